"""An engine's registration in etcd, for synchronous code (the vLLM connector's scheduler half).

:class:`EngineRegistrar` owns a daemon thread running a private asyncio loop with one
:class:`~kvstore.cluster.etcd.EngineRegistration`: the engine's
:class:`~kvstore.cluster.state.EngineRecord` lives under ``engines/<engine_id>`` on a lease
for as long as the engine runs, and drops out with the lease when the engine dies.  Nothing
here ever blocks or fails the engine on etcd: :meth:`EngineRegistrar.start` returns at once
and the record is written when etcd answers (a warning is logged once while it does not);
:meth:`EngineRegistrar.close` revokes the lease within a bounded time.

Readers (a request scheduler) watch the records through
:class:`~kvstore.cluster.membership.Membership`: ``Membership(endpoints, cluster).start()
.snapshot().engines`` maps each live engine's id to its record.

The loop thread owns the registration; other threads only read ``registered`` and
``lease_id`` (single references) and ask it to stop (``call_soon_threadsafe``).
"""

from __future__ import annotations

import asyncio
import logging
import threading

from kvstore.cluster.etcd import EngineRegistration
from kvstore.cluster.state import EngineRecord, parse_target

log = logging.getLogger("kvstore.cluster.engines")


class EngineRegistrar:
    """Keeps ``record`` registered in the cluster of ``target`` (``etcd://HOST:PORT/CLUSTER``)
    from :meth:`start` to :meth:`close`; see the module docstring."""

    def __init__(self, target: str, record: EngineRecord, *, ttl_s: float = 10.0, timeout: float = 2.0) -> None:
        endpoints, cluster = parse_target(target)
        self.target = target
        self.registration = EngineRegistration(endpoints, cluster, record, ttl_s=ttl_s, timeout=timeout)
        self.deregistered = False  # close() revoked the lease
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._close_timeout = timeout

    @property
    def record(self) -> EngineRecord:
        """The record as last written (``started_at`` set once registered)."""
        return self.registration.record

    @property
    def lease_id(self) -> int | None:
        return self.registration.lease_id

    @property
    def registered(self) -> bool:
        """Whether the record is on a lease etcd granted (it may have expired since, while etcd is away)."""
        return self.registration.lease_id is not None

    def start(self) -> EngineRegistrar:
        """Start the registration thread; returns at once, whether etcd answers or not."""
        if self._thread is not None:
            return self
        self._thread = threading.Thread(target=self._main, name=f"kvstore-engine-{self.registration.name}", daemon=True)
        self._thread.start()
        self._started.wait()
        return self

    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        try:
            loop.run_until_complete(self._serve())
        except Exception:  # never the engine's problem: the record then drops out with its lease
            log.exception("engine registration of %s stopped", self.registration.name)
        finally:
            self._started.set()  # in case _serve failed before it
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        task = asyncio.ensure_future(self.registration.run())
        self._started.set()
        try:
            await self._stop.wait()
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            self.deregistered = await self.registration.deregister(timeout=self._close_timeout)
            await self.registration.close()

    def close(self, timeout: float = 2.0) -> bool:
        """Revoke the lease (the record goes at once) and stop the thread, waiting at most about
        ``timeout`` s for etcd.  True if the lease was revoked; otherwise the record goes when
        the lease expires."""
        loop, stop, thread = self._loop, self._stop, self._thread
        if thread is None:
            return False
        self._thread = None
        self._close_timeout = timeout
        if loop is not None and stop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(stop.set)
            except RuntimeError:  # the loop closed meanwhile
                pass
        thread.join(timeout + self.registration.session.timeout + 1.0)
        return self.deregistered

    def __enter__(self) -> EngineRegistrar:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

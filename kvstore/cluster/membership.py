"""A watched view of one cluster, usable from synchronous code.

:class:`Membership` owns a daemon thread running a private asyncio loop with a
:class:`~kvstore.cluster.etcd.ClusterWatcher`.  The latest
:class:`~kvstore.cluster.state.ClusterSnapshot` is swapped in whole (an immutable value
behind one reference), so readers on any thread take ``snapshot()`` without locks and
always see one etcd revision.  A condition variable lets callers wait for a predicate.

When etcd is unreachable the last snapshot stays (``connected=False``).  If etcd comes
back empty (it lost its state) the node list may be empty until nodes re-register;
``routing_nodes()`` then answers with the last non-empty node set, so clients keep
routing on the last membership they saw.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any, TypeVar

from kvstore.cluster.etcd import ClusterStore, ClusterWatcher
from kvstore.cluster.state import ClusterSnapshot, NodeInfo, check_cluster_name, parse_endpoints
from kvstore.errors import Unavailable

T = TypeVar("T")


class Membership:
    def __init__(
        self,
        endpoints: str,
        cluster: str,
        *,
        timeout: float = 2.0,
        on_change: Callable[[ClusterSnapshot], None] | None = None,
    ) -> None:
        parse_endpoints(endpoints)
        self.endpoints = endpoints
        self.cluster = check_cluster_name(cluster)
        self.timeout = timeout
        self._on_change = on_change
        self._snap = ClusterSnapshot(cluster)
        self._last_nodes: Mapping[str, NodeInfo] = {}
        self._cond = threading.Condition()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._task: asyncio.Task[None] | None = None
        self._store: ClusterStore | None = None
        self._watcher: ClusterWatcher | None = None

    # -- lifecycle ------------------------------------------------------------------------
    def start(self, wait: float = 10.0) -> Membership:
        """Start watching; wait up to ``wait`` s for the first load (Unavailable if etcd never answers)."""
        if self._thread is not None:
            return self
        ready = threading.Event()

        def main() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            self._watcher = ClusterWatcher(self.endpoints, self.cluster, self._publish, timeout=self.timeout)
            self._store = ClusterStore(self.endpoints, self.cluster, timeout=self.timeout)
            self._task = loop.create_task(self._watcher.run())
            ready.set()
            try:
                loop.run_until_complete(self._task)
            except asyncio.CancelledError:
                pass
            finally:
                loop.run_until_complete(self._watcher.close())
                loop.run_until_complete(self._store.close())
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()

        self._thread = threading.Thread(target=main, name=f"kvstore-membership-{self.cluster}", daemon=True)
        self._thread.start()
        ready.wait()
        if wait > 0 and self.wait_for(lambda s: s.loaded, wait) is None:
            self.close()
            raise Unavailable(f"cannot reach etcd at {self.endpoints} (cluster {self.cluster!r}) within {wait:.0f} s")
        return self

    def close(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        self._thread = None
        if self._task is not None:
            loop.call_soon_threadsafe(self._task.cancel)
        thread.join(timeout=10)

    def __enter__(self) -> Membership:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the view -----------------------------------------------------------------------------
    def _publish(self, snap: ClusterSnapshot) -> None:
        if self._on_change is not None:  # before waiters wake: they may rely on what it records
            self._on_change(snap)
        with self._cond:
            self._snap = snap
            if snap.nodes:
                self._last_nodes = snap.nodes
            self._cond.notify_all()

    def snapshot(self) -> ClusterSnapshot:
        return self._snap

    def routing_nodes(self) -> Mapping[str, NodeInfo]:
        """Live nodes to route over: the snapshot's, or the last non-empty set if it is empty."""
        snap = self._snap
        return snap.nodes if snap.nodes else self._last_nodes

    def wait_for(self, pred: Callable[[ClusterSnapshot], bool], timeout: float) -> ClusterSnapshot | None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not pred(self._snap):
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            return self._snap

    # -- etcd writes through the view's loop ----------------------------------------------------
    def call(self, fn: Callable[[ClusterStore], Awaitable[T]], timeout: float | None = None) -> T:
        """Run ``fn(store)`` on the membership loop (e.g. ``lambda s: s.bump_epoch(fp)``)."""
        loop, store = self._loop, self._store
        if loop is None or store is None or self._thread is None:
            raise Unavailable("membership view is closed")
        coro: Coroutine[Any, Any, T] = fn(store)  # type: ignore[assignment]  # an async def's Awaitable
        fut = asyncio.run_coroutine_threadsafe(coro, loop)
        try:
            return fut.result(timeout if timeout is not None else self.timeout * 3 + 1)
        except TimeoutError:
            fut.cancel()
            raise Unavailable(f"etcd at {self.endpoints} did not answer in time") from None

    def submit(self, fn: Callable[[ClusterStore], Awaitable[T]]) -> concurrent.futures.Future[T]:
        """Start ``fn(store)`` on the membership loop without waiting (fire and forget, or ``.result()``)."""
        loop, store = self._loop, self._store
        if loop is None or store is None or self._thread is None:
            raise Unavailable("membership view is closed")
        return asyncio.run_coroutine_threadsafe(fn(store), loop)  # type: ignore[arg-type]

    def run_async(self, fn: Callable[[ClusterStore], Awaitable[T]]) -> asyncio.Future[T]:
        """Like :meth:`call`, awaitable from another event loop (call it from that loop)."""
        return asyncio.wrap_future(self.submit(fn))

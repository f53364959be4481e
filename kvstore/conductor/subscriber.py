"""Follows one vLLM engine's KV event publisher into the conductor's cache index.

:class:`KVEventSubscriber` owns one daemon thread per publisher, and that thread owns its
ZMQ sockets; it decodes each batch (:mod:`kvstore.conductor.kvevents`) and writes the
:class:`~kvstore.conductor.cacheindex.FleetCacheIndex` a batch at a time.  The replay
(ROUTER) socket and the sequence rules are described on the class.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import zmq

from kvstore.conductor.cacheindex import FleetCacheIndex
from kvstore.conductor.kvevents import END_SEQ, decode_batch
from kvstore.errors import InvalidArgument

log = logging.getLogger("kvstore.conductor")


class KVEventSubscriber:
    """Follows one engine's publisher into ``index`` on a daemon thread of its own.

    ``endpoint``: the PUB socket to connect to (``tcp://host:5557``; vLLM binds
    ``tcp://*:5557``); ``replay``: its replay (ROUTER) endpoint, or None; ``block_size``:
    given, the engine is added to the index here (else it must have been added).

    Sequence numbers must follow one another.  A gap (batches missed), a number that goes
    back (the publisher restarted) or a lost connection clear the engine's view first (a
    missed batch may have removed blocks); then, with ``replay``, the subscriber asks for
    the batches from the first one missed (from 0 after a restart) and applies them onto
    the empty view: blocks stored since come back, older ones are not credited until stored
    again.  With ``history``, the first batch heard on a connection brings the whole replay
    buffer first (a conductor that starts after its engines learns what they held; asked
    only once the subscription is live, so that no batch falls between the replay and the
    stream; an engine that publishes nothing is credited with nothing until it does).  A
    replay that goes silent for ``replay_timeout_s`` is given up.

    Read from any thread: ``connected``, ``last_event_at`` (``time.monotonic()`` of the last
    batch, None before one), ``batches``, ``events``, ``resyncs`` (views dropped for a gap,
    a restart or a lost connection), ``errors`` (batches that did not decode).  ``close()``
    stops the thread (joined within ``timeout``) and removes the engine from the index."""

    def __init__(
        self,
        engine_id: str,
        endpoint: str,
        index: FleetCacheIndex,
        *,
        replay: str | None = None,
        block_size: int | None = None,
        topic: str = "",
        history: bool = True,
        replay_timeout_s: float = 1.0,
        heartbeat_s: float = 2.0,
    ) -> None:
        if block_size is not None:
            index.add_engine(engine_id, block_size)
        elif engine_id not in index.engines():
            raise InvalidArgument(f"engine {engine_id!r} is not in the index: add it first or pass block_size")
        self.engine_id, self.endpoint, self.index = engine_id, endpoint, index
        self.replay, self.history, self.replay_timeout_s = replay or None, history, replay_timeout_s
        self.connected = False
        self.last_event_at: float | None = None
        self.batches = self.events = self.resyncs = self.errors = 0
        self._expected: int | None = None  # the next seq for an unbroken stream (None: none yet)
        self._dup_from: int | None = None  # live batches from here to _expected came by replay already
        self._fresh = True  # no batch heard on this connection yet
        self._stop = threading.Event()
        self._ctx: zmq.Context[Any] = zmq.Context.instance()
        # made here so that a bad endpoint fails the caller; then the thread alone uses them
        self._sub = self._ctx.socket(zmq.SUB)
        try:
            self._sub.setsockopt(zmq.LINGER, 0)
            self._sub.setsockopt(zmq.RCVHWM, 100_000)
            if heartbeat_s > 0:  # a peer gone without a FIN still shows as a disconnect
                self._sub.setsockopt(zmq.HEARTBEAT_IVL, int(heartbeat_s * 1000))
                self._sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(heartbeat_s * 3000))
            self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
            self._mon = self._sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
            self._sub.connect(endpoint)
        except zmq.ZMQError as e:
            self._sub.close(linger=0)
            if block_size is not None:
                index.remove_engine(engine_id)
            raise InvalidArgument(f"KV events endpoint {endpoint!r}: {e}") from None
        self._thread = threading.Thread(target=self._run, name=f"kvevents-{engine_id}", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 1.0) -> None:
        self._stop.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("engine %s: KV events thread did not stop within %.1f s", self.engine_id, timeout)
        self.index.remove_engine(self.engine_id)

    # -- the thread
    def _run(self) -> None:
        from zmq.utils.monitor import recv_monitor_message

        poller = zmq.Poller()
        poller.register(self._sub, zmq.POLLIN)
        poller.register(self._mon, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                try:
                    self._step(poller, recv_monitor_message)
                except Exception:  # the view is dropped, never left half-true
                    log.exception("engine %s: KV events failed: its cache view is cleared", self.engine_id)
                    self._drop("a batch failed")
                    self._stop.wait(0.1)
        finally:
            self.connected = False
            self.index.clear(self.engine_id)
            self._sub.disable_monitor()
            self._mon.close(linger=0)
            self._sub.close(linger=0)

    def _step(self, poller: zmq.Poller, recv_monitor_message: Any) -> None:
        ready = dict(poller.poll(100))
        while self._mon in ready and self._mon.poll(0):
            self._on_monitor(int(recv_monitor_message(self._mon)["event"]))
        for _ in range(1000):  # then look at the monitor again
            if self._stop.is_set() or not self._sub.poll(0):
                return
            self._on_live(self._sub.recv_multipart(zmq.NOBLOCK))

    def _on_monitor(self, event: int) -> None:
        if event == zmq.EVENT_CONNECTED:
            self.connected = True
            self._fresh = True
        elif event == zmq.EVENT_DISCONNECTED:
            self.connected = False
            self._drop("the publisher disconnected")

    def _on_live(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.errors += 1
            self._drop(f"a message of {len(frames)} frames")
            return
        seq = int.from_bytes(frames[1], "big")
        if self._fresh:  # the first batch heard on a connection: the subscription is live now
            self._fresh = False
            if self.history and self.replay:
                self._drop("", count=False)
                self._replay_from(0)
        exp = self._expected
        if exp is not None and seq != exp:
            if seq < exp and self._dup_from is not None and seq >= self._dup_from:
                return  # a replay brought it already
            restart = seq < exp
            self._drop("the publisher restarted" if restart else f"{seq - exp} batches missed")
            if self.replay:
                self._replay_from(0 if restart else exp)
                exp = self._expected
                if exp is not None and seq < exp:
                    return
                if exp is not None and seq > exp:
                    self._drop(f"{seq - exp} batches missed and not replayed")
        self._dup_from = None
        self._take(seq, frames[2])

    def _take(self, seq: int, payload: bytes) -> None:
        self._expected = seq + 1
        try:
            batch = decode_batch(payload)
        except InvalidArgument as e:
            self.errors += 1
            self.index.clear(self.engine_id)
            log.warning("engine %s: %s: its cache view is cleared", self.engine_id, e)
            return
        self.index.apply(self.engine_id, batch.events)
        self.batches += 1
        self.events += len(batch.events)
        self.last_event_at = time.monotonic()

    def _drop(self, why: str, *, count: bool = True) -> None:
        self.index.clear(self.engine_id)
        self._expected = None
        if count:
            self.resyncs += 1
            log.info("engine %s: %s: its cache view is cleared", self.engine_id, why)

    def _replay_from(self, start: int) -> None:
        """Apply the publisher's buffered batches from ``start`` on (onto the view as it is)."""
        assert self.replay is not None
        sock = self._ctx.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 0)  # the ROUTER drops what does not fit: let it all fit
            sock.connect(self.replay)
            sock.send_multipart([b"", start.to_bytes(8, "big")], zmq.NOBLOCK)
            self._dup_from = start
            quiet_until = time.monotonic() + self.replay_timeout_s
            while not self._stop.is_set():
                if not sock.poll(100):
                    if time.monotonic() > quiet_until:
                        log.info("engine %s: no replay from %s: going on without", self.engine_id, self.replay)
                        return
                    continue
                frames = sock.recv_multipart()
                quiet_until = time.monotonic() + self.replay_timeout_s
                if len(frames) != 4 or frames[2] == END_SEQ:
                    return
                seq = int.from_bytes(frames[2], "big")
                exp = self._expected
                if exp is not None and seq < exp:
                    continue
                if exp is not None and seq > exp:  # the replay lost some itself
                    self._drop(f"the replay skipped {seq - exp} batches")
                self._take(seq, frames[3])
        except zmq.ZMQError as e:
            log.info("engine %s: replay from %s failed (%s): going on without", self.engine_id, self.replay, e)
        finally:
            sock.close(linger=0)

"""The node's event-loop watchdog: says when, for how long and where the loop was blocked.

Every RPC of a node is served on one asyncio loop (the tier manager's owner).  A call that
blocks it — a synchronous pass over a large arena, a slow disk, a starved core — delays
every caller at once, and they see only ``DEADLINE_EXCEEDED``.  :class:`LoopWatch` makes
that visible from inside the node:

* a heartbeat task on the loop stamps :func:`time.monotonic` every ``interval_s``;
* a daemon thread (not on the loop, so it runs while the loop is stuck in code that
  releases the GIL) checks the stamp; once it is ``stall_s`` old it writes the loop
  thread's current stack to the log (the code holding the loop, once per stall), and when
  the loop beats again it logs the stall's length and counts it: ``loop_stalls`` and ``loop_stalled_ms`` (their total
  length) in the node's counters (``Stats``, ``/metrics``).

Owned by the node server (:class:`kvstore.node.server.Node`): started with the loop's
other tasks, stopped before the loop closes.  The counters dict is the tier manager's;
only the heartbeat (on the loop) writes to it, so the manager's single-owner rule holds.

A stall in which something holds the GIL (a C extension that does not release it) stops
the thread too: its stack is then written as the stall ends, and shows where the loop
thread was waiting for the GIL, not the holder.  For those, the heartbeat also keeps
:func:`faulthandler.dump_traceback_later` armed (re-armed about once a second, ``dump_s``
ahead): CPython's own watchdog thread needs no GIL, so a loop that has not beaten for
``dump_s`` gets **every** thread's stack written to standard error (the node's log, after a
``Timeout (0:00:06)!`` line), the GIL's holder among them.  faulthandler has one such timer
per process: ``dump_s=None`` leaves it alone (an embedding process that uses it).
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import sys
import threading
import time
import traceback
from collections import Counter

log = logging.getLogger("kvstore.node.loopwatch")

INTERVAL_S = 0.1
"""How often the loop stamps its heartbeat."""
STALL_S = 1.0
"""A loop that has not stamped for this long is stalled: its stack is written to the log."""
DUMP_S = 5.0
"""A loop that has not stamped for this long has every thread's stack written by faulthandler."""


class LoopWatch:
    """A heartbeat on ``loop`` and a thread that reports when it stops (see the module doc).

    ``counters``: where ``loop_stalls`` (stalls of at least ``stall_s``) and
    ``loop_stalled_ms`` (their total length) are counted, from the loop's thread.  ``dump_s``:
    after how long a stall has all threads' stacks written by faulthandler (None: never)."""

    def __init__(
        self,
        counters: Counter[str],
        *,
        interval_s: float = INTERVAL_S,
        stall_s: float = STALL_S,
        dump_s: float | None = DUMP_S,
    ) -> None:
        if not 0 < interval_s < stall_s:
            raise ValueError(f"need 0 < interval_s < stall_s, got {interval_s} and {stall_s}")
        if dump_s is not None and dump_s < 2 * stall_s:
            raise ValueError(f"need dump_s >= 2 * stall_s (a dump is for long stalls), got {dump_s} and {stall_s}")
        self.dump_s = dump_s
        self._armed = 0.0  # when the heartbeat last armed faulthandler's timer
        self.counters = counters
        self.interval_s = interval_s
        self.stall_s = stall_s
        self._beat = time.monotonic()  # written by the loop, read by the thread (a float: atomic)
        self._loop_thread: int | None = None
        self._task: asyncio.Task[None] | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._reported = 0.0  # the beat whose stall the thread reported (one stack per stall)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the heartbeat on ``loop`` (call from the loop's thread) and the watching thread."""
        self._loop_thread = threading.get_ident()
        self._beat = time.monotonic()
        self._task = loop.create_task(self._heartbeat(), name="loopwatch")
        self._thread = threading.Thread(target=self._watch, name="kvstore-loopwatch", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Stop both (on the loop's thread); idempotent."""
        self._stop.set()
        if self.dump_s is not None:
            faulthandler.cancel_dump_traceback_later()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval_s + 1.0)
            self._thread = None

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            now = time.monotonic()
            gap = now - self._beat
            self._beat = now
            # re-arming starts a new C thread: about once a second, not every beat
            if self.dump_s is not None and now - self._armed >= self.stall_s:
                faulthandler.dump_traceback_later(self.dump_s + self.stall_s, repeat=False)
                self._armed = now
            if gap >= self.stall_s:
                self.counters["loop_stalls"] += 1
                self.counters["loop_stalled_ms"] += int(gap * 1000)
                log.warning("the node's event loop was blocked for %.2f s: every call waited that long", gap)

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s):
            beat = self._beat
            if time.monotonic() - beat < self.stall_s or beat == self._reported:
                continue
            self._reported = beat
            frame = sys._current_frames().get(self._loop_thread or -1)
            where = "".join(traceback.format_stack(frame)) if frame is not None else "(no frame)\n"
            log.warning(
                "the node's event loop has been blocked for over %.1f s; it is running:\n%s", self.stall_s, where
            )

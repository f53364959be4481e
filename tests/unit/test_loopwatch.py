"""The node's event-loop watchdog (kvstore.node.loopwatch) on a real loop and thread."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import textwrap
import time
from collections import Counter

import pytest

from kvstore.node.loopwatch import LoopWatch


def _hold_the_loop_without_yielding(seconds: float) -> None:
    time.sleep(seconds)  # what a synchronous pass over a large arena does to every caller


def test_a_blocked_loop_is_counted_and_the_code_holding_it_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    counters: Counter[str] = Counter()

    async def main() -> None:
        watch = LoopWatch(counters, interval_s=0.02, stall_s=0.3)
        watch.start(asyncio.get_running_loop())
        await asyncio.sleep(0.2)  # a healthy loop: nothing counted
        assert counters["loop_stalls"] == 0
        _hold_the_loop_without_yielding(0.8)
        await asyncio.sleep(0.2)  # the heartbeat runs again and counts the stall
        await watch.stop()
        await watch.stop()  # idempotent

    with caplog.at_level(logging.WARNING, logger="kvstore.node.loopwatch"):
        asyncio.run(main())
    assert counters["loop_stalls"] == 1
    assert 700 <= counters["loop_stalled_ms"] < 3000, counters
    text = caplog.text
    # the thread wrote the stack while the loop was still blocked: the blocking function is in it
    assert "has been blocked for over 0.3 s" in text and "_hold_the_loop_without_yielding" in text, text
    assert text.count("it is running") == 1  # one stack per stall
    assert "was blocked for 0.8" in text or "was blocked for 0.9" in text or "was blocked for 1." in text, text


def test_the_intervals_are_checked() -> None:
    with pytest.raises(ValueError, match="interval_s < stall_s"):
        LoopWatch(Counter(), interval_s=1.0, stall_s=0.5)


_GIL_HOLDER = textwrap.dedent(
    """
    import asyncio, sys, time
    from collections import Counter
    from kvstore.node.loopwatch import LoopWatch

    def _hold_the_gil_in_the_loop(seconds):
        sys.setswitchinterval(100)  # no other thread gets the GIL: a C extension that never releases it
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pass
        sys.setswitchinterval(0.005)

    async def main():
        counters = Counter()
        watch = LoopWatch(counters, interval_s=0.02, stall_s=0.2, dump_s=0.6)
        watch.start(asyncio.get_running_loop())
        await asyncio.sleep(0.5)
        _hold_the_gil_in_the_loop(2.0)
        await asyncio.sleep(0.2)
        await watch.stop()
        print("stalls", counters["loop_stalls"], flush=True)

    asyncio.run(main())
    """
)


def test_a_stall_that_holds_the_gil_has_every_threads_stack_written_from_c() -> None:
    """The watching thread cannot run while the GIL is held; faulthandler's C thread can."""
    r = subprocess.run([sys.executable, "-c", _GIL_HOLDER], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "stalls 1" in r.stdout, r.stdout
    # written while the GIL was still held: the holder's frame is in the dump
    assert "Timeout (0:00:00.800000)!" in r.stderr and "_hold_the_gil_in_the_loop" in r.stderr, r.stderr
    assert r.stderr.count("Timeout (") == 1, r.stderr  # the timer was cancelled at stop: no dump after


def test_a_dump_is_for_long_stalls_only() -> None:
    with pytest.raises(ValueError, match="dump_s >= 2"):
        LoopWatch(Counter(), interval_s=0.1, stall_s=1.0, dump_s=1.5)

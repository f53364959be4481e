"""The node's event-loop watchdog (kvstore.node.loopwatch) on a real loop and thread."""

from __future__ import annotations

import asyncio
import logging
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

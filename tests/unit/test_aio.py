"""kvstore.aio: cancelling tasks that swallow a cancellation, and a node that stops on
SIGTERM whatever its cluster tasks do."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvstore.aio import bounded, cancel_and_wait


def test_a_task_that_swallows_one_cancellation_is_cancelled_again_and_ends() -> None:
    """Python 3.11's wait_for can lose a cancellation; the stop must not wait for ever."""

    async def swallows_once() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            pass  # lost, as wait_for loses it when its result arrives with the cancel
        await asyncio.sleep(3600)  # awaits on: only a second cancellation ends it

    async def go() -> None:
        t = asyncio.create_task(swallows_once())
        plain = asyncio.create_task(asyncio.sleep(3600))
        failed = asyncio.create_task(asyncio.sleep(0))
        await asyncio.sleep(0.01)
        assert await asyncio.wait_for(cancel_and_wait([t, plain, failed], timeout=10.0), 20.0) == set()
        assert t.cancelled() and plain.cancelled() and failed.done()

    asyncio.run(go())


def test_a_task_that_never_ends_is_returned_after_the_timeout() -> None:
    deaf = True

    async def never() -> None:
        while deaf:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                continue

    async def go() -> None:
        nonlocal deaf
        t = asyncio.create_task(never())
        await asyncio.sleep(0.01)
        assert await asyncio.wait_for(cancel_and_wait([t], timeout=0.3), 20.0) == {t}
        assert not t.done()
        deaf = False  # let it end, so the loop can close
        t.cancel()
        await asyncio.wait([t])

    asyncio.run(go())


class _Stubborn:
    """A call that does not end on cancellation (as a gRPC call on a bad channel may not),
    until the test lets it: asyncio.run would otherwise wait for it for ever at its end."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.task: asyncio.Task[None] | None = None
        self.released = False

    async def call(self) -> None:
        self.task = asyncio.current_task()
        while not self.released:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.log.append("cancelled")

    async def release(self) -> None:
        self.released = True
        if self.task is not None and not self.task.done():
            self.task.cancel()
            await asyncio.wait({self.task})


def test_bounded_gives_up_on_a_call_that_ignores_its_cancellation() -> None:
    """Regression (a thousand-node membership test hung 300 s in ``wait_for``): past its
    timeout a call is cancelled, given GIVE_UP_S, and left; the caller gets TimeoutError."""

    async def go() -> tuple[float, list[str]]:
        s = _Stubborn()
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            await bounded(s.call(), 0.05)
        took = time.monotonic() - t0
        assert s.task is not None and not s.task.done()  # left behind, still running
        await s.release()
        return took, s.log

    took, log = asyncio.run(asyncio.wait_for(go(), 30))
    assert log and log[0] == "cancelled"
    assert took < 10  # a hang guard, not a timing claim: it returned instead of waiting for ever


def test_bounded_returns_results_and_raises_the_calls_errors() -> None:
    async def ok() -> int:
        await asyncio.sleep(0)
        return 7

    async def bad() -> None:
        raise ValueError("from the call")

    async def go() -> int:
        with pytest.raises(ValueError, match="from the call"):
            await bounded(bad(), 5)
        return await bounded(ok(), 5)

    assert asyncio.run(go()) == 7


def test_a_caller_cancelled_in_bounded_cancels_its_call() -> None:
    async def go() -> list[str]:
        s = _Stubborn()
        outer = asyncio.ensure_future(bounded(s.call(), 3600))
        await asyncio.sleep(0.01)
        outer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await outer
        await s.release()
        return s.log

    assert asyncio.run(asyncio.wait_for(go(), 30))[:1] == ["cancelled"]

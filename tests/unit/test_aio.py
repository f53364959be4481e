"""kvstore.aio: cancelling tasks that swallow a cancellation, and a node that stops on
SIGTERM whatever its cluster tasks do."""

from __future__ import annotations

import asyncio

from kvstore.aio import cancel_and_wait


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

"""Asyncio helpers shared by the node and the SDK.

Owns no state.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable
from typing import Any, TypeVar

T = TypeVar("T")


async def await_to_the_end(fut: asyncio.Future[Any]) -> Any:
    """Await ``fut`` (a thread's work); if the caller is cancelled meanwhile, wait for it to
    end before re-raising the cancellation.

    A thread cannot be stopped, and the work it does may read or write memory (arena
    extents) that the cancelled caller gives back as it unwinds, and that another block may
    get at once: unwinding first would let the thread write into someone else's bytes.
    The work's own exception, if any, is retrieved and dropped: the caller's cancellation is
    what propagates.
    """
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        while not fut.done():
            try:
                await asyncio.wait([fut])
            except asyncio.CancelledError:
                pass
        if not fut.cancelled():
            fut.exception()
        raise


CANCEL_AGAIN_S = 0.5
"""How long :func:`cancel_and_wait` gives a cancelled task before cancelling it again."""


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any]], *, timeout: float = 3.0) -> set[asyncio.Task[Any]]:
    """Cancel ``tasks`` and wait for them to end, at most ``timeout`` s; the ones still
    running (returned: the caller logs them) are left cancelled.

    A task can swallow a cancellation: Python 3.11's ``asyncio.wait_for`` returns the
    awaited result when it and the cancellation arrive together, and the task then awaits
    on, for ever.  So a task still running ``CANCEL_AGAIN_S`` after its cancellation is
    cancelled again, and a stop never waits without bound (a node that did not exit on
    SIGTERM, found so).  The ended tasks' exceptions are retrieved and dropped."""
    tasks = list(tasks)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    pending = {t for t in tasks if not t.done()}
    while pending:
        for t in pending:
            t.cancel()
        left = deadline - loop.time()
        if left <= 0:
            break
        _, pending = await asyncio.wait(pending, timeout=min(CANCEL_AGAIN_S, left))
    for t in tasks:
        if t.done() and not t.cancelled():
            t.exception()
    return pending


GIVE_UP_S = 1.0
"""How long :func:`bounded` waits for a timed-out call to end after cancelling it."""


async def bounded(aw: Awaitable[T], timeout: float) -> T:
    """``asyncio.wait_for(aw, timeout)`` that never waits past ``timeout + GIVE_UP_S``.

    Python 3.11's ``wait_for`` cancels a call that timed out and then waits, without bound,
    for it to end: a call that does not end on cancellation (a gRPC call on a channel that
    went bad) holds its caller for ever.  Here the call runs as a task of its own; past
    ``timeout`` it is cancelled (again, as :func:`cancel_and_wait` does) for at most
    ``GIVE_UP_S``, then left behind, and :class:`TimeoutError` is raised either way.  A
    caller cancelled meanwhile cancels the call the same way and re-raises."""
    task = asyncio.ensure_future(aw)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout)
    except asyncio.CancelledError:
        await cancel_and_wait([task], timeout=GIVE_UP_S)
        raise
    if done:
        return task.result()
    await cancel_and_wait([task], timeout=GIVE_UP_S)
    raise TimeoutError(f"no answer in {timeout:g} s")

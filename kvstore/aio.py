"""Asyncio helpers shared by the node and the SDK.

Owns no state.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any


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

"""Asyncio helpers shared by the node and the SDK.

Owns no state.
"""

from __future__ import annotations

import asyncio
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

"""Zero-copy access to the node's arena for code that moves bytes itself (the GPU agent).

``KVClient.acquire(keys)`` leases blocks and hands out *views* of their arena extents
(no copy at all: a CUDA copy engine can DMA from them once the arena is registered
as pinned memory); ``KVClient.reserve(...)`` hands out writable views of freshly
reserved extents that the caller fills before ``commit()``.  Both are context
managers: leaving the block releases the leases, or aborts an uncommitted
reservation, so nobody decrements anything by hand.  Local (``unix://``) targets only.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvstore.block import BlockMeta
from kvstore.shm import ArenaMapping
from kvstore.vocabulary import Extent


@dataclasses.dataclass
class LeasedBlocks:
    """Blocks held under read leases.  ``views[i]`` is None for a miss; else the block's
    extents as read-only memoryviews (usually one) into the shared arena.

    ``held_until`` (``time.monotonic()``): before it every lease is certainly still held,
    so bytes read from the views by then are the committed ones; ``release`` after that
    asks the node whether each lease outlived the read."""

    keys: Sequence[bytes]
    metas: list[BlockMeta | None]
    views: list[list[memoryview] | None]
    _release: Callable[[bool], list[bool]]
    held_until: float = float("inf")
    _done: bool = False
    valid: list[bool] = dataclasses.field(default_factory=list)

    def release(self) -> list[bool]:
        """Give the leases back; False for a lease that expired (its bytes are not to be
        trusted).  Called before ``held_until`` it does not wait for the node's answer
        (every lease was held throughout): no round trip on the caller's path."""
        if not self._done:
            self._done = True
            self.valid = self._release(time.monotonic() >= self.held_until)
        return self.valid

    def __enter__(self) -> LeasedBlocks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclasses.dataclass
class ReservedBlocks:
    """Space reserved for new blocks.  ``views[i]`` is None when the key is already
    stored (nothing to write) or the node had no room; else writable views to fill."""

    keys: Sequence[bytes]
    metas: list[BlockMeta]
    views: list[list[memoryview] | None]
    _commit: Callable[[list[int] | None], list[bool]]
    _abort: Callable[[], None]
    existed: list[bool] = dataclasses.field(default_factory=list)
    _done: bool = False

    def commit(self, checksums: Sequence[int] | None = None) -> list[bool]:
        """Publish the filled blocks; ``checksums`` (xxh3-64 per reserved key) if the metas had none."""
        self._done = True
        return self._commit(list(checksums) if checksums is not None else None)

    def abort(self) -> None:
        if not self._done:
            self._done = True
            self._abort()

    def __enter__(self) -> ReservedBlocks:
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        self.abort()  # no-op after commit


def views_of(arena: ArenaMapping, extents: list[Extent], nbytes: int, *, writable: bool) -> list[memoryview]:
    vs = arena.views(extents, nbytes)
    return vs if writable else [v.toreadonly() for v in vs]

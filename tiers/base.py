"""What a tier is: the typed protocol every storage tier (and every wrapper) implements.

A tier stores whole blocks (payload bytes plus their :class:`~kvstore.block.BlockMeta`)
under 16-byte chunk keys.  It owns its own key → location map, its allocator and its
eviction-policy instance; it knows nothing of leases, pins or other tiers (that is the
tier manager's job in ``kvstore/node/manager.py``).  A miss is a result, never an exception.

Eviction is split in two so the manager can demote a victim before it disappears:
``victims(can_evict)`` proposes keys in the policy's order, the manager copies what it
must keep, then calls ``delete(key)``.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol, runtime_checkable

from kvstore.block import BlockMeta
from kvstore.keys import ChunkKey
from kvstore.vocabulary import TierKind as TierKind  # re-exported: shared with the wire and the SDK


class MissReason(enum.Enum):
    NOT_PRESENT = "not_present"
    CORRUPT = "corrupt"


@dataclasses.dataclass(frozen=True, slots=True)
class ReadResult:
    """Outcome of one read: ``meta`` and ``nbytes`` on a hit, ``miss`` otherwise."""

    key: ChunkKey
    meta: BlockMeta | None = None
    nbytes: int = 0
    miss: MissReason | None = None

    @property
    def hit(self) -> bool:
        return self.miss is None


@runtime_checkable
class Tier(Protocol):
    """One storage tier.  Implementations document their own thread-safety."""

    kind: TierKind

    @property
    def capacity_bytes(self) -> int: ...

    @property
    def used_bytes(self) -> int: ...

    def __len__(self) -> int: ...

    def contains(self, key: ChunkKey) -> bool: ...

    def keys(self) -> list[ChunkKey]:
        """A snapshot of the stored keys."""
        ...

    def meta(self, key: ChunkKey) -> BlockMeta | None: ...

    def count_prefix(self, keys: Sequence[ChunkKey]) -> int:
        """How many of ``keys``, from the first, are present without a gap."""
        ...

    def write(self, meta: BlockMeta, payload: object) -> None:
        """Store a whole block (replacing any block under the same key).

        Raises ``CapacityExceeded`` when the block cannot fit even in an empty tier and
        ``InvalidArgument`` when the payload length contradicts ``meta``.  Never evicts:
        the manager makes room first.  ``payload`` is any contiguous buffer.
        """
        ...

    def read_into(self, key: ChunkKey, out: object) -> ReadResult:
        """Copy a block's payload into ``out`` (a writable buffer at least ``payload_len`` bytes)."""
        ...

    def delete(self, key: ChunkKey) -> bool: ...

    def fits(self, nbytes: int) -> bool:
        """True if a block of ``nbytes`` fits in the free space right now."""
        ...

    def victims(self, can_evict: Callable[[ChunkKey], bool] = lambda k: True) -> Iterator[ChunkKey]:
        """Candidate keys in eviction order, skipping those ``can_evict`` rejects.

        The caller deletes the ones it evicts while iterating; the ones it does not keep
        their place in the policy.
        """
        ...

    def close(self) -> None: ...


@runtime_checkable
class LowerTier(Tier, Protocol):
    """A tier below DRAM that the tier manager demotes blocks to and promotes them from
    (``kvstore/node/movers.py``): the NVMe tier and its wrappers.  Thread-safe: the manager
    calls the blocking methods (``write_many``, ``read_into``) from executor threads and the
    rest from its event loop."""

    corrupt_blocks: int
    """Blocks dropped because their bytes failed verification, since the tier opened."""

    def write_many(self, items: Sequence[tuple[BlockMeta, object]]) -> None:
        """Store blocks as one group commit, all or nothing (``CapacityExceeded`` or ``OSError``)."""
        ...

    def admit(self, key: ChunkKey, size: int) -> bool:
        """Whether the tier's admission filter takes a block of ``size`` bytes now."""
        ...

    def recovery(self) -> dict[str, int]:
        """What recovering the tier's index at open found (counts; zeros if nothing was recovered)."""
        ...


def count_prefix(tier: Tier, keys: Sequence[ChunkKey]) -> int:
    """Default ``count_prefix`` for tiers that only know ``contains``."""
    n = 0
    for k in keys:
        if not tier.contains(k):
            break
        n += 1
    return n


HoldingsHook = Callable[[ChunkKey, BlockMeta | None], None]
"""Told by a tier each time what it holds changes: ``(key, meta)`` when it starts holding
``key`` (or replaces its block), ``(key, None)`` when it stops.  Called inside the tier's
own critical section (the DRAM tier: on its owner's loop; the NVMe tier: under its
``_lock``), so the order of calls is the order of the changes; it must be cheap and must
not call back into the tier.  The node's holdings watch (``kvstore/node/watch.py``)."""


class TierWatch(Protocol):
    """Who occupies a tier, told by the tier as blocks come and go (``kvstore/node/quotas.py``).

    ``first`` orders eviction: keys it accepts are proposed before all others (see
    :func:`victims_first`); ``any_first`` says cheaply whether any key would be.
    """

    def stored(self, meta: BlockMeta, nbytes: int) -> None: ...

    def dropped(self, key: ChunkKey) -> None: ...

    def first(self, key: ChunkKey) -> bool: ...

    def any_first(self) -> bool: ...


def victims_first(
    victims: Callable[[Callable[[ChunkKey], bool]], Iterator[ChunkKey]],
    can_evict: Callable[[ChunkKey], bool],
    first: Callable[[ChunkKey], bool],
) -> Iterator[ChunkKey]:
    """A tier's ``victims(can_evict)`` in two rounds: the keys ``first`` accepts, in the
    policy's order, then the rest (each key proposed once)."""
    offered: set[ChunkKey] = set()
    for key in victims(lambda k: first(k) and can_evict(k)):
        offered.add(key)
        yield key
    yield from victims(lambda k: k not in offered and can_evict(k))

"""The DRAM tier: blocks in the node's shared-memory arena.

Owner: the tier manager's event loop.  Not thread-safe: every method runs on the
loop thread; only the byte copies into and out of extents (done by local clients,
the data channel or executor threads) happen elsewhere, on extents the manager
keeps alive with reservations and leases.

Besides the :class:`~tiers.base.Tier` protocol it offers the zero-copy two-phase
form the node serves to local clients: ``reserve`` space → the client copies into
the extents → ``commit`` (visible) or ``abort``; ``extents(key)`` for readers.
``detach`` takes a block out of the index without freeing its space, for blocks
deleted while a reader still holds a lease.

``watch`` (optional, ``tiers.base.TierWatch``) is told of every block stored and dropped,
with the bytes it occupies, and may move some keys to the front of eviction (the
per-tenant capacity quotas of ``kvstore/node/quotas.py``).

The manager's batch reads and commits reach the policy late (``touch_soon``,
``commit(policy_soon=True)``): on the loop's next turn, after the reply went out, so a batch's
policy updates overlap the client's copies; ``victims`` applies any still pending first, so
eviction never sees a stale order.

Invariants: ``used_bytes <= capacity_bytes`` always (the allocator cannot hand out
more); a key is in ``_blocks`` iff it is in the policy once pending updates are applied (and, with a ``watch``, iff the
watch was told it was stored and not yet that it was dropped).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Sequence

from kvstore.block import BlockMeta
from kvstore.errors import CapacityExceeded, InvalidArgument
from kvstore.keys import ChunkKey
from tiers.allocator import Extent, ExtentAllocator
from tiers.arena import Arena, as_bytes_view
from tiers.base import HoldingsHook, MissReason, ReadResult, TierKind, TierWatch, victims_first
from tiers.policy import DEFAULT_POLICY, EvictionPolicy, make_policy

DEFAULT_UNIT = 64 * 1024


class DRAMTier:
    kind = TierKind.DRAM

    def __init__(self, arena: Arena, *, policy: EvictionPolicy | None = None, unit: int = DEFAULT_UNIT) -> None:
        self.arena = arena
        self.allocator = ExtentAllocator(arena.size, unit)
        self.policy = policy if policy is not None else make_policy(DEFAULT_POLICY)
        self._blocks: dict[ChunkKey, tuple[BlockMeta, list[Extent]]] = {}
        self.watch: TierWatch | None = None
        self.holdings: HoldingsHook | None = None  # told of every key stored and dropped
        # policy updates not applied yet (touch_soon, commit(policy_soon=True)): see apply_policy
        self._pending: list[tuple[ChunkKey, BlockMeta | None]] = []

    # -- accounting -----------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self.allocator.capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self.allocator.used_bytes

    @property
    def stored_bytes(self) -> int:
        return sum(m.payload_len for m, _ in self._blocks.values())

    def __len__(self) -> int:
        return len(self._blocks)

    def keys(self) -> list[ChunkKey]:
        return list(self._blocks)

    def contains(self, key: ChunkKey) -> bool:
        return key in self._blocks

    def meta(self, key: ChunkKey) -> BlockMeta | None:
        b = self._blocks.get(key)
        return b[0] if b else None

    def entry(self, key: ChunkKey) -> tuple[BlockMeta, list[Extent]] | None:
        """``(meta, extents)`` of a stored block in one lookup; None if absent."""
        return self._blocks.get(key)

    def extents(self, key: ChunkKey) -> list[Extent] | None:
        b = self._blocks.get(key)
        return b[1] if b else None

    def count_prefix(self, keys: Sequence[ChunkKey]) -> int:
        n = 0
        for k in keys:
            if k not in self._blocks:
                break
            n += 1
        return n

    def fits(self, nbytes: int) -> bool:
        return self.allocator.free_bytes >= self.allocator.rounded(nbytes)

    def touch(self, key: ChunkKey) -> None:
        self.policy.access(key)

    def touch_soon(self, keys: Sequence[ChunkKey]) -> None:
        """``touch`` each of ``keys``, on the loop's next turn (after the reply that leased
        them went out: a batch read's policy updates then overlap the reader's copies), or
        before anything asks the policy for victims, whichever comes first."""
        self._later([(k, None) for k in keys])

    def _later(self, items: list[tuple[ChunkKey, BlockMeta | None]]) -> None:
        """Queue policy updates: ``(key, None)`` a read, ``(key, meta)`` the insert of the block
        ``commit(..., policy_soon=True)`` stored.  Without a running loop, applied now."""
        if not items:
            return
        first = not self._pending
        self._pending.extend(items)
        if first:
            try:
                asyncio.get_running_loop().call_soon(self.apply_policy)
            except RuntimeError:  # no loop (a tool, a test): at once
                self.apply_policy()

    def apply_policy(self) -> None:
        """Apply the policy updates queued by ``touch_soon`` and ``commit(policy_soon=True)``, in
        order; those of a block gone (or replaced) since are skipped."""
        items, self._pending = self._pending, []
        policy, blocks = self.policy, self._blocks
        for key, meta in items:
            b = blocks.get(key)
            if b is None:
                continue
            if meta is None:
                policy.access(key)
            elif b[0] is meta:
                policy.insert(key, meta.parent, meta.payload_len)

    # -- two-phase writes ---------------------------------------------------------
    def reserve(self, nbytes: int) -> list[Extent] | None:
        """Space for ``nbytes`` now, or ``None`` when the manager must evict first."""
        if self.allocator.rounded(nbytes) > self.capacity_bytes:
            raise CapacityExceeded(
                f"a {nbytes}-byte block cannot fit a DRAM tier of {self.capacity_bytes} bytes; raise --dram"
            )
        return self.allocator.allocate(nbytes)

    def reserve_many(self, sizes: Sequence[int]) -> list[list[Extent]] | None:
        """``reserve`` of each size at once (one allocator update per batch), or ``None``
        (nothing reserved) when the manager must evict first."""
        cap = self.capacity_bytes
        for n in sizes:
            if self.allocator.rounded(n) > cap:
                raise CapacityExceeded(f"a {n}-byte block cannot fit a DRAM tier of {cap} bytes; raise --dram")
        return self.allocator.allocate_many(sizes)

    def commit(self, meta: BlockMeta, extents: list[Extent], *, policy_soon: bool = False) -> None:
        """Make a reserved, filled block visible (replacing an older block under its key).
        ``policy_soon``: the policy hears of it on the loop's next turn (after the reply to a
        batch of commits), or before it is next asked for victims (``apply_policy``)."""
        old = self._blocks.pop(meta.key, None)
        if old is not None:
            self.policy.remove(meta.key)
            self.allocator.free(old[1])
            if self.watch is not None:
                self.watch.dropped(meta.key)
        self._blocks[meta.key] = (meta, extents)
        if policy_soon:
            self._later([(meta.key, meta)])
        else:
            self.policy.insert(meta.key, meta.parent, meta.payload_len)
        if self.watch is not None:
            self.watch.stored(meta, sum(e.length for e in extents))
        if self.holdings is not None:
            self.holdings(meta.key, meta)

    def abort(self, extents: list[Extent]) -> None:
        self.allocator.free(extents)

    def detach(self, key: ChunkKey) -> list[Extent] | None:
        """Remove ``key`` from the index but keep its space allocated; the caller frees it later."""
        b = self._blocks.pop(key, None)
        if b is None:
            return None
        self.policy.remove(key)
        if self.watch is not None:
            self.watch.dropped(key)
        if self.holdings is not None:
            self.holdings(key, None)
        return b[1]

    def free(self, extents: list[Extent]) -> None:
        self.allocator.free(extents)

    # -- Tier protocol ------------------------------------------------------------
    def write(self, meta: BlockMeta, payload: object) -> None:
        data = as_bytes_view(payload)
        if data.nbytes != meta.payload_len:
            raise InvalidArgument(f"payload has {data.nbytes} bytes, meta says {meta.payload_len}")
        extents = self.reserve(meta.payload_len)
        if extents is None:
            raise CapacityExceeded(f"DRAM tier has {self.allocator.free_bytes} free bytes; evict first")
        self.arena.write(extents, data)
        self.commit(meta, extents)

    def read_into(self, key: ChunkKey, out: object) -> ReadResult:
        b = self._blocks.get(key)
        if b is None:
            return ReadResult(key, miss=MissReason.NOT_PRESENT)
        meta, extents = b
        mv = as_bytes_view(out, writable=True)
        if mv.nbytes < meta.payload_len:
            raise InvalidArgument(f"output buffer holds {mv.nbytes} bytes; block has {meta.payload_len}")
        self.arena.read_into(extents, mv, meta.payload_len)
        self.policy.access(key)
        return ReadResult(key, meta=meta, nbytes=meta.payload_len)

    def delete(self, key: ChunkKey) -> bool:
        extents = self.detach(key)
        if extents is None:
            return False
        self.allocator.free(extents)
        return True

    def victims(
        self, can_evict: Callable[[ChunkKey], bool] = lambda k: True, *, by_policy: bool = False
    ) -> Iterator[ChunkKey]:
        """Keys to evict, in the policy's order; with a ``watch``, those it puts first
        before the others (``by_policy``: the policy's order alone)."""
        if self._pending:
            self.apply_policy()
        if not by_policy and self.watch is not None and self.watch.any_first():
            yield from victims_first(self._victims, can_evict, self.watch.first)
        else:
            yield from self._victims(can_evict)

    def _victims(self, can_evict: Callable[[ChunkKey], bool]) -> Iterator[ChunkKey]:
        for key in self.policy.victims():
            if can_evict(key):
                yield key

    def close(self) -> None:
        self._pending.clear()
        self._blocks.clear()
        self.arena.close()

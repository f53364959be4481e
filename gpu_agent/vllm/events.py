"""The connector's KV events: what the store now holds for a router to credit.

A saved run of chunks is one ``BlockStored`` whose ``parent_block_hash`` is the key of the
chunk before the run (``None`` only when the run starts the prompt), so a router can chain
it onto what it already knows.  Keys are the logical (rank-0) chunk keys, the same in every
worker, so vLLM's aggregator, which keeps the events every worker reported, keeps a run
only once every tensor-parallel rank stored its shard.  The medium is where the node put
the blocks: a save lands in the node's DRAM (``CPU``).  A failed load emits nothing: the
block may still be stored.  What the node does on its own (evicting, demoting to NVMe:
``STORAGE``) is found by :class:`StoredChunks` and reported within ``events_resync_s``.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable

from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
    KVEventAggregator,
)

from kvstore.keys import ChunkKey


class KVStoreEvents(KVConnectorKVEvents):
    """Blocks stored by the workers, aggregated over workers."""

    def __init__(self, num_workers: int = 1) -> None:
        self._agg = KVEventAggregator(num_workers)

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._agg.add_events(events)

    def aggregate(self) -> KVStoreEvents:
        common = self._agg.get_common_events()
        self._agg.clear_events()
        self._agg.add_events(common)
        self._agg.reset_workers()
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._agg.increment_workers(count)

    def get_all_events(self) -> list[KVCacheEvent]:
        return self._agg.get_all_events()

    def get_number_of_workers(self) -> int:
        return self._agg.get_number_of_workers()

    def clear_events(self) -> None:
        self._agg.clear_events()
        self._agg.reset_workers()


def stored_event(
    keys: list[ChunkKey], first: int, tokens: list[int], chunk: int, lora_name: str, medium: str = MEDIUM_CPU
) -> BlockStored | None:
    """The event for chunks ``keys[first:]`` of a chain (``tokens`` covers the whole chain)."""
    if first >= len(keys):
        return None
    return BlockStored(
        block_hashes=list(keys[first:]),
        parent_block_hash=keys[first - 1] if first > 0 else None,
        token_ids=list(tokens[first * chunk : len(keys) * chunk]),
        block_size=chunk,
        lora_id=None,
        medium=medium,
        lora_name=lora_name or None,
    )


TIER_MEDIUM = {"dram": MEDIUM_CPU, "nvme": MEDIUM_STORAGE, "hbm": MEDIUM_GPU}


@dataclasses.dataclass
class _Held:
    rank_keys: list[ChunkKey]  # the chunk's key on every tensor/pipeline rank
    parent: ChunkKey | None
    tokens: list[int]
    lora_name: str
    medium: str


class StoredChunks:
    """The chunks this engine reported stored, kept true (scheduler side).

    The node evicts and demotes blocks on its own; a router that heard ``BlockStored`` must
    hear of it.  Saves the scheduler issues are noted with every rank's key
    (:meth:`saving`); once the workers' ``BlockStored`` for a chunk arrives it is tracked
    (:meth:`stored`, at most ``limit`` chunks, the oldest dropped from tracking first), and
    every ``resync_s`` one ``Lookup`` of all tracked rank keys (:meth:`resync`) turns what
    changed into events: a chunk any rank lost is ``BlockRemoved``; one that moved tier (DRAM
    → NVMe) is removed from its old medium and stored in the new.  Lag: one ``resync_s``."""

    def __init__(self, resync_s: float, limit: int = 4096) -> None:
        self.resync_s, self.limit = resync_s, limit
        self._saving: OrderedDict[ChunkKey, list[ChunkKey]] = OrderedDict()
        self._held: OrderedDict[ChunkKey, _Held] = OrderedDict()
        self._next = 0.0

    def __len__(self) -> int:
        return len(self._held)

    def saving(self, chains: list[list[ChunkKey]], lo: int, hi: int) -> None:
        """Chunks ``[lo, hi)`` of a request whose save was issued; ``chains[r]`` is rank r's chain."""
        if self.resync_s <= 0:
            return
        for i in range(lo, hi):
            self._saving[chains[0][i]] = [c[i] for c in chains]
            self._saving.move_to_end(chains[0][i])
        while len(self._saving) > 2 * self.limit:  # saves that never reported: forgotten
            self._saving.popitem(last=False)

    def stored(self, ev: KVCacheEvent) -> None:
        """A ``BlockStored`` every worker reported: track its chunks."""
        if self.resync_s <= 0 or not isinstance(ev, BlockStored):
            return
        parent = ev.parent_block_hash
        for i, h in enumerate(ev.block_hashes):
            keys = self._saving.pop(h, None)  # type: ignore[call-overload]
            if keys is not None:
                toks = list(ev.token_ids[i * ev.block_size : (i + 1) * ev.block_size])
                self._held[h] = _Held(keys, parent, toks, ev.lora_name or "", ev.medium or MEDIUM_CPU)  # type: ignore[index]
                self._held.move_to_end(h)  # type: ignore[arg-type]
            parent = h
        while len(self._held) > self.limit:
            self._held.popitem(last=False)

    def due(self, now: float) -> bool:
        return self.resync_s > 0 and bool(self._held) and now >= self._next

    def resync(self, lookup: Callable[[list[ChunkKey]], list[str | None]], now: float) -> list[KVCacheEvent]:
        """Ask where every tracked chunk is now (``lookup``: the SDK's, one call); the events
        for what changed.  Raises what ``lookup`` raises (nothing is changed then)."""
        held, keys = self.begin_resync(now)
        return self.finish_resync(held, lookup(keys))

    def begin_resync(self, now: float) -> tuple[list[tuple[ChunkKey, _Held]], list[ChunkKey]]:
        """The chunks tracked now and every rank key of theirs, to look up (possibly on
        another thread) and hand to :meth:`finish_resync`."""
        self._next = now + self.resync_s
        held = list(self._held.items())
        return held, [k for _, h in held for k in h.rank_keys]

    def finish_resync(self, held: list[tuple[ChunkKey, _Held]], tiers: list[str | None]) -> list[KVCacheEvent]:
        """The events for what changed, from ``tiers`` of :meth:`begin_resync`'s keys; chunks
        no longer tracked since are left alone."""
        out: list[KVCacheEvent] = []
        pos = 0
        for key, h in held:
            where = tiers[pos : pos + len(h.rank_keys)]
            pos += len(h.rank_keys)
            if self._held.get(key) is not h:
                continue
            if any(t is None for t in where):
                out.append(BlockRemoved(block_hashes=[key], medium=h.medium))
                del self._held[key]
                continue
            medium = TIER_MEDIUM.get(str(where[0]), h.medium)
            if medium != h.medium:
                out.append(BlockRemoved(block_hashes=[key], medium=h.medium))
                out.append(
                    BlockStored(
                        block_hashes=[key],
                        parent_block_hash=h.parent,
                        token_ids=h.tokens,
                        block_size=len(h.tokens),
                        lora_id=None,
                        medium=medium,
                        lora_name=h.lora_name or None,
                    )
                )
                h.medium = medium
        return out

"""The connector's KV events: what the store now holds for a router to credit.

A saved run of chunks is one ``BlockStored`` whose ``parent_block_hash`` is the key of the
chunk before the run (``None`` only when the run starts the prompt), so a router can chain
it onto what it already knows.  Keys are the logical (rank-0) chunk keys, the same in every
worker, so vLLM's aggregator, which keeps the events every worker reported, keeps a run
only once every tensor-parallel rank stored its shard.  The medium is where the node put
the blocks: a save lands in the node's DRAM (``CPU``).  A failed load emits nothing: the
block may still be stored; the store's own eviction and demotion are not reported here.
"""

from __future__ import annotations

from vllm.distributed.kv_events import (
    MEDIUM_CPU,
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

"""Packed batches (``HelloResponse.packed_version``): the column format both sides read, and
the allocator and DRAM-tier pieces the batch paths use.

The columns must describe exactly the blocks the per-block ``BlockInfo`` messages describe
(``metas_from_packed(metas_to_packed(ms)) == ms``), and a node must refuse columns that
disagree or a block ``BlockMeta`` itself would refuse, with ``InvalidArgument``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import struct
import uuid
from collections.abc import Iterator

import pytest

from kvstore.block import BlockMeta
from kvstore.errors import InvalidArgument
from kvstore.keys import NO_PARENT, ChunkKey
from kvstore.wire import keys_from_packed, meta_from_pb, meta_to_pb, metas_from_packed, metas_to_packed, with_checksum
from protos.kvstore.v1 import kvstore_pb2 as pb
from tiers.allocator import Extent, ExtentAllocator
from tiers.arena import Arena
from tiers.dram import DRAMTier


def key(i: int) -> ChunkKey:
    return ChunkKey(struct.pack("<QQ", 0xACE, i))


METAS = [
    BlockMeta.for_payload(key(0), b"x" * 100),
    BlockMeta.for_payload(key(1), b"", parent=key(0), token_count=16),
    BlockMeta(bytes(8), key(2), key(1), 7, "float16", (2, 3, 4), 48, 2**64 - 1),
    BlockMeta(bytes(8), key(3), NO_PARENT, 0, "float32", (), 12, 5),  # no shape: any length
    BlockMeta(bytes(8), key(4), NO_PARENT, 2**32 - 1, "bfloat16", (1,) * 8, 2, 0),
]


def packed_again(ms: list[BlockMeta]) -> list[BlockMeta]:
    p = metas_to_packed(ms)
    assert p is not None
    return metas_from_packed(pb.PackedBlocks.FromString(p.SerializeToString()))


def test_packed_blocks_describe_what_the_messages_describe() -> None:
    assert packed_again(METAS) == METAS
    # and what a node reads from the per-block messages, field for field
    assert [meta_from_pb(meta_to_pb(m)) for m in METAS] == packed_again(METAS)
    ns = b"\x01" * 8
    same_ns = [BlockMeta.for_payload(key(i), b"y" * i, namespace=ns) for i in range(3)]
    assert packed_again(same_ns) == same_ns


def test_blocks_of_several_namespaces_are_not_packed() -> None:
    mixed = [BlockMeta.for_payload(key(0), b"a"), BlockMeta.for_payload(key(1), b"b", namespace=b"\x02" * 8)]
    assert metas_to_packed(mixed) is None


def good() -> pb.PackedBlocks:
    p = metas_to_packed(METAS[:3])
    assert p is not None
    return p


@pytest.mark.parametrize(
    "spoil",
    [
        lambda p: setattr(p, "keys", p.keys[:-1]),  # not 16 bytes a key
        lambda p: setattr(p, "parents", p.parents[:16]),  # one parent short
        lambda p: setattr(p, "namespace", b"\x00" * 7),
        lambda p: setattr(p, "token_counts", p.token_counts + b"\x00"),
        lambda p: setattr(p, "dtypes", bytes([99]) + p.dtypes[1:]),  # unknown dtype code
        lambda p: setattr(p, "ndims", bytes([9]) + p.ndims[1:]),  # more than 8 dims
        lambda p: setattr(p, "shape", p.shape[:-8]),  # fewer dims than the ndims say
        lambda p: setattr(p, "payload_lens", struct.pack("<Q", 101) + p.payload_lens[8:]),  # contradicts its shape
        lambda p: setattr(p, "payload_checksums", b"\x00" * 8),  # neither empty nor one per block
    ],
)
def test_malformed_packed_blocks_are_refused(spoil: object) -> None:
    p = good()
    spoil(p)  # type: ignore[operator]
    with pytest.raises(InvalidArgument):
        metas_from_packed(p)


def test_packed_keys() -> None:
    ks = [key(i) for i in range(5)]
    assert keys_from_packed(b"".join(ks)) == ks
    assert keys_from_packed(b"") == []
    with pytest.raises(InvalidArgument):
        keys_from_packed(b"\x00" * 17)


def test_with_checksum_keeps_the_rest_and_checks_the_range() -> None:
    assert with_checksum(METAS[2], 42) == dataclasses.replace(METAS[2], payload_checksum=42)
    with pytest.raises(InvalidArgument):
        with_checksum(METAS[2], 2**64)


# -- the allocator's batch allocation ------------------------------------------------------
def test_allocate_many_carves_one_allocation_in_order() -> None:
    a = ExtentAllocator(64 * 16, 64)
    got = a.allocate_many([64, 1, 130, 0])
    assert got == [[Extent(0, 64)], [Extent(64, 64)], [Extent(128, 192)], [Extent(320, 64)]]
    assert a.used_bytes == 384
    assert a.allocate_many([]) == []


def test_allocate_many_spans_free_pieces_and_refuses_whole() -> None:
    a = ExtentAllocator(64 * 8, 64)
    first, second, third = a.allocate(128), a.allocate(128), a.allocate(128)
    assert first and second and third
    a.free(first)
    a.free(third)  # free: units 0-1 and 4-7 (6 units)
    before = a.free_bytes
    assert a.allocate_many([64 * 7]) is None and a.free_bytes == before  # short: nothing taken
    got = a.allocate_many([64 * 3, 64 * 3])
    assert got is not None
    assert sum(e.length for g in got for e in g) == 64 * 6 and a.free_bytes == 0
    spans = sorted((e.offset, e.end) for g in got for e in g)
    assert all(x[1] <= y[0] for x, y in zip(spans, spans[1:]))  # no overlap
    assert any(len(g) > 1 for g in got)  # a block across the two free pieces
    for g in got:
        a.free(g)
    assert a.free_bytes == 64 * 6


# -- the DRAM tier's late policy updates ---------------------------------------------------
@pytest.fixture
def dram() -> Iterator[DRAMTier]:
    arena = Arena.create(f"/dev/shm/kvstore-test-{uuid.uuid4().hex}.arena", 64 * 1024 * 8, prefault=False)
    tier = DRAMTier(arena)
    yield tier
    tier.close()


def commit(dram: DRAMTier, i: int, *, soon: bool) -> BlockMeta:
    meta = BlockMeta.for_payload(key(i), b"z")
    ext = dram.reserve(1)
    assert ext is not None
    dram.commit(meta, ext, policy_soon=soon)
    return meta


def test_late_policy_updates_apply_before_victims_and_in_order(dram: DRAMTier) -> None:
    async def run() -> list[bytes]:
        for i in range(3):
            commit(dram, i, soon=True)
        dram.touch_soon([key(0)])  # read after the commits: key 0 is now the most recent
        commit(dram, 3, soon=True)
        dram.delete(key(3))  # gone before the policy heard of it: never a victim
        return list(dram.victims())  # before the loop's next turn: the pending updates go first

    order = asyncio.run(run())
    assert set(order) == {key(0), key(1), key(2)}
    assert order.index(key(0)) > order.index(key(1))


def test_late_policy_updates_apply_on_the_next_turn(dram: DRAMTier) -> None:
    async def run() -> None:
        commit(dram, 0, soon=True)
        assert key(0) not in list(dram.policy.victims())  # not yet told
        await asyncio.sleep(0)
        assert key(0) in list(dram.policy.victims())

    asyncio.run(run())


def test_a_block_replaced_before_its_late_insert_is_inserted_once(dram: DRAMTier) -> None:
    async def run() -> list[bytes]:
        commit(dram, 0, soon=True)
        commit(dram, 0, soon=False)  # replaced (a promotion, say): told at once
        await asyncio.sleep(0)
        return list(dram.victims())

    assert asyncio.run(run()) == [key(0)]

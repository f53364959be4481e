"""Tier-manager scenarios under a controlled clock: leases, pins, reclaim deadlines, eviction, demotion."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import FakeClock

from kvstore.block import BlockMeta
from kvstore.errors import CapacityExceeded
from kvstore.keys import NO_PARENT, ChunkKey
from kvstore.node.manager import Status, TierManager
from tiers.arena import Arena
from tiers.base import TierKind
from tiers.dram import DRAMTier
from tiers.nvme import NVMeTier
from tiers.policy import LRUPolicy, PrefixAwareLRUPolicy

MiB = 1 << 20


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


def payload(i: int, n: int = MiB) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def build(
    tmp_path: Path,
    clock: FakeClock,
    *,
    dram: int = 4 * MiB,
    nvme: int = 16 * MiB,
    policy: Any = PrefixAwareLRUPolicy,
    **kw: Any,
) -> TierManager:
    arena = Arena.create(f"/dev/shm/kvstore-scn-{uuid.uuid4().hex}.arena", dram)
    nv = (
        NVMeTier(tmp_path / f"nvme-{uuid.uuid4().hex[:6]}", nvme, policy=policy(), segment_bytes=4 * MiB)
        if nvme
        else None
    )
    return TierManager(DRAMTier(arena, policy=policy()), nv, clock=clock, reservation_ttl=5.0, lease_ttl=5.0, **kw)


@pytest.fixture
def mgr(tmp_path: Path, clock: FakeClock) -> Iterator[TierManager]:
    m = build(tmp_path, clock)
    yield m
    m.close()


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def put(m: TierManager, i: int, n: int = MiB, parent: ChunkKey = NO_PARENT) -> Status:
    data = payload(i, n)
    meta = BlockMeta.for_payload(key(i), data, parent=parent)
    (r,) = await m.reserve([meta])
    if r.status != Status.OK:
        return r.status
    m.dram.arena.write(list(r.extents), memoryview(data))
    (st,) = await m.commit([r.reservation_id])
    return st


async def read(m: TierManager, i: int, n: int = MiB) -> bytes | None:
    (x,) = await m.acquire([key(i)])
    if x.status != Status.OK:
        return None
    out = bytearray(x.meta.payload_len)
    m.dram.arena.read_into(list(x.extents), memoryview(out), x.meta.payload_len)
    assert m.release([x.lease_id]) == [True]
    return bytes(out)


def test_put_get_and_dedup(mgr: TierManager) -> None:
    async def go() -> None:
        assert await put(mgr, 1) == Status.OK
        assert await put(mgr, 1) == Status.EXISTS  # content-addressed: nothing rewritten
        assert await read(mgr, 1) == payload(1).tobytes()
        assert await read(mgr, 2) is None

    run(go())


def test_unfinished_write_is_reclaimed_after_deadline(mgr: TierManager, clock: FakeClock) -> None:
    async def go() -> None:
        base = mgr.dram.used_bytes
        meta = BlockMeta.for_payload(key(1), payload(1))
        (r,) = await mgr.reserve([meta])
        assert r.status == Status.OK and mgr.dram.used_bytes > base
        clock.advance(4.9)
        assert mgr.reap()["reservations"] == 0
        clock.advance(0.2)
        assert mgr.reap()["reservations"] == 1
        assert mgr.dram.used_bytes == base
        assert await mgr.commit([r.reservation_id]) == [Status.EXPIRED]
        assert mgr.where(key(1)) is None

    run(go())


def test_abort_frees_and_hides(mgr: TierManager) -> None:
    async def go() -> None:
        (r,) = await mgr.reserve([BlockMeta.for_payload(key(1), payload(1))])
        mgr.abort([r.reservation_id])
        assert mgr.dram.used_bytes == 0 and mgr.where(key(1)) is None

    run(go())


def test_leased_blocks_are_not_evicted_and_expire(mgr: TierManager, clock: FakeClock) -> None:
    async def go() -> None:
        for i in range(4):
            assert await put(mgr, i) == Status.OK
        leases = await mgr.acquire([key(i) for i in range(4)])
        assert all(x.status == Status.OK for x in leases)
        # DRAM is full and every block is leased: a new write cannot get space
        assert await put(mgr, 10) == Status.NO_SPACE
        clock.advance(5.1)
        assert mgr.reap()["leases"] == 4
        assert mgr.release([leases[0].lease_id]) == [False]  # expired: the reader must not trust its bytes
        assert await put(mgr, 10) == Status.OK  # now something could be demoted
        assert mgr.counters["demotions"] >= 1

    run(go())


def test_pins_keep_blocks_resident_until_ttl(mgr: TierManager, clock: FakeClock) -> None:
    async def go() -> None:
        for i in range(4):
            await put(mgr, i)
        assert mgr.pin([key(0), key(99)], ttl=10) == 1
        for i in range(10, 16):
            assert await put(mgr, i) == Status.OK
        assert mgr.where(key(0)) == TierKind.DRAM  # pinned: never demoted
        clock.advance(11)
        mgr.reap()
        for i in range(20, 24):
            await put(mgr, i)
        assert mgr.where(key(0)) == TierKind.NVME  # pin expired: evicted like any other
        assert mgr.unpin([key(0)]) == 0

    run(go())


def test_all_pinned_dram_reports_no_space(mgr: TierManager) -> None:
    async def go() -> None:
        for i in range(4):
            await put(mgr, i)
        mgr.pin([key(i) for i in range(4)], ttl=100)
        assert await put(mgr, 9) == Status.NO_SPACE

    run(go())


def test_write_back_demotion_and_promotion_are_byte_identical(mgr: TierManager) -> None:
    async def go() -> None:
        for i in range(12):
            assert await put(mgr, i) == Status.OK
        assert mgr.counters["demotions"] >= 8
        assert mgr.where(key(0)) == TierKind.NVME
        for i in range(12):
            assert await read(mgr, i) == payload(i).tobytes()
        assert mgr.counters["promotions"] >= 8
        assert mgr.dram.used_bytes <= mgr.dram.capacity_bytes

    run(go())


def test_prefix_aware_eviction_takes_descendants_first(tmp_path: Path, clock: FakeClock) -> None:
    m = build(tmp_path, clock, nvme=0)

    async def go() -> None:
        # chain 0 <- 1 <- 2 (parent <- child), then touch the root so plain LRU would evict 1 or 2 later anyway
        await put(m, 0)
        await put(m, 1, parent=key(0))
        await put(m, 2, parent=key(1))
        await read(m, 0)
        await put(m, 3)
        # full: the next write must evict a leaf: 2 (descendant) before 1 before 0, and 3 is newest
        await put(m, 4)
        assert m.where(key(2)) is None and m.where(key(1)) == TierKind.DRAM and m.where(key(0)) == TierKind.DRAM
        await put(m, 5)
        assert m.where(key(1)) is None and m.where(key(0)) == TierKind.DRAM

    run(go())
    m.close()


def test_delete_of_leased_block_hides_it_and_frees_on_release(mgr: TierManager) -> None:
    async def go() -> None:
        await put(mgr, 1)
        (x,) = await mgr.acquire([key(1)])
        assert await mgr.delete([key(1)]) == 1
        assert mgr.where(key(1)) is None
        used = mgr.dram.used_bytes
        assert used >= MiB  # still held by the lease
        out = bytearray(MiB)
        mgr.dram.arena.read_into(list(x.extents), memoryview(out), MiB)
        assert bytes(out) == payload(1).tobytes()
        assert mgr.release([x.lease_id]) == [True]
        assert mgr.dram.used_bytes == used - MiB

    run(go())


def test_invalidate_drops_a_namespace_in_every_tier(mgr: TierManager) -> None:
    async def go() -> None:
        ns_a, ns_b = b"A" * 8, b"B" * 8
        for i in range(8):
            data = payload(i)
            meta = BlockMeta.for_payload(key(i), data, namespace=ns_a if i % 2 else ns_b)
            (r,) = await mgr.reserve([meta])
            mgr.dram.arena.write(list(r.extents), memoryview(data))
            await mgr.commit([r.reservation_id])
        assert await mgr.invalidate(ns_a) == 4
        assert all(mgr.where(key(i)) is None for i in range(1, 8, 2))
        assert all(mgr.where(key(i)) is not None for i in range(0, 8, 2))

    run(go())


def test_dropping_namespaces_counts_why(mgr: TierManager) -> None:
    """The cluster agent drops namespaces through the manager (epoch bumps, owner changes):
    only the named namespaces go, from every tier, and the reason is counted."""

    async def go() -> None:
        ns = [bytes([65 + i]) * 8 for i in range(3)]
        for i in range(9):
            data = payload(i)
            meta = BlockMeta.for_payload(key(i), data, namespace=ns[i % 3])
            (r,) = await mgr.reserve([meta])
            mgr.dram.arena.write(list(r.extents), memoryview(data))
            await mgr.commit([r.reservation_id])
        assert await mgr.drop_namespaces({ns[0]}, why="epoch") == 3
        assert await mgr.drop_namespaces([ns[1]], why="owner_change") == 3
        assert await mgr.drop_namespaces(set()) == 0
        assert [i for i in range(9) if mgr.where(key(i)) is not None] == [2, 5, 8]
        c = mgr.counters
        assert (c["invalidated_blocks"], c["epoch_reclaimed_blocks"], c["owner_change_dropped_blocks"]) == (6, 3, 3)

    run(go())


def test_corrupt_local_write_is_not_demoted(mgr: TierManager) -> None:
    async def go() -> None:
        data = payload(1)
        meta = BlockMeta.for_payload(key(1), data)
        (r,) = await mgr.reserve([meta])
        mgr.dram.arena.write(list(r.extents), memoryview(np.zeros(MiB, np.uint8)))  # bytes that do not match
        await mgr.commit([r.reservation_id])
        for i in range(10, 16):
            await put(mgr, i)
        assert mgr.counters["corrupt_demotions"] == 1
        assert mgr.where(key(1)) is None  # dropped, never written to NVMe

    run(go())


def test_commit_with_verify_rejects_bad_bytes(mgr: TierManager) -> None:
    async def go() -> None:
        meta = BlockMeta.for_payload(key(1), payload(1))
        (r,) = await mgr.reserve([meta])
        assert await mgr.commit([r.reservation_id], verify=True) == [Status.CORRUPT]
        assert mgr.where(key(1)) is None and mgr.dram.used_bytes == 0

    run(go())


def test_block_bigger_than_dram_is_an_error(mgr: TierManager) -> None:
    async def go() -> None:
        with pytest.raises(CapacityExceeded):
            await mgr.reserve([BlockMeta.for_payload(key(1), np.zeros(5 * MiB, np.uint8))])

    run(go())


def test_a_reserve_with_nothing_evictable_answers_no_space_while_background_work_runs(mgr: TierManager) -> None:
    """DRAM full of reserved blocks and a background task that frees nothing (a cleaner or
    a write that keeps its blocks): the next Reserve answers NO_SPACE after ``stall_s``,
    it does not spin until its caller's deadline (the TP=2 engine's saves timed out so)."""

    async def go() -> None:
        held = [(await mgr.reserve([BlockMeta.for_payload(key(i), payload(i))]))[0] for i in range(4)]
        assert all(r.status == Status.OK for r in held) and mgr.dram.allocator.free_bytes < MiB
        never = asyncio.Event()
        mgr.movers.spawn(never.wait())
        mgr.movers.stall_s = 0.05
        (r,) = await asyncio.wait_for(mgr.reserve([BlockMeta.for_payload(key(9), payload(9))]), 10.0)
        assert r.status == Status.NO_SPACE and mgr.counters["reserve_stalled"] == 1
        never.set()
        mgr.abort([h.reservation_id for h in held])
        (r,) = await mgr.reserve([BlockMeta.for_payload(key(9), payload(9))])  # room again
        assert r.status == Status.OK

    run(go())


def test_write_through_persists_at_commit(tmp_path: Path, clock: FakeClock) -> None:
    m = build(tmp_path, clock, write_through=True, policy=LRUPolicy)

    async def go() -> None:
        await put(m, 1)
        for _ in range(100):
            if m.nvme.contains(key(1)):
                break
            await asyncio.sleep(0.01)
        assert m.nvme.contains(key(1))

    run(go())
    m.close()


def test_flush_demotes_every_dirty_block(mgr: TierManager) -> None:
    async def go() -> None:
        for i in range(3):
            await put(mgr, i)
        assert await mgr.flush() == 3
        assert all(mgr.nvme.contains(key(i)) for i in range(3))

    run(go())


def test_the_cleaner_writes_the_next_victims_ahead_so_a_full_dram_put_never_waits_on_the_disk(
    tmp_path: Path, clock: FakeClock
) -> None:
    """Issue 24: with ``clean_ahead`` the eviction end of DRAM is written to NVMe in the
    background (the blocks stay readable in DRAM), so a put into a full DRAM frees room by
    deleting clean blocks; it waits on the disk only when the cleaner fell behind (counted)."""
    m = build(tmp_path, clock, dram=8 * MiB, nvme=32 * MiB, policy=LRUPolicy, clean_ahead=0.25)

    async def settle() -> None:
        while m.movers.background:
            await asyncio.gather(*m.movers.background, return_exceptions=True)

    async def go() -> None:
        for i in range(7):  # 7 of 8 MiB: the victims' end (2 MiB) is no longer free
            assert await put(m, i) == Status.OK
            await settle()
        assert m.counters["cleaned_ahead"] >= 1
        assert m.where(key(0)) == TierKind.DRAM and m.movers.on_nvme(key(0))  # in both tiers: clean
        assert m.counters["reserve_waited_on_nvme"] == 0
        for i in range(7, 20):  # DRAM full from here on: every put evicts
            assert await put(m, i) == Status.OK
            await settle()
        assert m.counters["reserve_waited_on_nvme"] == 0, "a put waited although the cleaner had kept up"
        assert m.counters["dram_evictions"] >= 12
        for i in range(20):  # nothing lost: every block reads back from DRAM or NVMe, byte for byte
            assert await read(m, i) == payload(i).tobytes()
        # a burst the cleaner cannot keep up with: puts wait, and say so
        for i in range(20, 30):
            assert await put(m, i) == Status.OK
        assert m.counters["reserve_waited_on_nvme"] >= 1

    try:
        run(go())
    finally:
        m.close()


def test_the_cleaner_drops_a_corrupt_block_once_never_checks_it_again(tmp_path: Path, clock: FakeClock) -> None:
    """A dirty block whose bytes do not match its checksum, met by the cleaner, is dropped as
    corrupt at once: later commits do not read and check it again (a node that kept it spent
    its loop on it, one retry per commit), and the blocks around it are cleaned as usual."""
    m = build(tmp_path, clock, dram=8 * MiB, nvme=32 * MiB, policy=LRUPolicy, clean_ahead=0.25)

    async def settle() -> None:
        while m.movers.background:
            await asyncio.gather(*m.movers.background, return_exceptions=True)

    async def go() -> None:
        meta = BlockMeta.for_payload(key(0), payload(0))
        (r,) = await m.reserve([meta])
        m.dram.arena.write(list(r.extents), memoryview(np.zeros(MiB, np.uint8)))  # bytes that do not match
        await m.commit([r.reservation_id])
        for i in range(1, 10):  # past 6 of 8 MiB the cleaner runs at every commit; DRAM fills
            assert await put(m, i) == Status.OK
            await settle()
        assert m.counters["corrupt_demotions"] == 1, "the corrupt block was checked more than once"
        assert m.where(key(0)) is None and not m.movers.on_nvme(key(0))  # dropped, never written
        assert m.counters["cleaned_ahead"] >= 1
        for i in range(1, 10):  # the others: cleaned and evicted as usual, nothing lost
            assert await read(m, i) == payload(i).tobytes()

    try:
        run(go())
    finally:
        m.close()


def test_without_clean_ahead_a_full_dram_put_waits_on_the_disk(tmp_path: Path, clock: FakeClock) -> None:
    m = build(tmp_path, clock, dram=8 * MiB, nvme=32 * MiB, policy=LRUPolicy)

    async def go() -> None:
        for i in range(12):
            assert await put(m, i) == Status.OK
        assert m.counters["cleaned_ahead"] == 0 and m.counters["reserve_waited_on_nvme"] >= 4

    try:
        run(go())
    finally:
        m.close()

"""Why a lookup missed, told apart by the tier manager: evicted (from DRAM without NVMe, or
from NVMe), invalidated (delete, invalidate), corrupt (a bad put, a bad dirty block), never stored."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.block import BlockMeta
from kvstore.keys import ChunkKey
from kvstore.node.manager import Status, TierManager
from tiers.arena import Arena
from tiers.dram import DRAMTier
from tiers.nvme import NVMeTier
from tiers.policy import LRUPolicy

MiB = 1 << 20
NS1, NS2 = b"ns-one..", b"ns-two.."


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


def build(tmp_path: Path, *, dram: int = 4 * MiB, nvme: int = 0) -> TierManager:
    arena = Arena.create(f"/dev/shm/kvstore-miss-{uuid.uuid4().hex}.arena", dram)
    nv = (
        NVMeTier(tmp_path / f"nvme-{uuid.uuid4().hex[:6]}", nvme, policy=LRUPolicy(), segment_bytes=4 * MiB)
        if nvme
        else None
    )
    return TierManager(DRAMTier(arena, policy=LRUPolicy()), nv)


async def put(m: TierManager, i: int, ns: bytes = NS1, *, corrupt_after: bool = False) -> Status:
    data = np.full(MiB, i % 251, np.uint8)
    meta = BlockMeta.for_payload(key(i), data, namespace=ns, token_count=256)
    (r,) = await m.reserve([meta])
    assert r.status == Status.OK
    m.dram.arena.write(list(r.extents), memoryview(data))
    (st,) = await m.commit([r.reservation_id])
    if corrupt_after:  # a local writer scribbled over it after commit: caught before demotion
        m.dram.arena.write(list(r.extents[:1]), memoryview(b"\xff" * 16))
    return st


async def get(m: TierManager, *ids: int) -> list[Status]:
    leased = await m.acquire([key(i) for i in ids])
    m.release([x.lease_id for x in leased if x.status == Status.OK])
    return [x.status for x in leased]


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def misses(m: TierManager, op: str = "get") -> dict[str, int]:
    return {reason: n for (o, reason), n in m.ledger.snapshot()["misses"].items() if o == op and n}


def test_dram_only_node_tells_evicted_invalidated_and_never_stored_apart(tmp_path: Path) -> None:
    m = build(tmp_path)
    try:

        async def go() -> None:
            for i in range(6):  # 4 fit: 0 and 1 are evicted (no NVMe: they leave the node)
                assert await put(m, i) == Status.OK
            await m.delete([key(5)])
            assert await put(m, 7, NS2) == Status.OK
            assert await m.invalidate(NS2) == 1
            st = await get(m, 0, 1, 2, 5, 7, 99)
            assert st == [Status.MISS, Status.MISS, Status.OK, Status.MISS, Status.MISS, Status.MISS]

        run(go())
        assert misses(m) == {"evicted": 2, "invalidated": 2, "never_stored": 1}
        s = m.ledger.snapshot()
        assert s["hits"] == {("get", "dram"): 1} and s["hit_tokens"] == {("get", "dram"): 256}
        assert s["lookups"] == {"get": 6}
        # the evicted keys remember their namespace; the invalidated one of NS2 too
        assert s["ns_misses"] == {(NS1.hex(), "get"): 4, (NS2.hex(), "get"): 1}
    finally:
        m.close()


def test_nvme_tier_demotes_promotes_and_evicts(tmp_path: Path) -> None:
    m = build(tmp_path, dram=2 * MiB, nvme=3 * MiB)
    try:

        async def go() -> None:
            for i in range(4):  # DRAM holds 2: 0 and 1 are demoted, not lost
                assert await put(m, i) == Status.OK
            assert await get(m, 0) == [Status.OK]  # an NVMe hit, promoted
            for i in range(4, 8):  # NVMe fills up too: the oldest leave the node
                assert await put(m, i) == Status.OK
            gone = [i for i in range(8) if m.where(key(i)) is None]
            assert gone, "NVMe should have evicted something"
            st = await get(m, *gone)
            assert set(st) == {Status.MISS}
            return gone

        gone = run(go())
        s = m.ledger.snapshot()
        assert s["hits"][("get", "nvme")] == 1
        assert misses(m) == {"evicted": len(gone)}
        assert m.counters["promotions"] >= 1 and m.counters["demotions"] >= 2 and m.counters["nvme_evictions"] >= 1
    finally:
        m.close()


def test_corrupt_put_and_corrupt_dirty_block(tmp_path: Path) -> None:
    m = build(tmp_path, dram=2 * MiB, nvme=8 * MiB)
    try:

        async def go() -> None:
            # a put whose bytes do not match its checksum (the data channel verifies)
            data = np.zeros(MiB, np.uint8)
            meta = BlockMeta.for_payload(key(50), data, namespace=NS1, payload_checksum=12345)
            (r,) = await m.reserve([meta])
            m.dram.arena.write(list(r.extents), memoryview(data))
            assert await m.commit([r.reservation_id], verify=True) == [Status.CORRUPT]
            # a dirty block scribbled over: refused by NVMe at demotion, so it leaves the node
            assert await put(m, 1, corrupt_after=True) == Status.OK
            for i in (2, 3):
                assert await put(m, i) == Status.OK
            assert m.where(key(1)) is None
            assert await get(m, 50, 1) == [Status.MISS, Status.MISS]

        run(go())
        assert misses(m) == {"corrupt": 2}
    finally:
        m.close()


def test_match_prefix_and_exists_account_every_key(tmp_path: Path) -> None:
    m = build(tmp_path)
    try:

        async def go() -> None:
            for i in range(3):
                await put(m, i)
            await m.delete([key(1)])

        run(go())
        n, _ = m.match_prefix([key(0), key(1), key(2), key(3)])
        assert n == 1
        assert misses(m, "match_prefix") == {"invalidated": 3}  # the gap's reason covers the tail
        m.exists([key(0), key(1), key(3)])
        assert misses(m, "exists") == {"invalidated": 1, "never_stored": 1}
        s = m.ledger.snapshot()
        assert s["lookups"] == {"match_prefix": 4, "exists": 3}
        assert s["hits"] == {("match_prefix", "dram"): 1, ("exists", "dram"): 1}
    finally:
        m.close()

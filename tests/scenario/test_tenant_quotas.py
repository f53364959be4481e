"""Limits that count what is allocated, and per-tenant capacity quotas, under a controlled clock.

Issue 13 #1: limits counted payload bytes while DRAM is allocated in 64 KiB units, so a
tenant with ``max_reserved_bytes = 0`` reserved 1,024 zero-byte blocks (a whole 64 MiB tier),
``max_pinned_bytes = 0`` pinned as many, and a stream of 1-byte puts evicted everyone else.
What must hold now: every limit charges whole units, so 0- and 1-byte blocks are limited
like any other; a tenant over ``max_dram_bytes`` / ``max_nvme_bytes`` evicts its own blocks,
never another's; and eviction for the admin (or an uncapped tenant) takes the blocks of
tenants within their quotas last.
"""

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
from kvstore.keys import ChunkKey
from kvstore.node.holds import TenantLimits
from kvstore.node.manager import Status, TierManager
from kvstore.node.quotas import QuotaNVMe
from tiers.arena import Arena
from tiers.dram import DRAMTier
from tiers.nvme import NVMeTier, record_bytes

KiB, MiB = 1 << 10, 1 << 20
UNIT = 64 * KiB
NS = {"alice": b"ns-alice", "bob": b"ns-bob..", None: b"ns-admin"}


def key(tenant: str | None, i: int) -> ChunkKey:
    return ChunkKey(NS[tenant] + i.to_bytes(8, "big"))


def meta(tenant: str | None, i: int, n: int) -> tuple[BlockMeta, np.ndarray]:
    data = np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8)
    return BlockMeta.for_payload(key(tenant, i), data, namespace=NS[tenant]), data


def build(tmp_path: Path, limits: dict[str, TenantLimits], *, dram: int = 4 * MiB, nvme: int = 0) -> TierManager:
    arena = Arena.create(f"/dev/shm/kvstore-quota-{uuid.uuid4().hex}.arena", dram)
    nv = NVMeTier(tmp_path / f"nvme-{uuid.uuid4().hex[:6]}", nvme, segment_bytes=4 * MiB) if nvme else None
    return TierManager(DRAMTier(arena), nv, clock=FakeClock(), reservation_ttl=5.0, lease_ttl=5.0, tenant_limits=limits)


@pytest.fixture
def make(tmp_path: Path) -> Iterator[Any]:
    made: list[TierManager] = []

    def f(limits: dict[str, TenantLimits], **kw: Any) -> TierManager:
        made.append(build(tmp_path, limits, **kw))
        return made[-1]

    yield f
    for m in made:
        m.close()


async def put(m: TierManager, tenant: str | None, i: int, n: int) -> Status:
    md, data = meta(tenant, i, n)
    (r,) = await m.reserve([md], tenant=tenant, refuse_over_limit=False)
    if r.status != Status.OK:
        return r.status
    m.dram.arena.write(list(r.extents), data)
    (st,) = await m.commit([r.reservation_id])
    return st


def resident(m: TierManager, tenant: str | None, ids: range) -> int:
    return sum(m.dram.contains(key(tenant, i)) for i in ids)


@pytest.mark.parametrize("size", [0, 1])
def test_zero_reserved_bytes_reserve_nothing_even_empty_blocks(make: Any, size: int) -> None:
    m = make({"bob": TenantLimits(max_reserved_bytes=0)})

    async def go() -> None:
        with pytest.raises(
            CapacityExceeded,
            match=rf"a block of {size} bytes \(it takes 65536 bytes of DRAM.*larger than "
            r"tenant 'bob''s max_reserved_bytes=0",
        ):
            await m.reserve([meta("bob", i, size)[0] for i in range(1024)], tenant="bob")
        assert m.dram.used_bytes == 0 and not m.holds.reservations

    asyncio.run(go())


def test_reserved_bytes_count_whole_units(make: Any) -> None:
    m = make({"bob": TenantLimits(max_reserved_bytes=2 * UNIT)})

    async def go() -> None:
        res = await m.reserve([meta("bob", i, n)[0] for i, n in enumerate([0, 1, 1])], tenant="bob")
        assert [r.status for r in res] == [Status.OK, Status.OK, Status.NO_SPACE]
        assert m.holds.reserved_bytes["bob"] == 2 * UNIT == m.dram.used_bytes
        m.abort([r.reservation_id for r in res if r.status == Status.OK])
        assert not m.holds.reserved_bytes and m.dram.used_bytes == 0

    asyncio.run(go())


def test_zero_pinned_bytes_pin_nothing_even_empty_blocks(make: Any) -> None:
    m = make({"bob": TenantLimits(max_pinned_bytes=0), "carol": TenantLimits(max_pinned_bytes=UNIT)})

    async def go() -> None:
        for i in range(8):
            assert await put(m, "bob", i, 0) == Status.OK
        with pytest.raises(CapacityExceeded, match=r"max_pinned_bytes=0"):
            m.pin([key("bob", i) for i in range(8)], 60, tenant="bob")
        assert not m.holds.pins
        assert m.pin([key("bob", 0)], 60, tenant="carol") == 1  # one empty block: one whole unit
        with pytest.raises(CapacityExceeded, match=r"has 65536 bytes pinned and max_pinned_bytes=65536"):
            m.pin([key("bob", 1)], 60, tenant="carol")

    asyncio.run(go())


def test_a_tenant_over_its_dram_quota_evicts_only_its_own_blocks(make: Any) -> None:
    m = make({"alice": TenantLimits(max_dram_bytes=2 * MiB), "bob": TenantLimits(max_dram_bytes=MiB)})

    async def go() -> None:
        for i in range(32):  # alice's working set: exactly her quota
            assert await put(m, "alice", i, UNIT) == Status.OK
        for i in range(5000):  # bob's 1-byte flood: each takes a unit; 16 fit his quota
            assert await put(m, "bob", i, 1) == Status.OK
        assert resident(m, "alice", range(32)) == 32
        assert resident(m, "bob", range(5000)) == 16 and resident(m, "bob", range(4984, 5000)) == 16
        assert m.quotas is not None and m.quotas.use.used["bob"] == MiB
        assert m.counters["quota_evictions_dram"] == 5000 - 16
        assert m.stats()["tenant_occupancy"] == {
            "alice": {"dram_bytes": 2 * MiB, "nvme_bytes": 0},
            "bob": {"dram_bytes": MiB, "nvme_bytes": 0},
        }

    asyncio.run(go())


def test_the_admins_flood_takes_quota_holders_blocks_last(make: Any) -> None:
    m = make({"alice": TenantLimits(max_dram_bytes=2 * MiB)})

    async def go() -> None:
        for i in range(32):
            assert await put(m, "alice", i, UNIT) == Status.OK
        for i in range(5000):  # the admin (no quota) fills the other 2 MiB, over and over
            assert await put(m, None, i, 1) == Status.OK
        assert resident(m, "alice", range(32)) == 32
        assert resident(m, None, range(5000)) == 32

    asyncio.run(go())


def test_own_blocks_that_cannot_go_refuse_the_tenant_naming_the_quota(make: Any) -> None:
    m = make({"bob": TenantLimits(max_dram_bytes=2 * UNIT)})

    async def go() -> None:
        assert await put(m, "bob", 0, 1) == Status.OK
        assert m.pin([key("bob", 0)], 60, tenant="bob") == 1
        (r,) = await m.reserve([meta("bob", 1, 0)[0]], tenant="bob")
        assert r.status == Status.OK  # 2 units: his pinned block and this reservation
        with pytest.raises(
            CapacityExceeded, match=r"take 131072 bytes of DRAM and max_dram_bytes=131072.*pinned, leased or reserved"
        ):
            await m.reserve([meta("bob", 2, 0)[0]], tenant="bob")
        assert m.counters["reserve_tenant_quota"] == 1
        assert await put(m, "alice", 0, UNIT) == Status.OK  # nobody else is held back

    asyncio.run(go())


def test_a_tenant_over_its_nvme_quota_demotes_over_its_own_blocks(make: Any) -> None:
    rec = record_bytes(1)
    m = make(
        {
            "alice": TenantLimits(max_dram_bytes=MiB, max_nvme_bytes=64 * rec),
            "bob": TenantLimits(max_dram_bytes=MiB, max_nvme_bytes=8 * rec),
        },
        nvme=8 * MiB,
    )

    async def go() -> None:
        assert isinstance(m.nvme, QuotaNVMe)
        for i in range(48):  # 16 stay in DRAM, 32 demoted to NVMe
            assert await put(m, "alice", i, 1) == Status.OK
        for i in range(400):  # bob's flood is demoted too, but only over his own NVMe records
            assert await put(m, "bob", i, 1) == Status.OK
        assert m.quotas is not None
        await asyncio.gather(*m.movers.background)
        on_nvme = lambda t, n: sum(m.nvme.contains(key(t, i)) for i in range(n))  # noqa: E731
        assert on_nvme("alice", 48) == 32 and resident(m, "alice", range(48)) == 16
        assert on_nvme("bob", 400) <= 8 + 16  # his cap, plus at most one demotion batch in flight
        assert m.nvme.use.used["alice"] == 32 * rec
        assert m.nvme.use.used["bob"] == on_nvme("bob", 400) * rec
        assert m.counters["quota_evictions_nvme"] > 0
        # his blocks read back from NVMe are the right bytes; alice's are all there
        for i in range(48):
            (x,) = await m.acquire([key("alice", i)], tenant="alice")
            assert x.status == Status.OK
            got = bytes(m.dram.arena.views(list(x.extents), x.meta.payload_len)[0])
            assert got == meta("alice", i, 1)[1].tobytes()
            m.release([x.lease_id])

    asyncio.run(go())

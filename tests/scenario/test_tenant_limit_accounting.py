"""Per-tenant limits on what eviction cannot reclaim, under a controlled clock.

A tenant's reservations (unfinished writes) and pins hold DRAM that eviction skips; the
tier manager keeps, per tenant, the payload bytes each holds and refuses what would take
it over ``max_reserved_bytes`` / ``max_pinned_bytes``.  What must hold: the sums are exact
through commit, abort, reservation reclaim, unpin, pin expiry, delete and invalidation;
refusals name the limit; other tenants and the admin are unaffected; no pin outlives
``max_pin_ttl``.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from conftest import FakeClock

from kvstore.block import BlockMeta
from kvstore.errors import CapacityExceeded
from kvstore.keys import ChunkKey
from kvstore.node.holds import TenantLimits
from kvstore.node.manager import Status, TierManager
from tiers.arena import Arena
from tiers.dram import DRAMTier

KiB = 1 << 10
MiB = 1 << 20
NS = b"ns-bob.."


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


def meta(i: int, n: int = 64 * KiB, ns: bytes = NS) -> BlockMeta:
    data = np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8)
    return BlockMeta.for_payload(key(i), data, namespace=ns)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def mgr(clock: FakeClock) -> Iterator[TierManager]:
    arena = Arena.create(f"/dev/shm/kvstore-lim-{uuid.uuid4().hex}.arena", 8 * MiB)
    limits = {"bob": TenantLimits(max_reserved_bytes=256 * KiB, max_pinned_bytes=128 * KiB), "alice": TenantLimits()}
    m = TierManager(
        DRAMTier(arena), None, clock=clock, reservation_ttl=5.0, lease_ttl=5.0, tenant_limits=limits, max_pin_ttl=60.0
    )
    yield m
    m.close()


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def held(m: TierManager, tenant: str) -> tuple[int, int]:
    return m.holds.reserved_bytes[tenant], m.holds.pinned_bytes[tenant]


async def store(m: TierManager, ids: list[int], tenant: str | None = "bob") -> None:
    res = await m.reserve([meta(i) for i in ids], tenant=tenant)
    assert [r.status for r in res] == [Status.OK] * len(ids)
    assert await m.commit([r.reservation_id for r in res]) == [Status.OK] * len(ids)


def test_reserve_over_the_limit_answers_no_space_per_block(mgr: TierManager) -> None:
    async def go() -> None:
        res = await mgr.reserve([meta(i) for i in range(6)], tenant="bob")  # 6 x 64 KiB, limit 256 KiB
        assert [r.status for r in res] == [Status.OK] * 4 + [Status.NO_SPACE] * 2
        assert held(mgr, "bob") == (256 * KiB, 0)
        assert mgr.counters["reserve_tenant_limit"] == 2
        # nothing more fits: the whole call is refused, naming the limit
        with pytest.raises(
            CapacityExceeded, match=r"tenant 'bob' has 262144 bytes reserved.*max_reserved_bytes=262144"
        ):
            await mgr.reserve([meta(10)], tenant="bob")
        # other tenants and the admin are not limited by bob's state
        assert [r.status for r in await mgr.reserve([meta(20 + i) for i in range(8)], tenant="alice")] == [
            Status.OK
        ] * 8
        assert [r.status for r in await mgr.reserve([meta(40)], tenant=None)] == [Status.OK]
        assert "alice" not in mgr.holds.reserved_bytes or held(mgr, "alice")[0] == 8 * 64 * KiB
        # commit releases the bytes; so does abort
        assert await mgr.commit([res[0].reservation_id, res[1].reservation_id]) == [Status.OK] * 2
        assert held(mgr, "bob") == (128 * KiB, 0)
        mgr.abort([res[2].reservation_id])
        assert held(mgr, "bob") == (64 * KiB, 0)
        assert [r.status for r in await mgr.reserve([meta(11), meta(12), meta(13), meta(14)], tenant="bob")] == [
            Status.OK
        ] * 3 + [Status.NO_SPACE]

    run(go())


def test_a_block_bigger_than_the_limit_says_so(mgr: TierManager) -> None:
    async def go() -> None:
        with pytest.raises(CapacityExceeded, match=r"larger than tenant 'bob''s max_reserved_bytes=262144"):
            await mgr.reserve([meta(1, 512 * KiB)], tenant="bob")
        assert held(mgr, "bob") == (0, 0)
        # a put stream reserves block by block and takes the NO_SPACE answer instead
        (r,) = await mgr.reserve([meta(1, 512 * KiB)], tenant="bob", refuse_over_limit=False)
        assert r.status == Status.NO_SPACE

    run(go())


def test_existing_keys_cost_nothing_and_are_answered(mgr: TierManager) -> None:
    async def go() -> None:
        await store(mgr, [1])
        res = await mgr.reserve([meta(1)] + [meta(i) for i in range(2, 6)], tenant="bob")
        assert [r.status for r in res] == [Status.EXISTS] + [Status.OK] * 4
        assert held(mgr, "bob") == (256 * KiB, 0)

    run(go())


def test_reclaimed_reservations_give_their_bytes_back(mgr: TierManager, clock: FakeClock) -> None:
    async def go() -> None:
        res = await mgr.reserve([meta(i) for i in range(4)], tenant="bob")
        assert held(mgr, "bob") == (256 * KiB, 0)
        clock.advance(5.1)
        # overdue but not reaped yet: a refused reserve reclaims them first, and fits
        (r,) = await mgr.reserve([meta(9)], tenant="bob")
        assert r.status == Status.OK and held(mgr, "bob") == (64 * KiB, 0)
        assert await mgr.commit([x.reservation_id for x in res]) == [Status.EXPIRED] * 4
        clock.advance(5.1)
        assert mgr.reap()["reservations"] == 1
        assert held(mgr, "bob") == (0, 0) and "bob" not in mgr.holds.reserved_bytes

    run(go())


def test_held_reservations_count_until_resolved(mgr: TierManager) -> None:
    async def go() -> None:
        res = await mgr.reserve([meta(i) for i in range(4)], tenant="bob")
        assert mgr.hold(reservation_ids=[r.reservation_id for r in res])
        assert mgr.reap(now=mgr.clock() + 1e6)["reservations"] == 0  # a transfer holds them
        assert held(mgr, "bob") == (256 * KiB, 0)
        mgr.reap(now=math.inf)  # the shutdown sweep
        assert held(mgr, "bob") == (0, 0)

    run(go())


def test_pins_over_the_limit_are_refused_whole(mgr: TierManager) -> None:
    async def go() -> None:
        await store(mgr, list(range(4)))
        assert mgr.pin([key(0), key(1)], 30, tenant="bob") == 2
        assert held(mgr, "bob") == (0, 128 * KiB)
        assert mgr.pin([key(0), key(1)], 40, tenant="bob") == 2  # its own pins again: no new charge
        with pytest.raises(CapacityExceeded, match=r"tenant 'bob' has 131072 bytes pinned and max_pinned_bytes=131072"):
            mgr.pin([key(1), key(2)], 30, tenant="bob")
        assert not mgr.pinned(key(2)) and held(mgr, "bob") == (0, 128 * KiB)
        assert mgr.counters["pin_tenant_limit"] == 1
        assert mgr.pin([key(99)], 30, tenant="bob") == 0  # absent keys: no-ops, never refused
        # unpin gives the bytes back
        assert mgr.unpin([key(0)]) == 1
        assert held(mgr, "bob") == (0, 64 * KiB)
        assert mgr.pin([key(2)], 30, tenant="bob") == 1
        # the admin is not limited, and its pins are charged to nobody
        assert mgr.pin([key(3)], 30) == 1 and held(mgr, "bob") == (0, 128 * KiB)

    run(go())


def test_pin_expiry_delete_and_invalidate_release_pinned_bytes(mgr: TierManager, clock: FakeClock) -> None:
    async def go() -> None:
        await store(mgr, [0, 1])
        assert mgr.pin([key(0)], 10, tenant="bob") == 1
        assert mgr.pin([key(1)], 30, tenant="bob") == 1
        clock.advance(10.5)
        # key 0's pin ended; the reaper has not run, but a refused pin drops it first
        assert mgr.pin([key(0)], 30, tenant="bob") == 1  # a new pin (fits once the old is gone)
        assert held(mgr, "bob") == (0, 128 * KiB)
        clock.advance(20)
        mgr.reap()
        assert held(mgr, "bob") == (0, 64 * KiB) and not mgr.pinned(key(1))
        assert await mgr.delete([key(0)]) == 1
        assert held(mgr, "bob") == (0, 0) and not mgr.holds.pinned_bytes
        await store(mgr, [2, 3])
        assert mgr.pin([key(2), key(3)], 30, tenant="bob") == 2
        assert await mgr.invalidate(NS) == 3  # keys 1, 2, 3
        assert held(mgr, "bob") == (0, 0)

    run(go())


def test_a_repin_moves_the_charge_to_whoever_pinned_last(mgr: TierManager) -> None:
    async def go() -> None:
        await store(mgr, [0, 1, 2])
        assert mgr.pin([key(0)], 30) == 1  # the admin's: uncharged
        assert mgr.pin([key(0), key(1)], 30, tenant="bob") == 2  # now bob's
        assert held(mgr, "bob") == (0, 128 * KiB)
        assert mgr.pin([key(1)], 30) == 1  # the admin's again: bob no longer pays for it
        assert held(mgr, "bob") == (0, 64 * KiB)
        assert mgr.pin([key(2)], 30, tenant="bob") == 1

    run(go())


def test_pin_ttl_is_capped_for_everyone(mgr: TierManager, clock: FakeClock) -> None:
    async def go() -> None:
        await store(mgr, [0, 1])
        assert mgr.pin([key(0)], math.inf, tenant="bob") == 1
        assert mgr.pin([key(1)], 1e9) == 1  # the admin too
        assert mgr.counters["pins_ttl_capped"] == 2
        clock.advance(59.9)
        assert mgr.pinned(key(0)) and mgr.pinned(key(1))
        clock.advance(0.2)
        assert not mgr.pinned(key(0)) and not mgr.pinned(key(1))
        mgr.reap()
        assert held(mgr, "bob") == (0, 0) and not mgr.holds.pins
        for bad in (0, -1, math.nan):
            with pytest.raises(ValueError, match="pin ttl must be positive"):
                mgr.pin([key(0)], bad, tenant="bob")

    run(go())


def test_stats_report_each_tenants_holds(mgr: TierManager) -> None:
    async def go() -> None:
        await store(mgr, [0])
        mgr.pin([key(0)], 30, tenant="bob")
        await mgr.reserve([meta(1)], tenant="bob")
        s = mgr.stats()["tenant_holds"]
        assert s == {
            "alice": {"reserved_bytes": 0, "pinned_bytes": 0},
            "bob": {"reserved_bytes": 64 * KiB, "pinned_bytes": 64 * KiB},
        }

    run(go())

"""Data-channel transfers (kvstore/node/transfers.py) over a real tier manager, under a controlled clock:
negotiation, take (once), the arena views a taken transfer carries, finish, expiry; and the
manager's methods for the bytes of reservations and leases."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from conftest import FakeClock

from kvstore.block import BlockMeta
from kvstore.framing import OP_GET, OP_PUT
from kvstore.keys import ChunkKey
from kvstore.node.manager import Status, TierManager
from kvstore.node.transfers import Transfers
from tiers.arena import Arena
from tiers.dram import DRAMTier

KiB = 1 << 10


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


def payload(i: int, n: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).tobytes()


def meta(i: int, n: int) -> BlockMeta:
    return BlockMeta.for_payload(key(i), np.frombuffer(payload(i, n), dtype=np.uint8))


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def mgr(clock: FakeClock) -> Iterator[TierManager]:
    arena = Arena.create(f"/dev/shm/kvstore-xfer-{uuid.uuid4().hex}.arena", 4 << 20)
    m = TierManager(DRAMTier(arena), None, clock=clock, reservation_ttl=5.0, lease_ttl=5.0)
    yield m
    m.close()


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def fill(views: list[memoryview], data: bytes) -> None:
    pos = 0
    for v in views:
        v[:] = data[pos : pos + v.nbytes]
        pos += v.nbytes
    assert pos == len(data)


def joined(views: list[memoryview]) -> bytes:
    return b"".join(bytes(v) for v in views)


def test_put_transfer_commits_what_came_through_its_views_and_is_taken_once(mgr: TierManager) -> None:
    async def go() -> None:
        t = Transfers(mgr)
        metas = [meta(1, 100 * KiB), meta(2, 0), meta(3, 70 * KiB + 3)]
        reserved = await mgr.reserve(metas)
        tid = t.start_put(metas, reserved)
        assert len(tid) == 16 and t.pending == 1
        assert await t.take(tid, OP_GET) is None, "an id is for one op"
        x = await t.take(tid, OP_PUT)
        assert x is not None and t.pending == 0 and t.active == 1
        assert await t.take(tid, OP_PUT) is None, "an id is taken once"
        assert all(mgr.held(r.reservation_id) for r in reserved)
        for views, m in zip(x.views, metas):
            fill(views, payload(int.from_bytes(m.key, "big"), m.payload_len))
        assert await t.finish_put(x, True) == [int(Status.OK)] * 3
        assert t.active == 0
        assert mgr.counters["tcp_bytes_in"] == sum(m.payload_len for m in metas)
        for m in metas:
            (lease,) = await mgr.acquire([m.key])
            views = mgr.leased_views(lease.lease_id)
            assert views is not None and joined(views) == payload(int.from_bytes(m.key, "big"), m.payload_len)
            mgr.release([lease.lease_id])
            assert mgr.leased_views(lease.lease_id) is None

    run(go())


def test_put_transfer_cut_short_aborts_and_bad_bytes_are_corrupt(mgr: TierManager) -> None:
    async def go() -> None:
        t = Transfers(mgr)
        metas = [meta(1, 8 * KiB)]
        tid = t.start_put(metas, await mgr.reserve(metas))
        x = await t.take(tid, OP_PUT)
        assert x is not None
        assert await t.finish_put(x, False) == [int(Status.EXPIRED)]
        assert mgr.counters["data_channel_aborted_puts"] == 1 and mgr.counters["tcp_bytes_in"] == 0
        assert not mgr.holds.reservations and mgr.dram.used_bytes == 0
        tid = t.start_put(metas, await mgr.reserve(metas))
        x = await t.take(tid, OP_PUT)
        assert x is not None
        fill(x.views[0], bytes(8 * KiB))  # not the bytes the checksum names
        assert await t.finish_put(x, True) == [int(Status.CORRUPT)]
        assert mgr.where(key(1)) is None

    run(go())


def test_get_transfer_reads_leased_bytes_and_releases_its_leases(mgr: TierManager) -> None:
    async def go() -> None:
        t = Transfers(mgr)
        m = meta(5, 33 * KiB)
        (r,) = await mgr.reserve([m])
        assert mgr.write_reserved(r.reservation_id, 0, memoryview(payload(5, m.payload_len)))
        assert await mgr.commit([r.reservation_id]) == [Status.OK]
        leased = await mgr.acquire([m.key, key(6)])  # one hit, one miss
        tid = t.start_get(leased)
        x = await t.take(tid, OP_GET)
        assert x is not None and len(x.views) == 1
        assert joined(x.views[0]) == payload(5, m.payload_len)
        await t.finish_get(x, True)
        assert not mgr.holds.leases and mgr.counters["tcp_bytes_out"] == m.payload_len
        assert t.start_get(await mgr.acquire([key(6)])) == b"", "nothing to move: no transfer"

    run(go())


def test_a_get_whose_leases_were_all_released_is_dropped_at_once(mgr: TierManager) -> None:
    """A client that gives up a TCP get before its bytes (an output buffer too small) releases
    the leases: the pending transfer goes with the last of them, not at its deadline."""

    async def go() -> None:
        t = Transfers(mgr)
        metas = [meta(i, 4 * KiB) for i in (7, 8)]
        rs = await mgr.reserve(metas)
        assert await mgr.commit([r.reservation_id for r in rs]) == [Status.OK] * 2
        leased = await mgr.acquire([m.key for m in metas])
        tid = t.start_get(leased)
        ids = [x.lease_id for x in leased]
        mgr.release(ids[:1])
        assert t.released(ids[:1]) == 0 and t.pending == 1, "one lease left: still the caller's"
        mgr.release(ids[1:])
        assert t.released(ids[1:]) == 1 and t.pending == 0
        assert await t.take(tid, OP_GET) is None
        other = t.start_get(await mgr.acquire([metas[0].key]))
        assert t.released([12345]) == 0 and t.pending == 1, "unknown ids drop nothing"
        x = await t.take(other, OP_GET)
        assert x is not None
        await t.finish_get(x, True)
        assert not mgr.holds.leases

    run(go())


def test_expired_transfers_end_and_a_late_take_is_refused(mgr: TierManager, clock: FakeClock) -> None:
    async def go() -> None:
        t = Transfers(mgr)
        metas = [meta(1, 4 * KiB)]
        put_tid = t.start_put(metas, await mgr.reserve(metas))
        late_tid = t.start_put([meta(2, 4 * KiB)], await mgr.reserve([meta(2, 4 * KiB)]))
        clock.advance(6.0)
        mgr.reap()  # the reservations' deadline passed: reclaimed
        assert await t.take(late_tid, OP_PUT) is None, "its reservations ended before the client came"
        t.expire()
        assert t.pending == 0
        assert await t.take(put_tid, OP_PUT) is None
        assert not mgr.holds.reservations and mgr.dram.used_bytes == 0

    run(go())


def test_write_reserved_writes_at_an_offset_across_extents_and_refuses_ended_reservations(
    mgr: TierManager,
) -> None:
    async def go() -> None:
        m = meta(7, 200 * KiB + 5)
        data = payload(7, m.payload_len)
        (r,) = await mgr.reserve([m])
        rid = r.reservation_id
        for off in range(0, len(data), 64 * KiB + 1):  # pieces that straddle allocation units
            assert mgr.write_reserved(rid, off, memoryview(data)[off : off + 64 * KiB + 1])
        views = mgr.reserved_views(rid)
        assert views is not None and joined(views) == data
        mgr.abort([rid])
        assert mgr.reserved_views(rid) is None
        assert not mgr.write_reserved(rid, 0, memoryview(b"x")), "an ended reservation's space may be another block's"

    run(go())

"""Regression tests from a review of the tier manager's interleavings: each is named after
its bug.  Executor work is made slow with a gate so that the race it exposes is certain.

* cancelling a call (a client's deadline) while a promotion reads NVMe into its arena
  extents freed them under the reading thread: another block's bytes were overwritten;
* the leader's cancellation reached every other caller waiting for the same promotion;
* a verified commit (data channel, gRPC stream) that was cancelled leaked its extents;
* a delete during a promotion or a demotion brought the block back (DRAM or NVMe);
* ``invalidate`` rebuilt a set per NVMe key (quadratic: the loop stalled for minutes);
* a failing ``acquire`` or ``reserve`` left leases or reservations behind;
* a NaN pin TTL was accepted (and silently dropped an existing pin).
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.block import BlockMeta
from kvstore.errors import CapacityExceeded, InvalidArgument
from kvstore.keys import ChunkKey
from kvstore.node.manager import Status, TierManager
from tiers.arena import Arena
from tiers.base import TierKind
from tiers.dram import DRAMTier
from tiers.nvme import NVMeTier
from tiers.policy import LRUPolicy

MiB = 1 << 20


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


def payload(i: int, n: int = MiB) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8)


def build(tmp_path: Path, *, dram: int = 4 * MiB, nvme: int = 16 * MiB, **kw: Any) -> TierManager:
    arena = Arena.create(f"/dev/shm/kvstore-rev-{uuid.uuid4().hex}.arena", dram)
    nv = (
        NVMeTier(tmp_path / f"nvme-{uuid.uuid4().hex[:6]}", nvme, policy=LRUPolicy(), segment_bytes=4 * MiB)
        if nvme
        else None
    )
    return TierManager(DRAMTier(arena, policy=LRUPolicy()), nv, **kw)


@pytest.fixture
def mgr(tmp_path: Path) -> Iterator[TierManager]:
    m = build(tmp_path)
    yield m
    m.close()


async def put(m: TierManager, i: int, n: int = MiB) -> Status:
    data = payload(i, n)
    (r,) = await m.reserve([BlockMeta.for_payload(key(i), data)])
    if r.status != Status.OK:
        return r.status
    m.dram.arena.write(list(r.extents), memoryview(data))
    (st,) = await m.commit([r.reservation_id])
    return st


def read(m: TierManager, leased: Any) -> bytes:
    out = bytearray(leased.meta.payload_len)
    m.dram.arena.read_into(list(leased.extents), memoryview(out), leased.meta.payload_len)
    return bytes(out)


class Gate:
    """Wraps an executor function so that it blocks until ``open()``; ``entered`` tells it started."""

    def __init__(self, fn: Callable[..., Any], when: Callable[..., bool] = lambda *a, **kw: True) -> None:
        self.fn, self.when = fn, when
        self.entered = threading.Event()
        self._open = threading.Event()

    def __call__(self, *args: Any, **kw: Any) -> Any:
        if not self.when(*args, **kw):
            return self.fn(*args, **kw)
        self.entered.set()
        assert self._open.wait(10), "gate never opened"
        return self.fn(*args, **kw)

    def open(self) -> None:
        self._open.set()

    async def wait_entered(self) -> None:
        for _ in range(1000):
            if self.entered.is_set():
                return
            await asyncio.sleep(0.005)
        raise AssertionError("the gated executor call never started")


async def demoted(m: TierManager, i: int) -> None:
    """Put block ``i`` and push it out of DRAM onto NVMe."""
    assert await put(m, i) == Status.OK
    for j in range(1000, 1004):
        assert await put(m, j) == Status.OK
    assert m.where(key(i)) == TierKind.NVME


def test_cancelled_promotion_does_not_free_extents_under_its_reader_regression(mgr: TierManager) -> None:
    async def go() -> None:
        await demoted(mgr, 1)
        gate = mgr.movers._nvme_read_to_arena = Gate(mgr.movers._nvme_read_to_arena)  # type: ignore[method-assign]
        task = asyncio.ensure_future(mgr.acquire([key(1)]))
        await gate.wait_entered()
        task.cancel()  # the client's deadline passed while the NVMe read is under way
        await asyncio.sleep(0.05)
        # a new write takes whatever space is free now
        mine = np.full(MiB, 0xAB, np.uint8)
        (r,) = await mgr.reserve([BlockMeta.for_payload(key(50), mine)])
        assert r.status == Status.OK
        mgr.dram.arena.write(list(r.extents), memoryview(mine))
        gate.open()  # the reading thread finishes
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await mgr.commit([r.reservation_id], verify=True) == [Status.OK], (
            "another block's bytes were written over"
        )
        (x,) = await mgr.acquire([key(50)])
        assert read(mgr, x) == mine.tobytes()
        mgr.release([x.lease_id])
        assert not mgr.holds.leases and not mgr.holds.refs

    asyncio.run(go())


def test_cancelled_promotion_leader_does_not_cancel_other_readers_regression(mgr: TierManager) -> None:
    async def go() -> None:
        await demoted(mgr, 1)
        gate = mgr.movers._nvme_read_to_arena = Gate(mgr.movers._nvme_read_to_arena)  # type: ignore[method-assign]
        leader = asyncio.ensure_future(mgr.acquire([key(1)]))
        await gate.wait_entered()
        other = asyncio.ensure_future(mgr.acquire([key(1)]))  # waits on the same promotion
        await asyncio.sleep(0.02)
        leader.cancel()
        gate.open()
        with pytest.raises(asyncio.CancelledError):
            await leader
        (x,) = await other  # another client's call: it must not be cancelled with the leader
        assert x.status == Status.OK and read(mgr, x) == payload(1).tobytes()
        mgr.release([x.lease_id])

    asyncio.run(go())


def test_cancelled_verified_commit_frees_its_extents_regression(mgr: TierManager) -> None:
    async def go() -> None:
        data = payload(1)
        (r,) = await mgr.reserve([BlockMeta.for_payload(key(1), data)])
        mgr.dram.arena.write(list(r.extents), memoryview(data))
        gate = mgr._checksum_extents = Gate(mgr._checksum_extents)  # type: ignore[method-assign]
        task = asyncio.ensure_future(mgr.commit([r.reservation_id], verify=True))
        await gate.wait_entered()
        task.cancel()  # a PutStream whose client went away while its last block was verified
        gate.open()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.01)
        assert mgr.where(key(1)) is None
        assert mgr.dram.used_bytes == 0, "the reservation's extents leaked"
        assert not mgr.holds.reservations

    asyncio.run(go())


def test_delete_during_promotion_does_not_bring_the_block_back_regression(mgr: TierManager) -> None:
    async def go() -> None:
        await demoted(mgr, 1)
        # gated inside the read, once the NVMe tier has pinned the block for its reader
        gate = mgr.nvme._transfer = Gate(mgr.nvme._transfer, lambda *a, writing: not writing)  # type: ignore[method-assign]
        task = asyncio.ensure_future(mgr.acquire([key(1)]))
        await gate.wait_entered()
        assert await mgr.delete([key(1)]) == 1
        gate.open()
        (x,) = await task
        assert x.status == Status.MISS, "a deleted block was served"
        assert mgr.where(key(1)) is None, "a deleted block came back"
        assert mgr.counters["get_misses_corrupt"] == 0  # deleted, not corrupt

    asyncio.run(go())


@pytest.mark.parametrize("how", ["invalidate", "delete"])
def test_delete_during_demotion_does_not_leave_the_block_on_nvme_regression(mgr: TierManager, how: str) -> None:
    async def go() -> None:
        ns = b"N" * 8
        data = payload(1)
        (r,) = await mgr.reserve([BlockMeta.for_payload(key(1), data, namespace=ns)])
        mgr.dram.arena.write(list(r.extents), memoryview(data))
        await mgr.commit([r.reservation_id])
        gate = mgr.movers._write_nvme = Gate(mgr.movers._write_nvme)  # type: ignore[method-assign]
        flushing = asyncio.ensure_future(mgr.flush())
        await gate.wait_entered()
        n = await (mgr.invalidate(ns) if how == "invalidate" else mgr.delete([key(1)]))
        assert n == 1
        gate.open()
        await flushing
        assert mgr.where(key(1)) is None and not mgr.nvme.contains(key(1)), "a deleted block was persisted"
        (x,) = await mgr.acquire([key(1)])
        assert x.status == Status.MISS
        assert mgr.dram.used_bytes == 0 and not mgr.holds.refs

    asyncio.run(go())


def test_delete_during_write_through_persist_regression(tmp_path: Path) -> None:
    m = build(tmp_path, write_through=True)

    async def go() -> None:
        gate = m.movers._write_nvme = Gate(m.movers._write_nvme)  # type: ignore[method-assign]
        putting = asyncio.create_task(put(m, 1))  # a write-through put answers once its persist ends
        await gate.wait_entered()
        assert await m.delete([key(1)]) == 1
        gate.open()
        assert await putting == Status.OK
        assert m.where(key(1)) is None and not m.nvme.contains(key(1))

    try:
        asyncio.run(go())
    finally:
        m.close()


class _ManyKeysNVMe:
    """Just enough of an NVMe tier to hold many index entries without writing them."""

    def __init__(self, metas: list[BlockMeta]) -> None:
        self._m = {m.key: m for m in metas}

    def keys(self) -> list[ChunkKey]:
        return list(self._m)

    def meta(self, k: ChunkKey) -> BlockMeta | None:
        return self._m.get(k)

    def contains(self, k: ChunkKey) -> bool:
        return k in self._m

    def delete(self, k: ChunkKey) -> bool:
        return self._m.pop(k, None) is not None

    def close(self) -> None:
        pass


def test_invalidate_of_a_large_nvme_namespace_is_not_quadratic_regression(tmp_path: Path) -> None:
    ns = b"B" * 8
    n = 20_000
    metas = [
        BlockMeta(
            namespace=ns,
            key=key(i),
            parent=ChunkKey(bytes(16)),
            token_count=0,
            dtype="uint8",
            shape=(1,),
            payload_len=1,
            payload_checksum=0,
        )
        for i in range(n)
    ]
    arena = Arena.create(f"/dev/shm/kvstore-rev-{uuid.uuid4().hex}.arena", MiB)
    m = TierManager(DRAMTier(arena, policy=LRUPolicy()), _ManyKeysNVMe(metas))
    try:
        t0 = time.perf_counter()
        assert asyncio.run(m.invalidate(ns)) == n
        took = time.perf_counter() - t0
        assert took < 2.0, f"invalidating {n} NVMe blocks took {took:.1f} s (the event loop stalls meanwhile)"
    finally:
        m.close()


def test_failed_acquire_leaves_no_lease_behind_regression(mgr: TierManager) -> None:
    async def go() -> None:
        await demoted(mgr, 1)
        assert await put(mgr, 2) == Status.OK  # in DRAM: leased first

        def broken(*_: Any) -> Any:
            raise OSError(5, "I/O error reading NVMe")

        mgr.movers._nvme_read_to_arena = broken  # type: ignore[method-assign]
        with pytest.raises(OSError):
            await mgr.acquire([key(2), key(1)])
        assert not mgr.holds.leases and not mgr.holds.refs, "the DRAM hit's lease leaked"

    asyncio.run(go())


def test_failed_reserve_leaves_no_reservation_behind_regression(mgr: TierManager) -> None:
    async def go() -> None:
        small = BlockMeta.for_payload(key(1), payload(1))
        huge = BlockMeta.for_payload(key(2), np.zeros(5 * MiB, np.uint8))  # bigger than the whole DRAM tier
        with pytest.raises(CapacityExceeded):
            await mgr.reserve([small, huge])
        assert not mgr.holds.reservations and mgr.dram.used_bytes == 0, "the first block's reservation leaked"

    asyncio.run(go())


def test_nan_pin_ttl_is_rejected_regression(mgr: TierManager) -> None:
    async def go() -> None:
        assert await put(mgr, 1) == Status.OK
        assert mgr.pin([key(1)], 100) == 1
        with pytest.raises(InvalidArgument):
            mgr.pin([key(1)], float("nan"))
        assert mgr.pinned(key(1)), "a NaN ttl dropped the existing pin"

    asyncio.run(go())


def test_nvme_write_error_during_demotion_does_not_fail_the_put_regression(mgr: TierManager) -> None:
    async def go() -> None:
        for i in range(4):
            assert await put(mgr, i) == Status.OK

        def failing(*_: Any) -> None:
            raise OSError(5, "Input/output error")

        mgr.nvme.write_many = failing  # type: ignore[method-assign]
        # DRAM is full: this put evicts a dirty block whose write-back fails.  A cache fails
        # open: the victim is dropped (and counted), the put goes through.
        assert await put(mgr, 10) == Status.OK
        assert mgr.counters["nvme_write_failures"] >= 1
        (x,) = await mgr.acquire([key(10)])
        assert x.status == Status.OK and read(mgr, x) == payload(10).tobytes()
        mgr.release([x.lease_id])

    asyncio.run(go())

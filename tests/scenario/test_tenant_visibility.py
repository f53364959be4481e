"""The tier manager's side of tenancy: a block the caller may not see is absent to it in every
lookup, is never promoted or leased for it, and cannot be replaced through a key collision;
deletes leave alone what the caller may not change; reservations and leases carry their tenant."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.block import BlockMeta
from kvstore.keys import ChunkKey
from kvstore.node.manager import Status, TierManager
from tiers.arena import Arena
from tiers.base import TierKind
from tiers.dram import DRAMTier
from tiers.nvme import NVMeTier

MiB = 1 << 20
NS_A, NS_B = b"A" * 8, b"B" * 8


def only(ns: bytes) -> Any:
    return lambda n: n == ns


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


@pytest.fixture
def mgr(tmp_path: Path) -> Iterator[TierManager]:
    arena = Arena.create(f"/dev/shm/kvstore-scn-{uuid.uuid4().hex}.arena", 4 * MiB)
    nvme = NVMeTier(tmp_path / "nvme", 16 * MiB, segment_bytes=4 * MiB)
    m = TierManager(DRAMTier(arena), nvme, reservation_ttl=5.0, lease_ttl=5.0)
    yield m
    m.close()


async def put(
    m: TierManager, i: int, ns: bytes, fill: int, *, tenant: str | None = None, visible: Any = None
) -> Status:
    data = np.full(64 * 1024, fill, np.uint8)
    (r,) = await m.reserve([BlockMeta.for_payload(key(i), data, namespace=ns)], tenant=tenant, visible=visible)
    if r.status != Status.OK:
        return r.status
    m.dram.arena.write(list(r.extents), memoryview(data))
    (st,) = await m.commit([r.reservation_id])
    return st


async def read(m: TierManager, i: int, visible: Any = None) -> int | None:
    (x,) = await m.acquire([key(i)], visible=visible)
    if x.status != Status.OK:
        return None
    try:
        return bytes(m.dram.arena.views(list(x.extents), x.meta.payload_len)[0][:1])[0]
    finally:
        m.release([x.lease_id])


def test_hidden_blocks_are_absent_to_lookups(mgr: TierManager) -> None:
    async def main() -> None:
        assert await put(mgr, 1, NS_A, 1) == Status.OK
        assert await put(mgr, 2, NS_A, 2) == Status.OK
        assert mgr.exists([key(1), key(2)], visible=only(NS_B)) == [None, None]
        assert mgr.exists([key(1)], visible=only(NS_A)) == [TierKind.DRAM]
        assert mgr.match_prefix([key(1), key(2)], visible=only(NS_B)) == (0, [])
        assert mgr.match_prefix([key(1), key(2)], visible=only(NS_A))[0] == 2
        assert await read(mgr, 1, only(NS_B)) is None
        assert await read(mgr, 1, only(NS_A)) == 1
        assert mgr.stats()["leases"] == 0

    asyncio.run(main())


def test_hidden_nvme_blocks_are_not_promoted(mgr: TierManager) -> None:
    async def main() -> None:
        assert await put(mgr, 1, NS_A, 7) == Status.OK
        await mgr.flush()
        mgr.dram.delete(key(1))  # now only on NVMe
        assert mgr.where(key(1)) == TierKind.NVME
        assert await read(mgr, 1, only(NS_B)) is None
        assert mgr.counters["promotions"] == 0 and not mgr.dram.contains(key(1))
        assert await read(mgr, 1, only(NS_A)) == 7
        assert mgr.counters["promotions"] == 1

    asyncio.run(main())


def test_a_key_collision_never_replaces_another_namespace_block(mgr: TierManager) -> None:
    """Tenant B puts A's key declaring its own namespace: the answer is the one a new key
    gets (so it learns nothing), and A's block stays as it was."""

    async def main() -> None:
        assert await put(mgr, 1, NS_A, 1) == Status.OK
        assert await put(mgr, 1, NS_B, 9, visible=only(NS_B)) == Status.OK  # not EXISTS
        assert mgr.counters["puts_shadowed"] == 1
        assert await read(mgr, 1) == 1 and mgr.namespace_of(key(1)) == NS_A
        assert await put(mgr, 1, NS_A, 5, visible=only(NS_A)) == Status.EXISTS  # its owner deduplicates as ever
        # the same on NVMe
        await mgr.flush()
        mgr.dram.delete(key(1))
        assert await put(mgr, 1, NS_B, 9, visible=only(NS_B)) == Status.OK
        assert await read(mgr, 1) == 1 and mgr.namespace_of(key(1)) == NS_A
        assert mgr.stats()["reservations"] == 0

    asyncio.run(main())


def test_a_commit_racing_another_namespace_is_dropped(mgr: TierManager) -> None:
    async def main() -> None:
        data = np.full(4096, 3, np.uint8)
        (rb,) = await mgr.reserve([BlockMeta.for_payload(key(1), data, namespace=NS_B)], tenant="bob")
        assert mgr.reservation_tenant(rb.reservation_id) == "bob"
        assert await put(mgr, 1, NS_A, 1, tenant="alice") == Status.OK  # A commits first
        mgr.dram.arena.write(list(rb.extents), memoryview(data))
        assert await mgr.commit([rb.reservation_id]) == [Status.OK]
        assert await read(mgr, 1) == 1 and mgr.namespace_of(key(1)) == NS_A

    asyncio.run(main())


def test_delete_leaves_what_the_caller_may_not_change(mgr: TierManager) -> None:
    async def main() -> None:
        assert await put(mgr, 1, NS_A, 1) == Status.OK
        assert await put(mgr, 2, NS_B, 2) == Status.OK
        assert await mgr.delete([key(1), key(2), key(3)], may=only(NS_B)) == 1
        assert mgr.where(key(1)) == TierKind.DRAM and mgr.where(key(2)) is None
        assert await mgr.delete([key(1)]) == 1  # no predicate: the admin

    asyncio.run(main())


def test_leases_carry_their_tenant(mgr: TierManager) -> None:
    async def main() -> None:
        assert await put(mgr, 1, NS_A, 1) == Status.OK
        (x,) = await mgr.acquire([key(1)], tenant="alice")
        assert mgr.lease_tenant(x.lease_id) == "alice" and mgr.lease_tenant(12345) is None
        assert mgr.release([x.lease_id]) == [True]

    asyncio.run(main())


# -- from the tenants security review ---------------------------------------------------------
# ``invalidate(ns)`` collected its keys, then awaited the NVMe scan and deleted those keys
# without looking again: a key that came to hold another namespace's block meanwhile (deleted
# by its first owner, then written by another tenant) lost that block too.
def test_invalidate_deleted_a_block_another_namespace_wrote_during_its_scan(mgr: TierManager) -> None:
    scanning, resume = threading.Event(), threading.Event()
    nvme_keys = mgr.nvme.keys

    def slow_keys() -> object:  # the NVMe scan, held open while the loop runs other calls
        scanning.set()
        resume.wait(10)
        return nvme_keys()

    async def main() -> None:
        assert await put(mgr, 1, NS_B, 1) == Status.OK
        assert await put(mgr, 2, NS_B, 2) == Status.OK
        mgr.nvme.keys = slow_keys  # type: ignore[method-assign]
        task = asyncio.create_task(mgr.invalidate(NS_B))  # collects key(1) and key(2) from DRAM, then scans NVMe
        while not scanning.is_set():
            await asyncio.sleep(0.001)
        assert await mgr.delete([key(1)]) == 1  # B's block goes ...
        assert await put(mgr, 1, NS_A, 7) == Status.OK  # ... and A writes that key
        resume.set()
        assert await task == 1  # B's other block only
        meta = mgr.dram.meta(key(1))
        assert meta is not None and meta.namespace == NS_A  # A's block stayed
        assert mgr.dram.meta(key(2)) is None

    asyncio.run(main())

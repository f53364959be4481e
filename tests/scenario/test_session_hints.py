"""Session hints through the real tier manager (DRAM arena + NVMe tier) under a controlled clock:
closed sessions' blocks go first in both tiers, shared ones stay, idle sessions expire, tenants
close only their own sessions, bookkeeping stays bounded."""

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
from kvstore.errors import PermissionDenied
from kvstore.keys import NO_PARENT, ChunkKey
from kvstore.node.manager import Status, TierManager
from kvstore.node.sessions import SessionHinted, Sessions, hinted
from tiers.arena import Arena
from tiers.base import TierKind
from tiers.dram import DRAMTier
from tiers.nvme import NVMeTier
from tiers.policy import LRUPolicy, PrefixReusePolicy

MiB = 1 << 20


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


def build(
    tmp_path: Path, clock: FakeClock, *, dram_blocks: int = 4, nvme_blocks: int = 0, policy: Any = LRUPolicy, **kw: Any
) -> TierManager:
    sessions = Sessions(idle_ttl=60.0, clock=clock, **kw)
    arena = Arena.create(f"/dev/shm/kvstore-sess-{uuid.uuid4().hex}.arena", dram_blocks * MiB)
    nv = None
    if nvme_blocks:
        # a record is a header page plus the payload: room for exactly nvme_blocks of them
        nv = NVMeTier(
            tmp_path / f"nvme-{uuid.uuid4().hex[:6]}",
            nvme_blocks * (MiB + 4096),
            policy=hinted(policy(), sessions),
            segment_bytes=nvme_blocks * (MiB + 4096),
        )
    return TierManager(DRAMTier(arena, policy=hinted(policy(), sessions)), nv, clock=clock, sessions=sessions)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def mgr(tmp_path: Path, clock: FakeClock) -> Iterator[TierManager]:
    m = build(tmp_path, clock)
    yield m
    m.close()


async def put(
    m: TierManager, i: int, *, session: str | None = None, tenant: str | None = None, parent: int | None = None
) -> Status:
    data = np.full(MiB, i % 251, dtype=np.uint8)
    meta = BlockMeta.for_payload(key(i), data, parent=key(parent) if parent is not None else NO_PARENT)
    (r,) = await m.reserve([meta], session=session, tenant=tenant)
    if r.status != Status.OK:
        return r.status
    m.dram.arena.write(list(r.extents), memoryview(data))
    (st,) = await m.commit([r.reservation_id])
    return st


async def read(m: TierManager, i: int, *, session: str | None = None) -> bool:
    (x,) = await m.acquire([key(i)], session=session)
    if x.status == Status.OK:
        m.release([x.lease_id])
    return x.status == Status.OK


def test_closed_sessions_blocks_go_first_and_shared_ones_stay(mgr: TierManager) -> None:
    async def go() -> None:
        assert await put(mgr, 0, session="a") == Status.OK  # a system prompt both sessions use
        assert mgr.match_prefix([key(0)], session="b")[0] == 1
        assert await put(mgr, 1, session="a", parent=0) == Status.OK
        assert await put(mgr, 2, session="b", parent=0) == Status.OK
        assert await read(mgr, 1, session="a")  # block 1 is now the most recently used: LRU would keep it
        assert mgr.close_session("a") == 1  # block 1 only: block 0 is shared with open session b
        assert await put(mgr, 3) == Status.OK  # the tier is full: one block must go
        assert await put(mgr, 4) == Status.OK
        assert mgr.where(key(1)) is None, "the closed session's own block is the first victim"
        assert mgr.where(key(0)) == TierKind.DRAM, "the block shared with an open session stays"
        # without the close, plain LRU would have evicted block 0 (least recently used) first
        assert mgr.close_session("a") is None  # closed already: unknown
        assert mgr.stats()["counters"]["sessions_close_unknown"] == 1

    asyncio.run(go())


def test_without_session_ids_it_is_the_policy_itself(tmp_path: Path, clock: FakeClock) -> None:
    async def go(m: TierManager) -> list[TierKind | None]:
        for i in range(12):
            assert await put(m, i, parent=i - 1 if i % 3 else None) == Status.OK
            if i % 4 == 0:
                await read(m, i // 2)
        return [m.where(key(i)) for i in range(12)]

    plain = TierManager(
        DRAMTier(Arena.create(f"/dev/shm/kvstore-sess-{uuid.uuid4().hex}.arena", 4 * MiB), policy=PrefixReusePolicy()),
        None,
        clock=clock,
    )
    hinted_m = build(tmp_path, clock, policy=PrefixReusePolicy)
    try:
        assert isinstance(hinted_m.dram.policy, SessionHinted)
        assert asyncio.run(go(plain)) == asyncio.run(go(hinted_m))
    finally:
        plain.close()
        hinted_m.close()


def test_a_use_revives_a_dead_block(mgr: TierManager) -> None:
    async def go() -> None:
        for i in range(3):
            assert await put(mgr, i, session="a") == Status.OK
        assert mgr.close_session("a") == 3
        assert mgr.sessions is not None and mgr.sessions.is_dead(key(1))
        assert await read(mgr, 1)  # read without a session: someone still wants it
        assert not mgr.sessions.is_dead(key(1))
        assert mgr.match_prefix([key(2)], session="c")[0] == 1  # looked up by a new session: held again
        assert not mgr.sessions.is_dead(key(2))
        assert await put(mgr, 3) == Status.OK
        assert await put(mgr, 4) == Status.OK
        assert mgr.where(key(0)) is None  # the one block still dead went first
        assert mgr.where(key(1)) and mgr.where(key(2))

    asyncio.run(go())


def test_dead_blocks_are_demoted_first_then_evicted_first_from_nvme(tmp_path: Path, clock: FakeClock) -> None:
    m = build(tmp_path, clock, dram_blocks=2, nvme_blocks=3)

    async def go() -> None:
        assert await put(m, 0, session="keep") == Status.OK
        assert await put(m, 1, session="done") == Status.OK
        assert await read(m, 1, session="done")  # block 1 most recent in DRAM
        assert m.close_session("done") == 1
        assert await put(m, 2, session="keep") == Status.OK  # DRAM full: the dead block is demoted, not block 0
        assert m.where(key(1)) == TierKind.NVME and m.where(key(0)) == TierKind.DRAM
        assert await put(m, 3, session="keep") == Status.OK  # now block 0 is demoted
        assert m.where(key(0)) == TierKind.NVME
        assert await read(m, 0, session="keep")  # NVMe's most recent use is block 0; dead block 1 is older still
        for i in (4, 5, 6):
            assert await put(m, i, session="keep") == Status.OK
        await asyncio.sleep(0)
        assert m.where(key(1)) is None, "the dead block is the first NVMe victim"
        assert m.counters["nvme_evictions"] >= 1

    try:
        asyncio.run(go())
    finally:
        m.close()


def test_idle_sessions_close_after_the_ttl(mgr: TierManager, clock: FakeClock) -> None:
    async def go() -> None:
        assert await put(mgr, 1, session="idle") == Status.OK
        clock.advance(59)
        assert await put(mgr, 2, session="busy") == Status.OK
        mgr.reap()
        assert mgr.sessions is not None and len(mgr.sessions) == 2
        clock.advance(2)
        mgr.reap()
        assert len(mgr.sessions) == 1 and mgr.sessions.is_dead(key(1)) and not mgr.sessions.is_dead(key(2))
        assert mgr.stats()["counters"]["sessions_expired"] == 1

    asyncio.run(go())


def test_a_tenant_closes_only_its_own_sessions(mgr: TierManager) -> None:
    async def go() -> None:
        assert await put(mgr, 1, session="s", tenant="alice") == Status.OK
        assert await put(mgr, 2, session="s", tenant="bob") == Status.OK  # same id, another tenant: another session
        with pytest.raises(PermissionDenied, match="tenant 'carol'"):
            mgr.close_session("s", tenant="carol")
        assert mgr.close_session("s", tenant="alice") == 1
        assert mgr.sessions is not None and mgr.sessions.is_dead(key(1)) and not mgr.sessions.is_dead(key(2))
        with pytest.raises(PermissionDenied):
            mgr.close_session("s", tenant="alice")  # alice's is closed; bob's is not hers
        assert mgr.close_session("never", tenant="alice") is None
        assert mgr.close_session("s") == 1  # the admin closes any tenant's

    asyncio.run(go())


def test_bookkeeping_is_bounded(clock: FakeClock) -> None:
    s = Sessions(clock=clock, max_sessions=3, max_keys=64)
    for i in range(10):
        s.touch(None, f"s{i}", [key(1000 * i + j) for j in range(4)])
    assert len(s) == 3 and s.counters["sessions_evicted"] == 7
    for i in range(40):
        s.touch(None, "big", [key(i)])
    assert s.stats()["session_keys"] + s.stats()["dead_blocks"] <= 64
    assert s.counters["session_keys_untracked"] > 0  # one session tracks at most max_keys / 8 keys

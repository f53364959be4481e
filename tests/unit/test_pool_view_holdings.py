"""The holdings watch's two ends without a network: the node's ``HoldingsLog`` fed by real
tiers, the stream it serves (resume, resync), and the SDK's compact ``NodeHoldings`` index.
The same protocol over gRPC with real node processes: tests/integration/test_pool_view.py."""

from __future__ import annotations

import asyncio
import struct
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from client._holdings import MERGE_AT, NodeHoldings, best_holders, entries, key_hashes
from kvstore.block import BlockMeta
from kvstore.errors import InvalidArgument
from kvstore.keys import ChunkKey
from kvstore.node.watch import HoldingsLog, holdings_stream
from protos.kvstore.v1 import kvstore_pb2 as pb
from tiers.arena import Arena
from tiers.dram import DRAMTier
from tiers.nvme import NVMeTier

NS = b"ns-fp-01"


def key(i: int) -> ChunkKey:
    return ChunkKey(struct.pack("<QQ", 0xACE, i))  # differ only in the high half: the hash must fold it in


@pytest.fixture
def dram() -> Iterator[DRAMTier]:
    arena = Arena.create(f"/dev/shm/kvstore-test-{uuid.uuid4().hex}.arena", 64 * 1024 * 64, prefault=False)
    tier = DRAMTier(arena)
    yield tier
    tier.close()


@pytest.fixture
def nvme(tmp_path: Path) -> Iterator[NVMeTier]:
    tier = NVMeTier(tmp_path / "nvme", 4 << 20, segment_bytes=1 << 20, direct_io=False, sync=False)
    yield tier
    tier.close()


def put_dram(dram: DRAMTier, i: int) -> BlockMeta:
    meta = BlockMeta.for_payload(key(i), b"z", namespace=NS)
    ext = dram.reserve(1)
    assert ext is not None
    dram.commit(meta, ext)
    return meta


def put_nvme(nvme: NVMeTier, i: int) -> None:
    nvme.write_many([(BlockMeta.for_payload(key(i), b"z", namespace=NS), b"z")])


def changes(log: HoldingsLog, since: int) -> list[tuple[ChunkKey, int]]:
    got = log.since(since, 1 << 20)
    assert got is not None
    return [(k, c) for k, c, _, _ in got[1]]


# -- the node's log, told by the tiers ---------------------------------------------------------
def test_every_tier_change_is_a_delta_in_order(dram: DRAMTier, nvme: NVMeTier) -> None:
    log = HoldingsLog()
    log.attach(dram, nvme)
    put_dram(dram, 1)  # a put
    put_nvme(nvme, 1)  # demoted ...
    dram.delete(key(1))  # ... and evicted from DRAM: a move, two deltas
    put_dram(dram, 1)  # promoted back
    nvme.delete(key(1))  # gone from NVMe (evicted there, or deleted)
    dram.delete(key(1))
    assert changes(log, 0) == [
        (key(1), 0x01),
        (key(1), 0x02),
        (key(1), 0x10),
        (key(1), 0x01),
        (key(1), 0x20),
        (key(1), 0x10),
    ]
    assert log.revision == 6


def test_a_delta_carries_the_namespace_of_what_is_stored(dram: DRAMTier) -> None:
    log = HoldingsLog()
    log.attach(dram, None)
    put_dram(dram, 2)
    dram.delete(key(2))
    got = log.since(0)
    assert got is not None and got[0] == 1
    assert [d[2] for d in got[1]] == [NS, bytes(8)]


def test_the_ring_keeps_the_last_history_deltas_and_no_more(dram: DRAMTier) -> None:
    log = HoldingsLog(history=4)
    log.attach(dram, None)
    for i in range(6):
        put_dram(dram, i)
    assert log.since(1) is None  # revision 2 is gone: a subscriber there must resync
    first, deltas = log.since(2)  # type: ignore[misc]
    assert first == 3 and [d[0] for d in deltas] == [key(2), key(3), key(4), key(5)]
    assert log.since(6) == (7, [])  # up to date
    assert log.since(7) is None  # ahead: another incarnation's revision


def test_history_must_hold_a_delta() -> None:
    with pytest.raises(InvalidArgument, match="at least 1"):
        HoldingsLog(history=0)


# -- the stream one subscriber gets -------------------------------------------------------------
async def take(
    log: HoldingsLog, dram: DRAMTier, nvme: NVMeTier | None, req: pb.WatchHoldingsRequest, n: int
) -> list[pb.HoldingsUpdate]:
    out: list[pb.HoldingsUpdate] = []
    stream = holdings_stream(log, dram, nvme, req)
    async for m in stream:
        out.append(m)
        if len(out) == n:
            break
    await stream.aclose()
    return out


def test_a_new_subscriber_gets_a_snapshot_of_both_tiers_then_deltas(dram: DRAMTier, nvme: NVMeTier) -> None:
    log = HoldingsLog()
    log.attach(dram, nvme)
    put_dram(dram, 1)
    put_nvme(nvme, 1)
    put_nvme(nvme, 2)

    async def run() -> list[pb.HoldingsUpdate]:
        asyncio.get_running_loop().call_later(0.05, put_dram, dram, 3)
        return await take(log, dram, nvme, pb.WatchHoldingsRequest(heartbeat_ms=10_000), 3)

    snap_dram, snap_nvme, delta = asyncio.run(run())
    assert snap_dram.kind == pb.HOLDINGS_KIND_SNAPSHOT and not snap_dram.last and not snap_dram.resync
    assert snap_dram.keys == key(1) and snap_dram.changes == b"\x01" and snap_dram.namespaces == NS
    assert snap_nvme.last and snap_nvme.revision == 3 and set(snap_nvme.changes) == {0x02}
    assert sorted(snap_nvme.keys[i : i + 16] for i in (0, 16)) == sorted([key(1), key(2)])
    assert delta.kind == pb.HOLDINGS_KIND_DELTAS and delta.first_revision == 4 == delta.revision
    assert delta.keys == key(3) and delta.changes == b"\x01" and delta.incarnation == log.incarnation


def test_an_empty_node_says_its_snapshot_is_over(dram: DRAMTier, nvme: NVMeTier) -> None:
    log = HoldingsLog()
    log.attach(dram, nvme)
    (m,) = asyncio.run(take(log, dram, nvme, pb.WatchHoldingsRequest(), 1))
    assert m.kind == pb.HOLDINGS_KIND_SNAPSHOT and m.last and m.keys == b"" and m.revision == 0


def test_resuming_within_the_history_sends_only_what_was_missed(dram: DRAMTier) -> None:
    log = HoldingsLog(history=8)
    log.attach(dram, None)
    for i in range(5):
        put_dram(dram, i)
    req = pb.WatchHoldingsRequest(incarnation=log.incarnation, revision=3)
    (m,) = asyncio.run(take(log, dram, None, req, 1))
    assert m.kind == pb.HOLDINGS_KIND_DELTAS and (m.first_revision, m.revision) == (4, 5)
    assert m.keys == key(3) + key(4)


@pytest.mark.parametrize("why", ["revision too old", "another incarnation"])
def test_resuming_what_the_node_cannot_replay_resyncs(dram: DRAMTier, why: str) -> None:
    log = HoldingsLog(history=2)
    log.attach(dram, None)
    for i in range(5):
        put_dram(dram, i)
    inc = log.incarnation if why == "revision too old" else bytes(16)
    (m,) = asyncio.run(take(log, dram, None, pb.WatchHoldingsRequest(incarnation=inc, revision=1), 1))
    assert m.kind == pb.HOLDINGS_KIND_SNAPSHOT and m.resync and m.last and m.revision == 5
    assert log.resyncs == 1


def test_an_idle_stream_sends_heartbeats(dram: DRAMTier) -> None:
    log = HoldingsLog()
    log.attach(dram, None)
    snap, beat = asyncio.run(take(log, dram, None, pb.WatchHoldingsRequest(heartbeat_ms=10), 2))
    assert snap.kind == pb.HOLDINGS_KIND_SNAPSHOT
    assert beat.kind == pb.HOLDINGS_KIND_HEARTBEAT and beat.revision == 0 and beat.changed_unix_ns > 0


def test_closing_the_log_ends_its_streams(dram: DRAMTier) -> None:
    log = HoldingsLog()
    log.attach(dram, None)

    async def run() -> int:
        asyncio.get_running_loop().call_later(0.05, log.close)
        return len([m async for m in holdings_stream(log, dram, None, pb.WatchHoldingsRequest(heartbeat_ms=60_000))])

    assert asyncio.run(run()) == 1  # the snapshot, then the end
    assert log.subscribers == 0


@pytest.mark.parametrize(
    ("req", "match"),
    [
        (pb.WatchHoldingsRequest(incarnation=b"short"), "incarnation must be empty or 16 bytes"),
        (pb.WatchHoldingsRequest(heartbeat_ms=5), "heartbeat_ms"),
        (pb.WatchHoldingsRequest(heartbeat_ms=120_000), "heartbeat_ms"),
    ],
)
def test_bad_watch_requests_are_refused(dram: DRAMTier, req: pb.WatchHoldingsRequest, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        asyncio.run(take(HoldingsLog(), dram, None, req, 1))


# -- the SDK's compact index ------------------------------------------------------------------------
def test_key_hashes_take_16_byte_keys_packed_or_listed() -> None:
    keys = [key(i) for i in range(100)]
    listed, packed = key_hashes(keys), key_hashes(b"".join(keys))
    assert listed.dtype == np.uint64 and (listed == packed).all()
    assert not (listed & 3).any()  # the low bits carry an entry's tiers
    assert len(set(listed.tolist())) == 100  # keys that differ only in their high half differ
    with pytest.raises(InvalidArgument, match="16 bytes"):
        key_hashes([key(1), b"short"])
    with pytest.raises(InvalidArgument, match="16 bytes each"):
        key_hashes(b"x" * 17)


def test_holdings_snapshot_or_s_a_key_held_in_two_tiers() -> None:
    h = NodeHoldings()
    hs = key_hashes([key(1), key(2), key(1)])
    h.replace(entries(hs, np.array([1, 2, 2], np.uint8)))
    assert h.lookup(key_hashes([key(1), key(2), key(3)])).tolist() == [3, 2, 0]
    assert h.blocks == 2


def test_holdings_apply_sets_and_clears_tiers_in_order() -> None:
    h = NodeHoldings()
    h.replace(entries(key_hashes([key(1)]), np.array([1], np.uint8)))
    # key 1 moves to NVMe; key 2 arrives and leaves; key 3 arrives
    h.apply(key_hashes([key(1), key(1), key(2), key(2), key(3)]), np.array([0x02, 0x10, 0x01, 0x10, 0x01], np.uint8))
    assert h.lookup(key_hashes([key(1), key(2), key(3)])).tolist() == [2, 0, 1]
    assert h.blocks == 2
    h.apply(key_hashes([key(1), key(9)]), np.array([0x20, 0x20], np.uint8))  # dropping an unknown key: nothing
    assert h.lookup(key_hashes([key(1), key(9)])).tolist() == [0, 0]
    assert h.blocks == 1


def test_holdings_merge_recent_keys_into_the_arrays_without_losing_any() -> None:
    h = NodeHoldings()
    h.replace(entries(key_hashes([key(i) for i in range(0, 1000, 2)]), np.ones(500, np.uint8)))
    new = [key(i) for i in range(10_000, 10_000 + MERGE_AT)]
    h.apply(key_hashes([key(0)]), np.array([0x10], np.uint8))  # a dropped slot, reclaimed by the merge
    h.apply(key_hashes(new), np.full(len(new), 0x02, np.uint8))
    assert not h._recent  # merged (white box: the dict is what would grow)
    assert h.blocks == 499 + MERGE_AT
    got = h.lookup(key_hashes([key(0), key(2), key(1), new[0], new[-1]]))
    assert got.tolist() == [0, 1, 0, 2, 2]
    assert h.nbytes() == 8 * (499 + MERGE_AT)


def test_best_holders_prefers_dram_then_the_first_node_and_stops_at_the_first_gap() -> None:
    a, b = NodeHoldings(), NodeHoldings()
    a.replace(entries(key_hashes([key(1), key(2), key(4)]), np.array([2, 2, 1], np.uint8)))
    b.replace(entries(key_hashes([key(1), key(2), key(3)]), np.array([2, 1, 1], np.uint8)))
    hits, who, in_dram = best_holders([a, b], key_hashes([key(1), key(2), key(3), key(5), key(4)]))
    assert hits == 3
    assert who == [0, 1, 1] and in_dram == [False, True, True]  # both on NVMe: the first; then DRAM wins
    assert best_holders([], key_hashes([key(1)])) == (0, [], [])

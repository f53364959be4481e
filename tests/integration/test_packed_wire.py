"""Packed batches against a real node: clients that speak them and clients that do not
(an older SDK: the per-block messages) store and read the same blocks, with the same
answers per block, split at ``max_batch``; a node refuses malformed or oversized packed
requests up front and changes nothing.

One node serves the module, started with ``--max-batch 4``.
"""

from __future__ import annotations

import os
import struct
from typing import Any

import grpc
import numpy as np
import pytest
from conftest import NodeProcess
from small_batch_node import LIMIT, node, nothing_left_behind, stub  # noqa: F401 - fixtures

from client import KVClient
from client._transports import DataChannel, SharedMemory, Transport
from kvstore.block import BlockMeta, checksum
from kvstore.errors import InvalidArgument
from kvstore.wire import PACKED_VERSION, from_u64s, metas_to_packed
from protos.kvstore.v1 import kvstore_pb2 as pb
from protos.kvstore.v1 import kvstore_pb2_grpc as pb_grpc


class PerBlockShm(SharedMemory):
    """The shared-memory transport of an SDK that predates packed batches."""

    def connect(self, **kw: Any) -> None:
        super().connect(**kw)
        self.packed = False


class PerBlockDataChannel(DataChannel):
    def connect(self, **kw: Any) -> None:
        super().connect(**kw)
        self.packed = False


def client(node: NodeProcess, kind: str) -> KVClient:
    transports: dict[str, str | Transport] = {
        "shm": "shm",
        "shm-per-block": PerBlockShm(),
        "tcp": "data-channel",
        "tcp-per-block": PerBlockDataChannel(),
    }
    return KVClient(node.unix if kind.startswith("shm") else node.tcp, transport=transports[kind])


KINDS = ["shm", "shm-per-block", "tcp", "tcp-per-block"]


def payloads(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=1000 + 4096 * (i % 3), dtype=np.uint8) for i in range(n)]


def test_the_node_says_it_speaks_packed_batches(stub: pb_grpc.KVStoreStub) -> None:
    assert stub.Hello(pb.HelloRequest(), timeout=10).packed_version == PACKED_VERSION


@pytest.mark.parametrize("writer", KINDS)
@pytest.mark.parametrize("reader", KINDS)
def test_writers_and_readers_of_either_form_agree(node: NodeProcess, writer: str, reader: str) -> None:
    keys = [os.urandom(16) for _ in range(10)]  # three batches of at most 4
    data = payloads(10, 1)
    with client(node, writer) as w, client(node, reader) as r:
        assert w.put_many(keys[:3], data[:3]) == [True] * 3
        assert w.put_many(keys, data) == [True] * 10  # 3 already stored (EXISTS), 7 new
        missing = [os.urandom(16) for _ in range(3)]
        ask = [keys[0], missing[0], *keys[1:6], missing[1], *keys[6:], missing[2]]
        outs = [np.zeros(16384, np.uint8) for _ in ask]
        got = r.get_many_into(ask, outs)
        for c, kind in ((w, writer), (r, reader)):  # each spoke the form it is meant to
            assert getattr(c._core.transport, "packed", None) is (not kind.endswith("per-block"))
        want = dict(zip(keys, data))
        for k, g, o in zip(ask, got, outs):
            if k in want:
                assert g == want[k].nbytes and np.array_equal(o[:g], want[k])
            else:
                assert g is None
        # one output buffer too small: refused, and no lease is left behind (see the fixture)
        with pytest.raises(InvalidArgument):
            r.get_many_into(keys[:4], [np.zeros(16384, np.uint8)] * 3 + [np.zeros(10, np.uint8)])
        assert r.delete(keys) == 10


@pytest.mark.parametrize("writer", ["shm", "tcp"])
def test_checksums_of_packed_puts_reach_the_node(node: NodeProcess, stub: pb_grpc.KVStoreStub, writer: str) -> None:
    keys = [os.urandom(16) for _ in range(6)]
    data = payloads(6, 2)
    with client(node, writer) as w:
        assert w.put_many(keys, data) == [True] * 6
    # read back through the per-block messages: each block's checksum is its payload's xxh3
    resp = stub.Acquire(pb.KeysRequest(keys=keys[:LIMIT]), timeout=10)
    try:
        assert [x.block.payload_checksum for x in resp.leases] == [checksum(d) for d in data[:LIMIT]]
    finally:
        stub.Release(pb.ReleaseRequest(lease_ids=[x.lease_id for x in resp.leases]), timeout=10)
    # and through the packed columns
    resp = stub.Acquire(pb.KeysRequest(packed_keys=b"".join(keys[2:])), timeout=10)
    try:
        assert from_u64s(resp.packed.payload_checksums) == [checksum(d) for d in data[2:]]
        assert from_u64s(resp.packed.payload_lens) == [d.nbytes for d in data[2:]]
        assert list(resp.packed.statuses) == [pb.KEY_STATUS_OK] * 4 and not resp.leases
    finally:
        stub.Release(pb.ReleaseRequest(lease_ids=from_u64s(resp.packed.ids)), timeout=10)
    stub.Delete(pb.KeysRequest(keys=keys[:LIMIT]), timeout=10)
    stub.Delete(pb.KeysRequest(packed_keys=b"".join(keys[LIMIT:])), timeout=10)


def test_a_packed_acquire_answers_each_key(stub: pb_grpc.KVStoreStub, node: NodeProcess) -> None:
    k = os.urandom(16)
    with client(node, "shm") as c:
        assert c.put_many([k], [b"abc"]) == [True]
    resp = stub.Acquire(pb.KeysRequest(packed_keys=os.urandom(16) + k), timeout=10)
    p = resp.packed
    try:
        assert list(p.statuses) == [pb.KEY_STATUS_MISS, pb.KEY_STATUS_OK]
        ids = from_u64s(p.ids)
        assert ids[0] == 0 and ids[1] != 0
        assert struct.unpack("<2I", p.extent_counts) == (0, 1)
        assert list(p.tiers) == [pb.TIER_UNSPECIFIED, pb.TIER_DRAM]
    finally:
        stub.Release(pb.ReleaseRequest(lease_ids=[i for i in from_u64s(p.ids) if i]), timeout=10)
    stub.Delete(pb.KeysRequest(keys=[k]), timeout=10)


def packed_blocks(n: int) -> pb.PackedBlocks:
    p = metas_to_packed([BlockMeta.for_payload(os.urandom(16), b"p" * 10) for _ in range(n)])
    assert p is not None
    return p


@pytest.mark.parametrize(
    "call",
    [
        lambda s: s.Reserve(pb.ReserveRequest(packed=packed_blocks(LIMIT + 1)), timeout=10),
        lambda s: s.StartPut(pb.ReserveRequest(packed=packed_blocks(LIMIT + 1)), timeout=10),
        lambda s: s.Acquire(pb.KeysRequest(packed_keys=os.urandom(16 * (LIMIT + 1))), timeout=10),
        lambda s: s.StartGet(pb.KeysRequest(packed_keys=os.urandom(16 * (LIMIT + 1))), timeout=10),
        lambda s: s.Acquire(pb.KeysRequest(packed_keys=os.urandom(17)), timeout=10),
        lambda s: s.Reserve(pb.ReserveRequest(packed=pb.PackedBlocks(keys=os.urandom(16))), timeout=10),
    ],
    ids=["reserve-over", "startput-over", "acquire-over", "startget-over", "acquire-ragged", "reserve-ragged"],
)
def test_bad_packed_requests_are_refused_and_change_nothing(stub: pb_grpc.KVStoreStub, call: Any) -> None:
    before = stub.Stats(pb.Empty(), timeout=10)
    with pytest.raises(grpc.RpcError) as e:
        call(stub)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    after = stub.Stats(pb.Empty(), timeout=10)
    assert [(t.blocks, t.used_bytes) for t in after.tiers] == [(t.blocks, t.used_bytes) for t in before.tiers]

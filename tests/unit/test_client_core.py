"""The SDK's sans-I/O core on its own: its operations driven against an in-process fake
node and an in-process fake transport (the unit under test is the core's logic: batching
by ``max_batch`` and bytes, checksums, retries of keys the node could not bring into DRAM,
re-learning a node after ``Unavailable``, argument checks).  The real transports and
drivers are exercised against real nodes in tests/integration/test_sdk.py."""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import xxhash

from client import ClientOptions, KVClient, Timeouts, connect
from client._core import ClientCore
from client._instructions import RETRY, GetStream, Io, Op, PutStream, Rpc, RpcNoWait, instruction
from client._stats import Counters
from client._transports import Transport
from kvstore.block import BlockMeta
from kvstore.errors import InvalidArgument, Unavailable
from kvstore.keys import ChunkKey
from protos.kvstore.v1 import kvstore_pb2 as pb


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


class FakeNode:
    """The control calls a core makes, answered from a dict; ``fail`` raises on the next calls."""

    def __init__(self, *, max_batch: int = 64, max_block_bytes: int = 1 << 20) -> None:
        self.max_batch, self.max_block_bytes = max_batch, max_block_bytes
        self.blocks: dict[bytes, tuple[BlockMeta, bytes]] = {}
        self.calls: list[tuple[str, Any]] = []
        self.fail: list[BaseException] = []

    def call(self, method: str, request: Any) -> Any:
        self.calls.append((method, request))
        if self.fail:
            raise self.fail.pop(0)
        if method == "Hello":
            return pb.HelloResponse(
                node_id="fake", arena_size=1 << 30, max_block_bytes=self.max_block_bytes, max_batch=self.max_batch
            )
        keys = list(getattr(request, "keys", ()))
        assert len(keys) <= self.max_batch, f"{method} of {len(keys)} keys over max_batch={self.max_batch}"
        if method == "Lookup":
            return pb.LookupResponse(tiers=[pb.TIER_DRAM if k in self.blocks else pb.TIER_UNSPECIFIED for k in keys])
        if method == "MatchPrefix":
            n = next((i for i, k in enumerate(keys) if k not in self.blocks), len(keys))
            return pb.MatchPrefixResponse(matched=n, tiers=[pb.TIER_DRAM] * n)
        if method == "Delete":
            return pb.DeleteResponse(count=sum(self.blocks.pop(k, None) is not None for k in keys))
        if method == "ReportHits":
            return pb.Empty()
        raise AssertionError(f"the fake node does not answer {method}")

    def names(self) -> list[str]:
        return [m for m, _ in self.calls]


class FakeTransport(Transport):
    """Moves bytes straight into the fake node's dict.  ``no_space``: keys answered ``RETRY`` once
    each (as a node does when it cannot bring them into DRAM for this batch)."""

    name = "fake"

    def __init__(self, node: FakeNode, *, batch_bytes: int | None = None) -> None:
        self.node = node
        self.batch_bytes = batch_bytes  # type: ignore[misc]
        self.connects = 0
        self.put_batches: list[int] = []
        self.get_batches: list[int] = []
        self.no_space: set[bytes] = set()
        self.closed = False

    def connect(self, *, host: str, hello: pb.HelloResponse, timeouts: Any, tls: Any) -> None:
        self.connects += 1

    def put(self, metas: list[BlockMeta], views: list[memoryview], sid: str) -> Op[list[bool]]:
        self.put_batches.append(len(metas))

        def store() -> list[bool]:
            for m, v in zip(metas, views):
                self.node.blocks[m.key] = (m, bytes(v))
            return [True] * len(metas)

        return (yield Io(store))

    def get(self, keys: list[ChunkKey], outs: list[memoryview] | None, sid: str, *, verify: bool) -> Op[list[Any]]:
        self.get_batches.append(len(keys))
        result: list[Any] = []
        for i, k in enumerate(keys):
            if k in self.no_space:
                self.no_space.discard(k)
                result.append(RETRY)
            elif k not in self.node.blocks:
                result.append(None)
            else:
                data = self.node.blocks[k][1]
                if outs is None:
                    result.append(data)
                else:
                    outs[i][: len(data)] = data
                    result.append(len(data))
        yield from ()
        return result

    def close(self) -> None:
        self.closed = True


def drive(op: Op[Any], node: FakeNode) -> Any:
    """A driver: ``match`` over the core's instructions, as KVClient._run does."""
    try:
        instr = next(op)
        while True:
            try:
                match instruction(instr):
                    case Rpc(method, request) | RpcNoWait(method, request):
                        result = node.call(method, request)
                    case Io(fn):
                        result = fn()
                    case other:
                        raise AssertionError(f"unexpected {other}")
            except Exception as e:
                instr = op.throw(e)
                continue
            instr = op.send(result)
    except StopIteration as stop:
        return stop.value


def core_and_node(**node_kw: Any) -> tuple[ClientCore, FakeNode, FakeTransport]:
    node = FakeNode(**node_kw)
    transport = FakeTransport(node)
    return ClientCore("10.0.0.1:7000", transport=transport), node, transport


def test_put_and_get_go_through_the_transport_with_checksums_the_core_computed() -> None:
    core, node, transport = core_and_node()
    payloads = [bytes([i]) * (100 + i) for i in range(5)]
    keys = [key(i) for i in range(5)]
    assert drive(core.put_many(keys, payloads), node) == [True] * 5
    assert core.transport is transport and transport.connects == 1
    for k, p in zip(keys, payloads):  # a transport that does not hash while copying gets checksummed metadata
        meta, data = node.blocks[k]
        assert data == p and meta.payload_checksum == xxhash.xxh3_64_intdigest(p) and meta.payload_len == len(p)
    assert drive(core.get_many_into([*keys, key(99)], None), node) == [*payloads, None]
    out = bytearray(200)
    assert drive(core.get_many_into([keys[2]], [out]), node) == [len(payloads[2])]
    assert bytes(out[: len(payloads[2])]) == payloads[2]


def test_batches_respect_max_batch_and_the_transport_byte_budget() -> None:
    core, node, transport = core_and_node(max_batch=3)
    keys = [key(i) for i in range(7)]
    assert drive(core.put_many(keys, [b"x" * 100] * 7), node) == [True] * 7
    assert transport.put_batches == [3, 3, 1]
    assert drive(core.lookup(keys), node) == ["dram"] * 7
    assert [len(r.keys) for m, r in node.calls if m == "Lookup"] == [3, 3, 1]

    core, node, transport = core_and_node()
    transport.batch_bytes = 250  # type: ignore[misc]
    assert drive(core.put_many(keys[:5], [b"y" * 100] * 5), node) == [True] * 5
    assert transport.put_batches == [2, 2, 1]


def test_keys_the_node_could_not_bring_into_dram_are_retried_in_smaller_batches() -> None:
    core, node, transport = core_and_node()
    keys = [key(i) for i in range(8)]
    drive(core.put_many(keys, [bytes([i]) * 10 for i in range(8)]), node)
    transport.no_space = {keys[1], keys[5], keys[6]}
    assert drive(core.get_many_into(keys, None), node) == [bytes([i]) * 10 for i in range(8)]
    assert transport.get_batches == [8, 1, 1, 1]  # the 3 retried keys in batches of len(retry) // 2 = 1


def test_match_prefix_stops_at_the_first_gap_and_asks_nothing_after_it() -> None:
    core, node, _ = core_and_node(max_batch=2)
    keys = [key(i) for i in range(8)]
    drive(core.put_many(keys[:3], [b"z"] * 3), node)
    assert drive(core.match_prefix(keys), node) == (3, ["dram"] * 3)
    assert [len(r.keys) for m, r in node.calls if m == "MatchPrefix"] == [2, 2]


def test_a_block_over_the_nodes_max_block_bytes_is_refused_before_anything_is_sent() -> None:
    core, node, transport = core_and_node(max_block_bytes=64)
    with pytest.raises(InvalidArgument, match="max_block_bytes=64"):
        drive(core.put_many([key(1)], [b"a" * 65]), node)
    assert transport.put_batches == [] and node.blocks == {}


def test_unavailable_makes_the_next_operation_ask_hello_again() -> None:
    core, node, transport = core_and_node()
    two = [key(1), key(2)]  # (a one-key lookup needs no max_batch, so no Hello)
    assert drive(core.lookup(two), node) == [None, None]
    assert node.names() == ["Hello", "Lookup"]
    node.fail = [Unavailable("node down")]
    with pytest.raises(Unavailable):
        drive(core.lookup(two), node)
    assert core.stale
    assert drive(core.lookup(two), node) == [None, None]
    assert node.names() == ["Hello", "Lookup", "Lookup", "Hello", "Lookup"]
    assert transport.connects == 2 and not core.stale


def test_bad_arguments_raise_before_any_instruction() -> None:
    core, node, _ = core_and_node()
    for op in (
        core.put_many([key(1)], [b"a", b"b"]),
        core.put_many([key(1)], [b"a"], session="bad\nid"),
        core.get_many_into([key(1)], [bytearray(1), bytearray(1)]),
        core.lookup([b"short"]),
    ):
        with pytest.raises(InvalidArgument):
            drive(op, node)
    assert node.calls == []
    with pytest.raises(InvalidArgument, match="transport must be one of"):
        ClientCore("10.0.0.1:7000", transport="carrier-pigeon")


def test_zero_copy_views_need_the_shared_memory_transport() -> None:
    core, node, _ = core_and_node()
    with pytest.raises(InvalidArgument, match="zero-copy views need a unix:// target"):
        drive(core.acquire_views([key(1)]), node)
    assert core.arena is None


def test_best_effort_aborts_swallow_the_nodes_refusal_and_plain_ones_raise_it() -> None:
    core, node, _ = core_and_node(max_batch=2)
    drive(core.lookup([key(1), key(2)]), node)  # learn max_batch
    assert drive(core.abort_ids([1, 2, 3], quietly=True), node) is None  # the fake node refuses Abort
    assert [len(r.reservation_ids) for m, r in node.calls if m == "Abort"] == [2, 1]
    with pytest.raises(AssertionError, match="does not answer Abort"):
        drive(core.abort_ids([4]), node)


def test_close_closes_the_transport() -> None:
    core, node, transport = core_and_node()
    drive(core.lookup([key(1)]), node)
    core.close()
    assert transport.closed
    with pytest.raises(Unavailable, match="closed"):
        core.check_open()


def test_instructions_from_the_tuple_form_are_still_understood() -> None:
    req = pb.KeysRequest(keys=[key(1)])

    def chunks() -> Iterator[pb.BlockChunk]:
        yield pb.BlockChunk()

    assert instruction(("rpc", "Lookup", req)) == Rpc("Lookup", req)
    assert instruction(("rpc_nowait", "Release", req)) == RpcNoWait("Release", req)
    assert instruction(("put_stream", chunks, 3)) == PutStream(chunks, 3)
    assert instruction(("put_stream", chunks)) == PutStream(chunks, None)
    assert instruction(("get_stream", req)) == GetStream(req)
    assert instruction(Rpc("Stats", pb.Empty())) == Rpc("Stats", pb.Empty())
    with pytest.raises(AssertionError, match="unknown instruction"):
        instruction(("teleport", req))


def test_client_options_merge_keyword_arguments_and_refuse_unknown_or_doubled_ones() -> None:
    base = ClientOptions(timeouts=Timeouts(rpc=1.0), verify=False)
    assert ClientOptions.of(None, {"transport": "grpc-stream"}).transport == "grpc-stream"
    merged = ClientOptions.of(base, {"token": "t"})
    assert merged.token == "t" and merged.verify is False and merged.timeouts == Timeouts(rpc=1.0)
    assert ClientOptions.of(base, {}) is base
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        ClientOptions.of(None, {"tls_ca": "x"})
    with pytest.raises(InvalidArgument, match="verify given both"):
        ClientOptions.of(base, {"verify": True})
    with pytest.raises(dataclasses.FrozenInstanceError):
        base.verify = True  # type: ignore[misc]


def test_counters_read_zero_until_counted_and_refuse_a_name_no_node_reports() -> None:
    c = Counters({"puts": 3})
    assert c["puts"] == 3 and c["dram_evictions"] == 0  # known, not counted yet
    with pytest.raises(KeyError, match="no node counter named 'dram_evictons'"):
        c["dram_evictons"]
    assert json.loads(json.dumps({"counters": c})) == {"counters": {"puts": 3}}  # still a dict to print


def test_connect_returns_the_client_for_the_target_and_the_old_spelling_warns() -> None:
    # no node or etcd is reached: gRPC channels connect lazily, and wait_s=0 waits for no membership
    single = connect("127.0.0.1:1", ClientOptions(timeouts=Timeouts(rpc=0.5)))
    try:
        assert type(single) is KVClient and single.options.timeouts == Timeouts(rpc=0.5)
    finally:
        single.close()
    cluster = connect("etcd://127.0.0.1:1/c", wait_s=0, prefer_local=False)
    try:
        assert type(cluster).__name__ == "ClusterClient"
    finally:
        cluster.close()
    with pytest.warns(DeprecationWarning, match=r"use client.connect"):
        old = KVClient("etcd://127.0.0.1:1/c", wait_s=0, prefer_local=False)  # type: ignore[call-arg]
    try:
        assert type(old).__name__ == "ClusterClient"
    finally:
        old.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a single-node target does not warn
        KVClient("127.0.0.1:1").close()
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        connect("127.0.0.1:1", replication=2)  # a cluster option for one node

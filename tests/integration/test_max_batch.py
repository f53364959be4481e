"""``max_batch`` against a real node: requests over it are refused up front and store nothing;
the SDK splits every batch call to fit it, so a caller never meets it.

One node serves the module, started with ``--max-batch 4``.  Regression (PutStream over
the limit): the node used to commit each streamed block as it ended, so a stream of
``max_batch + 1`` blocks stored the first ``max_batch`` and then failed.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from conftest import NodeProcess
from small_batch_node import LIMIT, node, nothing_left_behind, stub  # noqa: F401 - fixtures

from client import AsyncKVClient, KVClient
from kvstore.block import BlockMeta, checksum
from kvstore.wire import BLOCKS_METADATA_KEY
from protos.kvstore.v1 import kvstore_pb2 as pb
from protos.kvstore.v1 import kvstore_pb2_grpc as pb_grpc

OVER = LIMIT + 1


def rkey() -> bytes:
    return os.urandom(16)


def info(key: bytes, payload: bytes) -> pb.BlockInfo:
    return pb.BlockInfo(key=key, payload_len=len(payload), payload_checksum=checksum(payload))


def refused(call: Callable[..., Any], request: Any, **kw: Any) -> str:
    """The call (a response stream drained) fails with INVALID_ARGUMENT naming the limit."""
    with pytest.raises(grpc.RpcError) as ei:
        result = call(request, timeout=10, **kw)
        if hasattr(result, "__next__"):
            list(result)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, ei.value.details()
    assert f"max_batch={LIMIT}" in ei.value.details()
    return ei.value.details()


def stored(stub: pb_grpc.KVStoreStub, keys: list[bytes]) -> list[bool]:
    out: list[bool] = []
    for i in range(0, len(keys), LIMIT):
        out += [
            t != pb.TIER_UNSPECIFIED for t in stub.Lookup(pb.KeysRequest(keys=keys[i : i + LIMIT]), timeout=10).tiers
        ]
    return out


def dram_used(stub: pb_grpc.KVStoreStub) -> int:
    (t,) = [t for t in stub.Stats(pb.Empty(), timeout=10).tiers if t.tier == pb.TIER_DRAM]
    return t.used_bytes


def stream(blocks: list[tuple[bytes, bytes]]) -> Iterator[pb.BlockChunk]:
    for k, v in blocks:
        yield pb.BlockChunk(block=info(k, v), data=v[: len(v) // 2])
        yield pb.BlockChunk(data=v[len(v) // 2 :])


def test_hello_advertises_the_limit(stub: pb_grpc.KVStoreStub) -> None:
    assert stub.Hello(pb.HelloRequest(), timeout=10).max_batch == LIMIT


def test_writes_over_the_limit_are_refused_and_store_nothing(stub: pb_grpc.KVStoreStub) -> None:
    blocks = [(rkey(), os.urandom(10_000 + i)) for i in range(OVER)]
    keys = [k for k, _ in blocks]
    used = dram_used(stub)
    refused(stub.Reserve, pb.ReserveRequest(blocks=[info(k, v) for k, v in blocks]))
    refused(stub.StartPut, pb.ReserveRequest(blocks=[info(k, v) for k, v in blocks]))
    # a stream cannot be counted before it is read: the node reserves and fills up to the
    # limit, then refuses the rest and aborts what it reserved (regression: it committed them)
    assert "none was stored" in refused(stub.PutStream, stream(blocks))
    assert stored(stub, keys) == [False] * OVER and dram_used(stub) == used
    refused(stub.Commit, pb.CommitRequest(reservation_ids=list(range(1, OVER + 1))))
    refused(stub.Abort, pb.AbortRequest(reservation_ids=list(range(1, OVER + 1))))
    # at the limit, the same calls work
    assert list(stub.PutStream(stream(blocks[:LIMIT]), timeout=10).statuses) == [pb.KEY_STATUS_OK] * LIMIT
    assert stored(stub, keys) == [True] * LIMIT + [False]
    assert stub.Delete(pb.KeysRequest(keys=keys[:LIMIT]), timeout=10).count == LIMIT


def test_put_stream_that_declares_too_many_blocks_is_refused_before_it_is_read(stub: pb_grpc.KVStoreStub) -> None:
    k, v = rkey(), os.urandom(50_000)
    more = threading.Event()

    def held() -> Iterator[pb.BlockChunk]:
        yield pb.BlockChunk(block=info(k, v), data=v)
        more.wait(10)  # the rest never comes while the call is open

    fut = stub.PutStream.future(held(), timeout=10, metadata=((BLOCKS_METADATA_KEY, str(OVER)),))
    try:
        with pytest.raises(grpc.RpcError) as ei:
            fut.result(timeout=5)  # answered while the client still holds the stream open
    finally:
        more.set()
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and f"max_batch={LIMIT}" in ei.value.details()
    assert stored(stub, [k]) == [False]
    # a declared count is an upper bound the node holds the stream to
    blocks = [(rkey(), os.urandom(1000)) for _ in range(3)]
    with pytest.raises(grpc.RpcError) as ei:
        stub.PutStream(stream(blocks), timeout=10, metadata=((BLOCKS_METADATA_KEY, "2"),))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "declared" in ei.value.details()
    assert stored(stub, [b for b, _ in blocks]) == [False] * 3
    ok = stub.PutStream(stream(blocks), timeout=10, metadata=((BLOCKS_METADATA_KEY, "3"),))
    assert list(ok.statuses) == [pb.KEY_STATUS_OK] * 3
    assert stub.Delete(pb.KeysRequest(keys=[b for b, _ in blocks]), timeout=10).count == 3


def test_put_stream_refused_midway_stores_none_of_its_blocks(stub: pb_grpc.KVStoreStub) -> None:
    blocks = [(rkey(), os.urandom(20_000)) for _ in range(3)]
    used = dram_used(stub)

    def short_last() -> Iterator[pb.BlockChunk]:
        yield from stream(blocks[:2])
        k, v = blocks[2]
        yield pb.BlockChunk(block=info(k, v), data=v[:100])  # the stream ends 19,900 bytes early

    with pytest.raises(grpc.RpcError) as ei:
        stub.PutStream(short_last(), timeout=10)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "carried 100 bytes" in ei.value.details()
    assert stored(stub, [k for k, _ in blocks]) == [False] * 3 and dram_used(stub) == used


def test_reads_and_key_calls_over_the_limit_are_refused(stub: pb_grpc.KVStoreStub) -> None:
    keys = [rkey() for _ in range(OVER)]
    payload = b"kept"
    assert (
        list(stub.PutStream(stream([(k, payload) for k in keys[:LIMIT]]), timeout=10).statuses)
        == [pb.KEY_STATUS_OK] * LIMIT
    )
    over = pb.KeysRequest(keys=keys)
    for call in (stub.Acquire, stub.StartGet, stub.GetStream, stub.Lookup, stub.MatchPrefix, stub.Delete, stub.Unpin):
        refused(call, over)
    refused(stub.Pin, pb.PinRequest(keys=keys, ttl_s=5))
    refused(stub.Release, pb.ReleaseRequest(lease_ids=list(range(1, OVER + 1))))
    assert stored(stub, keys) == [True] * LIMIT + [False]  # the refused Delete deleted nothing
    assert stub.Stats(pb.Empty(), timeout=10).pins == 0
    assert stub.Delete(pb.KeysRequest(keys=keys[:LIMIT]), timeout=10).count == LIMIT


# -- the SDK never meets the limit ----------------------------------------------------------
N = 3 * LIMIT + 1


def payloads(n: int) -> list[bytes]:
    return [os.urandom(4096 + 37 * i) for i in range(n)]


@pytest.mark.parametrize("path", ["shm", "data-channel", "grpc-stream"])
def test_sdk_batch_calls_of_three_times_the_limit(node: NodeProcess, path: str) -> None:
    target = node.unix if path == "shm" else node.tcp
    keys, datas = [rkey() for _ in range(N)], payloads(N)
    with KVClient(target, transport=path) as kv:
        assert kv.put_many(keys, datas) == [True] * N
        assert kv.get_many(keys) == datas
        outs = [np.zeros(len(d), np.uint8) for d in datas]
        assert kv.get_many_into(keys, outs) == [len(d) for d in datas]
        assert [o.tobytes() for o in outs] == datas
        assert kv.exists(keys + [rkey()]) == [True] * N + [False]
        assert kv.lookup(keys) == ["dram"] * N
        assert kv.match_prefix(keys) == N
        gap = keys[: 2 * LIMIT + 1] + [rkey()] + keys[2 * LIMIT + 1 :]
        assert kv.match_prefix_tiers(gap) == (2 * LIMIT + 1, ["dram"] * (2 * LIMIT + 1))
        assert kv.pin(keys, ttl=30) == N and kv.unpin(keys) == N
        assert kv.delete(keys) == N
        assert kv.exists(keys) == [False] * N


def test_async_sdk_batch_calls_of_three_times_the_limit(node: NodeProcess) -> None:
    keys, datas = [rkey() for _ in range(N)], payloads(N)

    async def go() -> None:
        async with AsyncKVClient(node.tcp) as kv:
            assert await kv.put_many(keys, datas) == [True] * N
            assert await kv.get_many(keys) == datas
            assert await kv.match_prefix(keys) == N
            assert await kv.delete(keys) == N

    asyncio.run(go())


def test_zero_copy_views_of_three_times_the_limit(node: NodeProcess) -> None:
    keys, datas = [rkey() for _ in range(N)], payloads(N)
    metas = [BlockMeta.for_payload(k, d) for k, d in zip(keys, datas)]
    with KVClient(node.unix) as kv:
        with kv.reserve(metas) as r:
            for views, d in zip(r.views, datas):
                assert views is not None
                pos = 0
                for v in views:
                    v[:] = d[pos : pos + v.nbytes]
                    pos += v.nbytes
            assert r.commit() == [True] * N
        with kv.acquire(keys) as held:
            assert [b"".join(bytes(v) for v in views) for views in held.views] == datas
        assert held.valid == [True] * N
        # an uncommitted reservation of many blocks is aborted whole on leaving the block
        more = [BlockMeta.for_payload(rkey(), d) for d in datas]
        with kv.reserve(more) as r:
            assert all(v is not None for v in r.views)
        assert kv.stats()["reservations"] == 0 and kv.exists([m.key for m in more]) == [False] * N
        assert kv.delete(keys) == N

"""Bad input against a real node: every mistake gets the right gRPC status and a clear
SDK exception, and the node stays up and loses nothing.

One node serves the whole module, started with small limits (``KVSTORE_MAX_BATCH=8``,
``KVSTORE_MAX_BLOCK_BYTES=2MiB``).  Blocks stored at the start are checked after every
test, together with the node's reservation count: a rejected write must leave nothing
reserved behind.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from conftest import NodeProcess

from client import InvalidArgument, KVClient
from kvstore.block import checksum
from kvstore.node.datachannel import COUNT, OP_GET, OP_PUT, REPLY, REPLY_MAGIC, REQUEST, REQUEST_MAGIC
from protos.kvstore.v1 import kvstore_pb2 as pb
from protos.kvstore.v1 import kvstore_pb2_grpc as pb_grpc

MiB = 1 << 20
MAX_BATCH = 8
MAX_BLOCK = 2 * MiB


def rkey() -> bytes:
    return os.urandom(16)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    env = {"KVSTORE_MAX_BATCH": str(MAX_BATCH), "KVSTORE_MAX_BLOCK_BYTES": "2MiB"}
    n = NodeProcess(tmp_path_factory.mktemp("bad") / "node", "--dram", "64MiB", "--nvme", "0", env=env).start()
    yield n
    assert n.stop(timeout=30) == 0
    Path(f"/dev/shm/kvstore-test-{n.node_id}.arena").unlink(missing_ok=True)


@pytest.fixture(scope="module")
def channel(node: NodeProcess) -> Iterator[grpc.Channel]:
    ch = grpc.insecure_channel(node.tcp, options=[("grpc.max_send_message_length", 80 * MiB)])
    yield ch
    ch.close()


@pytest.fixture(scope="module")
def stub(channel: grpc.Channel) -> pb_grpc.KVStoreStub:
    return pb_grpc.KVStoreStub(channel)


@pytest.fixture(scope="module")
def stored(node: NodeProcess) -> dict[bytes, bytes]:
    blocks = {rkey(): os.urandom(n) for n in (1, 4096, MiB)}
    with KVClient(node.unix) as kv:
        assert kv.put_many(list(blocks), list(blocks.values())) == [True] * 3
    return blocks


@pytest.fixture(autouse=True)
def node_survives(node: NodeProcess, stored: dict[bytes, bytes]) -> Iterator[None]:
    yield
    assert node.proc is not None and node.proc.poll() is None, "".join(node.output)
    with KVClient(node.tcp) as kv:
        assert kv.get_many(list(stored)) == list(stored.values())
        assert wait_for(lambda: kv.stats()["reservations"] == 0)


def wait_for(cond: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def stats(stub: pb_grpc.KVStoreStub) -> pb.StatsResponse:
    return stub.Stats(pb.Empty(), timeout=10)


def dram_used(stub: pb_grpc.KVStoreStub) -> int:
    (t,) = [t for t in stats(stub).tiers if t.tier == pb.TIER_DRAM]
    return t.used_bytes


def fails(call: Callable[..., Any], request: Any, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT) -> str:
    """Make the call (draining a response stream), check its status; return its details."""
    with pytest.raises(grpc.RpcError) as ei:
        result = call(request, timeout=10)
        if hasattr(result, "__next__"):  # a response stream: the error comes while reading it
            list(result)
    err = ei.value
    assert err.code() == code, (err.code(), err.details())
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        assert ("kvstore-error", "InvalidArgument") in [(m.key, m.value) for m in err.trailing_metadata()]
    return err.details()


def block(key: bytes, payload: bytes = b"", **kw: Any) -> pb.BlockInfo:
    info = {"key": key, "payload_len": len(payload), "payload_checksum": checksum(payload), **kw}
    return pb.BlockInfo(**info)


def chunks(*items: pb.BlockChunk) -> Iterator[pb.BlockChunk]:
    return iter(items)


# -- keys -------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 15, 17])
def test_wrong_key_length_is_caught_by_the_sdk(n: int) -> None:
    bad = b"k" * n
    # nothing listens here: InvalidArgument (not Unavailable) proves the check is client-side
    with KVClient("127.0.0.1:1") as kv:
        for call in (
            lambda: kv.put(bad, b"x"),
            lambda: kv.put(rkey(), b"x", parent=bad),
            lambda: kv.put_many([rkey(), bad], [b"x", b"y"]),
            lambda: kv.get(bad),
            lambda: kv.get_into(bad, bytearray(4)),
            lambda: kv.get_many([rkey(), bad]),
            lambda: kv.get_many_into([bad], [bytearray(4)]),
            lambda: kv.exists([bad]),
            lambda: kv.lookup([bad]),
            lambda: kv.match_prefix([rkey(), bad]),
            lambda: kv.match_prefix_tiers([bad]),
            lambda: kv.delete([bad]),
            lambda: kv.pin([bad], 5.0),
            lambda: kv.unpin([bad]),
        ):
            with pytest.raises(InvalidArgument, match="16 bytes"):
                call()
        with pytest.raises(InvalidArgument, match="16 bytes"):
            kv.get("not bytes")  # type: ignore[arg-type]


@pytest.mark.parametrize("n", [15, 17])
def test_wrong_key_length_is_rejected_by_the_node(stub: pb_grpc.KVStoreStub, n: int) -> None:
    bad = b"k" * n
    keys = pb.KeysRequest(keys=[rkey(), bad])
    for call in (stub.Lookup, stub.MatchPrefix, stub.Acquire, stub.StartGet, stub.Delete, stub.Unpin, stub.GetStream):
        assert "16 bytes" in fails(call, keys)
    fails(stub.Pin, pb.PinRequest(keys=[bad], ttl_s=5))
    for info in (block(bad, b"x"), block(rkey(), b"x", parent=bad), block(rkey(), b"x", namespace=b"ns")):
        fails(stub.Reserve, pb.ReserveRequest(blocks=[info]))
        fails(stub.StartPut, pb.ReserveRequest(blocks=[info]))
        fails(stub.PutStream, chunks(pb.BlockChunk(block=info, data=b"x")))
    assert "8 bytes" in fails(stub.Invalidate, pb.InvalidateRequest(namespace=b"k" * 7))
    assert stats(stub).reservations == 0


# -- limits -----------------------------------------------------------------------------


def test_batches_over_max_batch(node: NodeProcess, stub: pb_grpc.KVStoreStub) -> None:
    hello = stub.Hello(pb.HelloRequest(), timeout=10)
    assert hello.max_batch == MAX_BATCH and hello.max_block_bytes == MAX_BLOCK
    ok = pb.KeysRequest(keys=[rkey() for _ in range(MAX_BATCH)])
    assert list(stub.Lookup(ok, timeout=10).tiers) == [pb.TIER_UNSPECIFIED] * MAX_BATCH
    over = pb.KeysRequest(keys=[rkey() for _ in range(MAX_BATCH + 1)])
    for call in (stub.Lookup, stub.MatchPrefix, stub.Acquire, stub.StartGet, stub.Delete, stub.Unpin, stub.GetStream):
        assert "max_batch=8" in fails(call, over)
    fails(stub.Pin, pb.PinRequest(keys=over.keys, ttl_s=5))
    infos = [block(rkey(), b"x") for _ in range(MAX_BATCH + 1)]
    fails(stub.Reserve, pb.ReserveRequest(blocks=infos))
    fails(stub.StartPut, pb.ReserveRequest(blocks=infos))
    fails(stub.Commit, pb.CommitRequest(reservation_ids=list(range(1, MAX_BATCH + 2))))
    assert "max_batch" in fails(stub.PutStream, iter([pb.BlockChunk(block=i, data=b"x") for i in infos]))
    assert stats(stub).reservations == 0

    with KVClient(node.unix) as kv:
        # every batch call of the SDK is split to fit the node's limit
        keys = [rkey() for _ in range(3 * MAX_BATCH + 1)]
        datas = [os.urandom(100 + i) for i in range(len(keys))]
        assert kv.put_many(keys, datas) == [True] * len(keys)
        assert kv.get_many(keys) == datas
        assert kv.lookup(keys) == ["dram"] * len(keys) and kv.match_prefix(keys) == len(keys)
        assert kv.delete(keys) == len(keys)


def test_block_over_max_block_bytes(node: NodeProcess, stub: pb_grpc.KVStoreStub) -> None:
    info = pb.BlockInfo(key=rkey(), payload_len=MAX_BLOCK + 1)
    assert "max_block_bytes" in fails(stub.Reserve, pb.ReserveRequest(blocks=[info]))
    fails(stub.StartPut, pb.ReserveRequest(blocks=[info]))
    fails(stub.PutStream, chunks(pb.BlockChunk(block=info, data=b"x")))
    for target in (node.unix, node.tcp):
        with KVClient(target) as kv:
            with pytest.raises(InvalidArgument, match="max_block_bytes"):
                kv.put(rkey(), bytes(MAX_BLOCK + 1))
            k = rkey()
            assert kv.put(k, np.ones(MAX_BLOCK, np.uint8)) and kv.get(k) == bytes([1]) * MAX_BLOCK  # at the limit: fine
            assert kv.delete([k]) == 1


def test_block_info_that_contradicts_itself(stub: pb_grpc.KVStoreStub) -> None:
    bad = [
        pb.BlockInfo(key=rkey(), dtype="float16", shape=[4, 4], payload_len=33),
        pb.BlockInfo(key=rkey(), dtype="complex64", payload_len=8),
        pb.BlockInfo(key=rkey(), dtype="uint8", shape=[1] * 9, payload_len=1),
    ]
    for info in bad:
        fails(stub.Reserve, pb.ReserveRequest(blocks=[info]))
        fails(stub.StartPut, pb.ReserveRequest(blocks=[info]))
        fails(stub.PutStream, chunks(pb.BlockChunk(block=info, data=b"x")))
    assert "contradicts" in fails(stub.Reserve, pb.ReserveRequest(blocks=bad[:1]))
    assert "dtype" in fails(stub.Reserve, pb.ReserveRequest(blocks=bad[1:2]))
    assert stats(stub).reservations == 0


def test_oversized_and_malformed_messages(channel: grpc.Channel, stub: pb_grpc.KVStoreStub) -> None:
    fails(stub.Lookup, pb.KeysRequest(keys=[b"x" * (65 * MiB)]), grpc.StatusCode.RESOURCE_EXHAUSTED)
    raw = channel.unary_unary("/kvstore.v1.KVStore/Lookup")
    assert "malformed" in fails(raw, b"\xff\xff\xff\xff")
    raw_put = channel.stream_unary("/kvstore.v1.KVStore/PutStream")
    fails(raw_put, iter([b"\x0a\xff\xff"]))
    fails(channel.unary_unary("/kvstore.v1.KVStore/NoSuchMethod"), b"", grpc.StatusCode.UNIMPLEMENTED)


# -- the streaming put ------------------------------------------------------------------


def test_put_stream_that_ends_early_leaves_nothing(stub: pb_grpc.KVStoreStub) -> None:
    used = dram_used(stub)
    payload = os.urandom(100_000)
    k = rkey()
    head = pb.BlockChunk(block=block(k, payload), data=payload[:40_000])
    details = fails(stub.PutStream, chunks(head, pb.BlockChunk(data=payload[40_000:60_000])))
    assert "60000 bytes" in details and "100000" in details
    assert list(stub.Lookup(pb.KeysRequest(keys=[k]), timeout=10).tiers) == [pb.TIER_UNSPECIFIED]
    s = stats(stub)
    assert s.reservations == 0 and dram_used(stub) == used
    # the same block, whole, is then accepted
    whole = chunks(pb.BlockChunk(block=block(k, payload), data=payload[:50_000]), pb.BlockChunk(data=payload[50_000:]))
    assert list(stub.PutStream(whole, timeout=10).statuses) == [pb.KEY_STATUS_OK]
    assert stub.Delete(pb.KeysRequest(keys=[k]), timeout=10).count == 1
    assert dram_used(stub) == used


def test_put_stream_whose_client_goes_away_leaves_nothing(stub: pb_grpc.KVStoreStub) -> None:
    used = dram_used(stub)
    k = rkey()
    payload = os.urandom(MAX_BLOCK)
    gate = threading.Event()

    def held_open() -> Iterator[pb.BlockChunk]:  # past a stage of bytes: the block is reserved
        yield pb.BlockChunk(block=block(k, payload), data=payload[: MAX_BLOCK * 3 // 4])
        gate.wait(10)

    fut = stub.PutStream.future(held_open(), timeout=20)
    try:
        assert wait_for(lambda: stats(stub).reservations == 1)
    finally:
        fut.cancel()
        gate.set()
    assert wait_for(lambda: stats(stub).reservations == 0)
    assert dram_used(stub) == used
    assert list(stub.Lookup(pb.KeysRequest(keys=[k]), timeout=10).tiers) == [pb.TIER_UNSPECIFIED]


def test_put_stream_with_too_many_bytes_or_no_header(stub: pb_grpc.KVStoreStub) -> None:
    used = dram_used(stub)
    k = rkey()
    payload = os.urandom(5000)
    assert "more bytes" in fails(stub.PutStream, chunks(pb.BlockChunk(block=block(k, payload), data=payload + b"!")))
    assert "block header" in fails(stub.PutStream, chunks(pb.BlockChunk(data=payload)))
    assert list(stub.Lookup(pb.KeysRequest(keys=[k]), timeout=10).tiers) == [pb.TIER_UNSPECIFIED]
    # a payload that does not match its checksum is refused per block, not stored
    corrupt = block(k, payload)
    corrupt.payload_checksum ^= 1
    assert list(stub.PutStream(chunks(pb.BlockChunk(block=corrupt, data=payload)), timeout=10).statuses) == [
        pb.KEY_STATUS_CORRUPT
    ]
    assert list(stub.Lookup(pb.KeysRequest(keys=[k]), timeout=10).tiers) == [pb.TIER_UNSPECIFIED]
    assert stats(stub).reservations == 0 and dram_used(stub) == used


# -- handles -----------------------------------------------------------------------------


def test_unknown_reservations_and_leases(stub: pb_grpc.KVStoreStub) -> None:
    r = stub.Commit(pb.CommitRequest(reservation_ids=[987654321]), timeout=10)
    assert list(r.statuses) == [pb.KEY_STATUS_EXPIRED]
    assert list(stub.Release(pb.ReleaseRequest(lease_ids=[987654321]), timeout=10).valid) == [False]
    stub.Abort(pb.AbortRequest(reservation_ids=[987654321]), timeout=10)
    # a reservation committed twice: the second commit finds nothing
    payload = b"twice"
    res = stub.Reserve(pb.ReserveRequest(blocks=[block(rkey(), payload)]), timeout=10)
    rid = res.reservations[0].reservation_id
    assert list(stub.Commit(pb.CommitRequest(reservation_ids=[rid]), timeout=10).statuses) == [pb.KEY_STATUS_OK]
    assert list(stub.Commit(pb.CommitRequest(reservation_ids=[rid]), timeout=10).statuses) == [pb.KEY_STATUS_EXPIRED]
    fails(stub.Commit, pb.CommitRequest(reservation_ids=[1, 2], payload_checksums=[1]))


@pytest.mark.parametrize("path", ["shm", "tcp", "grpc-stream"])
def test_get_into_a_buffer_too_small(node: NodeProcess, stub: pb_grpc.KVStoreStub, path: str) -> None:
    target = node.unix if path == "shm" else node.tcp
    with KVClient(target, transport="grpc-stream" if path == "grpc-stream" else "auto") as kv:
        k = rkey()
        data = os.urandom(10_000)
        assert kv.put(k, data)
        with pytest.raises(InvalidArgument, match="10000"):
            kv.get_into(k, bytearray(9_999))
        with pytest.raises(InvalidArgument):
            kv.get_many_into([k, k], [bytearray(10_000), np.empty(10, np.uint8)])
        # the leases taken for the failed reads are given back at once
        assert wait_for(lambda: stats(stub).leases == 0, timeout=2)
        out = bytearray(10_000)
        assert kv.get_into(k, out) == 10_000 and bytes(out) == data


# -- the data channel ----------------------------------------------------------------------


def data_conn(node: NodeProcess) -> socket.socket:
    host, port = node.endpoints["data"].rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=5)
    s.settimeout(2)
    return s


def closed_at_once(s: socket.socket) -> bool:
    """The node hung up without writing anything (a FIN, or a reset for unread input)."""
    t0 = time.monotonic()
    try:
        got = s.recv(64)
    except ConnectionResetError:
        got = b""
    finally:
        s.close()
    return got == b"" and time.monotonic() - t0 < 1.0


def recv_exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        part = s.recv(n - len(buf))
        assert part, "connection closed early"
        buf += part
    return buf


@pytest.mark.parametrize(
    "first",
    [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        b"hello\n",
        REQUEST.pack(b"KVDX", OP_GET, bytes(16)),
        REQUEST.pack(REQUEST_MAGIC, 9, bytes(16)),
    ],
    ids=["http", "short", "bad-magic", "bad-op"],
)
def test_data_channel_drops_garbage(node: NodeProcess, first: bytes) -> None:
    s = data_conn(node)
    s.sendall(first)
    assert closed_at_once(s)


def test_data_channel_drops_unknown_transfer_ids(node: NodeProcess, stub: pb_grpc.KVStoreStub) -> None:
    used = dram_used(stub)
    s = data_conn(node)
    s.sendall(REQUEST.pack(REQUEST_MAGIC, OP_GET, os.urandom(16)))
    assert closed_at_once(s)
    s = data_conn(node)
    try:
        s.sendall(REQUEST.pack(REQUEST_MAGIC, OP_PUT, os.urandom(16)) + os.urandom(MiB))
    except (BrokenPipeError, ConnectionResetError):
        pass  # the node may hang up before we finish sending
    assert closed_at_once(s)
    assert dram_used(stub) == used and stats(stub).reservations == 0


def test_data_channel_transfer_ids_are_single_use(
    node: NodeProcess, stub: pb_grpc.KVStoreStub, stored: dict[bytes, bytes]
) -> None:
    key, data = next((k, v) for k, v in stored.items() if len(v) == 4096)
    sg = stub.StartGet(pb.KeysRequest(keys=[key]), timeout=10)
    assert sg.transfer_id and sg.leases[0].status == pb.KEY_STATUS_OK
    # a GET id presented as a PUT is refused (and not spent)
    s = data_conn(node)
    s.sendall(REQUEST.pack(REQUEST_MAGIC, OP_PUT, sg.transfer_id))
    assert closed_at_once(s)
    s = data_conn(node)
    s.sendall(REQUEST.pack(REQUEST_MAGIC, OP_GET, sg.transfer_id))
    assert REPLY.unpack(recv_exact(s, REPLY.size)) == (REPLY_MAGIC, 0)
    assert recv_exact(s, len(data)) == data
    s.close()
    s = data_conn(node)
    s.sendall(REQUEST.pack(REQUEST_MAGIC, OP_GET, sg.transfer_id))  # replayed
    assert closed_at_once(s)
    assert wait_for(lambda: stats(stub).leases == 0)

    k, payload = rkey(), os.urandom(70_000)
    sp = stub.StartPut(pb.ReserveRequest(blocks=[block(k, payload)]), timeout=10)
    assert list(sp.statuses) == [pb.KEY_STATUS_OK]
    s = data_conn(node)
    s.sendall(REQUEST.pack(REQUEST_MAGIC, OP_PUT, sp.transfer_id) + payload)
    head = recv_exact(s, REPLY.size + COUNT.size + 1)
    assert REPLY.unpack_from(head) == (REPLY_MAGIC, 0) and COUNT.unpack_from(head, REPLY.size) == (1,)
    assert head[-1] == pb.KEY_STATUS_OK
    s.close()
    s = data_conn(node)
    s.sendall(REQUEST.pack(REQUEST_MAGIC, OP_PUT, sp.transfer_id) + payload)
    assert closed_at_once(s)
    with KVClient(node.tcp) as kv:
        assert kv.get(k) == payload


def test_data_channel_put_cut_short_leaves_nothing(node: NodeProcess, stub: pb_grpc.KVStoreStub) -> None:
    used = dram_used(stub)
    k, payload = rkey(), os.urandom(200_000)
    sp = stub.StartPut(pb.ReserveRequest(blocks=[block(k, payload)]), timeout=10)
    s = data_conn(node)
    s.sendall(REQUEST.pack(REQUEST_MAGIC, OP_PUT, sp.transfer_id) + payload[:50_000])
    s.shutdown(socket.SHUT_WR)  # the client goes away mid-payload
    assert closed_at_once(s)
    assert wait_for(lambda: stats(stub).reservations == 0)
    assert dram_used(stub) == used
    assert list(stub.Lookup(pb.KeysRequest(keys=[k]), timeout=10).tiers) == [pb.TIER_UNSPECIFIED]
    assert stats(stub).counters["data_channel_aborted_puts"] >= 1


def test_a_refused_put_stream_of_one_byte_blocks_moves_nothing_and_refuses_no_one(tmp_path: Path) -> None:
    """Issue 24 (a held-out check): a stream of thousands of one-byte blocks, refused at the
    end (more than ``max_batch``), used to reserve a DRAM unit for each as its header came:
    every resident block was demoted and other clients' puts were refused meanwhile.  Its
    blocks now wait in memory until a stage's worth of bytes came: nothing is reserved."""
    from kvstore.children import private_node

    with private_node(tmp_path / "node", "--max-batch", "4096", dram="8MiB", nvme="64MiB") as n:
        channel = grpc.insecure_channel(n.endpoints["grpc"])
        stub = pb_grpc.KVStoreStub(channel)
        with KVClient(n.target) as kv, KVClient(n.target) as other:
            resident = [rkey() for _ in range(6)]
            assert kv.put_many(resident, [os.urandom(MiB)] * 6) == [True] * 6  # 6 of 8 MiB
            before = stats(stub).counters
            gate, reached = threading.Event(), threading.Event()
            ones = [block(rkey(), b"x") for _ in range(4097)]

            def flood() -> Iterator[pb.BlockChunk]:
                for i, info in enumerate(ones):
                    yield pb.BlockChunk(block=info, data=b"x")
                    if i == 3000:
                        reached.set()
                        gate.wait(20)  # open, 3,001 blocks sent: others put meanwhile

            fut = stub.PutStream.future(flood(), timeout=60)
            assert reached.wait(20)
            time.sleep(0.5)  # the node has read what was sent
            assert stats(stub).reservations == 0
            k = rkey()
            assert other.put(k, os.urandom(MiB)), "a put was refused while the stream was open"
            gate.set()
            with pytest.raises(grpc.RpcError) as ei:
                fut.result()
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_batch" in ei.value.details()
            after = stats(stub).counters
            # (the cleaner may have copied a block to NVMe ahead of time: it stays in DRAM)
            assert after.get("dram_evictions", 0) == before.get("dram_evictions", 0), "the stream evicted blocks"
            assert kv.lookup(resident) == ["dram"] * 6
            assert stats(stub).reservations == 0
            assert kv.lookup([i.key for i in ones[:5]]) == [None] * 5
        channel.close()

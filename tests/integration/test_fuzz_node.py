"""Property-based attack on a real node: random and mutated gRPC requests and data-channel frames.

Issue 13 ("Also"): whatever bytes a client sends, the node answers with a typed error (a
gRPC status of ``kvstore.errors``' mapping, never ``UNKNOWN`` or ``INTERNAL``, which mean
an exception escaped a handler) or closes a data-channel connection, and never crashes.

One node serves the module, with an admin token and one tenant, ``bob``; requests go out
as either, as raw bytes so that the node's own decoder sees them: messages built from
the descriptors with hostile values (``tests/proto_strategies.py``), the same serialized
and then mutated, and plain random bytes.  Data-channel connections get random first
frames, and frames naming a live transfer followed by mutated payloads.  After each test
the node must still be up, hold no reservation, and store and return a block byte for
byte; a block a mutated transfer stored must read back as the bytes its checksum names.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from conftest import NodeProcess, wait_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from proto_strategies import messages, mutated

from client import KVClient
from kvstore.block import BlockMeta, checksum
from kvstore.node.datachannel import OP_GET, OP_PUT, REPLY, REPLY_MAGIC, REQUEST, REQUEST_MAGIC
from kvstore.wire import meta_to_pb
from protos.kvstore.v1 import kvstore_pb2 as pb
from protos.kvstore.v1 import kvstore_pb2_grpc as pb_grpc

ADMIN, BOB = "fuzz-admin", "fuzz-bob"
SERVICE = pb.DESCRIPTOR.services_by_name["KVStore"]
TYPED = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.DATA_LOSS,
    grpc.StatusCode.UNAUTHENTICATED,
}
FUZZ = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    d = tmp_path_factory.mktemp("fuzz")
    cfg = d / "node.toml"
    # short TTLs: transfers refused before they started give their reservations and leases back soon
    cfg.write_text(
        f'[node]\ntoken = "{ADMIN}"\nmax_batch = 64\nmax_block_bytes = "4MiB"\nreservation_ttl_s = 2\nread_lease_ttl_s = 2\n\n'
        f'[tenants.bob]\ntoken = "{BOB}"\nmax_reserved_bytes = "8MiB"\nmax_dram_bytes = "16MiB"\n'
    )
    n = NodeProcess(d / "node", "--config", str(cfg), "--dram", "64MiB", "--nvme", "32MiB")
    n.env = {k: v for k, v in n.env.items() if not k.startswith("KVSTORE_")}
    n.start()
    yield n
    alive(n)
    assert "Traceback" not in "".join(n.output), "".join(n.output)[-4000:]
    assert n.stop(timeout=30) == 0
    Path(n.arena_path).unlink(missing_ok=True)


@pytest.fixture(scope="module")
def channel(node: NodeProcess) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(node.unix) as ch:
        yield ch


def md(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def stats(channel: grpc.Channel) -> pb.StatsResponse:
    return pb_grpc.KVStoreStub(channel).Stats(pb.Empty(), timeout=10, metadata=md(ADMIN))


def alive(node: NodeProcess) -> None:
    """Up, nothing left reserved, and a put and a get work byte for byte."""
    assert node.proc is not None and node.proc.poll() is None, "".join(node.output)[-4000:]
    with grpc.insecure_channel(node.unix) as ch:
        wait_for(lambda: stats(ch).reservations == 0, 15, "fuzzed transfers' reservations to be given back")
    data = os.urandom(100_000)
    k = os.urandom(16)
    for target in (node.unix, node.tcp):
        with KVClient(target, token=ADMIN) as kv:
            assert kv.put(k, data) and kv.get(k) == data


def _raw(data: st.DataObject, request_type: type) -> bytes:
    msg = data.draw(messages(request_type))
    how = data.draw(st.sampled_from(["message", "mutated", "random"]))
    if how == "message":
        return msg.SerializeToString()
    if how == "mutated":
        return data.draw(mutated(msg.SerializeToString()))
    return data.draw(st.binary(max_size=200))


def _typed(e: grpc.RpcError, method: str) -> None:
    assert e.code() in TYPED, f"{method}: {e.code()} {e.details()}"


UNARY = [m.name for m in SERVICE.methods if not m.client_streaming and not m.server_streaming]


@pytest.mark.parametrize("method", UNARY)
def test_unary_calls_answer_typed_errors(node: NodeProcess, channel: grpc.Channel, method: str) -> None:
    desc = SERVICE.methods_by_name[method]
    call = channel.unary_unary(f"/kvstore.v1.KVStore/{method}")
    from google.protobuf import message_factory

    request_type = message_factory.GetMessageClass(desc.input_type)

    @FUZZ
    @given(st.data(), st.sampled_from([ADMIN, BOB]))
    def check(data: st.DataObject, token: str) -> None:
        try:
            call(_raw(data, request_type), timeout=10, metadata=md(token))
        except grpc.RpcError as e:
            _typed(e, method)

    check()
    alive(node)


def test_put_streams_answer_typed_errors(node: NodeProcess, channel: grpc.Channel) -> None:
    call = channel.stream_unary("/kvstore.v1.KVStore/PutStream")

    @FUZZ
    @given(st.data(), st.sampled_from([ADMIN, BOB]), st.integers(1, 4))
    def check(data: st.DataObject, token: str, n: int) -> None:
        chunks = [_raw(data, pb.BlockChunk) for _ in range(n)]
        try:
            call(iter(chunks), timeout=10, metadata=md(token))
        except grpc.RpcError as e:
            _typed(e, "PutStream")

    check()
    alive(node)


def test_get_streams_answer_typed_errors(node: NodeProcess, channel: grpc.Channel) -> None:
    call = channel.unary_stream("/kvstore.v1.KVStore/GetStream")

    @FUZZ
    @given(st.data(), st.sampled_from([ADMIN, BOB]))
    def check(data: st.DataObject, token: str) -> None:
        try:
            for _ in call(_raw(data, pb.KeysRequest), timeout=10, metadata=md(token)):
                pass
        except grpc.RpcError as e:
            _typed(e, "GetStream")

    check()
    alive(node)


# -- the data channel ----------------------------------------------------------------------


def conn(node: NodeProcess) -> socket.socket:
    host, port = node.endpoints["data"].rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=5)
    s.settimeout(5)
    return s


def exchange(node: NodeProcess, sent: bytes) -> bytes:
    """Send ``sent`` on a new connection and end it (else the node keeps it for the next
    transfer); what the node writes back before it closes."""
    s = conn(node)
    try:
        s.sendall(sent)
        s.shutdown(socket.SHUT_WR)
    except OSError:  # the node hung up already
        pass
    return drain(s)


def drain(s: socket.socket) -> bytes:
    """Everything the node writes until it closes (or stops writing for a while)."""
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    finally:
        s.close()
    return out


_FRAME = REQUEST.pack(REQUEST_MAGIC, OP_GET, bytes(16))


@FUZZ
@given(
    st.one_of(
        st.binary(max_size=64),
        mutated(_FRAME),
        st.builds(REQUEST.pack, st.just(REQUEST_MAGIC), st.integers(0, 255), st.binary(min_size=16, max_size=16)),
    )
)
def test_random_first_frames_are_closed_without_a_word(node: NodeProcess, first: bytes) -> None:
    assert exchange(node, first) == b""


def test_random_first_frames_leave_the_node_serving(node: NodeProcess) -> None:
    alive(node)


@FUZZ
@given(st.data())
def test_mutated_transfers_store_only_what_their_checksums_name(
    node: NodeProcess, channel: grpc.Channel, data: st.DataObject
) -> None:
    stub = pb_grpc.KVStoreStub(channel)
    payload = data.draw(st.binary(min_size=0, max_size=3000))
    meta = BlockMeta.for_payload(os.urandom(16), payload)
    sp = stub.StartPut(pb.ReserveRequest(blocks=[meta_to_pb(meta)]), timeout=10, metadata=md(ADMIN))
    assert list(sp.statuses) == [pb.KEY_STATUS_OK]
    frame = REQUEST.pack(REQUEST_MAGIC, OP_PUT, sp.transfer_id)
    sent = data.draw(st.one_of(st.just(frame + payload), mutated(frame + payload)))
    reply = exchange(node, sent)
    assert reply == b"" or reply[:4] == REPLY_MAGIC
    tiers = stub.Lookup(pb.KeysRequest(keys=[meta.key]), timeout=10, metadata=md(ADMIN)).tiers
    if list(tiers) != [pb.TIER_UNSPECIFIED]:  # stored: exactly the bytes its checksum names
        with KVClient(node.unix, token=ADMIN) as kv:
            got = kv.get(meta.key)
        assert got is not None and checksum(got) == meta.payload_checksum and got == payload
    if sent == frame + payload:
        assert REPLY.unpack_from(reply) == (REPLY_MAGIC, 0) and reply[-1] == pb.KEY_STATUS_OK


@FUZZ
@given(st.data())
def test_mutated_get_frames_send_a_block_or_nothing(
    node: NodeProcess, channel: grpc.Channel, data: st.DataObject
) -> None:
    stub = pb_grpc.KVStoreStub(channel)
    payload = os.urandom(data.draw(st.integers(0, 3000)))
    key = os.urandom(16)
    with KVClient(node.unix, token=ADMIN) as kv:
        assert kv.put(key, payload)
    sg = stub.StartGet(pb.KeysRequest(keys=[key]), timeout=10, metadata=md(ADMIN))
    frame = REQUEST.pack(REQUEST_MAGIC, OP_GET, sg.transfer_id)
    sent = data.draw(mutated(frame))
    reply = exchange(node, sent)
    assert reply in (b"", REPLY.pack(REPLY_MAGIC, 0) + payload)
    if reply == b"":  # refused: the id was not spent, so its leases end at their deadline or now
        assert exchange(node, frame) == REPLY.pack(REPLY_MAGIC, 0) + payload
    wait_for(lambda: stats(channel).leases == 0, 10, "the transfer's leases to end")

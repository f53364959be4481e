"""SIGTERM drains for ``drain_timeout_s``, then cancels what still runs, and exits 0.

A node started with ``--drain-timeout 1`` is stopped while three operations hang: a
local writer holding a reservation it never commits, a put stream stalled half-way
through a block, and a get stream whose reader stopped reading.  The node must exit 0
within the drain plus a margin far below the default 10 s, and after a restart on the
same data directory every block committed before the SIGTERM is readable, byte for byte,
from NVMe, while none of the unfinished writes is.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from conftest import NodeProcess

from client import KVClient
from kvstore.block import BlockMeta, checksum
from kvstore.node.datachannel import COUNT, OP_PUT, REPLY, REQUEST, REQUEST_MAGIC
from protos.kvstore.v1 import kvstore_pb2 as pb
from protos.kvstore.v1 import kvstore_pb2_grpc as pb_grpc

MiB = 1 << 20
DRAIN_S = 1.0
MARGIN_S = 5.0  # start-up excluded: SIGTERM to exit, with a few MiB to demote


def wait_for(cond: Any, what: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what()}"
        time.sleep(0.02)


@pytest.mark.timeout(120)
def test_sigterm_cancels_what_outlives_the_drain_and_keeps_the_index_consistent(
    node_factory: Any, tmp_path: Any
) -> None:
    data_dir = tmp_path / "drained"
    node: NodeProcess = node_factory(
        "--dram", "64MiB", "--nvme", "256MiB", "--drain-timeout", str(DRAIN_S), data_dir=data_dir
    )
    committed = {os.urandom(16): os.urandom(MiB + i) for i in range(4)}
    big_key, big = os.urandom(16), os.urandom(4 * MiB)  # read by the stalled get stream, again and again
    reserved_key, stream_key = os.urandom(16), os.urandom(16)
    stream_payload = os.urandom(4 * MiB)

    kv = KVClient(node.unix)
    channel = grpc.insecure_channel(node.tcp)
    stub = pb_grpc.KVStoreStub(channel)
    resume = threading.Event()
    try:
        assert kv.put_many([*committed, big_key], [*committed.values(), big]) == [True] * 5
        # 1. a local writer that reserved and filled a block, and never commits it
        held = kv.reserve([BlockMeta.for_payload(reserved_key, b"r" * MiB)])
        (views,) = held.views
        assert views is not None
        for v in views:
            v[:] = b"r" * v.nbytes

        # 2. a put stream stalled half-way through its block
        def half() -> Iterator[pb.BlockChunk]:
            info = pb.BlockInfo(
                key=stream_key, payload_len=len(stream_payload), payload_checksum=checksum(stream_payload)
            )
            yield pb.BlockChunk(block=info, data=stream_payload[: 2 * MiB])
            resume.wait(60)

        put = stub.PutStream.future(half(), timeout=60)
        # 3. a get stream whose reader took one chunk and stopped reading (64 MiB to send:
        # more than gRPC's windows and the socket buffers hold, so the node's handler waits)
        get = stub.GetStream(pb.KeysRequest(keys=[big_key] * 16), timeout=60)
        assert next(get).status == pb.KEY_STATUS_OK
        wait_for(lambda: (s := kv.stats())["reservations"] == 2 and s["leases"] == 1, lambda: kv.stats())

        t0 = time.monotonic()
        node.proc.send_signal(signal.SIGTERM)
        rc = node.proc.wait(timeout=DRAIN_S + 30)
        took = time.monotonic() - t0
    finally:
        resume.set()
        channel.close()
    assert rc == 0, "".join(node.output)
    assert DRAIN_S * 0.9 <= took < DRAIN_S + MARGIN_S, f"stopped in {took:.1f} s with a {DRAIN_S} s drain"
    with pytest.raises(grpc.RpcError):
        put.result(timeout=10)  # cancelled by the node, never answered OK
    out = "".join(node.output)
    assert "aborted 1 unfinished writes" in out, out  # the local writer's; the streams cleaned up after themselves
    kv.close()  # its reservation is gone with the node: the abort on close fails quietly

    again = node_factory("--dram", "64MiB", "--nvme", "256MiB", data_dir=data_dir)
    with KVClient(again.unix) as kv2:
        assert kv2.lookup(list(committed)) == ["nvme"] * len(committed)  # demoted at the SIGTERM, re-indexed
        assert kv2.get_many(list(committed)) == list(committed.values())
        assert kv2.get(big_key) == big
        assert kv2.exists([reserved_key, stream_key]) == [False, False]
        stats = kv2.stats()
        assert stats["counters"].get("nvme_corrupt_blocks", 0) == 0
        assert stats["tiers"]["nvme"]["blocks"] == len(committed) + 1


@pytest.mark.timeout(120)
def test_data_channel_put_negotiated_before_sigterm_finishes_during_the_drain(node_factory: Any, tmp_path: Any) -> None:
    drain = 20.0  # generous: the node must leave as soon as the transfer is done, not at the deadline
    data_dir = tmp_path / "dc"
    node: NodeProcess = node_factory(
        "--dram", "64MiB", "--nvme", "64MiB", "--drain-timeout", str(drain), data_dir=data_dir
    )
    key, payload = os.urandom(16), os.urandom(3 * MiB)
    with grpc.insecure_channel(node.tcp) as ch:
        info = pb.BlockInfo(key=key, payload_len=len(payload), payload_checksum=checksum(payload))
        resp = pb_grpc.KVStoreStub(ch).StartPut(pb.ReserveRequest(blocks=[info]), timeout=10)
    assert list(resp.statuses) == [pb.KEY_STATUS_OK]
    t0 = time.monotonic()
    node.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)  # the node is draining: gRPC refuses new calls, the data channel still takes this transfer
    host, port = node.endpoints["data"].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(REQUEST.pack(REQUEST_MAGIC, OP_PUT, resp.transfer_id) + payload)
        reply = b""
        while len(reply) < REPLY.size + COUNT.size + 1:
            chunk = s.recv(64)
            assert chunk, "the node closed the connection instead of finishing the transfer"
            reply += chunk
    assert reply[REPLY.size + COUNT.size :] == bytes([pb.KEY_STATUS_OK])
    assert node.proc.wait(timeout=drain + 30) == 0
    assert time.monotonic() - t0 < drain / 2, "the node waited for the deadline although nothing was left to drain"

    again = node_factory("--dram", "64MiB", "--nvme", "64MiB", data_dir=data_dir)
    with KVClient(again.unix) as kv:
        assert kv.get(key) == payload

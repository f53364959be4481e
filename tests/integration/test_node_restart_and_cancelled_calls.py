"""Regression tests from a review of the node's data path and the SDK, with real node
processes; each is named after its bug.

* A ``unix://`` client that made no call while its node restarted kept its old ``Hello``
  and its mapping of the old arena file (the node replaces that file, never truncates it):
  its puts went into the dead arena (the new node served zeros to every other reader)
  and its gets read whatever the dead arena held at the new extents.
* An ``AsyncKVClient`` call cancelled mid-way (an engine aborting a request) abandoned its
  operation: leases and reservations stayed pinned on the node until their TTL (30 s),
  and the abandoned generator raised "generator ignored GeneratorExit" when collected.
* A data-channel transfer refused because its leases or reservations were gone by the time
  a connection presented its id left its start time in the node's in-flight table for good
  (recorded before the check, removed only when a transfer finishes).
"""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path
from typing import Any

import pytest
from conftest import NodeProcess

from client import AsyncKVClient, KVClient

MiB = 1 << 20


def rkey() -> bytes:
    return os.urandom(16)


@pytest.fixture
def restartable(tmp_path: Path) -> Any:
    n = NodeProcess(tmp_path / "node", "--dram", "64MiB", "--nvme", "0")
    yield n
    n.stop(timeout=30)
    Path(n.arena_path).unlink(missing_ok=True)


def test_idle_local_client_survives_a_node_restart_regression(restartable: NodeProcess) -> None:
    node = restartable.start()
    old = rkey(), os.urandom(300_000)
    with KVClient(node.unix) as kv:
        assert kv.put(*old)  # maps the arena
        node.stop()
        node.start()  # same data dir and arena path: the file is replaced
        k, p = rkey(), os.urandom(200_000)
        assert kv.put(k, p)  # no call failed meanwhile: the client never heard of the restart
        with KVClient(node.unix) as fresh:
            assert fresh.get(k) == p, "the idle client wrote into the dead arena"
            k2, p2 = rkey(), os.urandom(300_000)
            assert fresh.put(k2, p2)
        assert kv.get(k2) == p2, "the idle client read the dead arena"
        assert kv.get(old[0]) is None  # DRAM only: gone with the old node
        with kv.acquire([k2]) as leased:  # zero-copy views are of the live arena too
            assert leased.views[0] is not None and b"".join(bytes(v) for v in leased.views[0]) == p2


def test_idle_async_local_client_survives_a_node_restart_regression(restartable: NodeProcess) -> None:
    import asyncio

    node = restartable.start()

    async def go() -> None:
        async with AsyncKVClient(node.unix) as kv:
            assert await kv.put(rkey(), os.urandom(100_000))
            await asyncio.to_thread(node.stop)
            await asyncio.to_thread(node.start)
            k, p = rkey(), os.urandom(100_000)
            assert await kv.put(k, p)
            with KVClient(node.unix) as fresh:
                assert fresh.get(k) == p, "the idle client wrote into the dead arena"
            assert await kv.get(k) == p

    asyncio.run(go())


@pytest.mark.parametrize("op", ["get", "put"])
def test_cancelled_async_call_gives_back_its_leases_and_reservations_regression(
    restartable: NodeProcess, op: str
) -> None:
    node = restartable.start()

    async def go() -> None:
        async with AsyncKVClient(node.unix) as kv:
            k, p = rkey(), os.urandom(MiB)
            assert await kv.get(k) is None  # connects and maps the arena
            if op == "get":
                assert await kv.put(k, p)
            arena = kv._core.arena
            assert arena is not None
            name = "read_into" if op == "get" else "write_hashed"
            entered, gate = threading.Event(), threading.Event()
            copy = getattr(arena, name)

            def slow(*a: Any) -> Any:
                entered.set()
                gate.wait(10)
                return copy(*a)

            setattr(arena, name, slow)
            task = asyncio.ensure_future(kv.get_into(k, bytearray(MiB)) if op == "get" else kv.put(k, p))
            assert await asyncio.to_thread(entered.wait, 10)
            task.cancel()  # the caller gives up while the bytes are being copied
            await asyncio.sleep(0.05)
            gate.set()
            with pytest.raises(asyncio.CancelledError):
                await task
            setattr(arena, name, copy)
            s = await kv.stats()
            assert s["leases"] == 0 and s["reservations"] == 0, f"held on the node after the cancel: {s}"

    asyncio.run(go())


def test_slow_local_writer_does_not_write_past_its_reservation_deadline_regression(tmp_path: Path) -> None:
    """A local put copies into the arena under a reservation; once the node reclaims it, its
    space may be another block's.  The SDK must not start copying a block that late."""
    import time

    ttl = 1.0
    node = NodeProcess(tmp_path / "node", "--dram", "64MiB", "--nvme", "0", "--reservation-ttl", str(ttl)).start()
    try:
        with KVClient(node.unix) as kv:
            assert kv.get(rkey()) is None  # connects and maps the arena
            arena = kv._core.arena
            assert arena is not None
            copy, started = arena.write_hashed, []

            def slow(*a: Any) -> Any:  # the copy, then the process stalls (swapped out, descheduled)
                started.append(time.monotonic())
                out = copy(*a)
                time.sleep(0.6)
                return out

            arena.write_hashed = slow  # type: ignore[method-assign]
            keys = [rkey() for _ in range(3)]
            t0 = time.monotonic()
            stored = kv.put_many(keys, [os.urandom(100_000) for _ in keys])
            late = [round(t - t0, 2) for t in started if t - t0 >= ttl]
            assert not late, f"blocks copied {late} s after Reserve, past the {ttl} s reservation deadline"
            assert stored[2] is False
            arena.write_hashed = copy  # type: ignore[method-assign]
            assert kv.stats()["reservations"] == 0
    finally:
        node.stop(timeout=30)
        Path(node.arena_path).unlink(missing_ok=True)


def test_refused_transfer_stayed_in_flight_regression(restartable: NodeProcess) -> None:
    import socket
    import time

    import grpc

    from kvstore.block import BlockMeta
    from kvstore.node.datachannel import COUNT, OP_GET, OP_PUT, REPLY, REPLY_MAGIC, REQUEST, REQUEST_MAGIC, STATUS_OK
    from kvstore.wire import meta_to_pb
    from protos.kvstore.v1 import kvstore_pb2 as pb
    from protos.kvstore.v1 import kvstore_pb2_grpc as pb_grpc

    node = restartable.start()
    host, port = node.endpoints["data"].rsplit(":", 1)

    def present(op: int, tid: bytes) -> bytes:
        """Present a transfer id on a fresh data-channel connection; what the node answers first."""
        with socket.create_connection((host, int(port)), timeout=10) as conn:
            conn.sendall(REQUEST.pack(REQUEST_MAGIC, op, tid))
            try:
                return conn.recv(REPLY.size)
            except ConnectionResetError:
                return b""

    def in_flight(stub: pb_grpc.KVStoreStub) -> tuple[int, int, int, int]:
        st = stub.Stats(pb.Empty(), timeout=10)
        return st.counters["active_transfers"], st.counters["pending_transfers"], st.leases, st.reservations

    k, p = rkey(), os.urandom(100_000)
    with KVClient(node.tcp) as kv, grpc.insecure_channel(node.tcp) as ch:
        stub = pb_grpc.KVStoreStub(ch)
        assert kv.put(k, p)
        # GET: the lease is released before any connection presents the transfer id
        r = stub.StartGet(pb.KeysRequest(keys=[k]), timeout=10)
        (lease,) = r.leases
        assert list(stub.Release(pb.ReleaseRequest(lease_ids=[lease.lease_id]), timeout=10).valid) == [True]
        assert present(OP_GET, r.transfer_id) == b""  # refused: closed without a reply
        assert in_flight(stub) == (0, 0, 0, 0)
        # PUT: the reservation (its id guessed: ids are sequential) is aborted first
        (probe,) = stub.Acquire(pb.KeysRequest(keys=[k]), timeout=10).leases
        stub.Release(pb.ReleaseRequest(lease_ids=[probe.lease_id]), timeout=10)
        k2, p2 = rkey(), os.urandom(50_000)
        meta = meta_to_pb(BlockMeta.for_payload(k2, p2))
        r2 = stub.StartPut(pb.ReserveRequest(blocks=[meta]), timeout=10)
        stub.Abort(pb.AbortRequest(reservation_ids=[probe.lease_id + 1]), timeout=10)
        assert present(OP_PUT, r2.transfer_id) == b""  # refused: closed before any byte is read
        assert in_flight(stub) == (0, 0, 0, 0), "a refused transfer is still counted in flight"
        # a transfer that is taken is counted while it runs, and no longer once it ends
        r3 = stub.StartPut(pb.ReserveRequest(blocks=[meta]), timeout=10)
        with socket.create_connection((host, int(port)), timeout=10) as conn:
            conn.sendall(REQUEST.pack(REQUEST_MAGIC, OP_PUT, r3.transfer_id) + p2[:1000])
            deadline = time.monotonic() + 10
            while in_flight(stub)[0] != 1:
                assert time.monotonic() < deadline, in_flight(stub)
                time.sleep(0.02)
            conn.sendall(p2[1000:])
            reply = b""
            while len(reply) < REPLY.size + COUNT.size + 1 and (chunk := conn.recv(64)):
                reply += chunk
        assert reply == REPLY.pack(REPLY_MAGIC, STATUS_OK) + COUNT.pack(1) + bytes([pb.KEY_STATUS_OK])
        assert in_flight(stub) == (0, 0, 0, 0)
        assert kv.get(k2) == p2

"""One node per test module, started with ``--max-batch 4`` (a small limit, so three times it is
still a small test): the ``node`` and ``stub`` fixtures, and an autouse check that every test
leaves no reservation, lease or pending transfer behind.  Import the three fixtures by name."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from conftest import NodeProcess

from protos.kvstore.v1 import kvstore_pb2 as pb
from protos.kvstore.v1 import kvstore_pb2_grpc as pb_grpc

LIMIT = 4


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    n = NodeProcess(
        tmp_path_factory.mktemp("maxbatch") / "node", "--dram", "64MiB", "--nvme", "0", "--max-batch", str(LIMIT)
    ).start()
    yield n
    assert n.stop(timeout=30) == 0
    Path(n.arena_path).unlink(missing_ok=True)


@pytest.fixture(scope="module")
def stub(node: NodeProcess) -> Iterator[pb_grpc.KVStoreStub]:
    with grpc.insecure_channel(node.tcp) as ch:
        yield pb_grpc.KVStoreStub(ch)


@pytest.fixture(autouse=True)
def nothing_left_behind(stub: pb_grpc.KVStoreStub) -> Iterator[None]:
    yield
    s = stub.Stats(pb.Empty(), timeout=10)
    # (a TCP get refused for a small buffer gives its leases back, and its transfer goes with them)
    assert (s.reservations, s.leases, s.counters["pending_transfers"]) == (0, 0, 0)

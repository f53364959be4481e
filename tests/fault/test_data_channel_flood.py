"""A flood of connections on the data channel (issue 13, item 2).

A node with a small open-file limit (``ulimit -n 256``, as a prefix that execs the node) is
flooded with more idle, unauthenticated TCP connections than it has descriptors.  What must
hold: the node keeps accepting (EMFILE backs the accept loop off, never ends it), caps the
connections it holds, closes the ones that never present a transfer, and serves remote
puts and gets again within 5 s after the flood ends.
"""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import start_clean, stop_clean

from client import KVClient, KVStoreError, Timeouts
from kvstore.node.datachannel import FIRST_FRAME_TIMEOUT_S

pytestmark = pytest.mark.solo  # a connection flood and descriptor limits: scripts/test.sh runs it on its own

NOFILE = 256
ULIMIT = ["bash", "-c", f'ulimit -n {NOFILE} && exec "$@"', "ulimit"]  # the node keeps its PID
FLOOD = 600  # connections: more than the node has descriptors
SERVES_AGAIN_S = 5.0  # the figure
QUICK = Timeouts(connect=1, rpc=2, data=2)


@pytest.fixture(autouse=True)
def _enough_descriptors_here() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < FLOOD + 200:
        pytest.skip(f"this test opens {FLOOD} connections; the hard open-file limit here is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, FLOOD + 200), hard))


@contextlib.contextmanager
def flood(address: str, n: int) -> Iterator[list[socket.socket]]:
    """``n`` connections that never send a byte (those the node refuses are kept too); closed at exit."""
    host, port = address.rsplit(":", 1)
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                s.connect((host, int(port)))
            socks.append(s)
        time.sleep(1.0)  # the node works through its backlog
        yield socks
    finally:
        for s in socks:
            s.close()


def round_trip(tcp: str) -> bool:
    """One remote put and get over the data channel (a fresh client: no pooled connection)."""
    key, data = os.urandom(16), os.urandom(256 << 10)
    try:
        with KVClient(tcp, transport="data-channel", timeouts=QUICK) as kv:
            return bool(kv.put(key, data)) and kv.get(key) == data
    except KVStoreError:
        return False


def seconds_until_served(tcp: str, limit: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < limit:
        if round_trip(tcp):
            return time.monotonic() - start
        time.sleep(0.1)
    raise AssertionError(f"the data channel did not serve again within {limit} s")


def test_accept_survives_emfile_and_serves_within_5s_after_the_flood(tmp_path: Path) -> None:
    # caps above the descriptor limit: the flood exhausts the node's descriptors and accept fails with EMFILE
    node = start_clean(
        tmp_path / "n",
        "--dram",
        "64MiB",
        "--nvme",
        "0",
        "--log-level",
        "INFO",
        prefix=ULIMIT,
        env={"KVSTORE_DATA_MAX_CONNECTIONS": "4000", "KVSTORE_DATA_MAX_CONNECTIONS_PER_PEER": "4000"},
    )
    try:
        assert round_trip(node.tcp)
        with flood(node.endpoints["data"], FLOOD):
            assert not round_trip(node.tcp), "the flood did not exhaust the node's descriptors: the test proves nothing"
        took = seconds_until_served(node.tcp, 30.0)
        print(f"served again {took:.2f} s after an EMFILE flood ended")
        assert took < SERVES_AGAIN_S
        assert any("cannot accept a connection" in line for line in node.output), "".join(node.output)
    finally:
        stop_clean(node)


def test_connections_are_capped_and_silent_ones_time_out(tmp_path: Path) -> None:
    node = start_clean(tmp_path / "n", "--dram", "64MiB", "--nvme", "0", "--log-level", "INFO", prefix=ULIMIT)
    try:
        with flood(node.endpoints["data"], FLOOD) as socks:
            # the caps (half the descriptors, a quarter of that per peer) kept the node's other files open:
            # gRPC still answers, and the node logged the refusals
            with KVClient(node.unix, timeouts=QUICK) as kv:
                assert kv.stats()["counters"] is not None
            assert any("refused a connection" in line for line in node.output)
            # the flood stays open but silent: the node drops it at the first-frame deadline and serves again
            took = seconds_until_served(node.tcp, FIRST_FRAME_TIMEOUT_S + 15.0)
            print(f"served again {took:.2f} s into a silent flood that stayed open")
            assert took < FIRST_FRAME_TIMEOUT_S + SERVES_AGAIN_S
            assert len(socks) == FLOOD
    finally:
        stop_clean(node)

"""Cluster test fixtures: a private etcd, nodes that join it, and cluster clients.

Import the fixtures into a test module (``from cluster_fixtures import etcd, cluster``).
``etcd`` is a single-member etcd on free loopback ports in a temporary directory,
stopped by its PID at teardown (tests may stop and restart it meanwhile).  ``cluster``
starts ``kvstore serve --etcd ...`` nodes (real processes, via ``conftest.NodeProcess``)
with a 2-second membership lease so expiry is quick, and stops every node it started
(resuming any left SIGSTOPped) at teardown.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import NodeProcess, wait_for

from kvstore.cluster.local_etcd import LocalEtcd, find_etcd

LEASE_TTL = 2  # seconds; etcd's minimum is about 1.5
FAST = {"rpc": 1.0, "data": 2.0, "connect": 1.0}  # client deadlines for fault tests

needs_etcd = pytest.mark.skipif(
    find_etcd() is None, reason="etcd is not installed (Debian: apt-get install etcd-server)"
)


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[LocalEtcd]:
    if find_etcd() is None:
        pytest.skip("etcd is not installed (Debian: apt-get install etcd-server)")
    server = LocalEtcd(tmp_path / "etcd").start()
    try:
        yield server
    finally:
        server.stop()
        assert server.proc is None


class Cluster:
    """Nodes of one cluster in one etcd; ``client()`` builds cluster clients."""

    def __init__(self, etcd: LocalEtcd, tmp: Path) -> None:
        self.etcd = etcd
        self.tmp = tmp
        self.name = f"c{uuid.uuid4().hex[:8]}"
        self.nodes: dict[str, NodeProcess] = {}
        self.all: list[NodeProcess] = []
        self.clients: list[Any] = []
        self.stopped: set[int] = set()  # pids we SIGSTOPped

    @property
    def target(self) -> str:
        return f"etcd://{self.etcd.endpoint}/{self.name}"

    def node_args(self, *extra: str) -> tuple[str, ...]:
        return (
            "--etcd",
            self.etcd.endpoint,
            "--cluster",
            self.name,
            "--membership-ttl",
            str(LEASE_TTL),
            "--dram",
            "64MiB",
            "--nvme",
            "128MiB",
            *extra,
        )

    def arena(self, node_id: str) -> str:
        # unique per test run: a node of a concurrent run with the same id must never
        # truncate the arena file this run's clients have mapped (that is a SIGBUS)
        return f"/dev/shm/kvstore-test-{self.name}-{node_id}.arena"

    def process(self, node_id: str, extra: tuple[str, ...]) -> NodeProcess:
        """The node's process, not yet started (a subclass may run it elsewhere: tests/fault/test_partition_netns.py)."""
        return NodeProcess(
            self.tmp / node_id, *self.node_args("--arena-path", self.arena(node_id), *extra), node_id=node_id
        )

    def start(self, *node_ids: str, extra: tuple[str, ...] = ()) -> list[NodeProcess]:
        """Start nodes in parallel (each with its own data dir; a node id reuses its dir).  Each is
        started from a thread of its own that ends here; the node outlives it (``kvstore.children``
        forks it from a thread that lasts as long as this process)."""
        procs = [self.process(nid, extra) for nid in node_ids]
        errors: list[BaseException] = []

        def run(p: NodeProcess) -> None:
            try:
                p.start(timeout=60)
            except BaseException as e:  # reported below
                errors.append(e)

        threads = [threading.Thread(target=run, args=(p,)) for p in procs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.all.extend(procs)
        for p in procs:
            self.nodes[p.node_id] = p
        if errors:
            raise errors[0]
        return procs

    def set(self, name: str, value: object) -> None:
        from kvstore.cluster.etcd import ClusterStore

        async def go() -> None:
            store = ClusterStore(self.etcd.endpoint, self.name)
            try:
                await store.set_config(name, value)
            finally:
                await store.close()

        asyncio.run(go())

    def client(self, *, warm: bool = True, **kw: Any) -> Any:
        """A cluster client with the fault tests' short deadlines.  With ``warm`` it first sees
        every running (not stopped) node in its view and has connected to each: a test's first
        call then measures the cluster, not the client's first connection racing a 1 s deadline
        on a busy machine (a first ``put_many`` right after two nodes started once came back all
        False in CI)."""
        from client import Timeouts, connect

        kw.setdefault("timeouts", Timeouts(**FAST))
        c = connect(self.target, **kw)
        self.clients.append(c)
        if warm:
            running = [p for p in self.nodes.values() if p.proc is not None and p.proc.poll() is None]
            live = sum(1 for p in running if p.proc.pid not in self.stopped)
            assert c.wait_for_nodes(live, 30), f"the client's view did not show {live} nodes in 30 s"
            c.warm()
        return c

    def sigstop(self, node_id: str) -> None:
        pid = self.nodes[node_id].proc.pid  # type: ignore[union-attr]
        os.kill(pid, signal.SIGSTOP)
        self.stopped.add(pid)

    def sigcont(self, node_id: str) -> None:
        pid = self.nodes[node_id].proc.pid  # type: ignore[union-attr]
        os.kill(pid, signal.SIGCONT)
        self.stopped.discard(pid)

    def close(self) -> None:
        for c in self.clients:
            c.close()
        for pid in list(self.stopped):
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        for p in self.all:
            p.stop(timeout=30)
            Path(self.arena(p.node_id)).unlink(missing_ok=True)


@pytest.fixture
def cluster(etcd: LocalEtcd, tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(etcd, tmp_path)
    try:
        yield c
    finally:
        c.close()


wait_until = wait_for  # the name the cluster tests use

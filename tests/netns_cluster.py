"""Cluster fixtures whose nodes each run in a network namespace (tests/netns.py), so a
test can partition a node for real: its packets vanish, as behind a failed switch.

Import the fixtures into a test module (``from netns_cluster import net, etcd, cluster``).
``net`` is this test's :class:`netns.Network` (deleted at teardown, also after a
failure); ``etcd`` listens on the network's anchor address in the root namespace;
``cluster`` is a :class:`NetCluster` whose nodes get a namespace each, named after the
node, and which heals every partition before it stops its nodes.

etcd, the test and its clients stay in the root namespace.  Nodes listen on 0.0.0.0
inside their namespace and advertise their namespace address (``advertise_host``), which
is what clients dial.  Clients are built with ``prefer_local=False``: the nodes share this
machine's hostname and /dev/shm, and the local Unix-socket path would bypass the network.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cluster_fixtures import FAST, Cluster
from conftest import NodeProcess
from netns import Network, unavailable_reason

from client import KVClient, Timeouts
from kvstore.cluster.local_etcd import LocalEtcd, find_etcd


@pytest.fixture
def net() -> Iterator[Network]:
    why = unavailable_reason()
    if why is not None:
        if os.geteuid() != 0:
            pytest.skip(why)
        pytest.fail(why)  # root without iproute2: a broken setup, not a reason to skip
    n = Network()
    try:
        yield n
    finally:
        n.close()


@pytest.fixture
def etcd(net: Network, tmp_path: Path) -> Iterator[LocalEtcd]:
    if find_etcd() is None:
        pytest.skip("etcd is not installed (Debian: apt-get install etcd-server)")
    server = LocalEtcd(tmp_path / "etcd", host=net.etcd_host).start()
    try:
        yield server
    finally:
        server.stop()


class NetCluster(Cluster):
    """A cluster whose nodes each run in a namespace of ``net``, named after the node."""

    def __init__(self, etcd: LocalEtcd, tmp: Path, net: Network) -> None:
        super().__init__(etcd, tmp)
        self.net = net

    def process(self, node_id: str, extra: tuple[str, ...]) -> NodeProcess:
        host = self.net.hosts.get(node_id) or self.net.add_host(node_id)
        return NodeProcess(
            self.tmp / node_id,
            *self.node_args("--arena-path", self.arena(node_id), *extra),
            node_id=node_id,
            prefix=host.exec_prefix,
            listen="0.0.0.0:0",
            env={"KVSTORE_ADVERTISE_HOST": host.ip},
        )

    def client(self, **kw: Any) -> Any:
        kw.setdefault("prefer_local", False)
        return super().client(**kw)

    def direct(self, node_id: str) -> KVClient:
        """A single-node client of ``node_id`` over TCP, through the network."""
        c = KVClient(self.nodes[node_id].tcp, timeouts=Timeouts(**FAST))
        self.clients.append(c)
        return c


@pytest.fixture
def cluster(etcd: LocalEtcd, net: Network, tmp_path: Path) -> Iterator[NetCluster]:
    c = NetCluster(etcd, tmp_path, net)
    try:
        yield c
    finally:
        net.heal_all()  # so nodes deregister and stop at once
        c.close()

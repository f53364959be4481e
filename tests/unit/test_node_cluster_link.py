"""A node joins its cluster only through the link its composition root hands it
(``kvstore serve``: ``kvstore.cluster.node.ClusterLink``); ``kvstore.node`` never names
``kvstore.cluster`` (the import-graph test checks the imports, this the wiring)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from kvstore.cluster.etcd import OwnerRegistry
from kvstore.cluster.node import ClusterLink, NodeAgent
from kvstore.errors import InvalidArgument
from kvstore.node.config import NodeConfig
from kvstore.node.manager import TierManager
from kvstore.node.server import Node
from tiers.arena import Arena
from tiers.dram import DRAMTier


def config(tmp_path: Path, **kw: Any) -> NodeConfig:
    return NodeConfig(data_dir=str(tmp_path), dram="16MiB", nvme="0", **kw)


def test_a_node_with_etcd_and_no_link_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="no cluster link"):
        Node(config(tmp_path, etcd="127.0.0.1:2379", cluster="c"))


def test_a_node_without_etcd_ignores_a_link(tmp_path: Path) -> None:
    node = Node(config(tmp_path), cluster=ClusterLink())
    assert node._link is None and node.cluster is None


def test_the_link_builds_etcds_authority_and_a_node_agent(tmp_path: Path) -> None:
    cfg = config(tmp_path, etcd="127.0.0.1:2379", cluster="c", node_id="n1")
    link = ClusterLink()
    authority = link.owner_authority(cfg)
    assert isinstance(authority, OwnerRegistry) and "127.0.0.1:2379" in authority.where
    arena = Arena.create(f"/dev/shm/kvstore-test-link-{uuid.uuid4().hex}.arena", 1 << 20, prefault=False)
    manager = TierManager(DRAMTier(arena, unit=4096), None)
    try:
        agent = link.agent(cfg, {"grpc": "127.0.0.1:1", "data": "", "unix": ""}, manager, None)
        assert isinstance(agent, NodeAgent) and agent.info.node_id == "n1" and agent.info.grpc == "127.0.0.1:1"
    finally:
        manager.close()

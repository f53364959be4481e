"""The pure parts of cluster mode: epochs, settings, targets, records, the etcd key schema."""

from __future__ import annotations

import pytest

from kvstore.cluster.cli import parse_namespace
from kvstore.cluster.state import (
    ClusterConfig,
    NamespaceRecord,
    NodeInfo,
    effective_fingerprint,
    namespace_key,
    node_key,
    parse_endpoints,
    parse_setting,
    parse_target,
)
from kvstore.errors import InvalidArgument
from kvstore.keys import Namespace


def test_effective_fingerprint() -> None:
    fp = Namespace("llama").fingerprint
    assert effective_fingerprint(fp, 0) == fp  # epoch 0 keys exactly like a single node
    e1, e2 = effective_fingerprint(fp, 1), effective_fingerprint(fp, 2)
    assert len(e1) == 8 and len({fp, e1, e2}) == 3
    assert effective_fingerprint(bytes(8), 1).hex() == "170e463080d5de4e"  # pinned
    with pytest.raises(InvalidArgument):
        effective_fingerprint(b"short", 1)
    with pytest.raises(InvalidArgument):
        effective_fingerprint(fp, -1)
    assert NamespaceRecord(fp, 3).effective == effective_fingerprint(fp, 3)


def test_key_schema() -> None:
    assert node_key("prod", "n1") == b"/kvstore/prod/nodes/n1"
    assert namespace_key("prod", bytes(range(8))) == b"/kvstore/prod/namespaces/0001020304050607"
    for bad in ("", "a/b", " x"):
        with pytest.raises(InvalidArgument):
            node_key(bad, "n1")


def test_settings() -> None:
    assert parse_setting("replication", "3") == 3 and parse_setting("replication", 2) == 2
    assert parse_setting("handoff_window_s", "1.5") == 1.5
    for name, value in [
        ("replication", "0"),
        ("replication", "1.5"),
        ("replication", "x"),
        ("nope", "1"),
        ("handoff_window_s", "-1"),
    ]:
        with pytest.raises(InvalidArgument):
            parse_setting(name, value)
    cfg = ClusterConfig.from_raw({"replication": b"2", "unknown": b"1", "handoff_window_s": b"bad"})
    assert cfg == ClusterConfig(replication=2)


def test_targets_and_endpoints() -> None:
    assert parse_target("etcd://127.0.0.1:2379/prod") == ("127.0.0.1:2379", "prod")
    assert parse_target("etcd://h1:1,h2:2/c/") == ("h1:1,h2:2", "c")
    assert parse_endpoints("h1:1, http://h2:2") == [("h1", 1), ("h2", 2)]
    for bad in ("etcd://h:1", "etcd://h:1/", "etcd://h/c", "h:1/c"):
        with pytest.raises(InvalidArgument):
            parse_target(bad)


def test_node_record_round_trip_ignores_unknown_fields() -> None:
    info = NodeInfo("n1", "127.0.0.1:1", zone="z", dram_bytes=5)
    assert NodeInfo.from_json(info.to_json()) == info
    assert NodeInfo.from_json(b'{"node_id": "n", "grpc": "h:1", "from_the_future": 1}') == NodeInfo("n", "h:1")


def test_cli_namespace_argument() -> None:
    ns = Namespace("m", tp_size=2)
    assert parse_namespace(ns.fingerprint.hex()) == (ns.fingerprint, None)
    assert parse_namespace('{"model_id": "m", "tp_size": 2}')[0] == ns.fingerprint
    assert parse_namespace("m") == (Namespace("m").fingerprint, Namespace("m").to_dict())
    with pytest.raises(InvalidArgument):
        parse_namespace('{"model_id": "m", "bogus": 1}')

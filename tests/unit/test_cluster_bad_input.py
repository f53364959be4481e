"""Bad membership input (issue 19): duplicate node ids, records that do not parse, weights of 0
or absurd ones, memberships of 0 or 1 nodes with replication 3, bad hot-key settings.  Each is
a clear error or well-defined behaviour, never a crash of a client's view or a node's."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from cluster_core import drive, publish, router, view

from client._cluster import ClusterCore
from kvstore.cluster.etcd import _Builder
from kvstore.cluster.placement import BoundedTable, Ring, placement
from kvstore.cluster.state import ClusterConfig, ClusterSnapshot, NodeInfo, node_key, parse_setting
from kvstore.errors import InvalidArgument

CLUSTER = "bad"
KEYS = [os.urandom(16) for _ in range(64)]


def rec(node_id: str, **kw: Any) -> bytes:
    return NodeInfo(node_id, f"10.0.0.1:{7000 + len(node_id)}", **kw).to_json()


# -- the watcher's view -------------------------------------------------------------------------------
def test_unparseable_and_absurd_records_are_ignored_the_rest_routes() -> None:
    b = _Builder(CLUSTER)
    b.apply(node_key(CLUSTER, "a"), rec("a"), 1)
    b.apply(node_key(CLUSTER, "junk"), b"{not json", 2)
    b.apply(node_key(CLUSTER, "zero"), rec("zero").replace(b'"weight": 100', b'"weight": 0'), 3)
    b.apply(node_key(CLUSTER, "huge"), rec("huge").replace(b'"weight": 100', b'"weight": 1000000000'), 4)
    b.apply(node_key(CLUSTER, "list"), b"[1, 2, 3]", 5)
    snap = b.freeze(connected=True)
    assert set(snap.nodes) == {"a"} and snap.revision == 5
    assert placement(snap.config.placement, snap.members()).owners(KEYS[0], 3) == ["a"]


def test_a_good_record_garbled_later_keeps_the_last_good_one() -> None:
    b = _Builder(CLUSTER)
    b.apply(node_key(CLUSTER, "a"), rec("a"), 1)
    b.apply(node_key(CLUSTER, "a"), b"\xff\xfe garbage", 2)
    assert b.freeze(connected=True).nodes["a"] == NodeInfo.from_json(rec("a"))
    b.apply(node_key(CLUSTER, "a"), None, 3)  # the lease expires: gone, whatever it held
    assert b.freeze(connected=True).nodes == {}


def test_duplicate_node_ids_a_record_claiming_another_id_is_ignored() -> None:
    """Records are keyed by node id in etcd, so two live records of one id cannot exist (a second
    node with a taken id is refused at registration: test_cluster.py); a record whose content
    names another node than its key would be a second claim to that id: ignored."""
    b = _Builder(CLUSTER)
    b.apply(node_key(CLUSTER, "a"), rec("a"), 1)
    b.apply(node_key(CLUSTER, "b"), rec("a"), 2)  # says it is "a"
    assert set(b.freeze(connected=True).nodes) == {"a"}


def test_duplicate_ids_given_to_placement_count_once() -> None:
    assert BoundedTable(["a", "b", "a", "c", "b"]).nodes == ("a", "b", "c")
    dup, plain = BoundedTable(["a", "b", "a", "c"]), BoundedTable(["c", "b", "a"])
    assert all(dup.owners(k, 3) == plain.owners(k, 3) for k in KEYS)
    assert Ring(["x", "x", "y"]).nodes == ("x", "y")


@pytest.mark.parametrize("bad", [0, -5, 10**9, "100", 2.5, None, True])
def test_weights_of_zero_or_absurd_are_clear_errors_to_placement(bad: object) -> None:
    with pytest.raises(InvalidArgument, match="weight"):
        BoundedTable({"a": 100, "b": bad})  # type: ignore[dict-item]


@pytest.mark.parametrize(
    "name,value",
    [
        ("hot_extras", -1),
        ("hot_extras", 5000),
        ("hot_extras", "1.5"),
        ("hot_window_s", 0),
        ("hot_reads_per_s", -1),
        ("replication", 0),
    ],
)
def test_bad_hot_settings_are_clear_errors(name: str, value: object) -> None:
    with pytest.raises(InvalidArgument, match=name):
        parse_setting(name, value)
    assert ClusterConfig.from_raw({name: str(value).encode()}) == ClusterConfig()  # a bad value in etcd: the default


# -- 0 and 1 nodes with replication 3 -------------------------------------------------------------------
def test_placement_of_zero_and_one_node_with_replication_3() -> None:
    assert BoundedTable([]).owners(KEYS[0], 3) == [] and BoundedTable([]).owners_many(KEYS[:2], 3) == [[], []]
    one = BoundedTable(["solo"])
    assert all(one.owners(k, 3) == ["solo"] for k in KEYS)
    assert Ring([]).owners(KEYS[0], 3) == [] and Ring(["solo"]).owners(KEYS[0], 3) == ["solo"]


@pytest.fixture
def core() -> Iterator[ClusterCore]:
    with router(CLUSTER) as c:
        yield c


def snapshot(nodes: list[str], r: int) -> ClusterSnapshot:
    return view(CLUSTER, 7, {n: (i + 1, 100 + i) for i, n in enumerate(nodes)}, replication=r)


def test_a_client_with_no_nodes_answers_misses_and_refuses_nothing_silently(core: ClusterCore) -> None:
    publish(core, snapshot([], 3))
    ks = KEYS[:4]
    stored, calls = drive(core.put_many(ks, [b"x"] * 4, namespace=None, parents=None, token_counts=None), None)
    assert stored == [False] * 4 and calls == []  # no node to store on: every put says so
    got, calls = drive(core.get_many_into(ks, None), None)
    assert got == [None] * 4 and calls == []
    (tiers, where), _ = drive(core.lookup(ks), None)
    assert tiers == [None] * 4 and where == [None] * 4


def test_one_node_with_replication_3_holds_the_one_copy(core: ClusterCore) -> None:
    publish(core, snapshot(["solo"], 3))
    routing = core.routing()
    assert routing.r == 3 and all(routing.owners(k) == ["solo"] for k in KEYS)
    stored, calls = drive(
        core.put_many(KEYS[:4], [b"x"] * 4, namespace=None, parents=None, token_counts=None), lambda n, make: [True] * 4
    )
    assert stored == [True] * 4 and calls == ["solo"]

"""Rendezvous placement: pure, stable across processes, balanced, minimally disruptive."""

from __future__ import annotations

import collections
import json
import subprocess
import sys

import pytest

from kvstore.cluster.placement import Ring, owners, weight

KEYS = [bytes([i % 256, i // 256]) * 8 for i in range(4000)]
NODES = [f"node-{i}" for i in range(5)]


def test_golden_vectors() -> None:
    # pinned: every client and node, in every release, must place keys the same way
    assert weight("node-0", bytes(16)) == 0xD469FEE15A04CF7B
    assert owners(bytes(range(16)), ["a", "b", "c", "d"], 2) == ["c", "b"]
    assert Ring(["a", "b", "c", "d"]).ranked(bytes(16)) == ["a", "c", "d", "b"]
    code = "from kvstore.cluster.placement import owners; print(owners(bytes(range(16)), ['a','b','c','d'], 2))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "['c', 'b']"  # the same in a fresh process (no process-random seed)


def test_owners_are_distinct_ordered_and_clamped() -> None:
    ring = Ring(NODES)
    for k in KEYS[:200]:
        ranked = ring.ranked(k)
        assert sorted(ranked) == sorted(NODES)
        assert ring.owners(k, 2) == ranked[:2]
        assert [weight(n, k) for n in ranked] == sorted((weight(n, k) for n in NODES), reverse=True)
    assert ring.owners(KEYS[0], 9) == ring.ranked(KEYS[0])  # R larger than the cluster: every node
    assert Ring([]).owners(KEYS[0], 2) == []
    assert Ring(["x", "x", "y"]).nodes == ("x", "y")
    assert Ring(reversed(NODES)).owners(KEYS[5], 3) == ring.owners(KEYS[5], 3)  # order of the input does not matter


def test_balance() -> None:
    counts = collections.Counter(Ring(NODES).owners(k, 1)[0] for k in KEYS)
    expected = len(KEYS) / len(NODES)
    assert all(abs(c - expected) < 0.15 * expected for c in counts.values()), counts


@pytest.mark.parametrize("r", [1, 2])
def test_a_join_moves_only_keys_the_new_node_wins(r: int) -> None:
    before, after = Ring(NODES), Ring([*NODES, "node-new"])
    moved = 0
    for k in KEYS:
        old, new = before.owners(k, r), after.owners(k, r)
        if old != new:
            moved += 1
            assert "node-new" in new  # nothing moves between the old nodes
            assert set(new) - {"node-new"} <= set(old)
    assert moved / len(KEYS) < r / (len(NODES) + 1) * 1.3


def test_a_leave_moves_only_the_leavers_keys() -> None:
    before, after = Ring(NODES), Ring(NODES[1:])
    for k in KEYS:
        old, new = before.owners(k, 2), after.owners(k, 2)
        if "node-0" not in old:
            assert old == new
        else:
            assert [n for n in old if n != "node-0"] == new[:1]


# -- bounded-v1: the default scheme (O(1) per key, weighted, bounded loads) ---------------------
import numpy as np  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvstore.cluster.placement import (  # noqa: E402
    BOUNDED_V1,
    EPSILON,
    RENDEZVOUS_V1,
    SLOTS,
    BoundedTable,
    check_weight,
    group_keys,
    make,
    placement,
    slot_of,
)
from kvstore.cluster.state import ClusterConfig, NodeInfo, parse_setting  # noqa: E402
from kvstore.errors import InvalidArgument  # noqa: E402


def shares(table: BoundedTable, ranks: int) -> np.ndarray:
    """Slots per node over the first ``ranks`` ranks (a node's exact share of the key space)."""
    return sum(
        np.bincount(np.frombuffer(table.slot_owners(k), dtype=np.uint32), minlength=len(table)) for k in range(ranks)
    )


def rows(table: BoundedTable, r: int) -> list[frozenset[str]]:
    cols = table.ranks(r)
    return [frozenset(table.nodes[c[s]] for c in cols) for s in range(SLOTS)]


def moved(a: BoundedTable, b: BoundedTable, r: int) -> float:
    return sum(x != y for x, y in zip(rows(a, r), rows(b, r))) / SLOTS


def test_bounded_golden_vectors() -> None:
    # pinned: every client and node, in every release, must place keys the same way under bounded-v1
    assert slot_of(bytes(16)) == 0x193D == slot_of(bytes(4) + b"x" * 12)  # the first 4 bytes alone
    got = BoundedTable(["a", "b", "c", "d"]).owners(bytes(range(16)), 2)
    code = (
        "from kvstore.cluster.placement import BoundedTable; "
        "print(BoundedTable(['d','c','b','a']).owners(bytes(range(16)), 2))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == repr(got)  # the same in a fresh process, from another input order
    assert got == GOLDEN_BOUNDED


GOLDEN_BOUNDED = ["b", "d"]


@settings(max_examples=25, deadline=None)
@given(st.sets(st.text("abcdefgh0123456789-", min_size=1, max_size=6), min_size=1, max_size=12), st.randoms())
def test_every_client_agrees_from_the_same_membership(nodes: set[str], rnd: object) -> None:
    order = sorted(nodes)
    rnd.shuffle(order)  # type: ignore[attr-defined]
    a, b = BoundedTable(order), BoundedTable({n: 100 for n in reversed(order)})
    r = min(3, len(nodes))
    assert [list(c) for c in a.ranks(r)] == [list(c) for c in b.ranks(r)]
    for k in KEYS[:50]:
        own = a.owners(k, 3)
        assert own == b.owners(k, 3) and len(own) == len(set(own)) == r


def test_small_clusters_and_replication_above_the_cluster_size() -> None:
    assert BoundedTable([]).owners(KEYS[0], 3) == [] and BoundedTable([]).owners_many(KEYS[:2], 3) == [[], []]
    assert BoundedTable(["x"]).owners(KEYS[0], 3) == ["x"]
    two = BoundedTable(["x", "y"])
    assert all(sorted(two.owners(k, 3)) == ["x", "y"] for k in KEYS[:100])
    assert two.owners(KEYS[0], 0) == [] and BoundedTable(["x", "x", "y"]).nodes == ("x", "y")
    assert two.owners_many(KEYS[:20], 2) == [two.owners(k, 2) for k in KEYS[:20]]


@pytest.mark.parametrize("n", [3, 64, 1000])
def test_balance_within_epsilon_at_every_rank(n: int) -> None:
    table = BoundedTable([f"node-{i}" for i in range(n)])
    r = min(2, n)
    for ranks in range(1, r + 1):
        s = shares(table, ranks)
        assert s.max() / s.mean() <= 1 + EPSILON, (ranks, s.max() / s.mean())


@pytest.mark.parametrize("n", [64, 1000])
def test_a_join_or_leave_moves_close_to_r_over_n(n: int) -> None:
    nodes = [f"node-{i}" for i in range(n)]
    table, joined, left = BoundedTable(nodes), BoundedTable([*nodes, "node-new"]), BoundedTable(nodes[1:])
    for r in (1, 2):
        ideal = r / (n + 1)
        for other in (joined, left):
            frac = moved(table, other, r)
            assert ideal * 0.8 <= frac <= ideal * 2.0, (
                r,
                frac,
                ideal,
            )  # measured: 1.1-1.7x (kvstore bench placement)
    # the new node's slots are its own; only the bounded overflow moves anything else
    new_rows = rows(joined, 1)
    gained = sum("node-new" in x for x in new_rows) / SLOTS
    assert gained >= 0.8 / (n + 1)


def test_weights_give_proportional_shares() -> None:
    members = {f"node-{i}": 100 for i in range(60)} | {"big-0": 200, "big-1": 200, "small": 50}
    table = BoundedTable(members)
    s = shares(table, 1)
    total = sum(members.values())
    for i, node in enumerate(table.nodes):
        want = SLOTS * members[node] / total
        assert 0.85 * want <= s[i] <= (1 + EPSILON) * want, (node, s[i], want)


@pytest.mark.parametrize("bad", [0, -1, 10_001, 2.5, True, "100", None])
def test_absurd_weights_are_clear_errors(bad: object) -> None:
    with pytest.raises(InvalidArgument, match=r"integer in \[1, 10000\]"):
        check_weight(bad)
    with pytest.raises(InvalidArgument):
        BoundedTable({"a": 100, "b": bad})  # type: ignore[dict-item]
    raw = NodeInfo("a", "h:1").to_json().replace(b'"weight": 100', b'"weight": ' + json.dumps(bad).encode())
    with pytest.raises(ValueError):
        NodeInfo.from_json(raw)  # the watcher ignores such a record (logged), never crashes


def test_node_records_that_do_not_parse_are_value_errors() -> None:
    for raw in (b"[1, 2]", b'"x"', b'{"grpc": "h:1"}', b'{"node_id": 5, "grpc": "h:1"}', b"{not json"):
        with pytest.raises(ValueError):
            NodeInfo.from_json(raw)
    assert NodeInfo.from_json(b'{"node_id": "a", "grpc": "h:1", "future": 1}').weight == 100  # older/newer fields


def test_group_keys_share_owners_and_stay_distinct() -> None:
    keys = [xxhash_key(i) for i in range(1000)]
    assert group_keys(keys, 1) == keys
    table = BoundedTable([f"node-{i}" for i in range(256)])
    for g in (4, 16, 64):
        grouped = group_keys(keys, g)
        assert len(set(grouped)) == len(keys) and all(len(k) == 16 for k in grouped)
        assert all(a[4:] == b[4:] for a, b in zip(grouped, keys))  # 96 bits of the chain hash stay
        for start in range(0, len(keys), g):
            assert len({tuple(table.owners(k, 2)) for k in grouped[start : start + g]}) == 1
        primaries = {table.owners(k, 1)[0] for k in grouped}
        assert len(primaries) <= -(-len(keys) // g)  # at most one owner per group and rank
    with pytest.raises(InvalidArgument):
        group_keys(keys, 0)


def xxhash_key(i: int) -> bytes:
    import xxhash

    return xxhash.xxh3_128_digest(i.to_bytes(8, "little"))


def test_schemes_settings_and_cache() -> None:
    assert ClusterConfig().placement == BOUNDED_V1 and ClusterConfig().chunk_group == 1
    assert (
        parse_setting("placement", "rendezvous-v1") == RENDEZVOUS_V1 == parse_setting("placement", b'"rendezvous-v1"')
    )
    with pytest.raises(InvalidArgument, match="bounded-v1, rendezvous-v1"):
        parse_setting("placement", "maglev")
    with pytest.raises(InvalidArgument, match="<= 4096"):
        parse_setting("chunk_group", "100000")
    assert (
        ClusterConfig.from_raw({"placement": b'"nonsense"'}).placement == BOUNDED_V1
    )  # a bad record keeps the default
    with pytest.raises(InvalidArgument, match="unknown placement scheme"):
        make("maglev", {"a": 100})
    members = {"a": 100, "b": 100}
    assert placement(BOUNDED_V1, members) is placement(BOUNDED_V1, dict(reversed(members.items())))
    assert isinstance(placement(RENDEZVOUS_V1, members), Ring)
    assert placement(RENDEZVOUS_V1, members).owners(KEYS[0], 2) == owners(KEYS[0], ["a", "b"], 2)

"""Rendezvous placement: pure, stable across processes, balanced, minimally disruptive."""

from __future__ import annotations

import collections
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

"""Hot keys (kvstore.cluster.hot): heat, the owners' decision, the extras, the readers' spread,
and the busiest node's load under a Zipf-skewed workload (issue 19, item 3).  No etcd, no nodes:
tests/integration/test_cluster_hot_replicas.py runs the same with real ones."""

from __future__ import annotations

import collections
import dataclasses
import os
from collections.abc import Iterator

import pytest
from cluster_core import publish, router

from client._cluster import ClusterCore
from kvstore.bench.cluster_sim import hot_load
from kvstore.cluster import hot
from kvstore.cluster.etcd import _Builder
from kvstore.cluster.placement import BoundedTable, Ring
from kvstore.cluster.state import ClusterConfig, ClusterSnapshot, NodeInfo, hot_key, prefix

CLUSTER = "hot"


def names(n: int) -> list[str]:
    return [f"n{i:04d}" for i in range(n)]


# -- extras ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 3, 16, 257])
def test_extras_are_deterministic_distinct_and_not_owners(n: int) -> None:
    table, again = BoundedTable(names(n)), BoundedTable(list(reversed(names(n))))
    for _ in range(200):
        key = os.urandom(16)
        for r in (1, 2, 3):
            own = table.owners(key, r)
            ext = hot.extras(table, key, r, 8)
            assert ext == hot.extras(again, key, r, 8)  # every client and node computes the same ones
            assert len(set(ext)) == len(ext) and not set(ext) & set(own)
            assert len(ext) == min(8, n - len(own))  # fewer only when the cluster has no more nodes
            assert hot.extras(table, key, r, 3) == ext[:3]  # growing or shrinking keeps most copies


def test_extras_of_the_rendezvous_scheme_follow_the_keys_ranking() -> None:
    ring = Ring(names(10))
    key = os.urandom(16)
    assert hot.extras(ring, key, 2, 3) == ring.ranked(key)[2:5]


def test_extras_with_zero_or_one_node_and_replication_3() -> None:
    key = os.urandom(16)
    assert hot.extras(BoundedTable([]), key, 3, 4) == []
    assert hot.extras(BoundedTable(["only"]), key, 3, 4) == []
    assert hot.extras(BoundedTable(["a", "b"]), key, 3, 4) == []  # both are owners already


def test_extras_spread_over_the_cluster() -> None:
    table = BoundedTable(names(1000))
    hosts = collections.Counter(x for _ in range(2000) for x in hot.extras(table, os.urandom(16), 2, 4))
    assert len(hosts) > 900  # not the same few nodes for every hot key


# -- heat and decision ------------------------------------------------------------------------------
def test_heat_counter_is_bounded_and_finds_the_hot_key() -> None:
    h = hot.HeatCounter(capacity=64)
    hot_k = b"\x01" * 16
    for i in range(50_000):
        h.add(os.urandom(16))
        if i % 10 == 0:
            h.add(hot_k)
    counts, total = h.take()
    assert len(counts) <= 64
    assert total == 55_000
    assert counts[hot_k] >= 5000 - 2 * hot.ADMIT
    assert h.take() == ({}, 0)  # a new window


def test_sampled_heat_counter_scales_its_counts() -> None:
    h = hot.HeatCounter(sample=4)
    h.add_many([b"\x02" * 16] * 40_000)
    counts, total = h.take()
    assert 36_000 <= total <= 44_000 and 36_000 <= counts[b"\x02" * 16] <= 44_000


def _decide(counts: dict[bytes, int], total: int, current: dict[bytes, int] | None = None, **kw: object) -> dict:
    args = {"r": 1, "current": current or {}, "owns": lambda k: True, "floor": 1.0, "max_extras": 16}
    args.update(kw)
    return hot.decide(counts, total, 1.0, **args)  # type: ignore[arg-type]


def test_a_key_carrying_most_of_a_nodes_reads_gets_extras_in_proportion() -> None:
    a, b = b"\x0a" * 16, b"\x0b" * 16
    # cold load 1000 reads/s; a: 2000 (8 copies' worth at a quarter of the cold load each), b: 100
    got = _decide({a: 2000, b: 100}, 3100)
    assert got == {a: 7}
    assert _decide({a: 2000}, 3100, max_extras=3) == {a: 3}  # capped by hot_extras
    assert _decide({a: 2000}, 3100, max_extras=0) == {}  # off
    assert _decide({a: 2000}, 3100, owns=lambda k: False) == {}  # only owners publish
    assert _decide({a: 2000}, 3100, floor=5000.0) == {}  # below the floor: never hot


def test_hot_key_copies_hold_while_the_heat_stays_and_go_when_it_cools() -> None:
    a = b"\x0a" * 16
    # 7 extras on R = 1: the owner sees 1/8 of the key's reads
    assert _decide({a: 250}, 1250, current={a: 7}) == {a: 7}
    assert _decide({a: 220}, 1220, current={a: 7}) == {a: 7}  # a little cooler: hysteresis keeps 7
    assert _decide({a: 100}, 1100, current={a: 7}) == {a: 3}  # much cooler: fewer copies
    assert _decide({a: 10}, 1010, current={a: 7}) == {}  # cold: no extras


def test_hot_record_round_trip_and_bad_records() -> None:
    rec = {b"\x01" * 16: 3, b"\x02" * 16: 1}
    assert hot.from_json(hot.to_json(rec)) == rec
    for bad in (
        b"nope",
        b"[]",
        b'{"keys": 3}',
        b'{"keys": {"zz": 1}}',
        b'{"keys": {"0101": 1}}',
        b'{"keys": {"' + b"01" * 16 + b'": 0}}',
        b'{"keys": {"' + b"01" * 16 + b'": 100000}}',
        b'{"keys": {"' + b"01" * 16 + b'": true}}',
    ):
        with pytest.raises(ValueError):
            hot.from_json(bad)


def test_watcher_merges_hot_records_and_ignores_bad_ones() -> None:
    b = _Builder(CLUSTER)
    k1, k2 = b"\x01" * 16, b"\x02" * 16
    b.apply(hot_key(CLUSTER, "a"), hot.to_json({k1: 2}), 5)
    b.apply(hot_key(CLUSTER, "b"), hot.to_json({k1: 4, k2: 1}), 6)
    assert b.freeze(connected=True).hot == {k1: 4, k2: 1}  # the most any publisher asks for
    b.apply(hot_key(CLUSTER, "b"), b"garbage", 7)  # unparseable: b's keys are gone, no crash
    assert b.freeze(connected=True).hot == {k1: 2}
    b.apply(hot_key(CLUSTER, "a"), None, 8)  # a's lease expired (or it cooled)
    assert b.freeze(connected=True).hot == {}
    assert (prefix(CLUSTER) + "hot/a").encode() == hot_key(CLUSTER, "a")


def test_extra_copies_are_dropped_when_the_key_leaves_the_hot_set() -> None:
    table = BoundedTable(names(8))
    key = next(k for k in (os.urandom(16) for _ in range(1000)) if "n0003" in hot.extras(table, k, 1, 3))
    ex = hot.ExtraCopies("n0003")
    assert ex.update(table, {key: 3}, 1) == []
    assert ex.held == {key}
    assert ex.update(table, {}, 1) == [key]  # cooled: drop the copy
    assert ex.update(table, {}, 1) == []


# -- the readers' spread ----------------------------------------------------------------------------
@pytest.fixture
def core() -> Iterator[ClusterCore]:
    with router(CLUSTER) as c:
        yield c


def test_readers_spread_a_hot_key_over_its_copies_and_skip_a_dead_extra(core: ClusterCore) -> None:
    ids = names(12)
    nodes = {n: NodeInfo(n, f"10.0.0.{i + 1}:7000") for i, n in enumerate(ids)}
    regs = {n: (i + 1, 100 + i) for i, n in enumerate(ids)}
    key, cold = b"\x07" * 16, b"\x08" * 16
    snap = ClusterSnapshot(CLUSTER, 9, nodes, ClusterConfig(replication=2), {}, regs, True, True, hot={key: 4})
    publish(core, snap)
    routing = core.routing()
    owners, extras = routing.owners(key), routing.extras(key)
    assert len(extras) == 4 and routing.extras(cold) == []
    first = collections.Counter()
    for _ in range(3000):
        cands, _ = core._spread(routing, [key, cold], routing.owners_many([key, cold]))
        first[cands[0][0]] += 1
        assert cands[0][1:] == [n for n in owners if n != cands[0][0]]  # then the owners, in rank order
        assert cands[1] == routing.owners(cold)  # a key that is not hot: its owners only
    assert set(first) == {*owners, *extras}
    assert max(first.values()) < 2 * 3000 / 6  # about uniform over the 6 copies
    core.failed(extras[0], TimeoutError("dead"), routing)  # a dead extra: skipped
    core.suspects.mark(extras[0])
    picked = {core._spread(routing, [key], [owners])[0][0][0] for _ in range(500)}
    assert extras[0] not in picked and picked == {*owners, *extras[1:]}
    # a view without nodes keeps no hot keys (nothing to spread over)
    publish(core, dataclasses.replace(snap, nodes={}, revision=10))


# -- the figure: busiest node <= 2x the mean under a Zipf workload ---------------------------------------
@pytest.mark.parametrize("n", [64, 1000])
def test_zipf_busiest_node_is_at_most_twice_the_mean_with_hot_replicas(n: int) -> None:
    got = hot_load(n, windows=10)
    assert got["without"]["max_over_mean"] > 5  # the skew is real: one node carries the hottest key
    assert got["with"]["max_over_mean"] <= 2.0, got

"""Membership at 1,000 nodes against a real etcd (issue 19, item 4): a light harness registers
1,000 node records (the real Registration code: leases, puts, keep-alives), and real watchers
must all load the full membership, see every join and leave (the harness gives each 10 s, a
hang guard, and raises if a view never converges), read membership in full once, and apply the
watch's events one by one (one snapshot per batch of events).  How fast they converge is a
figure of ``kvstore bench cluster-sim``, not an assertion here: on a loaded 2-core runner a
batch of 50 leaves once took 1.2 s."""

from __future__ import annotations

import asyncio

import pytest
from cluster_fixtures import etcd  # noqa: F401 - fixture

from kvstore.bench import membership as membench
from kvstore.cluster.etcd import ClusterWatcher, Registration
from kvstore.cluster.local_etcd import LocalEtcd
from kvstore.cluster.state import NodeInfo

pytestmark = pytest.mark.solo  # a thousand members on one etcd: scripts/test.sh runs it on its own


def test_a_thousand_nodes_views_all_converge_on_every_join_and_leave(etcd: LocalEtcd) -> None:
    got = asyncio.run(
        membench.run_async(etcd.endpoint, "scale", nodes=1000, views=10, ttl_s=10.0, keepalive_window_s=10.0)
    )
    # run_async raises TimeoutError unless every view (10 watchers and the placement-building
    # Membership) reached each state: all 1,000 loaded, 5 joins and leaves, 50 leaving at once
    assert got["nodes"] == 1000 and got["views"] == 11, got
    assert len(got["join_ms"]) == 5 and len(got["leave_ms"]) == 5, got
    assert got["events_per_publish"] >= 1, got
    assert got["full_reads"]["per_view"] == 1  # each view read membership once, at its start
    # keep-alives: a refresh and a record check per node every ttl/3 s (0.6/s at ttl 10; the
    # harness's nodes registered together, so a 10 s window holds 3 or 4 of their cycles)
    assert 0 < got["keepalive"]["rpcs_per_node_s"] <= 0.85, got


def test_watch_events_are_applied_incrementally_one_snapshot_per_batch(etcd: LocalEtcd) -> None:
    async def go() -> tuple[int, int, int, int, int]:
        snaps: list[int] = []
        w = ClusterWatcher(etcd.endpoint, "batch", lambda s: snaps.append(len(s.nodes)), batch_s=0.05)
        task = asyncio.ensure_future(w.run())
        try:
            while not w.last.loaded:
                await asyncio.sleep(0.01)
            regs = [
                Registration(etcd.endpoint, "batch", NodeInfo(f"b{i:03d}", f"10.1.0.{i}:7070"), ttl_s=10)
                for i in range(40)
            ]
            await asyncio.gather(*(r.register() for r in regs))  # 40 joins within milliseconds
            while len(w.last.nodes) < 40:
                await asyncio.sleep(0.01)
            published = w.publishes
            await asyncio.gather(*(r.deregister() for r in regs))
            while w.last.nodes:
                await asyncio.sleep(0.01)
            for r in regs:
                await r.close()
            return w.loads, w.events, published, w.publishes, snaps[-1]
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await w.close()

    loads, events, after_joins, publishes, last = asyncio.run(go())
    assert loads == 1  # nothing re-read membership
    assert events == 80
    assert after_joins < 40 and publishes < 80  # batches, not one snapshot (and placement) per event
    assert last == 0

"""Membership at 1,000 nodes against a real etcd (issue 19, item 4): a light harness registers
1,000 node records (the real Registration code: leases, puts, keep-alives), and real watchers
must start fast, see every join and leave within a second, read membership in full once, and
apply the watch's events one by one (one snapshot per batch of events)."""

from __future__ import annotations

import asyncio

from cluster_fixtures import etcd  # noqa: F401 - fixture

from kvstore.cluster import membench
from kvstore.cluster.etcd import ClusterWatcher, Registration
from kvstore.cluster.local_etcd import LocalEtcd
from kvstore.cluster.state import NodeInfo


def test_a_thousand_nodes_views_converge_within_a_second(etcd: LocalEtcd) -> None:  # noqa: F811
    got = asyncio.run(
        membench.run_async(etcd.endpoint, "scale", nodes=1000, views=10, ttl_s=10.0, keepalive_window_s=10.0)
    )
    assert got["client_start_ms"]["snapshot_max"] <= 1000, got
    assert got["join_leave_max_ms"] <= 1000, got
    assert got["batch_leave_50_ms"] <= 1000, got
    assert got["full_reads"]["per_view"] == 1  # each view read membership once, at its start
    # keep-alives: a refresh and a record check per node every ttl/3 s (0.6/s at ttl 10; the
    # harness's nodes registered together, so a 10 s window holds 3 or 4 of their cycles)
    assert 0 < got["keepalive"]["rpcs_per_node_s"] <= 0.85, got


def test_watch_events_are_applied_incrementally_one_snapshot_per_batch(etcd: LocalEtcd) -> None:  # noqa: F811
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

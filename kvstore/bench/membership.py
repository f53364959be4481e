"""Membership at scale, against a real etcd: ``kvstore bench cluster-sim`` (its ``membership``
object) and ``tests/integration/test_membership_scale.py``.

A light harness stands in for ``N`` nodes: one :class:`~kvstore.cluster.etcd.Registration`
per node (the real registration and keep-alive code: lease, put, refresh every ttl/3 with a
record check), all on one event loop and one etcd connection, instead of ``N`` processes.
Views are real :class:`~kvstore.cluster.etcd.ClusterWatcher` objects, each with its own
connection (as every node and client has), plus one
:class:`~kvstore.cluster.membership.Membership` that builds the placement table the way a
cluster client does.

Figures:

* ``client_start_ms``: a new view's start (read everything, watch from the next revision)
  until its first snapshot, and until its placement table is built (what a cluster
  client's start waits for);
* ``join_ms`` / ``leave_ms``: from the call (register / deregister) until *every* view
  shows the change (max over views; the placement-building view included);
* ``keepalive``: what the harness's keep-alives cost etcd, from etcd's own metrics
  (gRPC messages and bytes received) over a window, per node per second;
* ``full_reads``: full reads of the cluster prefix the views made (one each at start: the
  watch applies events one by one after that), and snapshots published per event batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from kvstore.cluster.etcd import ClusterWatcher, EtcdSession, Registration
from kvstore.cluster.local_etcd import LocalEtcd, find_etcd
from kvstore.cluster.membership import Membership
from kvstore.cluster.placement import placement
from kvstore.cluster.state import ClusterSnapshot, NodeInfo


def _metrics(endpoint: str) -> dict[str, float]:
    """etcd's counters of received gRPC messages and bytes (summed over methods)."""
    text = urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=5).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r'grpc_server_msg_received_total\{.*grpc_method="(\w+)".*\} (\S+)', line)
        if m:
            out[f"msgs:{m.group(1)}"] = out.get(f"msgs:{m.group(1)}", 0.0) + float(m.group(2))
        elif line.startswith("etcd_network_client_grpc_received_bytes_total "):
            out["bytes_in"] = float(line.split()[1])
        elif line.startswith("etcd_network_client_grpc_sent_bytes_total "):
            out["bytes_out"] = float(line.split()[1])
    return out


def _info(i: int) -> NodeInfo:
    return NodeInfo(
        node_id=f"sim-{i:05d}",
        grpc=f"10.{(i >> 16) & 255}.{(i >> 8) & 255}.{i & 255}:7070",
        data=f"10.{(i >> 16) & 255}.{(i >> 8) & 255}.{i & 255}:7071",
        host=f"host-{i:05d}",
        data_dir=f"/data/{i}",
        started_at=time.time(),
    )


async def _until(views: list[ClusterWatcher], pred: Any, timeout: float) -> float:
    """Seconds until ``pred(snapshot)`` holds on every view (``timeout`` raised as TimeoutError)."""
    t0 = time.perf_counter()
    while True:
        if all(pred(v.last) for v in views):
            return time.perf_counter() - t0
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError("views did not converge")
        await asyncio.sleep(0.001)


async def run_async(
    endpoint: str, cluster: str, *, nodes: int, views: int = 20, ttl_s: float = 10.0, keepalive_window_s: float = 10.0
) -> dict[str, Any]:
    shared = EtcdSession(endpoint, timeout=10.0)
    regs: list[Registration] = []
    for i in range(nodes):
        reg = Registration(endpoint, cluster, _info(i), ttl_s=ttl_s)
        reg.session = shared  # one connection for the whole harness (a node has its own)
        regs.append(reg)
    t0 = time.perf_counter()
    for i in range(0, nodes, 100):
        await asyncio.gather(*(r.register() for r in regs[i : i + 100]))
    register_s = time.perf_counter() - t0
    tasks = [asyncio.ensure_future(r.run()) for r in regs]
    watchers: list[ClusterWatcher] = []
    wtasks: list[asyncio.Task[None]] = []
    membership: Membership | None = None
    try:
        # a client's start: read + watch, then the placement table
        t0 = time.perf_counter()
        built: dict[str, float] = {}

        def on_change(snap: ClusterSnapshot) -> None:
            if snap.nodes:
                placement(snap.config.placement, snap.members()).ranks(snap.config.replication)  # type: ignore[attr-defined]
                built.setdefault("first", time.perf_counter() - t0)

        loop = asyncio.get_running_loop()
        membership = Membership(endpoint, cluster, on_change=on_change)
        await loop.run_in_executor(None, membership.start)
        client_ready = time.perf_counter() - t0
        starts = []
        for _ in range(views):
            w = ClusterWatcher(endpoint, cluster, lambda s: None)
            watchers.append(w)
            t1 = time.perf_counter()
            wtasks.append(asyncio.ensure_future(w.run()))
            await _until([w], lambda s: s.loaded and len(s.nodes) >= nodes, 30)
            starts.append(time.perf_counter() - t1)

        class _MembershipView:  # the placement-building view, read like the watchers
            @property
            def last(self) -> ClusterSnapshot:
                assert membership is not None
                return membership.snapshot()

        everyone: list[Any] = [*watchers, _MembershipView()]
        # joins and leaves, one at a time
        joins, leaves = [], []
        for j in range(5):
            reg = Registration(endpoint, cluster, _info(nodes + j), ttl_s=ttl_s)
            reg.session = shared
            nid = reg.info.node_id
            t1 = time.perf_counter()
            await reg.register()
            await _until(everyone, lambda s, nid=nid: nid in s.nodes, 10)
            joins.append(time.perf_counter() - t1)
            t1 = time.perf_counter()
            await reg.deregister()
            await _until(everyone, lambda s, nid=nid: nid not in s.nodes, 10)
            leaves.append(time.perf_counter() - t1)
        # a batch: 50 nodes leave at once (their leases revoked together)
        gone = regs[-50:] if nodes >= 100 else []
        for t in tasks[len(regs) - len(gone) :]:  # their keep-alives stop (or they would register again)
            t.cancel()
        t1 = time.perf_counter()
        await asyncio.gather(*(r.deregister() for r in gone))
        ids = {r.info.node_id for r in gone}
        await _until(everyone, lambda s: not ids & s.nodes.keys(), 10)
        batch_leave = time.perf_counter() - t1
        # keep-alive traffic, from etcd's counters
        before, t1 = _metrics(endpoint), time.perf_counter()
        await asyncio.sleep(keepalive_window_s)
        after, dt = _metrics(endpoint), time.perf_counter() - t1
        alive = nodes - len(gone)
        per = {k.split(":", 1)[1]: (after.get(k, 0) - before.get(k, 0)) / dt / alive for k in after if ":" in k}
        per = {k: round(v, 4) for k, v in per.items() if v > 0}
        ms = [round(x * 1e3, 1) for x in (*joins,)]
        return {
            "etcd": endpoint,
            "nodes": nodes,
            "views": views + 1,
            "lease_ttl_s": ttl_s,
            "register_all_s": round(register_s, 2),
            "client_start_ms": {
                "snapshot_max": round(max(starts) * 1e3, 1),
                "snapshot_median": round(sorted(starts)[len(starts) // 2] * 1e3, 1),
                "with_placement": round(client_ready * 1e3, 1),
                "placement_built": round(built.get("first", float("nan")) * 1e3, 1),
            },
            "join_ms": ms,
            "leave_ms": [round(x * 1e3, 1) for x in leaves],
            "join_leave_max_ms": round(max(*joins, *leaves) * 1e3, 1),
            "batch_leave_50_ms": round(batch_leave * 1e3, 1),
            "keepalive": {
                "window_s": round(dt, 1),
                "msgs_per_node_s": per,
                "rpcs_per_node_s": round(sum(per.values()), 3),
                "bytes_in_per_node_s": round((after.get("bytes_in", 0) - before.get("bytes_in", 0)) / dt / alive, 1),
                "bytes_out_per_node_s": round((after.get("bytes_out", 0) - before.get("bytes_out", 0)) / dt / alive, 1),
            },
            "full_reads": {"per_view": max(w.loads for w in watchers), "views": len(watchers)},
            "events_per_publish": round(
                sum(w.events for w in watchers) / max(1, sum(w.publishes for w in watchers)), 2
            ),
        }
    finally:
        for t in [*tasks, *wtasks]:
            t.cancel()
        await asyncio.gather(*tasks, *wtasks, return_exceptions=True)
        for w in watchers:
            await w.close()
        if membership is not None:
            await asyncio.get_running_loop().run_in_executor(None, membership.close)
        with contextlib.suppress(Exception):
            await shared.close()


def run(nodes: int, *, views: int = 20, ttl_s: float = 10.0, keepalive_window_s: float = 10.0) -> dict[str, Any]:
    """Start a private etcd, run the harness against it, stop it.  ``{"skipped": why}`` without etcd."""
    if find_etcd() is None:
        return {"skipped": "etcd is not installed: membership convergence not measured (apt-get install etcd-server)"}
    with tempfile.TemporaryDirectory(prefix="kvstore-membench-") as tmp:
        server = LocalEtcd(Path(tmp) / "etcd").start()
        try:
            return asyncio.run(
                run_async(
                    server.endpoint,
                    "membench",
                    nodes=nodes,
                    views=views,
                    ttl_s=ttl_s,
                    keepalive_window_s=keepalive_window_s,
                )
            )
        finally:
            server.stop()

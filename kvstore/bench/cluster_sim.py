"""``kvstore bench cluster-sim``: every cluster figure at sizes one machine cannot run.

Per cluster size, in-process and with the real code: placement (``kvstore bench
placement``'s :func:`~kvstore.bench.placement.measure`), keys moved, balance, fan-out, and
the busiest node's read load under a Zipf workload without and with hot replicas
(:func:`hot_load`, driving :mod:`kvstore.cluster.hot`); then membership convergence
against a private etcd (:mod:`kvstore.bench.membership`) when one is installed.

State: none beyond one run; owned by the calling thread.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from typing import Any

import numpy as np

from kvstore.bench.placement import SLOTS, ints, measure
from kvstore.cluster.placement import BoundedTable


def _owns(table: BoundedTable, node: str, r: int, key: bytes) -> bool:
    return node in table.owners(key, r)


def hot_load(
    n: int,
    *,
    r: int = 2,
    keys: int = 100_000,
    zipf_s: float = 1.0,
    reads_per_node: int = 400,
    windows: int = 8,
    measure_windows: int = 3,
    max_extras: int | None = None,
    floor: float = 1.0,
    seed: int = 0,
) -> dict[str, Any]:
    """The busiest node's read load against the mean, without and with hot replicas.

    In-process, one window (1 s of simulated time) at a time: ``reads_per_node * n`` reads
    per window drawn from a Zipf(``zipf_s``) law over ``keys`` keys.  The real code decides
    and places: the placement table (:class:`BoundedTable`), each owner's decision
    (:func:`kvstore.cluster.hot.decide`, fed with the exact counts of the keys the node
    served at least ``ADMIT`` times: what its heat counter admits), the merged hot table
    (:class:`~kvstore.cluster.hot.HotTable`) and the extras (:func:`~kvstore.cluster.hot.extras`);
    readers spread a hot key uniformly over its copies (what the SDK's random pick does on
    average).  A copy read on an extra for the first time is a miss there and a read on the
    rank-0 owner (the fill).  Load = reads a node answered, misses included."""
    from kvstore.cluster import hot

    rng = np.random.default_rng(seed)
    names = [f"node-{i:04d}" for i in range(n)]
    table = BoundedTable(names)
    r = min(r, n)
    table.ranks(r)
    index = {x: i for i, x in enumerate(names)}
    key_bytes = [rng.bytes(16) for _ in range(keys)]
    owners = np.array([[index[x] for x in own] for own in table.owners_many(key_bytes, r)], dtype=np.int64)
    p = 1.0 / np.arange(1, keys + 1, dtype=np.float64) ** zipf_s
    p /= p.sum()
    reads = reads_per_node * n
    max_extras = (n - r) if max_extras is None else max_extras

    def run(with_hot: bool) -> dict[str, Any]:
        merged = hot.HotTable()
        filled: set[tuple[int, int]] = set()
        loads: list[np.ndarray] = []
        hot_keys = extra_copies = 0
        for w in range(windows):
            counts = rng.multinomial(reads, p)
            load = np.zeros(n, dtype=np.int64)
            per_node: list[dict[bytes, int]] = [{} for _ in range(n)]
            hot_now = dict(merged.merged) if with_hot else {}
            hot_idx = {i for i in range(keys) if key_bytes[i] in hot_now} if hot_now else set()
            cold = counts.copy()
            if hot_idx:
                cold[list(hot_idx)] = 0
            load += np.bincount(owners[:, 0], weights=cold, minlength=n).astype(np.int64)
            busy = np.nonzero(cold >= hot.ADMIT)[0]
            for i in busy.tolist():
                per_node[owners[i, 0]][key_bytes[i]] = int(cold[i])
            for i in hot_idx:
                kb = key_bytes[i]
                copies = [*owners[i].tolist(), *(index[x] for x in hot.extras(table, kb, r, hot_now[kb]))]
                split = rng.multinomial(int(counts[i]), [1 / len(copies)] * len(copies))
                for node, c in zip(copies, split.tolist()):
                    if c == 0:
                        continue
                    load[node] += c
                    if node not in owners[i] and (i, node) not in filled:
                        filled.add((i, node))
                        load[owners[i, 0]] += 1
                    if c >= hot.ADMIT:
                        per_node[node][kb] = c
            if w >= windows - measure_windows:
                loads.append(load)
            if not with_hot:
                continue
            for node in range(n):
                me = names[node]
                decided = hot.decide(
                    per_node[node],
                    int(load[node]),
                    1.0,
                    r=r,
                    current=merged.merged,
                    owns=functools.partial(_owns, table, me, r),
                    floor=floor,
                    max_extras=max_extras,
                )
                merged.set(me, decided)
            hot_keys, extra_copies = len(merged.merged), sum(merged.merged.values())
        total = np.sum(loads, axis=0)
        return {
            "max_over_mean": round(float(total.max() / total.mean()), 3),
            "busiest_share": round(float(total.max() / total.sum()), 5),
            "hot_keys": hot_keys,
            "extra_copies": extra_copies,
        }

    return {
        "nodes": n,
        "r": r,
        "keys": keys,
        "zipf_s": zipf_s,
        "reads_per_window": reads,
        "windows": windows,
        "without": run(False),
        "with": run(True),
    }


# -- kvstore bench cluster-sim ----------------------------------------------------------------------
def cluster_sim(
    sizes: tuple[int, ...],
    *,
    r: int = 2,
    membership_nodes: int | None = None,
    membership: bool = True,
    quick: bool = False,
) -> dict[str, Any]:
    """Every figure of issue 19 per cluster size: placement, moves, balance, fan-out, hot-node
    load (in-process, the real code), and membership convergence against a real etcd for
    ``membership_nodes`` (default: the largest size) when etcd is installed."""
    from kvstore.bench import membership as membench

    results = []
    for n in sizes:
        m = measure(
            n,
            r=r,
            keys=5_000 if quick else 20_000,
            old_keys=100 if quick else 300,
            lengths=(16, 256, 1000),
            groups=(1, 16, 64),
            prompts=3 if quick else 5,
        )
        m["hot"] = hot_load(n, r=r, windows=6 if quick else 10, reads_per_node=200 if quick else 400)
        results.append(m)
    out: dict[str, Any] = {"slots": SLOTS, "replication": r, "results": results}
    if membership:
        target = membership_nodes or max(sizes)
        out["membership"] = membench.run(target, views=10 if quick else 20, keepalive_window_s=5 if quick else 10)
    else:
        out["membership"] = {"skipped": "not asked for (--no-membership)"}
    return out


def print_cluster_sim(out: dict[str, Any], f: Any) -> None:
    print(f"kvstore bench cluster-sim: bounded-v1 ({out['slots']} slots), R = {out['replication']}", file=f)
    print(
        f"{'nodes':>6} {'us/key':>7} {'(old)':>8} {'1000-chunk ms':>13} {'build ms':>8} {'moved join/leave (ideal)':>27}"
        f" {'balance':>7} {'hot max/mean without -> with':>29} {'hot keys':>8} {'copies':>6}",
        file=f,
    )
    for m in out["results"]:
        rr = f"r{m['r']}"
        mv = m["moved"][rr]
        h = m["hot"]
        print(
            f"{m['nodes']:>6} {m['us_per_key']['bounded']:>7.2f} {m['us_per_key']['rendezvous']:>8.1f} "
            f"{m['match_prefix_1000_ms']['bounded']:>13.2f} {m['build_ms']:>8.0f} "
            f"{mv['join']:>8.4f}/{mv['leave']:.4f} ({mv['ideal_leave']:.4f}) {list(m['balance'].values())[-1]:>7.3f} "
            f"{h['without']['max_over_mean']:>17.2f} -> {h['with']['max_over_mean']:<8.2f} "
            f"{h['with']['hot_keys']:>8} {h['with']['extra_copies']:>6}",
            file=f,
        )
    print("\nRPCs per request (read: rank-0 owners / write: all R owners), by prompt chunks and chunk group", file=f)
    for m in out["results"]:
        print(
            f"{m['nodes']:>6}  "
            + "  ".join(f"{k}: {v['read_rpcs']:.1f}/{v['write_rpcs']:.1f}" for k, v in m["rpcs"].items()),
            file=f,
        )
    mem = out["membership"]
    if "skipped" in mem:
        print(f"\nmembership: {mem['skipped']}", file=f)
        return
    ka = mem["keepalive"]
    print(
        f"\nmembership (real etcd {mem['etcd']}, {mem['nodes']} registered nodes, {mem['views']} views):\n"
        f"  client start: snapshot {mem['client_start_ms']['snapshot_median']:.0f} ms median / "
        f"{mem['client_start_ms']['snapshot_max']:.0f} ms max; with its placement table "
        f"{mem['client_start_ms']['with_placement']:.0f} ms\n"
        f"  every view converged after a join/leave in <= {mem['join_leave_max_ms']:.0f} ms "
        f"(joins {mem['join_ms']} ms, leaves {mem['leave_ms']} ms); 50 leaving at once: "
        f"{mem['batch_leave_50_ms']:.0f} ms\n"
        f"  keep-alive on etcd per node: {ka['rpcs_per_node_s']:.3f} RPC/s ({ka['msgs_per_node_s']}), "
        f"{ka['bytes_in_per_node_s']:.0f} B/s in, {ka['bytes_out_per_node_s']:.0f} B/s out (lease TTL {mem['lease_ttl_s']:.0f} s)\n"
        f"  full reads of membership per view: {mem['full_reads']['per_view']} (start only); "
        f"events per published snapshot: {mem['events_per_publish']}",
        file=f,
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", default="3,64,256,1000", metavar="N[,N]", help="cluster sizes (default 3,64,256,1000)")
    p.add_argument(
        "--no-membership", action="store_true", help="skip the etcd membership measurement (its 1,000-node harness)"
    )
    p.add_argument("--quick", action="store_true", help="fewer keys, prompts and windows")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout (the table goes to stderr)")


def main(a: argparse.Namespace) -> int:
    sim = cluster_sim(ints(a.nodes), membership=not a.no_membership, quick=a.quick)
    print_cluster_sim(sim, sys.stderr if a.json else sys.stdout)
    if a.json:
        print(json.dumps(sim, sort_keys=True), flush=True)
    return 0

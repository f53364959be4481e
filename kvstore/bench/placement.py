"""``kvstore bench placement``: placement at cluster sizes one machine cannot run.

In-process and with the real code: the tables the SDK routes by
(:mod:`kvstore.cluster.placement`), the original rendezvous scheme measured in the same
run (timings are reported as ratios to it: the machine's speed and load cancel out), and
request fan-out computed from real chunk keys (:func:`kvstore.keys.chunk_keys`) grouped
as ``ClusterClient.chunk_keys`` groups them.  No etcd, no nodes.

Figures, per cluster size N:

* ``us_per_key``: owners of one key (``owners(key, r)``), old and new, and their ratio;
  ``batch_us_per_key``: the batched path the SDK uses (``owners_many``);
* ``build_ms``: building the table (and its ``r`` ranks), once per membership change;
* ``match_prefix_ms``: routing a 1,000-chunk ``match_prefix`` (owners of every key);
* ``moved``: fraction of the key space whose owner set changes when a node joins or
  leaves, against the minimal ``r / N``;
* ``balance``: max/mean of each node's exact share of the key space (slots), rank 0
  and all ``r`` ranks; ``balance_sampled``: max/mean of keys per node for 1,000 sampled
  keys per node, beside what a perfectly uniform random placement shows for as many keys
  (at that sample size the sampling noise, not the placement, dominates);
* ``rpcs``: owners one request touches (rank-0 reads; the R owners of writes) by prompt
  length and chunk group.

State: none beyond one run; owned by the calling thread.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import numpy as np

from kvstore.cluster.placement import SLOTS, BoundedTable, Ring, group_keys, slot_of
from kvstore.keys import Namespace, chunk_keys

DEFAULT_NODES = (3, 64, 256, 1024)


def _timed(fn: Any, repeat: int = 3) -> float:
    """Best of ``repeat`` wall times (s): the least disturbed run on a shared machine."""
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _rows(table: BoundedTable, r: int) -> list[frozenset[int]]:
    cols = [np.asarray(c, dtype=np.int64) for c in table.ranks(r)]
    names = np.array(table.nodes, dtype=object)
    return [frozenset(x) for x in zip(*(names[c] for c in cols))]


def _moved(a: BoundedTable, b: BoundedTable, r: int) -> float:
    return sum(x != y for x, y in zip(_rows(a, r), _rows(b, r))) / SLOTS


def _prompts(count: int, chunks: int, chunk_tokens: int, seed: int) -> list[list[bytes]]:
    rng = np.random.default_rng(seed)
    ns = Namespace("bench-placement", chunk_tokens=chunk_tokens)
    return [list(chunk_keys(rng.integers(0, 32000, chunks * chunk_tokens), ns)) for _ in range(count)]


def measure(
    n: int, *, r: int, keys: int, old_keys: int, lengths: tuple[int, ...], groups: tuple[int, ...], prompts: int
) -> dict[str, Any]:
    nodes = [f"node-{i:04d}" for i in range(n)]
    sample = [os.urandom(16) for _ in range(keys)]
    build_s = _timed(lambda: BoundedTable(nodes).ranks(r), 1)
    table = BoundedTable(nodes)
    table.ranks(r)
    ring = Ring(nodes)
    old_s = _timed(lambda: [ring.owners(k, r) for k in sample[:old_keys]]) / old_keys
    new_s = _timed(lambda: [table.owners(k, r) for k in sample]) / keys
    batch_s = _timed(lambda: table.owners_many(sample, r)) / keys
    prefix = sample[:1000]
    old_prefix_s = old_s * len(prefix)
    match_s = _timed(lambda: table.owners_many(prefix, r))
    # moves
    joined, left = BoundedTable([*nodes, "node-new"]), BoundedTable(nodes[1:])
    moved = {}
    for rr in sorted({1, r}):
        rr = min(rr, n)
        moved[f"r{rr}"] = {
            "join": round(_moved(table, joined, rr), 5),
            "leave": round(_moved(table, left, rr), 5),
            "ideal_join": round(rr / (n + 1), 5),
            "ideal_leave": round(rr / n, 5),
        }
    # balance: exact shares, and sampled keys
    cols = [np.bincount(np.asarray(c, dtype=np.int64), minlength=n) for c in table.ranks(r)]
    share0, share_r = cols[0], np.sum(cols, axis=0)
    sampled = [os.urandom(16) for _ in range(max(keys, 1000 * n))]
    rank0 = table.slot_owners(0)
    per_key = np.bincount(np.array([rank0[slot_of(k)] for k in sampled]), minlength=n)
    # what a perfectly uniform placement would show for as many keys (the sampling noise alone)
    uniform = np.random.default_rng(0).multinomial(len(sampled), [1 / n] * n)
    # fan-out per request
    rpcs: dict[str, Any] = {}
    for length in lengths:
        ps = _prompts(prompts, length, 16, seed=length)
        for g in groups:
            reads, writes = [], []
            for p in ps:
                own = table.owners_many(group_keys(p, g), r)
                reads.append(len({o[0] for o in own}))
                writes.append(len({x for o in own for x in o}))
            rpcs[f"chunks={length},group={g}"] = {
                "read_rpcs": statistics.mean(reads),
                "write_rpcs": statistics.mean(writes),
            }
    return {
        "nodes": n,
        "r": min(r, n),
        "us_per_key": {
            "rendezvous": round(old_s * 1e6, 3),
            "bounded": round(new_s * 1e6, 3),
            "ratio": round(old_s / new_s, 1),
        },
        "batch_us_per_key": round(batch_s * 1e6, 3),
        "build_ms": round(build_s * 1e3, 1),
        "match_prefix_1000_ms": {"rendezvous": round(old_prefix_s * 1e3, 2), "bounded": round(match_s * 1e3, 3)},
        "moved": moved,
        "balance": {
            "rank0": round(float(share0.max() / share0.mean()), 4),
            f"ranks0-{min(r, n) - 1}": round(float(share_r.max() / share_r.mean()), 4),
        },
        "balance_sampled": {
            "keys": len(sampled),
            "max_over_mean": round(float(per_key.max() / per_key.mean()), 3),
            "uniform_max_over_mean": round(float(uniform.max() / uniform.mean()), 3),
        },
        "rpcs": rpcs,
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--nodes",
        default=",".join(map(str, DEFAULT_NODES)),
        help="cluster sizes, comma-separated (default 3,64,256,1024)",
    )
    p.add_argument("--replication", type=int, default=2, metavar="R", help="owners per key (default 2)")
    p.add_argument("--keys", type=int, default=20_000, help="keys timed per size for bounded-v1 (default 20000)")
    p.add_argument("--old-keys", type=int, default=1_000, help="keys timed per size for rendezvous-v1 (default 1000)")
    p.add_argument(
        "--lengths", default="16,64,256,1000", help="prompt lengths in chunks for fan-out (default 16,64,256,1000)"
    )
    p.add_argument("--groups", default="1,16,64", help="chunk groups for fan-out (default 1,16,64)")
    p.add_argument("--prompts", type=int, default=10, help="prompts per length (default 10)")
    p.add_argument("--json", action="store_true", help="print JSON")


def ints(spec: str) -> tuple[int, ...]:
    from kvstore.errors import InvalidArgument

    try:
        vals = tuple(int(x) for x in spec.split(",") if x.strip())
    except ValueError:
        raise InvalidArgument(f"expected comma-separated integers, got {spec!r}") from None
    if not vals or min(vals) < 1:
        raise InvalidArgument(f"expected positive integers, got {spec!r}")
    return vals


def main(a: argparse.Namespace) -> int:
    sizes, lengths, groups = ints(a.nodes), ints(a.lengths), ints(a.groups)
    out = [
        measure(
            n,
            r=max(1, a.replication),
            keys=max(1, a.keys),
            old_keys=max(1, a.old_keys),
            lengths=lengths,
            groups=groups,
            prompts=max(1, a.prompts),
        )
        for n in sizes
    ]
    if a.json:
        print(json.dumps({"slots": SLOTS, "results": out}, indent=2))
        return 0
    print(f"placement: bounded-v1 ({SLOTS} slots) against rendezvous-v1, same run; R = {a.replication}")
    print(
        f"{'nodes':>6} {'old us/key':>10} {'new us/key':>10} {'ratio':>7} {'batch us':>8} {'build ms':>8} "
        f"{'1000-chunk ms old/new':>22} {'bal r0':>7} {'bal all':>7} {'sampled/uniform':>15}"
    )
    for m in out:
        u, mp, b = m["us_per_key"], m["match_prefix_1000_ms"], list(m["balance"].values())
        print(
            f"{m['nodes']:>6} {u['rendezvous']:>10.2f} {u['bounded']:>10.2f} {u['ratio']:>6.1f}x {m['batch_us_per_key']:>8.2f} "
            f"{m['build_ms']:>8.0f} {mp['rendezvous']:>12.1f} / {mp['bounded']:<7.2f} {b[0]:>7.3f} {b[1]:>7.3f} "
            f"{m['balance_sampled']['max_over_mean']:>7.3f}/{m['balance_sampled']['uniform_max_over_mean']:<7.3f}"
        )
    print("\nkeys moved by one join / leave (fraction of the key space; ideal = r/N)")
    for m in out:
        parts = [
            f"{k}: join {v['join']:.4f} ({v['join'] / v['ideal_join']:.2f}x ideal), leave {v['leave']:.4f} "
            f"({v['leave'] / v['ideal_leave']:.2f}x)"
            for k, v in m["moved"].items()
        ]
        print(f"{m['nodes']:>6}  " + "; ".join(parts))
    print("\nowners touched per request (read: rank-0 owners; write: all R owners)")
    for m in out:
        print(
            f"{m['nodes']:>6}  "
            + "  ".join(f"{k}: {v['read_rpcs']:.1f}/{v['write_rpcs']:.1f}" for k, v in m["rpcs"].items())
        )
    return 0

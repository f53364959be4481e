"""``kvstore bench latency``: p50/p99 of single-block calls, locally and over TCP.

Role: the per-call cost the batched throughput figures hide (issue 15 #2).  For each
path (``local``: shared memory over the Unix socket; ``tcp``: the data channel) and each
size in ``--sizes``, ``--latency-ops`` calls of each operation on one block at a time:
``put`` (a new key each call), ``get`` (``get_into`` a pre-faulted buffer), ``exists``
and ``match_prefix`` (one stored key; size-independent, so measured at the first size).
Every call is timed on its own with ``perf_counter``; the figures are p50, p99 and the
mean in microseconds, client wall time (the RPC, the copy and the node's work).

A warm-up of ``ops // 10`` calls per operation runs first, untimed.  Keys are deleted
afterwards, untimed.  No state outlives a call.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import struct
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

import xxhash

from kvstore.bench.kit import KiB, MiB, add_report_arguments, buffer, label, log, report, sizes_arg, split_targets
from kvstore.bench.nodes import private_node
from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.vocabulary import percentiles

OPS = ("put", "get", "exists", "match_prefix")
_run = itertools.count(int(time.time() * 1000) & 0xFFFFFFFF)


def _summary(samples: Sequence[float]) -> dict[str, float | None]:
    """p50, p99 and mean of ``samples`` (seconds), in microseconds, and how many."""
    return {
        **percentiles(samples, scale=1e6, digits=1, suffix="_us"),
        "mean_us": round(sum(samples) / len(samples) * 1e6, 1),
        "calls": len(samples),
    }


def _times(fn: Callable[[int], Any], n: int) -> list[float]:
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        fn(i)
        out.append(time.perf_counter() - t0)
    return out


def measure_path(kv: Any, sizes: Sequence[int], ops: int) -> dict[str, dict[str, Any]]:
    """``{size label: {op: percentiles}}`` of one client."""
    run = next(_run) << 32 | os.getpid()
    out: dict[str, dict[str, Any]] = {}
    for si, size in enumerate(sizes):
        src, dst = buffer(size, pattern=True), buffer(size)
        want = xxhash.xxh3_64_intdigest(src.data)
        warm = max(1, ops // 10)
        keys = [struct.pack("<QII", run, si, i) for i in range(warm + ops)]
        stored = keys[0]
        try:
            for i in range(warm):  # connections, caches, the node's first allocations
                kv.put(keys[i], src)
                kv.get_into(stored, dst)
            if xxhash.xxh3_64_intdigest(dst.data) != want:
                raise KVStoreError(f"get of a {label(size)} block returned bytes that differ from the put")
            r: dict[str, Any] = {}
            # B023: each closure below runs to completion within this iteration of the loop

            def put(i: int) -> None:
                if not kv.put(keys[warm + i], src):  # noqa: B023
                    raise KVStoreError(f"a {label(size)} put failed (node out of DRAM?)")  # noqa: B023

            r["put"] = _summary(_times(put, ops))
            r["get"] = _summary(_times(lambda i: kv.get_into(keys[warm + i], dst), ops))  # noqa: B023
            if si == 0:
                r["exists"] = _summary(_times(lambda i: kv.exists([keys[warm + i]]), ops))  # noqa: B023
                r["match_prefix"] = _summary(_times(lambda i: kv.match_prefix([keys[warm + i]]), ops))  # noqa: B023
            out[label(size)] = r
        finally:
            for i in range(0, len(keys), 1024):
                kv.delete(keys[i : i + 1024])
    return out


def run_latency(targets: dict[str, tuple[str, str]], sizes: Sequence[int], ops: int) -> dict[str, Any]:
    """``targets``: path name -> (target, transport).  The ``latency`` object."""
    from client import KVClient

    out: dict[str, Any] = {"ops": ops, "sizes": [label(s) for s in sizes], "paths": {}}
    for name, (target, transport) in targets.items():
        log(f"latency: {name}: {ops} single-block calls per operation and size ...")
        with KVClient(target, transport=transport) as kv:
            out["paths"][name] = measure_path(kv, sizes, ops)
    return out


def _cell(p: dict[str, Any] | None) -> str:
    return f"{p['p50_us']:.0f} / {p['p99_us']:.0f}" if p else "-"


def print_latency(r: dict[str, Any], f: TextIO) -> None:
    print(f"single-block latency, {r['ops']} calls each (client wall time, us):", file=f)
    print(f"{'path':<8}{'size':>8}  " + "".join(f"{op + ' p50/p99':>22}" for op in OPS), file=f)
    for path, by_size in r["paths"].items():
        for size, v in by_size.items():
            cells = "".join(f"{_cell(v.get(op)):>22}" for op in OPS)
            print(f"{path:<8}{size:>8}  {cells}", file=f)


def run(a: argparse.Namespace) -> dict[str, Any]:
    """Single-block calls on a private node (or ``--target``)."""
    work = Path(tempfile.mkdtemp(prefix="kvstore-bench-"))
    node = None
    try:
        if a.target:
            unix, tcp = split_targets(a.target)
            where = a.target
        else:
            dram = -(-max(64 * MiB, int(1.25 * (a.latency_ops * 11 // 10 + 1) * max(a.sizes))) // MiB) * MiB
            log(f"latency: starting a private node ({dram >> 20} MiB DRAM) ...")
            node = private_node(dram, work)
            unix, tcp = node.endpoints["unix"], node.endpoints["grpc"]
            where = f"private (pid {node.endpoints['pid']}, {dram >> 20} MiB DRAM)"
        targets = {
            name: (t, transport)
            for name, t, transport in (("local", unix, "shm"), ("tcp", tcp, "data-channel"))
            if t and name in a.paths
        }
        return {"bench": "sdk", "node": where, "latency": run_latency(targets, a.sizes, a.latency_ops)}
    finally:
        if node is not None:
            node.stop()
        shutil.rmtree(work, ignore_errors=True)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvstore.bench.sdk import add_target_arguments

    add_report_arguments(p, quick="200 calls per operation and size")
    p.add_argument("--sizes", type=sizes_arg, default=None, metavar="LIST", help="block sizes (default 64KiB,256KiB)")
    p.add_argument(
        "--latency-ops",
        "--ops",
        dest="latency_ops",
        type=int,
        default=None,
        metavar="N",
        help="calls per operation and size (default 1000; --quick 200)",
    )
    add_target_arguments(p)


def main(a: argparse.Namespace) -> int:
    a.sizes = a.sizes or [64 * KiB, 256 * KiB]
    a.latency_ops = a.latency_ops or (200 if a.quick else 1000)
    if a.latency_ops < 1:
        raise InvalidArgument("--latency-ops must be at least 1")
    a.paths = {x.strip() for x in a.paths.split(",") if x.strip()}
    load_before = os.getloadavg()[0]
    result = run(a)

    def table(f: TextIO) -> None:
        print(f"kvstore bench latency; node: {result['node']}", file=f)
        print_latency(result["latency"], f)

    return report(result, json_out=a.json, load_before=load_before, table=table)

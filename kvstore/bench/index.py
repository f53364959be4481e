"""``kvstore bench index --blocks N``: a node's NVMe tier holding N small blocks.

Role: measures what a large index costs (issue 15 #3), as the ``index`` object of the
engine benchmark's JSON:

* ``restart_s``: a real ``kvstore serve`` node on that NVMe directory, from SIGTERM to
  READY again (its stop, a new interpreter, the index scan, the arena, gRPC); ``stop_s``
  and ``start_s`` (the first start, page cache warm from the fill) beside it;
* ``open_s``: the NVMe tier's own open in this process (the part of a restart that grows
  with N), ``index_check_s`` the index check it starts with (meta pages, then a read of
  every entry in a child process: ``tiers/nvme_recovery.py``);
* ``disk_bytes`` / ``disk_used_bytes``: the lmdb file and the pages its last transaction
  uses; ``memory_bytes``: anonymous memory (``RssAnon``) the open added to this process;
* ``match_prefix_1000_us`` / ``exists_1000_us``: the tier manager's own calls over 1,000
  stored keys (server time, best of ``repeat``), and ``*_rpc_us`` the same over the
  node's Unix socket (the SDK's round trip included).

The blocks are written straight into the tier (group commits of 1,024, no fsync per
batch; one ``sync`` at the end): filling is not what is measured.  Keys form chains of
1,000 (each block's parent is the one before), as prefixes do.  No state outlives a call.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import struct
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.bench.kit import KiB, MiB, label, log, report, size_arg
from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.keys import ChunkKey

CHAIN = 1000
TARGETS = {200_000: 3.0, 1_000_000: 15.0}  # restart_s at most, by size (issue 15)
MATCH_PREFIX_TARGET_US = 1000.0


def rss_anon(pid: int | str = "self") -> int:
    """Anonymous resident memory of a process (heap, not mapped files such as lmdb's), in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def _key(i: int) -> ChunkKey:
    return ChunkKey(struct.pack("<QQ", 0x1DE7, i))


def _fill(directory: Path, n: int, size: int, capacity: int) -> float:
    from kvstore.block import BlockMeta, checksum
    from kvstore.keys import NO_PARENT
    from tiers.nvme import NVMeTier

    payload = np.zeros(size, np.uint8)
    pcs = checksum(payload)
    t0 = time.perf_counter()
    with NVMeTier(directory, capacity, sync=False) as tier:
        for lo in range(0, n, 1024):
            tier.write_many(
                [
                    (
                        BlockMeta.for_payload(
                            _key(i), payload, payload_checksum=pcs, parent=NO_PARENT if i % CHAIN == 0 else _key(i - 1)
                        ),
                        payload,
                    )
                    for i in range(lo, min(n, lo + 1024))
                ]
            )
            if lo % (64 * 1024) == 0 and lo:
                log(f"index: {lo:,} of {n:,} blocks written")
    os.sync()
    return time.perf_counter() - t0


def _disk(index_dir: Path) -> tuple[int, int]:
    import lmdb

    data = index_dir / "data.mdb"
    env = lmdb.open(str(index_dir), readonly=True, lock=False, max_dbs=2)
    try:
        info, psize = env.info(), env.stat()["psize"]
    finally:
        env.close()
    return data.stat().st_size, (info["last_pgno"] + 1) * psize


def _best_us(fn: Any, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return round(best * 1e6, 1)


def _in_process(directory: Path, capacity: int, n: int, repeat: int) -> dict[str, Any]:
    """Open the tier here (time, memory) and time the manager's lookups over it."""
    from kvstore.node.manager import TierManager
    from tiers.arena import Arena
    from tiers.dram import DRAMTier
    from tiers.nvme import NVMeTier
    from tiers.nvme_recovery import index_damage
    from tiers.policy import DEFAULT_POLICY, make_policy

    t0 = time.perf_counter()
    damage = index_damage(directory / "index.lmdb")
    check_s = time.perf_counter() - t0
    if damage is not None:
        raise KVStoreError(f"the index the benchmark wrote reads as damaged: {damage}")
    gc.collect()
    before = rss_anon()
    t0 = time.perf_counter()
    tier = NVMeTier(directory, capacity, policy=make_policy(DEFAULT_POLICY))
    open_s = time.perf_counter() - t0
    gc.collect()
    memory = rss_anon() - before
    arena = Arena.create(Path("/dev/shm") / f"kvstore-bench-index-{os.getpid()}.arena", 4 * MiB, prefault=False)
    m = TierManager(DRAMTier(arena, unit=4096), tier)
    try:
        if len(tier) != n:
            raise KVStoreError(f"the NVMe tier reopened with {len(tier)} blocks, not {n}")
        chain = n // CHAIN // 2 * CHAIN if n >= CHAIN else 0  # a chain in the middle of the index
        keys = [_key(i) for i in range(chain, min(n, chain + CHAIN))]
        hit, _ = m.match_prefix(keys)
        if hit != len(keys):
            raise KVStoreError(f"match_prefix found {hit} of {len(keys)} stored keys")
        mp = _best_us(lambda: m.match_prefix(keys), repeat)
        ex = _best_us(lambda: m.exists(keys), repeat)
    finally:
        m.close()
    return {
        "open_s": round(open_s, 3),
        "index_check_s": round(check_s, 3),
        "memory_bytes": memory,
        "memory_bytes_per_block": round(memory / max(n, 1)),
        "match_prefix_1000_us": mp,
        "exists_1000_us": ex,
        "keys_per_lookup": len(keys),
        "match_prefix_us_per_key": round(mp / len(keys), 3),
        "exists_us_per_key": round(ex / len(keys), 3),
    }


def _node(work: Path, capacity: int, n: int, repeat: int) -> dict[str, Any]:
    """Start a node on the filled directory, then restart it: stop → READY timed."""
    from client import KVClient
    from kvstore.bench.nodes import bench_node

    sock = Path(tempfile.mkdtemp(prefix="kvb-"))  # a deep --dir would make too long a socket path
    node = None
    try:
        t0 = time.perf_counter()
        node = bench_node("64MiB", work, nvme=capacity, extra=("--socket", str(sock / "node.sock")), timeout=600)
        start_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        if node.stop(timeout=300) != 0:
            raise KVStoreError("the benchmark's node did not stop cleanly")
        stop_s = time.perf_counter() - t0
        node.start(timeout=600)
        restart_s = time.perf_counter() - t0
        rss = rss_anon(node.endpoints["pid"])
        keys = [_key(i) for i in range(min(n, CHAIN))]
        with KVClient(node.target) as kv:
            if kv.match_prefix(keys) != len(keys):
                raise KVStoreError("the restarted node does not hold the blocks it had")
            mp = _best_us(lambda: kv.match_prefix(keys), repeat)
            ex = _best_us(lambda: kv.lookup(keys), repeat)
    finally:
        if node is not None:
            node.stop(timeout=300)
        shutil.rmtree(sock, ignore_errors=True)
    return {
        "start_s": round(start_s, 3),
        "stop_s": round(stop_s, 3),
        "restart_s": round(restart_s, 3),
        "node_rss_anon_bytes": rss,
        "match_prefix_1000_rpc_us": mp,
        "exists_1000_rpc_us": ex,
    }


def run_index(n: int, block: int, base: Path, repeat: int = 20) -> dict[str, Any]:
    """The ``index`` object for ``n`` blocks of ``block`` bytes (see the module)."""
    from tiers.nvme_format import PAGE, record_bytes

    if n < 1:
        raise InvalidArgument("--blocks must be at least 1")
    capacity = -(-(record_bytes(block) * n + 64 * MiB) // PAGE) * PAGE
    if shutil.disk_usage(base).free < capacity + 2 * n * 256 + 256 * MiB:
        raise InvalidArgument(
            f"{base} has less than {label(capacity)} free for {n:,} blocks of {label(block)}; pass --dir"
        )
    work = Path(tempfile.mkdtemp(prefix="kvstore-bench-index-", dir=base))
    nvme = work / "node" / "nvme"
    try:
        log(f"index: writing {n:,} blocks of {label(block)} into an NVMe tier in {work} ...")
        fill_s = _fill(nvme, n, block, capacity)
        log(f"index: node start, stop, restart on {n:,} blocks ...")
        out: dict[str, Any] = {
            "blocks": n,
            "block_bytes": block,
            "record_bytes": record_bytes(block),
            "fill_s": round(fill_s, 1),
            **_node(work, capacity, n, repeat),
        }
        disk, used = _disk(nvme / "index.lmdb")
        out.update(disk_bytes=disk, disk_used_bytes=used, disk_bytes_per_block=round(used / n))
        log("index: opening the tier in-process for memory and lookup figures ...")
        out.update(_in_process(nvme, capacity, n, repeat))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    target = next((t for size, t in sorted(TARGETS.items()) if n <= size), None)
    out["targets"] = {"match_prefix_1000_us": MATCH_PREFIX_TARGET_US} | ({"restart_s": target} if target else {})
    out["targets_met"] = {k: out[k] <= t for k, t in out["targets"].items()}
    return out


def print_index(r: dict[str, Any], f: Any) -> None:
    print(
        f"kvstore bench index --blocks {r['blocks']:,}: blocks of {label(r['block_bytes'])} "
        f"({label(r['record_bytes'])} records), filled in {r['fill_s']:.0f} s",
        file=f,
    )
    rows = [
        ("restart (SIGTERM -> READY)", f"{r['restart_s']:.2f} s"),
        ("  stop / first start", f"{r['stop_s']:.2f} s / {r['start_s']:.2f} s"),
        ("  NVMe tier open (in-process)", f"{r['open_s']:.2f} s, of which index check {r['index_check_s']:.2f} s"),
        (
            "index on disk (used / file)",
            f"{r['disk_used_bytes'] / MiB:.1f} / {r['disk_bytes'] / MiB:.1f} MiB ({r['disk_bytes_per_block']} B/block)",
        ),
        (
            "index in memory (RssAnon)",
            f"{r['memory_bytes'] / MiB:.1f} MiB ({r['memory_bytes_per_block']} B/block); "
            f"node {r['node_rss_anon_bytes'] / MiB:.0f} MiB",
        ),
        (
            "match_prefix, 1,000 keys",
            f"{r['match_prefix_1000_us']:.0f} us server, {r['match_prefix_1000_rpc_us']:.0f} us rpc",
        ),
        ("exists, 1,000 keys", f"{r['exists_1000_us']:.0f} us server, {r['exists_1000_rpc_us']:.0f} us rpc"),
    ]
    for name, v in rows:
        print(f"{name:<32}{v}", file=f)
    for k, t in r["targets"].items():
        print(f"target {k:<24} <= {t:<6} got {r[k]:>8}  {'met' if r['targets_met'][k] else 'MISSED'}", file=f)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--blocks",
        "--index-blocks",
        dest="index_blocks",
        type=int,
        required=True,
        metavar="N",
        help="fill a node's NVMe tier with N small blocks and report restart time, index size and lookup cost at that size",
    )
    p.add_argument(
        "--block-bytes",
        "--index-block-bytes",
        dest="index_block_bytes",
        type=size_arg,
        default=4 * KiB,
        metavar="SIZE",
        help="payload of each block (default 4KiB: 8KiB on disk)",
    )
    p.add_argument(
        "--dir",
        metavar="DIR",
        help="directory for the NVMe tier (default: a temp dir on the data dir's filesystem, never tmpfs)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout (the table goes to stderr)")


def main(a: argparse.Namespace) -> int:
    from kvstore.bench.engine import engine_base_dir

    load_before = os.getloadavg()[0]
    base = Path(a.dir) if a.dir else engine_base_dir()
    result: dict[str, Any] = {"bench": "engine", "index": run_index(a.index_blocks, a.index_block_bytes, base)}
    return report(result, json_out=a.json, load_before=load_before, table=lambda f: print_index(result["index"], f))

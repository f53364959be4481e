"""``python -m kvstore.bench.poolview --blocks N``: what a ``PoolView`` costs (architecture §3a).

Prints one JSON object:

* ``index``: N blocks of random 16-byte keys spread over ``--nodes`` nodes, taken in through
  the very code a snapshot goes through in a view (``client/_holdings.py``: hashes, entries
  per 16,384-key message, one ``NodeHoldings.replace`` per node).  ``bytes_per_block`` is
  what the index keeps; ``peak_bytes_per_block`` the most Python and numpy held while
  building it (``tracemalloc``: the messages' entries, their concatenation, the sort);
  ``build_s`` the time.
* ``deltas``: ``--deltas`` changes applied to the first node (drops of held keys, up to
  16,384, the rest new keys put in DRAM, so the recent keys are merged into the array as
  they pass ``MERGE_AT``), in 4,096-change messages as a stream carries them; per second.
* ``match``: the lookup behind ``PoolView.match`` (hash the chain, ask every node, pick the
  fastest holder) for chains of 16, 64 and 256 held keys, and a chain whose first key is
  held nowhere; p50 and p99 in microseconds over ``--repeat`` calls.
* ``false_positives``: ``--probes`` random keys never stored, looked up: how many were
  reported held, and the expected rate (``blocks / 2^62``).
* ``live`` (``--live M``, 0: skipped): a private node (DRAM for all M blocks: each takes a
  64 KiB allocation unit) and a ``PoolView`` following it while M 4 KiB blocks are put: the
  time until the view holds what the node holds, the view's lag p50/p99 (ms,
  ``PoolView.stats``), and the full ``PoolView.match`` over a 64-key chain (µs).

A benchmark, not a test: nothing here asserts a time.  No state outlives a call.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np

from client._holdings import NodeHoldings, best_holders, entries, key_hashes
from kvstore.bench.kit import log
from kvstore.errors import InvalidArgument
from kvstore.vocabulary import percentiles

MESSAGE = 16384  # keys per snapshot message, as the node sends them
DELTAS = 4096  # changes per delta message
CHAINS = (16, 64, 256)


def _keys(rng: np.random.Generator, n: int) -> bytes:
    return rng.bytes(16 * n)


def _time_calls(fn: Callable[[], Any], repeat: int) -> dict[str, float | None]:
    for _ in range(min(repeat, 100)):  # warm
        fn()
    out = []
    for _ in range(repeat):
        t = time.perf_counter_ns()
        fn()
        out.append(time.perf_counter_ns() - t)
    return percentiles(out, scale=1e-3, digits=2, suffix="_us")


def build_index(blocks: int, nodes: int, seed: int) -> tuple[list[NodeHoldings], bytes, dict[str, Any]]:
    """The nodes' indexes holding ``blocks`` random keys (message by message, round robin over
    the nodes); the first message's keys (for lookups); the ``index`` figures."""
    rng = np.random.default_rng(seed)
    holdings = [NodeHoldings() for _ in range(nodes)]
    parts: list[list[Any]] = [[] for _ in range(nodes)]
    first = b""
    gc.collect()
    tracemalloc.start()
    t0 = time.perf_counter()
    for i, lo in enumerate(range(0, blocks, MESSAGE)):
        raw = _keys(rng, min(MESSAGE, blocks - lo))
        if not first:
            first = raw
        tiers = rng.integers(1, 4, len(raw) // 16, dtype=np.uint8)  # DRAM, NVMe or both
        parts[i % nodes].append(entries(key_hashes(raw), tiers))
        del raw
    for h, p in zip(holdings, parts):
        snapshot = np.concatenate(p) if p else np.empty(0, np.uint64)
        p.clear()
        h.replace(snapshot)
        del snapshot
    build_s = time.perf_counter() - t0
    kept, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    kept -= len(first)  # the lookup keys are the benchmark's, not the index's
    index_bytes = sum(h.nbytes() for h in holdings)
    return (
        holdings,
        first,
        {
            "blocks": blocks,
            "nodes": nodes,
            "index_bytes": index_bytes,
            "bytes_per_block": round(index_bytes / max(blocks, 1), 2),
            "traced_bytes_per_block": round(kept / max(blocks, 1), 2),
            "peak_bytes_per_block": round(peak / max(blocks, 1), 2),
            "build_s": round(build_s, 3),
        },
    )


def apply_deltas(h: NodeHoldings, held: bytes, n: int, seed: int) -> dict[str, Any]:
    """``n`` changes to ``h``: drops of the keys in ``held`` (up to half), the rest new keys put in DRAM."""
    rng = np.random.default_rng(seed + 1)
    drops = min(n // 2, len(held) // 16)
    new = key_hashes(_keys(rng, n - drops))
    old = key_hashes(held[: 16 * drops])
    hashes = np.concatenate([new, old])
    changes = np.concatenate([np.full(len(new), 0x01, np.uint8), np.full(len(old), 0x30, np.uint8)])
    order = rng.permutation(len(hashes))
    hashes, changes = hashes[order], changes[order]
    t0 = time.perf_counter()
    for lo in range(0, len(hashes), DELTAS):
        h.apply(hashes[lo : lo + DELTAS], changes[lo : lo + DELTAS])
    s = time.perf_counter() - t0
    return {"deltas": len(hashes), "seconds": round(s, 3), "per_s": round(len(hashes) / s) if s else None}


def _match(holdings: list[NodeHoldings], chain: list[bytes]) -> tuple[int, list[int], list[bool]]:
    return best_holders(holdings, key_hashes(chain))


def match_latency(holdings: list[NodeHoldings], held: bytes, repeat: int, seed: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    first_node = held[: 16 * max(CHAINS)]  # the first message went to node 0, all held
    for n in CHAINS:
        chain = [first_node[16 * i : 16 * i + 16] for i in range(n)]
        assert best_holders(holdings, key_hashes(chain))[0] == n
        out[f"chain_{n}"] = _time_calls(functools.partial(_match, holdings, chain), repeat)
    missed = [np.random.default_rng(seed + 2).bytes(16)] + [first_node[16 * i : 16 * i + 16] for i in range(63)]
    out["chain_64_first_missing"] = _time_calls(functools.partial(_match, holdings, missed), repeat)
    return out


def false_positives(holdings: list[NodeHoldings], blocks: int, probes: int, seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed + 3)
    found = 0
    for lo in range(0, probes, 65536):
        hashes = key_hashes(_keys(rng, min(65536, probes - lo)))
        found += int(sum(int((h.lookup(hashes) != 0).sum()) for h in holdings))
    return {"probes": probes, "reported_held": found, "expected_rate": blocks / 2**62}


def live(blocks: int, repeat: int) -> dict[str, Any]:
    """A private node, a view following it, ``blocks`` 4 KiB puts: lag and ``PoolView.match``."""
    from client import KVClient, PoolView
    from kvstore.children import private_node

    payload = np.zeros(4096, np.uint8)
    rng = np.random.default_rng(7)
    keys = [rng.bytes(16) for _ in range(blocks)]
    with tempfile.TemporaryDirectory() as d, private_node(d, dram=f"{blocks // 16 + 64}MiB", nvme=0) as node:
        unix = str(node.endpoints["unix"])
        with KVClient(unix) as kv, PoolView([unix], heartbeat_s=0.1, node_deadline_s=5.0) as view:
            if not view.wait_synced(30):
                raise RuntimeError("the view did not get the node's snapshot within 30 s")
            t0 = time.perf_counter()
            for lo in range(0, blocks, 64):
                kv.put_many(keys[lo : lo + 64], [payload] * len(keys[lo : lo + 64]))
            held = kv.stats()["tiers"]["dram"]["blocks"]  # fewer than put if DRAM evicted some
            deadline = time.monotonic() + 60
            while view.stats().blocks != held and time.monotonic() < deadline:
                time.sleep(0.001)
            seen_s = time.perf_counter() - t0
            s = view.stats()
            chain = keys[:64]
            return {
                "blocks_put": blocks,
                "node_blocks": held,
                "view_blocks": s.blocks,
                "puts_and_view_s": round(seen_s, 3),
                "lag_ms_p50": round(s.lag_ms_p50, 3),
                "lag_ms_p99": round(s.lag_ms_p99, 3),
                "deltas": s.deltas,
                "match_64": _time_calls(lambda: view.match(chain), repeat),
            }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvstore.bench.poolview", description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=1_000_000, help="blocks the pool holds (default 1,000,000)")
    p.add_argument("--nodes", type=int, default=4, help="nodes they are spread over (default 4)")
    p.add_argument("--deltas", type=int, default=200_000, help="changes to apply (default 200,000)")
    p.add_argument("--repeat", type=int, default=2000, help="calls per latency figure (default 2,000)")
    p.add_argument("--probes", type=int, default=1_000_000, help="absent keys looked up (default 1,000,000)")
    p.add_argument("--live", type=int, default=5000, help="blocks put to a live node (0: skip; default 5,000)")
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args(argv)
    for name in ("blocks", "nodes", "repeat"):
        if getattr(a, name) < 1:
            raise InvalidArgument(f"--{name} must be at least 1, got {getattr(a, name)}")
    if a.blocks < MESSAGE * a.nodes:
        raise InvalidArgument(f"--blocks must be at least {MESSAGE} per node ({MESSAGE * a.nodes} for {a.nodes} nodes)")
    log(f"building the index of {a.blocks:,} blocks over {a.nodes} nodes")
    holdings, held, index = build_index(a.blocks, a.nodes, a.seed)
    result: dict[str, Any] = {"index": index}
    log("timing lookups")
    result["match"] = match_latency(holdings, held, a.repeat, a.seed)
    log(f"looking up {a.probes:,} absent keys")
    result["false_positives"] = false_positives(holdings, a.blocks, a.probes, a.seed)
    if a.deltas > 0:
        log(f"applying {a.deltas:,} deltas")
        result["deltas"] = apply_deltas(holdings[0], held, a.deltas, a.seed)
    del holdings
    gc.collect()
    if a.live > 0:
        log(f"following a live node through {a.live:,} puts")
        result["live"] = live(a.live, a.repeat)
    json.dump(result, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``kvstore bench conductor-sim``: what one routing decision costs, over a simulated fleet.

The conductor must never be the fleet's bottleneck (target: at most 1 ms per request at
32k-token prompts and 64 engines).  This builds the conductor's own state for a fleet
that does not exist: ``engines`` engines whose caches (a :class:`FleetCacheIndex` fed
the same ``BlockStored`` events vLLM publishes) hold random prefixes of a few shared
"documents" and of each other's prompts, a cost model fitted on synthetic measurements, a
pool that holds a share of each prompt on random nodes and tiers, and engines with queues
and running decodes; then it times, per request, the conductor's decision path:

* ``keys_us``: the prompt's pool chunk keys (:func:`kvstore.keys.chunk_keys_from`);
* ``match_us``: every engine's cached prefix (:meth:`FleetCacheIndex.match`, which
  hashes the prompt's blocks);
* ``decide_us``: the estimates and the pick (:func:`kvstore.conductor.policy.decide`);
* ``decision_us``: all three, the figure against the target.

The pool lookup (one RPC to the nodes) and tokenising are not part of it: the first is
network time bounded by ``--pool-timeout-ms``, the second the engine does too.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, TextIO

import numpy as np

from kvstore.conductor.cacheindex import FleetCacheIndex, prefix_block_keys
from kvstore.conductor.cost import CostModel, Load
from kvstore.conductor.policy import EngineLoad, PoolMatch, decide
from kvstore.keys import chunk_keys_from
from kvstore.vocabulary import percentiles

BLOCK = 16
CHUNK = 256


def _stored(tokens: np.ndarray, upto: int) -> dict[str, Any]:
    """One ``BlockStored`` event (vLLM's shape) for the first ``upto`` tokens' full blocks."""
    n = upto // BLOCK
    hashes = prefix_block_keys(tokens[: n * BLOCK], BLOCK)  # as vLLM hashes: any distinct ids do
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": None,
        "token_ids": tokens[: n * BLOCK].tolist(),
        "block_size": BLOCK,
        "lora_id": None,
        "medium": "GPU",
        "group_idx": 0,
    }


def conductor_sim(engines: int = 64, prompt_tokens: int = 32768, requests: int = 200, seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, 128_000, prompt_tokens, dtype=np.uint32) for _ in range(8)]
    index = FleetCacheIndex()
    ids = [f"engine{i}" for i in range(engines)]
    t0 = time.perf_counter()
    for eid in ids:
        index.add_engine(eid, BLOCK)
        for _ in range(3):  # each engine: prefixes of three of the documents
            d = docs[int(rng.integers(len(docs)))]
            index.apply(eid, [_stored(d, int(rng.integers(BLOCK, prompt_tokens)))])
    fill_s = time.perf_counter() - t0
    model = CostModel()
    for _ in range(64):
        load = Load(int(rng.integers(1, 8000)), float(rng.uniform(0, 4)), int(rng.integers(0, 8000)))
        model.observe_ttft(ids[int(rng.integers(engines))], load, 0.05 + 0.0004 * load.compute + load.queued_s)
    nodes = [f"node{i}" for i in range(max(1, engines // 4))]
    keys_us, match_us, decide_us, total_us = [], [], [], []
    fp = b"\x01" * 8
    for _ in range(requests):
        d = docs[int(rng.integers(len(docs)))]
        shared = int(rng.integers(0, prompt_tokens))
        tokens = np.concatenate([d[:shared], rng.integers(0, 128_000, prompt_tokens - shared, dtype=np.uint32)])
        held = int(rng.integers(0, prompt_tokens // CHUNK))
        where = tuple(
            (nodes[int(rng.integers(len(nodes)))], "dram" if rng.random() < 0.7 else "nvme") for _ in range(held)
        )
        t1 = time.perf_counter()
        keys = chunk_keys_from(tokens, fp, CHUNK)
        t2 = time.perf_counter()
        local = index.match(tokens)
        t3 = time.perf_counter()
        loads = [
            EngineLoad(eid, "both", nodes[i % len(nodes)], local.get(eid, 0), float(i * 97 % 5000), i % 17, i, i * 0.03)
            for i, eid in enumerate(ids)
        ]
        dec = decide(model, loads, len(tokens), PoolMatch(CHUNK, where))
        t4 = time.perf_counter()
        assert dec.engine is not None and len(keys) == prompt_tokens // CHUNK
        keys_us.append((t2 - t1) * 1e6)
        match_us.append((t3 - t2) * 1e6)
        decide_us.append((t4 - t3) * 1e6)
        total_us.append((t4 - t1) * 1e6)

    return {
        "bench": "conductor-sim",
        "engines": engines,
        "prompt_tokens": prompt_tokens,
        "block_tokens": BLOCK,
        "chunk_tokens": CHUNK,
        "requests": requests,
        "cached_blocks": sum(index.held(e) for e in ids),
        "index_fill_s": round(fill_s, 3),
        "keys_us": percentiles(keys_us, digits=1),
        "match_us": percentiles(match_us, digits=1),
        "decide_us": percentiles(decide_us, digits=1),
        "decision_us": percentiles(total_us, digits=1),
        "target_us": 1000,
    }


def print_conductor_sim(r: dict[str, Any], out: TextIO) -> None:
    print(
        f"conductor decision, {r['engines']} engines, {r['prompt_tokens']}-token prompts "
        f"({r['cached_blocks']} cached blocks indexed): p50 {r['decision_us']['p50']} us, "
        f"p99 {r['decision_us']['p99']} us (target {r['target_us']} us)",
        file=out,
    )
    for k in ("keys_us", "match_us", "decide_us"):
        print(f"  {k[:-3]:>7}: p50 {r[k]['p50']} us, p99 {r[k]['p99']} us", file=out)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engines", "--sim-engines", dest="engines", type=int, default=64, help="engines (default 64)")
    p.add_argument(
        "--prompt-tokens",
        "--sim-prompt-tokens",
        dest="prompt_tokens",
        type=int,
        default=32768,
        help="prompt length (default 32768)",
    )
    p.add_argument("--quick", action="store_true", help="50 requests instead of 300")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout (the table goes to stderr)")


def main(a: argparse.Namespace) -> int:
    r = conductor_sim(a.engines, a.prompt_tokens, 50 if a.quick else 300)
    print_conductor_sim(r, sys.stderr if a.json else sys.stdout)
    if a.json:
        print(json.dumps(r, sort_keys=True), flush=True)
    return 0

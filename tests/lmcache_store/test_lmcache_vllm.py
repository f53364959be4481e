"""End to end: a real vLLM CPU engine with LMCache's multi-process connector, a real
``lmcache server`` whose L2 is kvstore (its ``plugin`` adapter type), and a real node.

The engine computes a prompt; LMCache's server stores its chunks in L1 and its store
controller writes them to kvstore.  Then the server's L1 is emptied (LMCache's own HTTP call)
and vLLM's prefix cache reset, so the same prompt can only be served from kvstore: the
server's prefetch reads it back (the node counts the reads under agent ``lmcache-l2``) and the
greedy tokens and logprobs equal an engine with no cache at all.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import NodeProcess, agent_metric

pytestmark = pytest.mark.lmcache

MAX, N, CHUNK = 2048, 1000, 256
ATOL = 1e-4


def prompt(seed: int, n: int = N) -> list[int]:
    return np.random.default_rng(seed).integers(1, 31000, n).tolist()


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["tokens"] == b["tokens"] and bool(np.allclose(a["logprobs"], b["logprobs"], atol=ATOL, rtol=0))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A node, an ``lmcache server`` with kvstore as its L2, a vLLM engine using it and a
    reference engine with no cache, started together (engines take most of a minute)."""
    from kvstore.demo.engine import EngineProcess, make_model
    from kvstore.demo.lmcache import LMCacheServer, kvstore_l2

    d = tmp_path_factory.mktemp("lmcache-e2e")
    with contextlib.ExitStack() as stack:
        node = NodeProcess(d / "node", "--dram", "256MiB", "--nvme", "0", "--metrics-port", "0").start()
        stack.callback(node.stop, timeout=30)
        server = LMCacheServer(kvstore_l2(node.unix, deadline_s=2.0), d / "lmcache.log").wait_ready()
        stack.callback(server.close)
        model = make_model(d / "model", layers=2, hidden=256, max_tokens=MAX)
        engines = {
            name: EngineProcess(
                model,
                max_tokens=MAX,
                kv_bytes=64 << 20,
                connector=connector,
                log_path=d / f"{name}.log",
                nice=5,
            )
            for name, connector in (("ref", None), ("lmcache", server.engine_connector()))
        }
        for e in engines.values():
            stack.callback(e.close)
        for e in engines.values():
            e.wait_ready()
        yield {"node": node, "server": server, **engines}


def stored_chunks(node: Any) -> float:
    return agent_metric(node.endpoints["metrics"], "lmcache-l2")(
        "kvstore_agent_blocks_total", op="write", result="stored"
    )


def read_chunks(node: Any) -> float:
    return agent_metric(node.endpoints["metrics"], "lmcache-l2")("kvstore_agent_blocks_total", op="read", result="hit")


def test_a_prompt_served_from_kvstore_through_lmcache_equals_no_cache(fleet: dict[str, Any]) -> None:
    node, server, eng, ref = fleet["node"], fleet["server"], fleet["lmcache"], fleet["ref"]
    tokens = prompt(1)
    want = ref.generate(tokens)
    first = eng.generate(tokens)
    assert same(first, want)
    full = (N // CHUNK) * CHUNK  # LMCache saves whole chunks only
    deadline = time.monotonic() + 60
    while stored_chunks(node) < N // CHUNK:
        assert time.monotonic() < deadline, f"kvstore got {stored_chunks(node)} chunks: {server.log_tail()}"
        time.sleep(0.2)
    server.clear_l1()
    assert eng.reset_prefix_cache()
    before = read_chunks(node)
    again = eng.generate(tokens)
    assert same(again, want), (again["tokens"], want["tokens"])
    assert read_chunks(node) - before == N // CHUNK, server.log_tail()
    assert again["num_cached_tokens"] >= full - CHUNK, again  # vLLM computed (at most) the tail itself


def test_an_unseen_prompt_misses_in_kvstore_and_is_computed(fleet: dict[str, Any]) -> None:
    node, eng, ref = fleet["node"], fleet["lmcache"], fleet["ref"]
    tokens = prompt(2)
    before = read_chunks(node)
    got = eng.generate(tokens)
    assert same(got, ref.generate(tokens))
    assert read_chunks(node) == before
    assert got["num_cached_tokens"] == 0


def test_kvstore_demo_lmcache_prints_its_summary(tmp_path: Path) -> None:
    """``kvstore demo lmcache --json`` end to end (small: one 600-token prompt on a 2-layer
    model): kvstore served the hit (chunks read from the node, prompt tokens not computed),
    every configuration's tokens equal vLLM alone, a TTFT for each configuration."""
    r = subprocess.run(
        [sys.executable, "-m", "kvstore", "demo", "lmcache", "--json", "--prompt-tokens", "600",
         "--new-tokens", "4", "--repeat", "1", "--layers", "2", "--hidden", "256", "--log-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["tokens_equal"] is True
    assert out["backend_reads"] == 600 // CHUNK
    assert out["hit_tokens"] >= (600 // CHUNK) * CHUNK - CHUNK
    assert set(out["ttft_ms"]) == {"none", "lmcache-fs", "lmcache-kvstore"}
    assert all(v > 0 for v in out["ttft_ms"].values())

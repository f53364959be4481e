"""The short form of ``kvstore bench serving``: a few dozen requests of a conversation
trace through two real vLLM OpenAI servers per configuration (baseline, pool, pd, and
conductor and conductor-pd: the same fleets behind ``kvstore conductor``).

It checks the machinery, not timing: every request completes; ``pool`` serves prompt
tokens from the store (the engines' own counters and the nodes' block reads say so);
``pool``, ``pd`` and the conductor's generate the same greedy tokens as ``baseline`` for
every request; the conductor routes over both engines and reports its decisions;
and nothing is left behind (no server process, no arena in /dev/shm).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.children import VLLM_SHM_PREFIXES, shm_names

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
REQUESTS = 40


def _servers() -> set[int]:
    out = subprocess.run(["pgrep", "-f", "vllm.entrypoints.openai.api_server"], capture_output=True, text=True)
    return {int(p) for p in out.stdout.split()}


def _arenas() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if "kvstore" in n} if os.path.isdir("/dev/shm") else set()


def _vllm_shm() -> set[str]:
    return {n for n in shm_names() if n.startswith(VLLM_SHM_PREFIXES)}


@pytest.mark.timeout(2400)  # five fleets start one after another: minutes, not the suite's 300 s
def test_short_serving_run(tmp_path: Path) -> None:
    trace = tmp_path / "conversations.jsonl"
    subprocess.run(
        [sys.executable, "-m", "kvstore", "replay", "--generate", str(trace), "--requests", "200", "--seed", "7"],
        check=True,
        cwd=ROOT,
        capture_output=True,
        timeout=120,
    )
    servers, arenas, vllm_shm = _servers(), _arenas(), _vllm_shm()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvstore",
            "bench",
            "serving",
            "--trace",
            str(trace),
            "--requests",
            str(REQUESTS),
            "--block-tokens",
            "64",
            "--rate",
            "4",
            "--max-output-tokens",
            "16",
            "--configs",
            "baseline,pool,pd,conductor,conductor-pd",
            "--json",
            "--records",
            str(tmp_path / "records.jsonl"),
            "--log-dir",
            str(tmp_path / "logs"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=2400,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    r = json.loads(out.stdout)
    assert set(r["configs"]) == {"baseline", "pool", "pd", "conductor", "conductor-pd"}
    for name, c in r["configs"].items():
        assert (c["requests"], c["completed"], c["errors"], c["rejected"]) == (REQUESTS, REQUESTS, 0, 0), (name, c)
        assert c["ttft_ms"]["p50"] is not None and c["throughput_tok_s"] > 0
    pool, pd, base = r["configs"]["pool"], r["configs"]["pd"], r["configs"]["baseline"]
    assert base["prompt_tokens"]["store"] == 0
    assert pool["prompt_tokens"]["store"] > 0, pool["prompt_tokens"]  # the store served prompt tokens
    assert pool["store_blocks"]["dram_reads"] > 0, pool["store_blocks"]
    # pd: a decode engine loads what its prefill engine computed (all but the last token), so
    # the fleet recomputes little more than baseline does (a decode engine that lost the
    # store after a local hit recomputed 40-60 % of its prompts)
    total = r["trace"]["prompt_tokens"]["total"]
    assert pd["prompt_tokens"]["store"] > 0, pd["prompt_tokens"]
    assert pd["prompt_tokens"]["recomputed"] - base["prompt_tokens"]["recomputed"] < total // 4, (pd, base)
    assert pool["tokens_equal_baseline"] == 1.0 and pd["tokens_equal_baseline"] == 1.0
    # every engine of every configuration ran on the same split of CPUs
    cpus = {name: [e["cpus"] for e in f["engines"]] for name, f in r["fleets"].items()}
    assert len({tuple(v) for v in cpus.values()}) == 1, cpus
    records = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert len(records) == 5 * REQUESTS
    assert all(x["prefill_engine"] for x in records if x["config"] == "pd")
    # the conductor: same tokens, both engines used, every decision on record, and hits
    # from the engines' own caches (their KV events) or the pool
    for name in ("conductor", "conductor-pd"):
        c = r["configs"][name]
        assert c["tokens_equal_baseline"] == 1.0, (name, c)
        routing = c["routing"]
        assert len(routing["decisions_per_engine"]) == 2, routing
        assert routing["decision_us"]["p50"] is not None and routing["predicted_ttft_abs_err_median"] is not None
        assert routing["decision_cpu_us"]["p50"] is not None and routing["rejected"] == {}  # targets, no refusals
        assert c["cpu_s"]["conductor"] > 0, c["cpu_s"]
        assert c["prompt_tokens"]["store"] + c["prompt_tokens"]["engine_cache"] > 0, c["prompt_tokens"]
    assert r["front_nice"] == -10  # root here: the client and the conductors ran ahead of the engines
    assert _servers() <= servers, "a vLLM server outlived the benchmark"
    assert _arenas() <= arenas, "a node's arena was left in /dev/shm"
    assert _vllm_shm() <= vllm_shm, "a vLLM server's shared memory was left in /dev/shm"

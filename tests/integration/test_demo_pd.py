"""``kvstore demo pd``: prefill in one process, decode in another, a real (small, random)
Llama; the decode process's greedy tokens must equal a store-free generation's in every
scenario (DRAM, HBM after prefetch, NVMe after a node restart, half the prompt cached)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]


def test_prefill_to_decode_handoff_generates_the_reference_tokens() -> None:
    cmd = [
        sys.executable,
        "-m",
        "kvstore",
        "demo",
        "pd",
        "--prompt-tokens",
        "512",
        "--new-tokens",
        "8",
        "--chunk-tokens",
        "128",
        "--repeat",
        "1",
        "--dram",
        "64MiB",
        "--nvme",
        "128MiB",
        "--json",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["ok"] is True
    assert r["prefill_pid"] != r["decode_pid"]
    assert r["prefill"]["stored"] == 4 and r["prefill"]["failed"] == 0
    assert len(r["reference_tokens"]) == 8
    sc = r["scenarios"]
    assert set(sc) == {"full recompute", "DRAM hit", "HBM hit (prefetched)", "NVMe hit", "partial hit (half)"}
    assert all(s["tokens_equal"] for s in sc.values())
    assert all(s["ttft_s"] > 0 for s in sc.values())
    assert (sc["DRAM hit"]["cached_tokens"], sc["DRAM hit"]["tier"]) == (512, "dram")
    assert (sc["HBM hit (prefetched)"]["cached_tokens"], sc["HBM hit (prefetched)"]["tier"]) == (512, "hbm")
    assert (sc["NVMe hit"]["cached_tokens"], sc["NVMe hit"]["tier"]) == (512, "nvme")
    assert sc["partial hit (half)"]["cached_tokens"] == 256


def test_bad_arguments_fail_before_any_work() -> None:
    for args, msg in (
        (["--chunk-tokens", "100"], "multiple of 16"),
        (["--prompt-tokens", "300", "--chunk-tokens", "256"], "two chunks"),
    ):
        bad = subprocess.run(
            [sys.executable, "-m", "kvstore", "demo", "pd", *args], capture_output=True, text=True, cwd=ROOT, timeout=60
        )
        assert bad.returncode != 0 and msg in bad.stderr


def test_table_shows_every_scenario() -> None:
    from kvstore.demo.pd import format_table

    s = {"ttft_s": 0.5, "cached_tokens": 0, "tier": "-", "tokens_equal": True}
    r = {
        "prompt_tokens": 512,
        "new_tokens": 8,
        "chunk_tokens": 128,
        "device": "cpu",
        "prefill_pid": 1,
        "decode_pid": 2,
        "model": {"layers": 4, "hidden": 256, "kv_heads": 2, "head_dim": 64, "dtype": "float32"},
        "prefill": {"prefill_s": 0.1, "save_s": 0.01, "stored": 4},
        "scenarios": {
            "full recompute": s,
            "DRAM hit": {**s, "ttft_s": 0.05, "cached_tokens": 512, "tier": "dram"},
            "partial hit (half)": {**s, "tokens_equal": False},
        },
        "ok": False,
    }
    table = format_table(r)
    assert "DRAM hit" in table and "10.0x" in table and "DIFFER" in table and "MISMATCH" in table

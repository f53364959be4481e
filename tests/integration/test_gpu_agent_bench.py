"""``kvstore bench gpu`` is a CUDA benchmark; ``--device cpu`` dry-runs the same
script so it does not rot on machines without a GPU (its numbers mean nothing there)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_dry_run_on_cpu() -> None:
    cmd = [
        sys.executable,
        "-m",
        "kvstore",
        "bench",
        "gpu",
        "--device",
        "cpu",
        "--layers",
        "2",
        "--kv-heads",
        "2",
        "--head-dim",
        "32",
        "--dtype",
        "float16",
        "--chunk-tokens",
        "64",
        "--blocks",
        "4",
        "--iters",
        "1",
        "--json",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["agent_load_byte_identical"] is True and r["arena_pinned"] is False
    assert set(r["reference_gbps"]) == {"h2d_small", "d2h_small", "h2d_block", "d2h_block"}
    assert set(r["arena_gbps"]) == {"h2d_small", "d2h_small"}
    assert set(r["agent_gbps"]) == {"load_from_arena", "save_to_arena", "load_from_hbm_pool"}
    assert {"t_load_s", "t_compute_s", "t_overlap_s", "hidden_over_load", "hidden_over_total"} <= set(r["overlap"])


def test_bench_without_cuda_says_so() -> None:
    import torch

    if torch.cuda.is_available():
        return
    out = subprocess.run(
        [sys.executable, "-m", "kvstore", "bench", "gpu"], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert out.returncode != 0 and "no CUDA device" in out.stderr

"""``kvstore plan`` over DRAM × NVMe splits: the grid, the cheapest split for a target, the best
split for a budget, the heat map, and bad input, end to end through the CLI."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvstore.cli import main
from kvstore.traces.costmodel import CostModel
from kvstore.traces.format import Trace
from kvstore.traces.generate import GenParams, generate_events
from kvstore.traces.simulator import simulate

GiB = 1 << 30
BPT = 131072  # 64 MiB blocks of 512 tokens: 16 blocks per GiB


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory: Any) -> Path:
    p = tmp_path_factory.mktemp("plan2") / "gen.jsonl"
    reqs, closes = generate_events(GenParams(requests=250, seed=202, close_after_s=60))
    Trace(reqs, closes=closes).write(p)
    return p


def run(capsys: Any, *argv: str) -> tuple[int, str, str]:
    try:
        rc = main(list(argv))
    except SystemExit as e:  # argparse
        rc = int(e.code or 0)
    out, err = capsys.readouterr()
    return rc, out, err


GRID = [
    "--bytes-per-token",
    str(BPT),
    "--fractions",
    "0.02,0.1",
    "--nvme-fractions",
    "0.2,0.6",
    "--policies",
    "lru",
    "--jobs",
    "1",
    "--dram-price-per-gib",
    "4",
    "--nvme-price-per-gib",
    "0.25",
]


def plan_json(capsys: Any, trace_file: Path, *args: str) -> tuple[int, dict[str, Any]]:
    rc, out, err = run(capsys, "plan", str(trace_file), *GRID, *args, "--json")
    assert rc in (0, 1), err
    return rc, json.loads(out)


def test_grid_answers_and_heatmap(capsys: Any, trace_file: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "grid.png"
    # a target and a budget both within reach of the grid: 2 DRAM rows x 3 NVMe columns (0 included)
    rc, o = plan_json(
        capsys,
        trace_file,
        "--target-hit-ratio",
        "30%",
        "--budget",
        "40",
        "--recompute-tps",
        "8000",
        "--dram-gbps",
        "20",
        "--nvme-gbps",
        "4",
        "--heatmap",
        str(png),
    )
    assert rc == 0
    trace = Trace.load(trace_file)
    rows = o["grid"]["splits"]
    assert len(rows) == 6 and o["grid"]["nvme_blocks"][0] == 0 and len(o["grid"]["dram_blocks"]) == 2
    assert o["prices"] == {"dram_per_gib": 4.0, "nvme_per_gib": 0.25}
    for r in rows:
        assert r["cost"] == pytest.approx(4 * r["dram_bytes"] / GiB + 0.25 * r["nvme_bytes"] / GiB)
        assert r["dram_bytes"] == r["dram_blocks"] * 512 * BPT
        assert r["tier_hits"]["dram"] + r["tier_hits"]["nvme"] == pytest.approx(r["hit_ratio"])
        assert r["hit_ratio"] <= o["unlimited_hit_ratio"] + 1e-12
    # the grid replays through the node's tiers: the same figures as a two-tier replay
    r = next(r for r in rows if r["nvme_blocks"])
    sim = simulate(trace, r["dram_blocks"], "prefix-reuse", nvme_blocks=r["nvme_blocks"])
    assert r["hit_ratio"] == sim.hit_ratio
    model = CostModel(8000.0, BPT, 20.0, 4.0)
    hits = dict(sim.tier_hits)
    assert r["prefill_saved_s_per_request"] == pytest.approx(
        model.saved_s(sim.hit_tokens, hits["dram"], hits["nvme"], 512) / len(trace)
    )
    # DRAM only (NVMe 0) is the one-tier sweep's figure for the planned policy
    dram_only = {r["dram_blocks"]: r["hit_ratio"] for r in rows if r["nvme_blocks"] == 0}
    for p in o["sweep"]:
        assert dram_only[p["capacity_blocks"]] == p["hit_ratio"]["prefix-reuse"]
    # the answers: the cheapest split that reaches 30 %, the highest hit ratio within 40
    c = o["cheapest_for_target"]
    assert c["found"] and c["split"]["hit_ratio"] >= 0.3
    assert c["split"]["cost"] == min(r["cost"] for r in rows if r["hit_ratio"] >= 0.3)
    assert "cheapest for 30.0%" in c["answer"]
    b = o["best_for_budget"]
    assert b["found"] and b["split"]["cost"] <= 40 and o["budget"] == 40
    assert b["split"]["hit_ratio"] == max(r["hit_ratio"] for r in rows if r["cost"] <= 40)
    assert "prefill saved" in b["answer"]
    # the two-tier split beats DRAM alone at the same DRAM size: what NVMe is for
    assert max(r["hit_ratio"] for r in rows if r["nvme_blocks"]) > max(dram_only.values())
    assert o["heatmap"] == str(png) and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the one-tier plan is still there, unchanged
    assert o["reachable"] is True and "plan" in o


def test_budget_alone(capsys: Any, trace_file: Path) -> None:
    rc, o = plan_json(capsys, trace_file, "--budget", "10")
    assert rc == 0 and o["target_hit_ratio"] is None and "cheapest_for_target" not in o and "reachable" not in o
    b = o["best_for_budget"]
    assert b["found"] and b["split"]["cost"] <= 10 and "prefill_saved_s_per_request" not in b["split"]


def test_target_no_split_reaches(capsys: Any, trace_file: Path) -> None:
    # above the unlimited-capacity hit ratio: no split can, and the answer says why
    rc, o = plan_json(capsys, trace_file, "--target-hit-ratio", "0.99")
    assert rc == 1
    c = o["cheapest_for_target"]
    assert not c["found"] and c["split"] is None
    assert "no split reaches 99.0%" in c["answer"] and "even unlimited capacity gives" in c["answer"]
    assert c["best_split"]["hit_ratio"] == max(r["hit_ratio"] for r in o["grid"]["splits"])
    # reachable with more capacity, not with this grid: the answer says to widen it
    target = o["unlimited_hit_ratio"] - 0.001
    rc, out, _ = run(
        capsys, "plan", str(trace_file), *GRID, "--nvme-fractions", "0.05", "--target-hit-ratio", str(target)
    )
    assert rc == 1 and "NOT FOUND: no split reaches" in out and "add larger --fractions or --nvme-fractions" in out


def test_budget_buys_nothing(capsys: Any, trace_file: Path) -> None:
    rc, out, _ = run(capsys, "plan", str(trace_file), *GRID, "--budget", "0.5")
    assert rc == 1 and "NOT FOUND: a budget of 0.5 buys no split of the grid: the cheapest is" in out


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--dram-price-per-gib", "-1", "--nvme-price-per-gib", "1", "--budget", "5"],
            "--dram-price-per-gib must be a non-negative number",
        ),
        (
            ["--dram-price-per-gib", "1", "--nvme-price-per-gib", "nan", "--budget", "5"],
            "--nvme-price-per-gib must be a non-negative number",
        ),
        (
            ["--dram-price-per-gib", "1", "--nvme-price-per-gib", "1", "--budget", "-3"],
            "--budget must be a non-negative number",
        ),
        (
            ["--dram-price-per-gib", "x", "--nvme-price-per-gib", "1", "--budget", "5"],
            "--dram-price-per-gib must be a number",
        ),
        (["--budget", "5"], "give --dram-price-per-gib and --nvme-price-per-gib"),
        (["--dram-price-per-gib", "1"], "give --target-hit-ratio R"),
        (["--target-hit-ratio", "0.3", "--nvme-fractions", "0,2"], "--nvme-fractions must each lie in (0, 1]"),
        (["--target-hit-ratio", "0.3", "--heatmap", "x.png"], "--heatmap draws the two-tier grid"),
        (
            ["--budget", "5", "--dram-price-per-gib", "1", "--nvme-price-per-gib", "1", "--recompute-tps", "-8"],
            "--recompute-tps must be a positive number",
        ),
    ],
)
def test_bad_input(capsys: Any, trace_file: Path, args: list[str], message: str) -> None:
    rc, _, err = run(
        capsys, "plan", str(trace_file), "--bytes-per-token", "8", "--fractions", "0.1", "--jobs", "1", *args
    )
    assert rc == 2 and message in err

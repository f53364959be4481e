"""``kvstore replay`` and ``kvstore plan`` from the command line: output, generation, bad input."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvstore.cli import main
from kvstore.traces.format import Trace
from kvstore.traces.generate import GenParams, generate


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory: Any) -> Path:
    p = tmp_path_factory.mktemp("traces") / "small.jsonl"
    Trace(generate(GenParams(requests=200, seed=21))).write(p)
    return p


def run(capsys: Any, *argv: str) -> tuple[int, str, str]:
    try:
        rc = main(list(argv))
    except SystemExit as e:  # argparse
        rc = int(e.code or 0)
    out, err = capsys.readouterr()
    return rc, out, err


def test_replay_json(capsys: Any, trace_file: Path) -> None:
    rc, out, _ = run(capsys, "replay", str(trace_file), "--capacity", "5%", "--json")
    assert rc == 0
    o = json.loads(out)
    for k in ("hit_ratio", "optimal_hit_ratio", "lru_hit_ratio", "hit_tokens", "capacity_blocks", "policy"):
        assert k in o
    assert o["mode"] == "simulator" and o["policy"] == "prefix-reuse"
    assert o["capacity_blocks"] == round(0.05 * o["unique_blocks"])
    assert o["lru_hit_ratio"] <= o["optimal_hit_ratio"] and o["hit_ratio"] <= o["optimal_hit_ratio"]
    t = Trace.load(trace_file)
    assert o["requests"] == 200 and o["blocks"] == t.total_blocks


def test_replay_text_and_capacity_forms(capsys: Any, trace_file: Path) -> None:
    rc, out, _ = run(capsys, "replay", str(trace_file), "--capacity", "50", "--policy", "lru")
    assert rc == 0 and "capacity  50 blocks" in out and "optimal" in out and "gap closed" in out
    rc, out, _ = run(capsys, "replay", str(trace_file), "--capacity", "unlimited", "--json", "--requests", "50")
    o = json.loads(out)
    assert o["requests"] == 50 and o["hit_ratio"] == pytest.approx(o["unlimited_hit_ratio"]) and o["gap_closed"] is None
    # bytes: 64 MiB / (512 tokens x 4096 bytes per token = 2 MiB per block) = 32 blocks
    rc, out, _ = run(capsys, "replay", str(trace_file), "--capacity", "64MiB", "--bytes-per-token", "4096", "--json")
    assert json.loads(out)["capacity_blocks"] == 32


def test_generate(capsys: Any, tmp_path: Path) -> None:
    out_path = tmp_path / "gen.jsonl"
    rc, out, _ = run(
        capsys, "replay", "--generate", str(out_path), "--requests", "120", "--seed", "3", "--turns", "3", "--json"
    )
    assert rc == 0
    o = json.loads(out)
    assert o["requests"] == 120 and Trace.load(out_path).summary() == {k: o[k] for k in Trace.load(out_path).summary()}


@pytest.mark.parametrize(
    "args, message",
    [
        (["--capacity", "0"], "--capacity must be a positive number of blocks"),
        (["--capacity", "-5"], "--capacity must be a positive number of blocks, got '-5'"),
        (["--capacity", "0%"], "--capacity must be a positive percentage"),
        (["--capacity", "abc"], "--capacity: not a capacity: 'abc'"),
        (["--capacity", "1.5"], "--capacity: not a capacity"),
        (["--capacity", "8GiB"], "is a size: give --bytes-per-token"),
        (["--capacity", "1KiB", "--bytes-per-token", "4096"], "holds no block"),
        (["--capacity", "10", "--policy", "mru"], "unknown policy 'mru'"),
        ([], "--capacity is required"),
    ],
)
def test_replay_bad_input(capsys: Any, trace_file: Path, args: list[str], message: str) -> None:
    rc, _, err = run(capsys, "replay", str(trace_file), *args)
    assert rc == 2 and message in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["replay"], "give a TRACE"),
        (["replay", "missing.jsonl", "--capacity", "5"], "cannot read trace missing.jsonl"),
        (["replay", "--generate", "x.jsonl", "--reuse", "2"], "--reuse must be in [0, 1]"),
        (["replay", "--capacity", "5", "--block-tokens", "0", "t.jsonl"], "--block-tokens must be positive"),
        (["replay", "t.jsonl", "--requests", "-1"], "--requests must be positive"),
        (["replay", "t.jsonl", "--target", "x:1", "--block-bytes", "lots"], "--block-bytes"),
        (
            ["plan", "t.jsonl", "--target-hit-ratio", "1.5", "--bytes-per-token", "1"],
            "--target-hit-ratio must lie in (0, 1]",
        ),
        (
            ["plan", "t.jsonl", "--target-hit-ratio", "x", "--bytes-per-token", "1"],
            "--target-hit-ratio must be a ratio",
        ),
        (
            ["plan", "t.jsonl", "--target-hit-ratio", "0.2", "--bytes-per-token", "1", "--fractions", "0,2"],
            "--fractions must each lie in (0, 1]",
        ),
    ],
)
def test_argument_errors(capsys: Any, argv: list[str], message: str) -> None:
    rc, _, err = run(capsys, *argv)
    assert rc == 2 and message in err


def test_trace_and_generate_together(capsys: Any, trace_file: Path, tmp_path: Path) -> None:
    rc, _, err = run(capsys, "replay", str(trace_file), "--generate", str(tmp_path / "x.jsonl"))
    assert rc == 2 and "not both" in err


def test_malformed_trace_names_the_line(capsys: Any, tmp_path: Path) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 512, "hash_ids": [1]}\n{"timestamp": 1, "input_length": 512}\n')
    rc, _, err = run(capsys, "replay", str(p), "--capacity", "5")
    assert rc == 2 and f"{p} line 2: missing field 'hash_ids'" in err


def test_plan_json_and_plot(capsys: Any, trace_file: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "plan.png"
    rc, out, _ = run(
        capsys,
        "plan",
        str(trace_file),
        "--target-hit-ratio",
        "25%",
        "--layers",
        "4",
        "--kv-heads",
        "2",
        "--head-dim",
        "64",
        "--fractions",
        "0.02,0.1,0.5",
        "--policies",
        "lru,prefix-reuse",
        "--jobs",
        "1",
        "--plot",
        str(png),
        "--json",
    )
    assert rc == 0
    o = json.loads(out)
    assert o["bytes_per_token"] == 4 * 2 * 2 * 64 * 2 and o["block_bytes"] == 512 * o["bytes_per_token"]
    assert [p["capacity_blocks"] for p in o["sweep"]] == sorted(p["capacity_blocks"] for p in o["sweep"])
    assert set(o["sweep"][0]["hit_ratio"]) == {"lru", "prefix-reuse", "optimal"}
    plan = o["plan"]
    assert o["reachable"] and plan["total_bytes"] == plan["capacity_blocks"] * o["block_bytes"]
    assert plan["dram_bytes"] <= plan["nvme_bytes"] == plan["total_bytes"]
    assert o["optimal_capacity_blocks"] <= plan["capacity_blocks"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_unreachable_target(capsys: Any, trace_file: Path) -> None:
    rc, out, _ = run(
        capsys,
        "plan",
        str(trace_file),
        "--target-hit-ratio",
        "0.99",
        "--bytes-per-token",
        "1000",
        "--fractions",
        "0.1",
        "--policies",
        "lru",
        "--jobs",
        "1",
    )
    assert rc == 1 and "out of reach" in out


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "give the KV size"),
        (["--layers", "4"], "also needs --kv-heads, --head-dim"),
        (["--bytes-per-token", "8", "--layers", "4"], "not both"),
        (["--layers", "4", "--kv-heads", "2", "--head-dim", "8", "--dtype", "fp7"], "unknown --dtype 'fp7'"),
        (["--bytes-per-token", "8", "--policy", "nope"], "unknown policy 'nope'"),
        (["--bytes-per-token", "8", "--dram-share", "0"], "--dram-share must lie in (0, 1]"),
    ],
)
def test_plan_bad_input(capsys: Any, trace_file: Path, args: list[str], message: str) -> None:
    rc, _, err = run(capsys, "plan", str(trace_file), "--target-hit-ratio", "0.2", *args)
    assert rc == 2 and message in err

"""``kvstore sim --capacity``: the offered rate's rescaling, the search, and the command line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_sim_fleet import BT, profile, shared_trace, write_trace

from kvstore.bench.serving.workload import Scaling, build
from kvstore.cli import main
from kvstore.errors import InvalidArgument
from kvstore.sim.capacity import at_rate, find_capacity


def test_at_rate_sends_what_the_benchmark_sends_at_that_rate(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": t, "input_length": 1024, "output_length": 8, "hash_ids": [i, i + 1], "session_id": "s"}
        for i, t in enumerate((0, 100, 250, 1000, 1300))
    ]
    rows.append({"timestamp": 1400, "close_session": "s"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    wl = build(path, Scaling(block_tokens=BT))
    for rate in (0.5, 3.0, 40.0):
        want = build(path, Scaling(block_tokens=BT, rate=rate))
        got = at_rate(wl, rate)
        assert [w.arrival_s for w in got.items] == pytest.approx([w.arrival_s for w in want.items])
        assert [t for t, _ in got.closes] == pytest.approx([t for t, _ in want.closes]) and got.closes
        assert [w.tokens for w in got.items] == [w.tokens for w in want.items]
        assert got.scaling == want.scaling and got.offered_rps == pytest.approx(rate)
    with pytest.raises(InvalidArgument, match="positive"):
        at_rate(wl, 0.0)


def test_the_search_finds_the_highest_rate_meeting_the_target_within_the_tolerance() -> None:
    calls: list[float] = []

    def met(rate: float) -> float:  # a fleet that keeps up to 7.3 req/s
        calls.append(rate)
        return 1.0 if rate <= 7.3 else 0.5

    cap = find_capacity(met, 1.0, tolerance=0.01)
    assert 7.3 / 1.01 <= cap.capacity_rps <= 7.3
    assert [r for r, _ in cap.steps] == calls and calls[:4] == [1.0, 2.0, 4.0, 8.0]
    # from above: halves until one passes
    down = find_capacity(met, 100.0, tolerance=0.01)
    assert 7.3 / 1.01 <= down.capacity_rps <= 7.3 and down.steps[0] == (100.0, 0.5)
    assert find_capacity(lambda r: 0.0, 1.0, max_halvings=3).capacity_rps == 0.0
    assert find_capacity(lambda r: 1.0, 1.0, max_doublings=3).capacity_rps == 8.0
    # the target is the 90 %, inclusive
    assert find_capacity(lambda r: 0.9 if r <= 3 else 0.89, 1.0, tolerance=0.01).capacity_rps > 2.9


def sim_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main(["sim", *args, "--json"]) == 0
    out = capsys.readouterr()
    result: dict[str, Any] = json.loads(out.out)
    assert "capacity (req/s at >= 90% of requests within the SLO)" in out.err
    return result


def test_the_cli_reports_each_configurations_capacity_and_its_figures_at_baselines(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    trace = shared_trace(tmp_path / "t.jsonl", n=40)
    prof = tmp_path / "p.json"
    profile(name="small", num_gpu_blocks=24).save(prof)
    args = ["--trace", str(trace), "--block-tokens", str(BT), "--profile", str(prof), "--engines", "2",
            "--node-dram", "64KiB", "--node-nvme", "0", "--connector-extra", '{"chunk_tokens": 32}',
            "--slo-ttft-ms", "300", "--configs", "baseline,pool", "--capacity", "--capacity-tolerance", "0.05"]  # fmt: skip
    r = sim_json(capsys, *args)
    at = r["at_baseline_capacity"]
    for name in ("baseline", "pool"):
        c = r["configs"][name]
        steps = c["capacity"]["steps"]
        assert c["capacity_rps"] == c["capacity"]["capacity_rps"] > 0
        passed = [s["rate_rps"] for s in steps if s["slo_met"] >= 0.9]
        failed = [s["rate_rps"] for s in steps if s["slo_met"] < 0.9]
        assert c["capacity_rps"] == max(passed)
        assert min(f for f in failed if f > max(passed)) <= max(passed) * 1.05 * (1 + 1e-9)  # within the tolerance
        assert at["configs"][name]["requests"] == 40 and "ttft_ms" in at["configs"][name]
    assert at["rate_rps"] == r["configs"]["baseline"]["capacity_rps"] and at["slo_target"] == 0.9
    assert at["configs"]["baseline"]["slo_met"] >= 0.9
    # every rate runs once: the search's first step is the workload as given, baseline at its
    # capacity is one of its steps, pool there maybe one of its own
    pool_rates = [s["rate_rps"] for s in r["configs"]["pool"]["capacity"]["steps"]]
    base_steps = r["configs"]["baseline"]["capacity"]["steps"]
    assert r["sim"]["runs"] == len(base_steps) + len(pool_rates) + (at["rate_rps"] not in pool_rates)
    assert _no_wall(sim_json(capsys, *args)) == _no_wall(r)  # deterministic for a seed
    # baseline is searched even when only pool runs
    only = sim_json(capsys, *args, "--configs", "pool")
    assert list(only["configs"]) == ["pool"] and only["at_baseline_capacity"]["rate_rps"] == at["rate_rps"]
    assert set(only["at_baseline_capacity"]["configs"]) == {"baseline", "pool"}
    assert only["at_baseline_capacity"]["baseline_capacity"]["capacity_rps"] == at["rate_rps"]


def test_capacity_needs_a_workload_that_has_a_rate(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl", [(0, [1, 2], 8)])
    assert main(["sim", "--trace", str(trace), "--configs", "baseline", "--capacity"]) == 2
    assert "--capacity needs a workload of at least two requests" in capsys.readouterr().err


def _no_wall(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _no_wall(v) for k, v in x.items() if k != "wall_s"}
    return x


def test_the_plot_is_goodput_against_offered_load_with_each_capacity_marked(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """``--plot PNG`` (with ``--capacity``): every search run is a point (offered rate, the
    goodput and TTFT p50 it gave, also in the JSON's steps); the PNG is written; without
    ``--capacity`` it is refused before anything runs."""
    from kvstore.sim.plot import curves

    trace = shared_trace(tmp_path / "t.jsonl", n=40)
    prof = tmp_path / "p.json"
    profile(name="small", num_gpu_blocks=24).save(prof)
    png = tmp_path / "cap.png"
    args = ["--trace", str(trace), "--block-tokens", str(BT), "--profile", str(prof), "--engines", "2",
            "--slo-ttft-ms", "300", "--configs", "baseline", "--capacity", "--capacity-tolerance", "0.05"]  # fmt: skip
    r = sim_json(capsys, *args, "--plot", str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    steps = r["configs"]["baseline"]["capacity"]["steps"]
    assert all(s["goodput_rps"] is not None and s["ttft_p50_ms"] > 0 for s in steps)
    (pts,) = curves(r).values()
    assert [p["rate_rps"] for p in pts] == sorted({s["rate_rps"] for s in steps})
    knee = next(p for p in pts if p["rate_rps"] == r["configs"]["baseline"]["capacity_rps"])
    assert knee["slo_met"] >= 0.9 and all(p["slo_met"] < 0.9 for p in pts if p["rate_rps"] > knee["rate_rps"])
    assert main(["sim", *[x for x in args if x != "--capacity"], "--plot", str(tmp_path / "x.png")]) == 2
    assert "--plot needs --capacity" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_overload_runs_each_configuration_past_its_capacity_against_its_peak(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """``--overload F``: each configuration also runs at F times its own capacity, reported
    against the best goodput of its search (``goodput_vs_peak``): past the knee a fleet
    without rejection serves fewer requests within the SLO than at its peak.  F must be
    above 1, and only with ``--capacity``."""
    trace = shared_trace(tmp_path / "t.jsonl", n=40)
    prof = tmp_path / "p.json"
    profile(name="small", num_gpu_blocks=24).save(prof)
    args = ["--trace", str(trace), "--block-tokens", str(BT), "--profile", str(prof), "--engines", "2",
            "--slo-ttft-ms", "300", "--configs", "baseline", "--capacity", "--capacity-tolerance", "0.05"]  # fmt: skip
    r = sim_json(capsys, *args, "--overload", "2")
    c = r["configs"]["baseline"]
    o = c["overload"]
    assert o["factor"] == 2 and o["rate_rps"] == pytest.approx(2 * c["capacity_rps"], rel=1e-3)
    peak = max(s["goodput_rps"] for s in c["capacity"]["steps"])
    assert o["peak_goodput_rps"] == pytest.approx(peak, rel=1e-3)
    assert o["goodput_vs_peak"] == pytest.approx(o["goodput_rps"] / peak, rel=1e-3) and o["goodput_vs_peak"] < 0.9
    assert o["slo_met"] < 0.9 and o["rejected"] == 0  # no rejection in baseline: it collapses
    for bad in (["--overload", "1"], ["--overload", "0.5"]):
        assert main(["sim", *args, *bad]) == 2
        assert "--overload F needs --capacity and F above 1" in capsys.readouterr().err
    assert main(["sim", *[x for x in args if x != "--capacity"], "--overload", "2"]) == 2
    assert "--overload F needs --capacity" in capsys.readouterr().err

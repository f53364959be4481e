"""``kvstore sim validate``: the comparison of a real run with the simulator's, and its
refusal of a real run of another workload.  (The validation itself, against real vLLM
engines, is a benchmark: docs/sim.md has its figures.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_sim_fleet import BT, shared_trace

from kvstore.cli import main
from kvstore.errors import InvalidArgument
from kvstore.sim.validate import compare


def summary(ttft: float, tbt: float, tput: float) -> dict[str, Any]:
    return {"ttft_ms": {"p50": ttft, "p90": 2 * ttft}, "tbt_ms": {"p50": tbt}, "throughput_tok_s": tput}


def test_errors_are_relative_to_the_real_run_and_the_ttft_ratio_is_compared() -> None:
    real = {"configs": {"baseline": summary(100, 20, 50), "pool": summary(50, 20, 50)}}
    sim = {"configs": {"baseline": summary(120, 15, 50), "pool": summary(80, 20, 40)}}
    out = compare(real, sim, ["baseline", "pool"], 0.25)
    b, p = out["configs"]["baseline"], out["configs"]["pool"]
    assert b["error"] == {"ttft_p50_ms": 0.2, "ttft_p90_ms": 0.2, "tbt_p50_ms": -0.25, "throughput_tok_s": 0.0}
    assert b["within"] and not p["within"]  # pool's TTFT is 60 % off
    assert out["ttft_ratio"] == {"real": 0.5, "sim": pytest.approx(0.6667, abs=1e-4), "same_side": True}
    assert not out["ok"]
    sim["configs"]["pool"] = summary(130, 20, 50)  # within 25 %? no: 160 % and slower than baseline
    out = compare(real, sim, ["baseline", "pool"], 3.0)
    assert out["configs"]["pool"]["within"] and out["ttft_ratio"]["same_side"] is False and not out["ok"]
    with pytest.raises(InvalidArgument, match="'pd' is missing from the simulated run"):
        compare({"configs": {"pd": summary(1, 1, 1)}}, sim, ["pd"], 0.25)


def test_a_saved_real_run_is_compared_on_the_same_workload_and_refused_for_another(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    trace = str(shared_trace(tmp_path / "t.jsonl"))
    flags = ["--trace", trace, "--block-tokens", str(BT), "--rate", "4", "--configs", "baseline,pool", "--engines", "2"]
    # a "real" result of the same workload: the simulator's own (so every error is 0)
    assert main(["sim", *flags, "--json"]) == 0
    saved = tmp_path / "real.json"
    saved.write_text(capsys.readouterr().out)
    assert main(["sim", "validate", *flags, "--real", str(saved), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and set(out["configs"]) == {"baseline", "pool"}
    assert all(e == 0 for c in out["configs"].values() for e in c["error"].values())
    assert out["workload"]["requests"] == 24 and out["workload"]["argv"][2:] == ["--rate", "4.0"]
    # the same file against other workload flags is refused, naming what differs
    other = ["sim", "validate", *flags[:2], "--block-tokens", str(2 * BT), "--rate", "4", "--real", str(saved)]
    assert main(other) == 2
    assert "--real: made with other workload flags (block_tokens," in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("[]")
    assert main(["sim", "validate", *flags, "--real", str(tmp_path / "bad.json")]) == 2
    assert "not the JSON of `kvstore bench serving --json`" in capsys.readouterr().err


def test_calibration_recovers_a_step_model_from_its_steps() -> None:
    """The fit of ``kvstore sim calibrate`` finds the constants that made the steps (the
    ones in kvstore/sim/profiles/local.json's shape), and its jitter the noise put in."""
    import random

    from kvstore.sim.calibrate import fit

    truth = {
        "overhead_ms": 16.0,
        "prefill_ms_per_token": 0.3,
        "prefill_attn_ms": 2e-5,
        "decode_ms_per_seq": 0.4,
        "request_ms": 6.0,
    }
    rng = random.Random(1)
    samples = []
    for t in (32, 64, 128, 256, 512, 1024, 2048) * 3:
        ms = (
            truth["overhead_ms"]
            + truth["request_ms"]
            + truth["prefill_ms_per_token"] * t
            + truth["prefill_attn_ms"] * t * t
        )
        samples.append({"t": t, "pairs": t * t, "b": 0, "ctx": 0, "ms": ms * rng.lognormvariate(0, 0.05)})
    for b, p in ((1, 32), (4, 32), (16, 32), (32, 32), (1, 512), (4, 512), (8, 512)) * 10:
        ms = truth["overhead_ms"] + truth["decode_ms_per_seq"] * b  # no cost per context token
        samples.append({"t": 0, "pairs": 0, "b": b, "ctx": b * (p + 8), "ms": ms * rng.lognormvariate(0, 0.05)})
    f = fit(samples)
    c = f["constants"]
    for k in ("overhead_ms", "prefill_ms_per_token", "decode_ms_per_seq"):
        assert c[k] == pytest.approx(truth[k], rel=0.15), k
    assert c["request_ms"] == pytest.approx(truth["request_ms"], rel=0.3)  # a prefill's, not a decode step's
    assert c["prefill_attn_ms"] == pytest.approx(truth["prefill_attn_ms"], rel=0.5)  # small beside T: loosely
    for t in (64, 1024, 2048):  # what the simulator uses: step times, within the noise
        want = (
            truth["overhead_ms"]
            + truth["request_ms"]
            + truth["prefill_ms_per_token"] * t
            + truth["prefill_attn_ms"] * t * t
        )
        got = c["overhead_ms"] + c["request_ms"] + c["prefill_ms_per_token"] * t + c["prefill_attn_ms"] * t * t
        assert got == pytest.approx(want, rel=0.05)
    assert c["decode_ms_per_kv_token"] < 1e-3  # not in the data: (nearly) nothing, never negative
    assert 0.03 < f["jitter_cv"] < 0.08 and f["r2"] > 0.95
    with pytest.raises(InvalidArgument, match="cannot fit"):
        fit(samples[:3])


class _PrefixCachingEngine:
    """An engine stand-in with a prefix cache of whole blocks and known step costs: what
    ``kvstore sim calibrate``'s measurements ask of a vLLM engine (``generate``, ``batch``)."""

    block_size = 16
    overhead, per_token, per_pair, per_cached_pair, per_seq = 5.0, 0.1, 1e-4, 2e-4, 0.3

    def __init__(self) -> None:
        self.cached: set[tuple[int, ...]] = set()

    def generate(self, tokens: list[int], max_tokens: int) -> dict[str, float]:
        bs = self.block_size
        hit = 0
        while (hit + 1) * bs < len(tokens) and tuple(tokens[: (hit + 1) * bs]) in self.cached:
            hit += 1
        c = hit * bs
        for end in range(bs, len(tokens) + 1, bs):
            self.cached.add(tuple(tokens[:end]))
        new = len(tokens) - c
        ms = self.overhead + self.per_token * new + self.per_pair * new * new + self.per_cached_pair * new * c
        return {"ttft_ms": ms}

    def batch(self, requests: list[object]) -> list[dict[str, list[float]]]:
        step = self.overhead + self.per_seq * len(requests)
        return [{"token_ms": [i * step for i in range(24)]}]


def test_calibration_times_prefills_over_a_cached_prefix_and_fits_their_attention() -> None:
    """A pool's hit leaves the engine the prompt's tail to compute, attending to the whole
    prompt: calibration times such steps (a prefix computed first, then the prompt) and
    the fit prices the new tokens' pairs with the cached prefix apart from their pairs
    among themselves (``prefill_cached_attn_ms``: an engine reads that KV back), so the
    simulator charges a hit's tail its context at the engine's own rate."""
    import argparse

    from kvstore.sim.calibrate import cached_pairs, fit, measure

    engine = _PrefixCachingEngine()
    samples = measure(engine, argparse.Namespace(seed=0, max_prefill=2048, repeats=1))
    cached = [s for s in samples if s["kind"] == "prefill-cached"]
    bs = engine.block_size
    want = {(t, t * (c * bs + t), t * c * bs) for c in (2, 4, 8) for t in (32, 128, 384)}
    assert {(s["t"], s["pairs"], s["cached_pairs"]) for s in cached} == want
    for s in cached:  # each timed step computed only the new tokens: the prefix hit
        new_pairs = s["pairs"] - s["cached_pairs"]
        expect = engine.per_token * s["t"] + engine.per_pair * new_pairs + engine.per_cached_pair * s["cached_pairs"]
        assert s["ms"] == pytest.approx(engine.overhead + expect)
        old = {k: v for k, v in s.items() if k != "cached_pairs"}  # a sample saved before the field
        assert cached_pairs(old) == s["cached_pairs"]
    c = fit(samples)["constants"]
    assert c["prefill_attn_ms"] == pytest.approx(engine.per_pair, rel=0.01)
    assert c["prefill_cached_attn_ms"] == pytest.approx(engine.per_cached_pair, rel=0.01)
    assert c["prefill_ms_per_token"] == pytest.approx(engine.per_token, rel=0.01)


def test_a_calibrations_samples_are_fitted_again_without_vllm(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """``kvstore sim calibrate --samples FILE`` fits the samples of an earlier ``--json``
    run into ``--base`` (its block geometry kept), citing the file; a file without samples
    is refused."""
    import argparse

    from kvstore.sim.calibrate import measure
    from kvstore.sim.profile import EngineProfile

    engine = _PrefixCachingEngine()
    samples = measure(engine, argparse.Namespace(seed=0, max_prefill=2048, repeats=1))
    saved = tmp_path / "cal.json"
    saved.write_text(json.dumps({"name": "a profile first"}) + "\n" + json.dumps({"samples": samples, "fit": {}}))
    out = tmp_path / "refit.json"
    assert main(["sim", "calibrate", "--samples", str(saved), "--out", str(out), "--name", "refit"]) == 0
    p = EngineProfile.load(out)
    local = EngineProfile.load("local")
    assert p.name == "refit" and (p.block_size, p.num_gpu_blocks) == (local.block_size, local.num_gpu_blocks)
    assert p.prefill_cached_attn_ms == pytest.approx(engine.per_cached_pair, rel=0.01)
    assert p.overhead_ms == pytest.approx(engine.overhead, rel=0.01)
    assert (
        "kvstore sim calibrate --samples" in p.sources["prefill_cached_attn_ms"]
        and "cal.json" in p.sources["overhead_ms"]
    )
    capsys.readouterr()
    (tmp_path / "bad.json").write_text(json.dumps({"fit": {}}))
    assert main(["sim", "calibrate", "--samples", str(tmp_path / "bad.json")]) == 2
    assert "has no samples" in capsys.readouterr().err


def test_calibrating_without_vllm_says_where_to_run_it(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    assert main(["sim", "calibrate"]) == 2
    assert "run `.venv-vllm/bin/kvstore sim calibrate`" in capsys.readouterr().err
    assert main(["sim", "calibrate", "--repeats", "0"]) == 2
    assert "--repeats must be at least 1" in capsys.readouterr().err


def test_the_connector_constants_are_fitted_back_from_a_run_they_made(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """``--fit-connector``: a "real" run made by the simulator with known connector costs
    (2 ms a step, 8 ms a request) is fitted back to exactly those (both on the grid), the
    profile written cites the fit, and the comparison after it is exact."""
    from kvstore.sim.profile import EngineProfile

    trace = str(shared_trace(tmp_path / "t.jsonl"))
    prof = EngineProfile.load("local").to_dict()
    truth = tmp_path / "truth.json"
    truth.write_text(json.dumps({**prof, "connector_step_ms": 2.0, "connector_request_ms": 8.0}))
    flags = ["--trace", trace, "--block-tokens", str(BT), "--rate", "4", "--configs", "baseline,pool"]
    assert main(["sim", *flags, "--profile", str(truth), "--json"]) == 0
    saved = tmp_path / "real.json"
    saved.write_text(capsys.readouterr().out)
    out_profile = tmp_path / "fitted.json"
    argv = ["sim", "validate", *flags, "--real", str(saved), "--fit-connector", str(out_profile), "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    best = out["fit_connector"]["best"]
    assert (best["connector_step_ms"], best["connector_request_ms"]) == (2.0, 8.0) and best["loss"] == pytest.approx(0)
    fitted = EngineProfile.load(str(out_profile))
    assert (fitted.connector_step_ms, fitted.connector_request_ms) == (2.0, 8.0)
    assert fitted.sources["connector_step_ms"].startswith("fitted: `kvstore sim validate --fit-connector`")
    assert out["ok"] and all(e == 0 for c in out["configs"].values() for e in c["error"].values())
    # the costs matter: without them the simulated pool is faster than the run they made
    assert main(["sim", "validate", *flags, "--real", str(saved), "--json"]) in (0, 1)
    plain = json.loads(capsys.readouterr().out)
    assert plain["configs"]["pool"]["sim"]["ttft_p50_ms"] < out["configs"]["pool"]["sim"]["ttft_p50_ms"]
    # a real run without pool cannot be fitted
    only_base = tmp_path / "base.json"
    only_base.write_text(json.dumps({**json.loads(saved.read_text()), "configs": {"baseline": {}}}))
    bad = ["sim", "validate", *flags[:-2], "--configs", "baseline", "--real", str(only_base)]
    assert main([*bad, "--fit-connector", str(tmp_path / "x.json")]) == 2
    assert "--fit-connector needs `baseline` and `pool` in the real run" in capsys.readouterr().err
    # with the run's records the fit matches TTFT request by request, and finds the same costs
    records = tmp_path / "real.jsonl"
    assert main(["sim", *flags, "--profile", str(truth), "--records", str(records), "--json"]) == 0
    capsys.readouterr()
    by_request = [*argv, "--real-records", str(records)]
    assert main(by_request) == 0
    out = json.loads(capsys.readouterr().out)
    best = out["fit_connector"]["best"]
    assert (best["connector_step_ms"], best["connector_request_ms"]) == (2.0, 8.0) and best["loss"] == pytest.approx(0)
    assert best["pool_minus_baseline_ttft_ms"] == out["per_request"]["pool_minus_baseline_ttft_ms"]["real"]
    assert (
        "median per-request TTFT over baseline's"
        in EngineProfile.load(str(out_profile)).sources["connector_request_ms"]
    )


def test_an_engine_with_the_connector_pays_its_step_and_request_costs() -> None:
    """``connector_step_ms`` and ``connector_request_ms`` lengthen the steps of an engine that
    has the pool (a ``lookup_external``), per step and per request first scheduled, and
    nothing of an engine without it."""
    from kvstore.sim.engine import EngineModel, ExternalHit
    from kvstore.sim.profile import EngineProfile

    prof = EngineProfile.from_dict(
        {
            **EngineProfile.load("local").to_dict(),
            "connector_step_ms": 3.0,
            "connector_request_ms": 5.0,
            "jitter_cv": 0,
        },
        "test",
    )

    def steps(lookup: object) -> list[float]:
        m = EngineModel(prof, lookup_external=lookup)  # type: ignore[arg-type]
        for i in range(2):
            m.add_request(f"r{i}", 100, [], max_tokens=2, arrival_s=0.0)
        return [m.step(0.0).step_time_s, m.step(1.0).step_time_s]

    plain = steps(None)
    pooled = steps(lambda req_id, hashes: ExternalHit())
    assert pooled[0] == pytest.approx(plain[0] + (3.0 + 2 * 5.0) / 1000)  # both admitted in the first step
    assert pooled[1] == pytest.approx(plain[1] + 3.0 / 1000)  # the decode step: the per-step cost alone


def test_every_engine_pays_request_ms_in_the_step_that_takes_a_request_in() -> None:
    """``request_ms``: each request a step schedules for the first time lengthens it (with
    the pool's connector or without); a decode step pays nothing of it."""
    from kvstore.sim.engine import EngineModel
    from kvstore.sim.profile import EngineProfile

    base = {**EngineProfile.load("local").to_dict(), "jitter_cv": 0}

    def steps(request_ms: float) -> list[float]:
        m = EngineModel(EngineProfile.from_dict({**base, "request_ms": request_ms}, "test"))
        for i in range(3):
            m.add_request(f"r{i}", 100, [], max_tokens=2, arrival_s=0.0)
        return [m.step(0.0).step_time_s, m.step(1.0).step_time_s]

    without, with_ = steps(0.0), steps(6.0)
    assert with_[0] == pytest.approx(without[0] + 3 * 6.0 / 1000)
    assert with_[1] == pytest.approx(without[1])


def test_sim_writes_every_requests_record_as_the_benchmark_does(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """``kvstore sim --records``: one JSON line per request and configuration, in the shape
    of ``kvstore bench serving --records`` (so the two can be compared request by request)."""
    trace = str(shared_trace(tmp_path / "t.jsonl"))
    out = tmp_path / "records.jsonl"
    flags = ["--trace", trace, "--block-tokens", str(BT), "--rate", "4", "--configs", "baseline,pool"]
    assert main(["sim", *flags, "--records", str(out), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(recs) == 2 * 24 and {r["config"] for r in recs} == {"baseline", "pool"}
    for name in ("baseline", "pool"):
        mine = [r for r in recs if r["config"] == name]
        assert sorted(r["index"] for r in mine) == list(range(24))
        assert len([r for r in mine if r["error"] is None]) == result["configs"][name]["completed"]
        assert all(r["prompt_tokens"] == 224 and r["ttft_ms"] > 0 and r["engine"] for r in mine)
        ttfts = sorted(r["ttft_ms"] for r in mine)
        assert ttfts[0] - 1e-3 <= result["configs"][name]["ttft_ms"]["p50"] <= ttfts[-1] + 1e-3  # (rounded)
        assert all(r["e2e_ms"] >= r["ttft_ms"] and len(r["itl_ms"]) == r["max_tokens"] - 1 for r in mine)


def test_sim_repeats_with_seeds_and_reports_medians_as_the_benchmark_does(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """``kvstore sim --repeat 3``: three runs a configuration, seeds 0, 1, 2, each figure the
    median of the three runs' (each one the same as ``--seed i`` alone), ``repeats`` and
    ``runs`` as the benchmark's, every record tagged with its repeat; ``sim validate`` runs the
    simulator as many times as the saved real run did."""
    import statistics

    trace = str(shared_trace(tmp_path / "t.jsonl"))
    flags = ["--trace", trace, "--block-tokens", str(BT), "--rate", "4", "--configs", "baseline"]
    out = tmp_path / "records.jsonl"
    assert main(["sim", *flags, "--repeat", "3", "--records", str(out), "--json"]) == 0
    three = json.loads(capsys.readouterr().out)
    singles = []
    for seed in range(3):
        assert main(["sim", *flags, "--seed", str(seed), "--json"]) == 0
        singles.append(json.loads(capsys.readouterr().out)["configs"]["baseline"])
    base = three["configs"]["baseline"]
    assert base["repeats"]["n"] == 3 and len(base["runs"]) == 3 and three["sim"]["repeat"] == 3
    assert len({s["ttft_ms"]["p90"] for s in singles}) > 1  # the local profile's jitter moves it
    assert base["ttft_ms"]["p90"] == pytest.approx(statistics.median(s["ttft_ms"]["p90"] for s in singles), abs=1e-3)
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted({r["repeat"] for r in recs}) == [0, 1, 2] and len(recs) == 3 * 24
    saved = tmp_path / "real.json"
    saved.write_text(json.dumps(three))
    assert main(["sim", "validate", *flags, "--real", str(saved), "--json"]) == 0  # itself: no error
    v = json.loads(capsys.readouterr().out)
    assert v["sim"]["repeat"] == 3 and v["configs"]["baseline"]["error"]["ttft_p50_ms"] == 0
    assert main(["sim", *flags, "--repeat", "0"]) == 2
    assert "--repeat must be 1 to 100" in capsys.readouterr().err


def test_ttft_is_compared_request_by_request_from_both_runs_records(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """``--real-records``: the real run's records against the simulator's own, request by
    request (median error, median |error|, pool − baseline per request): a "real" run that
    is the simulator's with another connector cost shows it there; a bad file is refused."""
    from kvstore.sim.profile import EngineProfile

    trace = str(shared_trace(tmp_path / "t.jsonl"))
    flags = ["--trace", trace, "--block-tokens", str(BT), "--rate", "4", "--configs", "baseline,pool"]
    prof = tmp_path / "costly.json"
    prof.write_text(json.dumps({**EngineProfile.load("local").to_dict(), "connector_request_ms": 30.0}))
    real_records = tmp_path / "real.jsonl"
    assert main(["sim", *flags, "--profile", str(prof), "--records", str(real_records), "--json"]) == 0
    saved = tmp_path / "real.json"
    saved.write_text(capsys.readouterr().out)
    args = ["sim", "validate", *flags, "--real", str(saved), "--real-records", str(real_records), "--json"]
    main([*args, "--profile", str(prof)])
    same = json.loads(capsys.readouterr().out)["per_request"]
    assert all(c["requests"] == 24 and c["ttft_median_abs_rel_err"] == 0 for c in same["configs"].values())
    assert same["pool_minus_baseline_ttft_ms"]["real"] == same["pool_minus_baseline_ttft_ms"]["sim"] > 0
    main(args)  # the bundled profile: 4 ms a request, not 30
    cheap = json.loads(capsys.readouterr().out)["per_request"]
    assert cheap["configs"]["baseline"]["ttft_median_abs_rel_err"] == 0  # untouched by the connector's cost
    assert cheap["configs"]["pool"]["ttft_median_rel_err"] < 0
    diff = cheap["pool_minus_baseline_ttft_ms"]
    assert diff["sim"] < diff["real"]
    real_records.write_text("not json\n")
    assert main(args) == 2
    assert "line 1: not a request's record" in capsys.readouterr().err


def test_a_costlier_save_is_declined_sooner_by_the_evidence_admission(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """``connector_save_ms`` is what one save costs the worker besides its bytes over the DRAM
    link (``EngineProfile.save_s``); the simulated connector's ``evidence`` admission weighs
    it as the real one weighs its workers' save timings: on the shared trace's first 100
    requests (little reuse), a costlier save stores fewer chunks and skips more."""
    from kvstore.sim.profile import EngineProfile

    local = EngineProfile.load("local")
    assert local.save_s(0) == 0
    assert local.save_s(2 << 20) == pytest.approx(local.load_s("dram", 2 << 20) + local.connector_save_ms / 1000)
    got = {}
    for ms in (0.0, 20.0):
        prof = tmp_path / f"save{ms}.json"
        prof.write_text(json.dumps({**local.to_dict(), "connector_save_ms": ms}))
        assert main(["sim", "--requests", "100", "--configs", "pool", "--profile", str(prof), "--json"]) == 0
        got[ms] = json.loads(capsys.readouterr().out)["configs"]["pool"]["connector"]
    assert got[20.0]["saved_chunks"] < got[0.0]["saved_chunks"]
    assert got[20.0]["skipped_save_chunks"] > got[0.0]["skipped_save_chunks"]
    with pytest.raises(InvalidArgument, match="connector_save_ms"):
        EngineProfile.from_dict({**local.to_dict(), "connector_save_ms": -1.0}, "bad")

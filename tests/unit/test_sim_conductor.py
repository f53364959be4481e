"""``kvstore sim``'s ``conductor`` configuration: the project's conductor routing a simulated
fleet, fed the engines' KV events, the pool's locations and the engines' load."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_sim_fleet import BT, CHUNK, profile, shared_trace, workload, write_trace

from gpu_agent.vllm.settings import ConnectorSettings
from kvstore.cli import main
from kvstore.errors import InvalidArgument
from kvstore.sim.cli import run_config
from kvstore.sim.conductor import ConductorRouter, conductor_config
from kvstore.sim.fleet import run_fleet
from kvstore.sim.pool import PoolHooks
from kvstore.traces.simulator import TraceClock


def families_trace(path: Path, n: int = 32) -> Path:
    """Four prompt families (a 10-block system prompt each) in pairs, F0 F0 F1 F1 F2 F2 F3 F3
    F0 ..., each request with 4 blocks of its own and 16 output tokens, one every 500 ms:
    round robin sends every family to both engines."""
    rows = [(i * 500, [(i // 2) % 4 * 100 + j for j in range(10)] + [10_000 + i * 10 + j for j in range(4)], 16 * 32)
            for i in range(n)]  # fmt: skip
    return write_trace(path, rows)


# prefill slow enough (224 ms for a whole prompt) that a cached prefix is no tie; a cache of
# about two prefixes beside the running request
SLOW = {"prefill_ms_per_token": 1.0, "num_gpu_blocks": 40}


def run(name: str, path: Path, engines: int = 2, **kw: Any) -> dict[str, Any]:
    return run_config(
        name,
        workload(path),
        profile(**SLOW),
        engines=engines,
        seed=0,
        node_dram=1 << 20,
        node_nvme=0,
        slo_ttft_ms=2000,
        slo_tbt_ms=200,
        # auto: only a family's second sighting is stored, so a cached prefix on an engine is
        # worth more than the pool's copy (under evidence, the default, the pool holds every
        # family from the start and the conductor has no engine cache to prefer)
        settings=ConnectorSettings.from_extra({**CHUNK, "save_policy": "auto"}),
        **kw,
    )


def test_the_conductor_sends_each_prompt_family_where_its_prefix_is_cached(tmp_path: Path) -> None:
    path = families_trace(tmp_path / "t.jsonl")
    rr = run("pool", path)
    cond = run("conductor", path)
    assert cond["completed"] == cond["requests"] == 32 and cond["rejected"] == 0
    # round robin sends all four families to each engine, whose cache holds two: the
    # conductor, reading the engines' KV events, keeps two families on each
    assert cond["prompt_tokens"]["engine_cache"] > 2 * rr["prompt_tokens"]["engine_cache"]
    r = cond["routing"]
    assert sum(r["decisions_per_engine"].values()) == 32 and set(r["decisions_per_engine"]) == {"engine0", "engine1"}
    assert r["decision_us"]["p50"] is not None and r["predicted_ttft_abs_err_median"] is not None
    # per engine: the same first tokens, predicted against measured (the dashboard's columns)
    per = r["ttft_per_engine"]
    assert set(per) == {"engine0", "engine1"} and sum(e["n"] for e in per.values()) == 32
    assert all(
        e["predicted_p50_ms"] > 0 and e["measured_p50_ms"] > 0 and e["abs_err_median"] >= 0 for e in per.values()
    )
    assert min(e["abs_err_median"] for e in per.values()) <= r["predicted_ttft_abs_err_median"]
    assert max(e["abs_err_median"] for e in per.values()) >= r["predicted_ttft_abs_err_median"]
    assert r["rejected"] == {} and r["pool_errors"] == r["pool_late"] == 0
    assert cond["kv_events"] > 0 and "connector" in cond and "store_blocks" in cond


def test_the_view_reads_every_event_as_the_engines_published_it(tmp_path: Path) -> None:
    """Every BlockStored is placed (its parent known, its token_ids whole blocks), so the
    view's blocks are the engine's own cached blocks."""
    wl = workload(shared_trace(tmp_path / "t.jsonl", n=40))
    p = profile(num_gpu_blocks=24)  # evictions and re-stores happen
    clock = TraceClock()
    hooks = PoolHooks(p, 3, node_dram=1 << 20, clock=clock, settings=ConnectorSettings.from_extra(CHUNK))
    router = ConductorRouter(p, 3, pool=hooks.pool, cfg=conductor_config(2000, 200), clock=clock)
    run_fleet(wl, p, engines=3, hooks=hooks, router=router, clock=clock)
    index = router.view.index
    for i, eid in enumerate(("engine0", "engine1", "engine2")):
        counts = index.counts(eid)
        assert counts["stored"] > 0 and counts["removed"] > 0
        assert counts["orphan"] == counts["malformed"] == counts["cleared"] == 0
        assert index.held(eid) == len(router._models[i]._cached)


def test_with_rejection_on_the_conductor_refuses_what_would_miss_its_target(tmp_path: Path) -> None:
    path = families_trace(tmp_path / "t.jsonl")
    strict = conductor_config(150, 200, reject=True, extra="--min-samples 4")
    out = run("conductor", path, conductor=strict)
    assert out["rejected"] > 0 and out["completed"] + out["rejected"] == 32 and out["errors"] == 0
    assert out["routing"]["rejected"].get("ttft") == out["rejected"]
    assert sum(out["routing"]["decisions_per_engine"].values()) == out["completed"]
    lenient = run("conductor", path)  # the same targets without --conductor-reject only guide placement
    assert lenient["rejected"] == 0


def test_conductor_args_are_the_conductors_own_flags() -> None:
    cfg = conductor_config(1500, 100, extra="--probe-s 0.5 --min-samples 3")
    assert cfg.probe_s == 0.5 and cfg.slo.min_samples == 3 and cfg.slo.ttft_s == 1.5 and not cfg.slo.reject
    assert cfg.engines == ()
    with pytest.raises(InvalidArgument, match="--conductor-args"):
        conductor_config(1500, 100, extra="--no-such-flag")


def test_the_simulated_conductor_starts_from_its_profiles_rates_unless_told_otherwise() -> None:
    """The priors an operator sets from measured rates: a tier the conductor never sends a
    request to keeps its prior, so the defaults' 1 GB/s over the network would make the
    H100 profile's pool look slower than computing (it is 25 GB/s there)."""
    from kvstore.sim.profile import EngineProfile

    h100 = EngineProfile.load("h100-llama3-8b")
    cfg = conductor_config(2000, 200, profile=h100)
    assert cfg.priors.load_gbps == (50.0, 7.0, 25.0) and cfg.priors.bytes_per_token == 131072
    assert cfg.priors.prefill_tokens_per_s == pytest.approx(1000 / h100.prefill_ms_per_token, rel=1e-5)
    told = conductor_config(2000, 200, profile=h100, extra="--tier-gbps 10,2,1 --bytes-per-token 1000")
    assert told.priors.load_gbps == (10.0, 2.0, 1.0) and told.priors.bytes_per_token == 1000
    assert conductor_config(2000, 200).priors == conductor_config(2000, 200, extra="").priors  # the CLI's defaults


def test_the_cli_runs_the_conductor_deterministically(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    trace = shared_trace(tmp_path / "t.jsonl")
    prof = tmp_path / "p.json"
    profile(name="small", num_gpu_blocks=24).save(prof)
    args = ["sim", "--trace", str(trace), "--block-tokens", str(BT), "--profile", str(prof), "--engines", "2",
            "--node-dram", "64KiB", "--connector-extra", json.dumps(CHUNK), "--configs", "baseline,conductor",
            "--json"]  # fmt: skip

    def once() -> dict[str, Any]:
        assert main(args) == 0
        out = capsys.readouterr()
        assert "conductor" in out.err
        r: dict[str, Any] = json.loads(out.out)
        return r

    r = once()
    assert list(r["configs"]) == ["baseline", "conductor"] and "routing" in r["configs"]["conductor"]
    assert "routing" not in r["configs"]["baseline"]

    def timeless(x: Any) -> Any:  # the decision's real time and the wall clock differ between runs
        if isinstance(x, dict):
            return {k: timeless(v) for k, v in x.items() if k not in ("wall_s", "decision_us", "decision_cpu_us")}
        return x

    assert timeless(once()) == timeless(r)

"""``kvstore sim``'s ``pd`` and ``conductor-pd``: prefill engines save a prompt's chunks through
the pool, decode engines load exactly those and compute the prompt's last token; the handoff's
transfer is in TTFT as the profile's bandwidths say."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_sim_fleet import CHUNK, profile, shared_trace, sim, workload, write_trace

from gpu_agent.vllm.settings import ConnectorSettings
from kvstore.errors import InvalidArgument
from kvstore.sim.cli import run_config
from kvstore.sim.fleet import FleetRun, roles, run_fleet
from kvstore.sim.pool import PoolHooks
from kvstore.traces.simulator import TraceClock


def unique_trace(path: Path, n: int = 12) -> Path:
    """``n`` prompts sharing nothing, of 3 to 8 trace blocks (48-128 tokens: some end on a
    32-token chunk boundary, some in the middle of a chunk), one every 100 ms."""
    return write_trace(path, [(i * 100, [1000 * i + j for j in range(3 + i % 6)], 24) for i in range(n)])


def pd_run(
    path: Path, engines: int = 4, prefill: int = 2, nodes: int | None = None, node_dram: int = 1 << 20
) -> tuple[FleetRun, PoolHooks]:
    """``pd``'s fleet (``prefill`` prefill engines, the rest decode) over the test profile."""
    wl = workload(path)
    p = profile()
    clock = TraceClock()
    hooks = PoolHooks(
        p,
        engines,
        nodes=nodes,
        node_dram=node_dram,
        clock=clock,
        settings=ConnectorSettings.from_extra(CHUNK),
        roles=roles(engines, prefill),
    )
    try:
        return run_fleet(wl, p, engines=engines, hooks=hooks, clock=clock, prefill=prefill), hooks
    finally:
        hooks.close()


def test_decode_engines_compute_only_each_prompts_last_token(tmp_path: Path) -> None:
    run, hooks = pd_run(unique_trace(tmp_path / "t.jsonl"))
    assert len(run.served) == 12
    for s in run.served:
        n = len(s.work.tokens)
        assert s.done and s.prefill in (0, 1) and s.engine in (2, 3)
        assert s.prefill_cache_tokens == s.prefill_store_tokens == 0  # prefill engines never load
        assert s.engine_cache_tokens == 0 and s.store_tokens == n - 1, (n, s.store_tokens)
        assert s.prefill_end_s is not None and s.work.arrival_s < s.prefill_end_s < s.token_s[0]
    pt = run.prompt_tokens()
    prompts = sum(len(w.work.tokens) for w in run.served)
    assert pt["total"] == 2 * prompts and pt["recomputed"] == prompts + len(run.served)
    c = hooks.summary()["connector"]
    assert c["handoffs"] == 12 and c["handoff_short"] == 0 and c["loads"] == 12
    assert hooks.summary()["store_blocks"]["remote_pulls"] > 0  # one node per engine: every load is remote


def test_the_fronts_take_prefill_and_decode_engines_each_in_turn(tmp_path: Path) -> None:
    run, _ = pd_run(unique_trace(tmp_path / "t.jsonl"), engines=5, prefill=2)
    assert [s.prefill for s in run.served] == [0, 1] * 6
    assert [s.engine for s in run.served] == [2, 3, 4] * 4


@pytest.mark.parametrize("nodes", [None, 1])
def test_the_handoffs_transfer_is_in_ttft_as_the_profiles_bandwidth_predicts(tmp_path: Path, nodes: int | None) -> None:
    path = write_trace(tmp_path / "t.jsonl", [(0, list(range(7)), 8)])  # 112 tokens: 3 chunks and a partial one
    run, _ = pd_run(path, engines=2, prefill=1, nodes=nodes)
    (s,) = run.served
    p = profile()
    T = len(s.work.tokens)
    bpt = p.kv_bytes_per_token
    prefill_s = p.step_ms(T, T * T, 0, 0) / 1e3  # one step, nothing cached
    save_s = p.load_s("dram", 4 * 32 * bpt)  # its 3 chunks and the partial one, saved in that step
    decode_s = p.step_ms(1, T, 0, 0) / 1e3  # the last prompt token, attending to all T
    if nodes is None:  # the decode engine's node pulls from the prefill engine's: network, asynchronously
        load_s = p.load_s("network", (T - 1) * bpt)
    else:  # one node: its DRAM, inside the decode engine's step
        load_s = p.load_s("dram", (T - 1) * bpt)
    assert s.store_tokens == T - 1
    rec = s.record("pd")
    assert rec.prefill_engine == "engine0" and rec.engine == "engine1"
    assert rec.prefill_ms == pytest.approx(prefill_s * 1e3, rel=1e-9)
    assert rec.ttft_ms == pytest.approx((prefill_s + save_s + load_s + decode_s) * 1e3, rel=1e-9)


def test_a_handoff_whose_chunks_are_gone_is_recomputed_and_counted(tmp_path: Path) -> None:
    # nodes of 2 chunks: a 4-chunk prompt's first chunks are evicted by its own later ones
    run, hooks = pd_run(unique_trace(tmp_path / "t.jsonl"), node_dram=2 * 32 * 1000)
    assert all(s.done for s in run.served)
    c = hooks.summary()["connector"]
    assert c["handoffs"] == 12 and 0 < c["handoff_short"] < 12
    short = [s for s in run.served if s.store_tokens < len(s.work.tokens) - 1]
    assert len(short) == c["handoff_short"]


def test_prefill_counts_are_checked() -> None:
    with pytest.raises(InvalidArgument, match="--prefill must be between 1 and --engines - 1"):
        roles(2, 2)
    assert roles(3, 1) == ["prefill", "decode", "decode"] and roles(2) == ["both", "both"]


def test_conductor_pd_routes_through_the_conductors_pd_decision(tmp_path: Path) -> None:
    wl = workload(shared_trace(tmp_path / "t.jsonl"))
    out = run_config(
        "conductor-pd",
        wl,
        profile(),
        engines=4,
        seed=0,
        node_dram=1 << 20,
        node_nvme=0,
        slo_ttft_ms=2000,
        slo_tbt_ms=200,
        settings=ConnectorSettings.from_extra(CHUNK),
    )
    assert out["completed"] == 24 and out["errors"] == out["rejected"] == 0
    decisions = out["routing"]["decisions_per_engine"]
    # every request is dispatched twice: to a prefill engine (0, 1), then to a decode engine (2, 3)
    assert sum(decisions.get(f"engine{i}", 0) for i in (0, 1)) == 24
    assert sum(decisions.get(f"engine{i}", 0) for i in (2, 3)) == 24
    assert out["connector"]["handoffs"] == 24 and out["connector"]["handoff_short"] == 0
    assert out["prompt_tokens"]["total"] == 2 * sum(len(w.tokens) for w in wl.items)


def test_the_cli_runs_pd_with_the_benchmarks_keys(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    prof = tmp_path / "tiny.json"
    profile().save(prof)
    args = ["--trace", str(shared_trace(tmp_path / "t.jsonl")), "--block-tokens", "16", "--engines", "3",
            "--profile", str(prof),
            "--connector-extra", json.dumps(CHUNK), "--configs", "pool,pd,conductor-pd", "--json"]  # fmt: skip
    rc, out, err = sim(capsys, *args)
    assert rc == 0 and "pd fleet: 1 prefill, 2 decode engines" in err
    r = json.loads(out)
    assert r["sim"]["prefill"] == 1
    assert [e["role"] for e in r["fleets"]["pd"]["engines"]] == ["prefill", "decode", "decode"]
    assert [e["role"] for e in r["fleets"]["pool"]["engines"]] == ["both"] * 3
    pool, pd, cpd = (r["configs"][n] for n in ("pool", "pd", "conductor-pd"))
    assert set(pd) == set(pool) and set(cpd) == set(pool) | {"routing", "kv_events"}
    for c in (pd, cpd):
        assert c["completed"] == 24 and c["tokens_equal_baseline"] is None
    rc, _, err = sim(capsys, *args[:-3], "--configs", "pd", "--prefill", "3")
    assert rc == 2 and "--prefill must be between 1 and --engines - 1" in err


def test_a_decode_preempted_after_its_first_token_reloads_its_whole_prompt(tmp_path: Path) -> None:
    # regression: a resumed request's last token is an output, so the load may reach the prompt's
    # end (it asked for one token past it: tail_tokens -1, and the engine refused the answer)
    p = profile(num_gpu_blocks=24)  # two decodes of up to 21 blocks do not fit: preemptions
    rows = [(i * 10, [1000 * i + j for j in range(3 + i % 6)], 200) for i in range(6)]
    wl = workload(write_trace(tmp_path / "t.jsonl", rows), output_scale=1.0)  # 200 output tokens
    clock = TraceClock()
    hooks = PoolHooks(
        p, 2, node_dram=1 << 20, clock=clock, settings=ConnectorSettings.from_extra(CHUNK), roles=roles(2, 1)
    )
    run = run_fleet(wl, p, engines=2, hooks=hooks, clock=clock, prefill=1)
    hooks.close()
    assert all(s.done for s in run.served)
    resumed = [s for s in run.served if s.preemptions]
    assert resumed and all(s.engine_cache_tokens + s.store_tokens == len(s.work.tokens) for s in resumed)

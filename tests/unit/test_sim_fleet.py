"""``kvstore sim``: the virtual-time fleet (baseline) and the pool of one real tier manager per
engine with the connector's save policy and load gate, on tiny traces written here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gpu_agent.vllm.settings import ConnectorSettings
from kvstore.bench.serving.workload import Scaling, Workload, build
from kvstore.cli import main
from kvstore.errors import InvalidArgument
from kvstore.sim.cli import parse_configs, run_config
from kvstore.sim.engine import EngineModel, ExternalHit, engine_block_hashes
from kvstore.sim.fleet import run_fleet
from kvstore.sim.pool import PoolHooks, chunks_of, node_of
from kvstore.sim.profile import EngineProfile
from kvstore.traces.simulator import TraceClock

TRACE_BLOCK = 512  # Mooncake's tokens per hash id
BT = 16  # --block-tokens: one trace id = one engine block of 16 tokens
CHUNK = {"chunk_tokens": 32}  # two engine blocks per chunk, so short prompts have several


def profile(**kw: object) -> EngineProfile:
    base: dict[str, object] = dict(
        name="tiny",
        description="a test engine",
        model="none",
        hardware="none",
        overhead_ms=10.0,
        prefill_ms_per_token=0.1,
        prefill_attn_ms=1e-5,
        decode_ms_per_seq=0.05,
        decode_ms_per_kv_token=1e-4,
        max_num_batched_tokens=512,
        max_num_seqs=16,
        block_size=16,
        num_gpu_blocks=4096,
        kv_bytes_per_token=1000,
        dram_bandwidth_Bps=1e9,
        nvme_bandwidth_Bps=1e8,
        network_bandwidth_Bps=5e8,
        dram_latency_s=1e-3,
        nvme_latency_s=1e-3,
        network_latency_s=1e-3,
    )
    base.update(kw)
    return EngineProfile(**base)  # type: ignore[arg-type]


def write_trace(path: Path, rows: list[tuple[int, list[int], int]]) -> Path:
    """Mooncake lines: (timestamp ms, hash ids, output length); prompts are whole trace blocks."""
    with path.open("w") as f:
        for ts, ids, out in rows:
            f.write(
                json.dumps(
                    {"timestamp": ts, "input_length": TRACE_BLOCK * len(ids), "output_length": out, "hash_ids": ids}
                )
                + "\n"
            )
    return path


def shared_trace(path: Path, n: int = 24) -> Path:
    """Two prompt families (a 10-block system prompt each) in pairs, A A B B A A ..., each
    request with 4 blocks of its own: 224-token prompts, one request every 200 ms."""
    rows = []
    for i in range(n):
        fam = (i // 2) % 2
        rows.append((i * 200, [fam * 100 + j for j in range(10)] + [10_000 + i * 10 + j for j in range(4)], 160))
    return write_trace(path, rows)


def workload(path: Path, **kw: Any) -> Workload:
    return build(path, Scaling(block_tokens=BT, **kw))


def pool_run(wl: Workload, p: EngineProfile, engines: int = 2, **extra: Any) -> dict[str, Any]:
    return run_config(
        "pool",
        wl,
        p,
        engines=engines,
        seed=0,
        node_dram=1 << 20,
        node_nvme=0,
        slo_ttft_ms=2000,
        slo_tbt_ms=200,
        settings=ConnectorSettings.from_extra({**CHUNK, **extra}),
    )


# -- the fleet ------------------------------------------------------------------------------
def test_every_request_completes_with_its_output_length(tmp_path: Path) -> None:
    wl = workload(shared_trace(tmp_path / "t.jsonl"))
    p = profile(num_gpu_blocks=40)  # a small cache: preemptions and evictions happen
    for hooks in (None, PoolHooks(p, 3, node_dram=1 << 20, clock=(clock := TraceClock()))):
        run = run_fleet(wl, p, engines=3, hooks=hooks, clock=clock)
        assert len(run.served) == len(wl.items)
        for s in run.served:
            assert s.error is None and s.done and len(s.token_s) == s.work.output_tokens
            assert s.token_s == sorted(s.token_s) and s.token_s[0] > s.work.arrival_s
        assert sorted(s.engine for s in run.served)[:: len(wl.items) // 3] == [0, 1, 2]  # round robin
        assert run.virtual_s >= max(s.token_s[-1] for s in run.served)
        pt = run.prompt_tokens()
        assert (
            pt["engine_cache"] + pt["store"] + pt["recomputed"] == pt["total"] == sum(len(w.tokens) for w in wl.items)
        )


def test_ttft_of_one_request_on_an_idle_engine_is_one_step_of_its_prompt(tmp_path: Path) -> None:
    wl = workload(write_trace(tmp_path / "t.jsonl", [(0, [1, 2, 3, 4, 5], 96)]))
    p = profile()
    T = len(wl.items[0].tokens)
    run = run_fleet(wl, p, engines=4)
    (s,) = run.served
    assert s.token_s[0] - s.work.arrival_s == pytest.approx(p.step_ms(T, T * T, 0, 0) / 1000)
    # then one decode step per token, each attending its whole context
    assert s.token_s[1] - s.token_s[0] == pytest.approx(p.step_ms(0, 0, 1, T + 1) / 1000)


def test_a_request_longer_than_an_engine_holds_is_an_error_not_a_hang(tmp_path: Path) -> None:
    wl = workload(write_trace(tmp_path / "t.jsonl", [(0, list(range(20)), 32), (10, [1], 32)]))
    run = run_fleet(wl, profile(num_gpu_blocks=8), engines=1)
    assert "needs" in (run.served[0].error or "") and run.served[1].done


# -- the pool -------------------------------------------------------------------------------
def test_shared_prefixes_are_served_from_the_store_and_unique_prompts_are_not(tmp_path: Path) -> None:
    path = shared_trace(tmp_path / "t.jsonl")
    p = profile(num_gpu_blocks=24)  # an engine's cache holds about one prompt: the other family evicts it
    shared = pool_run(workload(path), p)
    pt = shared["prompt_tokens"]
    assert pt["store"] > 0 and pt["engine_cache"] + pt["store"] + pt["recomputed"] == pt["total"]
    assert shared["store_blocks"]["remote_pulls"] > 0  # stored by the other engine's node
    assert shared["store_blocks"]["dram_reads"] > 0  # and, pulled once, found on its own
    assert shared["connector"]["saved_chunks"] > 0 and shared["connector"]["load_misses"] == 0
    base = run_config(
        "baseline", workload(path), p, engines=2, seed=0, node_dram=0, node_nvme=0, slo_ttft_ms=2000, slo_tbt_ms=200
    )
    assert pt["recomputed"] < base["prompt_tokens"]["recomputed"]
    assert base["prompt_tokens"]["store"] == 0 and base["store_blocks"] is None

    unique = pool_run(workload(path, unique=True), p, save_policy="auto")
    assert unique["prompt_tokens"]["store"] == 0 and unique["prompt_tokens"]["engine_cache"] == 0
    assert unique["connector"]["saved_chunks"] == 0  # second sighting: a one-off prompt is never stored
    assert pool_run(workload(path, unique=True), p, save_policy="always")["connector"]["saved_chunks"] > 0


def test_a_repeated_prompt_loads_its_partial_chunk_to_its_last_token_less_one(tmp_path: Path) -> None:
    """As the connector does, a prompt's trailing partial chunk is saved (keyed by its exact
    tokens) and a lookup that found every full chunk of the same prompt loads it too: the
    second request of an 80-token prompt (two 32-token chunks and 16 tokens) computes one
    token, where full chunks alone left it 16; a prompt that only shares the full chunks
    does not get the other's partial chunk."""
    rows = [(0, [1, 2, 3, 4, 5], 8), (1000, [1, 2, 3, 4, 5], 8), (2000, [1, 2, 3, 4, 6], 8), (3000, [7, 8], 8)]
    wl = workload(write_trace(tmp_path / "t.jsonl", rows))
    got = pool_run(wl, profile(), save_policy="always")
    pt, c = got["prompt_tokens"], got["connector"]
    # the repeat (engine 1, from engine 0's node): 79 of its 80 tokens; the third prompt (engine
    # 0, its own cache holds the full chunks) nothing of the other tail; the fourth is fresh
    assert pt["store"] == 79 and pt["engine_cache"] == 64
    assert pt["recomputed"] == pt["total"] - 79 - 64
    assert c["loads"] == 1 and c["load_misses"] == 0
    assert got["store_blocks"]["remote_pulls"] == 3  # the repeat's two chunks and tail, into its own node
    # committed: the first prompt's 2 chunks and tail, the 3 pulled, the third prompt's tail (its
    # chunks were stored already: as the connector, it saves from chunk 0 when its hit was local)
    # and the fourth's chunk
    assert c["saved_chunks"] == 3 + 3 + 1 + 1 and c["save_exists"] == 2


def test_save_policy_auto_stores_a_sessions_prompt_at_its_first_sighting(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    rows = [
        {
            "timestamp": i * 100,
            "input_length": 8 * TRACE_BLOCK,
            "output_length": 64,
            "hash_ids": [i * 10 + j for j in range(8)],
        }
        for i in range(4)
    ]
    rows[0]["session_id"] = "chat-1"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = pool_run(workload(path), profile(), save_policy="auto")
    assert out["connector"]["saved_chunks"] == 4  # the session's 8 blocks, 4 chunks; the others none


def test_a_store_slower_than_recompute_is_gated(tmp_path: Path) -> None:
    path = shared_trace(tmp_path / "t.jsonl", n=48)
    p = profile(num_gpu_blocks=24)
    fast = pool_run(workload(path), p, save_policy="always")
    slow = pool_run(
        workload(path),
        profile(num_gpu_blocks=24, network_bandwidth_Bps=1e4, dram_bandwidth_Bps=1e4),
        save_policy="always",
    )
    assert fast["connector"]["gated_chunks"] == 0
    assert slow["connector"]["gated_chunks"] > 0 and slow["prompt_tokens"]["store"] < fast["prompt_tokens"]["store"]
    ungated = pool_run(
        workload(path),
        profile(num_gpu_blocks=24, network_bandwidth_Bps=1e4, dram_bandwidth_Bps=1e4),
        save_policy="always",
        load_gate=False,
    )
    assert ungated["connector"]["gated_chunks"] == 0


def test_nvme_and_remote_hits_load_asynchronously_and_local_dram_ones_in_the_step(tmp_path: Path) -> None:
    wl = workload(shared_trace(tmp_path / "t.jsonl"))
    out = pool_run(wl, profile(num_gpu_blocks=24), save_policy="always")
    c = out["connector"]
    assert 0 < c["async_loads"] < c["loads"]  # remote pulls async, own-node DRAM hits synchronous
    never = pool_run(wl, profile(num_gpu_blocks=24), save_policy="always", async_loads="never")
    assert never["connector"]["async_loads"] == 0 and never["prompt_tokens"]["store"] > 0


def test_a_hit_may_ask_for_an_asynchronous_load_on_a_synchronous_engine() -> None:
    p = profile()
    hashes = engine_block_hashes(list(range(4)), 64, block_size=16, trace_block_tokens=16)
    e = EngineModel(p, lookup_external=lambda rid, hs: ExternalHit(network=len(hs), async_load=True))
    e.add_request("r", 64, hashes, 2, 0.0)
    first = e.step(0.0)
    assert first.idle and [a.req_id for a in first.loads_started] == ["r"] and not first.admitted
    ready = e.next_ready_s()
    assert ready is not None and ready == pytest.approx(p.load_s("network", 3 * p.block_bytes))
    second = e.step(ready)
    assert [a.req_id for a in second.admitted] == ["r"] and second.admitted[0].external_tokens == 48


def test_engines_sharing_a_node_find_each_others_chunks_in_its_dram(tmp_path: Path) -> None:
    wl = workload(shared_trace(tmp_path / "t.jsonl"))
    p = profile(num_gpu_blocks=24)
    kw: dict[str, Any] = dict(seed=0, node_dram=1 << 20, node_nvme=0, slo_ttft_ms=2000, slo_tbt_ms=200)
    settings = ConnectorSettings.from_extra(CHUNK)
    apart = run_config("pool", wl, p, engines=2, settings=settings, **kw)
    shared = run_config("pool", wl, p, engines=2, settings=settings, nodes=1, **kw)
    assert apart["store_blocks"]["remote_pulls"] > 0 and apart["nodes"]["stored_chunks"] > 0
    assert shared["store_blocks"]["remote_pulls"] == 0 and shared["store_blocks"]["dram_reads"] > 0
    assert shared["prompt_tokens"]["store"] > 0
    assert node_of(4) == [0, 1, 2, 3] and node_of(4, 2) == [0, 0, 1, 1] and node_of(3, 1) == [0, 0, 0]
    with pytest.raises(InvalidArgument, match="--nodes must be between 1 and --engines"):
        node_of(2, 3)


def test_a_queued_requests_remote_chunks_are_prefetched_to_its_node_while_it_waits(tmp_path: Path) -> None:
    # request 0 (a prefix F) is computed on engine 0 and saved in its node; at 100 ms four
    # unrelated requests and one more of F arrive, round robin: engine 1 (one request at a
    # time) runs one, queues the next, and F's second request arrives behind it
    fam = list(range(10))
    rows = [(0, [*fam, 10_000], 64)]
    rows += [(100, [20_000 + 10 * i + j for j in range(14)], 64) for i in range(1, 5)]
    rows += [(100, [*fam, 30_000], 64)]
    wl = workload(write_trace(tmp_path / "queued.jsonl", rows))
    p = profile(max_num_seqs=1)
    on, off = pool_run(wl, p), pool_run(wl, p, prefetch=False)
    c = on["connector"]
    assert (c["prefetches"], c["prefetch_chunks"], c["prefetch_skipped"], c["prefetch_misses"]) == (1, 5, 0, 0)
    assert off["connector"]["prefetches"] == off["connector"]["prefetch_chunks"] == 0
    # prefetched while it waited, F's chunks load from the engine's own node, in the step;
    # without, the same chunks are pulled at its load, in the background
    assert (on["store_blocks"]["dram_reads"], on["store_blocks"]["remote_pulls"], c["async_loads"]) == (5, 5, 0)
    assert (off["store_blocks"]["dram_reads"], off["store_blocks"]["remote_pulls"]) == (0, 5)
    assert off["connector"]["async_loads"] == 1
    assert on["prompt_tokens"]["store"] == off["prompt_tokens"]["store"] == 160
    # lookups that ask the store (rpc) make no prefetcher, as in the connector's scheduler half
    assert pool_run(wl, p, lookups="rpc")["connector"]["prefetches"] == 0


def test_node_sizes_are_whole_chunks() -> None:
    assert chunks_of(0, 100, "--node-nvme") == 0 and chunks_of(250, 100, "--node-dram") == 2
    with pytest.raises(InvalidArgument, match="--node-dram of 99 bytes holds no chunk of 100 bytes"):
        chunks_of(99, 100, "--node-dram")


# -- the command line ---------------------------------------------------------------------
def sim(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = main(["sim", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_an_unknown_configuration_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    known = "known: baseline, pool, pd, conductor, conductor-pd"
    with pytest.raises(InvalidArgument, match=rf"unknown configuration\(s\) pdd \({known}\)"):
        parse_configs("baseline,pdd")
    rc, _, err = sim(capsys, "--trace", str(shared_trace(tmp_path / "t.jsonl")), "--configs", "pool,nope")
    assert rc == 2 and "nope" in err and known in err


def _without_wall(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _without_wall(v) for k, v in x.items() if k != "wall_s"}
    return x


def test_the_cli_runs_a_trace_end_to_end_with_the_benchmarks_figures(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    trace = shared_trace(tmp_path / "t.jsonl")
    prof = tmp_path / "jittery.json"
    profile(name="jittery", jitter_cv=0.3, num_gpu_blocks=24).save(prof)
    args = ["--trace", str(trace), "--block-tokens", str(BT), "--profile", str(prof), "--engines", "2",
            "--node-dram", "64KiB", "--node-nvme", "0", "--connector-extra", json.dumps(CHUNK), "--configs",
            "baseline,pool", "--json"]  # fmt: skip
    rc, out, err = sim(capsys, *args)
    assert rc == 0 and "kvstore sim (jittery, 2 engines)" in err and "TTFT p50 ms" in err
    r = json.loads(out)
    assert set(r) >= {"trace", "scaling", "slo", "configs", "sim"} and list(r["configs"]) == ["baseline", "pool"]
    assert r["sim"]["profile"] == "jittery" and r["sim"]["engines"] == 2 and r["sim"]["virtual_s"] > 4.6
    assert r["sim"]["connector"] == {
        "chunk_tokens": 32,
        "save_policy": "evidence",  # the connector's default, simulated
        "load_gate": True,
        "async_loads": "auto",
    }
    for c in r["configs"].values():
        assert c["requests"] == c["completed"] == 24 and c["errors"] == 0
        for key in ("ttft_ms", "tbt_ms"):
            assert set(c[key]) == {"p50", "p90", "p99"} and all(v > 0 for v in c[key].values())
        assert set(c["itl_ms"]) == {"p50", "p99"} and c["throughput_tok_s"] > 0 and c["goodput_rps"] > 0
        assert set(c["prompt_tokens"]) == {"engine_cache", "store", "recomputed", "total"}
        assert c["engine_steps"]["steps"] > 0
    assert set(r["configs"]["pool"]["store_blocks"]) == {
        "dram_reads",
        "nvme_reads",
        "remote_pulls",
        "stored_bytes",
        "read_back_bytes",
    }
    sb = r["configs"]["pool"]["store_blocks"]
    assert sb["stored_bytes"] > 0 and sb["stored_bytes"] % (32 * 1000) == 0  # whole chunks of the profile's KV
    assert 0 < sb["read_back_bytes"] <= sb["stored_bytes"]
    assert r["configs"]["pool"]["nodes"]["dram_chunks"] == 65536 // (32 * 1000)
    # deterministic for a seed (only wall-clock figures differ); another seed, other step times
    assert _without_wall(json.loads(sim(capsys, *args)[1])) == _without_wall(r)
    other = json.loads(sim(capsys, *args, "--seed", "7")[1])
    assert other["configs"]["baseline"]["ttft_ms"] != r["configs"]["baseline"]["ttft_ms"]
    # the table without --json
    rc, out, _ = sim(capsys, *args[:-1], "--configs", "baseline")
    assert rc == 0 and "baseline: 24/24 completed" in out and "simulated" in out

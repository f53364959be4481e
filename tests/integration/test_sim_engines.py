"""Mock engines (``kvstore sim serve``) as processes: vLLM's OpenAI API, /metrics, KV events
read by the conductor's own subscriber and index, and ``kvstore bench serving --engine sim``
over the real harness, conductor and etcd; the ``pool`` of mock engines: their link to real
kvstore nodes (:mod:`kvstore.sim.live_pool`: lookups from the pool's view, checked loads,
pulls, saves, a node that dies) and the benchmark's ``pool`` configuration over them."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import wait_for

from kvstore.bench.serving.fleet import parse_metrics

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 128  # the local profile's block size
PROMPT = list(range(1000, 1000 + 2 * BLOCK + 44))  # two full blocks and a partial one


class MockEngine:
    """One ``kvstore sim serve`` process on free ports (read from its banner)."""

    def __init__(self, *args: str) -> None:
        cmd = [sys.executable, "-m", "kvstore", "sim", "serve", "--port", "0", *args]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # the banner, once it serves (or its error, if it exits)
        m = re.search(r"on (http://\S+) .*?(?:KV events (\S+) replay (\S+))?$", line.strip())
        if m is None:
            self.proc.kill()
            raise AssertionError(f"the mock engine did not start: {line}{self.proc.stdout.read()}")
        self.url, self.events, self.replay = m.group(1), m.group(2), m.group(3)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def post(self, path: str, body: Any, *, raw: bytes | None = None) -> tuple[int, Any]:
        data = raw if raw is not None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                text = r.read().decode()
                status = r.status
        except urllib.error.HTTPError as e:
            text, status = e.read().decode(), e.code
        if text.startswith("data:"):
            return status, [
                json.loads(x[5:]) for x in text.split("\n\n") if x.startswith("data:") and "[DONE]" not in x
            ]
        return status, json.loads(text) if text else None

    def get(self, path: str) -> tuple[int, str]:
        with urllib.request.urlopen(self.url + path, timeout=10) as r:
            return r.status, r.read().decode()

    def metrics(self) -> dict[str, float]:
        return parse_metrics(self.get("/metrics")[1])


@pytest.fixture
def engine() -> Iterator[MockEngine]:
    e = MockEngine(
        "--speed", "4", "--kv-events-endpoint", "tcp://127.0.0.1:0", "--kv-events-replay-endpoint", "tcp://127.0.0.1:0"
    )
    try:
        yield e
    finally:
        e.close()


def _completion(prompt: Any, max_tokens: int, **kw: Any) -> dict[str, Any]:
    return {"model": "kvstore-sim", "prompt": prompt, "max_tokens": max_tokens, "return_token_ids": True, **kw}


def test_completions_stream_and_not_give_the_same_deterministic_tokens(engine: MockEngine) -> None:
    status, full = engine.post("/v1/completions", _completion(PROMPT, 5))
    assert status == 200 and full["object"] == "text_completion"
    tokens = full["choices"][0]["token_ids"]
    assert len(tokens) == 5 and full["choices"][0]["finish_reason"] == "length"
    assert full["usage"]["prompt_tokens"] == len(PROMPT) and full["usage"]["completion_tokens"] == 5

    status, chunks = engine.post(
        "/v1/completions", _completion(PROMPT, 5, stream=True, stream_options={"include_usage": True})
    )
    assert status == 200
    streamed = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])]
    assert streamed == tokens  # the same prompt, the same tokens, one chunk each
    assert [len(c["choices"]) for c in chunks] == [1] * 5 + [0]
    assert chunks[-1]["usage"]["completion_tokens"] == 5
    # the second time, the prompt's two full blocks come from the prefix cache
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 2 * BLOCK

    other = engine.post("/v1/completions", _completion(PROMPT[:-1], 5))[1]["choices"][0]["token_ids"]
    assert other != tokens
    text = engine.post("/v1/completions", _completion("the same words", 3))[1]
    assert text["usage"]["prompt_tokens"] == 3 and text["choices"][0]["text"].count(" t") == 3


def test_chat_completions_stream_and_not(engine: MockEngine) -> None:
    body = {"model": "kvstore-sim", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}
    status, full = engine.post("/v1/chat/completions", body)
    assert status == 200 and full["object"] == "chat.completion"
    message = full["choices"][0]["message"]
    assert message["role"] == "assistant" and message["content"].count(" t") == 4

    status, chunks = engine.post("/v1/chat/completions", {**body, "stream": True})
    assert status == 200 and all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == message["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_models_health_and_metrics_counters_move(engine: MockEngine) -> None:
    assert engine.get("/health")[0] == 200
    models = json.loads(engine.get("/v1/models")[1])
    assert [m["id"] for m in models["data"]] == ["kvstore-sim"]
    before = engine.metrics()
    assert before["vllm:num_requests_waiting"] == 0 and before["vllm:num_requests_running"] == 0
    for _ in range(2):
        assert engine.post("/v1/completions", _completion(PROMPT, 3))[0] == 200
    after = engine.metrics()
    assert after["vllm:prefix_cache_queries_total"] - before.get("vllm:prefix_cache_queries_total", 0) == 2 * len(
        PROMPT
    )
    assert after["vllm:prefix_cache_hits_total"] - before.get("vllm:prefix_cache_hits_total", 0) == 2 * BLOCK
    assert after["vllm:generation_tokens_total"] == before.get("vllm:generation_tokens_total", 0) + 6
    assert after["vllm:request_prompt_tokens_sum"] == 2 * len(PROMPT)
    assert after['vllm:prompt_tokens_by_source_total{source="local_cache_hit"}'] == 2 * BLOCK
    assert after["vllm:iteration_tokens_total_count"] >= 6  # a prefill step, then a decode step per token


def test_kv_events_reach_the_conductors_index_and_reset_clears_them(engine: MockEngine) -> None:
    from kvstore.conductor.cacheindex import FleetCacheIndex
    from kvstore.conductor.subscriber import KVEventSubscriber

    index = FleetCacheIndex()
    sub = KVEventSubscriber("sim0", engine.events, index, replay=engine.replay, block_size=BLOCK)
    try:
        wait_for(lambda: sub.connected, 10, "the subscriber to connect")
        assert index.match(PROMPT)["sim0"] == 0
        assert engine.post("/v1/completions", _completion(PROMPT, 2))[0] == 200
        wait_for(lambda: index.match(PROMPT)["sim0"] == 2 * BLOCK, 10, "the prompt's two blocks credited")
        assert index.match(PROMPT[:BLOCK] + [7] * BLOCK)["sim0"] == BLOCK  # a shared first block only
        assert sub.errors == 0 and index.counts("sim0")["malformed"] == 0

        assert (
            urllib.request.urlopen(urllib.request.Request(engine.url + "/reset_prefix_cache", data=b"")).status == 200
        )
        wait_for(lambda: index.match(PROMPT)["sim0"] == 0, 10, "AllBlocksCleared to clear the view")
        # the engine's cache itself is empty: the prompt is computed again
        usage = engine.post("/v1/completions", _completion(PROMPT, 1))[1]["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    finally:
        sub.close()


def test_a_late_subscriber_gets_what_the_engine_holds_by_replay(engine: MockEngine) -> None:
    from kvstore.conductor.cacheindex import FleetCacheIndex
    from kvstore.conductor.subscriber import KVEventSubscriber

    assert engine.post("/v1/completions", _completion(PROMPT, 2))[0] == 200  # before anyone listens
    index = FleetCacheIndex()
    sub = KVEventSubscriber("sim0", engine.events, index, replay=engine.replay, block_size=BLOCK)
    try:
        wait_for(lambda: sub.connected, 10, "the subscriber to connect")
        other = list(range(5000, 5000 + BLOCK + 1))
        assert engine.post("/v1/completions", _completion(other, 2))[0] == 200  # a live batch triggers the replay
        wait_for(lambda: index.match(PROMPT)["sim0"] == 2 * BLOCK, 10, "the earlier prompt credited by replay")
        assert index.match(other)["sim0"] == BLOCK
    finally:
        sub.close()


def test_a_client_that_goes_away_mid_stream_aborts_its_request(engine: MockEngine) -> None:
    import http.client
    from urllib.parse import urlsplit

    u = urlsplit(engine.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
    body = _completion(PROMPT, 7000, stream=True)  # half a minute of decoding at this speed
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data:")  # decoding
    assert engine.metrics()["vllm:num_requests_running"] == 1
    conn.sock.shutdown(2)  # type: ignore[union-attr]
    conn.close()
    wait_for(lambda: engine.metrics()["vllm:num_requests_running"] == 0, 10, "the request to be aborted")
    assert engine.metrics()["vllm:request_success_total"] == 0  # aborted, not finished
    assert engine.post("/v1/completions", _completion(PROMPT, 1))[0] == 200


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        (None, 400, "not JSON"),
        ({"model": "kvstore-sim"}, 400, "'prompt' must be"),
        (_completion([1, 2, 10**9], 2), 400, "out of vocabulary"),
        (_completion([], 2), 400, "must be"),
        (_completion(PROMPT, 0), 400, "max_tokens must be an integer >= 1"),
        (_completion(PROMPT, 10**6), 400, "maximum context length"),
        (_completion(PROMPT, 2, n=2), 400, "n > 1"),
        (_completion([PROMPT, PROMPT], 2), 400, "batched prompts"),
        (_completion(PROMPT, 2, min_tokens=3), 400, "min_tokens"),
        (_completion(PROMPT, 2, stream_options={"include_usage": True}), 400, "stream=True"),
        ({**_completion(PROMPT, 2), "model": "other"}, 404, "does not exist"),
    ],
)
def test_bad_input_gets_vllms_error_and_the_engine_serves_on(
    engine: MockEngine, body: Any, status: int, says: str
) -> None:
    got, answer = engine.post("/v1/completions", body, raw=b"{not json" if body is None else None)
    assert got == status
    assert says in answer["error"]["message"] and answer["error"]["code"] == status
    assert engine.post("/v1/completions", _completion(PROMPT, 1))[0] == 200


def test_bad_chat_input_gets_400(engine: MockEngine) -> None:
    for messages in ([], [{"content": "no role"}], [{"role": "user", "content": [{"type": "image_url"}]}]):
        status, answer = engine.post("/v1/chat/completions", {"messages": messages})
        assert status == 400 and answer["error"]["type"] == "BadRequestError", messages


def test_a_cache_too_small_for_max_model_len_fails_at_start() -> None:
    with pytest.raises(AssertionError, match="more than the KV cache holds"):
        MockEngine("--num-gpu-blocks", "4", "--max-model-len", "4096")


def test_bench_serving_engine_sim_runs_baseline_and_conductor(tmp_path: Path) -> None:
    from kvstore.cluster.local_etcd import find_etcd

    # the conductor configuration registers its engines in etcd (scripts/setup.sh installs it)
    assert find_etcd() is not None, "etcd is not installed: run scripts/setup.sh"
    cmd = [sys.executable, "-m", "kvstore", "bench", "serving", "--engine", "sim", "--engines", "4"]
    cmd += ["--configs", "baseline,conductor", "--requests", "8", "--warmup", "1", "--json"]
    cmd += ["--log-dir", str(tmp_path / "logs"), "--records", str(tmp_path / "records.jsonl")]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert {"trace", "scaling", "slo", "configs", "fleets", "failures", "cpus", "model"} <= set(result)
    assert result["failures"] == []
    for name in ("baseline", "conductor"):
        c = result["configs"][name]
        assert (c["requests"], c["completed"], c["errors"], c["rejected"]) == (8, 8, 0, 0), c
        assert c["ttft_ms"]["p50"] > 0 and c["prompt_tokens"]["total"] > 0
        assert len(result["fleets"][name]["engines"]) == 4
    conductor = result["configs"]["conductor"]
    assert conductor["tokens_equal_baseline"] == 1.0  # token ids depend on the prompt alone
    assert sum(conductor["routing"]["decisions_per_engine"].values()) >= 8
    records = [json.loads(x) for x in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert len(records) == 16 and all(r["error"] is None for r in records)


# -- the pool: mock engines moving scaled-down KV through real kvstore nodes ----------------------
CHUNK = 2 * BLOCK  # the connector's default chunk for the local profile's 128-token blocks
THREE_CHUNKS = list(range(3000, 3000 + 3 * CHUNK + 10))  # 6 full blocks, all of them loadable


def _step(model: Any, link: Any, now: float, rid: str | None = None, tokens: list[int] | None = None) -> Any:
    """One step of an engine model with its pool link, as the live engine drives them."""
    from kvstore.sim.live import prompt_block_hashes

    if rid is not None and tokens is not None:
        hashes = prompt_block_hashes(tokens, BLOCK, b"m")
        model.add_request(rid, len(tokens), hashes, 1, now)
        link.arrived(rid, tokens, hashes)
    res = model.step(now)
    link.step_started(res)
    link.step_ended(res)
    return res


def test_the_pool_link_misses_saves_loads_pulls_and_turns_a_dead_node_into_misses(node_factory: Any) -> None:
    import time

    from client import KVClient, chunk_keys
    from kvstore.sim.engine import EngineModel
    from kvstore.sim.live_pool import LinkSettings, PoolLink, payload
    from kvstore.sim.profile import EngineProfile

    n1 = node_factory("--dram", "16MiB", "--nvme", "0")
    n2 = node_factory("--dram", "16MiB", "--nvme", "0")
    profile = EngineProfile.load("local")
    a = PoolLink(profile, "m", LinkSettings(n1.unix, kv_scale=64, deadline_s=1.0))
    b = PoolLink(profile, "m", LinkSettings(n2.unix, (n2.unix, n1.unix), kv_scale=64, deadline_s=1.0))

    def engine(link: PoolLink) -> EngineModel:
        return EngineModel(profile, rng=random.Random(0), lookup_external=link.lookup_external)  # local's jitter

    try:
        assert a.chunk_bytes == 8192 * CHUNK // 64
        assert a.view.wait_synced(30) and b.view.wait_synced(30)
        keys = chunk_keys(THREE_CHUNKS, a.namespace)
        assert len(keys) == 3

        # nothing stored: a miss, the prompt computed, its three full chunks saved into node 1
        res = _step(engine(a), a, 0.0, "r1", THREE_CHUNKS)
        assert [(x.cached_tokens, x.external_tokens) for x in res.admitted] == [(0, 0)]
        wait_for(a.idle, 10, "node 1's saves")
        c = a.counters()
        assert (c["view_lookups"], c["loads"], c["save_chunks"], c["save_refused"]) == (1, 0, 3, 0), c
        with KVClient(n1.unix) as kv:
            assert kv.lookup(keys) == ["dram"] * 3
            assert [kv.get(k) for k in keys] == [payload(k, a.chunk_bytes) for k in keys]

        # an engine on node 2 finds them on node 1 (network: loaded while it steps on), pulls and checks them
        wait_for(lambda: b.view.match(keys).hits == 3, 10, "node 2's view to see node 1's chunks")
        res = _step(engine(b), b, 1.0, "r2", THREE_CHUNKS)
        assert [x.external_tokens for x in res.loads_started] == [3 * CHUNK] and not res.admitted
        wait_for(b.idle, 10, "node 2's load")
        c = b.counters()
        assert (c["loads"], c["load_tokens"], c["pulled_blocks"], c["load_errors"], c["load_mismatches"]) == (
            1,
            3 * CHUNK,
            3,
            0,
            0,
        ), c
        assert c["async_loads"] == 1 and c["save_chunks"] == 0  # found, so not saved again
        with KVClient(n2.unix) as kv:
            assert kv.lookup(keys) == ["dram"] * 3

        # a fresh engine on node 1 loads them from its own DRAM, in the step that admits it
        res = _step(engine(a), a, 2.0, "r3", THREE_CHUNKS)
        assert [(x.cached_tokens, x.external_tokens) for x in res.admitted] == [(3 * CHUNK, 3 * CHUNK)]
        wait_for(a.idle, 10, "node 1's load")
        c = a.counters()
        assert (c["loads"], c["load_tokens"], c["load_errors"]) == (1, 3 * CHUNK, 0), c

        # a chunk whose bytes are not its key's payload is a miss for the rest of the hit
        other = list(range(9000, 9000 + CHUNK + 5))
        bad = chunk_keys(other, a.namespace)[0]
        with KVClient(n1.unix) as kv:
            assert kv.put(bad, b"\0" * a.chunk_bytes, namespace=a.namespace, token_count=CHUNK)
        wait_for(lambda: a.view.match([bad]).hits == 1, 10, "node 1's view to see the bad chunk")
        res = _step(engine(a), a, 3.0, "r4", other)
        assert [x.external_tokens for x in res.admitted] == [CHUNK]  # the model takes the hit the view promised
        wait_for(a.idle, 10, "the bad load")
        c = a.counters()
        assert (c["loads"], c["load_tokens"], c["load_mismatches"], c["load_errors"], c["view_stale_hits"]) == (
            2,
            3 * CHUNK,
            1,
            2,
            1,
        ), c

        # node 1 dies: its chunks are misses, its saves dropped, every call within its deadline
        n1.kill9()
        t0 = time.monotonic()
        _step(engine(a), a, 4.0, "r5", THREE_CHUNKS)  # the view may still list node 1's chunks
        wait_for(a.idle, 10, "the load from the dead node")
        _step(engine(a), a, 5.0, "r6", list(range(20000, 20000 + 2 * CHUNK + 1)))  # a miss, then a save
        wait_for(a.idle, 10, "the save to the dead node")
        assert time.monotonic() - t0 < 10
        c = a.counters()
        assert c["load_tokens"] == 3 * CHUNK and c["node_errors"] >= 1, c
        assert c["saves_dropped"] + c["lookups_node_down"] >= 1, c
        wait_for(lambda: a.view.match(keys).hits == 0, 20, "the view to drop the dead node")
        res = _step(engine(a), a, 6.0, "r7", THREE_CHUNKS)
        assert [x.external_tokens for x in res.admitted] == [0]  # a miss: computed
        t0 = time.monotonic()
        a.close()
        assert time.monotonic() - t0 < 10
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--kv-view", "127.0.0.1:1"], "--kv-view needs --kv-node"),
        (["--kv-node", "etcd://127.0.0.1:2379/c"], "--kv-node must be a node's"),
        (["--kv-node", "127.0.0.1:1", "--kv-scale", "0"], "--kv-scale must be at least 1"),
        (["--kv-node", "127.0.0.1:1", "--kv-deadline", "0"], "--kv-deadline must be positive"),
    ],
)
def test_bad_pool_flags_fail_at_start(args: list[str], says: str) -> None:
    with pytest.raises(AssertionError, match=says):
        MockEngine(*args)


def test_bench_serving_engine_sim_runs_pool_through_real_nodes(tmp_path: Path) -> None:
    from kvstore.cluster.local_etcd import find_etcd

    assert find_etcd() is not None, "etcd is not installed: run scripts/setup.sh"
    trace = tmp_path / "conversations.jsonl"
    gen = [sys.executable, "-m", "kvstore", "replay", "--generate", str(trace), "--requests", "24", "--seed", "7"]
    gen += ["--system-prompts", "3", "--think-time", "2"]  # turns that come back soon, over shared prompts
    subprocess.run(gen, cwd=ROOT, check=True, capture_output=True, timeout=60)
    cmd = [sys.executable, "-m", "kvstore", "bench", "serving", "--engine", "sim", "--engines", "2"]
    cmd += ["--configs", "baseline,pool", "--trace", str(trace), "--block-tokens", "64", "--max-output-tokens", "32"]
    cmd += ["--warmup", "1", "--json", "--log-dir", str(tmp_path / "logs")]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert result["failures"] == []
    for name in ("baseline", "pool"):
        c = result["configs"][name]
        assert (c["requests"], c["completed"], c["errors"], c["rejected"]) == (24, 24, 0, 0), c
        assert c["tokens_equal_baseline"] == 1.0  # token ids depend on the prompt alone
    base, pool = result["configs"]["baseline"]["prompt_tokens"], result["configs"]["pool"]["prompt_tokens"]
    assert base["store"] == 0 and pool["total"] == base["total"] > 0
    assert 0 < pool["store"] <= pool["total"] - pool["engine_cache"], pool
    assert pool["engine_cache"] + pool["store"] + pool["recomputed"] == pool["total"]
    blocks = result["configs"]["pool"]["store_blocks"]
    assert blocks["dram_reads"] > 0 and blocks["stored_bytes"] > 0, blocks
    connector = result["configs"]["pool"]["connector"]
    assert connector["load_mismatches"] == 0 and connector["save_chunks"] > 0, connector
    assert connector["load_tokens"] >= pool["store"]
    assert all(e["node"] for e in result["fleets"]["pool"]["engines"])
    assert not any(e["node"] for e in result["fleets"]["baseline"]["engines"])


def test_a_served_calibration_times_an_engine_through_its_openai_api(tmp_path: Path) -> None:
    """``kvstore sim calibrate --served`` drives an engine through its OpenAI server with the
    benchmark's client: pointed at a mock engine whose steps follow a known profile, its
    samples carry every kind of step, the server's cache config is read from ``/metrics``, and
    the fit finds the profile's per-token and per-sequence costs (loosely: these are real
    seconds on a shared machine; the constants are large beside the noise)."""
    import argparse

    from kvstore.bench.serving.fleet import Engine
    from kvstore.sim.calibrate import ServedEngine, fit, measure
    from kvstore.sim.profile import EngineProfile

    truth = {
        "overhead_ms": 25.0,
        "prefill_ms_per_token": 0.4,
        "prefill_attn_ms": 0.0,
        "decode_ms_per_seq": 2.0,
        "decode_ms_per_kv_token": 0.0,
    }
    prof = {**EngineProfile.load("local").to_dict(), **truth, "name": "calibrated-here", "block_size": 16}
    prof["num_gpu_blocks"] = 512
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(prof))
    e = MockEngine("--profile", str(path), "--model", "m")
    try:
        served = ServedEngine(Engine("mock", e.url, "both", "any"), "m")
        assert (served.block_size, served.num_blocks) == (16, 512)
        samples = measure(served, argparse.Namespace(seed=0, repeats=1, max_prefill=512))
    finally:
        e.close()
    kinds = {s["kind"] for s in samples}
    assert kinds == {"prefill", "prefill-cached", "decode"}, kinds
    c = fit(samples)["constants"]
    assert c["prefill_ms_per_token"] == pytest.approx(truth["prefill_ms_per_token"], rel=0.5), c
    assert c["overhead_ms"] >= 0.8 * truth["overhead_ms"], c  # the server adds to it, never takes away
    assert c["decode_ms_per_seq"] == pytest.approx(truth["decode_ms_per_seq"], rel=0.5), c

"""Mock engines (``kvstore sim serve``) as processes: vLLM's OpenAI API, /metrics, KV events
read by the conductor's own subscriber and index, and ``kvstore bench serving --engine sim``
over the real harness, conductor and etcd."""

from __future__ import annotations

import json
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
    from kvstore.conductor.kvevents import FleetCacheIndex, KVEventSubscriber

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
    from kvstore.conductor.kvevents import FleetCacheIndex, KVEventSubscriber

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

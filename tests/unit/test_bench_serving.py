"""``kvstore bench serving`` without vLLM: the workload it makes of a trace, the figures it
computes, and its client against a real HTTP server speaking the OpenAI streaming
protocol (an aiohttp server in a thread; the vLLM form is tests/vllm/test_serving_vllm.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvstore.bench.serving import report
from kvstore.bench.serving.fleet import Engine, engine_cpus, renice
from kvstore.bench.serving.front import PrefillDecode, RoundRobin
from kvstore.bench.serving.runner import Record, Replay, tbt
from kvstore.bench.serving.workload import Scaling, build, shared_block_ratio
from kvstore.errors import InvalidArgument

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT / "tests" / "data" / "mooncake_synthetic_trace.jsonl"
REJECT_FIRST_TOKEN = 7  # the server below answers 429 to prompts starting with this token


def _lines(tmp_path: Path, rows: list[object]) -> Path:
    p = tmp_path / "trace.jsonl"
    p.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return p


# -- workload -------------------------------------------------------------------------


def test_equal_hash_ids_give_equal_tokens_and_the_salt_changes_them(tmp_path: Path) -> None:
    t = _lines(
        tmp_path,
        [
            {"timestamp": 0, "input_length": 1024, "output_length": 10, "hash_ids": [1, 2]},
            {"timestamp": 5, "input_length": 1500, "output_length": 10, "hash_ids": [1, 2, 3]},
            {"timestamp": 9, "input_length": 600, "output_length": 10, "hash_ids": [4, 5]},
        ],
    )
    w = build(t, Scaling(block_tokens=16))
    a, b, c = (x.tokens for x in w.items)
    assert len(a) == 32 and len(b) == 32 + round((1500 - 1024) * 16 / 512) and len(c) == 16 + round(88 * 16 / 512)
    assert b[:32] == a  # a shared prefix is the same tokens
    assert c[:16] != a[:16]
    other = build(t, Scaling(block_tokens=16, salt="another"))
    assert other.items[0].tokens != a
    assert all(1 <= tok < 32000 for x in w.items for tok in x.tokens)


def test_scaling_of_lengths_and_arrivals(tmp_path: Path) -> None:
    t = _lines(
        tmp_path,
        [{"timestamp": 1000 * i, "input_length": 512, "output_length": 512, "hash_ids": [i]} for i in range(5)],
    )
    w = build(t, Scaling(block_tokens=32, min_output_tokens=4))
    assert [x.output_tokens for x in w.items] == [32] * 5  # scaled with the input
    assert [x.arrival_s for x in w.items] == [0.0, 1.0, 2.0, 3.0, 4.0]
    w = build(t, Scaling(block_tokens=32, time_scale=0.5, output_scale=0.001, min_output_tokens=3))
    assert [x.arrival_s for x in w.items] == [0.0, 0.5, 1.0, 1.5, 2.0]
    assert [x.output_tokens for x in w.items] == [3] * 5
    w = build(t, Scaling(block_tokens=32, rate=4.0, requests=3, max_output_tokens=10))
    assert len(w.items) == 3 and w.items[-1].arrival_s == pytest.approx(0.5)
    assert [x.output_tokens for x in w.items] == [10] * 3
    w = build(t, Scaling(block_tokens=32, window=(1.0, 3.0)))
    assert [x.hash_ids for x in w.items] == [(1,), (2,)]


def test_a_sample_keeps_whole_prefix_trees_and_the_traces_reuse() -> None:
    full = build(TRACE, Scaling(block_tokens=16))
    w = build(TRACE, Scaling(block_tokens=16, sample=0.05))
    assert 100 < len(w.items) < 400
    roots = {x.hash_ids[0] for x in w.items}
    assert sum(1 for x in full.items if x.hash_ids[0] in roots) == len(w.items)
    # the sample keeps the reuse of the whole trace, where a prefix of the trace has little
    assert shared_block_ratio([x.hash_ids for x in w.items]) > 0.5
    assert shared_block_ratio([x.hash_ids for x in full.items[: len(w.items)]]) < 0.2
    unique = build(TRACE, Scaling(block_tokens=16, sample=0.05, unique=True))
    assert shared_block_ratio([x.hash_ids for x in unique.items]) == 0.0
    assert [len(x.tokens) for x in unique.items] == [len(x.tokens) for x in w.items]


def test_bad_lines_are_skipped_and_named(tmp_path: Path) -> None:
    t = _lines(
        tmp_path,
        [
            {"timestamp": 0, "input_length": 512, "output_length": 3, "hash_ids": [1]},
            {"timestamp": 1, "output_length": 3, "hash_ids": [1]},
            "{not json",
            {"timestamp": 2, "input_length": "many", "hash_ids": [1]},
            {"timestamp": 3, "input_length": 512, "output_length": 3, "hash_ids": [2]},
        ],
    )
    w = build(t, Scaling())
    assert len(w.items) == 2
    assert [s.split(": ")[0].rsplit(" ", 1)[-1] for s in w.skipped] == ["2", "3", "4"]
    assert "input_length" in w.skipped[0] and "JSON" in w.skipped[1]
    with pytest.raises(InvalidArgument, match="no request"):
        build(_lines(tmp_path, ["{not json"]), Scaling())
    with pytest.raises(InvalidArgument, match="--sample"):
        Scaling(sample=1.5)
    with pytest.raises(InvalidArgument, match="--rate"):
        Scaling(rate=0)


def test_engine_cpus_are_the_same_split_for_every_configuration() -> None:
    assert engine_cpus(2, [0, 1]) == ["0", "1"]
    assert engine_cpus(2, [0, 1, 2, 3]) == ["0,1", "2,3"]
    assert engine_cpus(3, [0, 1]) == ["0", "1", "0"]


# -- figures --------------------------------------------------------------------------


def test_tbt_is_the_mean_of_the_slowest_tenth_of_intervals() -> None:
    assert tbt([]) is None
    assert tbt([5.0]) == 5.0
    assert tbt([1.0] * 18 + [10.0, 30.0]) == 20.0  # 20 intervals: the slowest 2
    assert tbt([1.0] * 20 + [9.0]) == pytest.approx((9 + 1 + 1) / 3)  # 21 intervals: the slowest 3


def _rec(i: int, ttft: float, itl: list[float], tokens: list[int], **kw: object) -> Record:
    r = Record("x", i, float(i), 10, len(tokens), ttft_ms=ttft, itl_ms=itl, tokens=tokens, **kw)  # type: ignore[arg-type]
    r.e2e_ms = ttft + sum(itl)
    return r


def test_goodput_counts_only_requests_within_both_targets() -> None:
    recs = [
        _rec(0, 100, [10, 10], [1, 2, 3]),
        _rec(1, 3000, [10, 10], [1, 2, 3]),  # TTFT misses
        _rec(2, 100, [10, 500], [1, 2, 3]),  # TBT misses
        _rec(3, 100, [10, 10], [1, 2, 4]),  # tokens differ from the baseline
        Record("x", 4, 4.0, 10, 3, error="engine-1: HTTP 500: boom"),
        Record("x", 5, 5.0, 10, 3, error="engine-1: HTTP 429: busy", rejected=True),
    ]
    base = [_rec(i, 100, [10, 10], [1, 2, 3]) for i in range(4)]
    s = report.summarise(recs, slo_ttft_ms=2000, slo_tbt_ms=200, baseline=base, greedy=True)
    assert (s["requests"], s["completed"], s["errors"], s["rejected"]) == (6, 4, 1, 1)
    # first arrival to the last answer of any kind: request 5's refusal at 5 s (a front that
    # refuses the end of a trace does not shorten the time it served the rest in)
    makespan = 5.0
    assert s["goodput_rps"] == pytest.approx(2 / makespan, rel=1e-3)
    assert s["tokens_equal_baseline"] == 0.75
    assert s["ttft_ms"]["p50"] == 100.0
    assert s["tbt_ms"]["p99"] == pytest.approx(float(np.percentile([10, 10, 500, 10], 99)), rel=1e-3)
    assert (
        report.summarise(recs, slo_ttft_ms=2000, slo_tbt_ms=200, baseline=base, greedy=False)["tokens_equal_baseline"]
        is None
    )


def test_prompt_sources_from_engine_counters() -> None:
    before = {"e0": {"vllm:request_prompt_tokens_sum": 100.0, "vllm:request_prefill_kv_computed_tokens_sum": 90.0}}
    after = {
        "e0": {
            "vllm:request_prompt_tokens_sum": 1100.0,
            "vllm:request_prefill_kv_computed_tokens_sum": 390.0,
            "vllm:external_prefix_cache_hits_total": 500.0,
        }
    }
    assert report.prompt_sources(before, after) == {
        "engine_cache": 200,
        "store": 500,
        "recomputed": 300,
        "total": 1000,
    }
    assert report.prompt_sources({}, {"e0": {}})["store"] is None  # an engine that did not answer
    counters = report.connector_counters(
        {"e0": {"vllm:kvstore_loads_total": 2.0}},
        {"e0": {"vllm:kvstore_loads_total": 5.0, "vllm:kvstore_handoff_timeouts_total": 1.0, "vllm:other_total": 9}},
    )
    assert counters == {"handoff_timeouts": 1, "loads": 3}


# -- the client against a real streaming server ----------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class StreamingServer:
    """An OpenAI-style completions server: one token a chunk, ``token_ids`` the prompt's
    first tokens; 429 for prompts starting with REJECT_FIRST_TOKEN; ``/metrics`` counts."""

    def __init__(self) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.prompt_tokens = 0
        self.seen: list[dict[str, object]] = []
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        assert self._ready.wait(10)

    def _serve(self) -> None:
        from aiohttp import web

        async def models(_: web.Request) -> web.Response:
            return web.json_response({"data": [{"id": "fake-model"}]})

        async def metrics(_: web.Request) -> web.Response:
            return web.Response(text=f"vllm:request_prompt_tokens_sum {self.prompt_tokens}\n")

        async def completions(req: web.Request) -> web.StreamResponse:
            body = await req.json()
            self.seen.append(body)
            prompt = body["prompt"]
            if prompt[0] == REJECT_FIRST_TOKEN:
                return web.json_response({"error": "busy"}, status=429)
            self.prompt_tokens += len(prompt)
            if not body.get("stream"):
                return web.json_response(
                    {"choices": [{"token_ids": [prompt[0]]}], "kv_transfer_params": {"kvstore": {"saved": 1}}}
                )
            resp = web.StreamResponse()
            await resp.prepare(req)
            for i in range(body["max_tokens"]):
                await asyncio.sleep(0.002)
                chunk = {"choices": [{"index": 0, "text": "", "token_ids": [prompt[i % len(prompt)]]}]}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            return resp

        app = web.Application()
        app.router.add_get("/v1/models", models)
        app.router.add_get("/metrics", metrics)
        app.router.add_post("/v1/completions", completions)
        asyncio.set_event_loop(self._loop)
        runner = web.AppRunner(app)
        self._loop.run_until_complete(runner.setup())
        self._loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self._loop.run_forever()

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


@pytest.fixture
def server() -> Iterator[StreamingServer]:
    s = StreamingServer()
    yield s
    s.close()


def _workload(n: int, *, reject: set[int] = frozenset()) -> object:  # type: ignore[assignment]
    from kvstore.bench.serving.workload import Work, Workload

    items = tuple(
        Work(i, 0.01 * i, ((REJECT_FIRST_TOKEN,) if i in reject else (100 + i,)) + (5,) * 20, 6, (i,)) for i in range(n)
    )
    return Workload("inline", Scaling(), items, ())


def test_the_client_times_every_streamed_token_and_counts_rejections(server: StreamingServer) -> None:
    e = Engine("fake", server.url, "both", "0")
    recs = Replay("baseline", _workload(6, reject={2}), RoundRobin([e]), model="fake-model").run()  # type: ignore[arg-type]
    assert [r.ok for r in recs] == [True, True, False, True, True, True]
    assert recs[2].rejected and recs[2].status == 429 and "HTTP 429" in (recs[2].error or "")
    for r in recs:
        if r.ok:
            assert len(r.tokens) == 6 and len(r.itl_ms) == 5 and r.ttft_ms is not None and r.ttft_ms > 0
            assert r.tokens[0] == 100 + r.index
    body = server.seen[0]
    assert body["stream"] is True and body["temperature"] == 0 and body["ignore_eos"] is True
    assert body["return_token_ids"] is True and body["max_tokens"] == 6


def test_prefill_decode_passes_the_prefill_answers_kv_transfer_params(server: StreamingServer) -> None:
    p = Engine("p", server.url, "prefill", "0")
    d = Engine("d", server.url, "decode", "1")
    recs = Replay("pd", _workload(2), PrefillDecode([p, d]), model="fake-model").run()  # type: ignore[arg-type]
    assert all(r.ok and r.prefill_engine == "p" and r.engine == "d" for r in recs)
    prefills = [b for b in server.seen if not b["stream"]]
    decodes = [b for b in server.seen if b["stream"]]
    assert len(prefills) == 2 and all(b["max_tokens"] == 1 for b in prefills)
    assert all(b["kv_transfer_params"] == {"kvstore": {"saved": 1}} for b in decodes)


def test_an_engine_that_stops_answering_is_named_and_skipped(server: StreamingServer) -> None:
    dead = Engine("gone", f"http://127.0.0.1:{_free_port()}", "both", "1")  # nothing listens there
    live = Engine("fake", server.url, "both", "0")
    rep = Replay("pool", _workload(6), RoundRobin([dead, live]), model="fake-model")  # type: ignore[arg-type]
    recs = rep.run()
    failed = [r for r in recs if not r.ok]
    assert len(failed) == 1 and "gone" in (failed[0].error or "")  # then the front skips it
    assert sum(r.ok for r in recs) == 5 and not dead.alive
    assert "gone" in rep.dead["gone"]


def test_the_command_against_a_target(server: StreamingServer, tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvstore",
            "bench",
            "serving",
            "--target",
            server.url,
            "--requests",
            "6",
            "--rate",
            "50",
            "--warmup",
            "1",
            "--json",
            "--records",
            str(tmp_path / "r.jsonl"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    c = r["configs"]["target"]
    assert (c["requests"], c["completed"], c["errors"]) == (6, 6, 0)
    for key in ("ttft_ms", "tbt_ms"):
        assert set(c[key]) == {"p50", "p90", "p99"}
    assert set(c["itl_ms"]) == {"p50", "p99"} and set(c["e2e_ms"]) == {"p50", "p99"}
    assert c["throughput_tok_s"] > 0 and c["goodput_rps"] > 0
    assert c["prompt_tokens"]["total"] == r["trace"]["prompt_tokens"]["total"]  # /metrics over the run, not the warm-up
    assert c["tokens_equal_baseline"] is None
    assert r["slo"] == {"ttft_ms": 2000.0, "tbt_ms": 200.0} and r["scaling"]["block_tokens"] == 16
    assert len((tmp_path / "r.jsonl").read_text().splitlines()) == 6
    assert "kvstore bench serving" in out.stderr  # the table


def test_a_target_that_does_not_answer_is_a_clear_error() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvstore", "bench", "serving", "--target", f"http://127.0.0.1:{_free_port()}"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert out.returncode == 2
    assert "does not answer" in out.stderr and "Traceback" not in out.stderr


def test_bad_options_are_clear_errors() -> None:
    for args, want in (
        (["--configs", "baseline,bogus"], "unknown configuration"),
        (["--sweep-rate", "1,x"], "--sweep-rate"),
        (["--trace", "/nonexistent/trace.jsonl"], "cannot read trace"),
        (["--connector-extra", "[1]"], "--connector-extra"),
    ):
        out = subprocess.run(
            [sys.executable, "-m", "kvstore", "bench", "serving", *args],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
        assert out.returncode == 2 and want in out.stderr and "Traceback" not in out.stderr, (args, out.stderr)


def test_a_rate_sweep_reports_goodput_per_step(server: StreamingServer, tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvstore",
            "bench",
            "serving",
            "--target",
            server.url,
            "--requests",
            "4",
            "--sweep-rate",
            "20,40",
            "--warmup",
            "0",
            "--json",
            "--plot",
            str(tmp_path / "p.png"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert [s["offered_rps"] for s in r["steps"]] == [20.0, 40.0]
    assert all(s["configs"]["target"]["completed"] == 4 for s in r["steps"])
    assert r["configs"]["target"] == r["steps"][-1]["configs"]["target"]
    assert r["capacity_goodput_rps"]["target"] > 0
    assert (tmp_path / "p.png").stat().st_size > 10_000


def test_sessions_reach_the_connector_and_their_closes_are_sent(server: StreamingServer, tmp_path: Path) -> None:
    t = _lines(
        tmp_path,
        [
            {"timestamp": 0, "input_length": 512, "output_length": 32, "hash_ids": [1], "session_id": "s1"},
            {"timestamp": 100, "input_length": 1024, "output_length": 32, "hash_ids": [1, 2], "session_id": "s1"},
            {"timestamp": 150, "close_session": "s1"},
            {"timestamp": 200, "input_length": 512, "output_length": 32, "hash_ids": [3]},
        ],
    )
    w = build(t, Scaling(block_tokens=16, time_scale=0.5))
    assert [x.session_id for x in w.items] == ["s1", "s1", None]
    assert w.closes == ((0.075, "s1"),)
    closed: list[str] = []
    e = Engine("fake", server.url, "both", "0")
    recs = Replay("pool", w, RoundRobin([e]), model="fake-model", on_close=closed.append).run()
    assert all(r.ok for r in recs) and closed == ["s1"]
    sent = [b.get("kv_transfer_params") for b in server.seen]
    assert sent == [{"session_id": "s1"}, {"session_id": "s1"}, None]


def test_renice_sets_every_thread_of_a_process() -> None:
    """The front's priority (``--front-nice``): Linux keeps a nice value per thread, so
    every thread a process already has is set, not only its first."""
    code = "import threading, time\n[threading.Thread(target=time.sleep, args=(30,), daemon=True).start() for _ in range(3)]\nprint('up', flush=True)\ntime.sleep(30)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
        assert renice(proc.pid, 7)
        tids = [int(t.name) for t in Path(f"/proc/{proc.pid}/task").iterdir()]
        assert len(tids) == 4 and {os.getpriority(os.PRIO_PROCESS, t) for t in tids} == {7}
    finally:
        proc.kill()
        proc.wait()

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
from kvstore.bench.serving.fleet import Engine, engine_cpus, pin_engine, renice
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
    assert report.prompt_sources(before, after) == {  # vLLM without prompt_tokens_by_source
        "engine_cache": 200,
        "store": 500,
        "recomputed": 300,
        "total": 1000,
        "store_failed": 0,
    }
    assert report.prompt_sources({}, {"e0": {}})["store"] is None  # an engine that did not answer
    counters = report.connector_counters(
        {"e0": {"vllm:kvstore_loads_total": 2.0}},
        {"e0": {"vllm:kvstore_loads_total": 5.0, "vllm:kvstore_handoff_timeouts_total": 1.0, "vllm:other_total": 9}},
    )
    assert counters == {"handoff_timeouts": 1, "loads": 3}
    per = report.connector_counters(
        {"e0": {}, "e1": {}},
        {
            "e0": {"vllm:kvstore_lookups_total": 4.0, "vllm:kvstore_lookup_pending_total": 6.0},
            "e1": {"vllm:kvstore_handoff_waits_total": 2.0, "vllm:kvstore_view_lookups_total": 12.0},
        },
        requests=8,
    )
    assert per is not None and per["deferred_per_request"] == 1.0 and per["lookup_rpcs_per_request"] == 0.5
    assert per["view_lookups"] == 12 and "view_lag_ms" not in per  # no view lag histogram
    # the view's lag over the run: its histogram's delta (10 samples under 2 ms, 1 of 10-15 ms)
    lag = "vllm:kvstore_view_lag_seconds_bucket"
    lagged = report.connector_counters(
        {"e0": {f'{lag}{{le="0.002"}}': 5.0, f'{lag}{{le="0.015"}}': 5.0, f'{lag}{{le="+Inf"}}': 5.0}},
        {
            "e0": {
                "vllm:kvstore_view_stale_hits_total": 2.0,
                f'{lag}{{le="0.002"}}': 15.0,
                f'{lag}{{le="0.015"}}': 16.0,
                f'{lag}{{le="+Inf"}}': 16.0,
                "vllm:kvstore_view_lag_seconds_count": 16.0,
                "vllm:kvstore_view_lag_seconds_sum": 0.05,
            }
        },
        requests=4,
    )
    assert lagged is not None and lagged["view_stale_hits"] == 2
    assert lagged["view_lag_ms"]["p50"] <= 2.0 and 2.0 < lagged["view_lag_ms"]["p99"] <= 15.0
    # what the nodes stored over the run and read back of it (a restarted node counts from 0)
    blocks = report.store_blocks(
        {"node0": {"stored_bytes": 1000, "read_back_bytes": 100, "get_hits_dram": 5}, "node1": {"stored_bytes": 900}},
        {"node0": {"stored_bytes": 3000, "read_back_bytes": 600, "get_hits_dram": 9}, "node1": {"stored_bytes": 200}},
        {},
        {},
    )
    assert blocks == {
        "dram_reads": 4,
        "nvme_reads": 0,
        "remote_pulls": 0,
        "stored_bytes": 2200,
        "read_back_bytes": 500,
    }


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
        self.extra_metrics = ""  # more exposition text for /metrics
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
            return web.Response(text=f"vllm:request_prompt_tokens_sum {self.prompt_tokens}\n" + self.extra_metrics)

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


BENCH_SERVING = (sys.executable, "-m", "kvstore", "bench", "serving")


def test_the_command_against_a_target(server: StreamingServer, tmp_path: Path) -> None:
    out = subprocess.run(
        [
            *BENCH_SERVING,
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
        (["--repeat", "0"], "--repeat must be at least 1"),
        (["--fault", "explode:node0@1"], "unknown action"),
        (["--fault", "kill:node5@1"], "the fleet has 2 node(s)"),
        (["--fault", "kill:node0@1", "--sweep-rate", "1,2"], "not with --sweep-rate"),
        (["--fault", "kill:node0@1", "--target", "http://127.0.0.1:9"], "not with --target"),
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
    met = [s["configs"]["target"]["slo_met"] >= 0.9 for s in r["steps"]]
    assert r["capacity_rps"]["target"] == (None if not met[0] else 20.0 if not met[1] else 40.0)
    assert (tmp_path / "p.png").stat().st_size > 10_000


def test_a_sweeps_capacity_is_the_highest_rate_with_nine_in_ten_within_the_slo(tmp_path: Path) -> None:
    """The knee the plot marks: the highest offered rate up to which every rate had >= 90 %
    within the SLO (a passing rate past a failing one is noise), None where the first failed."""
    from kvstore.bench.serving import report

    def step(rate: float, a: float, b: float) -> dict[str, object]:
        return {
            "offered_rps": rate,
            "configs": {n: {"slo_met": m, "goodput_rps": rate * m} for n, m in (("a", a), ("b", b))},
        }

    result = {
        "configs": {"a": {}, "b": {}},
        "steps": [step(1, 1.0, 0.5), step(2, 0.95, 0.4), step(4, 0.5, 0.1), step(8, 0.9, 0.0)],
        "slo": {"ttft_ms": 1000},
    }
    assert report.sweep_capacity(result) == {"a": 2, "b": None}
    result["steps"][2]["configs"]["a"]["slo_met"] = 0.92
    assert report.sweep_capacity(result) == {"a": 8, "b": None}
    report.plot(result, [], str(tmp_path / "knee.png"))
    assert (tmp_path / "knee.png").stat().st_size > 10_000


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


def test_a_close_due_after_the_last_request_is_not_waited_for(server: StreamingServer, tmp_path: Path) -> None:
    """A trace's closes come a while after a session's last turn; a slice's last sessions
    close long after its last request.  The replay does not wait for those (a 1,000-second
    wait once followed a 200-second replay): they are counted, not sent."""
    t = _lines(
        tmp_path,
        [
            {"timestamp": 0, "input_length": 512, "output_length": 8, "hash_ids": [1], "session_id": "s1"},
            {"timestamp": 40, "close_session": "s1"},
            {"timestamp": 100, "input_length": 512, "output_length": 8, "hash_ids": [2], "session_id": "s2"},
            {"timestamp": 600_000, "close_session": "s2"},
        ],
    )
    w = build(t, Scaling(block_tokens=16))
    assert w.closes == ((0.04, "s1"), (600.0, "s2"))
    closed: list[str] = []
    rep = Replay("pool", w, RoundRobin([Engine("fake", server.url, "both", "0")]), model="m", on_close=closed.append)
    recs = rep.run()
    assert all(r.ok for r in recs) and closed == ["s1"] and rep.closes_skipped == 1
    assert rep.wall_s < 600  # a hang guard: the replay ended with its requests


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


def test_pin_engine_pins_every_thread_of_the_engines_processes_but_its_workers() -> None:
    """An engine's server and engine core (here a parent with threads and a child) go to
    its worker's CPUs, thread by thread; a process named like vLLM's worker keeps its own
    binding; an engine with no CPU list of its own is left alone."""
    cpus = sorted(os.sched_getaffinity(0))
    code = (
        "import os, subprocess, sys, threading, time\n"
        "WORKER = os.environ['WORKER']\n"
        "[threading.Thread(target=time.sleep, args=(30,), daemon=True).start() for _ in range(2)]\n"
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])\n"
        "w = subprocess.Popen([sys.executable, '-c', WORKER])\n"
        "while open(f'/proc/{w.pid}/comm').read().strip() != 'VLLM::Worker': time.sleep(0.01)\n"
        "print(c.pid, w.pid, flush=True)\n"
        "time.sleep(30)"
    )
    # vLLM names its worker processes (the kernel's comm, what psutil's name() reads)
    worker_code = "import ctypes, time; ctypes.CDLL(None).prctl(15, b'VLLM::Worker', 0, 0, 0); time.sleep(30)"
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env={**os.environ, "WORKER": worker_code}
    )
    try:
        assert proc.stdout is not None
        child, worker = (int(x) for x in proc.stdout.readline().split())
        e = Engine("e0", "http://127.0.0.1:1", "both", str(cpus[-1]), proc=proc)
        assert pin_engine(e)
        for pid in (proc.pid, child):
            tids = [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
            assert {frozenset(os.sched_getaffinity(t)) for t in tids} == {frozenset({cpus[-1]})}, pid
        assert os.sched_getaffinity(worker) == set(cpus)  # vLLM bound its workers already
        assert not pin_engine(Engine("e1", "http://127.0.0.1:1", "both", "any", proc=proc))
    finally:
        proc.kill()
        proc.wait()


# -- the connector's histograms: scrape, percentiles, connector_ms ------------------------

# the connector's bounds (gpu_agent/vllm/stats.py BUCKETS, which imports vLLM): seconds, 50 µs to 10 s
BUCKETS = tuple(m * 10.0**e for e in range(-5, 1) for m in (1, 1.5, 2, 3, 5, 7) if 5e-5 <= m * 10.0**e <= 7) + (10.0,)
LABELS = ["model_name", "engine"]


def _registry() -> tuple[object, dict[str, object]]:
    from prometheus_client import CollectorRegistry, Counter, Histogram

    reg = CollectorRegistry()
    metrics: dict[str, object] = {
        p: Histogram(f"vllm:kvstore_{p}_seconds", p, LABELS, buckets=BUCKETS, registry=reg)
        for p in ("lookup", "load_wait")
    }
    metrics["load_tokens"] = Counter("vllm:kvstore_load_tokens", "tokens", LABELS, registry=reg)
    metrics["by_source"] = Counter("vllm:prompt_tokens_by_source", "by source", [*LABELS, "source"], registry=reg)
    return reg, metrics


def _text(reg: object) -> str:
    from prometheus_client import generate_latest

    return generate_latest(reg).decode()  # type: ignore[arg-type]


def test_scrape_keeps_histogram_buckets_apart(server: StreamingServer) -> None:
    """A real prometheus_client exposition (two engines' label sets) through fleet.scrape:
    buckets by bound, counters and everything else summed over labels as before."""
    from kvstore.bench.serving.fleet import parse_metrics, scrape

    reg, m = _registry()
    for engine, xs in (("0", [0.0012, 0.004]), ("1", [0.0012, 20.0])):
        for x in xs:
            m["lookup"].labels("kvstore-bench", engine).observe(x)  # type: ignore[attr-defined]
        m["load_tokens"].labels("kvstore-bench", engine).inc(100)  # type: ignore[attr-defined]
        m["by_source"].labels("kvstore-bench", engine, "local_cache_hit").inc(7)  # type: ignore[attr-defined]
        m["by_source"].labels("kvstore-bench", engine, "local_compute").inc(3)  # type: ignore[attr-defined]
    server.extra_metrics = _text(reg)
    got = scrape(server.url)
    assert got == parse_metrics(server.extra_metrics) | {"vllm:request_prompt_tokens_sum": 0.0}
    fam = "vllm:kvstore_lookup_seconds"
    assert f"{fam}_bucket" not in got  # never merged over bounds
    assert got[f'{fam}_bucket{{le="0.001"}}'] == 0
    assert got[f'{fam}_bucket{{le="0.0015"}}'] == 2  # both engines' 1.2 ms
    assert got[f'{fam}_bucket{{le="0.005"}}'] == 3
    assert got[f'{fam}_bucket{{le="10.0"}}'] == 3 and got[f'{fam}_bucket{{le="+Inf"}}'] == 4
    assert len([k for k in got if k.startswith(f"{fam}_bucket")]) == len(BUCKETS) + 1
    assert got[f"{fam}_count"] == 4 and got[f"{fam}_sum"] == pytest.approx(0.0012 * 2 + 0.004 + 20.0)
    assert got["vllm:kvstore_load_tokens_total"] == 200  # a counter: summed over engines, as before
    assert got["vllm:prompt_tokens_by_source_total"] == 20  # the sum over sources stays
    assert got['vllm:prompt_tokens_by_source_total{source="local_cache_hit"}'] == 14
    assert got['vllm:prompt_tokens_by_source_total{source="local_compute"}'] == 6


def test_histogram_quantile_by_hand() -> None:
    inf = float("inf")
    b = [(0.001, 2.0), (0.002, 6.0), (0.005, 10.0), (inf, 10.0)]
    # rank 5 of 10: in (1 ms, 2 ms], 3 of its 4 observations in: 1 + 1 * 3/4 ms
    assert report.histogram_quantile(0.5, b) == pytest.approx(0.00175)
    assert report.histogram_quantile(0.99, b) == pytest.approx(0.002 + 0.003 * 3.9 / 4)
    assert report.histogram_quantile(0.1, b) == pytest.approx(0.0005)  # first bucket: from 0
    assert report.histogram_quantile(0.9, [(0.001, 1.0), (inf, 3.0)]) == 0.001  # in +Inf: the top finite bound
    assert report.histogram_quantile(0.5, [(0.001, 0.0), (inf, 0.0)]) is None  # empty
    assert report.histogram_quantile(0.5, [(0.001, 4.0), (0.002, 3.0), (inf, 4.0)]) == pytest.approx(0.0005)
    with pytest.raises(ValueError):
        report.histogram_quantile(0.5, [(0.001, 1.0)])


def test_connector_ms_over_the_run_from_prometheus_client_histograms() -> None:
    """Two engines' histograms made by prometheus_client from known samples; only what
    was observed between the two scrapes counts, summed over the engines."""
    from kvstore.bench.serving.fleet import parse_metrics

    regs = [_registry() for _ in range(2)]
    for _, m in regs:  # before the run: slow samples that must not count
        for _ in range(10):
            m["lookup"].labels("kvstore-bench", "0").observe(0.5)  # type: ignore[attr-defined]
    before = {f"e{i}": parse_metrics(_text(reg)) for i, (reg, _) in enumerate(regs)}
    run = {0: [0.0012] * 30 + [0.004] * 20, 1: [0.0012] * 30 + [0.004] * 19 + [20.0]}
    for i, (_, m) in enumerate(regs):
        for x in run[i]:
            m["lookup"].labels("kvstore-bench", "0").observe(x)  # type: ignore[attr-defined]
        m["load_wait"].labels("kvstore-bench", "0")  # a family present without samples in the run
    after = {f"e{i}": parse_metrics(_text(reg)) for i, (reg, _) in enumerate(regs)}
    got = report.connector_ms(before, after)
    assert got is not None and set(got) == {"lookup", "load_wait"}
    samples = run[0] + run[1]
    lookup = got["lookup"]
    assert lookup["count"] == 100
    assert lookup["mean"] == pytest.approx(float(np.mean(samples)) * 1e3, abs=1e-3)
    # rank 50 of 100: 60 samples in (1 ms, 1.5 ms], none below: 1 + 0.5 * 50/60 ms
    assert lookup["p50"] == pytest.approx(1 + 0.5 * 50 / 60, abs=1e-3)
    # rank 99: 60 up to 3 ms, 99 up to 5 ms: the top of (3 ms, 5 ms]
    assert lookup["p99"] == pytest.approx(5.0, abs=1e-3)
    # the samples' own median lies in the bucket the estimate came from
    assert 1.0 < float(np.median(samples)) * 1e3 <= 1.5
    assert got["load_wait"] == {"count": 0, "mean": None, "p50": None, "p99": None}
    assert report.connector_ms({"b": {}}, {"b": {"vllm:request_prompt_tokens_sum": 5.0}}) is None  # baseline


# -- prompt tokens by where they finally came from ----------------------------------------


def _engine(**counters: float) -> dict[str, float]:
    names = {
        "total": "vllm:request_prompt_tokens_sum",
        "computed": "vllm:request_prefill_kv_computed_tokens_sum",
        "external": "vllm:external_prefix_cache_hits_total",
        "local": 'vllm:prompt_tokens_by_source_total{source="local_cache_hit"}',
        "promised": 'vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}',
        "compute": 'vllm:prompt_tokens_by_source_total{source="local_compute"}',
        "loaded": "vllm:kvstore_load_tokens_total",
    }
    return {names[k]: v for k, v in counters.items()}


def test_prompt_tokens_count_each_token_once_when_loads_fail() -> None:
    """The fault run: vLLM's external hits counted 157,505 tokens for 41,061 prompt tokens
    (at allocation, and again at each re-admission); the connector loaded 20,000 of the
    30,000 it promised, so 10,000 were recomputed."""
    after = {
        "e0": _engine(
            total=41_061, computed=10_661, external=157_505, local=400, promised=30_000, compute=10_661, loaded=20_000
        )
    }
    got = report.prompt_sources({"e0": {}}, after)
    assert got == {"engine_cache": 400, "store": 20_000, "recomputed": 20_661, "total": 41_061, "store_failed": 10_000}
    # a tensor-parallel engine's workers each count the tokens they loaded
    got = report.prompt_sources({"e0": {}}, after, tp=2)
    assert (got["store"], got["recomputed"], got["store_failed"]) == (10_000, 30_661, 20_000)
    # before the connector exports its loads: what vLLM promised, counted once per request
    no_loads = {"e0": {k: v for k, v in after["e0"].items() if "kvstore" not in k}}
    assert report.prompt_sources({"e0": {}}, no_loads)["store"] == 30_000


def test_prompt_token_sources_always_add_up() -> None:
    rng = np.random.default_rng(5)
    for _ in range(500):
        total = float(rng.integers(0, 5000))
        counters = {
            k: float(rng.integers(0, 2 * int(total) + 2))
            for k in ("computed", "external", "local", "promised", "loaded")
            if rng.random() < 0.8
        }
        before = {"e0": _engine(total=float(rng.integers(0, 100)))}
        after = {"e0": _engine(total=before["e0"]["vllm:request_prompt_tokens_sum"] + total, **counters)}
        got = report.prompt_sources(before, after)
        assert got["engine_cache"] + got["store"] + got["recomputed"] == got["total"] == total, (counters, got)
        assert min(got["engine_cache"], got["store"], got["recomputed"], got["store_failed"]) >= 0, (counters, got)


# -- repeats ---------------------------------------------------------------------------


def test_repeated_runs_report_medians_ranges_and_pair_with_baselines_runs() -> None:
    def run(tokens: list[list[int]], ttft: float) -> list[Record]:
        return [_rec(i, ttft + i, [10, 10], t) for i, t in enumerate(tokens)]

    a, b = [[1, 2, 3], [4, 5, 6]], [[1, 2, 9], [4, 5, 9]]  # two baseline runs that differ (drift)
    runs = {"baseline": [run(a, 100), run(b, 300), run(a, 200)], "pool": [run(a, 50), run(b, 70), run(a, 60)]}
    extras = {"pool": [{"prompt_tokens": {"store": s}, "label": f"run{s}"} for s in (10, 30, 20)]}
    got = report.summarise_runs(runs, extras, slo_ttft_ms=2000, slo_tbt_ms=200, greedy=True)
    pool, base = got["pool"], got["baseline"]
    assert [r["tokens_equal_baseline"] for r in pool["runs"]] == [1.0, 1.0, 1.0]  # run i with baseline's run i
    assert [r["tokens_equal_baseline"] for r in base["runs"]] == [1.0, 0.0, 1.0]  # baseline's with its first
    assert pool["ttft_ms"]["p50"] == 60.5 and base["ttft_ms"]["p50"] == 200.5  # the medians, same keys
    assert pool["repeats"]["n"] == 3
    assert pool["repeats"]["ranges"]["ttft_ms.p50"] == [50.5, 70.5]
    assert pool["repeats"]["ranges"]["prompt_tokens.store"] == [10, 30]
    assert pool["prompt_tokens"]["store"] == 20 and isinstance(pool["prompt_tokens"]["store"], int)
    assert pool["label"] == "run10"  # not a number: the first run's
    assert {
        "ttft_ms.p90",
        "ttft_ms.p99",
        "tbt_ms.p50",
        "tbt_ms.p90",
        "tbt_ms.p99",
        "throughput_tok_s",
        "goodput_rps",
    } <= set(pool["repeats"]["ranges"])
    single = report.summarise_runs({"pool": runs["pool"][:1]}, {}, slo_ttft_ms=2000, slo_tbt_ms=200, greedy=True)
    assert "repeats" not in single["pool"] and "runs" not in single["pool"]


def test_the_command_repeats_each_configuration(server: StreamingServer, tmp_path: Path) -> None:
    out = subprocess.run(
        [*BENCH_SERVING, "--target", server.url, "--requests", "3", "--rate", "50", "--warmup", "0"]
        + ["--repeat", "3", "--json", "--records", str(tmp_path / "r.jsonl")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    c = json.loads(out.stdout)["configs"]["target"]
    assert c["repeats"]["n"] == 3 and len(c["runs"]) == 3
    assert all(r["completed"] == 3 for r in c["runs"]) and c["completed"] == 3
    p50s = [r["ttft_ms"]["p50"] for r in c["runs"]]
    assert c["ttft_ms"]["p50"] == pytest.approx(float(np.median(p50s)), abs=1e-3)
    assert c["repeats"]["ranges"]["ttft_ms.p50"] == [min(p50s), max(p50s)]
    recs = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert sorted({r["repeat"] for r in recs}) == [0, 1, 2] and len(recs) == 9
    assert "median of 3 runs" in out.stderr


# -- --sample on a conversation trace ---------------------------------------------------


def _generate(path: Path, *more: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "kvstore", "replay", "--generate", str(path), "--requests", "600", "--seed", "7"]
        + ["--system-prompts", "1", "--reuse", "1", "--one-shot", "0", *more],
        check=True,
        capture_output=True,
        timeout=120,
        cwd=ROOT,
    )


def test_a_sample_of_a_conversation_trace_keeps_whole_conversations(tmp_path: Path) -> None:
    """`kvstore replay --generate` with one shared system prompt: every request is in one
    prefix tree, so --sample keeps sessions (conversations) below it, or, without session
    ids, the subtrees below the shared prompt, which are the same conversations."""
    _generate(tmp_path / "conv.jsonl")
    _generate(tmp_path / "bare.jsonl", "--no-sessions")
    full = build(tmp_path / "conv.jsonl", Scaling(block_tokens=16))
    assert len({x.hash_ids[0] for x in full.items}) == 1  # the premise: one tree holds everything
    session_of = {x.hash_ids: x.session_id for x in full.items}
    sizes: dict[str | None, int] = {}
    for x in full.items:
        sizes[x.session_id] = sizes.get(x.session_id, 0) + 1
    for trace in ("conv.jsonl", "bare.jsonl"):
        for share in (0.1, 0.3, 0.6):
            w = build(tmp_path / trace, Scaling(block_tokens=16, sample=share))
            assert abs(len(w.items) / len(full.items) - share) < 0.1, (trace, share, len(w.items))
            assert w.summary()["sampled_by"] == "sessions and subtrees below a shared root"
            kept: dict[str | None, int] = {}
            for x in w.items:
                sid = session_of[x.hash_ids]
                kept[sid] = kept.get(sid, 0) + 1
            assert all(kept[sid] == sizes[sid] for sid in kept), (trace, share)  # whole conversations
            assert shared_block_ratio([x.hash_ids for x in w.items]) > 0.5  # with their reuse
        tiny = build(tmp_path / trace, Scaling(block_tokens=16, sample=1e-9))  # never empty, never an error
        assert 0 < len(tiny.items) < 20
    assert build(TRACE, Scaling(sample=0.05)).summary()["sampled_by"] == "prefix trees"


# -- faults ----------------------------------------------------------------------------


def test_fault_specs_parse_into_a_plan_and_bad_ones_are_clear_errors() -> None:
    from kvstore.bench.serving.fleet import Fault, parse_faults

    plan = parse_faults(["restart:node1@40,kill:node1@20", "kill:0@5.5"], nodes=2)
    assert plan == (Fault(5.5, 0, "kill"), Fault(20.0, 1, "kill"), Fault(40.0, 1, "restart"))
    assert plan[0].to_json() == {"action": "kill", "node": 0, "at_s": 5.5}
    assert parse_faults(["restart:node0@3"]) == (Fault(3.0, 0, "restart"),)  # a live node: stopped, started
    for spec, want in (
        ("explode:node1@2", "unknown action 'explode'"),
        ("kill:node1", "is not ACTION:NODE@SECONDS"),
        ("kill@3", "is not ACTION:NODE@SECONDS"),
        ("kill:nodeX@3", "must be nodeN or N"),
        ("kill:node1@soon", "is not a number"),
        ("kill:node1@-1", "zero or more seconds"),
        ("kill:node1@inf", "zero or more seconds"),
        ("kill:node2@1", "the fleet has 2 node(s)"),
        ("kill:node1@1,kill:node1@3", "while down"),
        ("kill:node1@1,restart:node1@1", "two actions on node1"),
        (",", "empty spec"),
    ):
        with pytest.raises(InvalidArgument, match=None) as e:
            parse_faults([spec], nodes=2)
        assert want in str(e.value), (spec, str(e.value))


def test_the_null_connector_fleet_runs_vllm_with_a_connector_and_no_node(tmp_path: Path) -> None:
    """``null-connector``: the same vLLM command as ``pool`` but kvstore's connector, with
    vLLM's connector path on (a KV connector configured) and no node, etcd or session ids."""
    from kvstore.bench.serving.cli import _configs
    from kvstore.bench.serving.fleet import NULL_CONNECTOR, Fleet, FleetSpec

    spec = FleetSpec(model="m", engines=2)
    null, base = Fleet("null-connector", spec, log_dir=tmp_path), Fleet("baseline", spec, log_dir=tmp_path)
    assert not null.uses_store and null.roles == ["both", "both"]
    cmd, ref = null._command(0, "both", 8000), base._command(0, "both", 8000)
    i = cmd.index("--kv-transfer-config")
    assert cmd[:i] == ref  # otherwise the very command baseline runs
    cfg = json.loads(cmd[i + 1])
    assert (cfg["kv_connector"], cfg["kv_connector_module_path"]) == NULL_CONNECTOR
    assert cfg["kv_role"] == "kv_both" and "kv_connector_extra_config" not in cfg
    mod, name = NULL_CONNECTOR[1], NULL_CONNECTOR[0]
    assert (ROOT / (mod.replace(".", "/") + ".py")).is_file() and f"class {name}(" in (
        ROOT / (mod.replace(".", "/") + ".py")
    ).read_text()
    # a reference: asked for by name, never in the default run
    assert "null-connector" not in _configs(None, None) and _configs("baseline,null-connector", None)[1]
    for c in (null, base):
        c.close()


def test_node_nice_is_checked_and_reaches_the_nodes_and_etcd(tmp_path: Path) -> None:
    """``--node-nice``: the fleet's nodes and etcd start at that nice value (set at exec)."""
    from kvstore.bench.serving.fleet import Fleet, FleetSpec

    with pytest.raises(InvalidArgument, match="--node-nice"):
        FleetSpec(model="", node_nice=20)
    with Fleet("pool", FleetSpec(model="", engines=1, node_nice=3), log_dir=tmp_path) as fleet:
        fleet._start_store()
        procs = [fleet.nodes[0].proc.pid, fleet._etcd.pid]
        for pid in procs:
            nices = {os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir(f"/proc/{pid}/task")}
            assert nices == {3}, (pid, nices)


def test_the_fault_scheduler_kills_and_restarts_a_fleets_node(tmp_path: Path) -> None:
    """A real `kvstore serve` started by the fleet's own node code (one node in a cluster
    over a private etcd): killed, then back on the same socket, arena and ports."""
    import time

    from client import KVClient
    from kvstore.bench.serving.fleet import FaultScheduler, Fleet, FleetSpec, parse_faults

    with Fleet("pool", FleetSpec(model="", engines=1), log_dir=tmp_path) as fleet:
        fleet._start_store()
        node = fleet.nodes[0]
        first = dict(node.endpoints)
        pid = node.proc.pid
        sched = FaultScheduler(fleet.nodes, parse_faults(["kill:node0@0,restart:node0@0.2"], nodes=1))
        sched.start(time.monotonic())
        assert sched.wait(120)
        res = sched.finish()
        assert [(r["action"], r["error"]) for r in res] == [("kill", None), ("restart", None)], res
        assert 0 <= res[0]["done_at_s"] <= res[1]["done_at_s"] and res[1]["at_s"] == 0.2
        assert node.proc.pid != pid and node.running()
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # the old process is gone (reaped)
        for k in ("unix", "grpc", "data", "arena", "node_id"):
            assert node.endpoints.get(k) == first.get(k), k
        with KVClient(node.target) as c:
            assert "counters" in c.stats()
        # an action the replay did not reach is reported, not carried out
        late = FaultScheduler(fleet.nodes, parse_faults(["kill:node0@3600"]))
        late.start(time.monotonic())
        (r,) = late.finish()
        assert r["done_at_s"] is None and "not carried out" in r["error"] and node.running()


def test_engine_steps_counts_vllms_iterations_and_request_phases_over_the_run() -> None:
    """vLLM's iteration and per-request phase histograms, as prometheus_client writes them:
    steps and tokens per step over the run, summed over engines; phases in ms."""
    from prometheus_client import CollectorRegistry, Histogram

    from kvstore.bench.serving.fleet import parse_metrics

    def engine() -> tuple[CollectorRegistry, Histogram, Histogram]:
        reg = CollectorRegistry()
        it = Histogram("vllm:iteration_tokens_total", "tokens", LABELS, buckets=[1, 8, 64, 512], registry=reg)
        q = Histogram("vllm:request_queue_time_seconds", "queue", LABELS, buckets=BUCKETS, registry=reg)
        return reg, it, q

    engines = [engine() for _ in range(2)]
    for _, it, _q in engines:
        it.labels("kvstore-bench", "0").observe(500)  # before the run: not counted
    before = {f"e{i}": parse_metrics(_text(reg)) for i, (reg, _, _) in enumerate(engines)}
    for i, (_, it, q) in enumerate(engines):
        for x in [2] * 9 + [300]:  # nine decode steps, one with a prefill
            it.labels("kvstore-bench", "0").observe(x)
        q.labels("kvstore-bench", "0").observe(0.004 * (i + 1))
    after = {f"e{i}": parse_metrics(_text(reg)) for i, (reg, _, _) in enumerate(engines)}
    got = report.engine_steps(before, after)
    assert got is not None
    assert got["steps"] == 20 and got["tokens_per_step"] == pytest.approx((9 * 2 + 300) / 10)
    assert got["queue_ms"]["mean"] == pytest.approx(6.0)
    assert "prefill_ms" not in got  # no engine exports it
    assert report.engine_steps({"b": {}}, {"b": {"vllm:request_prompt_tokens_sum": 5.0}}) is None


def test_the_conductors_bytes_per_token_are_the_served_models_own(tmp_path: Path) -> None:
    from kvstore.bench.serving.fleet import kv_bytes_per_token

    def model(**cfg: object) -> str:
        d = tmp_path / str(len(list(tmp_path.iterdir())))
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
        return str(d)

    llama8b = dict(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, hidden_size=4096)
    assert kv_bytes_per_token(model(**llama8b, torch_dtype="bfloat16")) == 128 << 10  # the conductor's default
    # the benchmark's CPU model (make_model: 4 layers, 8 query heads, 4 KV heads of 64, float32)
    tiny = dict(num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=64, hidden_size=512)
    assert kv_bytes_per_token(model(**tiny, torch_dtype="float32")) == 2 * 4 * 4 * 64 * 4
    assert kv_bytes_per_token(model(**{**tiny, "num_key_value_heads": None}, dtype="float16")) == 2 * 4 * 8 * 64 * 2
    assert kv_bytes_per_token(model(num_hidden_layers=4)) is None  # no heads: unknown, the default stays
    assert kv_bytes_per_token(str(tmp_path / "missing")) is None
    assert kv_bytes_per_token("meta-llama/Llama-3.1-8B") is None  # a hub name, not a directory

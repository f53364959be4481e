"""``kvstore conductor`` as a process, over engines that are processes: the OpenAI front,
bad input, engines that die or answer garbage, clients that go away, early rejection.

The engines here are stand-ins (tests/stand_in_engine.py) so that faults are exact and
quick; the conductor over real vLLM servers and the store is tested in tests/vllm."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore.cluster.local_etcd import free_port

ROOT = Path(__file__).resolve().parents[2]


def _get(url: str, timeout: float = 5.0) -> tuple[int, Any, dict[str, str]]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            raw = r.read()
            return r.status, _parse(raw), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, _parse(e.read()), dict(e.headers)


def _parse(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


def post(url: str, body: Any, timeout: float = 30.0) -> tuple[int, Any, dict[str, str]]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, _parse(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, _parse(e.read()), dict(e.headers)


def wait_http(url: str, timeout: float = 30.0, status: int = 200) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with contextlib.suppress(OSError):
            if _get(url, timeout=1.0)[0] == status:
                return
        time.sleep(0.05)
    raise AssertionError(f"{url} did not answer {status} within {timeout} s")


class Proc:
    def __init__(self, args: list[str], url: str, log: Path) -> None:
        self.args, self.url, self.log = args, url, log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Proc:
        self.proc = subprocess.Popen(
            self.args, stdout=self.log.open("ab"), stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True
        )
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()


def engine(tmp: Path, name: str, *extra: str) -> Proc:
    port = free_port("127.0.0.1")
    args = [sys.executable, str(ROOT / "tests" / "stand_in_engine.py"), "--port", str(port), *extra]
    p = Proc(args, f"http://127.0.0.1:{port}", tmp / f"{name}.log").start()
    wait_http(p.url + "/health")
    return p


def conductor(tmp: Path, engines: list[Proc], *extra: str, roles: list[str] | None = None, probe: float = 0.2) -> Proc:
    port = free_port("127.0.0.1")
    args = [sys.executable, "-m", "kvstore", "conductor", "--port", str(port), "--probe-s", str(probe), *extra]
    for i, e in enumerate(engines):
        args += ["--engine", e.url + (f"={roles[i]}" if roles else "")]
    p = Proc(args, f"http://127.0.0.1:{port}", tmp / "conductor.log").start()
    wait_http(p.url + "/health")
    return p


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    yield started
    for p in reversed(started):
        p.stop()


def state(c: Proc) -> dict[str, Any]:
    return _get(c.url + "/conductor/state")[1]


def completion(c: Proc, n: int = 64, seed: int = 1, **kw: Any) -> tuple[int, Any, dict[str, str]]:
    body = {"model": "stand-in", "prompt": [(seed * 7919 + i) % 30000 for i in range(n)], "max_tokens": 4, **kw}
    return post(c.url + "/v1/completions", body)


def seen(e: Proc) -> dict[str, Any]:
    return _get(e.url + "/stand-in")[1]


def test_routes_streaming_and_plain_requests_and_says_where_they_went(tmp_path: Path, procs: list[Proc]) -> None:
    a, b = engine(tmp_path, "a"), engine(tmp_path, "b")
    procs += [a, b]
    c = conductor(tmp_path, [a, b])
    procs.append(c)
    status, body, headers = completion(c)
    assert status == 200, body
    assert body["choices"][0]["text"] == "xxxx"
    assert headers["x-kvstore-engine"] in {
        "127.0.0.1:" + a.url.rsplit(":", 1)[1],
        "127.0.0.1:" + b.url.rsplit(":", 1)[1],
    }
    assert "predicted_ttft_ms=" in headers["x-kvstore-route"]
    # streaming: the events arrive as the engine sends them, [DONE] last
    req = urllib.request.Request(
        c.url + "/v1/chat/completions",
        data=json.dumps(
            {"model": "stand-in", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True}
        ).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        lines = [ln for ln in r.read().split(b"\n") if ln.startswith(b"data:")]
    assert len(lines) == 6 and lines[-1] == b"data: [DONE]"
    status, models, _ = _get(c.url + "/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == ["stand-in"]
    status, text, _ = _get(c.url + "/metrics")
    assert 'kvstore_conductor_outcomes_total{outcome="served"} 2.0' in text
    st = state(c)
    assert sum(st["routing"]["decisions_per_engine"].values()) == 2
    assert st["routing"]["decision_us"]["p50"] is not None
    assert st["routing"]["decision_cpu_us"]["p50"] is not None and st["routing"]["refusal_ms"]["p50"] is None


def test_bad_requests_get_openai_errors_and_the_conductor_serves_on(tmp_path: Path, procs: list[Proc]) -> None:
    a = engine(tmp_path, "a")
    procs.append(a)
    c = conductor(tmp_path, [a], "--max-request-mb", "1")
    procs.append(c)
    wait_http(c.url + "/v1/models")
    time.sleep(0.5)  # the first probe learns the engine's models
    cases = [
        (b"{not json", 400),
        (json.dumps([1, 2]).encode(), 400),
        ({"model": "nobody-serves-this", "prompt": [1, 2, 3]}, 404),
        ({"model": "stand-in", "prompt": {"a": 1}}, 400),
        ({"model": "stand-in", "prompt": [1, -2, 3]}, 400),
        ({"model": "stand-in", "prompt": [1, 2], "max_tokens": 0}, 400),
        ({"model": "stand-in", "prompt": [1, 2], "stream": "yes"}, 400),
        ({"model": "stand-in", "prompt": [1] * (1 << 20)}, 413),
    ]
    for body, want in cases:
        status, err, _ = post(c.url + "/v1/completions", body)
        assert status == want, (body if isinstance(body, bytes) else str(body)[:80], status, err)
        assert isinstance(err, dict) and err["error"]["message"] and err["error"]["code"] == want, err
    status, err, _ = post(c.url + "/v1/chat/completions", {"model": "stand-in", "messages": "hello"})
    assert status == 400, err
    assert seen(a)["requests"] == 0  # nothing reached the engine
    assert completion(c)[0] == 200
    _, text, _ = _get(c.url + "/metrics")
    assert 'kvstore_conductor_outcomes_total{outcome="served"} 1.0' in text


def test_a_dead_engine_is_taken_out_and_its_requests_go_elsewhere(tmp_path: Path, procs: list[Proc]) -> None:
    """No probe runs during the test (``--probe-s 60``): the requests themselves find the
    dead engine (connection refused) and go to the next best one."""
    a, b = engine(tmp_path, "a"), engine(tmp_path, "b")
    procs += [a, b]
    c = conductor(tmp_path, [a, b], probe=60)
    procs.append(c)
    completion(c)  # both probed once at start; exact ties spread, so the next ones go to each engine
    a.kill()
    # Every request is served by b.  One of them is sent to a, finds it refusing, and takes it
    # out.  Not necessarily the first: a start-up probe that saw the first request running on
    # a counts it as busy for 5 s (the scrape's freshness), and meanwhile b wins every tie.
    deadline = time.monotonic() + 20
    seed = 0
    while True:
        status, body, headers = completion(c, seed=seed)
        assert status == 200, body
        assert headers["x-kvstore-engine"] == b.url.removeprefix("http://")
        seed += 1
        alive = {e["url"]: e["alive"] for e in state(c)["engines"]}
        if seed >= 6 and not alive[a.url]:
            break
        assert time.monotonic() < deadline, f"no request found the dead engine in 20 s ({seed} requests): {alive}"
        if seed >= 6:
            time.sleep(0.2)
    assert alive == {a.url: False, b.url: True}
    b.kill()
    status, body, _ = completion(c)
    assert status == 503 and "no engine" in body["error"]["message"], body


def test_an_engine_that_comes_back_is_probed_back_in(tmp_path: Path, procs: list[Proc]) -> None:
    a, b = engine(tmp_path, "a"), engine(tmp_path, "b")
    procs += [a, b]
    c = conductor(tmp_path, [a, b])
    procs.append(c)
    a.kill()
    end = time.monotonic() + 10
    while {e["url"]: e["alive"] for e in state(c)["engines"]}[a.url]:
        assert time.monotonic() < end, state(c)
        time.sleep(0.1)
    a2 = Proc(a.args, a.url, a.log).start()
    procs.append(a2)
    wait_http(a2.url + "/health")
    end = time.monotonic() + 10
    while not {e["url"]: e["alive"] for e in state(c)["engines"]}[a.url]:
        assert time.monotonic() < end, state(c)
        time.sleep(0.1)
    assert completion(c)[0] == 200


def test_an_engine_that_answers_garbage_gets_a_502_never_counted_as_served(tmp_path: Path, procs: list[Proc]) -> None:
    g = engine(tmp_path, "g", "--garbage")
    procs.append(g)
    c = conductor(tmp_path, [g])
    procs.append(c)
    for stream in (False, True):
        status, body, _ = completion(c, stream=stream)
        assert status == 502, body
        assert "garbage" in body["error"]["message"]
    _, text, _ = _get(c.url + "/metrics")
    assert 'outcome="served"' not in text
    assert 'kvstore_conductor_outcomes_total{outcome="engine_error"} 2.0' in text


def test_a_client_that_goes_away_mid_stream_aborts_the_engine_request(tmp_path: Path, procs: list[Proc]) -> None:
    a = engine(tmp_path, "a", "--token-ms", "50")
    procs.append(a)
    c = conductor(tmp_path, [a])
    procs.append(c)
    host, port = c.url.removeprefix("http://").split(":")
    body = json.dumps({"model": "stand-in", "prompt": [1, 2, 3], "max_tokens": 200, "stream": True}).encode()
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        got = b""
        while got.count(b"data:") < 3:
            got += s.recv(4096)
    # the socket is closed: the conductor must close the engine's stream too
    end = time.monotonic() + 10
    while seen(a)["aborted"] < 1:
        assert time.monotonic() < end, seen(a)
        time.sleep(0.05)
    assert seen(a)["running"] == 0 and seen(a)["finished"] == 0
    assert completion(c)[0] == 200  # and it serves on
    st = state(c)
    assert all(e["prefilling"] == 0 and e["decoding"] == 0 for e in st["engines"]), st


def test_requests_that_would_miss_the_ttft_target_are_refused_early(tmp_path: Path, procs: list[Proc]) -> None:
    """A slow engine (2 ms per prompt token, one prefill at a time): once the model has
    its measurements, a burst of long prompts queues past the 300 ms target, and the
    requests that would miss it are answered 429 with Retry-After at once."""
    a = engine(tmp_path, "a", "--us-per-token", "2000", "--token-ms", "1")
    procs.append(a)
    c = conductor(tmp_path, [a], "--slo-ttft-ms", "300", "--min-samples", "3")
    procs.append(c)
    for seed in range(4):  # calibrate (streamed: the conductor sees the first token): ~130 ms each
        assert completion(c, n=64, seed=seed, stream=True)[0] == 200
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(
            pool.map(
                lambda s: (time.monotonic(), completion(c, n=100, seed=s, stream=True), time.monotonic()), range(10, 18)
            )
        )
    refused = [(t1 - t0, h) for t0, (st, _, h), t1 in results if st == 429]
    served = [st for _, (st, _, _), _ in results if st == 200]
    assert refused and served, [r[1][0] for r in results]
    assert all("Retry-After" in h and int(h["Retry-After"]) >= 1 for _, h in refused)
    assert seen(a)["requests"] == 4 + len(served)  # refused requests never reached the engine
    _, text, _ = _get(c.url + "/metrics")
    assert f'kvstore_conductor_rejected_total{{slo="ttft"}} {float(len(refused))}' in text
    assert f"kvstore_conductor_refusal_seconds_count {float(len(refused))}" in text
    assert state(c)["routing"]["refusal_ms"]["p99"] is not None


def test_load_goes_to_the_engine_with_the_shorter_queue(tmp_path: Path, procs: list[Proc]) -> None:
    a, b = engine(tmp_path, "a", "--us-per-token", "500"), engine(tmp_path, "b", "--us-per-token", "500")
    procs += [a, b]
    c = conductor(tmp_path, [a, b])
    procs.append(c)
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda s: completion(c, n=400, seed=s), range(6)))
    per = state(c)["routing"]["decisions_per_engine"]
    assert sorted(per.values()) == [3, 3], per


def _tokenizer(d: Path) -> Path:
    """A real (tiny, word-level) Hugging Face tokenizer with a chat template, saved as a model's is."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = "hello world the a user assistant system : how are you".split()
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    t = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    t.chat_template = (
        "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant :{% endif %}"
    )
    t.save_pretrained(d)
    return d


def test_text_and_chat_prompts_are_tokenised_as_the_engines_do(tmp_path: Path, procs: list[Proc]) -> None:
    a = engine(tmp_path, "a")
    procs.append(a)
    c = conductor(tmp_path, [a], "--tokenizer", str(_tokenizer(tmp_path / "tok")))
    procs.append(c)
    end = time.monotonic() + 30
    while True:  # the tokenizer loads in the background; until then text prompts are estimated
        status, body, headers = post(c.url + "/v1/completions", {"prompt": "hello world how are you", "max_tokens": 2})
        assert status == 200, body
        if "estimated" not in headers["x-kvstore-route"]:
            break
        assert time.monotonic() < end, headers
        time.sleep(0.2)
    assert headers["x-kvstore-route"].startswith("prompt=5;"), headers
    chat = {"messages": [{"role": "user", "content": "hello world"}], "max_tokens": 2}
    status, body, headers = post(c.url + "/v1/chat/completions", chat)
    assert status == 200, body
    # "user : hello world assistant :": six tokens, as the chat template renders them
    assert headers["x-kvstore-route"].startswith("prompt=6;"), headers
    # token ids pass through as they are
    status, body, headers = post(c.url + "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2})
    assert status == 200 and headers["x-kvstore-route"].startswith("prompt=3;"), headers


def test_bad_flags_are_one_clear_line() -> None:
    for args, want in (
        ([], "give --engine"),
        (["--engine", "localhost:8000"], "want http://HOST:PORT"),
        (["--engine", "http://h:1=chef"], "role must be one of"),
        (["--etcd", "etcd://h:1"], "names its cluster"),
        (["--engine", "http://h:1", "--tier-gbps", "1,2"], "--tier-gbps"),
    ):
        r = subprocess.run(
            [sys.executable, "-m", "kvstore", "conductor", *args], capture_output=True, text=True, cwd=ROOT, timeout=60
        )
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert want in r.stdout + r.stderr and "Traceback" not in r.stderr, (args, r.stdout, r.stderr)

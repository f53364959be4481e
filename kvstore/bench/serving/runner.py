"""Open-loop replay of a :class:`~kvstore.bench.serving.workload.Workload` through a front,
over HTTP, streaming: one :class:`Record` per request.

Each request is sent at its arrival time whether or not earlier ones have finished (open
loop: a fleet that falls behind queues, as a real one does).  Times are taken on this
process's monotonic clock: TTFT from the request's scheduled arrival to the first
streamed token (for ``pd``, the prefill request's time is inside it), every interval
between streamed chunks that carry tokens, end-to-end to the last token.

Failures never stop the run: a non-200 answer is recorded with its status and body
(429 and 503 count as rejections), a connection that fails names the engine, and an
engine that refuses connections (or whose process has exited) is marked dead, so the
front stops sending it requests.  ``on_start`` hears the replay's start (the time its
arrivals count from), so a fault plan (:class:`kvstore.bench.serving.fleet.FaultScheduler`)
runs on the same clock.  Owned by the asyncio loop of :func:`replay`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Callable
from typing import Any

from kvstore.bench.serving.fleet import Engine
from kvstore.bench.serving.front import Front, NoEngine
from kvstore.bench.serving.workload import Work, Workload

REJECT_STATUS = (429, 503)


@dataclasses.dataclass
class Record:
    """What happened to one request (``--records`` writes these, one JSON object a line)."""

    config: str
    index: int
    arrival_s: float
    prompt_tokens: int
    max_tokens: int
    engine: str = ""
    prefill_engine: str = ""
    ttft_ms: float | None = None
    prefill_ms: float | None = None
    itl_ms: list[float] = dataclasses.field(default_factory=list)
    e2e_ms: float | None = None
    tokens: list[int] = dataclasses.field(default_factory=list)
    cached_tokens: int | None = None
    status: int | None = None
    error: str | None = None
    rejected: bool = False
    reject_ms: float | None = None  # a rejected request: how soon the answer came
    step: int = 0
    repeat: int = 0  # which run of its configuration (--repeat), from 0

    @property
    def ok(self) -> bool:
        return self.error is None and not self.rejected and self.ttft_ms is not None

    @property
    def tbt_ms(self) -> float | None:
        """Mooncake's TBT: the mean of the slowest 10 % of the request's inter-token intervals
        (at least one); None with fewer than two tokens."""
        return tbt(self.itl_ms)

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["tbt_ms"] = self.tbt_ms
        return d


def tbt(intervals: list[float]) -> float | None:
    if not intervals:
        return None
    k = max(1, -(-len(intervals) // 10))
    worst = sorted(intervals, reverse=True)[:k]
    return sum(worst) / k


def _body(
    model: str, w: Work, *, temperature: float, stream: bool, max_tokens: int, kvp: Any, sessions: bool = True
) -> dict[str, Any]:
    b: dict[str, Any] = {
        "model": model,
        "prompt": list(w.tokens),
        "max_tokens": max_tokens,
        "temperature": temperature,
        "ignore_eos": True,
        "stream": stream,
        "return_token_ids": True,
    }
    if temperature == 0:
        b["seed"] = 0
    if stream:
        b["stream_options"] = {"include_usage": True}
    if sessions and w.session_id is not None:  # the store's eviction hints (the connector reads it there)
        kvp = {**(kvp or {}), "session_id": w.session_id}
    if kvp is not None:
        b["kv_transfer_params"] = kvp
    return b


class Replay:
    """One replay of a workload through a front (see the module docstring)."""

    def __init__(
        self,
        config: str,
        workload: Workload,
        front: Front,
        *,
        model: str,
        temperature: float = 0.0,
        timeout_s: float = 300.0,
        step: int = 0,
        on_done: Callable[[Record], None] | None = None,
        on_close: Callable[[str], None] | None = None,
        sessions: bool = True,
        repeat: int = 0,
        on_start: Callable[[float], None] | None = None,
    ) -> None:
        self.config = config
        self.workload = workload
        self.front = front
        self.model = model
        self.temperature = temperature
        self.timeout_s = timeout_s
        self.step = step
        self.on_done = on_done
        self.on_close = on_close  # a session's close event (blocking: run in a thread)
        self.closes_failed: list[str] = []
        self.closes_skipped = 0  # closes still due when the last request ended: not sent
        self.sessions = sessions  # pass session ids on (False: engines without the connector, which warn)
        self.dead: dict[str, str] = {}  # engine name -> why it was taken out
        self.wall_s = 0.0
        self.repeat = repeat
        self.on_start = on_start  # called with the start time (time.monotonic) before the first request

    def run(self) -> list[Record]:
        return asyncio.run(self._run())

    async def _run(self) -> list[Record]:
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        conn = aiohttp.TCPConnector(limit=0, force_close=False)
        async with aiohttp.ClientSession(timeout=timeout, connector=conn) as http:
            t0 = time.monotonic()
            if self.on_start is not None:
                self.on_start(t0)
            tasks = [asyncio.create_task(self._one(http, w, t0)) for w in self.workload.items]
            closing = [asyncio.create_task(self._close(at, sid, t0)) for at, sid in self.workload.closes]
            records = list(await asyncio.gather(*tasks))
            # a close due after the last request ended changes nothing measured (the trace's
            # closes come a while after a session's last turn, those of the slice's last
            # sessions long after it): not waited for, counted in closes_skipped
            late = [c for c in closing if not c.done()]
            for c in late:
                c.cancel()
            await asyncio.gather(*closing, return_exceptions=True)
            self.closes_skipped = len(late)
            self.wall_s = time.monotonic() - t0
        return records

    async def _one(self, http: Any, w: Work, t0: float) -> Record:
        rec = Record(
            self.config, w.index, w.arrival_s, len(w.tokens), w.output_tokens, step=self.step, repeat=self.repeat
        )
        delay = t0 + w.arrival_s - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        arrival = t0 + w.arrival_s
        try:
            route = self.front.route(w.index)
        except NoEngine as e:
            rec.error = str(e)
            return self._done(rec)
        rec.engine = route.decode.name
        kvp = None
        try:
            if route.prefill is not None:
                rec.prefill_engine = route.prefill.name
                body = _body(
                    self.model,
                    w,
                    temperature=self.temperature,
                    stream=False,
                    max_tokens=1,
                    kvp=None,
                    sessions=self.sessions,
                )
                async with http.post(route.prefill.url + "/v1/completions", json=body) as r:
                    if r.status != 200:
                        return self._done(await self._refused(rec, r, route.prefill, arrival))
                    data = await r.json()
                kvp = data.get("kv_transfer_params")
                rec.prefill_ms = (time.monotonic() - arrival) * 1e3
            body = _body(
                self.model,
                w,
                temperature=self.temperature,
                stream=True,
                max_tokens=w.output_tokens,
                kvp=kvp,
                sessions=self.sessions,
            )
            async with http.post(route.decode.url + "/v1/completions", json=body) as r:
                if r.status != 200:
                    return self._done(await self._refused(rec, r, route.decode, arrival))
                rec.status = 200
                last: float | None = None
                async for raw in r.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        break
                    obj = json.loads(payload)
                    if "error" in obj:
                        rec.error = f"{route.decode.name}: {obj['error']}"
                        break
                    now = time.monotonic()
                    got = [t for c in obj.get("choices") or [] for t in (c.get("token_ids") or [])]
                    if got:
                        if last is None:
                            rec.ttft_ms = (now - arrival) * 1e3
                        else:
                            rec.itl_ms.append((now - last) * 1e3)
                        last = now
                        rec.tokens.extend(got)
                    usage = obj.get("usage") or {}
                    details = usage.get("prompt_tokens_details") or {}
                    if details.get("cached_tokens") is not None:
                        rec.cached_tokens = int(details["cached_tokens"])
                if last is not None:
                    rec.e2e_ms = (last - arrival) * 1e3
                if rec.error is None and len(rec.tokens) < w.output_tokens:
                    rec.error = (
                        f"{route.decode.name}: the stream ended after {len(rec.tokens)} of {w.output_tokens} tokens"
                    )
        except TimeoutError:
            rec.error = f"{rec.engine}: no complete answer within {self.timeout_s:.0f} s (--request-timeout)"
        except Exception as e:  # aiohttp's connection errors, a malformed stream
            engine = route.prefill if route.prefill is not None and rec.prefill_ms is None else route.decode
            rec.error = f"{engine.name} ({engine.url}): {type(e).__name__}: {e}"
            self._check_dead(engine, e)
        return self._done(rec)

    async def _close(self, at: float, session_id: str, t0: float) -> None:
        if self.on_close is None:
            return
        delay = t0 + at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        try:
            await asyncio.to_thread(self.on_close, session_id)
        except Exception as e:  # a close that fails is reported, never fatal
            self.closes_failed.append(f"close_session {session_id!r}: {type(e).__name__}: {e}")

    async def _refused(self, rec: Record, r: Any, engine: Engine, arrival: float) -> Record:
        rec.status = int(r.status)
        text = (await r.text())[:300]
        if r.status in REJECT_STATUS:
            rec.rejected = True
            rec.reject_ms = (time.monotonic() - arrival) * 1e3
        rec.error = f"{engine.name}: HTTP {r.status}: {text}"
        return rec

    def _check_dead(self, engine: Engine, e: BaseException) -> None:
        import aiohttp

        gone = engine.proc is not None and engine.proc.poll() is not None
        if gone or isinstance(e, aiohttp.ClientConnectorError):
            if engine.alive:
                engine.alive = False
                code = engine.proc.returncode if engine.proc is not None else None
                self.dead[engine.name] = (
                    f"engine {engine.name} ({engine.url}) stopped answering"
                    + (f" (its process exited with code {code})" if gone else f": {type(e).__name__}: {e}")
                    + "; no more requests were sent to it"
                )

    def _done(self, rec: Record) -> Record:
        if self.on_done is not None:
            self.on_done(rec)
        return rec

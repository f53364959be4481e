"""The conductor's OpenAI-compatible front (aiohttp): requests in, routed to an engine, relayed back.

Endpoints: ``POST /v1/completions`` and ``/v1/chat/completions`` (streaming and not),
``GET /v1/models``, ``/health`` (200 while an engine is live), ``/metrics`` (Prometheus)
and ``/conductor/state`` (engines, routing record, the cost model's fits, as JSON).

One request: parse and check it (a clear OpenAI-style error otherwise: 400 malformed,
404 a model the fleet does not serve, 413 too large); its token ids (passed through, or
the model's tokenizer and chat template); the view (pool lookups); the decision
(:mod:`kvstore.conductor.policy`); then either 429 with ``Retry-After`` (refused early) or
the engine's answer.  Every answer carries ``x-kvstore-engine`` and ``x-kvstore-route``
(where it went and why), and one log line says the same.

Faults: an engine that cannot be reached before it answered (refused, reset, connect
timeout) is taken out and the request goes to the next best engine (``attempts`` in
all); an engine that answers garbage gets the request a 502, counted as an engine error,
never as served.  A client that goes away mid-stream closes the engine's connection,
which makes vLLM abort the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any

import aiohttp
from aiohttp import web

from kvstore.conductor.engines import EngineState
from kvstore.conductor.policy import Decision, Estimate
from kvstore.conductor.service import Conductor, Sent

log = logging.getLogger("kvstore.conductor")

CONDUCTOR_KEY: web.AppKey[Conductor] = web.AppKey("conductor", Conductor)


def error(status: int, message: str, kind: str, *, headers: dict[str, str] | None = None) -> web.Response:
    """An OpenAI-style error body."""
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return web.json_response(body, status=status, headers=headers)


class BadRequest(Exception):
    def __init__(self, status: int, message: str, kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status, self.kind = status, kind


# -- the request's tokens --------------------------------------------------------------------
def prompt_tokens(c: Conductor, body: dict[str, Any], chat: bool) -> tuple[list[int] | None, int]:
    """(token ids or None when they cannot be known, a prompt length for the estimate)."""
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
            raise BadRequest(400, "'messages' must be a non-empty list of message objects")
        if c.tokenizer is None:
            return None, max(1, len(json.dumps(msgs)) // 4)
        try:
            ids = c.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        except Exception:  # a template the tokenizer cannot apply: the engine will say why
            return None, max(1, len(json.dumps(msgs)) // 4)
        if not isinstance(ids, list):  # transformers 5: a BatchEncoding (a mapping, not a dict)
            ids = ids["input_ids"]
        return [int(t) for t in ids], len(ids)
    p = body.get("prompt")
    if isinstance(p, list) and p and isinstance(p[0], (list, str)):
        p = p[0]  # a batch: routed by its first prompt
    if isinstance(p, list):
        if not p or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in p):
            raise BadRequest(400, "'prompt' as token ids must be a non-empty list of non-negative integers")
        return list(p), len(p)
    if isinstance(p, str):
        if c.tokenizer is None:
            return None, max(1, len(p) // 4)
        ids = c.tokenizer.encode(p)
        return [int(t) for t in ids], len(ids)
    raise BadRequest(400, "'prompt' must be a string, a list of token ids, or a list of those")


def _check(c: Conductor, body: Any, chat: bool) -> str | None:
    if not isinstance(body, dict):
        raise BadRequest(400, "the request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest(400, "'model' must be a string")
    served = c.engines.models()
    if model is not None and served and model not in served:
        raise BadRequest(404, f"The model `{model}` does not exist (served: {', '.join(served)}).", "NotFoundError")
    for k in ("max_tokens", "max_completion_tokens", "n"):
        v = body.get(k)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise BadRequest(400, f"'{k}' must be a positive integer")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise BadRequest(400, "'stream' must be true or false")
    return model


def _route_header(d: Decision, prompt_tokens: int, tokenized: bool) -> str:
    def one(tag: str, x: Estimate) -> str:
        return (
            f"{tag}={x.engine_id}; local={x.local_tokens}; pool={x.pool_tokens}"
            f"(dram={x.load.dram},nvme={x.load.nvme},remote={x.load.remote}); compute={x.load.compute}; "
            f"queued_ms={x.load.queued_s * 1e3:.0f}; decodes={x.load.running}; ttft_ms={x.ttft_s * 1e3:.0f}"
        )

    parts = [f"prompt={prompt_tokens}" + ("" if tokenized else "(estimated: no token ids)")]
    if d.prefill is not None:
        parts.append(one("prefill", d.prefill))
    if d.engine is not None:
        parts.append(one("engine", d.engine))
    parts.append(f"predicted_ttft_ms={d.predicted_ttft_s * 1e3:.0f}; reason={d.reason}")
    return "; ".join(parts)


def _is_token_event(line: bytes) -> bool | None:
    """For an SSE line: True if it carries output, False if not, None if it is garbage."""
    line = line.strip()
    if not line or line.startswith((b":", b"event:", b"id:", b"retry:")):
        return False
    if not line.startswith(b"data:"):
        return None
    payload = line[5:].strip()
    if payload == b"[DONE]":
        return False
    try:
        ev = json.loads(payload)
    except ValueError:
        return None
    if not isinstance(ev, dict):
        return None
    for ch in ev.get("choices") or ():
        if ch.get("text") or ch.get("token_ids") or (ch.get("delta") or {}).get("content"):
            return True
    return False


# -- handlers ------------------------------------------------------------------------------------
async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, chat=True)


async def _serve(request: web.Request, chat: bool) -> web.StreamResponse:
    c = request.app[CONDUCTOR_KEY]
    arrived = time.monotonic()
    try:
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError as e:
            raise BadRequest(400, f"the request body is not JSON: {e}") from None
        model = _check(c, body, chat)
        tokens, n = (
            await asyncio.to_thread(prompt_tokens, c, body, chat) if c.tokenizer else prompt_tokens(c, body, chat)
        )
    except BadRequest as e:
        c.outcome("bad_request")
        return error(e.status, str(e), e.kind)
    except web.HTTPRequestEntityTooLarge as e:
        c.outcome("bad_request")
        return error(413, f"the request body is too large ({e.text})", "RequestTooLarge")
    c.note_prompt(n)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    excluded: set[str] = set()
    early = c.refuse_early(n, model)  # under overload: the 429 without the pool's RPC or the cache walk
    engines: dict[str, EngineState]
    for _attempt in range(c.cfg.attempts):
        if early is not None:
            d, engines = early, {}
        else:
            live = [e for e in c.engines.live(model) if e.engine_id not in excluded]
            pools = await c.pool_match(tokens, live)
            d, engines = c.decide(tokens, n, model, pools)
        for eid in excluded:
            engines.pop(eid, None)
        if d.refused:
            if d.refused in ("ttft", "tbt"):
                c.refused(d.refused, time.monotonic() - arrived)
                log.info("refused a %d-token prompt: predicted %s misses its target", n, d.refused)
                return error(
                    429,
                    f"the fleet cannot serve this request within the {d.refused.upper()} target now "
                    f"(predicted TTFT {d.predicted_ttft_s * 1e3:.0f} ms); retry after {d.retry_after_s} s",
                    "RateLimitError",
                    headers={"Retry-After": str(d.retry_after_s)},
                )
            c.outcome("engine_error")
            return error(503, f"no engine can take the request: {d.refused}", "ServiceUnavailableError")
        assert d.engine is not None
        sent = Sent(c.next_id(), d, n, arrived, tokenized=tokens is not None, max_tokens=_max_tokens(body))
        try:
            return await _dispatch(request, c, body, path, sent, engines)
        except _Unreachable as u:
            excluded.add(u.engine.engine_id)
            c.engine_failed(u.engine, u.why)
            log.warning("request %s: engine %s unreachable (%s); trying another", sent.rid, u.engine.engine_id, u.why)
    c.outcome("engine_error")
    return error(503, f"no engine could be reached after {c.cfg.attempts} attempts", "ServiceUnavailableError")


def _max_tokens(body: dict[str, Any]) -> int:
    """The output the request asks for (16, vLLM's completions default, when it does not say)."""
    for k in ("max_completion_tokens", "max_tokens"):
        v = body.get(k)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return 16


class _Unreachable(Exception):
    def __init__(self, engine: EngineState, why: str) -> None:
        super().__init__(why)
        self.engine, self.why = engine, why


UNREACHABLE = (
    aiohttp.ClientConnectorError,
    aiohttp.ServerDisconnectedError,
    aiohttp.ClientOSError,
    asyncio.TimeoutError,
)


def _count_sources(c: Conductor, e: EngineState, x: Estimate) -> None:
    for source, n in (
        ("engine", x.local_tokens),
        ("pool_dram", x.load.dram),
        ("pool_nvme", x.load.nvme),
        ("pool_remote", x.load.remote),
        ("compute", x.load.compute),
    ):
        c.metrics.hit_tokens.labels(source).inc(n)
        e.tokens[source] = e.tokens.get(source, 0) + n


async def _dispatch(
    request: web.Request, c: Conductor, body: dict[str, Any], path: str, sent: Sent, engines: dict[str, EngineState]
) -> web.StreamResponse:
    d = sent.decision
    assert d.engine is not None and c.http is not None
    dec = engines[d.engine.engine_id]
    headers = {
        "x-kvstore-engine": dec.engine_id,
        "x-kvstore-route": _route_header(d, sent.prompt_tokens, sent.tokenized),
    }
    log.info("request %s (%d tokens) → %s", sent.rid, sent.prompt_tokens, headers["x-kvstore-route"])
    kvp = body.get("kv_transfer_params") if isinstance(body.get("kv_transfer_params"), dict) else None
    if d.prefill is not None:
        pre = engines[d.prefill.engine_id]
        _count_sources(c, pre, d.prefill)
        pbody = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        pbody.update(stream=False, max_tokens=1, n=1)
        if "max_completion_tokens" in pbody:
            pbody["max_completion_tokens"] = 1
        c.dispatched(pre, sent.rid, d.prefill.load)
        t0 = time.monotonic()
        try:
            async with c.http.post(pre.url + path, json=pbody) as r:
                raw = await r.read()
                status = r.status
        except UNREACHABLE as e:
            c.ended(pre, sent.rid, ok=False)
            raise _Unreachable(pre, f"{type(e).__name__}: {e}") from None
        if status != 200:
            c.ended(pre, sent.rid, ok=False)
            c.outcome("engine_error")
            return web.Response(status=status, body=raw, content_type="application/json", headers=headers)
        try:
            made = json.loads(raw)
            kvp = {**(kvp or {}), **(made.get("kv_transfer_params") or {})}
        except (ValueError, AttributeError, TypeError):
            c.ended(pre, sent.rid, ok=False)
            c.outcome("engine_error")
            return error(502, f"prefill engine {pre.engine_id} answered garbage", "BadGatewayError", headers=headers)
        c.first_token(pre, sent, d.prefill.load, time.monotonic() - t0)
        c.ended(pre, sent.rid, ok=True)
        body = {**body, "kv_transfer_params": kvp}
    else:
        _count_sources(c, dec, d.engine)
    load = d.handoff if d.handoff is not None else d.engine.load
    c.dispatched(dec, sent.rid, load)
    sent.running_at_start = dec.running(time.monotonic())
    t_sent = time.monotonic()
    stream = bool(body.get("stream"))
    ok = False
    up: aiohttp.ClientResponse | None = None
    try:
        try:
            up = await c.http.post(dec.url + path, json=body)
        except UNREACHABLE as e:
            raise _Unreachable(dec, f"{type(e).__name__}: {e}") from None
        if up.status != 200:
            raw = await up.read()
            c.outcome("engine_error" if up.status >= 500 else "bad_request")
            return web.Response(
                status=up.status, body=raw, content_type=up.content_type or "application/json", headers=headers
            )
        if not stream:
            raw = await up.read()
            try:
                json.loads(raw)
            except ValueError:
                c.outcome("engine_error")
                return error(502, f"engine {dec.engine_id} answered garbage", "BadGatewayError", headers=headers)
            took = time.monotonic() - t_sent
            if (body.get("max_tokens") or body.get("max_completion_tokens")) == 1:
                c.first_token(dec, sent, load, took)
                c.ttft_seen(sent, time.monotonic() - sent.arrived)
            ok = True
            c.outcome("served")
            return web.Response(body=raw, content_type="application/json", headers=headers)
        return await _relay(request, c, up, dec, sent, load, t_sent, headers)
    finally:
        if up is not None and not up.closed:
            up.close()  # an unfinished answer closes the connection: vLLM aborts the request
        if stream:
            ok = sent.completed
        c.ended(dec, sent.rid, ok=ok, tbt_s=_tbt(sent.intervals), running=sent.running_at_start + 1)


def _tbt(intervals: list[float]) -> float | None:
    if len(intervals) < 5:
        return None
    k = max(1, -(-len(intervals) // 10))
    return sum(sorted(intervals, reverse=True)[:k]) / k


async def _relay(
    request: web.Request,
    c: Conductor,
    up: aiohttp.ClientResponse,
    dec: EngineState,
    sent: Sent,
    load: Any,
    t_sent: float,
    headers: dict[str, str],
) -> web.StreamResponse:
    resp: web.StreamResponse | None = None
    if up.content_type != "text/event-stream":
        c.outcome("engine_error")
        return error(
            502,
            f"engine {dec.engine_id} answered garbage ({up.content_type}, not a stream)",
            "BadGatewayError",
            headers=headers,
        )
    try:
        async for line in up.content:
            if sent.first_token_at is None:
                kind = _is_token_event(line)
            else:  # past the first token the events are not parsed again: a data line is a token
                kind = line.startswith(b"data:") and line[5:].strip() != b"[DONE]"
            if kind is None:
                c.outcome("engine_error")
                if resp is None:
                    return error(502, f"engine {dec.engine_id} answered garbage", "BadGatewayError", headers=headers)
                msg = {
                    "error": {
                        "message": f"engine {dec.engine_id} answered garbage",
                        "type": "BadGatewayError",
                        "code": 502,
                    }
                }
                await resp.write(b"data: " + json.dumps(msg).encode() + b"\n\n")
                return resp
            if resp is None:
                resp = web.StreamResponse(
                    headers={**headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
                )
                await resp.prepare(request)
            if kind:
                now = time.monotonic()
                if sent.first_token_at is None:
                    sent.first_token_at = now
                    c.first_token(dec, sent, load, now - t_sent)
                    c.ttft_seen(sent, now - sent.arrived)
                elif sent.last_token_at is not None:
                    sent.intervals.append(now - sent.last_token_at)
                sent.last_token_at = now
            await resp.write(line)
    except (ConnectionResetError, aiohttp.ClientConnectionResetError, asyncio.CancelledError):
        c.outcome("client_gone")
        log.info("request %s: the client went away; the engine's request is aborted", sent.rid)
        raise
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as e:
        c.outcome("engine_error")
        if resp is None:
            raise _Unreachable(dec, f"{type(e).__name__}: {e}") from None
        log.warning("request %s: engine %s broke off its answer (%s)", sent.rid, dec.engine_id, e)
        return resp
    if resp is None:
        c.outcome("engine_error")
        return error(502, f"engine {dec.engine_id} answered nothing", "BadGatewayError", headers=headers)
    sent.completed = True
    c.outcome("served")
    with contextlib.suppress(ConnectionResetError):
        await resp.write_eof()
    return resp


async def models(request: web.Request) -> web.Response:
    c = request.app[CONDUCTOR_KEY]
    data = [{"id": m, "object": "model", "owned_by": "kvstore-conductor"} for m in c.engines.models()]
    return web.json_response({"object": "list", "data": data})


async def health(request: web.Request) -> web.Response:
    c = request.app[CONDUCTOR_KEY]
    live = len(c.engines.live())
    return web.json_response({"live_engines": live}, status=200 if live else 503)


async def metrics(request: web.Request) -> web.Response:
    from prometheus_client import generate_latest

    c = request.app[CONDUCTOR_KEY]
    now = time.monotonic()
    for e in c.engines.by_id.values():
        c.metrics.engine_up.labels(e.engine_id).set(1 if e.alive else 0)
        c.metrics.queued.labels(e.engine_id).set(e.queued_tokens(now, c.mean_prompt))
        c.metrics.running.labels(e.engine_id).set(e.running(now))
        c.metrics.staleness.labels(e.engine_id).set(c.local.staleness(e.engine_id))
    return web.Response(body=generate_latest(c.metrics.registry), content_type="text/plain", charset="utf-8")


async def state(request: web.Request) -> web.Response:
    return web.json_response(request.app[CONDUCTOR_KEY].state())


def make_app(c: Conductor) -> web.Application:
    app = web.Application(client_max_size=c.cfg.max_body_bytes)
    app[CONDUCTOR_KEY] = c
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/conductor/state", state)

    async def on_startup(_: web.Application) -> None:
        await c.start()

    async def on_cleanup(_: web.Application) -> None:
        await c.close()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app

"""``kvstore sim serve``: a mock vLLM engine, the simulated engine behind vLLM's OpenAI API.

One process serves what the benchmark and the conductor use of a vLLM server, with no GPU
and no vLLM: ``POST /v1/completions`` and ``/v1/chat/completions`` (streaming SSE or not;
:mod:`kvstore.sim.openai` checks requests and shapes answers), ``GET /v1/models``,
``/health``, ``/metrics`` (vLLM's metric names), ``POST /reset_prefix_cache``, and with
``--kv-events-endpoint`` vLLM's KV events over ZMQ (:mod:`kvstore.sim.kvevents_pub`).
The engine is :class:`~kvstore.sim.live.LiveEngine`: the simulator's model of vLLM's
scheduler and prefix cache, stepped in real time at the speed of a profile
(``--profile``, ``--speed``), so a few dozen mock engines run on two cores.

With ``--etcd etcd://HOST:PORT/CLUSTER`` the engine registers itself there as the kvstore
connector registers a vLLM engine (:class:`~kvstore.cluster.state.EngineRecord`: its URL,
role, block size and KV-events endpoints, on a lease), so ``kvstore conductor --etcd``
finds it and follows its cache.  It has no kvstore node (``node`` is empty) and no pool:
its namespace fingerprint is a hash of the served model's name, which no stored chunk has.

With ``--kv-node TARGET`` the engine moves scaled-down KV through a real kvstore node
(:mod:`kvstore.sim.live_pool`): lookups from the pool's view (``--kv-view``: the cluster's
``etcd://`` target or node targets; default the own node), loads and saves of chunks of
``kv_bytes_per_token × chunk tokens ÷ --kv-scale`` bytes, every call within
``--kv-deadline`` seconds.  The engine's timing stays its profile's.

Wiring only: the state is the :class:`LiveEngine`'s (and its pool link's), on the one
asyncio loop that serves the HTTP app.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from kvstore.errors import InvalidArgument
from kvstore.sim.openai import BadRequest, GenRequest

if TYPE_CHECKING:  # aiohttp, ZMQ and etcd's client load only when the engine is served
    from aiohttp import web

    from kvstore.cluster.state import EngineRecord
    from kvstore.sim.live import LiveEngine, Submission
    from kvstore.sim.live_pool import LinkSettings
    from kvstore.sim.profile import EngineProfile

log = logging.getLogger("kvstore.sim")

SERVED_DEFAULT = "kvstore-sim"
DEFAULT_VOCAB = 32000
CHUNK_BLOCKS = 16
"""The registered ``chunk_tokens`` is this many engine blocks (a multiple, as a record must)."""
DEFAULT_KV_SCALE = 64
"""``--kv-scale``'s default: a chunk of the ``local`` profile (256 tokens of 8 KiB) is 32 KiB
and the benchmark's 1 GiB nodes hold 16 MiB each, so 16 engines' nodes fit in 256 MiB."""
DEFAULT_KV_DEADLINE_S = 2.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to serve on (default 8000; 0: any free port)")
    p.add_argument("--profile", default="local", metavar="NAME|FILE", help="step-time profile (default local)")
    p.add_argument("--model", default=SERVED_DEFAULT, help=f"the served model's name (default {SERVED_DEFAULT})")
    p.add_argument("--num-gpu-blocks", type=int, help="KV cache blocks (default: the profile's)")
    p.add_argument("--max-model-len", type=int, help="longest prompt + completion (default: what the cache holds)")
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB, help=f"token ids 0..N-1 (default {DEFAULT_VOCAB})")
    p.add_argument("--seed", type=int, default=0, help="seed of the profile's step-time jitter (default 0)")
    p.add_argument("--speed", type=float, default=1.0, help="run the engine's clock this much faster (default 1)")
    p.add_argument(
        "--kv-events-endpoint", metavar="tcp://HOST:PORT", help="publish vLLM's KV events on this ZMQ PUB endpoint"
    )
    p.add_argument(
        "--kv-events-replay-endpoint", metavar="tcp://HOST:PORT", help="serve replays of them on this ROUTER endpoint"
    )
    p.add_argument("--etcd", metavar="etcd://HOST:PORT/CLUSTER", help="register the engine there (for the conductor)")
    p.add_argument("--advertise-url", metavar="URL", help="the URL registered (default http://HOST:PORT)")
    g = p.add_argument_group("kvstore pool (scaled-down KV through a real node)")
    g.add_argument(
        "--kv-node",
        metavar="TARGET",
        help="the engine's own kvstore node (unix:///PATH or HOST:PORT): turns the pool on",
    )
    g.add_argument(
        "--kv-view",
        metavar="etcd://HOST:PORT/CLUSTER|TARGET[,TARGET...]",
        help="what lookups follow (the pool's view): a cluster's membership or node targets (default: --kv-node)",
    )
    g.add_argument(
        "--kv-scale",
        type=int,
        default=DEFAULT_KV_SCALE,
        metavar="N",
        help="a chunk's bytes are the profile's KV bytes per token x chunk tokens / N, at least 64 "
        f"(default {DEFAULT_KV_SCALE})",
    )
    g.add_argument(
        "--kv-deadline",
        type=float,
        default=DEFAULT_KV_DEADLINE_S,
        metavar="S",
        help=f"each call to a node within this many seconds (default {DEFAULT_KV_DEADLINE_S:g})",
    )
    p.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))


@contextlib.asynccontextmanager
async def _lifespan(a: argparse.Namespace, port: int) -> AsyncIterator[LiveEngine]:
    """The engine, its publisher and its registration, made on the serving loop."""
    from kvstore.sim.kvevents_pub import KVEventPublisher
    from kvstore.sim.live import LiveEngine

    profile = load_profile(a.profile, a.num_gpu_blocks)
    pool = None
    if a.kv_node:
        from kvstore.sim.live_pool import PoolLink

        pool = PoolLink(profile, a.model, link_settings(a))
    try:
        pub = None
        if a.kv_events_endpoint:
            pub = KVEventPublisher(a.kv_events_endpoint, replay_endpoint=a.kv_events_replay_endpoint)
        engine = LiveEngine(
            profile, model_name=a.model, vocab=a.vocab_size, seed=a.seed, speed=a.speed, publisher=pub, pool=pool
        )
        engine.start()
        registrar = None
        if a.etcd:
            from kvstore.cluster.engines import EngineRegistrar

            registrar = EngineRegistrar(a.etcd, engine_record(a, port, engine)).start()
        try:
            yield engine
        finally:
            if registrar is not None:
                await asyncio.to_thread(registrar.close)
            await engine.close()
    finally:
        if pool is not None:
            await asyncio.to_thread(pool.close)


def link_settings(a: argparse.Namespace) -> LinkSettings:
    """The pool link's settings from ``--kv-*`` (InvalidArgument for bad ones)."""
    from kvstore.sim.live_pool import LinkSettings

    view: str | tuple[str, ...] = ()
    if a.kv_view:
        view = (
            a.kv_view
            if a.kv_view.startswith("etcd://")
            else tuple(t.strip() for t in a.kv_view.split(",") if t.strip())
        )
    return LinkSettings(a.kv_node, view, kv_scale=a.kv_scale, deadline_s=a.kv_deadline)


def load_profile(name: str, num_gpu_blocks: int | None) -> EngineProfile:
    """``--profile`` (a bundled name or a file), with ``--num-gpu-blocks`` if given."""
    import dataclasses

    from kvstore.sim.profile import EngineProfile

    profile = EngineProfile.load(name)
    if num_gpu_blocks is not None:
        profile = dataclasses.replace(profile, num_gpu_blocks=num_gpu_blocks)
    return profile


def engine_record(a: argparse.Namespace, port: int, engine: LiveEngine) -> EngineRecord:
    """What the kvstore connector would register for this engine (see the module docstring)."""
    import xxhash

    from kvstore.cluster.state import EngineRecord

    url = (a.advertise_url or f"http://{a.host}:{port}").rstrip("/")
    host = urlsplit(url).hostname or a.host
    pub = engine.publisher

    def reachable(endpoint: str) -> str:  # a bound wildcard is advertised at the URL's host
        return endpoint.replace("0.0.0.0", host).replace("*", host) if endpoint else ""

    bs = engine.profile.block_size
    return EngineRecord(
        engine_id=f"sim-{host}-{port}".replace(".", "-"),
        url=url,
        role="both",
        fingerprint=xxhash.xxh3_64_hexdigest(b"kvstore.sim/" + a.model.encode()),
        chunk_tokens=bs * CHUNK_BLOCKS,
        block_size=bs,
        models=(a.model,),
        kv_events=reachable(pub.endpoint) if pub is not None else "",
        kv_events_replay=reachable(pub.replay_endpoint) if pub is not None else "",
        bytes_per_token=engine.profile.kv_bytes_per_token,
        host=socket.gethostname(),
        pid=os.getpid(),
    )


def make_app(engine: LiveEngine, *, max_model_len: int) -> web.Application:
    """The aiohttp app over a started :class:`~kvstore.sim.live.LiveEngine`."""
    from aiohttp import web

    from kvstore.sim import openai

    model = engine.model_name

    def error(e: BadRequest) -> web.Response:
        return web.json_response(e.body(), status=e.status)

    async def generate(request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError) as e:
            return error(BadRequest(f"the request body is not JSON: {e}"))
        parse = openai.parse_chat if chat else openai.parse_completion
        try:
            req = parse(body, served=model, vocab=engine.vocab, max_model_len=max_model_len)
            sub = engine.submit(req.tokens, req.max_tokens, prefix="chatcmpl" if chat else "cmpl")
        except BadRequest as e:
            return error(e)
        except InvalidArgument as e:
            return error(BadRequest(str(e)))
        rid = f"{sub.req_id}-{uuid.uuid4().hex[:8]}"
        try:
            if req.stream:
                return await _stream(request, engine, sub, req, rid, model)
            tokens = [t async for t in engine.outputs(sub)]
        except RuntimeError as e:
            return web.json_response(openai.error_body(str(e), status=500, kind="InternalServerError"), status=500)
        finally:
            engine.abort(sub)  # a no-op once it finished; else the client went away
        use = openai.usage(len(req.tokens), len(tokens), sub.cached_tokens)
        return web.json_response(openai.full(req, rid, model, tokens, use))

    async def completions(request: web.Request) -> web.StreamResponse:
        return await generate(request, chat=False)

    async def chat_completions(request: web.Request) -> web.StreamResponse:
        return await generate(request, chat=True)

    async def models(_: web.Request) -> web.Response:
        card = {
            "id": model,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "vllm",
            "root": model,
            "parent": None,
            "max_model_len": max_model_len,
        }
        return web.json_response({"object": "list", "data": [card]})

    async def health(_: web.Request) -> web.Response:
        if engine.failed is not None:
            return web.json_response(openai.error_body(engine.failed, status=500, kind="EngineDeadError"), status=500)
        return web.Response(status=200)

    async def metrics(_: web.Request) -> web.Response:
        from prometheus_client import generate_latest

        return web.Response(body=generate_latest(engine.metrics.registry), content_type="text/plain", charset="utf-8")

    async def reset_prefix_cache(_: web.Request) -> web.Response:
        if not engine.reset_prefix_cache():
            msg = "the prefix cache was not reset: requests hold blocks (vLLM resets only an idle cache)"
            return web.json_response(openai.error_body(msg, status=400, kind="BadRequestError"), status=400)
        return web.Response(status=200)

    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    return app


async def _stream(
    request: web.Request, engine: LiveEngine, sub: Submission, req: GenRequest, rid: str, model: str
) -> web.StreamResponse:
    from aiohttp import web

    from kvstore.sim import openai

    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    created = int(time.time())

    async def send(obj: Any) -> None:
        await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

    try:
        if req.chat:
            await send(openai.role_chunk(rid, model, created))
        n = 0
        try:
            async for t in engine.outputs(sub):
                n += 1
                await send(openai.chunk(req, rid, model, [t], "length" if n == req.max_tokens else None, created))
        except RuntimeError as e:  # the engine failed: the stream says so, as vLLM's does
            await send(openai.error_body(str(e), status=500, kind="InternalServerError"))
        else:
            if req.include_usage:
                use = openai.usage(len(req.tokens), n, sub.cached_tokens)
                await send(openai.usage_chunk(req, rid, model, created, use))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    except ConnectionResetError:  # the client went away: the caller aborts the request
        pass
    return resp


async def serve(a: argparse.Namespace) -> None:
    """Serve until cancelled (SIGINT/SIGTERM)."""
    from aiohttp import web

    try:  # bound first: port 0 picks one, which is registered and printed
        sock = socket.create_server((a.host, a.port))
    except OSError as e:
        raise InvalidArgument(f"cannot serve on {a.host}:{a.port}: {e}") from None
    port = sock.getsockname()[1]
    async with _lifespan(a, port) as engine:
        max_len = a.max_model_len or (engine.profile.num_gpu_blocks - 1) * engine.profile.block_size
        runner = web.AppRunner(make_app(engine, max_model_len=max_len), access_log=None)
        await runner.setup()
        site = web.SockSite(runner, sock)
        await site.start()
        pub = engine.publisher
        events = f"; KV events {pub.endpoint} replay {pub.replay_endpoint or '-'}" if pub is not None else ""
        link = engine.pool
        kv = f", kvstore node {a.kv_node}, {link.chunk_bytes}-byte chunks" if link is not None else ""
        print(f"kvstore sim serve on http://{a.host}:{port} (profile {engine.profile.name}{kv}){events}", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()


def check(a: argparse.Namespace) -> None:
    """The flags' own checks (InvalidArgument), before anything starts."""
    if a.vocab_size < 1:
        raise InvalidArgument(f"--vocab-size must be positive, got {a.vocab_size}")
    if not a.speed > 0:
        raise InvalidArgument(f"--speed must be positive, got {a.speed}")
    if a.max_model_len is not None and a.max_model_len < 2:
        raise InvalidArgument(f"--max-model-len must be at least 2, got {a.max_model_len}")
    if a.kv_events_replay_endpoint and not a.kv_events_endpoint:
        raise InvalidArgument("--kv-events-replay-endpoint needs --kv-events-endpoint")
    if a.etcd:
        from kvstore.cluster.state import parse_target

        parse_target(a.etcd)
    if a.kv_scale < 1:
        raise InvalidArgument(f"--kv-scale must be at least 1, got {a.kv_scale}")
    if not a.kv_deadline > 0:
        raise InvalidArgument(f"--kv-deadline must be positive, got {a.kv_deadline}")
    if a.kv_view and not a.kv_node:
        raise InvalidArgument("--kv-view needs --kv-node (the engine's own node, where it loads and saves)")
    if a.kv_node:
        _check_node_target("--kv-node", a.kv_node)
        if a.kv_view and a.kv_view.startswith("etcd://"):
            from kvstore.cluster.state import parse_target

            parse_target(a.kv_view)
        elif a.kv_view:
            targets = [t.strip() for t in a.kv_view.split(",") if t.strip()]
            if not targets:
                raise InvalidArgument(f"--kv-view lists no target: {a.kv_view!r}")
            for t in targets:
                _check_node_target("--kv-view", t)
    profile = load_profile(a.profile, a.num_gpu_blocks)
    holds = (profile.num_gpu_blocks - 1) * profile.block_size
    if a.max_model_len is not None and a.max_model_len > holds:
        raise InvalidArgument(
            f"--max-model-len {a.max_model_len} is more than the KV cache holds ({holds} tokens: "
            f"{profile.num_gpu_blocks - 1} blocks of {profile.block_size}): raise --num-gpu-blocks"
        )


def _check_node_target(flag: str, target: str) -> None:
    """One node's target: ``unix:///PATH`` or ``HOST:PORT`` (InvalidArgument otherwise)."""
    host, sep, port = target.rpartition(":")
    if target.startswith("unix:/") or (sep and host and port.isdigit() and not target.startswith("etcd:")):
        return
    raise InvalidArgument(f"{flag} must be a node's unix:///PATH or HOST:PORT, got {target!r}")


def main(a: argparse.Namespace) -> int:
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    check(a)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(a))
    return 0

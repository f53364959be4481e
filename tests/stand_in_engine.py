"""A stand-in for a vLLM OpenAI server, for the conductor's fault and protocol tests.

Run as a process (``python tests/stand_in_engine.py --port P ...``): it speaks the part of
vLLM's HTTP API the conductor uses (``/health``, ``/metrics`` with
``vllm:num_requests_running``/``_waiting``, ``/v1/models``, ``/v1/completions`` and
``/v1/chat/completions``, streaming and not) and behaves as told: a prefill that takes
``--us-per-token`` per prompt token (one at a time, like one engine's prefill), then a
token every ``--token-ms``; ``--garbage`` answers unparseable bodies.  ``GET /stand-in``
reports what it saw (requests, finished, aborted: a client that went away mid-stream),
which the real engine cannot tell a test.  The real path is tested with real vLLM
servers in tests/vllm; this one makes faults (garbage, an engine killed mid-stream, a
client that disconnects) reproducible in a second.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from aiohttp import web


class Engine:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.running = 0
        self.waiting = 0
        self.seen: dict[str, int] = {"requests": 0, "finished": 0, "aborted": 0}
        self.prompts: list[dict[str, object]] = []
        self.prefill = asyncio.Lock()

    async def serve(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen["requests"] += 1
        prompt = body.get("prompt") or body.get("messages")
        n = len(prompt) if isinstance(prompt, list) else len(json.dumps(prompt)) // 4
        self.prompts.append({"tokens": n, "kv_transfer_params": body.get("kv_transfer_params")})
        if self.a.garbage:
            return web.Response(text="<html>this is not JSON", content_type="text/html")
        out = int(body.get("max_tokens") or 16)
        self.waiting += 1
        try:
            async with self.prefill:
                await asyncio.sleep(n * self.a.us_per_token / 1e6)
        finally:
            self.waiting -= 1
        self.running += 1
        chat = request.path.endswith("chat/completions")
        try:
            if not body.get("stream"):
                await asyncio.sleep(self.a.token_ms / 1e3 * (out - 1))
                self.seen["finished"] += 1
                return web.json_response(
                    {
                        "id": "cmpl-1",
                        "object": "text_completion",
                        "choices": [{"index": 0, "text": "x" * out, "finish_reason": "length"}],
                        "usage": {"prompt_tokens": n, "completion_tokens": out},
                        "kv_transfer_params": {"made_by": self.a.port},
                    }
                )
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            try:
                for i in range(out):
                    if i:
                        await asyncio.sleep(self.a.token_ms / 1e3)
                    ch = {"index": 0, "delta": {"content": "x"}} if chat else {"index": 0, "text": "x"}
                    await resp.write(b"data: " + json.dumps({"choices": [ch]}).encode() + b"\n\n")
                await resp.write(b"data: [DONE]\n\n")
            except (ConnectionResetError, asyncio.CancelledError):
                self.seen["aborted"] += 1
                raise
            self.seen["finished"] += 1
            return resp
        finally:
            self.running -= 1

    async def health(self, _: web.Request) -> web.Response:
        return web.Response(text="")

    async def metrics(self, _: web.Request) -> web.Response:
        return web.Response(
            text=f'vllm:num_requests_running{{engine="0"}} {self.running}.0\n'
            f'vllm:num_requests_waiting{{engine="0"}} {self.waiting}.0\n'
        )

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.a.model, "object": "model"}]})

    async def report(self, _: web.Request) -> web.Response:
        return web.json_response(
            {**self.seen, "prompts": self.prompts, "running": self.running, "waiting": self.waiting, "at": time.time()}
        )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", default="stand-in")
    p.add_argument("--us-per-token", type=float, default=100.0)
    p.add_argument("--token-ms", type=float, default=5.0)
    p.add_argument("--garbage", action="store_true")
    a = p.parse_args()
    e = Engine(a)
    app = web.Application()
    app.router.add_post("/v1/completions", e.serve)
    app.router.add_post("/v1/chat/completions", e.serve)
    app.router.add_get("/health", e.health)
    app.router.add_get("/metrics", e.metrics)
    app.router.add_get("/v1/models", e.models)
    app.router.add_get("/stand-in", e.report)
    web.run_app(app, host="127.0.0.1", port=a.port, print=None, access_log=None, handler_cancellation=True)


if __name__ == "__main__":
    main()

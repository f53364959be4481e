"""One process of the P/D demo: a model, a paged engine and (per request) a GPU agent.

Run as ``python -m kvstore.demo._worker``; :mod:`kvstore.demo.pd` drives it with one JSON
object per line on stdin and reads one JSON answer per line from stdout (everything
else the process prints goes to stderr).  Commands:

* ``{"cmd": "init", "spec": {...}, "chunk_tokens": C, "salt": S, "max_tokens": N}``
* ``{"cmd": "reference", "prompt": [...], "new_tokens": n}``: no store at all;
* ``{"cmd": "prefill", "target": T, "prompt": [...]}``: compute the prompt's KV, save it;
* ``{"cmd": "decode", "target": T, "prompt": [...], "new_tokens": n, "prefetch": bool}``:
  look up, load, finish the prompt, generate greedily.

TTFT is measured from the moment the request is taken up (model warm, engine pages
allocated, agent connected: as in a running engine) to the first generated token.
A fresh client and agent serve each request, so a node restart between requests
(the NVMe scenario) is picked up and the HBM pool starts empty unless prefetched.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, TextIO


class Worker:
    def __init__(self) -> None:
        self.model: Any = None

    def init(
        self, spec: dict[str, Any], chunk_tokens: int, salt: str, max_tokens: int, device: str | None = None
    ) -> dict[str, Any]:

        from gpu_agent.copy_engine import normalize_device
        from kvstore.demo.hf import ModelSpec, PagedEngine, build_model, forward, new_cache

        self.device = str(normalize_device(device))
        self.spec = ModelSpec(**spec)
        self.layout = self.spec.layout()
        self.namespace = self.layout.namespace("kvstore-demo-llama", chunk_tokens=chunk_tokens, tenant_salt=salt)
        self.model = build_model(self.spec, self.device)
        self.engine = PagedEngine(self.layout, max_tokens, self.device)
        # warm up (allocator, kernels for long sequences, one decode step) before anything is timed
        warm = new_cache()
        forward(self.model, [i % self.spec.vocab_size for i in range(max_tokens - 1)], warm)
        forward(self.model, [0], warm)
        return {"pid": os.getpid(), "device": self.device}

    def _agent(self, target: str) -> Any:
        from client import KVClient
        from gpu_agent.agent import AgentConfig, GPUAgent

        client = KVClient(target)
        cfg = AgentConfig(hbm_bytes=max(self.layout.block_bytes(self.namespace.chunk_tokens) * 4, 256 << 20))
        return client, GPUAgent(client, self.layout, self.namespace, device=self.device, config=cfg)

    def reference(self, prompt: list[int], new_tokens: int) -> dict[str, Any]:
        from kvstore.demo.hf import greedy, new_cache

        t0 = time.perf_counter()
        first: list[float] = []
        tokens = greedy(self.model, new_cache(), prompt, new_tokens, lambda: first.append(time.perf_counter() - t0))
        return {"tokens": tokens, "ttft_s": first[0], "cached_tokens": 0, "pid": os.getpid()}

    def prefill(self, target: str, prompt: list[int]) -> dict[str, Any]:
        from kvstore.demo.hf import forward, new_cache

        client, agent = self._agent(target)
        try:
            t0 = time.perf_counter()
            cache = new_cache()
            forward(self.model, prompt, cache)
            t1 = time.perf_counter()
            ids = self.engine.block_ids(len(prompt))
            self.engine.write_cache(cache, ids, len(prompt))
            result = agent.save(prompt, self.engine.kv, ids).wait()
            t2 = time.perf_counter()
            return {
                "prefill_s": t1 - t0,
                "save_s": t2 - t1,
                "stored": result.stored,
                "existed": result.existed,
                "failed": result.failed,
                "pid": os.getpid(),
                "agent": agent.stats(),
            }
        finally:
            agent.close()
            client.close()

    def decode(self, target: str, prompt: list[int], new_tokens: int, prefetch: bool = False) -> dict[str, Any]:
        from kvstore.demo.hf import greedy, new_cache

        client, agent = self._agent(target)
        try:
            if prefetch:  # as from the engine's waiting queue, before the request is scheduled
                agent.prefetch(prompt).result()
            t0 = time.perf_counter()
            first: list[float] = []
            cached = agent.lookup(prompt)
            ids = self.engine.block_ids(len(prompt))
            load_s = 0.0
            if cached:
                h = agent.load(prompt, self.engine.kv, ids)
                use = min(
                    h.num_tokens, len(prompt) - 1
                )  # the last prompt token is always computed: it yields the first logits
                cache = self.engine.read_cache(ids, use, h.wait_layer)
                ok = h.wait()
                load_s = time.perf_counter() - t0
                if not ok:
                    raise RuntimeError("a lease expired during the load")
                hbm = h.hbm_chunks
            else:
                use, cache, hbm = 0, new_cache(), 0
            tokens = greedy(self.model, cache, prompt[use:], new_tokens, lambda: first.append(time.perf_counter() - t0))
            return {
                "tokens": tokens,
                "ttft_s": first[0],
                "cached_tokens": cached,
                "used_tokens": use,
                "load_s": load_s,
                "hbm_chunks": hbm,
                "pid": os.getpid(),
                "agent": agent.stats(),
            }
        finally:
            agent.close()
            client.close()


def serve(inp: TextIO, out: TextIO) -> int:
    w = Worker()
    for line in inp:
        if not line.strip():
            continue
        req = json.loads(line)
        cmd = req.pop("cmd")
        if cmd == "exit":
            break
        try:
            resp = {"ok": True, **getattr(w, cmd)(**req)}
        except Exception as e:  # reported to the driver, which prints it and fails
            import traceback

            resp = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        out.write(json.dumps(resp) + "\n")
        out.flush()
    return 0


def main() -> int:
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    sys.stdout = sys.stderr  # library chatter must not corrupt the protocol
    os.dup2(sys.stderr.fileno(), 1)
    return serve(sys.stdin, out)


if __name__ == "__main__":
    sys.exit(main())

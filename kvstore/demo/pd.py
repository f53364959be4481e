"""``kvstore demo pd``: prefill on one process, decode on another, KV handed over through kvstore.

    kvstore demo pd --prompt-tokens 4096 --new-tokens 32 [--chunk-tokens 256] [--json]

What it runs (each worker is a separate ``python -m kvstore.demo._worker`` process with
the same small random Llama, see :mod:`kvstore.demo.hf`):

1. a private node (``kvstore serve`` on free ports, a temporary data directory) unless
   ``--target`` names one;
2. **full recompute**: the decode process generates from the prompt without the store
   (the reference the other scenarios must match token for token);
3. the prefill process computes the prompt's KV and saves it through its GPU agent;
4. **DRAM hit**: the decode process looks the prompt up, loads the KV through its agent
   layer by layer and generates greedily;
5. **HBM hit**: the same after ``prefetch`` put the blocks in the agent's HBM pool;
6. **NVMe hit**: the node is restarted on the same data directory (SIGTERM demotes dirty
   DRAM blocks to NVMe), so every block comes back from NVMe;
7. **partial hit**: the second half of the prompt's chunks is deleted from the node,
   so half the prompt is loaded and half recomputed.

It prints TTFT per scenario and whether each one's tokens equal the reference's; the
exit status is 1 if any differ.  With ``--target`` (a node that cannot be restarted
here) the NVMe scenario is skipped.  The arguments are :mod:`kvstore.demo.cli`'s, which
imports this module only for ``kvstore demo pd``; only :func:`main` imports anything heavy.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any


class WorkerProcess:
    """A ``kvstore.demo._worker`` child speaking JSON lines."""

    def __init__(self, name: str) -> None:
        self.name = name
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "TRANSFORMERS_VERBOSITY": "error",
            # keep freed memory in the process: without it every large activation is a fresh mmap
            # whose first touch runs at 0.4-0.9 GB/s (architecture §14) and TTFTs measure page faults
            "GLIBC_TUNABLES": os.environ.get(
                "GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=1073741824:glibc.malloc.trim_threshold=4294967296"
            ),
        }
        self.stderr: list[str] = []
        from kvstore.children import spawn  # dies with the demo

        self.proc = spawn(
            [sys.executable, "-m", "kvstore.demo._worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr.append(line)

    def send(self, cmd: str, **kw: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"cmd": cmd, **kw}) + "\n")
        self.proc.stdin.flush()

    def recv(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} worker died (rc={self.proc.wait()}):\n{''.join(self.stderr[-30:])}")
        resp: dict[str, Any] = json.loads(line)
        if not resp.pop("ok"):
            raise RuntimeError(f"{self.name} worker: {resp['error']}\n{resp.get('traceback', '')}")
        return resp

    def call(self, cmd: str, **kw: Any) -> dict[str, Any]:
        self.send(cmd, **kw)
        return self.recv()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("exit")
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def make_prompt(n: int, vocab: int, seed: int) -> list[int]:
    import numpy as np

    return [int(t) for t in np.random.default_rng(seed + 1).integers(0, vocab, size=n)]


def run(a: argparse.Namespace) -> dict[str, Any]:
    if a.chunk_tokens <= 0 or a.chunk_tokens % 16:
        raise SystemExit("--chunk-tokens must be a positive multiple of 16 (the engine's page size)")
    if a.prompt_tokens < 2 * a.chunk_tokens:
        raise SystemExit("--prompt-tokens must hold at least two chunks (the partial scenario caches half of them)")
    if a.new_tokens < 1:
        raise SystemExit("--new-tokens must be at least 1")
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        raise SystemExit(
            "the demo needs Hugging Face transformers: pip install 'kvstore[demo]' (or 'transformers>=5,<6')"
        )
    from kvstore.progress import Progress

    repeat = max(1, a.repeat)
    # the two engines built, the reference runs, the prefill, every scenario's runs
    with Progress("kvstore demo pd", total=2 + repeat * (1 + (3 if a.target else 4)), unit="steps") as prog:
        return _run(a, prog, repeat)


def _run(a: argparse.Namespace, prog: Any, repeat: int) -> dict[str, Any]:
    from client import KVClient
    from kvstore.children import private_node
    from kvstore.demo.hf import ModelSpec
    from kvstore.keys import chunk_keys

    prog.step("building the prefill and decode engines")
    spec = ModelSpec(
        hidden_size=a.hidden,
        intermediate_size=2 * a.hidden,
        num_layers=a.layers,
        max_positions=a.prompt_tokens + a.new_tokens,
        seed=a.seed,
    )
    prompt = make_prompt(a.prompt_tokens, spec.vocab_size, a.seed)
    salt = uuid.uuid4().hex  # a namespace of this run's own: blocks of earlier runs never count
    layout = spec.layout()
    ns = layout.namespace("kvstore-demo-llama", chunk_tokens=a.chunk_tokens, tenant_salt=salt)
    keys = chunk_keys(prompt, ns)

    tmp = None
    node = None
    workers: list[WorkerProcess] = []
    try:
        prefill, decode = WorkerProcess("prefill"), WorkerProcess("decode")
        workers += [prefill, decode]
        init = {
            "spec": {f: getattr(spec, f) for f in spec.__dataclass_fields__},
            "chunk_tokens": a.chunk_tokens,
            "salt": salt,
            "max_tokens": a.prompt_tokens + a.new_tokens,
            "device": a.device,
        }
        for w in workers:  # both import torch and build the model at the same time
            w.send("init", **init)
        if a.target:
            target = a.target
        else:
            tmp = tempfile.TemporaryDirectory(prefix="kvstore-demo-")
            node = private_node(Path(tmp.name) / "node", dram=a.dram, nvme=a.nvme)
            target = node.target
        pinfo, dinfo = prefill.recv(), decode.recv()
        prog.update(note="full recompute (the reference)")

        def tiers() -> list[str]:
            with KVClient(target) as kv:
                return [t or "-" for t in kv.lookup(keys)]

        def tier_summary(ts: list[str]) -> str:
            lead = ts[: ts.index("-")] if "-" in ts else ts  # the cached prefix's tiers
            return ",".join(sorted(set(lead))) if lead else "-"

        out: dict[str, Any] = {
            "prompt_tokens": a.prompt_tokens,
            "new_tokens": a.new_tokens,
            "chunk_tokens": a.chunk_tokens,
            "model": {
                "layers": spec.num_layers,
                "hidden": spec.hidden_size,
                "kv_heads": spec.num_kv_heads,
                "head_dim": spec.head_dim,
                "vocab": spec.vocab_size,
                "dtype": "float32",
                "seed": spec.seed,
            },
            "device": dinfo["device"],
            "prefill_pid": pinfo["pid"],
            "decode_pid": dinfo["pid"],
            "scenarios": {},
        }
        sc: dict[str, Any] = out["scenarios"]
        refs = []
        for _ in range(repeat):
            refs.append(decode.call("reference", prompt=prompt, new_tokens=a.new_tokens))
            prog.update()
        reference = refs[0]["tokens"]
        out["reference_tokens"] = reference
        sc["full recompute"] = {
            "ttft_s": min(r["ttft_s"] for r in refs),
            "cached_tokens": 0,
            "tier": "-",
            "tokens": reference if all(r["tokens"] == reference for r in refs) else None,
        }

        prog.step("prefill: saving the prompt's KV")
        saved = prefill.call("prefill", target=target, prompt=prompt)
        prog.update()
        out["prefill"] = {k: saved[k] for k in ("prefill_s", "save_s", "stored", "existed", "failed")}

        def scenario(name: str, before: Any = None, **kw: Any) -> None:
            runs = []
            prog.step(name)
            for _ in range(repeat):
                if before is not None:
                    before()
                where = tier_summary(tiers())
                r = decode.call("decode", target=target, prompt=prompt, new_tokens=a.new_tokens, **kw)
                runs.append(
                    {
                        "ttft_s": r["ttft_s"],
                        "cached_tokens": r["cached_tokens"],
                        "tier": "hbm" if r["hbm_chunks"] else where,
                        "load_s": r["load_s"],
                        "tokens": r["tokens"],
                    }
                )
                prog.update()
            best = min(runs, key=lambda x: x["ttft_s"])
            if any(x["tokens"] != best["tokens"] for x in runs):
                best["tokens"] = None
            sc[name] = best

        def restart() -> None:
            nonlocal target
            assert node is not None
            node.restart()  # SIGTERM flushes DRAM to NVMe; the new process starts with an empty DRAM tier
            target = node.target

        scenario("DRAM hit")
        scenario("HBM hit (prefetched)", prefetch=True)
        if node is not None:
            scenario("NVMe hit", before=restart)
        half = len(keys) // 2
        with KVClient(target) as kv:
            kv.delete(keys[half:])
        scenario("partial hit (half)")
        for s in sc.values():
            s["tokens_equal"] = s.pop("tokens") == reference
        out["ok"] = all(s["tokens_equal"] for s in sc.values())
        return out
    finally:
        for w in workers:
            w.close()
        if node is not None:
            node.close()
        if tmp is not None:
            tmp.cleanup()


def format_table(r: dict[str, Any]) -> str:
    m = r["model"]
    lines = [
        f"kvstore demo pd: {r['prompt_tokens']}-token prompt, {r['new_tokens']} new tokens, chunks of {r['chunk_tokens']} tokens",
        f"model: random Llama, {m['layers']} layers, hidden {m['hidden']}, {m['kv_heads']} KV heads x {m['head_dim']}, "
        f"{m['dtype']} on {r['device']}; prefill pid {r['prefill_pid']}, decode pid {r['decode_pid']}",
        f"prefill: {r['prefill']['prefill_s'] * 1e3:.0f} ms compute, saved {r['prefill']['stored']} blocks in "
        f"{r['prefill']['save_s'] * 1e3:.1f} ms",
        "",
        f"{'scenario':<22} {'cached':>7} {'tier':>7} {'TTFT ms':>9} {'vs recompute':>13}  tokens",
    ]
    base = r["scenarios"]["full recompute"]["ttft_s"]
    for name, s in r["scenarios"].items():
        lines.append(
            f"{name:<22} {s['cached_tokens']:>7} {s['tier']:>7} {s['ttft_s'] * 1e3:>9.1f} {base / s['ttft_s']:>12.1f}x  "
            f"{'= reference' if s['tokens_equal'] else 'DIFFER'}"
        )
    lines.append("")
    lines.append(
        "greedy tokens equal the single-process reference in every scenario"
        if r["ok"]
        else "MISMATCH: some scenario's tokens differ"
    )
    return "\n".join(lines)


def main(a: argparse.Namespace) -> int:
    a.layers = 4 if a.layers is None else a.layers
    a.hidden = 256 if a.hidden is None else a.hidden
    t0 = time.perf_counter()
    r = run(a)
    r["wall_s"] = time.perf_counter() - t0
    print(json.dumps(r) if a.json else format_table(r))
    return 0 if r["ok"] else 1

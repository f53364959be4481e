"""``kvstore demo vllm``: disaggregated prefill and decode in real vLLM engine processes.

A private node (or ``--target``), a locally made model (``--layers``, ``--hidden``) and
three engine processes with vLLM's defaults (prefix caching on): a plain one (no
connector: the ``recompute`` reference), a prefill engine (``kv_producer``) and a decode
engine (``kv_consumer``).  Each scenario uses a fresh prompt; the plain engine computes
it for the reference tokens, the prefill engine computes and stores it, and the decode
engine's time to first token is measured.  The decode request carries the prefill
response's ``kv_transfer_params`` (as a disaggregated router passes them on), so the
connector waits for exactly the chunks the prefill saved, no longer than its deadline:

* ``dram_hit``: the KV is in the node's DRAM;
* ``nvme_hit``: the node was restarted between prefill and decode (its DRAM blocks
  were demoted to NVMe at the stop), so every block comes back from NVMe; the decode
  engine first confirms the chunks are stored (it loads them, then drops its own
  prefix cache), since a restart loses a save still in flight, and after the restart a
  short probe re-attaches both engines to the new node process (:func:`_reattach`);
* ``partial_hit``: prefill stored only the first half of the prompt;
* ``remote_hit``: a fourth engine whose node is another member of a two-node cluster
  (a real etcd, replication 2) finds the chunks cluster-wide, fetches them over TCP into
  its own node and loads them from there;
* ``multi_turn``: a conversation's second turn.  The prefill engine answers turn 1
  (``ANSWER_TOKENS`` tokens, saved as they are decoded); turn 2 is turn 1's prompt and
  answer and a new message, served by the decode engine: its ``hit_tokens`` count the
  answer's tokens the store supplied too.

``hit_tokens``: the prompt tokens the store supplied (``kv_transfer_params["kvstore"]``'s
``external_tokens``).

``itl_during_load``: a request decoding ``ITL_TOKENS`` tokens on the decode engine, alone and
then while a prompt of ``--prompt-tokens`` loads from NVMe (added a few steps into its
decode; the node was restarted, so every chunk comes from disk): its inter-token latency
p50/p99 both ways and ``itl_p99_ratio``; and with the same arrival once the prompt is in
vLLM's own prefix cache (no load: what the arrival itself costs), ``itl_p99_ratio_vs_arrival``.  With ``--async-loads auto`` (the default) that load
runs in the background (vLLM's ``load_kv_async``); ``never`` shows the stall it replaces.

The demo forces what it demonstrates and says what did not happen: ``failed`` names each
check that failed (:func:`failed_checks`: tokens that differ from the reference, a hit
scenario the store supplied nothing to in some run, an NVMe load in ``itl_during_load``
that did not happen), ``ok`` is true when none did, and the exit status is 1 otherwise.

It also measures the connector's own data path in this process, on the same page
geometry: saving and loading one prompt's KV through the GPU agent against a plain copy
of the same bytes (``connector``).

Every engine first serves one warm-up prompt, so no TTFT includes first-request costs.
Every engine, the plain one included, runs its worker on the same cores (all of this
process's CPUs: :func:`kvstore.demo.engine.cpu_binding`), so the ratios compare like
with like (vLLM's own default binding keeps a core back from an engine without a
connector only); the output says which cores each engine's worker used (``engine_cpus``).
Run it in ``.venv-vllm`` (``./scripts/setup.sh --vllm``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.vocabulary import percentile

SCENARIOS = ("recompute", "dram_hit", "nvme_hit", "partial_hit", "remote_hit", "multi_turn")
ITL_TOKENS = 64
"""Tokens the decoding request of ``itl_during_load`` generates."""
ANSWER_TOKENS = 320
"""Turn 1's answer in ``multi_turn``: longer than a chunk, so whole chunks of it are stored."""
MESSAGE_TOKENS = 64
"""Turn 2's new message in ``multi_turn``."""


RETRY_S = 1.0
"""The engines' ``retry_s``: after a node restart they attach to it again this soon."""


def _reattach(prefill: Any, decode: Any, seed: int) -> None:
    """After a node restart: one short prompt saved by ``prefill`` and loaded by ``decode``,
    then the engines' deadline and ``RETRY_S``.  An engine's first store call after the
    restart can fail (its link still on the old process: the call ends at the deadline and
    the connector attaches afresh ``retry_s`` later); made here, it costs this probe a miss,
    not the scenario that follows it."""
    p = _prompt(512, seed)
    params = prefill.generate(p, max_tokens=1)["kv_transfer_params"]
    decode.generate(p, max_tokens=1, kv_transfer_params=params)
    time.sleep(2.0 + RETRY_S)  # ConnectorSettings.deadline_s's default, then retry_s


def _prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, 31000, n).tolist()


def run(a: argparse.Namespace) -> dict[str, Any]:
    from client import KVClient
    from kvstore.children import private_node
    from kvstore.demo.engine import EngineProcess, make_model

    n = a.prompt_tokens
    layers = a.layers if a.layers is not None else 4
    hidden = a.hidden if a.hidden is not None else 512
    max_tokens = n + a.new_tokens + 64
    with tempfile.TemporaryDirectory(prefix="kvstore-demo-vllm-") as tmp, contextlib.ExitStack() as stack:
        d = Path(tmp)
        logs = Path(a.log_dir) if getattr(a, "log_dir", None) else d
        logs.mkdir(parents=True, exist_ok=True)
        model = make_model(d / "model", layers=layers, hidden=hidden, max_tokens=max_tokens)
        node = None
        remote_extra: dict[str, Any] | None = None
        if a.target:
            target = a.target
        else:
            cluster = local_cluster(stack, d)
            node = stack.enter_context(
                private_node(d / "node", *cluster[1], dram=a.dram, nvme=a.nvme, log_path=logs / "node.log")
            )
            target = node.target
            if cluster[0]:
                other = stack.enter_context(
                    private_node(d / "other", *cluster[1], dram=a.dram, nvme=a.nvme, log_path=logs / "other.log")
                )
                remote_extra = {"target": other.target, "lookup_target": cluster[0], "retry_s": RETRY_S}
        heads = max(2, hidden // 64)
        kv_per_token = layers * 2 * max(1, heads // 2) * 64 * 4
        kv_bytes = max(64 << 20, 2 * max_tokens * kv_per_token)
        extra = {"target": target, "retry_s": RETRY_S}
        consumer = {"target": target, "async_loads": a.async_loads, "retry_s": RETRY_S}
        if remote_extra is not None:
            remote_extra["async_loads"] = a.async_loads
        t0 = time.perf_counter()
        engines = {
            "plain": EngineProcess(model, max_tokens=max_tokens, kv_bytes=kv_bytes, log_path=logs / "plain.log"),
            "prefill": EngineProcess(
                model,
                max_tokens=max_tokens,
                kv_bytes=kv_bytes,
                connector={"role": "kv_producer", "extra": extra},
                log_path=logs / "prefill.log",
            ),
            "decode": EngineProcess(
                model,
                max_tokens=max_tokens,
                kv_bytes=kv_bytes,
                connector={"role": "kv_consumer", "extra": consumer},
                log_path=logs / "decode.log",
            ),
        }
        if remote_extra is not None:
            engines["remote"] = EngineProcess(
                model,
                max_tokens=max_tokens,
                kv_bytes=kv_bytes,
                connector={"role": "kv_consumer", "extra": remote_extra},
                log_path=logs / "remote.log",
            )
        for e in engines.values():
            stack.callback(e.close)
        for e in engines.values():
            e.wait_ready(timeout=600)
        start_s = time.perf_counter() - t0
        for i, e in enumerate(engines.values()):
            e.generate(_prompt(n, 1000 + i), max_tokens=2)  # warm-up
        client = stack.enter_context(KVClient(target))

        out: dict[str, dict[str, Any]] = {}

        def record(name: str, r: dict[str, Any], ref: dict[str, Any]) -> None:
            info = (r.get("kv_transfer_params") or {}).get("kvstore", {})
            hit = info.get("external_tokens", int(info.get("hit_chunks", 0)) * int(info.get("chunk_tokens", 0)))
            row = {
                "ttft_ms": r["ttft_ms"],
                "hit_tokens": int(hit),
                "tokens_equal": r["tokens"] == ref["tokens"],
            }
            best = out.get(name)
            misses = (best or {}).get("runs_without_hit", 0) + (hit <= 0 and name != "recompute")
            if best is None or row["ttft_ms"] < best["ttft_ms"] or not row["tokens_equal"]:
                out[name] = row if best is None or row["tokens_equal"] or not best["tokens_equal"] else best
            out[name]["runs_without_hit"] = misses

        for rep in range(a.repeat):
            for k, name in enumerate(SCENARIOS[1:]):
                if (
                    (name == "nvme_hit" and node is None)
                    or (name == "remote_hit" and "remote" not in engines)
                    or (name == "multi_turn" and n <= ANSWER_TOKENS + MESSAGE_TOKENS)
                ):
                    continue
                tokens = _prompt(n, 10 * rep + k)
                if name == "multi_turn":  # turn 1, then turn 2 = turn 1 + its answer + a new message
                    first = tokens[: n - ANSWER_TOKENS - MESSAGE_TOKENS]
                    produced = engines["prefill"].generate(first, max_tokens=ANSWER_TOKENS)
                    tokens = first + produced["tokens"] + tokens[len(first) + ANSWER_TOKENS :]
                ref = engines["plain"].generate(tokens, max_tokens=a.new_tokens)
                record("recompute", {**ref, "kv_transfer_params": None}, ref)
                if name != "multi_turn":
                    stored = tokens[: n // 2] if name == "partial_hit" else tokens
                    produced = engines["prefill"].generate(stored, max_tokens=1)
                params = produced["kv_transfer_params"]
                if name == "nvme_hit":
                    assert node is not None
                    engines["decode"].generate(tokens, max_tokens=1, kv_transfer_params=params)  # all stored
                    engines["decode"].reset_prefix_cache()
                    node.restart()
                    _reattach(engines["prefill"], engines["decode"], 7000 + 10 * rep)
                reader = engines["remote" if name == "remote_hit" else "decode"]
                record(name, reader.generate(tokens, max_tokens=a.new_tokens, kv_transfer_params=params), ref)
        itl = itl_during_load(engines["prefill"], engines["decode"], node, n, a.repeat) if node is not None else None
        overhead = connector_overhead(client, layers=layers, hidden=hidden, tokens=n)
        failed = failed_checks(out, itl)
        rec = out["recompute"]["ttft_ms"]
        for row in out.values():
            row["ttft_ratio"] = row["ttft_ms"] / rec if rec else None
        return {
            "scenarios": out,
            "prompt_tokens": n,
            "new_tokens": a.new_tokens,
            "model": {"layers": layers, "hidden": hidden},
            "kv_bytes_per_token": kv_per_token,
            "engine_start_s": start_s,
            "engine_cpus": {name: e.cpus for name, e in engines.items()},
            "target": a.target or "private node",
            "connector": overhead,
            "itl_during_load": itl,
            "async_loads": a.async_loads,
            "failed": failed,
            "ok": not failed,
        }


def failed_checks(scenarios: dict[str, dict[str, Any]], itl: dict[str, Any] | None) -> list[str]:
    """The demo's checks that failed, by name: a scenario whose tokens differ from the
    reference's (``<scenario>.tokens_equal``), a hit scenario the store supplied nothing to
    in any run (``<scenario>.hit_tokens``: it demonstrated a recompute, not a load), and
    ``itl_during_load``'s two (its tokens, and its NVMe load having happened: ``loaded``)."""
    failed = [f"{name}.tokens_equal" for name, row in scenarios.items() if not row["tokens_equal"]]
    failed += [f"{name}.hit_tokens" for name, row in scenarios.items() if row.get("runs_without_hit")]
    if itl is not None:
        failed += [f"itl_during_load.{k}" for k in ("tokens_equal", "loaded") if not itl[k]]
    return failed


def _itl(result: dict[str, Any]) -> list[float]:
    t = result["token_ms"]
    return [b - a for a, b in zip(t, t[1:])]


def itl_during_load(prefill: Any, decode: Any, node: Any, n: int, repeat: int) -> dict[str, Any]:
    """Inter-token latency of a decoding request alone, and while a prompt of ``n`` tokens
    loads from NVMe on the same engine (see the module docstring).  p50/p99 over every
    interval of ``repeat`` runs each way."""
    from kvstore.demo.engine import request

    alone: list[float] = []
    loaded: list[float] = []
    arrived: list[float] = []  # the same arrival, its prompt in vLLM's own prefix cache: no load
    load_ms: list[float] = []
    nvme_tokens: list[int] = []  # per run: the prompt tokens the decode engine loaded from NVMe
    equal = True
    for rep in range(repeat):
        running = _prompt(256, 5000 + rep)
        ref = decode.batch([request(running, max_tokens=ITL_TOKENS)])[0]
        alone += _itl(ref)
        big = _prompt(n, 6000 + rep)
        big_ref = prefill.generate(big, max_tokens=1)
        params = big_ref["kv_transfer_params"]
        decode.generate(big, max_tokens=1, kv_transfer_params=params)  # every chunk is committed
        decode.reset_prefix_cache()
        node.restart()  # DRAM demoted to NVMe at the stop: the load comes from disk
        _reattach(prefill, decode, 8000 + rep)
        got = decode.batch(
            [
                request(_prompt(256, 5000 + rep), max_tokens=ITL_TOKENS),
                request(big, max_tokens=1, kv_transfer_params=params, start_after=8),
            ]
        )
        equal = equal and got[0]["tokens"] == ref["tokens"] and got[1]["tokens"] == big_ref["tokens"]
        info = (got[1].get("kv_transfer_params") or {}).get("kvstore", {})
        nvme_tokens.append(int(info.get("external_tokens", 0)))
        loaded += _itl(got[0])
        load_ms.append(got[1]["ttft_ms"])
        again = decode.batch(
            [
                request(_prompt(256, 5000 + rep), max_tokens=ITL_TOKENS),
                request(big, max_tokens=1, kv_transfer_params=params, start_after=8),
            ]
        )
        arrived += _itl(again[0])
        decode.reset_prefix_cache()

    def pct(xs: list[float], q: float) -> float:
        return percentile(xs, q) if xs else 0.0

    return {
        "itl_ms_alone": {"p50": pct(alone, 50), "p99": pct(alone, 99)},
        "itl_ms_during_load": {"p50": pct(loaded, 50), "p99": pct(loaded, 99)},
        "itl_ms_arrival_no_load": {"p50": pct(arrived, 50), "p99": pct(arrived, 99)},
        "itl_p99_ratio_vs_arrival": pct(loaded, 99) / pct(arrived, 99) if arrived else None,
        "itl_p99_ratio": pct(loaded, 99) / pct(alone, 99) if alone else None,
        "load_ttft_ms": min(load_ms) if load_ms else None,
        "nvme_load_tokens": nvme_tokens,
        "tokens_equal": equal,
        "loaded": bool(nvme_tokens) and all(t > 0 for t in nvme_tokens),
    }


def local_cluster(stack: contextlib.ExitStack, d: Path) -> tuple[str, tuple[str, ...]]:
    """A local etcd and the flags that make a node a member of a two-node cluster at
    replication 2 (every node owns every chunk); ("", ()) where etcd is not installed."""
    import asyncio
    import uuid

    from kvstore.cluster.etcd import ClusterStore
    from kvstore.cluster.local_etcd import LocalEtcd, find_etcd

    if find_etcd() is None:
        return "", ()
    etcd = stack.enter_context(LocalEtcd(d / "etcd"))
    name = f"demo-{uuid.uuid4().hex[:8]}"

    async def replicate() -> None:
        store = ClusterStore(etcd.endpoint, name)
        try:
            await store.set_config("replication", 2)
        finally:
            await store.close()

    asyncio.run(replicate())
    return f"etcd://{etcd.endpoint}/{name}", ("--etcd", etcd.endpoint, "--cluster", name)


def connector_overhead(client: Any, *, layers: int, hidden: int, tokens: int, repeat: int = 5) -> dict[str, Any]:
    """The connector's data path for one prompt, in this process: lookup, save and load of
    its chunks through the GPU agent over vLLM's CPU page geometry, against a plain copy of
    the same bytes (the floor any connector pays).  Best of ``repeat``."""
    import uuid

    import torch

    from gpu_agent.agent import AgentConfig, GPUAgent
    from gpu_agent.buffers import EngineBuffers
    from gpu_agent.vllm.spec import EngineSpec

    heads = max(1, max(2, hidden // 64) // 2)
    block = 128
    spec = EngineSpec("demo-overhead", "main", "float32", layers, heads, 64, block, "vllm:cpu:LBHNC")
    chunk = 256
    pages = tokens // block + 1
    kv = torch.randn(layers, pages, heads, block, 128)
    bufs = EngineBuffers.from_tensors(list(kv), pages)
    ids = list(range(pages))
    nbytes = tokens // chunk * chunk * spec.layout().token_bytes * 2 * layers
    flat = kv.reshape(-1).view(torch.uint8)[:nbytes]
    dst = torch.zeros_like(flat)  # mapped once, as the arena is: the reference pays no page faults
    best: dict[str, float] = {}

    def keep(name: str, dt: float) -> None:
        best[name] = min(best.get(name, dt), dt)

    agent = GPUAgent(client, spec.layout(), spec.namespace(chunk), device="cpu", config=AgentConfig(hbm_bytes=0))
    try:
        for _ in range(repeat):
            ns = spec.namespace(chunk, salt=uuid.uuid4().hex)  # a fresh prefix every round
            toks = list(range(tokens))
            t0 = time.perf_counter()
            agent.lookup(toks, namespace=ns)
            keep("lookup_ms", time.perf_counter() - t0)
            t0 = time.perf_counter()
            agent.save(toks, bufs, ids, namespace=ns).wait(60)
            keep("save_ms", time.perf_counter() - t0)
            t0 = time.perf_counter()
            agent.load(toks, bufs, ids, namespace=ns).wait(60)
            keep("load_ms", time.perf_counter() - t0)
            t0 = time.perf_counter()
            dst.copy_(flat)
            keep("memcpy_ms", time.perf_counter() - t0)
            agent.client.delete(agent.keys(toks, ns))
    finally:
        agent.close()
    ms = {k: v * 1e3 for k, v in best.items()}
    out: dict[str, float | None] = dict(ms)
    out["bytes"] = nbytes
    out["load_x_memcpy"] = ms["memcpy_ms"] / ms["load_ms"] if ms["load_ms"] else None
    out["save_x_memcpy"] = ms["memcpy_ms"] / ms["save_ms"] if ms["save_ms"] else None
    return out


def format_table(r: dict[str, Any]) -> str:
    lines = [
        f"kvstore demo vllm: {r['prompt_tokens']}-token prompts, {r['model']['layers']} layers x {r['model']['hidden']} hidden "
        f"({r['kv_bytes_per_token'] * r['prompt_tokens'] / (1 << 20):.1f} MiB of KV per prompt), engines up in {r['engine_start_s']:.0f} s",
        f"{'scenario':<14}{'TTFT ms':>10}{'x recompute':>13}{'hit tokens':>12}  tokens equal",
    ]
    for name, row in r["scenarios"].items():
        lines.append(
            f"{name:<14}{row['ttft_ms']:>10.1f}{row['ttft_ratio']:>13.2f}{row['hit_tokens']:>12}  {'yes' if row['tokens_equal'] else 'NO'}"
        )
    cpus = r.get("engine_cpus") or {}
    if cpus:
        lines.append(
            "engine workers' CPUs (VLLM_CPU_OMP_THREADS_BIND): " + "; ".join(f"{k} {v}" for k, v in cpus.items())
        )
    itl = r.get("itl_during_load")
    if itl:
        lines.append(
            f"inter-token latency of a decoding request (async_loads={r['async_loads']}): alone p50 "
            f"{itl['itl_ms_alone']['p50']:.1f} / p99 {itl['itl_ms_alone']['p99']:.1f} ms; while a "
            f"{r['prompt_tokens']}-token prompt loads from NVMe p50 {itl['itl_ms_during_load']['p50']:.1f} / p99 "
            f"{itl['itl_ms_during_load']['p99']:.1f} ms (p99 x {itl['itl_p99_ratio']:.2f}; x "
            f"{itl['itl_p99_ratio_vs_arrival']:.2f} the same arrival without a load, p99 "
            f"{itl['itl_ms_arrival_no_load']['p99']:.1f} ms; that load's TTFT {itl['load_ttft_ms']:.0f} ms)"
        )
    c = r["connector"]
    lines.append(
        f"connector data path for one prompt ({c['bytes'] / (1 << 20):.1f} MiB): lookup {c['lookup_ms']:.2f} ms, "
        f"save {c['save_ms']:.1f} ms ({c['save_x_memcpy']:.2f} x memcpy), load {c['load_ms']:.1f} ms "
        f"({c['load_x_memcpy']:.2f} x memcpy; memcpy {c['memcpy_ms']:.1f} ms)"
    )
    if r.get("failed"):
        lines.append("FAILED: " + ", ".join(r["failed"]))
    return "\n".join(lines)


def main(a: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    r = run(a)
    r["wall_s"] = time.perf_counter() - t0
    print(json.dumps(r) if a.json else format_table(r))
    return 0 if r["ok"] else 1

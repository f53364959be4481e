"""``kvstore bench connector``: the engine's data path (the GPU agent the vLLM connector
drives) against a memcpy of the same bytes, measured in the same run.  Needs torch, not vLLM.

For each page layout (``--layouts``: ``cpu``, vLLM's CPU backend, one tensor per layer of
``[pages, kv_heads, 128, 2 * head_dim]``; ``cuda``, the flash layout ``[2, pages, 16,
kv_heads, head_dim]`` on CPU tensors, so the same geometry runs without a device) it
starts from one prompt of ``--prompt-tokens`` tokens of a model of ``--model`` shape,
scattered over the engine's pages (a shuffled block table, what a busy engine hands over),
and reports:

* ``save_x_memcpy`` / ``load_x_memcpy``: one request's ``GPUAgent.save`` (until committed)
  and ``GPUAgent.load`` (until its leases are given back), with ``verify_loads`` on (the
  default), against one ``torch`` copy of the same number of bytes between pre-faulted
  buffers; ``*_noverify`` the same with verification off; ``save_ahead_x_memcpy`` the save
  as the connector makes it, its Reserve sent before the step computed
  (``GPUAgent.reserve_ahead``) and answered by the time the save starts.  Best of ``--repeat``.
* ``load_ms``: p50/p99 per-request load latency of a DRAM hit, an NVMe hit (a node whose
  DRAM holds fewer prompts than are cycled through, so each load promotes from disk) and a
  remote hit (the chunks are on another node: ``gpu_agent.pull`` fetches them over TCP, then
  the load is local — what the connector does with ``lookup_target``).
* ``put_ms``: p50/p99 of one request's save with the node's DRAM empty and with it full
  (every save demotes older blocks to NVMe), and ``put_p99_full_x_empty``.

Nodes are private ``kvstore serve`` processes, stopped at the end.  Every figure is a ratio
or a latency measured in this run on this machine; anything else running skews them.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from kvstore.bench.kit import add_report_arguments, repeats, report
from kvstore.bench.nodes import bench_node
from kvstore.errors import InvalidArgument
from kvstore.vocabulary import percentiles

MiB = 1 << 20
CLEAN_AHEAD = 0.5  # the NVMe node's --dram-clean-ahead: room for two whole prompts in a DRAM of four


def _disk_write_gbps(workdir: Path, nbytes: int) -> float:
    """Sequential write + fdatasync of ``nbytes`` where the NVMe tier lives (best of two)."""
    import os

    buf = os.urandom(min(nbytes, 8 * MiB))
    best = float("inf")
    path = workdir / "disk-probe"
    for _ in range(2):
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            left = nbytes
            while left > 0:
                left -= f.write(buf[: min(left, len(buf))])
            f.flush()
            os.fdatasync(f.fileno())
        best = min(best, time.perf_counter() - t0)
    path.unlink()
    return nbytes / best / 1e9


@dataclasses.dataclass(frozen=True)
class Shape:
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str

    @classmethod
    def parse(cls, text: str) -> Shape:
        """``LAYERS,KV_HEADS,HEAD_DIM,DTYPE`` (e.g. ``32,8,128,bfloat16``: Llama-3-8B)."""
        parts = [p.strip() for p in text.split(",")]
        if len(parts) != 4:
            raise InvalidArgument(f"--model takes LAYERS,KV_HEADS,HEAD_DIM,DTYPE, got {text!r}")
        try:
            layers, heads, dim = (int(p) for p in parts[:3])
        except ValueError:
            raise InvalidArgument(f"--model takes LAYERS,KV_HEADS,HEAD_DIM,DTYPE, got {text!r}") from None
        if min(layers, heads, dim) < 1 or parts[3] not in ("float16", "bfloat16", "float32"):
            raise InvalidArgument(f"--model: positive sizes and a float16/bfloat16/float32 dtype, got {text!r}")
        return cls(layers, heads, dim, parts[3])

    def token_bytes(self) -> int:
        item = 4 if self.dtype == "float32" else 2
        return 2 * self.layers * self.kv_heads * self.head_dim * item


class Engine:
    """An engine's KV buffers in one layout, a shuffled block table, and an agent on a node."""

    def __init__(self, layout: str, shape: Shape, tokens: int, client: Any, *, verify: bool) -> None:
        import torch

        from gpu_agent.agent import AgentConfig, GPUAgent
        from gpu_agent.buffers import EngineBuffers
        from gpu_agent.vllm.spec import EngineSpec

        page = 128 if layout == "cpu" else 16
        self.chunk = 256
        self.tokens = tokens // self.chunk * self.chunk
        if self.tokens == 0:
            raise InvalidArgument(f"--prompt-tokens must be at least one chunk ({self.chunk})")
        pages = self.tokens // page * 2 + 1  # room to scatter the prompt's pages
        dt = getattr(torch, shape.dtype)
        g = torch.Generator().manual_seed(0)
        if layout == "cpu":
            tensors = [
                torch.randn(pages, shape.kv_heads, page, 2 * shape.head_dim, generator=g).to(dt)
                for _ in range(shape.layers)
            ]
            page_layout = "vllm:cpu:LBHNC"
        else:
            tensors = [
                torch.randn(2, pages, page, shape.kv_heads, shape.head_dim, generator=g).to(dt)
                for _ in range(shape.layers)
            ]
            page_layout = ""
        self.buffers = EngineBuffers.from_tensors(tensors, pages)
        table = list(range(pages))
        random.Random(1).shuffle(table)
        self.block_ids = table[: self.tokens // page]
        self.spec = EngineSpec(
            "bench-connector", "main", shape.dtype, shape.layers, shape.kv_heads, shape.head_dim, page, page_layout
        )
        self.agent = GPUAgent(
            client,
            self.spec.layout(),
            self.spec.namespace(self.chunk),
            device="cpu",
            config=AgentConfig(hbm_bytes=0, verify_loads=verify),
        )
        self.nbytes = self.tokens * shape.token_bytes()
        self.toks = list(range(self.tokens))

    def namespace(self) -> Any:
        return self.spec.namespace(self.chunk, salt=uuid.uuid4().hex)  # a prompt the store has never seen

    def save(self, ns: Any, ahead: Any = None) -> Any:
        return self.agent.save(self.toks, self.buffers, self.block_ids, namespace=ns, ahead=ahead).wait(120)

    def reserve_ahead(self, ns: Any) -> Any:
        """What the connector does before a step computes; waited for here (the compute's time)."""
        ahead = self.agent.reserve_ahead(self.toks, self.block_ids, namespace=ns)
        ahead.wait(120)
        return ahead

    def load(self, ns: Any) -> bool:
        h = self.agent.load(self.toks, self.buffers, self.block_ids, namespace=ns)
        return h.wait(120) and h.num_tokens == self.tokens

    def delete(self, ns: Any) -> None:
        self.agent.client.delete(self.agent.keys(self.toks, ns))

    def close(self) -> None:
        self.agent.close()


def _ms(f: Callable[..., Any], *args: Any) -> tuple[float, Any]:
    t0 = time.perf_counter()
    r = f(*args)
    return (time.perf_counter() - t0) * 1e3, r


def _pcts(xs: list[float]) -> dict[str, Any]:
    return {**percentiles(xs, digits=3), "n": len(xs)}


def _memcpy_ms(nbytes: int) -> Callable[[], float]:
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)  # both touched: the reference pays no page faults

    def run() -> float:
        return _ms(dst.copy_, src)[0]

    return run


def ratios(layout: str, shape: Shape, tokens: int, target: str, repeat: int) -> dict[str, Any]:
    """save/load × memcpy for one layout, verification on and off, interleaved per rep."""
    from client import KVClient

    out: dict[str, Any] = {}
    client = KVClient(target)
    engines = {v: Engine(layout, shape, tokens, client, verify=v) for v in (True, False)}
    memcpy = _memcpy_ms(engines[True].nbytes)
    best: dict[str, float] = {}
    try:
        for _ in range(repeat):
            for verify, e in engines.items():
                sfx = "" if verify else "_noverify"
                ns = e.namespace()
                dt, res = _ms(e.save, ns)
                if res.stored != e.tokens // e.chunk:
                    raise RuntimeError(f"the benchmark's save stored {res.stored} of {e.tokens // e.chunk} blocks")
                best["save" + sfx] = min(best.get("save" + sfx, dt), dt)
                dt, ok = _ms(e.load, ns)
                if not ok:
                    raise RuntimeError("the benchmark's load did not load the whole prompt")
                best["load" + sfx] = min(best.get("load" + sfx, dt), dt)
                e.delete(ns)
                if verify:  # the engine's save: its Reserve answered while the step computed
                    ns = e.namespace()
                    ahead = e.reserve_ahead(ns)
                    dt, res = _ms(e.save, ns, ahead)
                    if res.stored != e.tokens // e.chunk:
                        raise RuntimeError(f"the benchmark's save stored {res.stored} of {e.tokens // e.chunk} blocks")
                    best["save_ahead"] = min(best.get("save_ahead", dt), dt)
                    e.delete(ns)
            m = memcpy()
            best["memcpy"] = min(best.get("memcpy", m), m)
        e = engines[True]
        out["bytes"] = e.nbytes
        out["memcpy_ms"] = round(best["memcpy"], 3)
        out["memcpy_gbps"] = round(e.nbytes / best["memcpy"] / 1e6, 2)
        out["save_ahead_ms"] = round(best["save_ahead"], 3)
        out["save_ahead_x_memcpy"] = round(best["memcpy"] / best["save_ahead"], 3)
        for k in ("save", "load", "save_noverify", "load_noverify"):
            out[k + "_ms"] = round(best[k], 3)
            out[k.replace("_noverify", "") + "_x_memcpy" + ("_noverify" if "noverify" in k else "")] = round(
                best["memcpy"] / best[k], 3
            )
        out["copy_threads"] = e.agent._host.threads if e.agent._host is not None else 0
    finally:
        for e in engines.values():
            e.close()
        client.close()
    return out


def latencies(
    shape: Shape, tokens: int, workdir: Path, requests: int, progress: Callable[[str], None]
) -> dict[str, Any]:
    """Per-request load latency from DRAM, NVMe and a remote node; put latency with DRAM
    empty and full (``cpu`` layout)."""
    from client import KVClient
    from gpu_agent.pull import pull_missing
    from kvstore.keys import chunk_keys

    prompt = tokens // 256 * 256 * shape.token_bytes()
    held = 4  # prompts the NVMe node's DRAM holds; twice as many are cycled, so every load promotes
    cycle = 2 * held
    out: dict[str, Any] = {"load_ms": {}, "put_ms": {}}
    small = bench_node(
        held * prompt + prompt // 2,
        workdir,
        nvme=(cycle + 4) * prompt + 256 * MiB,
        extra=("--dram-clean-ahead", str(CLEAN_AHEAD)),
        tag="nvme",
    )
    big = bench_node(2 * prompt + 256 * MiB, workdir, tag="dram")
    remote = bench_node(2 * prompt + 256 * MiB, workdir, tag="remote")
    disk = _disk_write_gbps(workdir, prompt)
    out["disk_write_gbps"] = round(disk, 3)
    try:
        with KVClient(big.target) as cb, KVClient(small.target) as cs, KVClient(str(remote.endpoints["grpc"])) as cr:
            e = Engine("cpu", shape, tokens, cb, verify=True)
            try:
                progress("DRAM hits")
                ns = e.namespace()
                e.save(ns)
                out["load_ms"]["dram"] = _pcts([_ms(e.load, ns)[0] for _ in range(requests)])
                e.delete(ns)
                progress("remote hits")
                rns = [e.namespace() for _ in range(requests)]
                remote_agent = Engine("cpu", shape, tokens, KVClient(remote.target), verify=True)
                try:
                    xs = []
                    for n in rns:
                        remote_agent.save(n)
                        chain = chunk_keys(e.toks, n)

                        def pull_then_load(n: Any = n, chain: list[Any] = chain) -> bool:
                            pull_missing(cb, cr, chain, 0, n, e.chunk)
                            return e.load(n)

                        dt, ok = _ms(pull_then_load)
                        if not ok:
                            raise RuntimeError("a remote hit did not load the whole prompt")
                        xs.append(dt)
                        e.delete(n)
                        remote_agent.delete(n)
                    out["load_ms"]["remote"] = _pcts(xs)
                finally:
                    client = remote_agent.agent.client
                    remote_agent.close()
                    client.close()
            finally:
                e.close()
            e = Engine("cpu", shape, tokens, cs, verify=True)
            try:
                progress("puts, DRAM empty then full")
                # A full DRAM's puts come at half the disk's write rate: the background writer can
                # keep up, so a put waits on NVMe only if it falls behind (reserve_waited_on_nvme).
                pace = prompt / (0.5 * disk * 1e9)
                out["put_pace_s"] = round(pace, 4)
                empty: list[float] = []
                full: list[float] = []
                names: list[Any] = []
                waits0 = int(cs.stats()["counters"].get("reserve_waited_on_nvme", 0))
                for _ in range(max(1, -(-requests // 2))):  # a round: DRAM emptied, then `cycle` saves
                    for n in names:
                        e.delete(n)
                    names = []
                    time.sleep(pace * held)  # the cleaner's writes of the last round are done
                    for i in range(cycle):
                        n = e.namespace()
                        dt = _ms(e.save, n)[0]
                        (empty if i < 2 else full if i > held else []).append(dt)
                        names.append(n)
                        time.sleep(max(0.0, pace - dt / 1e3))
                out["put_waited_on_nvme"] = int(cs.stats()["counters"].get("reserve_waited_on_nvme", 0)) - waits0
                out["put_ms"]["dram_empty"] = _pcts(empty)
                out["put_ms"]["dram_full"] = _pcts(full)
                out["put_p99_full_x_empty"] = round(
                    out["put_ms"]["dram_full"]["p99"] / out["put_ms"]["dram_empty"]["p99"], 3
                )
                progress("NVMe hits")
                xs = []
                for i in range(requests):
                    n = names[i % cycle]  # oldest first: never one DRAM holds
                    tiers = cs.lookup(e.agent.keys(e.toks, n))
                    dt, ok = _ms(e.load, n)
                    if not ok:
                        raise RuntimeError("an NVMe hit did not load the whole prompt")
                    if tiers[0] == "nvme":
                        xs.append(dt)
                out["load_ms"]["nvme"] = _pcts(xs) if xs else None
            finally:
                e.close()
    finally:
        for n in (small, big, remote):
            n.stop()
    return out


def run_connector(a: argparse.Namespace, progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    shape = Shape.parse(a.model)
    layouts = [x.strip() for x in a.layouts.split(",") if x.strip()]
    bad = [x for x in layouts if x not in ("cpu", "cuda")]
    if bad or not layouts:
        raise InvalidArgument(f"--layouts takes cpu and/or cuda, got {a.layouts!r}")
    tokens = a.prompt_tokens
    if tokens < 256:
        raise InvalidArgument("--prompt-tokens must be at least 256 (one chunk)")
    prompt = tokens // 256 * 256 * shape.token_bytes()
    result: dict[str, Any] = {
        "bench": "connector",
        "model": dataclasses.asdict(shape),
        "prompt_tokens": tokens // 256 * 256,
        "prompt_bytes": prompt,
        "layouts": {},
    }
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-connector-") as d:
        work = Path(d)
        node = bench_node(2 * prompt + 256 * MiB, work)
        try:
            for lay in layouts:
                progress(f"{lay} layout: save/load x memcpy")
                result["layouts"][lay] = ratios(lay, shape, tokens, node.target, a.repeat)
        finally:
            node.stop()
        if not a.no_latency:
            result.update(latencies(shape, tokens, work, a.latency_requests, progress))
    return result


def print_connector(r: dict[str, Any], f: TextIO) -> None:
    m = r["model"]
    print(
        f"kvstore bench connector: one {r['prompt_tokens']}-token prompt, {m['layers']} layers x "
        f"{m['kv_heads']} kv heads x {m['head_dim']} {m['dtype']} ({r['prompt_bytes'] / MiB:.0f} MiB)",
        file=f,
    )
    print(
        f"{'layout':<7}{'memcpy':>10}{'save':>9}{'x':>6}{'load':>9}{'x':>6}  verify off: save x, load x; reserved ahead: save x",
        file=f,
    )
    for name, x in r["layouts"].items():
        print(
            f"{name:<7}{x['memcpy_ms']:>8.1f}ms{x['save_ms']:>7.1f}ms{x['save_x_memcpy']:>6.2f}"
            f"{x['load_ms']:>7.1f}ms{x['load_x_memcpy']:>6.2f}  {x['save_x_memcpy_noverify']:.2f}, {x['load_x_memcpy_noverify']:.2f}; "
            f"{x['save_ahead_x_memcpy']:.2f}",
            file=f,
        )
    for tier, p in (r.get("load_ms") or {}).items():
        if p:
            print(f"load, {tier} hit: p50 {p['p50']:.1f} ms, p99 {p['p99']:.1f} ms ({p['n']} requests)", file=f)
    put = r.get("put_ms") or {}
    if put:
        e, u = put["dram_empty"], put["dram_full"]
        print(
            f"put: DRAM empty p50 {e['p50']:.1f} / p99 {e['p99']:.1f} ms; DRAM full p50 {u['p50']:.1f} / p99 {u['p99']:.1f} ms "
            f"(p99 full/empty {r['put_p99_full_x_empty']:.2f})",
            file=f,
        )


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_report_arguments(p, quick="an 8-layer model, 6 latency requests, 2 reps", rep="reps per ratio")
    p.add_argument(
        "--model",
        default="32,8,128,bfloat16",
        metavar="L,H,D,DTYPE",
        help="the model's KV shape: layers, kv heads, head dim, dtype (default 32,8,128,bfloat16; --quick 8,8,128,bfloat16)",
    )
    p.add_argument("--prompt-tokens", type=int, default=4096, metavar="N", help="prompt length (default 4096)")
    p.add_argument("--layouts", default="cpu,cuda", help="page layouts, cpu (vLLM's CPU backend) and/or cuda (flash)")
    p.add_argument(
        "--latency-requests",
        type=int,
        default=None,
        metavar="N",
        help="requests per latency figure (default 20; --quick 6)",
    )
    p.add_argument("--no-latency", action="store_true", help="the ratios only")


def main(a: argparse.Namespace) -> int:
    from kvstore.progress import Progress

    repeats(a)
    if a.quick and a.model == "32,8,128,bfloat16":
        a.model = "8,8,128,bfloat16"
    a.latency_requests = a.latency_requests or (6 if a.quick else 20)
    if a.latency_requests < 1:
        raise InvalidArgument("--latency-requests must be at least 1")
    load_before = os.getloadavg()[0]
    with Progress("kvstore bench connector", unit="stages") as bar:
        result = run_connector(a, progress=lambda stage: bar.update(1, note=stage))
    return report(result, json_out=a.json, load_before=load_before, table=lambda f: print_connector(result, f))

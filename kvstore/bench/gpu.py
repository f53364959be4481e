"""``kvstore bench gpu``: the GPU agent's arena ↔ HBM bandwidth against plain pinned copies, and how much of
a layer-wise load hides behind compute.

    kvstore bench gpu [--layers 32 --kv-heads 8 --head-dim 128 --dtype bfloat16
                      --chunk-tokens 256 --blocks 16] [--table scattered|contiguous]
                      [--target unix:///...] [--json]

Measured in one run, on one CUDA device (``--device cpu`` runs the same code on CPU
tensors, to check the script itself; its numbers mean little):

1. **reference**: plain ``cudaMemcpyAsync`` between ``torch`` pinned host memory
   (``pin_memory=True``) and device memory on a non-default stream, H2D and D2H, with
   the same transfer sizes the agent issues (one copy per layer, K/V half and chunk);
   and with whole blocks as single copies.
2. **arena DMA**: the same copies from and to the node's arena registered by the agent
   with ``cudaHostRegister`` (no agent logic: the DMA path alone).
3. **agent**: ``GPUAgent.load`` (arena → the engine's pages; includes the Acquire and
   Release round trips) and ``GPUAgent.save`` (pages → arena; includes Reserve, the
   payload checksums and Commit), end to end, and ``load`` again from the HBM pool after
   ``prefetch``.  The engine's pages follow ``--table``: ``scattered`` (default: a
   shuffled block table, what a busy engine hands over) or ``contiguous`` (pages in
   order, which overstates what an engine sees).  Each timed save writes blocks the
   store does not hold: the ``Delete`` that makes it so runs untimed before each
   repetition and is reported on its own (``delete_round_trip_s``).
4. **overlap**: per layer, a matmul on the compute stream sized to take about as long
   as that layer's load; ``t_load`` (load alone), ``t_compute`` (compute alone) and
   ``t_overlap`` (``wait_layer(i)`` then layer i's matmul, while later layers load).
   ``hidden = t_load + t_compute - t_overlap``; reported as ``hidden / t_load`` and
   ``hidden / (t_load + t_compute)``.

architecture §15's target: arena → HBM ≥ 0.8 × pinned ``cudaMemcpyAsync``, overlapped with compute.
Starts a private node (DRAM sized for the blocks, no NVMe) unless ``--target`` is given.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

GB = 1e9


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--blocks", type=int, default=16, help="chunks per load/save (default 16: 4096 tokens)")
    p.add_argument("--iters", type=int, default=5, help="timed repetitions; the median is reported")
    p.add_argument(
        "--table",
        choices=("scattered", "contiguous"),
        default="scattered",
        help="the engine's block table: shuffled pages (default) or pages in order",
    )
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (a dry run of the script)")
    p.add_argument("--target", help="a running node (unix:///path); default: start a private one")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the report")


class Clock:
    """Times device work: CUDA events on the current stream, or wall time on CPU."""

    def __init__(self, device: Any) -> None:
        import torch

        self.torch = torch
        self.cuda = device.type == "cuda"

    def time(self, fn: Callable[[], Any], iters: int, *, before: Callable[[], Any] | None = None) -> float:
        """Median time of ``fn``; ``before`` runs ahead of each call, untimed."""
        torch = self.torch
        if before is not None:
            before()
        fn()  # warm-up
        self.sync()
        out = []
        for _ in range(iters):
            if before is not None:
                before()
            if self.cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                self.sync()
                t0 = time.perf_counter()
                a.record()
                fn()
                b.record()
                b.synchronize()
                # host-side time covers calls that wait on other streams' events; take the larger
                out.append(max(a.elapsed_time(b) / 1e3, time.perf_counter() - t0))
            else:
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)
        return statistics.median(out)

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()  # benchmark harness only: the agent never does this


def copies_on_stream(torch: Any, stream: Any, pairs: list[tuple[Any, Any]]) -> Callable[[], None]:
    def run() -> None:
        ctx = torch.cuda.stream(stream) if stream is not None else _null()
        with ctx:
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
        if stream is not None:
            torch.cuda.current_stream().wait_stream(stream)

    return run


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def run(a: argparse.Namespace) -> dict[str, Any]:
    import torch

    from client import KVClient
    from gpu_agent.agent import AgentConfig, GPUAgent
    from gpu_agent.copy_engine import host_tensor, normalize_device
    from gpu_agent.layout import KVCacheLayout
    from kvstore.block import BlockMeta
    from kvstore.children import private_node
    from kvstore.keys import NO_PARENT, ChunkKey

    if torch.device(a.device).type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            "no CUDA device: this benchmark measures arena <-> HBM copies (use --device cpu for a dry run)"
        )
    device = normalize_device(a.device)
    lay = KVCacheLayout(a.layers, a.kv_heads, a.head_dim, a.dtype, 16)
    C = a.chunk_tokens
    ns = lay.namespace("bench-model", chunk_tokens=C, tenant_salt=uuid.uuid4().hex)
    block = lay.block_bytes(C)
    total = block * a.blocks
    pages = a.blocks * C // lay.page_size
    run_bytes = C * lay.token_bytes  # one layer's K (or V) of one chunk: the agent's copy unit (contiguous pages)
    clock = Clock(device)
    dt = getattr(torch, lay.dtype)
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "block_bytes": block,
        "blocks": a.blocks,
        "bytes": total,
        "copy_bytes": run_bytes,
        "layout": {
            "layers": a.layers,
            "kv_heads": a.kv_heads,
            "head_dim": a.head_dim,
            "dtype": a.dtype,
            "chunk_tokens": C,
        },
        "table": a.table,
    }

    tmp = node = None
    if a.target:
        target = a.target
    else:
        tmp = tempfile.TemporaryDirectory(prefix="kvstore-gpubench-")
        dram_mib = (3 * total) // (1 << 20) + 256
        node = private_node(Path(tmp.name) / "node", dram=f"{dram_mib}MiB", nvme="0")
        target = node.target
    try:
        client = KVClient(target)
        agent = GPUAgent(client, lay, ns, device=device, config=AgentConfig(hbm_bytes=total + block))
        results["arena_pinned"] = agent.pinned
        h2d = torch.cuda.Stream(device) if device.type == "cuda" else None
        d2h = torch.cuda.Stream(device) if device.type == "cuda" else None

        # -- 1. reference: torch pinned memory <-> device, same sizes --------------------
        pin = device.type == "cuda"
        host = torch.empty(total, dtype=torch.uint8, pin_memory=pin)
        host.fill_(1)
        dev = torch.empty(total, dtype=torch.uint8, device=device)
        pieces = [(slice(o, o + run_bytes)) for o in range(0, total, run_bytes)]
        blocks_ = [(slice(o, o + block)) for o in range(0, total, block)]
        ref = {
            "h2d_small": clock.time(copies_on_stream(torch, h2d, [(dev[s], host[s]) for s in pieces]), a.iters),
            "d2h_small": clock.time(copies_on_stream(torch, d2h, [(host[s], dev[s]) for s in pieces]), a.iters),
            "h2d_block": clock.time(copies_on_stream(torch, h2d, [(dev[s], host[s]) for s in blocks_]), a.iters),
            "d2h_block": clock.time(copies_on_stream(torch, d2h, [(host[s], dev[s]) for s in blocks_]), a.iters),
        }
        results["reference_gbps"] = {k: total / v / GB for k, v in ref.items()}
        del host

        # -- 2. the registered arena, raw DMA ----------------------------------------------
        g = torch.Generator(device=device).manual_seed(0)
        src_kv = [torch.randn(lay.buffer_shape(pages), generator=g, device=device).to(dt) for _ in range(a.layers)]
        tokens = list(range(a.blocks * C))
        if a.table == "scattered":  # where the engine's allocator put each page: anywhere
            ids = torch.randperm(pages, generator=torch.Generator().manual_seed(1)).tolist()
        else:
            ids = list(range(pages))
        saved = agent.save(tokens, src_kv, ids).wait(timeout=600)
        if saved.stored + saved.existed != a.blocks:
            raise SystemExit(
                f"the node stored {saved.stored} of {a.blocks} blocks: give it more DRAM (--target) or fewer --blocks"
            )
        keys = agent.keys(tokens)
        with client.acquire(keys) as held:
            parts = [host_tensor(v) for vs in held.views if vs for v in vs]
            arena_pairs = []
            off = 0
            for t in parts:
                for o in range(0, t.numel(), run_bytes):
                    n = min(run_bytes, t.numel() - o)
                    arena_pairs.append((dev[off : off + n], t[o : o + n]))
                    off += n
            arena = {"h2d_small": clock.time(copies_on_stream(torch, h2d, arena_pairs), a.iters)}
        # HBM -> arena: into freshly reserved (writable) extents, aborted afterwards
        metas = [
            BlockMeta(ns.fingerprint, ChunkKey(os.urandom(16)), NO_PARENT, C, lay.dtype, lay.block_shape(C), block, 0)
            for _ in range(a.blocks)
        ]
        with client.reserve(metas) as res:
            wparts = [host_tensor(v) for vs in res.views if vs for v in vs]
            back_pairs = []
            off = 0
            for t in wparts:
                for o in range(0, t.numel(), run_bytes):
                    n = min(run_bytes, t.numel() - o)
                    back_pairs.append((t[o : o + n], dev[off : off + n]))
                    off += n
            if off == total:
                arena["d2h_small"] = clock.time(copies_on_stream(torch, d2h, back_pairs), a.iters)
        results["arena_gbps"] = {k: total / v / GB for k, v in arena.items()}

        # -- 3. the agent, end to end -------------------------------------------------------
        dst_kv = [torch.zeros(lay.buffer_shape(pages), dtype=dt, device=device) for _ in range(a.layers)]

        def load() -> None:
            h = agent.load(tokens, dst_kv, ids)
            for i in range(a.layers):
                h.wait_layer(i)
            h.wait()

        agent.pool.clear()
        t_load = clock.time(load, a.iters)
        same = all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(src_kv, dst_kv))

        def delete() -> None:  # save() skips stored blocks: each timed save writes them again
            client.delete(keys)

        def save() -> None:
            agent.save(tokens, src_kv, ids).wait(timeout=600)

        t_save = clock.time(save, a.iters, before=delete)
        t_delete = clock.time(delete, a.iters)
        results["delete_round_trip_s"] = t_delete
        agent.save(tokens, src_kv, ids).wait(timeout=600)
        agent.prefetch(tokens).result(timeout=600)
        t_load_hbm = clock.time(load, a.iters)
        results["agent_gbps"] = {
            "load_from_arena": total / t_load / GB,
            "save_to_arena": total / t_save / GB,
            "load_from_hbm_pool": total / t_load_hbm / GB,
        }
        results["agent_load_byte_identical"] = same
        results["ratio_arena_to_hbm_vs_pinned"] = {
            "raw_dma": results["arena_gbps"]["h2d_small"] / results["reference_gbps"]["h2d_small"],
            "raw_dma_d2h": results["arena_gbps"].get("d2h_small", 0.0) / results["reference_gbps"]["d2h_small"],
            "agent_load": results["agent_gbps"]["load_from_arena"] / results["reference_gbps"]["h2d_small"],
            "agent_load_vs_whole_blocks": results["agent_gbps"]["load_from_arena"]
            / results["reference_gbps"]["h2d_block"],
            "agent_save_vs_pinned_d2h": results["agent_gbps"]["save_to_arena"] / results["reference_gbps"]["d2h_small"],
        }

        # -- 4. layer-wise load overlapped with compute --------------------------------------
        agent.pool.clear()
        per_layer = t_load / a.layers
        n = 256
        x = torch.randn(n, n, device=device, dtype=torch.float32)
        while n < 16384:
            t_mm = clock.time(lambda: x @ x, 3)  # noqa: B023 - timed here, before x changes
            if t_mm >= per_layer:
                break
            n = int(n * 1.5)
            x = torch.randn(n, n, device=device, dtype=torch.float32)
        mm = lambda: x @ x  # noqa: E731

        def compute_only() -> None:
            for _ in range(a.layers):
                mm()

        def overlapped() -> None:
            h = agent.load(tokens, dst_kv, ids)
            for i in range(a.layers):
                h.wait_layer(i)  # the compute stream waits for layer i only
                mm()
            h.wait()

        t_compute = clock.time(compute_only, a.iters)
        t_overlap = clock.time(overlapped, a.iters)
        hidden = max(0.0, t_load + t_compute - t_overlap)
        results["overlap"] = {
            "matmul_n": n,
            "t_load_s": t_load,
            "t_compute_s": t_compute,
            "t_overlap_s": t_overlap,
            "hidden_s": hidden,
            "hidden_over_load": hidden / t_load,
            "hidden_over_total": hidden / (t_load + t_compute),
        }
        results["agent_stats"] = agent.stats()
        agent.close()
        client.close()
        return results
    finally:
        if node is not None:
            node.close()
        if tmp is not None:
            tmp.cleanup()


def format_report(r: dict[str, Any]) -> str:
    ref, arena, ag, ov = r["reference_gbps"], r["arena_gbps"], r["agent_gbps"], r["overlap"]
    lay = r["layout"]
    return "\n".join(
        [
            f"gpu_agent bench on {r['device']}: {r['blocks']} blocks of {r['block_bytes'] / (1 << 20):.1f} MiB "
            f"({lay['layers']} layers, {lay['kv_heads']} KV heads x {lay['head_dim']}, {lay['dtype']}, {lay['chunk_tokens']} tokens), "
            f"copies of {r['copy_bytes'] / 1024:.0f} KiB; {r['table']} block table; arena pinned: {r['arena_pinned']}",
            f"  pinned cudaMemcpyAsync   H2D {ref['h2d_small']:.1f} GB/s  D2H {ref['d2h_small']:.1f} GB/s  "
            f"(whole blocks: H2D {ref['h2d_block']:.1f}, D2H {ref['d2h_block']:.1f})",
            f"  arena DMA (registered)   H2D {arena['h2d_small']:.1f} GB/s  ({r['ratio_arena_to_hbm_vs_pinned']['raw_dma']:.2f}x pinned)  "
            f"D2H {arena.get('d2h_small', 0.0):.1f} GB/s  ({r['ratio_arena_to_hbm_vs_pinned']['raw_dma_d2h']:.2f}x pinned)",
            f"  agent load (arena->HBM)  {ag['load_from_arena']:.1f} GB/s  ({r['ratio_arena_to_hbm_vs_pinned']['agent_load']:.2f}x pinned; "
            f"{r['ratio_arena_to_hbm_vs_pinned']['agent_load_vs_whole_blocks']:.2f}x whole blocks; target >= 0.8x)  "
            f"byte-identical: {r['agent_load_byte_identical']}",
            f"  agent save (HBM->arena)  {ag['save_to_arena']:.1f} GB/s  ({r['ratio_arena_to_hbm_vs_pinned']['agent_save_vs_pinned_d2h']:.2f}x pinned D2H; "
            f"includes checksums and commit; the delete round trip, {r['delete_round_trip_s'] * 1e3:.1f} ms, is not)",
            f"  agent load (HBM pool)    {ag['load_from_hbm_pool']:.1f} GB/s",
            f"  layer-wise overlap: load {ov['t_load_s'] * 1e3:.1f} ms, compute {ov['t_compute_s'] * 1e3:.1f} ms "
            f"(matmul {ov['matmul_n']}^2 per layer), overlapped {ov['t_overlap_s'] * 1e3:.1f} ms: "
            f"hidden {ov['hidden_over_load']:.0%} of the load, {ov['hidden_over_total']:.0%} of the total",
        ]
    )


def main(a: argparse.Namespace) -> int:
    r = run(a)
    print(json.dumps(r) if a.json else format_report(r))
    return 0

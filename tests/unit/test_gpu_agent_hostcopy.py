"""``gpu_agent.hostcopy``: the fused copy-and-checksum of the CPU path (issue 24).

The checksum a save returns is ``kvstore.block.checksum`` of the block it wrote, whatever
the page table and thread count; a load that skips pages still checks the whole block; a
block whose bytes changed is reported (copied, not trusted)."""

from __future__ import annotations

import random

import pytest
import torch

from gpu_agent.buffers import EngineBuffers
from gpu_agent.copy_engine import Segmented
from gpu_agent.hostcopy import BlockJob, HostCopier
from gpu_agent.layout import KVCacheLayout, PagedAdapter
from kvstore.block import checksum

CHUNK = 64


def setup(layout: str, pages: int = 24) -> tuple[KVCacheLayout, PagedAdapter, EngineBuffers]:
    lay = KVCacheLayout(num_layers=3, num_kv_heads=2, head_dim=16, dtype="float16", page_size=16)
    g = torch.Generator().manual_seed(0)
    if layout == "flash":
        ts = [torch.randn(2, pages, 16, 2, 16, generator=g).half() for _ in range(3)]
    else:  # vLLM's CPU layout: [pages, heads, page, 2 * dim]
        ts = [torch.randn(pages, 2, 16, 32, generator=g).half() for _ in range(3)]
    return lay, PagedAdapter(lay, CHUNK), EngineBuffers.from_tensors(ts, pages)


def block(nbytes: int, parts: int = 1) -> tuple[Segmented, list[memoryview], bytearray]:
    raw = bytearray(nbytes)
    cut = [0, nbytes // 3, nbytes][:parts] + [nbytes] if parts > 1 else [0, nbytes]
    views = [memoryview(raw)[a:b] for a, b in zip(cut, cut[1:])]
    return Segmented([torch.frombuffer(v, dtype=torch.uint8) for v in views]), views, raw


@pytest.mark.parametrize("layout", ["flash", "cpu"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("parts", [1, 2])
def test_a_save_returns_the_checksum_of_the_block_it_wrote_and_a_load_restores_the_pages(
    layout: str, threads: int, parts: int
) -> None:
    lay, adapter, bufs = setup(layout)
    copier = HostCopier(lay.layer_bytes(CHUNK), lay.num_layers, threads=threads)
    table = list(range(24))
    random.Random(3).shuffle(table)
    jobs, raws = [], []
    for c in range(3):
        seg, views, raw = block(lay.block_bytes(CHUNK), parts)
        plan = copier.plan(adapter.chunk_copies(adapter.chunk_pages(table, c), bufs.geometry))
        jobs.append(BlockJob(seg, views, plan))
        raws.append(raw)
    sums = copier.save(bufs, jobs)
    assert sums == [checksum(bytes(r)) for r in raws]
    before = [flat.clone() for flat, _ in bufs.layers]
    for flat, _ in bufs.layers:
        flat.zero_()
    loads = copier.load(bufs, [BlockJob(j.arena, j.views, j.copies, s) for j, s in zip(jobs, sums)])
    assert loads == [True, True, True]
    for c in range(3):  # the chunks' pages are back, byte for byte
        for (flat, base), old in zip(bufs.layers, before):
            for cp in adapter.chunk_copies(adapter.chunk_pages(table, c), bufs.geometry):
                o = base + cp.buffer_offset
                assert torch.equal(flat[o : o + cp.nbytes], old[o : o + cp.nbytes])
    copier.close()


def test_a_load_that_skips_pages_still_checks_the_whole_block_and_leaves_those_pages_alone() -> None:
    lay, adapter, bufs = setup("flash")
    copier = HostCopier(lay.layer_bytes(CHUNK), lay.num_layers)
    ids = [4, 5, 6, 7]
    seg, views, raw = block(lay.block_bytes(CHUNK))
    full = copier.plan(adapter.chunk_copies(ids, bufs.geometry))
    (want,) = copier.save(bufs, [BlockJob(seg, views, full)])
    partial = copier.plan(adapter.chunk_copies([-1, -1, 6, 7], bufs.geometry))  # the engine holds pages 4, 5
    marker = [flat.clone() for flat, _ in bufs.layers]
    for flat, base in bufs.layers:
        g = bufs.geometry
        flat[base + 4 * g.page_stride : base + 4 * g.page_stride + g.plane_bytes] = 7
    assert copier.load(bufs, [BlockJob(seg, views, partial, want)]) == [True]
    for flat, base in bufs.layers:  # page 4 kept what the engine had
        g = bufs.geometry
        assert bool((flat[base + 4 * g.page_stride : base + 4 * g.page_stride + g.plane_bytes] == 7).all())
    raw[len(raw) // 2] ^= 0xFF  # a byte of the block changes in the store
    assert copier.load(bufs, [BlockJob(seg, views, partial, want)]) == [False]
    assert copier.load(bufs, [BlockJob(seg, views, partial, None)]) == [True]  # verification off: trusted
    del marker


def test_a_block_too_small_for_the_layout_is_an_error_for_that_block_only() -> None:
    lay, adapter, bufs = setup("cpu")
    copier = HostCopier(lay.layer_bytes(CHUNK), lay.num_layers, threads=2)
    plan = copier.plan(adapter.chunk_copies([0, 1, 2, 3], bufs.geometry))
    good, gv, _ = block(lay.block_bytes(CHUNK))
    short, sv, _ = block(lay.block_bytes(CHUNK) - 1)
    out = copier.save(bufs, [BlockJob(good, gv, plan), BlockJob(short, sv, plan)])
    assert isinstance(out[0], int) and isinstance(out[1], ValueError)
    copier.close()
    with pytest.raises(ValueError):
        HostCopier(1, 1, threads=0)

"""Batched copies (``gpu_agent.transfer``: device staging plus one gather or scatter per
layer, what CUDA runs) move exactly the bytes the direct page-run copies move, for every
page geometry, scattered block tables, skipped pages and blocks split over extents."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from gpu_agent.buffers import EngineBuffers
from gpu_agent.copy_engine import CopyEngine, Segmented, copy_range
from gpu_agent.layout import KVCacheLayout, PagedAdapter
from gpu_agent.transfer import BatchedLoad, BatchedSave, page_view

LAY = KVCacheLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype="float16", page_size=4)
C = 16  # 4 pages per chunk
PAGES = 24


def flash() -> EngineBuffers:
    return EngineBuffers.flash([torch.zeros(LAY.buffer_shape(PAGES), dtype=torch.float16) for _ in range(3)], LAY)


def cpu_backend() -> EngineBuffers:  # vLLM's CPU layout: a page is one run
    return EngineBuffers.from_tensors(
        [torch.zeros(PAGES, 2, 4, 16, dtype=torch.float16) for _ in range(3)], PAGES, block_dim=0
    )


def cross_layer() -> EngineBuffers:  # one allocation, layers interleaved per page: pages not adjacent
    big = torch.zeros(PAGES, 3, 2, 4, 2, 8, dtype=torch.float16)
    return EngineBuffers.from_tensors([big[:, i] for i in range(3)], PAGES, block_dim=0)


GEOMETRIES: dict[str, Callable[[], EngineBuffers]] = {"flash": flash, "cpu": cpu_backend, "cross-layer": cross_layer}


def fill(b: EngineBuffers, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in b.sources:
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, generator=g, dtype=torch.uint8))


def direct_save(ad: PagedAdapter, b: EngineBuffers, pages: list[list[int]]) -> list[torch.Tensor]:
    lb = LAY.layer_bytes(C)
    out = [torch.zeros(LAY.block_bytes(C), dtype=torch.uint8) for _ in pages]
    for blk, ps in zip(out, pages):
        for layer, (flat, origin) in enumerate(b.layers):
            for c in ad.chunk_copies(ps, b.geometry):
                copy_range(blk, layer * lb + c.block_offset, flat, origin + c.buffer_offset, c.nbytes)
    return out


def split(t: torch.Tensor) -> Segmented:
    return Segmented([t[:1000], t[1000:1001], t[1001:]])  # a block over three extents


@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
@pytest.mark.parametrize("group_blocks", [1, 2, 8])
def test_batched_save_and_load_move_the_bytes_the_direct_copies_move(geometry: str, group_blocks: int) -> None:
    ad = PagedAdapter(LAY, C)
    src = GEOMETRIES[geometry]()
    fill(src, 1)
    table = [23, 5, 6, 7, 0, 2, 4, 8, 9, 10, 11, 12, 19, 18, 17, 16]  # scattered, partly contiguous
    pages = [ad.chunk_pages(table, c) for c in range(4)]
    eng = CopyEngine("cpu")
    try:
        blocks = [torch.zeros(LAY.block_bytes(C), dtype=torch.uint8) for _ in pages]
        save = BatchedSave(
            eng,
            src,
            src.geometry,
            [split(b) for b in blocks],
            pages,
            3,
            LAY.layer_bytes(C),
            group_blocks * LAY.block_bytes(C),
        )
        assert save.run() == []  # nothing deferred: every destination took the copy
        want = direct_save(ad, src, pages)
        assert all(torch.equal(a, b) for a, b in zip(blocks, want))

        dst = GEOMETRIES[geometry]()
        back = [1, 3, 13, 14, 15, 20, 21, 22, -1, -1, 6, 7, 0, 2, 4, 5]  # two pages the engine already holds
        load = BatchedLoad(
            eng,
            dst,
            dst.geometry,
            [split(b) for b in blocks],
            [ad.chunk_pages(back, c) for c in range(4)],
            LAY.layer_bytes(C),
            group_blocks * LAY.layer_bytes(C),
        )
        for layer in range(3):
            load.layer(layer)
        for s, d in zip(src.sources, dst.sources):
            for a, b in zip(table, back):
                if b >= 0:
                    assert torch.equal(
                        page(d, geometry, b).view(torch.int16), page(s, geometry, a).view(torch.int16)
                    ), (a, b)
        untouched = [p for p in range(PAGES) if p not in back]
        assert all(not page(d, geometry, p).any() for d in dst.sources for p in untouched)
    finally:
        eng.close()


def page(t: torch.Tensor, geometry: str, p: int) -> torch.Tensor:
    return t[:, p] if geometry == "flash" else t[p]


def test_hbm_slots_and_host_blocks_mix_in_one_load() -> None:
    ad = PagedAdapter(LAY, C)
    src = flash()
    fill(src, 2)
    table = list(range(8))
    blocks = direct_save(ad, src, [ad.chunk_pages(table, c) for c in range(2)])
    dst = flash()
    eng = CopyEngine("cpu")
    try:
        load = BatchedLoad(
            eng,
            dst,
            dst.geometry,
            [blocks[0].clone(), split(blocks[1])],  # a pool slot, a host block
            [ad.chunk_pages(table[::-1], c) for c in range(2)],
            LAY.layer_bytes(C),
            1 << 20,
        )
        for layer in range(3):
            load.layer(layer)
    finally:
        eng.close()
    for s, d in zip(src.sources, dst.sources):
        assert torch.equal(d[:, table[::-1]].view(torch.int16), s[:, table].view(torch.int16))


def test_page_view_picks_the_widest_word_that_divides_every_offset() -> None:
    b = flash()
    v = page_view(b.layers[0][0], b.layers[0][1], b.geometry)
    assert v.dtype == torch.int64 and tuple(v.shape) == (2, PAGES, LAY.page_bytes // 8)
    raw = torch.zeros(4096 + 2, dtype=torch.uint8)
    g = LAY.flash_geometry(4)
    assert page_view(raw, 2, g).dtype == torch.int16  # a base 2 bytes in
    assert page_view(raw, 1, g).dtype == torch.uint8

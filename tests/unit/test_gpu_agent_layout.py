"""The engine layout and the paged adapter: engine pages of 16 tokens <-> store chunks."""

from __future__ import annotations

import numpy as np
import pytest

from gpu_agent.layout import ByteCopy, KVCacheLayout, PagedAdapter, PageRun, page_runs
from kvstore.errors import Incompatible, InvalidArgument
from kvstore.keys import KVLayout, Namespace

LAY = KVCacheLayout(num_layers=3, num_kv_heads=2, head_dim=4, dtype="float16", page_size=16)


def test_sizes_follow_the_documented_block_layout() -> None:
    assert LAY.itemsize == 2
    assert LAY.token_bytes == 2 * 4 * 2
    assert LAY.block_shape(64) == (3, 2, 64, 2, 4)
    assert LAY.block_bytes(64) == 3 * 2 * 64 * 2 * 4 * 2
    assert LAY.layer_range(0, 64) == (0, LAY.layer_bytes(64))
    assert LAY.layer_range(2, 64) == (2 * LAY.layer_bytes(64), LAY.layer_bytes(64))
    assert LAY.buffer_shape(10) == (2, 10, 16, 2, 4)


def test_layout_rejects_nonsense() -> None:
    with pytest.raises(InvalidArgument):
        KVCacheLayout(0, 1, 1)
    with pytest.raises(InvalidArgument):
        KVCacheLayout(1, 1, 1, dtype="float13")


def test_namespace_must_match_the_layout() -> None:
    ns = LAY.namespace("m", chunk_tokens=64)
    assert ns.layout == KVLayout(3, 2, 4) and ns.kv_dtype == "float16"
    LAY.check_namespace(ns)
    with pytest.raises(Incompatible, match="layout"):
        LAY.check_namespace(Namespace("m", kv_dtype="bfloat16", layout=KVLayout(3, 2, 4), chunk_tokens=64))
    with pytest.raises(Incompatible, match="layout"):
        LAY.check_namespace(Namespace("m", kv_dtype="float16", layout=KVLayout(4, 2, 4), chunk_tokens=64))
    with pytest.raises(Incompatible, match="multiple of the engine's page_size"):
        LAY.check_namespace(Namespace("m", kv_dtype="float16", layout=KVLayout(3, 2, 4), chunk_tokens=40))


def test_page_runs_coalesce_consecutive_pages() -> None:
    assert page_runs([4, 5, 6, 7], 16) == [PageRun(0, 4, 4)]
    assert page_runs([7, 6, 5], 16) == [PageRun(0, 7, 1), PageRun(16, 6, 1), PageRun(32, 5, 1)]
    assert page_runs([1, 2, 9, 10, 3], 16) == [PageRun(0, 1, 2), PageRun(32, 9, 2), PageRun(64, 3, 1)]
    assert page_runs([], 16) == []


def test_chunk_pages_and_short_block_tables() -> None:
    ad = PagedAdapter(LAY, 64)
    assert ad.pages_per_chunk == 4
    ids = list(range(100, 112))
    assert ad.chunk_pages(ids, 0) == [100, 101, 102, 103]
    assert ad.chunk_pages(ids, 2) == [108, 109, 110, 111]
    with pytest.raises(InvalidArgument, match="block_ids has 12 pages"):
        ad.chunk_pages(ids, 3)
    with pytest.raises(Incompatible):
        PagedAdapter(LAY, 40)


def test_contiguous_pages_are_one_copy_per_kv_half() -> None:
    ad = PagedAdapter(LAY, 64)
    cps = ad.chunk_copies([8, 9, 10, 11], num_buffer_pages=20)
    half_block = 64 * LAY.token_bytes
    half_buffer = 20 * LAY.page_bytes
    assert cps == [
        ByteCopy(0, 8 * LAY.page_bytes, 4 * LAY.page_bytes),
        ByteCopy(half_block, half_buffer + 8 * LAY.page_bytes, 4 * LAY.page_bytes),
    ]


def test_copies_reject_pages_outside_the_buffer() -> None:
    ad = PagedAdapter(LAY, 64)
    with pytest.raises(InvalidArgument, match="outside"):
        ad.chunk_copies([0, 1, 2, 20], num_buffer_pages=20)
    with pytest.raises(InvalidArgument, match="spans 4 pages"):
        ad.chunk_copies([0, 1], num_buffer_pages=20)


@pytest.mark.parametrize("pages", [[0, 1, 2, 3], [9, 3, 4, 0], [11, 10, 9, 8]])
def test_applying_the_copies_moves_exactly_the_chunk(pages: list[int]) -> None:
    """Engine pages -> block and back, checked against the layout written out by hand."""
    lay, C, P = LAY, 64, 12
    ad = PagedAdapter(lay, C)
    rng = np.random.default_rng(0)
    engine = [rng.standard_normal(lay.buffer_shape(P)).astype(np.float16) for _ in range(lay.num_layers)]
    block = np.zeros(lay.block_shape(C), np.float16)
    bb, cps = block.reshape(-1).view(np.uint8), ad.chunk_copies(pages, P)
    for layer in range(lay.num_layers):
        base, _ = lay.layer_range(layer, C)
        eb = engine[layer].reshape(-1).view(np.uint8)
        for c in cps:
            bb[base + c.block_offset : base + c.block_offset + c.nbytes] = eb[
                c.buffer_offset : c.buffer_offset + c.nbytes
            ]
    # [layer][K/V][token][head][dim]: token t of the chunk lives in page pages[t // 16], slot t % 16
    for layer in range(lay.num_layers):
        for kv in (0, 1):
            for t in range(C):
                np.testing.assert_array_equal(block[layer, kv, t], engine[layer][kv, pages[t // 16], t % 16])
    # and back into other pages of a fresh buffer
    back = [np.zeros_like(e) for e in engine]
    for layer in range(lay.num_layers):
        base, _ = lay.layer_range(layer, C)
        db = back[layer].reshape(-1).view(np.uint8)
        for c in cps:
            db[c.buffer_offset : c.buffer_offset + c.nbytes] = bb[
                base + c.block_offset : base + c.block_offset + c.nbytes
            ]
        np.testing.assert_array_equal(back[layer][:, pages], engine[layer][:, pages])

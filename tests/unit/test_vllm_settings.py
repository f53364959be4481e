"""The vLLM connector's pure parts (no vLLM needed): its settings, the namespaces it keys
by, and the page geometries it learns from the shapes and strides the attention
backends give their KV tensors (CPU tensors of the CUDA backends' layouts too)."""

from __future__ import annotations

import pytest
import torch

from gpu_agent.buffers import EngineBuffers, learn_geometry
from gpu_agent.layout import KVCacheLayout, PagedAdapter
from gpu_agent.vllm.settings import ConnectorSettings
from gpu_agent.vllm.spec import EngineSpec
from kvstore.errors import Incompatible, InvalidArgument
from kvstore.keys import chunk_keys

SPEC = EngineSpec("m", "main", "float16", 2, 2, 64, 16, "vllm:cuda:LBHNC")


def test_unknown_and_mistyped_settings_are_refused_by_name() -> None:
    with pytest.raises(InvalidArgument, match="targte"):
        ConnectorSettings.from_extra({"targte": "unix:///x"})
    with pytest.raises(InvalidArgument, match="deadline_s"):
        ConnectorSettings.from_extra({"deadline_s": "soon"})
    with pytest.raises(InvalidArgument, match="verify_loads"):
        ConnectorSettings.from_extra({"verify_loads": "yes"})
    for bad in (0, -1.5):
        with pytest.raises(InvalidArgument, match="retry_s > 0"):
            ConnectorSettings.from_extra({"retry_s": bad})
    s = ConnectorSettings.from_extra({"target": "unix:///x", "deadline_s": 1, "chunk_tokens": 256, "retry_s": 0.5})
    assert (s.target, s.deadline_s, s.chunk_tokens, s.retry_s) == ("unix:///x", 1.0, 256, 0.5)
    assert ConnectorSettings().retry_s == 5.0


def test_a_chunk_covers_whole_vllm_blocks() -> None:
    assert ConnectorSettings().chunk_for(16) == 256 and ConnectorSettings().chunk_for(128) == 256
    assert ConnectorSettings().chunk_for(96) == 288
    with pytest.raises(Incompatible, match="chunk_tokens=200 .* block_size=128"):
        ConnectorSettings(chunk_tokens=200).chunk_for(128)


def test_an_engine_kvstore_cannot_describe_fails_naming_the_setting() -> None:
    with pytest.raises(Incompatible, match="fp8"):
        EngineSpec("m", "main", "fp8_e4m3", 2, 2, 64, 16, "x")


def test_requests_that_must_not_share_kv_never_share_keys() -> None:
    toks = list(range(512))
    base = chunk_keys(toks, SPEC.namespace(256))
    assert chunk_keys(toks, SPEC.namespace(256)) == base  # deterministic: the scheduler and workers agree
    for ns in (
        SPEC.namespace(256, lora="adapter-a"),
        SPEC.namespace(256, cache_salt="s1"),
        SPEC.namespace(256, salt="deploy"),
        EngineSpec("m", "v2", "float16", 2, 2, 64, 16, "vllm:cuda:LBHNC").namespace(256),
        EngineSpec("m", "main", "float16", 2, 2, 64, 16, "vllm:cpu:LBHNC").namespace(256),
        EngineSpec("m", "main", "float16", 2, 2, 64, 16, "vllm:cuda:LBHNC", tp_rank=1, tp_size=2).namespace(256),
    ):
        assert not set(chunk_keys(toks, ns)) & set(base)
    assert SPEC.namespace(256, cache_salt="s1") != SPEC.namespace(256, cache_salt="s2")


LAY = KVCacheLayout(num_layers=1, num_kv_heads=2, head_dim=4, dtype="float32", page_size=8)
P = 6  # pages


def layouts() -> dict[str, tuple[torch.Tensor, int]]:
    """One layer's KV in each backend's shape (and strides), and its page dimension."""
    H, N, D = LAY.num_kv_heads, LAY.page_size, LAY.head_dim
    return {
        "cpu [B,H,N,2D]": (torch.randn(P, H, N, 2 * D), 0),
        "flash [2,B,N,H,D]": (torch.randn(2, P, N, H, D), 1),
        "flash HND [2,B,N,H,D] as [2,B,H,N,D]": (torch.randn(2, P, H, N, D).permute(0, 1, 3, 2, 4), 1),
        "flashinfer [B,2,N,H,D]": (torch.randn(P, 2, N, H, D), 0),
        "cross-layer [B,L,H,N,2D] layer view": (torch.randn(P, 3, H, N, 2 * D)[:, 1], 0),
        "head-major [H,B,N,2D]": (torch.randn(H, P, N, 2 * D), 1),
    }


@pytest.mark.parametrize("name", list(layouts()))
def test_every_backend_layout_round_trips_a_chunk_through_a_block(name: str) -> None:
    t, bdim = layouts()[name]
    g = learn_geometry(t, P, block_dim=bdim)
    ad = PagedAdapter(LAY, 16)  # 2 pages per chunk
    ad.check_geometry(g)
    bufs = EngineBuffers.from_tensors([t], P, block_dim=bdim)
    bufs.check()
    flat, base = bufs.layers[0]
    pages = [4, 1]
    block = torch.zeros(LAY.layer_bytes(16), dtype=torch.uint8)
    for c in ad.chunk_copies(pages, g):
        block[c.block_offset : c.block_offset + c.nbytes] = flat[
            base + c.buffer_offset : base + c.buffer_offset + c.nbytes
        ]
    t2 = torch.zeros(t.untyped_storage().nbytes() // t.element_size()).as_strided(
        t.size(), t.stride(), t.storage_offset()
    )
    flat2, base2 = EngineBuffers.from_tensors([t2], P, block_dim=bdim).layers[0]
    for c in ad.chunk_copies(pages, g):
        flat2[base2 + c.buffer_offset : base2 + c.buffer_offset + c.nbytes] = block[
            c.block_offset : c.block_offset + c.nbytes
        ]
    sel = [slice(None)] * t.dim()
    for p in pages:  # exactly the chunk's pages came back, nothing else was written
        sel[bdim] = p
        assert torch.equal(t2[tuple(sel)], t[tuple(sel)])
    for p in set(range(P)) - set(pages):
        sel[bdim] = p
        assert not t2[tuple(sel)].any()


def test_a_tensor_whose_pages_are_not_separable_is_refused() -> None:
    with pytest.raises(Incompatible):
        learn_geometry(torch.randn(P, P, 8), P)  # which dimension is the page?
    t = torch.randn(2, 3, P, 8).permute(2, 0, 1, 3)  # pages split along two outer dimensions
    with pytest.raises(Incompatible):
        learn_geometry(t, P, block_dim=0)

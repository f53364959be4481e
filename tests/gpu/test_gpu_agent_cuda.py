"""The GPU agent on a CUDA device: pinned arena, real streams and events, DMA round trips.

Skipped without CUDA (``-m gpu`` selects these).  The same flows run on CPU tensors in
``tests/integration/test_gpu_agent.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ROOT = Path(__file__).resolve().parents[2]
C = 256


@pytest.fixture
def cuda_agent(node_factory: Any) -> Any:
    from client import KVClient
    from gpu_agent import AgentConfig, GPUAgent, KVCacheLayout

    n = node_factory("--dram", "512MiB", "--nvme", "512MiB")
    lay = KVCacheLayout(num_layers=8, num_kv_heads=4, head_dim=128, dtype="bfloat16", page_size=16)
    ns = lay.namespace("gpu-test", chunk_tokens=C, tenant_salt=uuid.uuid4().hex)
    client = KVClient(n.unix)
    agent = GPUAgent(client, lay, ns, device="cuda", config=AgentConfig(hbm_bytes=64 << 20))
    yield agent
    agent.close()
    client.close()


def kv(agent: Any, pages: int, fill: bool) -> list[Any]:
    lay = agent.layout
    if not fill:
        return [torch.zeros(lay.buffer_shape(pages), dtype=torch.bfloat16, device="cuda") for _ in range(lay.num_layers)]
    return [torch.randn(lay.buffer_shape(pages), device="cuda").to(torch.bfloat16) for _ in range(lay.num_layers)]


def equal_pages(a: list[Any], ia: list[int], b: list[Any], ib: list[int]) -> bool:
    return all(torch.equal(x[:, ia].view(torch.int16), y[:, ib].view(torch.int16)) for x, y in zip(a, b))


def test_arena_is_pinned_and_streams_are_not_the_default(cuda_agent: Any) -> None:
    assert cuda_agent.pinned is True
    assert cuda_agent.engine.stats()["pinned_registrations"] == 1
    default = torch.cuda.default_stream()
    for s in cuda_agent.engine._streams.values():
        assert s != default
    assert cuda_agent.pool.storage.is_cuda


def test_save_load_round_trip_through_the_node(cuda_agent: Any) -> None:
    toks = list(range(4 * C))
    src = kv(cuda_agent, 80, fill=True)
    src_ids = list(range(79, 15, -1))  # scattered: one DMA per page
    res = cuda_agent.save(toks, src, src_ids).wait(timeout=60)
    assert res.stored == 4
    dst = kv(cuda_agent, 80, fill=False)
    dst_ids = list(range(64))
    h = cuda_agent.load(toks, dst, dst_ids)
    assert h.num_tokens == 4 * C
    for i in range(cuda_agent.layout.num_layers):
        h.wait_layer(i)  # the current stream waits; the host does not
    torch.cuda.current_stream().synchronize()
    assert h.wait(timeout=60)
    assert equal_pages(src, src_ids, dst, dst_ids)


def test_save_is_ordered_after_the_compute_that_wrote_the_kv(cuda_agent: Any) -> None:
    toks = list(range(1000, 1000 + 2 * C))
    src = kv(cuda_agent, 32, fill=False)
    big = torch.randn(4096, 4096, device="cuda")
    for _ in range(8):
        big = big @ big / 64  # queued on the current stream
    val = (big[0, 0] * 0).nan_to_num(0.0) + 3.0  # a device scalar that exists only after the matmuls
    for layer in src:
        layer.copy_(val.to(torch.bfloat16).expand_as(layer))
    res = cuda_agent.save(toks, src, list(range(32))).wait(timeout=60)  # no synchronize before it
    assert res.stored == 2
    dst = kv(cuda_agent, 32, fill=False)
    cuda_agent.load(toks, dst, list(range(32))).wait(timeout=60)
    assert all(bool((d == 3.0).all()) for d in dst)


def test_prefetch_fills_the_pool_and_load_copies_device_to_device(cuda_agent: Any) -> None:
    toks = list(range(5000, 5000 + 3 * C))
    src = kv(cuda_agent, 48, fill=True)
    cuda_agent.save(toks, src, list(range(48))).wait(timeout=60)
    r = cuda_agent.prefetch(toks).result(timeout=60)
    assert r.fetched == 3
    dst = kv(cuda_agent, 48, fill=False)
    h = cuda_agent.load(toks, dst, list(range(47, -1, -1)))
    assert h.hbm_chunks == 3
    h.wait(timeout=60)
    assert equal_pages(src, list(range(48)), dst, list(range(47, -1, -1)))


def test_bench_script_runs_small() -> None:
    cmd = [sys.executable, "-m", "gpu_agent.bench", "--layers", "4", "--blocks", "4", "--iters", "2", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["arena_pinned"] is True and r["agent_load_byte_identical"] is True
    assert r["reference_gbps"]["h2d_small"] > 0 and 0 <= r["overlap"]["hidden_over_total"] <= 1

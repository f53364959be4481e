"""The GPU agent on a CUDA device: pinned arena, real streams and events, DMA round trips.

Skipped without CUDA (``-m gpu`` selects these; ``scripts/gpu-check.sh`` runs them).  The
same flows run on CPU tensors in ``tests/integration/test_gpu_agent.py``.  Ordering is
checked without host syncs: ``torch.cuda._sleep`` holds the compute stream, the test
queues its writes and reads behind it, and only the final comparison syncs.
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


SLEEP = 200_000_000  # cycles of torch.cuda._sleep: ~0.1 s, far longer than any copy here


def layout() -> Any:
    from gpu_agent import KVCacheLayout

    return KVCacheLayout(num_layers=8, num_kv_heads=4, head_dim=128, dtype="bfloat16", page_size=16)


@pytest.fixture
def cuda_agent(node_factory: Any) -> Any:
    from client import KVClient
    from gpu_agent import AgentConfig, GPUAgent

    n = node_factory("--dram", "512MiB", "--nvme", "512MiB")
    lay = layout()
    ns = lay.namespace("gpu-test", chunk_tokens=C, tenant_salt=uuid.uuid4().hex)
    client = KVClient(n.unix)
    agent = GPUAgent(client, lay, ns, device="cuda", config=AgentConfig(hbm_bytes=64 << 20))
    yield agent
    agent.close()
    client.close()


def kv(agent: Any, pages: int, fill: bool) -> list[Any]:
    lay, dev = agent.layout, agent.device
    if not fill:
        return [torch.zeros(lay.buffer_shape(pages), dtype=torch.bfloat16, device=dev) for _ in range(lay.num_layers)]
    return [torch.randn(lay.buffer_shape(pages), device=dev).to(torch.bfloat16) for _ in range(lay.num_layers)]


def equal_pages(a: list[Any], ia: list[int], b: list[Any], ib: list[int]) -> bool:
    return all(torch.equal(x[:, ia].view(torch.int16), y[:, ib].view(torch.int16)) for x, y in zip(a, b))


def test_arena_is_pinned_and_streams_are_not_the_default(cuda_agent: Any) -> None:
    assert cuda_agent.pinned is True
    assert cuda_agent.engine.stats()["pinned_registrations"] == 1
    default = torch.cuda.default_stream()
    for s in cuda_agent.engine._streams.values():
        assert s != default
    assert len(set(cuda_agent.engine._streams.values())) == len(cuda_agent.engine._streams)  # prefetch has its own
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
    cmd = [sys.executable, "-m", "kvstore", "bench", "gpu", "--layers", "4", "--blocks", "4", "--iters", "2", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["arena_pinned"] is True and r["agent_load_byte_identical"] is True
    assert r["reference_gbps"]["h2d_small"] > 0 and 0 <= r["overlap"]["hidden_over_total"] <= 1


def shuffled(n: int, seed: int) -> list[int]:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()


def test_save_then_reuse_orders_without_host_syncs(cuda_agent: Any) -> None:
    """Issue 18 #1 on a GPU: the compute stream is held by a sleep while the KV is written and
    saved, and the pages are overwritten right after save() returns: the store gets the KV
    written before the save, never the overwrite, with no host sync in between."""
    toks = list(range(7000, 7000 + 4 * C))
    ids = shuffled(96, 1)[:64]
    pages = kv(cuda_agent, 96, fill=False)
    want = kv(cuda_agent, 96, fill=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP)  # the compute stream is busy ...
    for p, w in zip(pages, want):
        p.copy_(w)  # ... and the KV is written behind it
    handle = cuda_agent.save(toks, pages, ids)  # the d2h copy must wait for the writes
    for p in pages:
        p.fill_(7.0)  # the engine reuses the pages at once: ordered after the copy out
    assert handle.wait(timeout=60).stored == 4
    dst = kv(cuda_agent, 96, fill=False)
    h = cuda_agent.load(toks, dst, ids)
    for i in range(cuda_agent.layout.num_layers):
        h.wait_layer(i)
    same = torch.stack(
        [(d[:, ids].view(torch.int16) == w[:, ids].view(torch.int16)).all() for d, w in zip(dst, want)]
    ).all()
    assert bool(same.item()) and h.wait(timeout=60)  # the only host sync


def test_a_load_into_pages_the_compute_stream_still_reads_waits_for_it(cuda_agent: Any) -> None:
    toks = list(range(9000, 9000 + 2 * C))
    src = kv(cuda_agent, 32, fill=True)
    assert cuda_agent.save(toks, src, list(range(32))).wait(timeout=60).stored == 2
    dst = kv(cuda_agent, 32, fill=True)
    before = [d.clone() for d in dst]
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP)
    seen = [d.clone() for d in dst]  # a read the compute stream queued before the load
    h = cuda_agent.load(toks, dst, list(range(32)))
    for i in range(cuda_agent.layout.num_layers):
        h.wait_layer(i)
    assert h.wait(timeout=60)
    torch.cuda.synchronize()
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(seen, before))
    assert equal_pages(src, list(range(32)), dst, list(range(32)))


def test_scattered_tables_and_skipped_pages(cuda_agent: Any) -> None:
    toks = list(range(11000, 11000 + 6 * C))
    src = kv(cuda_agent, 128, fill=True)
    ids = shuffled(128, 2)[:96]
    assert cuda_agent.save(toks, src, ids).wait(timeout=60).stored == 6
    dst = kv(cuda_agent, 128, fill=False)
    back = shuffled(128, 3)[:96]
    back[:20] = [-1] * 20  # the engine already holds those tokens
    h = cuda_agent.load(toks, dst, back)
    assert h.num_tokens == 6 * C and h.wait(timeout=60)
    assert equal_pages(src, ids[20:], dst, back[20:])
    untouched = sorted(set(range(128)) - set(back[20:]))
    assert all(not bool(d[:, untouched].any()) for d in dst)


def test_concurrent_prefetch_and_load(cuda_agent: Any) -> None:
    a, b = list(range(20000, 20000 + 4 * C)), list(range(30000, 30000 + 4 * C))
    sa, sb = kv(cuda_agent, 64, fill=True), kv(cuda_agent, 64, fill=True)
    cuda_agent.save(a, sa, list(range(64))).wait(timeout=60)
    cuda_agent.save(b, sb, list(range(64))).wait(timeout=60)
    futs = [cuda_agent.prefetch(a), cuda_agent.prefetch(b)]
    for _ in range(3):
        for toks, want in ((a, sa), (b, sb)):
            dst = kv(cuda_agent, 64, fill=False)
            ids = shuffled(64, len(toks))
            h = cuda_agent.load(toks, dst, ids)
            assert h.num_tokens == 4 * C and h.wait(timeout=60)
            assert equal_pages(want, list(range(64)), dst, ids)
    assert sum(f.result(timeout=60).fetched for f in futs) >= 1
    assert cuda_agent.pool.stats()["held_slots"] == 0 and cuda_agent.pool.stats()["reserved_slots"] == 0


def test_two_agents_on_one_client_share_one_registration(cuda_agent: Any) -> None:
    """Issue 18 #4: the second cudaHostRegister of the arena failed (712) and left the error
    for the next kernel launch to raise."""
    from gpu_agent import GPUAgent

    other = GPUAgent(cuda_agent.client, cuda_agent.layout, cuda_agent.namespace, device=cuda_agent.device)
    try:
        assert other.pinned and cuda_agent.pinned
        x = torch.ones(1024, device=cuda_agent.device) * 2  # a kernel launch: no stale error raised here
        assert float(x.sum().item()) == 2048
        toks = list(range(40000, 40000 + 2 * C))
        src = kv(cuda_agent, 32, fill=True)
        assert other.save(toks, src, list(range(32))).wait(timeout=60).stored == 2
        dst = kv(cuda_agent, 32, fill=False)
        assert cuda_agent.load(toks, dst, list(range(32))).wait(timeout=60)
        assert equal_pages(src, list(range(32)), dst, list(range(32)))
    finally:
        other.close()
    assert cuda_agent.pinned  # the registration is the first agent's too: still there
    assert cuda_agent.load(toks, kv(cuda_agent, 32, fill=False), list(range(32))).wait(timeout=60)


def test_a_refused_registration_stages_through_a_bounce_buffer(node_factory: Any) -> None:
    """Where cudaHostRegister is refused, copies really go through pinned bounce buffers."""
    from gpu_agent_fakes import FakeCudart

    from client import KVClient
    from gpu_agent import GPUAgent

    n = node_factory("--dram", "256MiB", "--nvme", "0")
    lay = layout()
    ns = lay.namespace("gpu-test", chunk_tokens=C, tenant_salt=uuid.uuid4().hex)
    with KVClient(n.unix) as client, GPUAgent(client, lay, ns, device="cuda", cudart=FakeCudart(refuse=1)) as agent:
        assert agent.pinned is False
        toks = list(range(50000, 50000 + 3 * C))
        src = kv(agent, 64, fill=True)
        ids = shuffled(64, 4)[:48]
        assert agent.save(toks, src, ids).wait(timeout=60).stored == 3
        dst = kv(agent, 64, fill=False)
        h = agent.load(toks, dst, ids)
        assert h.wait(timeout=60)
        assert equal_pages(src, ids, dst, ids)
        copies = agent.stats()["host_copies"]
        assert copies.get("staged", 0) >= 6 and copies.get("dma", 0) == 0


def test_node_restart_under_a_live_agent(tmp_path: Any) -> None:
    """Issue 18 #3: after a restart the agent copied from the new, unregistered arena while
    reporting itself pinned.  The first transfer after it registers the new mapping."""
    from conftest import NodeProcess

    from client import KVClient
    from gpu_agent import GPUAgent

    n = NodeProcess(tmp_path / "node", "--dram", "256MiB", "--nvme", "0").start()
    lay = layout()
    ns = lay.namespace("gpu-test", chunk_tokens=C, tenant_salt=uuid.uuid4().hex)
    try:
        with KVClient(n.unix) as client, GPUAgent(client, lay, ns, device="cuda") as agent:
            toks = list(range(60000, 60000 + 2 * C))
            src = kv(agent, 32, fill=True)
            assert agent.save(toks, src, list(range(32))).wait(timeout=60).stored == 2
            n.stop()
            n.start()
            assert agent.save(toks, src, list(range(32))).wait(timeout=60).stored == 2
            dst = kv(agent, 32, fill=False)
            assert agent.load(toks, dst, list(range(32))).wait(timeout=60)
            assert equal_pages(src, list(range(32)), dst, list(range(32)))
            st = agent.stats()
            assert agent.pinned and st["pinned_registered_total"] == 2 and st["counters"].get("staged_blocks", 0) == 0
    finally:
        n.stop()
        Path(n.arena_path).unlink(missing_ok=True)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_an_agent_on_the_second_device(node_factory: Any) -> None:
    from client import KVClient
    from gpu_agent import GPUAgent

    n = node_factory("--dram", "256MiB", "--nvme", "0")
    lay = layout()
    ns = lay.namespace("gpu-test", chunk_tokens=C, tenant_salt=uuid.uuid4().hex)
    assert torch.cuda.current_device() == 0
    with KVClient(n.unix) as client, GPUAgent(client, lay, ns, device="cuda:1") as agent:
        toks = list(range(70000, 70000 + 2 * C))
        src = kv(agent, 32, fill=True)
        assert agent.save(toks, src, list(range(32))).wait(timeout=60).stored == 2
        dst = kv(agent, 32, fill=False)
        h = agent.load(toks, dst, list(range(32)))
        with torch.cuda.device(1):
            torch.cuda._sleep(SLEEP)
            for i in range(lay.num_layers):
                h.wait_layer(i)  # cuda:1's current stream waits, whatever this thread's device
            same = torch.stack([(a.view(torch.int16) == b.view(torch.int16)).all() for a, b in zip(src, dst)]).all()
        assert bool(same.item()) and h.wait(timeout=60)

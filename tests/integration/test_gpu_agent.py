"""The GPU agent against a real node, on CPU tensors (the same code paths as on CUDA).

Save then load must give byte-identical KV in other pages; blocks are self-describing;
prefetch brings NVMe blocks up through DRAM into the HBM pool, and load then reads the
pool; a gap stops a load; the agent fails open when the node goes away.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import torch

from client import KVClient
from gpu_agent import AgentConfig, GPUAgent, KVCacheLayout
from kvstore.errors import InvalidArgument
from kvstore.keys import NO_PARENT, parent_keys

C = 64  # chunk tokens: 4 engine pages of 16


def make_layout(dtype: str = "float16") -> KVCacheLayout:
    return KVCacheLayout(num_layers=3, num_kv_heads=2, head_dim=16, dtype=dtype, page_size=16)


def buffers(lay: KVCacheLayout, pages: int, *, fill: bool, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, lay.dtype)
    if not fill:
        return [torch.zeros(lay.buffer_shape(pages), dtype=dt) for _ in range(lay.num_layers)]
    return [torch.randn(lay.buffer_shape(pages), generator=g).to(dt) for _ in range(lay.num_layers)]


def tokens(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 30000, (n,), generator=g).tolist()


def same_pages(a: list[torch.Tensor], ids_a: list[int], b: list[torch.Tensor], ids_b: list[int], n_pages: int) -> bool:
    return all(
        torch.equal(x[:, ids_a[:n_pages]].view(torch.uint8), y[:, ids_b[:n_pages]].view(torch.uint8))
        for x, y in zip(a, b)
    )


@pytest.fixture
def agent_factory(node: Any) -> Any:
    made: list[tuple[GPUAgent, KVClient]] = []

    def make(lay: KVCacheLayout | None = None, target: str | None = None, **cfg: Any) -> GPUAgent:
        lay = lay or make_layout()
        ns = lay.namespace("test-model", chunk_tokens=C, tenant_salt=uuid.uuid4().hex)
        client = KVClient(target or node.unix)
        a = GPUAgent(client, lay, ns, device="cpu", config=AgentConfig(**cfg))
        made.append((a, client))
        return a

    yield make
    for a, c in made:
        a.close()
        c.close()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_save_then_load_is_byte_identical_in_other_pages(agent_factory: Any, dtype: str) -> None:
    lay = make_layout(dtype)
    agent = agent_factory(lay)
    toks = tokens(5 * C + 10)  # 5 full chunks and a partial one (never stored)
    src = buffers(lay, 40, fill=True)
    src_ids = [39 - 2 * i for i in range(20)] + [0]  # scattered pages: one copy per page
    assert agent.lookup(toks) == 0
    res = agent.save(toks, src, src_ids).wait(timeout=30)
    assert (res.stored, res.existed, res.failed) == (5, 0, 0)
    assert agent.lookup(toks) == 5 * C

    dst = buffers(lay, 40, fill=False)
    dst_ids = list(range(2, 23))  # contiguous pages: one copy per chunk and K/V half
    h = agent.load(toks, dst, dst_ids)
    assert h.num_tokens == 5 * C and h.num_layers == 3
    for layer in range(3):
        h.wait_layer(layer)
    assert h.wait(timeout=30) is True
    assert same_pages(src, src_ids, dst, dst_ids, 20)
    untouched = [i for i in range(40) if i not in dst_ids[:20]]
    assert all(not d[:, untouched].any() for d in dst)  # nothing outside the block table was written
    assert agent.stats()["counters"]["load_host_blocks"] == 5


def test_blocks_are_self_describing(agent_factory: Any) -> None:
    agent = agent_factory()
    toks = tokens(2 * C)
    src = buffers(agent.layout, 8, fill=True)
    agent.save(toks, src, list(range(8))).wait(timeout=30)
    keys = agent.keys(toks)
    with agent.client.acquire(keys) as held:
        for i, meta in enumerate(held.metas):
            assert meta is not None
            assert meta.namespace == agent.namespace.fingerprint
            assert meta.parent == parent_keys(keys)[i] and parent_keys(keys)[0] == NO_PARENT
            assert meta.token_count == C and meta.dtype == "float16"
            assert meta.shape == (3, 2, C, 2, 16) and meta.payload_len == agent.block_bytes
            # the payload is [layer][K/V][token][head][dim]: layer 1's V of token 17 is page 1, slot 1
            block = torch.frombuffer(bytearray(b"".join(bytes(v) for v in held.views[i])), dtype=torch.float16).view(
                meta.shape
            )
            assert torch.equal(block[1, 1, 17], src[1][1, 4 * i + 1, 1])


def test_saving_twice_writes_nothing_new(agent_factory: Any) -> None:
    agent = agent_factory()
    toks = tokens(3 * C)
    src = buffers(agent.layout, 12, fill=True)
    assert agent.save(toks, src, list(range(12))).wait(timeout=30).stored == 3
    longer = toks + tokens(C, seed=5)
    src2 = buffers(agent.layout, 16, fill=True, seed=1)
    res = agent.save(longer, src2, list(range(16))).wait(timeout=30)
    assert (res.stored, res.existed) == (1, 3)


def test_load_stops_at_a_gap_and_at_the_end_of_the_block_table(agent_factory: Any) -> None:
    agent = agent_factory()
    toks = tokens(4 * C)
    src = buffers(agent.layout, 16, fill=True)
    agent.save(toks, src, list(range(16))).wait(timeout=30)
    dst = buffers(agent.layout, 16, fill=False)
    h = agent.load(toks, dst, list(range(9)))  # pages for two chunks and a bit
    assert h.num_tokens == 2 * C and h.wait(timeout=30)
    agent.client.delete([agent.keys(toks)[2]])
    assert agent.lookup(toks) == 2 * C
    h = agent.load(toks, dst, list(range(16)))
    assert h.num_tokens == 2 * C and h.wait(timeout=30)
    assert same_pages(src, list(range(8)), dst, list(range(8)), 8)
    miss = agent.load(tokens(3 * C, seed=9), dst, list(range(16)))
    assert miss.num_tokens == 0 and miss.wait()


def test_a_load_from_a_later_chunk_needs_neither_the_leading_chunks_nor_their_pages(agent_factory: Any) -> None:
    """The engine's own prefix cache holds the first chunks: the load starts at
    ``first_chunk``, so those chunks are not acquired (they may be gone from the store)
    and their pages are not written; the later chunks land in their own pages."""
    agent = agent_factory()
    toks = tokens(4 * C)
    src = buffers(agent.layout, 16, fill=True)
    agent.save(toks, src, list(range(16))).wait(timeout=30)
    agent.client.delete(agent.keys(toks)[:2])  # the leading chunks are gone from the store
    before = int(agent.client.stats()["counters"].get("get_hits_dram", 0))
    dst = buffers(agent.layout, 16, fill=False)
    h = agent.load(toks, dst, list(range(16)), first_chunk=2)
    assert h.num_tokens == 4 * C and h.wait(timeout=30)
    assert int(agent.client.stats()["counters"].get("get_hits_dram", 0)) - before == 2  # chunks 2 and 3 only
    assert same_pages(src, list(range(8, 16)), dst, list(range(8, 16)), 8)
    assert all(not d[:, :8].any() for d in dst)  # chunks 0-1's pages untouched
    with pytest.raises(InvalidArgument):
        agent.load(toks, dst, list(range(16)), first_chunk=-1)


def test_a_trailing_partial_chunk_is_stored_and_loaded_under_its_exact_tokens(agent_factory: Any) -> None:
    """``tail=True``: the partial chunk after the full ones is keyed by its exact tokens; a
    prompt one token longer or with another last token finds only the full chunks."""
    agent = agent_factory()
    toks = tokens(2 * C + 20)  # 2 full chunks, a tail of 20 tokens (pages 8 and 9 of chunk 2)
    src = buffers(agent.layout, 12, fill=True)
    ids = list(range(10)) + [9, 9]  # the tail's chunk padded to whole pages with its last page
    res = agent.save(toks, src, ids, tail=True).wait(timeout=30)
    assert (res.stored, res.failed) == (3, 0)
    tail = agent.keys(toks, tail=True)[2]
    assert len(agent.keys(toks, tail=True)) == 3 and tail not in agent.keys(toks + tokens(C, seed=3))
    with agent.client.acquire([tail]) as held:
        assert held.metas[0] is not None and held.metas[0].token_count == 20
    dst = buffers(agent.layout, 12, fill=False)
    h = agent.load(toks, dst, list(range(10)) + [-1, -1], tail=True)
    assert h.num_tokens == 2 * C + 20 and h.wait(timeout=30)
    assert same_pages(src, list(range(10)), dst, list(range(10)), 10)
    assert all(not d[:, 10:].any() for d in dst)
    for other in (toks + [7], toks[:-1] + [(toks[-1] + 1) % 30000]):
        h = agent.load(other, dst, list(range(12)), tail=True)
        assert h.num_tokens == 2 * C and h.wait(timeout=30)


def test_prefetch_then_load_reads_the_hbm_pool(agent_factory: Any) -> None:
    agent = agent_factory()
    toks = tokens(4 * C)
    src = buffers(agent.layout, 16, fill=True)
    agent.save(toks, src, list(range(16))).wait(timeout=30)
    fut = agent.prefetch(toks)
    r = fut.result(timeout=30)
    assert (r.fetched, r.prefix, r.resident) == (4, 4, 0)
    assert agent.prefetch(toks).result(timeout=30).resident == 4  # nothing left to fetch
    agent.client.delete(agent.keys(toks))  # gone from the store: the HBM copies still serve
    assert agent.lookup(toks) == 4 * C
    dst = buffers(agent.layout, 20, fill=False)
    ids = [19, 3, 7, 11, 0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14]
    h = agent.load(toks, dst, ids)
    assert h.num_tokens == 4 * C and h.hbm_chunks == 4 and h.wait(timeout=30)
    assert same_pages(src, list(range(16)), dst, ids, 16)


def test_a_small_pool_evicts_and_loads_mix_hbm_and_dram(agent_factory: Any) -> None:
    lay = make_layout()
    agent = agent_factory(lay, hbm_bytes=2 * lay.block_bytes(C))
    a, b = tokens(3 * C, seed=1), tokens(3 * C, seed=2)
    sa, sb = buffers(lay, 12, fill=True, seed=1), buffers(lay, 12, fill=True, seed=2)
    agent.save(a, sa, list(range(12))).wait(timeout=30)
    agent.save(b, sb, list(range(12))).wait(timeout=30)
    r = agent.prefetch(a).result(timeout=30)
    assert r.fetched == 2 and r.limit == "pool"
    r = agent.prefetch(b).result(timeout=30)
    assert r.fetched == 2 and agent.pool.evictions == 2  # a's blocks made room: they stay in DRAM
    dst = buffers(lay, 12, fill=False)
    h = agent.load(a, dst, list(range(12)))
    assert h.num_tokens == 3 * C and h.hbm_chunks == 0 and h.wait(timeout=30)
    assert same_pages(sa, list(range(12)), dst, list(range(12)), 12)
    h = agent.load(b, dst, list(range(12)))
    assert h.hbm_chunks == 2 and h.wait(timeout=30)
    assert same_pages(sb, list(range(12)), dst, list(range(12)), 12)


def test_prefetch_promotes_nvme_blocks(node_factory: Any, tmp_path: Any) -> None:
    data = tmp_path / "persist"
    n = node_factory("--dram", "64MiB", "--nvme", "128MiB", data_dir=data)
    lay = make_layout()
    ns = lay.namespace("test-model", chunk_tokens=C, tenant_salt=uuid.uuid4().hex)
    toks = tokens(3 * C)
    src = buffers(lay, 12, fill=True)
    with KVClient(n.unix) as c, GPUAgent(c, lay, ns, device="cpu") as agent:
        assert agent.save(toks, src, list(range(12))).wait(timeout=30).stored == 3
    assert n.stop() == 0  # SIGTERM: dirty DRAM blocks are demoted to NVMe
    n2 = node_factory("--dram", "64MiB", "--nvme", "128MiB", data_dir=data)
    with KVClient(n2.unix) as c, GPUAgent(c, lay, ns, device="cpu") as agent:
        keys = agent.keys(toks)
        assert c.lookup(keys) == ["nvme"] * 3
        assert agent.lookup(toks) == 3 * C
        r = agent.prefetch(toks).result(timeout=30)
        assert r.fetched == 3
        assert c.lookup(keys) == ["dram"] * 3  # leased through the node: promoted on the way
        dst = buffers(lay, 12, fill=False)
        h = agent.load(toks, dst, list(range(12)))
        assert h.hbm_chunks == 3 and h.wait(timeout=30)
        assert same_pages(src, list(range(12)), dst, list(range(12)), 12)


def test_contract_violations_raise(agent_factory: Any, node: Any) -> None:
    agent = agent_factory()
    toks = tokens(C)
    with pytest.raises(InvalidArgument, match="layers"):
        agent.load(toks, buffers(agent.layout, 4, fill=False)[:2], [0, 1, 2, 3])
    with pytest.raises(InvalidArgument, match="shape"):
        agent.save(toks, [torch.zeros(2, 4, 16, 2, 8, dtype=torch.float16)] * 3, [0, 1, 2, 3])
    with pytest.raises(InvalidArgument, match="float32"):
        agent.save(toks, [torch.zeros(make_layout().buffer_shape(4))] * 3, [0, 1, 2, 3])
    with pytest.raises(InvalidArgument, match="unix://"):
        agent_factory(target=node.tcp)


def test_fails_open_when_the_node_is_gone(node_factory: Any) -> None:
    n = node_factory("--dram", "64MiB", "--nvme", "0")
    lay = make_layout()
    ns = lay.namespace("test-model", chunk_tokens=C)
    from client import Timeouts

    with KVClient(n.unix, timeouts=Timeouts(rpc=2.0)) as c, GPUAgent(c, lay, ns, device="cpu") as agent:
        toks = tokens(2 * C)
        src = buffers(lay, 8, fill=True)
        agent.save(toks, src, list(range(8))).wait(timeout=30)
        n.kill9()
        assert agent.lookup(toks) == 0
        h = agent.load(toks, buffers(lay, 8, fill=False), list(range(8)))
        assert h.num_tokens == 0 and h.wait()
        res = agent.save(tokens(2 * C, seed=3), src, list(range(8))).wait(timeout=30)
        assert res.stored == 0 and res.failed == 2
        assert agent.prefetch(toks).result(timeout=30).fetched == 0
        assert agent.stats()["counters"]["store_errors"] >= 3


def test_save_is_a_fence_the_engine_may_reuse_its_pages_at_once(agent_factory: Any) -> None:
    """Issue: save() returned with the copies only queued; pages the engine then reused
    were stored under valid checksums.  Once save() returns the pages are the caller's."""
    agent = agent_factory(KVCacheLayout(num_layers=16, num_kv_heads=2, head_dim=16, page_size=16))
    toks = tokens(8 * C)
    src = buffers(agent.layout, 64, fill=True, seed=3)
    ids = list(range(63, 0, -2))  # scattered pages: many small copies, as a busy engine's block table
    want = [b.clone() for b in src]
    handle = agent.save(toks, src, ids)
    for b in src:
        b.zero_()  # the engine's next request writes these pages
    assert handle.wait(timeout=30).stored == 8
    dst = buffers(agent.layout, 64, fill=False)
    assert agent.load(toks, dst, ids).wait(timeout=30)
    assert same_pages(want, ids, dst, ids, 32)


def test_a_load_into_just_saved_pages_queues_after_the_save(agent_factory: Any) -> None:
    agent = agent_factory(KVCacheLayout(num_layers=16, num_kv_heads=2, head_dim=16, page_size=16))
    old, new = tokens(8 * C, seed=1), tokens(8 * C, seed=2)
    ids = list(range(63, 0, -2))
    pages = buffers(agent.layout, 64, fill=True, seed=4)
    agent.save(old, pages, ids).wait(timeout=30)
    other = buffers(agent.layout, 64, fill=True, seed=5)
    want_new = [b.clone() for b in other]
    want_old = [b.clone() for b in pages]
    handle = agent.save(new, other, ids)
    agent.load(old, other, ids).wait(timeout=30)  # the same pages, at once
    assert handle.wait(timeout=30).stored == 8
    assert same_pages(want_old, ids, other, ids, 32)
    back = buffers(agent.layout, 64, fill=False)
    assert agent.load(new, back, ids).wait(timeout=30)
    assert same_pages(want_new, ids, back, ids, 32)


def test_devices_are_normalised(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpu_agent.copy_engine import normalize_device

    assert normalize_device("cpu") == torch.device("cpu")
    assert normalize_device(torch.device("cpu")) == torch.device("cpu")
    if not torch.cuda.is_available():
        assert normalize_device(None) == torch.device("cpu")
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)  # the index of a bare "cuda"
    want = torch.device("cuda", torch.cuda.current_device())
    assert normalize_device("cuda") == want and normalize_device(torch.device("cuda")) == want
    assert normalize_device("cuda:0") == torch.device("cuda", 0)  # an explicit index is kept


def test_batched_copies_round_trip_scattered_tables_and_skipped_pages(agent_factory: Any) -> None:
    """The CUDA copy path (staging plus one scatter or gather per layer) run on CPU tensors."""
    agent = agent_factory(batch_on_cpu=True, staging_bytes=1)  # a group per block: the most passes
    toks = tokens(4 * C)
    src = buffers(agent.layout, 40, fill=True, seed=7)
    ids = [39, 3, 17, 8, 0, 1, 2, 36, 21, 22, 23, 24, 5, 30, 12, 11]
    assert agent.save(toks, src, ids).wait(timeout=30).stored == 4
    dst = buffers(agent.layout, 40, fill=False)
    back = [-1, -1, 4, 5, 6, 7, 8, 9, 10, 31, 32, 33, 34, 35, 36, 37]  # the engine holds the first two pages
    h = agent.load(toks, dst, back)
    assert h.num_tokens == 4 * C and h.wait(timeout=30)
    assert same_pages(src, ids[2:], dst, back[2:], 14)
    assert all(not d[:, [0, 1, 2, 3]].any() for d in dst)
    assert agent.prefetch(toks).result(timeout=30).fetched == 4
    again = buffers(agent.layout, 40, fill=False)
    h = agent.load(toks, again, ids)
    assert h.hbm_chunks == 4 and h.wait(timeout=30)
    assert same_pages(src, ids, again, ids, 16)


def test_a_load_returns_with_layer_0_queued_and_the_rest_follow(agent_factory: Any) -> None:
    """The device path (batched, as on CUDA): layers after the first are queued by the issuer."""
    from gpu_agent.copy_engine import DeferredEvent

    agent = agent_factory(batch_on_cpu=True)
    toks = tokens(2 * C)
    src = buffers(agent.layout, 8, fill=True)
    agent.save(toks, src, list(range(8))).wait(timeout=30)
    dst = buffers(agent.layout, 8, fill=False)
    h = agent.load(toks, dst, list(range(8)))
    assert all(isinstance(e, DeferredEvent) for e in h._events[1:])  # queued by the issuer, not the engine's thread
    for layer in range(3):
        h.wait_layer(layer)
        assert all(
            torch.equal(dst[layer][:, i].view(torch.uint8), src[layer][:, i].view(torch.uint8)) for i in range(8)
        )
    assert h.wait(timeout=30)


@pytest.mark.parametrize("threads", [1, 3])
def test_a_cpu_load_is_in_the_pages_when_load_returns_and_its_leases_are_back(
    agent_factory: Any, node: Any, threads: int
) -> None:
    """The CPU path copies inline (issue 24): no layer is left to wait for, and the leases
    go back without a round trip on the engine's thread (the node sees them released)."""
    from gpu_agent.copy_engine import DoneEvent

    agent = agent_factory(copy_threads=threads)
    toks = tokens(5 * C)
    src = buffers(agent.layout, 20, fill=True)
    table = [7, 3, 12, 0, 19, 4, 5, 6, 1, 2, 8, 9, 10, 11, 13, 14, 15, 16, 17, 18]  # scattered
    assert agent.save(toks, src, table).wait(timeout=30).stored == 5
    dst = buffers(agent.layout, 20, fill=False)
    h = agent.load(toks, dst, table)
    assert h.num_tokens == 5 * C and all(isinstance(e, DoneEvent) for e in h._events)
    assert same_pages(src, table, dst, table, 20)  # before any wait
    assert h.wait(timeout=0) is True
    with KVClient(node.unix) as other:
        from conftest import wait_for

        wait_for(lambda: other.stats()["leases"] == 0, 10, "the node to see the leases released")


def test_a_save_reserved_ahead_uses_that_space_and_an_unused_one_is_given_back(agent_factory: Any, node: Any) -> None:
    """``reserve_ahead`` (issue 24): the Reserve of a save runs while the engine computes;
    the save then makes no Reserve call of its own.  One for other blocks is aborted."""
    agent = agent_factory()
    toks = tokens(3 * C)
    src = buffers(agent.layout, 12, fill=True)
    import threading

    calls: list[tuple[bool, int]] = []  # (made on the reserver thread, blocks)
    reserve = agent.client.reserve

    def counted(metas: Any, **kw: Any) -> Any:
        calls.append((threading.current_thread().name.startswith("kv-reserve"), len(metas)))
        return reserve(metas, **kw)

    agent.client.reserve = counted
    ahead = agent.reserve_ahead(toks, list(range(12)))
    try:
        assert agent.save(toks, src, list(range(12)), ahead=ahead).wait(timeout=30).stored == 3
        assert calls == [(True, 3)]
        dst = buffers(agent.layout, 12, fill=False)
        assert agent.load(toks, dst, list(range(12))).wait(timeout=30)
        assert same_pages(src, list(range(12)), dst, list(range(12)), 12)
        other = agent.reserve_ahead(tokens(2 * C, seed=5), list(range(8)))
        assert agent.save(tokens(2 * C, seed=6), src, list(range(8)), ahead=other).wait(timeout=30).stored == 2
        assert other.wait(timeout=30)  # the reserver thread's call may come after the save's own
        assert sorted(calls[1:]) == [(False, 2), (True, 2)]  # it reserved for itself; the other went back
        never = agent.reserve_ahead(tokens(2 * C, seed=7), list(range(8)))
        never.abort()
    finally:
        agent.client.reserve = reserve
    with KVClient(node.unix) as c:
        from conftest import wait_for

        wait_for(lambda: c.stats()["reservations"] == 0, 10, "the unused reservations to be aborted")


def test_a_corrupt_block_is_copied_but_never_counted_as_loaded(agent_factory: Any) -> None:
    """The checksum is computed during the copy: a block whose bytes changed in the store
    was written into its pages, so the load stops before it and the engine recomputes it."""
    import numpy as np

    agent = agent_factory()
    toks = tokens(4 * C)
    src = buffers(agent.layout, 16, fill=True)
    agent.save(toks, src, list(range(16))).wait(timeout=30)
    keys = agent.keys(toks)
    arena = np.frombuffer(agent.client.arena_buffer(), dtype=np.uint8)
    with agent.client.acquire(keys[2:3]) as held:  # one byte of chunk 2, flipped in place
        v = held.views[0][-1]
        off = np.frombuffer(v, dtype=np.uint8).ctypes.data - arena.ctypes.data
        arena[off + v.nbytes // 2] ^= 0xFF
    h = agent.load(toks, buffers(agent.layout, 16, fill=False), list(range(16)))
    assert h.num_tokens == 2 * C and h.wait(timeout=30)
    assert agent.stats()["counters"]["checksum_failures"] == 1
    off_agent = agent_factory(verify_loads=False)  # the same namespace is not needed: count only
    assert off_agent.config.verify_loads is False


def test_a_lease_read_after_its_deadline_is_checked_with_the_node(agent_factory: Any) -> None:
    """Before ``held_until`` a release does not wait; after it the node says whether the lease
    outlived the read (here it did: the TTL is long, the deadline was moved up)."""
    agent = agent_factory()
    toks = tokens(2 * C)
    agent.save(toks, buffers(agent.layout, 8, fill=True), list(range(8))).wait(timeout=30)
    leased = agent.client.acquire(agent.keys(toks))
    import time as _time

    assert leased.held_until > _time.monotonic()
    leased.held_until = 0.0  # as if the read took past the deadline
    assert leased.release() == [True, True]


def test_prefetch_publishes_pool_slots_only_after_its_copy_completed(agent_factory: Any) -> None:
    """Issue 18 #5: a load could copy from a slot whose prefetch had not filled it yet."""
    import threading

    agent = agent_factory()
    toks = tokens(3 * C)
    src = buffers(agent.layout, 12, fill=True)
    agent.save(toks, src, list(range(12))).wait(timeout=30)
    gate = threading.Event()
    agent.engine.submit("prefetch", lambda: gate.wait(30))  # the prefetch stream is busy
    fut = agent.prefetch(toks)
    from conftest import wait_for

    wait_for(lambda: agent.pool.stats()["reserved_slots"] == 3, 30, "the prefetch to reserve its slots")
    assert not any(agent.pool.contains(k) for k in agent.keys(toks))  # reserved, not yet visible
    dst = buffers(agent.layout, 12, fill=False)
    h = agent.load(toks, dst, list(range(12)))
    assert h.hbm_chunks == 0 and h.wait(timeout=30)  # read from the arena, never an unfilled slot
    assert same_pages(src, list(range(12)), dst, list(range(12)), 12)
    gate.set()
    assert fut.result(timeout=30).fetched == 3
    assert all(agent.pool.contains(k) for k in agent.keys(toks)) and agent.pool.stats()["reserved_slots"] == 0


def test_a_prefetch_whose_copy_cannot_be_queued_leaves_no_slot(
    agent_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent = agent_factory()
    toks = tokens(2 * C)
    agent.save(toks, buffers(agent.layout, 8, fill=True), list(range(8))).wait(timeout=30)
    submit = agent.engine.submit

    def refuse(direction: str, *a: Any, **k: Any) -> Any:
        if direction == "prefetch":
            raise RuntimeError("no stream")
        return submit(direction, *a, **k)

    monkeypatch.setattr(agent.engine, "submit", refuse)
    with pytest.raises(RuntimeError, match="no stream"):
        agent.prefetch(toks).result(timeout=30)
    assert len(agent.pool) == 0 and agent.pool.free_slots == agent.pool.capacity
    assert agent.pool.stats()["reserved_slots"] == 0
    monkeypatch.undo()
    assert agent.prefetch(toks).result(timeout=30).fetched == 2  # and the leases were given back


class SlowCommits:
    """A client whose commits wait on a gate: a save whose checksum and commit take long."""

    def __init__(self, client: KVClient, gate: Any) -> None:
        self._client = client
        self.gate = gate

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def reserve(self, metas: Any, **kw: Any) -> Any:
        res = self._client.reserve(metas, **kw)
        commit = res.commit
        res.commit = lambda sums=None: (self.gate.wait(30), commit(sums))[1]
        return res


def test_a_load_releases_its_leases_without_waiting_behind_a_save_commit(node: Any) -> None:
    """Issue 18 #7: one completer thread made load-lease releases wait for a save's commit."""
    import threading

    lay = make_layout()
    ns = lay.namespace("test-model", chunk_tokens=C, tenant_salt=uuid.uuid4().hex)
    gate = threading.Event()
    gate.set()
    with KVClient(node.unix) as c, GPUAgent(SlowCommits(c, gate), lay, ns, device="cpu") as agent:
        a, b = tokens(2 * C, seed=1), tokens(2 * C, seed=2)
        agent.save(a, buffers(lay, 8, fill=True), list(range(8))).wait(timeout=30)
        gate.clear()
        slow = agent.save(b, buffers(lay, 8, fill=True, seed=2), list(range(8)))
        h = agent.load(a, buffers(lay, 8, fill=False), list(range(8)))
        assert h.wait(timeout=10) is True  # leases back while the save still commits
        assert not slow.done()
        gate.set()
        assert slow.wait(timeout=30).stored == 2


def test_registration_follows_the_clients_arena_across_a_node_restart(tmp_path: Any) -> None:
    """Issue 18 #3/#4 on the CPU copy engine with a fake CUDA runtime: two agents on one client
    register the arena once; after a node restart the first transfer registers the new
    mapping and the old one is unregistered while still mapped; closing unregisters all."""
    from conftest import NodeProcess
    from gpu_agent_fakes import FakeCudart

    rt = FakeCudart()
    n = NodeProcess(tmp_path / "node", "--dram", "64MiB", "--nvme", "0").start()
    lay = make_layout()
    ns = lay.namespace("test-model", chunk_tokens=C, tenant_salt=uuid.uuid4().hex)
    try:
        with KVClient(n.unix) as c:
            one = GPUAgent(c, lay, ns, device="cpu", cudart=rt)
            two = GPUAgent(c, lay, ns, device="cpu", cudart=rt)
            assert one.pinned and two.pinned and rt.count("register") == 1 and len(rt.registered) == 1
            (old,) = rt.registered
            toks = tokens(2 * C)
            src = buffers(lay, 8, fill=True)
            assert one.save(toks, src, list(range(8))).wait(timeout=30).stored == 2
            n.stop()
            n.start()  # same arena path: the file is replaced, the client remaps on its next call
            assert one.save(toks, src, list(range(8))).wait(timeout=30).stored == 2
            assert one.pinned and rt.count("register") == 2
            for _ in range(3):  # the old mapping is retired once the copies queued from it are done
                dst = buffers(lay, 8, fill=False)
                assert one.load(toks, dst, list(range(8))).wait(timeout=30)
                assert same_pages(src, list(range(8)), dst, list(range(8)), 8)
            two.load(toks, buffers(lay, 8, fill=False), list(range(8))).wait(timeout=30)
            assert set(rt.registered) != {old} and len(rt.registered) == 1
            one.close()
            assert len(rt.registered) == 1  # the other agent still uses it
            two.close()
            assert rt.registered == {} and all(rt.mapped_at_unregister)
            assert one.stats()["counters"].get("staged_blocks", 0) == 0
    finally:
        n.stop()
        import os

        if os.path.exists(n.arena_path):
            os.unlink(n.arena_path)


def test_a_refused_registration_stages_every_transfer(agent_factory: Any, node: Any) -> None:
    from gpu_agent_fakes import FakeCudart

    rt = FakeCudart(refuse=1)
    lay = make_layout()
    ns = lay.namespace("test-model", chunk_tokens=C, tenant_salt=uuid.uuid4().hex)
    with KVClient(node.unix) as c, GPUAgent(c, lay, ns, device="cpu", cudart=rt) as agent:
        assert agent.pinned is False and rt.last_error == 0
        toks = tokens(2 * C)
        src = buffers(lay, 8, fill=True)
        assert agent.save(toks, src, list(range(8))).wait(timeout=30).stored == 2
        dst = buffers(lay, 8, fill=False)
        assert agent.load(toks, dst, list(range(8))).wait(timeout=30)
        assert same_pages(src, list(range(8)), dst, list(range(8)), 8)
        assert agent.stats()["counters"]["staged_blocks"] == 4 and rt.count("register") == 1

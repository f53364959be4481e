"""kvstore as SGLang HiCache's storage backend, through SGLang's own code paths.

The backend is loaded by SGLang's dynamic loader from the extra config users write, over
SGLang's own host pools, keyed by SGLang's own page hashes; the first test runs SGLang's
``HiCacheController`` threads (backup, prefetch query, prefetch I/O) against a real node.
Every read is checked byte for byte against what was written; every failure is a miss.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from conftest import agent_metric
from sglang_rig import (
    LAYOUTS,
    MODEL,
    PAGE,
    backend,
    controller,
    extra_config,
    fill,
    mla_pools,
    one_rank,
    page_keys,
    pages,
    pools,
)

from client import KVClient
from gpu_agent.sglang.settings import page_key
from kvstore.errors import InvalidArgument

pytestmark = pytest.mark.sglang


def tokens(seed: int, n_pages: int = 6) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 30000, (n_pages * PAGE,), generator=g).tolist()


def reads(kv: KVClient) -> int:
    c = kv.stats()["counters"]
    return int(c["get_hits_dram"] + c["get_hits_nvme"])


def test_sglang_controller_backs_up_to_kvstore_and_a_second_engine_prefetches_the_same_bytes(node: Any) -> None:
    """One engine's controller backs pages up; another engine's controller (its own host pool,
    its own backend instance) finds them with its prefetch query and reads them into its host
    pool: the bytes are the first engine's, and the node counted the reads."""
    extra = extra_config(node.unix)
    toks = tokens(1)
    keys = page_keys(toks)
    with one_rank(), KVClient(node.unix) as kv:
        dev_a, host_a = pools()
        fill(host_a, seed=11)
        a = controller(dev_a, host_a, extra)
        try:
            assert type(a.storage_backend).__name__ == "KVStoreHiCacheStorage"
            assert a.page_get_func.__name__ == "_page_get_zero_copy"  # interface_v1: the zero-copy calls
            src = host_a.alloc(len(toks))
            want = pages(host_a, src, len(keys))
            a.write_storage(src, toks, hash_value=keys)
            done = a.ack_backup_queue.get(timeout=30)
            assert done.completed_tokens == len(toks)
        finally:
            a.detach_storage_backend()

        dev_b, host_b = pools()
        fill(host_b, seed=22)  # other bytes everywhere: a page not read stays different
        b = controller(dev_b, host_b, extra)
        before = reads(kv)
        try:
            op = b.prefetch("req-1", toks, None)
            op = b.prefetch_hit_queue.get(timeout=30)
            assert op.storage_hit_count == len(toks)
            op.host_indices = b.mem_pool_host.alloc(op.storage_hit_count)
            b.prefetch_buffer.put(op)
            completed, deadline = 0, time.monotonic() + 30
            while time.monotonic() < deadline:
                ack = b.ack_prefetch_queue.get(timeout=30)
                if ack.completed_tokens is not None:
                    completed = max(completed, ack.completed_tokens)
                if completed == len(toks):
                    break
            assert completed == len(toks)
            got = pages(host_b, op.host_indices, len(keys))
            assert all(torch.equal(w, g) for w, g in zip(want, got, strict=True))
            assert reads(kv) - before == len(keys)
            stats = b.storage_backend.stats.snapshot()
            assert stats["read_hits"] == len(keys) and stats["errors"] == 0
        finally:
            b.detach_storage_backend()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pages_round_trip_in_every_host_layout_by_both_interfaces(node: Any, layout: str) -> None:
    """Zero-copy v1 calls and the generic flat-page calls store and read the same bytes, in
    each host layout SGLang offers."""
    _, host = pools(layout)
    b = backend(host, extra_config(node.unix))
    fill(host, seed=3)
    toks = tokens(2)
    keys = page_keys(toks)
    src = host.alloc(len(toks))
    want = pages(host, src, len(keys))
    assert b.batch_exists(keys) == 0
    assert b.batch_set_v1(keys[:3], src[: 3 * PAGE]) == [True] * 3
    assert b.batch_set(keys[3:], want[3:]) is True  # the generic path, for the rest
    dst = host.alloc(len(toks))
    assert b.batch_get_v1(keys, dst) == [True] * len(keys)
    assert all(torch.equal(w, g) for w, g in zip(want, pages(host, dst, len(keys)), strict=True))
    outs = [host.get_dummy_flat_data_page() for _ in keys]
    got = b.batch_get(keys, outs)
    assert all(g is not None and torch.equal(w, g) for w, g in zip(want, got, strict=True))
    b.close()


def test_exists_counts_the_leading_run_and_a_gap_ends_it(node: Any) -> None:
    _, host = pools()
    b = backend(host, extra_config(node.unix))
    fill(host, seed=4)
    keys = page_keys(tokens(3))
    src = host.alloc(len(keys) * PAGE)
    assert all(b.batch_set_v1(keys, src))
    assert b.batch_exists(keys) == len(keys)
    assert b.batch_exists([*keys[:2], "0" * 64, *keys[3:]]) == 2
    assert b.batch_exists(["f" * 64, *keys]) == 0
    assert b.exists(keys[0]) and not b.exists("e" * 64)
    dst = host.alloc(3 * PAGE)
    assert b.batch_get_v1([keys[0], "d" * 64, keys[2]], dst) == [True, False, True]
    b.close()


@pytest.mark.parametrize(
    "reader",
    [
        {"model": "meta-llama/Llama-3.1-8B"},  # another model
        {"tp_rank": 1, "tp_size": 2},  # another tensor-parallel shard
        {"extra": {"kvstore_salt": "tenant-b"}},  # another tenant
        {"dtype": torch.float16},  # another KV dtype
        {"layout": "layer_first"},  # another host byte order
    ],
    ids=["model", "tp-rank", "salt", "dtype", "layout"],
)
def test_another_model_rank_tenant_dtype_or_layout_never_reads_the_pages(node: Any, reader: dict[str, Any]) -> None:
    """The same SGLang page hashes, asked by an engine whose KV would differ: every page is a
    miss and the reader's host pool keeps its own bytes."""
    _, host = pools()
    writer = backend(host, extra_config(node.unix))
    fill(host, seed=5)
    keys = page_keys(tokens(4))
    assert all(writer.batch_set_v1(keys, host.alloc(len(keys) * PAGE)))

    r = dict(reader)
    extra = {**extra_config(node.unix), **r.pop("extra", {})}
    _, other = pools(r.pop("layout", "page_first"), dtype=r.pop("dtype", torch.bfloat16))
    b = backend(other, extra, **r)
    fill(other, seed=6)
    dst = other.alloc(len(keys) * PAGE)
    before = pages(other, dst, len(keys))
    assert b.batch_exists(keys) == 0
    assert b.batch_get_v1(keys, dst) == [False] * len(keys)
    assert all(torch.equal(x, y) for x, y in zip(before, pages(other, dst, len(keys)), strict=True))
    writer.close()
    b.close()


def test_a_block_of_the_wrong_size_under_a_page_key_is_a_miss(node: Any) -> None:
    """Bytes of another size stored under the page's own key (a corrupted writer): the read
    says False and the host page is left as it was."""
    _, host = pools()
    b = backend(host, extra_config(node.unix))
    keys = page_keys(tokens(5, n_pages=2))
    with KVClient(node.unix) as kv:
        assert kv.put(page_key(b.namespace.fingerprint, keys[0]), b"x" * 100, namespace=b.namespace)
    fill(host, seed=7)
    dst = host.alloc(2 * PAGE)
    before = pages(host, dst, 2)
    assert b.batch_get_v1(keys, dst) == [False, False]
    assert all(torch.equal(x, y) for x, y in zip(before, pages(host, dst, 2), strict=True))
    b.close()


def test_a_block_larger_than_a_page_misses_alone(node: Any) -> None:
    """A block larger than a page under one page's key (the SDK refuses a batch holding one)
    is that page's miss only: the other page of the batch still reads."""
    _, host = pools()
    b = backend(host, extra_config(node.unix))
    keys = page_keys(tokens(6, n_pages=2))
    fill(host, seed=8)
    src = host.alloc(2 * PAGE)
    assert b.batch_set_v1(keys, src) == [True, True]
    with KVClient(node.unix) as kv:
        bad = page_key(b.namespace.fingerprint, keys[0])
        assert kv.delete([bad]) == 1
        assert kv.put(bad, b"x" * (2 * b.geometry.page_bytes), namespace=b.namespace)
    dst = host.alloc(2 * PAGE)
    assert b.batch_get_v1(keys, dst) == [False, True]
    assert torch.equal(pages(host, dst, 2)[1], pages(host, src, 2)[1])
    b.close()


def test_a_node_killed_after_the_query_leaves_misses_and_the_host_pages_untouched(node_factory: Any) -> None:
    """The prefetch query found every page; the node dies before the read: every page is a
    miss (SGLang recomputes), within the deadline, and nothing is written into the host pool.
    Later calls miss too, none raises into SGLang's threads."""
    n = node_factory("--dram", "64MiB", "--nvme", "0")
    _, host = pools()
    b = backend(host, extra_config(n.unix, kvstore_deadline_s=1.0))
    fill(host, seed=8)
    keys = page_keys(tokens(6))
    assert all(b.batch_set_v1(keys, host.alloc(len(keys) * PAGE)))
    assert b.batch_exists(keys) == len(keys)
    n.kill9()
    dst = host.alloc(len(keys) * PAGE)
    before = pages(host, dst, len(keys))
    assert b.batch_get_v1(keys, dst) == [False] * len(keys)
    assert all(torch.equal(x, y) for x, y in zip(before, pages(host, dst, len(keys)), strict=True))
    assert b.batch_exists(keys) == 0
    assert b.batch_set_v1(keys, dst) == [False] * len(keys)
    assert b.batch_get(keys) == [None] * len(keys)
    assert b.stats.snapshot()["errors"] >= 3
    b.close()


def test_bad_extra_config_is_refused_by_name_when_sglang_attaches(node: Any) -> None:
    _, host = pools()
    with pytest.raises(InvalidArgument, match="kvstore_target"):
        backend(host, {k: v for k, v in extra_config(node.unix).items() if k != "kvstore_target"})
    with pytest.raises(InvalidArgument, match="kvstore_tagret"):
        backend(host, extra_config(node.unix, kvstore_tagret="x"))
    with pytest.raises(InvalidArgument, match="kvstore_deadline_s"):
        backend(host, extra_config(node.unix, kvstore_deadline_s=0))


def test_a_hybrid_models_extra_pool_is_refused_at_attach(node: Any) -> None:
    """SGLang's v2 calls for Mamba / SWA / DSA pools are not served: attaching one fails with
    a message that says so, instead of a prefetch thread dying later."""
    _, host = pools()
    b = backend(host, extra_config(node.unix))
    with pytest.raises(NotImplementedError, match="KV pages only"):
        b.register_mem_host_pool_v2(host, "mamba")
    b.close()


def test_the_model_name_defaults_to_sglangs_and_kvstore_model_overrides_it(node: Any) -> None:
    _, host = pools()
    b = backend(host, extra_config(node.unix))
    c = backend(host, extra_config(node.unix, kvstore_model="qwen3-0.6b"))
    assert b.namespace.model_id == MODEL and c.namespace.model_id == "qwen3-0.6b"
    assert b.namespace.chunk_tokens == PAGE and b.namespace.layout.page_layout == "sglang:page_first"
    b.close()
    c.close()


def test_the_node_counts_the_backends_calls_under_its_agent(node_factory: Any) -> None:
    """The node's metrics name the SGLang backend (agent ``sglang-hicache``): its pages
    written, its reads' hits and misses and their bytes, apart from plain SDK clients."""
    n = node_factory("--dram", "64MiB", "--nvme", "0", "--metrics-port", "0")
    _, host = pools()
    b = backend(host, extra_config(n.unix))
    fill(host, seed=9)
    keys = page_keys(tokens(7))
    assert all(b.batch_set_v1(keys, host.alloc(len(keys) * PAGE)))
    assert b.batch_get_v1([*keys[:4], "9" * 64], host.alloc(5 * PAGE)) == [True] * 4 + [False]
    page_bytes = b.geometry.page_bytes
    v = agent_metric(n.endpoints["metrics"], "sglang-hicache")
    assert v("kvstore_agent_blocks_total", op="write", result="stored") == len(keys)
    assert v("kvstore_agent_blocks_total", op="read", result="hit") == 4
    assert v("kvstore_agent_blocks_total", op="read", result="miss") == 1
    assert v("kvstore_agent_bytes_total", direction="read") == 4 * page_bytes
    assert v("kvstore_agent_bytes_total", direction="write") == len(keys) * page_bytes
    assert "sdk" not in v.agents  # type: ignore[attr-defined]
    b.close()


def test_mla_pages_are_written_by_rank_0_and_read_by_every_rank(node: Any) -> None:
    """MLA's latent KV is the same on every tensor rank: rank 0 writes it (rank 1's writes
    store nothing and report success, as SGLang expects of a non-writer), rank 1 reads rank
    0's pages, and the pages are read straight into the pool (a contiguous page)."""
    _, host0 = mla_pools()
    _, host1 = mla_pools()
    extra = extra_config(node.unix)
    r0 = backend(host0, extra, tp_rank=0, tp_size=2, mla=True)
    r1 = backend(host1, extra, tp_rank=1, tp_size=2, mla=True)
    assert r0.namespace == r1.namespace and r0.is_writer and not r1.is_writer
    fill(host0, seed=10)
    fill(host1, seed=11)
    keys = page_keys(tokens(8))
    src1 = host1.alloc(len(keys) * PAGE)
    assert r1.batch_set_v1(keys, src1) == [True] * len(keys)
    assert r1.batch_exists(keys) == 0  # rank 1 stored nothing
    src0 = host0.alloc(len(keys) * PAGE)
    want = pages(host0, src0, len(keys))
    assert r0.batch_set_v1(keys, src0) == [True] * len(keys)
    dst = host1.alloc(len(keys) * PAGE)
    assert r1.batch_get_v1(keys, dst) == [True] * len(keys)
    assert all(torch.equal(w, g) for w, g in zip(want, pages(host1, dst, len(keys)), strict=True))
    _, mha = pools()
    other = backend(mha, extra)  # the same page hashes from a non-MLA pool: another namespace
    assert other.batch_exists(keys) == 0
    for b in (r0, r1, other):
        b.close()

"""kvstore as LMCache's L2 store, driven through LMCache's own code (``tests/lmcache_store``).

Each "server" is LMCache's ``StorageManager`` configured by its own command-line parser with
kvstore's adapter on ``--l2-adapter`` (LMCache's ``plugin`` type imports it); its store
controller pushes finished writes to kvstore and its prefetch controller looks chunks up, locks,
loads and unlocks them, against a real node.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from conftest import agent_metric
from lmcache.v1.distributed.api import MemoryLayoutDesc
from lmcache_rig import (
    CHUNK_BYTES,
    LAYOUT,
    MODEL,
    adapter,
    adapter_config,
    chunk_keys,
    hits,
    l2_hits,
    prefetch,
    read,
    server,
    wait_stored,
    write,
)

from client import KVClient
from gpu_agent.lmcache.settings import ChunkIdentity, chunk_key, chunk_namespace, layout_string
from kvstore.errors import InvalidArgument

pytestmark = pytest.mark.lmcache


def reads(kv: KVClient) -> int:
    c = kv.stats()["counters"]
    return int(c["get_hits_dram"] + c["get_hits_nvme"])


def test_a_server_stores_to_kvstore_and_another_prefetches_the_same_bytes(node: Any) -> None:
    """Server A's store controller writes six chunks to kvstore; server B (an empty L1: another
    server, or A restarted) prefetches them: every chunk an L2 hit, the bytes A's, the node
    counted six reads, and B's lookup locks were released (no pin left on the node)."""
    keys = chunk_keys(1)
    with KVClient(node.unix) as kv:
        with server(node.unix) as a:
            want = write(a, keys, seed=1)
            wait_stored(a, len(keys))
            assert adapter(a).stats.snapshot()["store_bytes"] == len(keys) * CHUNK_BYTES
        before = reads(kv)
        with server(node.unix) as b:
            result = prefetch(b, keys)
            assert l2_hits(result) == "1" * len(keys)
            got = read(b, keys)
            for k, t in zip(keys, got, strict=True):
                assert torch.equal(t, want[k])
            s = adapter(b).stats.snapshot()
            assert (s["found"], s["loaded"], s["errors"]) == (len(keys), len(keys), 0)
            deadline = time.monotonic() + 10
            while kv.stats()["pins"] and time.monotonic() < deadline:  # unlock runs on the adapter's thread
                time.sleep(0.05)
            assert kv.stats()["pins"] == 0
        assert reads(kv) - before == len(keys)


@pytest.mark.parametrize(
    "other",
    [
        {"model": "other/model"},
        {"kv_rank": (2 << 24) | (1 << 16) | (2 << 8) | 1},  # rank 1 of a TP-2 world
        {"cache_salt": "tenant-b"},
        {"dtype": torch.bfloat16},  # the same size as float16: only the key tells them apart
        {"salt": "another-deployment"},
    ],
    ids=["model", "kv_rank", "cache_salt", "dtype", "deployment_salt"],
)
def test_another_model_rank_salt_or_dtype_never_reads_the_chunks(node: Any, other: dict[str, Any]) -> None:
    """The same LMCache chunk hashes asked for under another model, kv rank, cache salt, KV
    dtype or deployment salt all miss in L2: nothing is read into the asking server's L1."""
    keys = chunk_keys(3, 4)
    with server(node.unix) as a:
        write(a, keys, seed=3)
        wait_stored(a, len(keys))
    asked = chunk_keys(
        3,
        4,
        model=other.get("model", MODEL),
        kv_rank=other.get("kv_rank", 0),
        cache_salt=other.get("cache_salt", ""),
    )
    layout = MemoryLayoutDesc(shapes=LAYOUT.shapes, dtypes=[other.get("dtype", torch.float16)])
    params = {"salt": other["salt"]} if "salt" in other else {}
    with KVClient(node.unix) as kv, server(node.unix, **params) as b:
        before = reads(kv)
        result = prefetch(b, asked, layout)
        assert l2_hits(result) == "0000" and hits(result) == "0000"
        assert reads(kv) == before
        assert adapter(b).stats.snapshot()["found"] == 0


@pytest.mark.parametrize("size", [CHUNK_BYTES // 2, CHUNK_BYTES * 2], ids=["smaller", "larger"])
def test_a_block_of_the_wrong_size_under_a_chunks_key_is_a_miss(node: Any, size: int) -> None:
    """Bytes of the wrong size under a chunk's key (a writer with another layout, a bug) are
    never handed to LMCache: the chunk is a miss, and with LMCache's prefix policy so is what
    follows it; the chunks before it load (a block too large for its buffer costs only its own
    chunk, not the batch)."""
    keys = chunk_keys(4, 4)
    with server(node.unix) as a:
        write(a, keys, seed=4)
        wait_stored(a, len(keys))
    layout = layout_string([torch.float16], [tuple(LAYOUT.shapes[0])])
    ns = chunk_namespace(ChunkIdentity(MODEL, 0, 0, "", layout))
    bad = chunk_key(ns.fingerprint, keys[2].chunk_hash)
    with KVClient(node.unix) as kv:
        assert kv.delete([bad]) == 1
        assert kv.put_many([bad], [bytes(size)], namespace=ns) == [True]
    with server(node.unix) as b:
        result = prefetch(b, keys)
        assert l2_hits(result) == "1100"
        s = adapter(b).stats.snapshot()
        assert s["wrong_size"] == 1 and s["loaded"] == 3  # LMCache loads what it found; the prefix ends at the gap


def test_a_node_down_leaves_misses_and_failed_stores_within_the_deadline(node_factory: Any) -> None:
    """The node killed: a prefetch finishes within the deadline with no hit, a store task
    reports failure, nothing raises into LMCache's controller threads, and the adapter says
    it is unhealthy."""
    n = node_factory("--dram", "64MiB", "--nvme", "0")
    keys = chunk_keys(5, 3)
    with server(n.unix, deadline_s=1.0) as a:
        write(a, keys, seed=5)
        wait_stored(a, len(keys))
        n.kill9()
        t0 = time.monotonic()
        fresh = chunk_keys(6, 3)
        with server(n.unix, deadline_s=1.0) as b:
            result = prefetch(b, keys, timeout=15)
            assert hits(result) == "000"
            assert time.monotonic() - t0 < 10
            assert adapter(b).report_status()["is_healthy"] is False
        write(a, fresh, seed=6)
        deadline = time.monotonic() + 15
        while adapter(a).stats.snapshot()["errors"] == 0:
            assert time.monotonic() < deadline, "the store task never finished"
            time.sleep(0.05)
        assert adapter(a).stats.snapshot()["stored"] == len(keys)


def test_lookup_locks_pin_chunks_until_unlocked(node: Any) -> None:
    """LMCache's lookup-and-lock pins what it found on the node (so eviction keeps it until
    the load); the unlock of the last lock unpins it; a key locked twice stays pinned until
    both locks are released."""
    keys = chunk_keys(7, 3)
    with KVClient(node.unix) as kv, server(node.unix) as a:
        write(a, keys, seed=7)
        wait_stored(a, len(keys))
        ad = adapter(a)
        missing = chunk_keys(8, 1)
        for _ in range(2):
            task = ad.submit_lookup_and_lock_task([*keys, *missing], {0: LAYOUT})
            deadline = time.monotonic() + 10
            while (bitmap := ad.query_lookup_and_lock_result(task)) is None:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            assert str(bitmap) == "1110"
            assert ad.query_lookup_and_lock_result(task) is None  # a result is returned once
        assert kv.stats()["pins"] == 3
        ad.submit_unlock(keys)
        time.sleep(0.3)
        assert kv.stats()["pins"] == 3  # one lock each still held
        ad.submit_unlock([*keys, *missing])
        deadline = time.monotonic() + 10
        while kv.stats()["pins"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert kv.stats()["pins"] == 0


def test_bad_adapter_params_are_refused_by_name(node: Any) -> None:
    """LMCache builds the adapter when the server starts: unknown or bad ``adapter_params``
    stop it there with kvstore's message."""
    with pytest.raises(InvalidArgument, match="targt"):
        with server(node.unix, targt="x"):
            pass
    with pytest.raises(InvalidArgument, match="deadline_s"):
        with server(node.unix, deadline_s=-1):
            pass
    assert adapter_config("unix:///x")["type"] == "plugin"


def test_the_node_counts_the_adapters_calls_under_its_agent(node_factory: Any) -> None:
    """The node's metrics name the adapter (agent ``lmcache-l2``): its chunks written, its
    reads' hits, their bytes, apart from plain SDK clients."""
    n = node_factory("--dram", "64MiB", "--nvme", "0", "--metrics-port", "0")
    keys = chunk_keys(9, 4)
    with server(n.unix) as a:
        write(a, keys, seed=9)
        wait_stored(a, len(keys))
    with server(n.unix) as b:
        assert l2_hits(prefetch(b, keys)) == "1111"
    v = agent_metric(n.endpoints["metrics"], "lmcache-l2")
    assert v("kvstore_agent_blocks_total", op="write", result="stored") == len(keys)
    assert v("kvstore_agent_blocks_total", op="read", result="hit") == len(keys)
    assert v("kvstore_agent_bytes_total", direction="read") == len(keys) * CHUNK_BYTES
    assert v("kvstore_agent_bytes_total", direction="write") == len(keys) * CHUNK_BYTES
    assert "sdk" not in v.agents  # type: ignore[attr-defined]


def test_many_cache_salts_do_not_grow_the_adapter_without_bound(node: Any, monkeypatch: Any) -> None:
    """Every user's ``cache_salt`` is a namespace: the adapter remembers a bounded number of
    them (oldest dropped) and still reads a dropped one's chunks (its key is recomputed)."""
    import gpu_agent.lmcache.l2 as l2

    monkeypatch.setattr(l2, "MAX_NAMESPACES", 2)
    users = [chunk_keys(10 + u, 2, cache_salt=f"user-{u}") for u in range(4)]
    with server(node.unix) as a:
        for u, keys in enumerate(users):
            write(a, keys, seed=10 + u)
        wait_stored(a, 2 * len(users))
        ad = adapter(a)
        assert len(ad._namespaces) <= 2 and len(ad._layouts) <= 2
    with server(node.unix) as b:
        assert l2_hits(prefetch(b, users[0])) == "11"

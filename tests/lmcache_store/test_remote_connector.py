"""kvstore as LMCache's remote storage plug-in (in-process mode), driven through LMCache's code.

LMCache builds its storage backends from a configuration file the way a vLLM worker's
``LMCacheConnectorV1`` does (``CreateStorageBackends``): the local CPU backend, and a
``RemoteBackend`` for the ``kvstore`` plug-in, which LMCache dials as ``plugin://kvstore``
through its dynamic connector adapter.  Every call below is the ``RemoteBackend``'s, as
LMCache's cache engine makes them, against a real node.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from conftest import agent_metric
from lmcache_rig import MODEL, connector, engine_backends, engine_chunks, engine_keys

from client import KVClient

pytestmark = pytest.mark.lmcache


def reads(kv: KVClient) -> int:
    c = kv.stats()["counters"]
    return int(c["get_hits_dram"] + c["get_hits_nvme"])


def put(backends: dict[str, Any], keys: list[Any], objs: list[Any]) -> None:
    """LMCache's store path: a batched put task on its event loop; wait until LMCache calls
    back for every key (the put finished, stored or not)."""
    done = threading.Semaphore(0)
    backends["RemoteBackend-kvstore"].batched_submit_put_task(
        keys, objs, on_complete_callback=lambda _k: done.release()
    )
    for _ in keys:
        assert done.acquire(timeout=20), "LMCache's put task never finished"


def test_lmcache_dials_the_plugin_and_a_second_engine_reads_the_same_bytes(node: Any, tmp_path: Any) -> None:
    """LMCache creates ``RemoteBackend-kvstore`` from the documented configuration (the
    ``plugin://kvstore`` URL reaches kvstore's connector, not a silent miss); one engine's
    chunks put through it are found and read by a second engine's backends: the same bytes,
    the node counted the reads, the leading-run contains counts them."""
    keys = engine_keys(1, 4)
    with engine_backends(node.unix, tmp_path) as a:
        assert type(connector(a)).__name__ == "KVStoreRemoteConnector"
        objs = engine_chunks(a, 4, seed=1)
        want = [o.tensor.clone() for o in objs]
        put(a, keys, objs)
        assert connector(a).stats.snapshot()["stored"] == 4
    with KVClient(node.unix) as kv, engine_backends(node.unix, tmp_path) as b:
        rb = backends_remote(b)
        before = reads(kv)
        assert all(rb.contains(k) for k in keys)
        assert rb.batched_contains(keys) == 4
        got = rb.batched_get_blocking(keys)
        assert all(g is not None for g in got)
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g.tensor, w)
            g.ref_count_down()
        assert reads(kv) - before == 4


def backends_remote(backends: dict[str, Any]) -> Any:
    return backends["RemoteBackend-kvstore"]


def test_the_leading_run_ends_at_the_first_missing_chunk(node: Any, tmp_path: Any) -> None:
    keys = engine_keys(2, 5)
    with engine_backends(node.unix, tmp_path) as a:
        objs = engine_chunks(a, 5, seed=2)
        put(a, [keys[i] for i in (0, 1, 3, 4)], [objs[i] for i in (0, 1, 3, 4)])
        rb = backends_remote(a)
        assert rb.batched_contains(keys) == 2
        assert [rb.contains(k) for k in keys] == [True, True, False, True, True]
        got = rb.get_blocking(keys[2])
        assert got is None


def test_a_partial_chunk_comes_back_with_its_tokens(node: Any, tmp_path: Any) -> None:
    """LMCache's last, partial chunk (fewer tokens than a chunk) round-trips: the block's
    length says how many tokens it holds, and the memory object comes back cut to them."""
    keys = engine_keys(3, 1)
    with engine_backends(node.unix, tmp_path) as a:
        (obj,) = engine_chunks(a, 1, seed=3, tokens=5)
        want = obj.tensor.clone()
        put(a, keys, [obj])
    with engine_backends(node.unix, tmp_path) as b:
        got = backends_remote(b).get_blocking(keys[0])
        assert got is not None
        assert got.tensor.shape == want.shape and torch.equal(got.tensor, want)
        got.ref_count_down()


@pytest.mark.parametrize("extra", [3, "chunk"], ids=["no_whole_token", "larger_than_a_chunk"])
def test_a_block_of_the_wrong_size_is_a_miss_alone(node: Any, tmp_path: Any, extra: Any) -> None:
    """A block that is no whole number of tokens, or larger than a chunk, is that chunk's
    miss; the other chunk of the batched read still comes back."""
    keys = engine_keys(4, 2)
    with engine_backends(node.unix, tmp_path) as a:
        c = connector(a)
        put(a, keys[1:], engine_chunks(a, 1, seed=4))
        size = c.single_token_size + 3 if extra == 3 else 2 * c.full_chunk_size_bytes
        with KVClient(node.unix) as kv:
            assert kv.put_many([c.key(keys[0])], [bytes(size)], namespace=c._namespace) == [True]
        got = backends_remote(a).batched_get_blocking(keys)
        assert got[0] is None and got[1] is not None
        got[1].ref_count_down()
        assert c.stats.snapshot()["wrong_size"] == 1


@pytest.mark.parametrize("other", ["model", "dtype", "salt"])
def test_another_model_dtype_or_salt_never_reads_the_chunks(node: Any, tmp_path: Any, other: str) -> None:
    keys = engine_keys(5, 3)
    with engine_backends(node.unix, tmp_path) as a:
        put(a, keys, engine_chunks(a, 3, seed=5))
    model = "other/model" if other == "model" else MODEL
    dtype = torch.bfloat16 if other == "dtype" else torch.float16
    extra = {"salt": "tenant-b"} if other == "salt" else {}
    asked = engine_keys(5, 3, model=model, dtype=dtype)
    with KVClient(node.unix) as kv, engine_backends(node.unix, tmp_path, model=model, dtype=dtype, **extra) as b:
        before = reads(kv)
        rb = backends_remote(b)
        assert rb.batched_contains(asked) == 0
        assert all(g is None for g in rb.batched_get_blocking(asked))
        assert reads(kv) == before


def test_a_node_down_is_a_miss_within_the_deadline(node_factory: Any, tmp_path: Any) -> None:
    n = node_factory("--dram", "64MiB", "--nvme", "0")
    keys = engine_keys(6, 2)
    with engine_backends(n.unix, tmp_path, deadline_s=1.0) as a:
        put(a, keys, engine_chunks(a, 2, seed=6))
        n.kill9()
        rb = backends_remote(a)
        t0 = time.monotonic()
        assert rb.batched_contains(keys) == 0
        assert rb.get_blocking(keys[0]) is None
        put(a, engine_keys(7, 1), engine_chunks(a, 1, seed=7))
        assert time.monotonic() - t0 < 15
        assert connector(a).stats.snapshot()["errors"] >= 3


def test_a_bad_setting_keeps_lmcache_from_creating_the_backend(node: Any, tmp_path: Any, caplog: Any) -> None:
    """A bad setting is no silent miss: LMCache does not create the backend (it would retry a
    failed connector every ten seconds and miss in between), and its log names kvstore's bad
    key."""
    with engine_backends(node.unix, tmp_path, deadline_sec=1) as b:
        assert "RemoteBackend-kvstore" not in b
    assert "deadline_sec" in caplog.text


def test_the_node_counts_the_connectors_calls_under_its_agent(node_factory: Any, tmp_path: Any) -> None:
    n = node_factory("--dram", "64MiB", "--nvme", "0", "--metrics-port", "0")
    keys = engine_keys(8, 3)
    with engine_backends(n.unix, tmp_path) as a:
        objs = engine_chunks(a, 3, seed=8)
        nbytes = sum(len(o.byte_array) for o in objs)
        put(a, keys, objs)
        for g in backends_remote(a).batched_get_blocking(keys):
            g.ref_count_down()
    v = agent_metric(n.endpoints["metrics"], "lmcache-remote")
    assert v("kvstore_agent_blocks_total", op="write", result="stored") == 3
    assert v("kvstore_agent_blocks_total", op="read", result="hit") == 3
    assert v("kvstore_agent_bytes_total", direction="read") == nbytes

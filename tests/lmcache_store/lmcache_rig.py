"""LMCache's own storage objects, built on CPU for the L2 adapter's tests.

Everything here is LMCache's code: its command-line parser (``parse_args``, what
``lmcache server`` parses, here with kvstore's adapter on ``--l2-adapter``), its
``StorageManager`` (the L1 memory manager, the store controller that pushes finished writes to
the L2 adapters, the prefetch controller that looks chunks up in L2, locks, loads and unlocks
them), its ``ObjectKey`` and memory layouts.  A "server" here is one ``StorageManager``: the
state an ``lmcache server`` process keeps; two of them are two servers (or one restarted with
an empty L1).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import time
from collections.abc import Iterator
from typing import Any

import torch
from lmcache.v1.distributed.api import GroupedObjectKeys, MemoryLayoutDesc, ObjectKey, PrefetchTaskSpec
from lmcache.v1.distributed.config import parse_args
from lmcache.v1.distributed.storage_manager import StorageManager

MODEL = "Qwen/Qwen3-0.6B"
SHAPE = torch.Size([2, 2, 16, 64])  # LMCache's KV_2LTD: K/V, layers, tokens, hidden
LAYOUT = MemoryLayoutDesc(shapes=[SHAPE], dtypes=[torch.float16])
CHUNK_BYTES = SHAPE.numel() * 2
_shm = itertools.count()


def adapter_config(target: str, **params: Any) -> dict[str, Any]:
    """The ``--l2-adapter`` JSON an LMCache user writes for kvstore."""
    return {
        "type": "plugin",
        "module_path": "gpu_agent.lmcache",
        "class_name": "KVStoreL2Adapter",
        "adapter_params": {"target": target, "deadline_s": 2.0, **params},
    }


@contextlib.contextmanager
def server(target: str, **params: Any) -> Iterator[StorageManager]:
    """One LMCache server's storage: 50 MB of L1 and kvstore as its L2, configured through
    LMCache's own command-line parser."""
    config = parse_args(
        [
            "--l1-size-gb",
            "0.05",
            "--no-l1-use-lazy",
            "--eviction-policy",
            "LRU",
            "--l2-adapter",
            json.dumps(adapter_config(target, **params)),
        ]
    )
    for l1 in config.l1_manager_configs:  # two servers in one process: each its own shared memory
        l1.memory_config = dataclasses.replace(l1.memory_config, shm_name=f"kvstore_test_{os.getpid()}_{next(_shm)}")
    sm = StorageManager(config)
    try:
        yield sm
    finally:
        sm.close()


def adapter(sm: StorageManager) -> Any:
    """The server's (only) L2 adapter: kvstore's."""
    (entry,) = sm.l2_adapters()
    return entry[1]


def chunk_keys(seed: int, n: int = 6, *, model: str = MODEL, kv_rank: int = 0, cache_salt: str = "") -> list[ObjectKey]:
    """``n`` chunk keys of one request (LMCache's hashes are opaque bytes to the adapter)."""
    g = torch.Generator().manual_seed(seed)
    hashes = [bytes(torch.randint(0, 256, (16,), generator=g, dtype=torch.uint8).tolist()) for _ in range(n)]
    return [ObjectKey(chunk_hash=h, model_name=model, kv_rank=kv_rank, cache_salt=cache_salt) for h in hashes]


def write(
    sm: StorageManager, keys: list[ObjectKey], seed: int, layout: MemoryLayoutDesc = LAYOUT
) -> dict[ObjectKey, torch.Tensor]:
    """Write chunks into the server's L1 as the engine's store does (reserve, fill, finish);
    the store controller then pushes them to L2.  Returns each chunk's bytes."""
    objs = sm.reserve_write(keys, layout)
    assert set(objs) == set(keys), "L1 refused a reservation"
    g = torch.Generator().manual_seed(seed)
    want = {}
    for k in keys:
        t = objs[k].tensor
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
        want[k] = t.clone()
    sm.finish_write(keys)
    return want


def wait_stored(sm: StorageManager, n: int, timeout: float = 20.0) -> None:
    """Until the server's store controller has had ``n`` chunks written to kvstore."""
    deadline = time.monotonic() + timeout
    while adapter(sm).stats.snapshot()["stored"] < n:
        assert time.monotonic() < deadline, f"kvstore stored {adapter(sm).stats.snapshot()} of {n} chunks"
        time.sleep(0.05)


def prefetch(
    sm: StorageManager, keys: list[ObjectKey], layout: MemoryLayoutDesc = LAYOUT, timeout: float = 20.0
) -> Any:
    """Prefetch ``keys`` as the server does for a lookup: L1, then L2 (lookup and lock, load,
    unlock).  Returns LMCache's ``PrefetchResult``."""
    spec = PrefetchTaskSpec(key_groups=[GroupedObjectKeys(keys=keys, object_group_id=0, layout_desc=layout)])
    handle = sm.submit_prefetch_task(spec)
    deadline = time.monotonic() + timeout
    while (result := sm.query_prefetch_status(handle)) is None:
        assert time.monotonic() < deadline, "the prefetch did not finish"
        time.sleep(0.02)
    return result


def l2_hits(result: Any) -> str:
    """The prefetch's L2 hits as LMCache prints its bitmap: ``1`` a chunk loaded from L2."""
    (row,) = result.l2_hit_cells
    return str(row)


def hits(result: Any) -> str:
    (row,) = result.hit_cells
    return str(row)


def read(sm: StorageManager, keys: list[ObjectKey]) -> list[torch.Tensor]:
    """The prefetched chunks' bytes, read from L1 as the engine's retrieve does."""
    with sm.read_prefetched_results(keys) as objs:
        assert objs is not None, "a prefetched chunk is not in L1"
        out = [o.tensor.clone() for o in objs]
    sm.finish_read_prefetched(keys)
    return out


# -- in-process mode: LMCache's storage backends (what LMCacheConnectorV1 builds in a worker) ---

ENGINE_CHUNK = 16  # tokens per LMCache chunk in these tests
ENGINE_KV_SHAPE = (2, 2, ENGINE_CHUNK, 2, 64)  # LMCache's (layers, K/V, chunk, kv heads, head size)


def engine_yaml(target: str, **extra: Any) -> str:
    """An LMCache configuration file with kvstore as its remote storage plug-in, as LMCache's
    documentation has users write one."""
    lines = [
        f"chunk_size: {ENGINE_CHUNK}",
        "local_cpu: true",
        "max_local_cpu_size: 0.05",
        'remote_storage_plugins: ["kvstore"]',
        "extra_config:",
        "  remote_storage_plugin.kvstore.module_path: gpu_agent.lmcache",
        "  remote_storage_plugin.kvstore.class_name: KVStoreRemoteConnector",
        f"  remote_storage_plugin.kvstore.target: {target}",
        "  remote_storage_plugin.kvstore.deadline_s: 2.0",
        *(f"  remote_storage_plugin.kvstore.{k}: {json.dumps(v)}" for k, v in extra.items()),
    ]
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def engine_backends(
    target: str, tmp: Any, *, model: str = MODEL, dtype: torch.dtype = torch.float16, **extra: Any
) -> Iterator[dict[str, Any]]:
    """LMCache's storage backends for one vLLM worker (world 1), built by LMCache's own
    ``CreateStorageBackends`` from a configuration file: its local CPU backend and, where
    LMCache could create it, ``RemoteBackend-kvstore``."""
    import asyncio
    import threading

    from lmcache.v1.config import load_engine_config_with_overrides
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend import CreateStorageBackends

    path = tmp / f"lmcache-{next(_shm)}.yaml"
    path.write_text(engine_yaml(target, **extra))
    config = load_engine_config_with_overrides(config_file_path=str(path))
    metadata = LMCacheMetadata(
        model_name=model,
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=dtype,
        kv_shape=ENGINE_KV_SHAPE,
        chunk_size=ENGINE_CHUNK,
    )
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    backends = CreateStorageBackends(config, metadata, loop)
    try:
        yield dict(backends)
    finally:
        for b in reversed(list(backends.values())):
            with contextlib.suppress(Exception):
                b.close()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)


def connector(backends: dict[str, Any]) -> Any:
    """kvstore's connector inside LMCache's ``RemoteBackend`` (LMCache wraps it to count calls)."""
    conn = backends["RemoteBackend-kvstore"].connection
    return getattr(conn, "_connector", conn)


def engine_keys(seed: int, n: int, *, model: str = MODEL, dtype: torch.dtype = torch.float16) -> list[Any]:
    from lmcache.utils import CacheEngineKey

    g = torch.Generator().manual_seed(seed)
    hashes = torch.randint(-(2**62), 2**62, (n,), generator=g).tolist()
    return [CacheEngineKey(model, 1, 0, int(h), dtype) for h in hashes]


def engine_chunks(backends: dict[str, Any], n: int, seed: int, tokens: int = ENGINE_CHUNK) -> list[Any]:
    """``n`` chunks of ``tokens`` tokens in LMCache's local CPU memory, as its store path
    makes them (the engine's KV copied into memory objects of its allocator)."""
    cpu, c = backends["LocalCPUBackend"], connector(backends)
    shapes = [torch.Size([*s[:2], tokens, *s[3:]]) for s in c.meta_shapes]
    g = torch.Generator().manual_seed(seed)
    objs = []
    for _ in range(n):
        o = cpu.allocate(shapes, c.meta_dtypes, c.meta_fmt)
        assert o is not None, "LMCache's CPU allocator is full"
        o.tensor.copy_(torch.randn(o.tensor.shape, generator=g).to(o.tensor.dtype))
        objs.append(o)
    return objs

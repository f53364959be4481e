"""SGLang's own HiCache objects, built on CPU for the backend's tests.

Everything here is SGLang's code: its device KV pool (``MHATokenToKVPool`` on ``cpu``), its
host pool (``MHATokenToKVPoolHost``, the pages the backend reads into and writes from), its
page allocator, its ``HiCacheController`` (the backup, prefetch and I/O threads that call a
storage backend in a serving engine), its dynamic loader (``StorageBackendFactory``) and its
page hash chain (``get_hash_str``).  SGLang cannot serve a model on these CPUs (its kernels
are CUDA builds), so the tests drive the controller as its scheduler does: backups through
``write_storage``, prefetches through ``prefetch`` and the host buffers it then allocates.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_hash_str
from sglang.srt.runtime_context import get_parallel

PAGE, HEADS, HEAD_DIM, LAYERS = 4, 2, 16, 3
MODEL = "Qwen/Qwen3-0.6B"
LAYOUTS = ("layer_first", "page_first", "page_first_direct")


def extra_config(target: str, **more: Any) -> dict[str, Any]:
    """The ``--hicache-storage-backend-extra-config`` a user writes for kvstore."""
    return {
        "backend_name": "kvstore",
        "module_path": "gpu_agent.sglang",
        "class_name": "KVStoreHiCacheStorage",
        "interface_v1": 1,
        "kvstore_target": target,
        "kvstore_deadline_s": 2.0,
        **more,
    }


def pools(layout: str = "page_first", *, dtype: torch.dtype = torch.bfloat16, heads: int = HEADS) -> tuple[Any, Any]:
    """SGLang's device pool (on CPU) and the host pool mirroring it."""
    device = MHATokenToKVPool(
        256, PAGE, dtype, heads, HEAD_DIM, LAYERS, "cpu", False, start_layer=0, end_layer=LAYERS - 1
    )
    host = MHATokenToKVPoolHost(
        device.get_device_pool_infos()[0].buffer_info,
        2,
        0,
        PAGE,
        layout,
        pin_memory=False,
        device_capacity_tokens=device.size,
        start_layer=device.start_layer,
        end_layer=device.end_layer,
        write_back_staging=device.hicache_write_back_staging,
    )
    return device, host


def mla_pools(layout: str = "page_first") -> tuple[Any, Any]:
    """An MLA model's device pool (on CPU: a 32-wide latent and a 16-wide rope part) and host pool."""
    device = MLATokenToKVPool(
        256, PAGE, torch.bfloat16, 32, 16, LAYERS, "cpu", False, start_layer=0, end_layer=LAYERS - 1
    )
    host = MLATokenToKVPoolHost(
        device.get_device_pool_infos()[0].buffer_info,
        2,
        0,
        PAGE,
        layout,
        pin_memory=False,
        device_capacity_tokens=device.size,
        start_layer=0,
        end_layer=LAYERS - 1,
        target_layer_num=LAYERS,
    )
    return device, host


def storage_config(
    extra: dict[str, Any], *, model: str = MODEL, tp_rank: int = 0, tp_size: int = 1, mla: bool = False
) -> Any:
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=True,
        is_page_first_layout=True,
        model_name=model,
        extra_config=extra,
    )


def backend(host: Any, extra: dict[str, Any], **config: Any) -> Any:
    """The backend as SGLang makes it: its factory's ``dynamic`` path, then the host pool
    registered, as ``HiCacheController.attach_storage_backend`` does."""
    b = StorageBackendFactory.create_backend("dynamic", storage_config(extra, **config), host)
    b.register_mem_pool_host(host)
    return b


def page_keys(tokens: list[int]) -> list[str]:
    """SGLang's page keys for ``tokens`` (its SHA-256 chain, one per full page)."""
    keys: list[str] = []
    prev = None
    for i in range(0, len(tokens) - len(tokens) % PAGE, PAGE):
        prev = get_hash_str(tokens[i : i + PAGE], prev)
        keys.append(prev)
    return keys


def fill(host: Any, seed: int) -> None:
    """Random KV in every host page (distinct per seed)."""
    g = torch.Generator().manual_seed(seed)
    host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape, generator=g).to(host.dtype))


def pages(host: Any, indices: torch.Tensor, n: int) -> list[torch.Tensor]:
    """Copies of the ``n`` pages at ``indices`` (flat, as SGLang's storage sees them)."""
    return [host.get_data_page(int(indices[i * PAGE]), flat=True).clone() for i in range(n)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def one_rank() -> Iterator[None]:
    """This process as SGLang's only rank: a gloo group of one, and the parallel widths the
    controller reads (a scheduler publishes them when it builds its groups)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    with get_parallel().override(
        tp_rank=0,
        tp_size=1,
        attn_tp_rank=0,
        attn_tp_size=1,
        attn_dp_rank=0,
        attn_cp_rank=0,
        attn_cp_size=1,
        attn_dcp_rank=0,
        attn_dcp_size=1,
        pp_rank=0,
        pp_size=1,
    ):
        yield


def controller(device: Any, host: Any, extra: dict[str, Any]) -> Any:
    """SGLang's HiCache controller with the backend attached (its threads running)."""
    allocator = PagedTokenToKVPoolAllocator(device.size, PAGE, device.dtype, "cpu", device, False)
    return HiCacheController(
        allocator,
        host,
        PAGE,
        dist.group.WORLD,
        threading.Event(),
        io_backend="direct",
        storage_backend="dynamic",
        model_name=MODEL,
        storage_backend_extra_config=extra,
        enable_storage_metrics=True,
    )

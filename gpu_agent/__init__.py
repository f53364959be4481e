"""The GPU agent: the inference worker's side of kvstore (architecture §7).

The only product package that imports ``torch.cuda`` (its benchmark, ``kvstore bench gpu``,
times CUDA copies of its own).  Importing ``gpu_agent`` itself imports
nothing heavy (the node and the ``kvstore`` CLI must run without torch); the names
below load on first use.

    from client import KVClient
    from gpu_agent import GPUAgent, KVCacheLayout

    layout = KVCacheLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16", page_size=16)
    ns = layout.namespace("llama-3-8b", chunk_tokens=256)
    agent = GPUAgent(KVClient("unix:///run/kvstore/kvstore.sock"), layout, ns)
    cached = agent.lookup(tokens)                          # tokens cached, any tier
    agent.prefetch(tokens)                                 # from the waiting queue
    h = agent.load(tokens, kv_buffers, block_ids)          # per layer: h.wait_layer(i)
    agent.save(tokens, kv_buffers, block_ids)              # asynchronous offload

Modules: ``layout`` (engine layout, paged adapter), ``prefetch`` (pure prefetch and
eviction planning), ``pool`` (HBM block pool), ``copy_engine`` (streams, events,
pinned arena), ``agent`` (the wiring).  The demos (``kvstore demo pd``, its Hugging Face
glue) live in :mod:`kvstore.demo`, the benchmark (``kvstore bench gpu``) in :mod:`kvstore.bench.gpu`.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "GPUAgent": "gpu_agent.agent",
    "AgentConfig": "gpu_agent.agent",
    "LoadHandle": "gpu_agent.agent",
    "SaveHandle": "gpu_agent.agent",
    "SaveResult": "gpu_agent.agent",
    "PrefetchResult": "gpu_agent.agent",
    "KVCacheLayout": "gpu_agent.layout",
    "PagedAdapter": "gpu_agent.layout",
    "Bandwidths": "gpu_agent.prefetch",
    "plan_prefetch": "gpu_agent.prefetch",
    "plan_evictions": "gpu_agent.prefetch",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'gpu_agent' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(mod), name)

"""kvstore for LMCache: an L2 store of LMCache's multi-process server (:mod:`gpu_agent.lmcache.l2`).

LMCache loads it through its ``plugin`` L2 adapter type, with no patch::

    lmcache server ... --l2-adapter '{"type": "plugin", "module_path": "gpu_agent.lmcache",
        "class_name": "KVStoreL2Adapter",
        "adapter_params": {"target": "unix:///run/kvstore/kvstore.sock"}}'

The adapter imports LMCache (``pip install 'kvstore[lmcache]'``) and loads on first use; the
settings and key rules (:mod:`gpu_agent.lmcache.settings`) need no LMCache.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "AdapterStats": "gpu_agent.lmcache.l2",
    "KVStoreL2Adapter": "gpu_agent.lmcache.l2",
    "KVStoreRemoteConnector": "gpu_agent.lmcache.remote",
    "RemoteStats": "gpu_agent.lmcache.remote",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'gpu_agent.lmcache' has no attribute {name!r}")
    return getattr(importlib.import_module(mod), name)

"""kvstore for SGLang: HiCache's L3 storage backend (:mod:`gpu_agent.sglang.hicache`).

SGLang loads it by name, with no patch::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
      '{"backend_name": "kvstore", "module_path": "gpu_agent.sglang",
        "class_name": "KVStoreHiCacheStorage", "interface_v1": 1,
        "kvstore_target": "unix:///run/kvstore/kvstore.sock"}'

The backend's classes import SGLang (``pip install 'kvstore[sglang]'``) and load on first
use; the settings and key rules (:mod:`gpu_agent.sglang.settings`) need no SGLang.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {"BackendStats": "gpu_agent.sglang.hicache", "KVStoreHiCacheStorage": "gpu_agent.sglang.hicache"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'gpu_agent.sglang' has no attribute {name!r}")
    return getattr(importlib.import_module(mod), name)

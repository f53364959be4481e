"""kvstore as a vLLM KV connector (``kv_connector_module_path="gpu_agent.vllm"``).

``KVStoreConnector`` (``gpu_agent.vllm.connector``) imports vLLM; ``settings`` (what
``kv_connector_extra_config`` holds, the namespaces) does not.  ``kvstore demo vllm``
and the engine process the demos and tests drive live in :mod:`kvstore.demo`
(``kvstore.demo.vllm``, ``kvstore.demo.engine``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVStoreConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVStoreConnector":
        from gpu_agent.vllm.connector import KVStoreConnector

        return KVStoreConnector
    raise AttributeError(f"module 'gpu_agent.vllm' has no attribute {name!r}")

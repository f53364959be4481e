"""A vLLM KV connector that does nothing: the serving benchmark's ``null-connector`` reference.

vLLM runs another path when any KV connector is configured: the scheduler asks it about
every waiting request and builds its metadata every step, the model runner binds that
metadata and calls its hooks around every forward and in every attention layer, and some
of vLLM's defaults change with it (its hybrid KV-cache manager is off, for one).  This
connector answers "nothing to load, nothing to save" to every call at once and holds no
state, so a fleet running it against one running ``baseline`` measures what vLLM's own
connector path costs, and ``pool`` against it what kvstore's connector costs on top.

Loaded by vLLM from ``kv_connector_module_path`` (``kvstore.bench.serving.null_connector``),
in vLLM's processes only: it imports vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


class NullConnector(KVConnectorBase_V1):
    """Every hook of vLLM's v1 connector API, each doing nothing (no state, no threads)."""

    # worker side
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    # scheduler side
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return KVConnectorMetadata()

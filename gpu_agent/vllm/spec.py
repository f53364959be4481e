"""What two vLLM engines must share to share KV: the engine's spec, each request's namespace.

The scheduler and every worker derive the same :class:`EngineSpec`
from the same config; a worker's spec differs only in its own tensor/pipeline rank, so
each rank keys its own shard (:func:`rank_namespace`).  Everything that changes what the
KV bytes mean is in the namespace fingerprint: the model and revision, the page layout,
vLLM's ``cache_dtype`` (fp8 KV is stored as ``uint8`` tensors: the tensor dtype alone does
not say which format), the connector's key scheme (:data:`KEY_SCHEME`), the rank, and per
request the LoRA adapter and the ``cache_salt``.  Requests whose KV depends on inputs the
token ids do not show (multimodal features, prompt embeddings) are never keyed
(:func:`unkeyable`): they are neither loaded nor saved.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from gpu_agent.layout import KVCacheLayout
from gpu_agent.vllm.settings import ConnectorSettings
from kvstore.block import DTYPES
from kvstore.errors import Incompatible
from kvstore.keys import ChunkKey, Namespace, chunk_keys, tail_key

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

KEY_SCHEME = "kvstore-vllm/2"
"""The connector's key scheme, folded into every namespace.  Version 2: connectors before it
loaded the wrong token range after a partial prefix-cache hit and saved rank 0's shard for
every tensor-parallel rank, so nothing they stored may ever be served."""


@dataclasses.dataclass(frozen=True, slots=True)
class EngineSpec:
    """What the engine's config says about its KV (identical in the scheduler and the workers)."""

    model_id: str
    revision: str
    kv_dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    page_layout: str
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    def __post_init__(self) -> None:
        if self.kv_dtype not in DTYPES:
            raise Incompatible(
                f"vLLM's KV cache dtype {self.kv_dtype!r} (cache_dtype / dtype) cannot be described by a kvstore "
                f"namespace; supported: {sorted(DTYPES)}"
            )
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) <= 0:
                raise Incompatible(f"vLLM's KV cache spec has {name}={getattr(self, name)}")

    def layout(self) -> KVCacheLayout:
        return KVCacheLayout(
            self.num_layers, self.num_kv_heads, self.head_dim, self.kv_dtype, self.block_size, self.page_layout
        )

    def namespace(self, chunk_tokens: int, *, lora: str = "", cache_salt: str = "", salt: str = "") -> Namespace:
        """The namespace of one request: the engine's, plus its LoRA adapter and cache salt."""
        tenant_salt = salt if not cache_salt else f"{salt}|cache_salt={cache_salt}"
        return self.layout().namespace(
            self.model_id,
            chunk_tokens=chunk_tokens,
            model_revision=self.revision,
            lora_id=lora,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            pp_rank=self.pp_rank,
            pp_size=self.pp_size,
            tenant_salt=tenant_salt,
        )


def engine_spec(
    vllm_config: VllmConfig,
    kv_cache_config: KVCacheConfig | None,
    *,
    tp_rank: int = 0,
    pp_rank: int = 0,
    model_id: str = "",
) -> EngineSpec:
    """The KV facts both halves key by; an engine kvstore cannot serve fails here, naming the setting."""
    if kv_cache_config is None:
        raise Incompatible("KVStoreConnector needs vLLM's kv_cache_config (vLLM >= 0.32)")
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise Incompatible(
            f"the model has {len(groups)} KV cache groups (hybrid attention); KVStoreConnector serves one full-attention group"
        )
    spec = groups[0].kv_cache_spec
    heads, head = getattr(spec, "num_kv_heads", None), getattr(spec, "head_size", None)
    if (
        heads is None
        or head is None
        or getattr(spec, "sliding_window", None)
        or getattr(spec, "head_size_v", head) != head
    ):
        raise Incompatible(
            f"KV cache spec {type(spec).__name__} (MLA, sliding window or unequal K/V heads) is not one kvstore can describe"
        )
    from vllm.platforms import current_platform

    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    layout = kv_cache_config.kv_cache_layout or cc.kv_cache_layout or "default"
    return EngineSpec(
        model_id=model_id or str(mc.model),
        revision=str(mc.revision or "main"),
        kv_dtype=str(spec.dtype).removeprefix("torch."),
        num_layers=len(groups[0].layer_names),
        num_kv_heads=int(heads),
        head_dim=int(head),
        block_size=int(spec.block_size),
        page_layout=f"{KEY_SCHEME}:{current_platform.device_type}:{layout}:{cache_format(vllm_config)}",
        tp_rank=tp_rank,
        tp_size=int(pc.tensor_parallel_size),
        pp_rank=pp_rank,
        pp_size=int(pc.pipeline_parallel_size),
    )


def cache_format(vllm_config: VllmConfig) -> str:
    """vLLM's KV-cache format beyond the tensor dtype: ``cache_dtype`` and how its scales are set."""
    cc = vllm_config.cache_config
    fmt = f"cache_dtype={cc.cache_dtype}"
    if str(cc.cache_dtype) != "auto":
        fmt += f",scales={'dynamic' if getattr(cc, 'calculate_kv_scales', False) else 'static'}"
    return fmt


def worker_ranks() -> tuple[int, int]:
    """This worker's tensor- and pipeline-parallel rank (inside a vLLM worker only)."""
    from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank()), int(get_pp_group().rank_in_group)


def all_ranks(spec: EngineSpec) -> list[tuple[int, int]]:
    """Every (tp_rank, pp_rank) whose shard a chunk needs before it counts as stored."""
    return [(t, p) for p in range(spec.pp_size) for t in range(spec.tp_size)]


def rank_namespace(ns: Namespace, tp_rank: int, pp_rank: int) -> Namespace:
    """``ns`` for another rank's shard (the rank is in the fingerprint: shards never share keys)."""
    if (ns.tp_rank, ns.pp_rank) == (tp_rank, pp_rank):
        return ns
    return dataclasses.replace(ns, tp_rank=tp_rank, pp_rank=pp_rank)


def rank_lookup_keys(tokens: list[int], ns: Namespace, tp_rank: int, pp_rank: int, first: int) -> list[ChunkKey]:
    """The keys a lookup asks for one rank's shard: ``tokens``' chunk keys from chunk
    ``first`` on, then the trailing partial chunk's key (if the prompt ends inside one)."""
    rns = rank_namespace(ns, tp_rank, pp_rank)
    chain = chunk_keys(tokens, rns)
    keys = chain[first:]
    tail = tail_key(tokens, rns, chain)
    if tail is not None:
        keys.append(tail)
    return keys


def request_namespace(spec: EngineSpec, settings: ConnectorSettings, chunk: int, request: Any) -> Namespace:
    """The namespace of one request on ``spec``'s rank: the engine's plus its LoRA adapter and cache salt."""
    lora = getattr(request, "lora_request", None)
    return spec.namespace(
        chunk,
        lora=lora.lora_name if lora is not None else "",
        cache_salt=getattr(request, "cache_salt", None) or "",
        salt=settings.salt,
    )


def request_session(request: Any) -> str | None:
    """The session a request belongs to (``kv_transfer_params["session_id"]``), for the
    store's eviction hints: blocks only closed sessions used go first."""
    params = getattr(request, "kv_transfer_params", None) or {}
    sid = params.get("session_id") if isinstance(params, dict) else None
    return sid if isinstance(sid, str) and sid else None


def unkeyable(request: Any) -> str | None:
    """Why a request's KV cannot be keyed by its token ids (None: it can).  Multimodal
    inputs sit behind placeholder tokens that are the same for every image, and prompt
    embeddings replace the tokens altogether: such requests are neither loaded nor saved."""
    if getattr(request, "mm_features", None):
        return "multimodal inputs"
    if getattr(request, "prompt_embeds", None) is not None:
        return "prompt embeddings"
    return None

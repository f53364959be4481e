"""Hugging Face ``transformers`` glue for ``kvstore demo pd`` (:mod:`kvstore.demo.pd`, whose
workers, :mod:`kvstore.demo._worker`, load it): a small random Llama and a paged "engine"
around it.

The model is a ``LlamaForCausalLM`` built from a small :class:`ModelSpec` with a fixed
seed (no weights are downloaded), in float32 on the CPU (or a CUDA device), so two
processes that build it get bit-identical weights.  The "engine" is the minimum a
paged inference engine does: a preallocated KV buffer per layer in the agent's layout
(``[2, pages, 16, kv_heads, head_dim]``), a block table, and conversion between those
pages and the ``DynamicCache`` the model computes with.

Needs ``transformers>=5`` (the ``demo`` extra).
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from collections.abc import Callable
from typing import Any

import torch

from gpu_agent.layout import KVCacheLayout


@dataclasses.dataclass(frozen=True, slots=True)
class ModelSpec:
    """A small Llama-architecture model (random weights from ``seed``)."""

    hidden_size: int = 256
    intermediate_size: int = 512
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    vocab_size: int = 1000
    max_positions: int = 8192
    seed: int = 0
    initializer_range: float = 0.1  # larger than HF's 0.02 so greedy output is not one repeated token

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def layout(self, page_size: int = 16) -> KVCacheLayout:
        return KVCacheLayout(self.num_layers, self.num_kv_heads, self.head_dim, "float32", page_size)


def build_model(spec: ModelSpec, device: str | torch.device = "cpu") -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        vocab_size=spec.vocab_size,
        max_position_embeddings=spec.max_positions,
        initializer_range=spec.initializer_range,
    )
    torch.manual_seed(spec.seed)
    # transformers' own annotations of .to (a decorated method) read as a call without self
    return LlamaForCausalLM(cfg).to(device=device, dtype=torch.float32).eval()  # type: ignore[call-arg]


def new_cache() -> Any:
    from transformers import DynamicCache

    return DynamicCache()


def _cache_kwarg(model: Any) -> str:
    # transformers 5.x renamed ``past_key_values`` to ``cache`` (the old name still works, with a warning)
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@torch.no_grad()
def forward(model: Any, input_ids: list[int], cache: Any) -> torch.Tensor:
    """Run ``input_ids`` through the model on top of ``cache`` (updated in place); last logits."""
    device = next(model.parameters()).device
    x = torch.tensor([input_ids], dtype=torch.long, device=device)
    out = model(input_ids=x, use_cache=True, **{_cache_kwarg(model): cache})
    return out.logits[0, -1]


@torch.no_grad()
def greedy(
    model: Any, cache: Any, input_ids: list[int], new_tokens: int, on_first: Callable[[], None] | None = None
) -> list[int]:
    """Feed ``input_ids`` (the uncached rest of the prompt) then generate ``new_tokens`` greedily."""
    out: list[int] = []
    logits = forward(model, input_ids, cache)
    for i in range(new_tokens):
        tok = int(logits.argmax().item())
        out.append(tok)
        if i == 0 and on_first is not None:
            on_first()
        if i + 1 < new_tokens:
            logits = forward(model, [tok], cache)
    return out


class PagedEngine:
    """A fixed pool of KV pages per layer in the agent's layout, and a trivial block table."""

    def __init__(self, layout: KVCacheLayout, max_tokens: int, device: str | torch.device = "cpu") -> None:
        self.layout = layout
        self.num_pages = -(-max_tokens // layout.page_size)
        dtype = getattr(torch, layout.dtype)
        self.kv = [
            torch.zeros(layout.buffer_shape(self.num_pages), dtype=dtype, device=device)
            for _ in range(layout.num_layers)
        ]

    def block_ids(self, num_tokens: int) -> list[int]:
        """The pages of a request of ``num_tokens`` (reversed, so the paged adapter's
        per-page mapping is exercised rather than one contiguous run)."""
        n = -(-num_tokens // self.layout.page_size)
        return list(range(self.num_pages - 1, self.num_pages - 1 - n, -1))

    def write_cache(self, cache: Any, block_ids: list[int], num_tokens: int) -> None:
        """Scatter a ``DynamicCache``'s first ``num_tokens`` tokens into the pages ``block_ids``."""
        lay = self.layout
        full = num_tokens // lay.page_size
        ids = torch.tensor(block_ids[:full], device=self.kv[0].device)
        for i, layer in enumerate(cache.layers):
            for kv, t in ((0, layer.keys), (1, layer.values)):
                # [1, H, S, D] -> [S, H, D] -> [pages, page_size, H, D]
                tokens = (
                    t[0, :, : full * lay.page_size]
                    .transpose(0, 1)
                    .reshape(full, lay.page_size, lay.num_kv_heads, lay.head_dim)
                )
                self.kv[i][kv].index_copy_(0, ids, tokens)

    def read_cache(self, block_ids: list[int], num_tokens: int, wait_layer: Callable[[int], None] | None = None) -> Any:
        """A ``DynamicCache`` of the first ``num_tokens`` tokens in pages ``block_ids``; with
        ``wait_layer``, each layer is converted as soon as its load is done."""
        lay = self.layout
        pages = -(-num_tokens // lay.page_size)
        ids = torch.tensor(block_ids[:pages], device=self.kv[0].device)
        cache = new_cache()
        for i in range(lay.num_layers):
            if wait_layer is not None:
                wait_layer(i)
            kv = self.kv[i].index_select(1, ids)  # [2, pages, P, H, D]
            kv = kv.reshape(2, pages * lay.page_size, lay.num_kv_heads, lay.head_dim)[:, :num_tokens]
            k, v = (kv[j].transpose(0, 1).unsqueeze(0).contiguous() for j in (0, 1))  # [1, H, S, D]
            cache.update(k, v, i)
        return cache


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    r = fn()
    return r, time.perf_counter() - t0

"""The engine's KV-cache layout and the paged adapter (engine pages ↔ store chunks).

Pure: no torch, no I/O.  The agent turns the byte ranges computed here into copies.

**Engine side.**  One tensor per layer, shaped ``[2, num_pages, page_size, kv_heads,
head_dim]`` (K at index 0, V at 1; vLLM's flash-attention layout), contiguous.  A
request's KV lives in the pages named by its block table (``block_ids``): tokens
``[j * page_size, (j + 1) * page_size)`` of the request sit in page ``block_ids[j]``.

**Store side.**  One block per chunk of ``chunk_tokens`` tokens, all layers, K and V::

    payload = [layer][K/V][token][kv_head][head_dim]      (shape (L, 2, C, H, D))

so one layer's K and V are one contiguous byte range of the block (layer-wise loads
copy ``layer_range(i)``), and a page's tokens are contiguous within K and within V:
a run of consecutive engine pages maps to one contiguous range on both sides, which
is what :func:`chunk_copies` coalesces.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from kvstore.block import DTYPES
from kvstore.errors import Incompatible, InvalidArgument
from kvstore.keys import KVLayout, Namespace


@dataclasses.dataclass(frozen=True, slots=True)
class KVCacheLayout:
    """What the engine's KV cache looks like: layers, KV heads, head dim, dtype, page size."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float16"  # a kvstore.block.DTYPES name, e.g. "bfloat16", "float32"
    page_size: int = 16  # tokens per engine page (vLLM's block_size)

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size"):
            if getattr(self, name) <= 0:
                raise InvalidArgument(f"KVCacheLayout.{name} must be positive, got {getattr(self, name)}")
        if self.dtype not in DTYPES:
            raise InvalidArgument(f"KVCacheLayout.dtype {self.dtype!r} is not one of {sorted(DTYPES)}")

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][1]

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's K (or V) in one layer."""
        return self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def page_bytes(self) -> int:
        """Bytes of one page's K (or V) in one layer."""
        return self.page_size * self.token_bytes

    def kv_layout(self) -> KVLayout:
        return KVLayout(num_layers=self.num_layers, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, kv_split=True)

    def namespace(self, model_id: str, *, chunk_tokens: int = 256, **fields: object) -> Namespace:
        """A namespace matching this layout (other fields: model revision, LoRA, ranks, salt)."""
        ns = Namespace(model_id, kv_dtype=self.dtype, layout=self.kv_layout(), chunk_tokens=chunk_tokens, **fields)  # type: ignore[arg-type]
        self.check_namespace(ns)
        return ns

    def check_namespace(self, ns: Namespace) -> None:
        """Raise :class:`Incompatible` unless ``ns`` describes KV of this layout."""
        if ns.layout != self.kv_layout() or ns.kv_dtype != self.dtype:
            raise Incompatible(
                f"namespace {ns.model_id!r} has layout {ns.layout} / {ns.kv_dtype}; the engine's cache is "
                f"{self.kv_layout()} / {self.dtype} (build the namespace with KVCacheLayout.namespace())"
            )
        if ns.chunk_tokens % self.page_size:
            raise Incompatible(
                f"chunk_tokens={ns.chunk_tokens} is not a multiple of the engine's page_size={self.page_size}; "
                "set the namespace's chunk_tokens to a multiple of the page size"
            )

    # -- store blocks ----------------------------------------------------------------
    def block_shape(self, chunk_tokens: int) -> tuple[int, ...]:
        return (self.num_layers, 2, chunk_tokens, self.num_kv_heads, self.head_dim)

    def layer_bytes(self, chunk_tokens: int) -> int:
        """Bytes of one layer (K and V) of one block: the unit of a layer-wise load."""
        return 2 * chunk_tokens * self.token_bytes

    def block_bytes(self, chunk_tokens: int) -> int:
        return self.num_layers * self.layer_bytes(chunk_tokens)

    def layer_range(self, layer: int, chunk_tokens: int) -> tuple[int, int]:
        """(offset, length) of ``layer``'s K and V in a block's payload."""
        n = self.layer_bytes(chunk_tokens)
        return layer * n, n

    # -- engine buffers --------------------------------------------------------------
    def buffer_shape(self, num_pages: int) -> tuple[int, ...]:
        """Shape of one layer's engine buffer."""
        return (2, num_pages, self.page_size, self.num_kv_heads, self.head_dim)


@dataclasses.dataclass(frozen=True, slots=True)
class ByteCopy:
    """One contiguous copy between a block's payload and one layer's engine buffer (bytes)."""

    block_offset: int
    buffer_offset: int
    nbytes: int


@dataclasses.dataclass(frozen=True, slots=True)
class PageRun:
    """Consecutive engine pages ``[page, page + num_pages)`` holding chunk tokens from ``chunk_token`` on."""

    chunk_token: int
    page: int
    num_pages: int


def page_runs(page_ids: Sequence[int], page_size: int) -> list[PageRun]:
    """Coalesce one chunk's page ids (in token order) into runs of consecutive pages."""
    runs: list[PageRun] = []
    for j, p in enumerate(page_ids):
        if runs and runs[-1].page + runs[-1].num_pages == p:
            last = runs[-1]
            runs[-1] = PageRun(last.chunk_token, last.page, last.num_pages + 1)
        else:
            runs.append(PageRun(j * page_size, int(p), 1))
    return runs


class PagedAdapter:
    """Maps a request's engine pages (``block_ids``) onto the store's chunks.

    Pure arithmetic over one :class:`KVCacheLayout` and one ``chunk_tokens``; the copy
    lists it returns are the same for every layer (offsets are per layer), so the
    agent computes them once per chunk and replays them layer by layer.
    """

    def __init__(self, layout: KVCacheLayout, chunk_tokens: int) -> None:
        if chunk_tokens <= 0 or chunk_tokens % layout.page_size:
            raise Incompatible(f"chunk_tokens={chunk_tokens} must be a positive multiple of page_size={layout.page_size}")
        self.layout = layout
        self.chunk_tokens = chunk_tokens
        self.pages_per_chunk = chunk_tokens // layout.page_size

    def full_chunks(self, num_tokens: int) -> int:
        return num_tokens // self.chunk_tokens

    def chunk_pages(self, block_ids: Sequence[int], chunk: int) -> list[int]:
        """The engine pages of chunk ``chunk`` (raises if the block table is too short)."""
        lo, hi = chunk * self.pages_per_chunk, (chunk + 1) * self.pages_per_chunk
        if len(block_ids) < hi:
            raise InvalidArgument(
                f"block_ids has {len(block_ids)} pages; chunk {chunk} needs pages [{lo}, {hi}) "
                f"({self.chunk_tokens} tokens per chunk, {self.layout.page_size} per page)"
            )
        return [int(b) for b in block_ids[lo:hi]]

    def chunk_copies(self, page_ids: Sequence[int], num_buffer_pages: int) -> list[ByteCopy]:
        """Copies moving one chunk between a block's layer range and a layer buffer of
        ``num_buffer_pages`` pages.  Block offsets are relative to the layer's range."""
        lay = self.layout
        if len(page_ids) != self.pages_per_chunk:
            raise InvalidArgument(f"a chunk spans {self.pages_per_chunk} pages, got {len(page_ids)}")
        for p in page_ids:
            if not 0 <= p < num_buffer_pages:
                raise InvalidArgument(f"page id {p} is outside the engine buffer of {num_buffer_pages} pages")
        half_block = self.chunk_tokens * lay.token_bytes  # K (or V) of one layer in the block
        half_buffer = num_buffer_pages * lay.page_bytes  # K (or V) of one layer in the engine buffer
        out: list[ByteCopy] = []
        for kv in (0, 1):
            for r in page_runs(page_ids, lay.page_size):
                out.append(
                    ByteCopy(
                        block_offset=kv * half_block + r.chunk_token * lay.token_bytes,
                        buffer_offset=kv * half_buffer + r.page * lay.page_bytes,
                        nbytes=r.num_pages * lay.page_bytes,
                    )
                )
        return out

"""The engine's KV-cache layout and the paged adapter (engine pages ↔ store chunks).

Pure: no torch, no I/O.  The agent turns the byte ranges computed here into copies.

**Engine side.**  One buffer per layer.  A request's KV lives in the pages named by
its block table (``block_ids``): tokens ``[j * page_size, (j + 1) * page_size)`` of the
request sit in page ``block_ids[j]``.  Where a page's bytes lie is a
:class:`PageGeometry`: each page of a layer is ``planes`` contiguous runs of
``plane_bytes`` (2 runs, K and V, in the flash-attention layout ``[2, num_pages,
page_size, kv_heads, head_dim]`` this module defaults to; 1 run where a page is one
block of memory, as in vLLM's CPU layout ``[num_pages, kv_heads, page_size,
2 * head_dim]``), at ``plane * plane_stride + page * page_stride`` from the layer's
base.  The geometry is learnt from the engine's tensors (``gpu_agent.buffers``), never
assumed; what order the bytes inside a run have is the engine's and is named in the
namespace (``KVLayout.page_layout``), so blocks of two layouts never meet.

**Store side.**  One block per chunk of ``chunk_tokens`` tokens, all layers::

    payload = [layer][plane][page of the chunk][plane_bytes]

For the flash layout that is ``[layer][K/V][token][kv_head][head_dim]`` (shape
``(L, 2, C, H, D)``).  One layer is one contiguous byte range of the block
(layer-wise loads copy ``layer_range(i)``), and a run of consecutive engine pages
maps to one contiguous range on both sides where the engine's pages are adjacent,
which is what :meth:`PagedAdapter.chunk_copies` coalesces.
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

    page_layout: str = ""
    """The byte order inside an engine page, where it is not the flash-attention layout
    (e.g. ``"vllm-cpu:LBHNC"``); part of the namespace, so differently ordered blocks never mix."""

    def kv_layout(self) -> KVLayout:
        return KVLayout(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            kv_split=True,
            page_layout=self.page_layout,
        )

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
        """Shape of one layer's engine buffer in the flash-attention layout."""
        return (2, num_pages, self.page_size, self.num_kv_heads, self.head_dim)

    def flash_geometry(self, num_pages: int) -> PageGeometry:
        """The geometry of a contiguous ``buffer_shape(num_pages)`` buffer."""
        return PageGeometry(
            planes=2,
            plane_bytes=self.page_bytes,
            page_stride=self.page_bytes,
            plane_stride=num_pages * self.page_bytes,
            num_pages=num_pages,
        )


@dataclasses.dataclass(frozen=True, slots=True)
class PageGeometry:
    """Where one page of one layer lies in an engine buffer (bytes from the layer's base).

    Page ``p``'s run ``k`` (``0 <= k < planes``) is ``plane_bytes`` contiguous bytes at
    ``k * plane_stride + p * page_stride``.  Invariant (checked by the agent against its
    layout): ``planes * plane_bytes == 2 * page_size * token_bytes``, every byte of a page once."""

    planes: int
    plane_bytes: int
    page_stride: int
    plane_stride: int
    num_pages: int

    def __post_init__(self) -> None:
        for name in ("planes", "plane_bytes", "page_stride", "num_pages"):
            if getattr(self, name) <= 0:
                raise InvalidArgument(f"PageGeometry.{name} must be positive, got {getattr(self, name)}")
        if self.planes > 1 and self.plane_stride <= 0:
            raise InvalidArgument("PageGeometry.plane_stride must be positive when a page has several runs")

    @property
    def adjacent(self) -> bool:
        """Consecutive pages' runs touch, so a run of pages is one copy."""
        return self.page_stride == self.plane_bytes


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


def page_runs(page_ids: Sequence[int], page_size: int, *, coalesce: bool = True) -> list[PageRun]:
    """Coalesce one chunk's page ids (in token order) into runs of consecutive pages.
    A negative id is a page to leave alone (the engine already holds those tokens)."""
    runs: list[PageRun] = []
    prev = -2
    for j, p in enumerate(page_ids):
        if p < 0:
            prev = -2
            continue
        joined, prev = coalesce and runs and prev >= 0 and runs[-1].page + runs[-1].num_pages == p, p
        if joined:
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
            raise Incompatible(
                f"chunk_tokens={chunk_tokens} must be a positive multiple of page_size={layout.page_size}"
            )
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

    def check_geometry(self, g: PageGeometry) -> None:
        """Raise :class:`Incompatible` unless ``g`` holds exactly one page of this layout."""
        lay = self.layout
        if g.planes * g.plane_bytes != 2 * lay.page_bytes:
            raise Incompatible(
                f"an engine page holds {g.planes} x {g.plane_bytes} bytes per layer; the layout needs "
                f"{2 * lay.page_bytes} (K and V of {lay.page_size} tokens x {lay.num_kv_heads} heads x {lay.head_dim} x {lay.itemsize} B)"
            )

    def chunk_copies(self, page_ids: Sequence[int], num_buffer_pages: int | PageGeometry) -> list[ByteCopy]:
        """Copies moving one chunk between a block's layer range and one layer's engine
        buffer (its :class:`PageGeometry`, or a page count for the flash layout).  Block
        offsets are relative to the layer's range, buffer offsets to the layer's base;
        pages with a negative id are skipped."""
        g = (
            num_buffer_pages
            if isinstance(num_buffer_pages, PageGeometry)
            else self.layout.flash_geometry(num_buffer_pages)
        )
        if len(page_ids) != self.pages_per_chunk:
            raise InvalidArgument(f"a chunk spans {self.pages_per_chunk} pages, got {len(page_ids)}")
        for p in page_ids:
            if p >= g.num_pages:
                raise InvalidArgument(f"page id {p} is outside the engine buffer of {g.num_pages} pages")
        half_block = self.pages_per_chunk * g.plane_bytes  # one run of every page of the chunk
        out: list[ByteCopy] = []
        runs = page_runs(page_ids, self.layout.page_size, coalesce=g.adjacent)
        for plane in range(g.planes):
            for r in runs:
                out.append(
                    ByteCopy(
                        block_offset=plane * half_block + (r.chunk_token // self.layout.page_size) * g.plane_bytes,
                        buffer_offset=plane * g.plane_stride + r.page * g.page_stride,
                        nbytes=r.num_pages * g.plane_bytes,
                    )
                )
        return out

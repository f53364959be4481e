"""Batched copies between store blocks and the engine's pages.

A block's layer range holds its chunk's pages back to back; in the engine those pages
lie wherever the block table put them.  Copying each page run on its own costs one
copy call per (block, layer, plane, run): 16,384 calls of 32 KiB for 4,096 tokens of a
32-layer model with a scattered block table, ~100 ms of host time.  Batched instead:

* **load** (:class:`BatchedLoad`), per layer: one host-to-device (or HBM-pool) copy per
  block into a device staging buffer, then one scatter kernel (``index_put_`` over a
  strided view of the layer) into the engine's pages;
* **save** (:class:`BatchedSave`), per layer one gather kernel from the engine's pages
  into a staging buffer laid out as blocks, then one device-to-host copy per block.

The engine's layer is viewed as ``(planes, num_pages, run)`` words (the widest of 8, 4,
2, 1 bytes dividing every offset), so negative page ids (pages to leave alone) are just
rows left out of the index.  Staging memory is allocated on the copy stream inside the
submitted function and dropped after it, so the caching allocator reuses it in that
stream's order; at most ``group_bytes`` per layer and group of blocks.

Used on CUDA, where the number of calls is what costs; on CPU the agent copies page runs
directly (no staging), but these classes run on CPU tensors too and the unit tests
check them there against the direct path.  State: per transfer, owned by the thread
that issues it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from gpu_agent.copy_engine import CopyEngine, Segmented
from gpu_agent.layout import PageGeometry

_WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)


def page_view(flat: torch.Tensor, origin: int, g: PageGeometry) -> torch.Tensor:
    """One layer's pages as a strided ``(planes, num_pages, run)`` view of words over ``flat``
    (the layer's storage as bytes; page 0's first run at byte ``origin``)."""
    for dt in _WORDS:
        w = torch.empty(0, dtype=dt).element_size()
        if any(x % w for x in (g.plane_bytes, g.page_stride, g.plane_stride, origin)):
            continue
        try:
            words = flat.view(dt)
        except RuntimeError:
            continue  # the storage's size or offset is not a multiple of w
        return torch.as_strided(
            words,
            (g.planes, g.num_pages, g.plane_bytes // w),
            (g.plane_stride // w, g.page_stride // w, 1),
            words.storage_offset() + origin // w,
        )
    raise AssertionError("uint8 always fits")  # pragma: no cover


def _groups(n: int, per: int) -> list[tuple[int, int]]:
    per = max(1, per)
    return [(lo, min(n, lo + per)) for lo in range(0, n, per)]


class _Index:
    """Device page indices of one group of blocks: ``full`` (n, pages per chunk) when every
    page is loaded, else (chunk, page in chunk, page id) of the pages that are."""

    def __init__(self, pages: Sequence[Sequence[int]], device: torch.device) -> None:
        self.n, self.ppc = len(pages), len(pages[0])
        flat = [p for ps in pages for p in ps]
        if all(p >= 0 for p in flat):
            self.full: torch.Tensor | None = _upload([flat], device).view(self.n, self.ppc)
            self.keep: tuple[torch.Tensor, ...] | None = None
        else:
            rows = [(c, j, p) for c, ps in enumerate(pages) for j, p in enumerate(ps) if p >= 0]
            self.full = None
            self.keep = tuple(_upload([[r[i] for r in rows]], device).view(-1) for i in range(3)) if rows else ()


def _upload(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    t = torch.tensor(rows, dtype=torch.int64)
    if device.type == "cuda":
        try:
            t = t.pin_memory()  # torch's caching host allocator: an asynchronous copy, reuse tracked
        except RuntimeError:
            pass
    return t.to(device, non_blocking=True)


class BatchedLoad:
    """Blocks' layer ranges (HBM pool slots or host segments) into the engine's pages,
    one layer per :meth:`layer` call (each inside a submitted function, in layer order)."""

    def __init__(
        self,
        engine: CopyEngine,
        buffers: Any,
        geometry: PageGeometry,
        sources: Sequence[torch.Tensor | Segmented],
        pages: Sequence[Sequence[int]],
        layer_bytes: int,
        group_bytes: int,
    ) -> None:
        self.engine = engine
        self.buffers = buffers  # EngineBuffers: .layers[i] = (flat bytes, origin)
        self.geometry = geometry
        self.sources = list(sources)
        self.pages = [list(p) for p in pages]
        self.layer_bytes = layer_bytes
        self.groups = _groups(len(self.sources), group_bytes // layer_bytes)
        self._index: list[_Index] = []

    def layer(self, layer: int) -> None:
        lb, base = self.layer_bytes, layer * self.layer_bytes
        flat, origin = self.buffers.layers[layer]
        view = page_view(flat, origin, self.geometry)
        dev = flat.device
        if not self._index:
            self._index = [_Index(self.pages[lo:hi], dev) for lo, hi in self.groups]
        for (lo, hi), idx in zip(self.groups, self._index):
            stage = torch.empty((hi - lo) * lb, dtype=torch.uint8, device=dev)
            for c in range(lo, hi):
                d = stage[(c - lo) * lb : (c - lo + 1) * lb]
                src = self.sources[c]
                if isinstance(src, torch.Tensor):
                    d.copy_(src[base : base + lb], non_blocking=True)  # an HBM pool slot
                else:
                    for rel, piece in src.pieces(base, lb):
                        self.engine.h2d(d[rel : rel + piece.numel()], piece)
            planes, _, run = view.shape
            s = stage.view(view.dtype).view(idx.n, planes, idx.ppc, run).permute(1, 0, 2, 3)
            if idx.full is not None:
                view[:, idx.full] = s
            elif idx.keep:
                ci, pi, pid = idx.keep
                view[:, pid] = s[:, ci, pi]


class BatchedSave:
    """The engine's pages of whole blocks into their arena segments: per group of blocks,
    one gather per layer into a staging buffer laid out as the blocks, then one copy per
    block (segment).  :meth:`run` returns the (host segment, device bytes) pairs it could
    not copy by DMA (not registered): the caller drains them once the event completed."""

    def __init__(
        self,
        engine: CopyEngine,
        buffers: Any,
        geometry: PageGeometry,
        dests: Sequence[Segmented],
        pages: Sequence[Sequence[int]],
        num_layers: int,
        layer_bytes: int,
        group_bytes: int,
    ) -> None:
        self.engine = engine
        self.buffers = buffers
        self.geometry = geometry
        self.dests = list(dests)
        self.pages = [list(p) for p in pages]
        self.num_layers = num_layers
        self.block_bytes = num_layers * layer_bytes
        self.groups = _groups(len(self.dests), group_bytes // self.block_bytes)

    def run(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        deferred: list[tuple[torch.Tensor, torch.Tensor]] = []
        bb = self.block_bytes
        views = [page_view(flat, origin, self.geometry) for flat, origin in self.buffers.layers]
        dev = views[0].device
        for lo, hi in self.groups:
            n = hi - lo
            idx = _Index(self.pages[lo:hi], dev)
            assert idx.full is not None, "a save copies whole chunks"
            stage = torch.empty(n * bb, dtype=torch.uint8, device=dev)
            for layer, view in enumerate(views):
                planes, _, run = view.shape
                s = stage.view(view.dtype).view(n, self.num_layers, planes, idx.ppc, run)
                s[:, layer].copy_(view[:, idx.full].permute(1, 0, 2, 3))
            for j in range(n):
                for rel, piece in self.dests[lo + j].pieces(0, bb):
                    src = stage[j * bb + rel : j * bb + rel + piece.numel()]
                    if not self.engine.d2h(piece, src):
                        deferred.append((piece, src))
        return deferred

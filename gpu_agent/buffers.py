"""The engine's KV buffers as the agent copies them: flat bytes, a base per layer, one geometry.

An engine hands the agent one tensor per layer.  Their shapes differ between engines
and attention backends (``[2, pages, page_size, heads, dim]`` for flash attention,
``[pages, heads, page_size, 2 * dim]`` for vLLM's CPU backend, strided views into one
cross-layer allocation, ...).  :func:`learn_geometry` reads where a page's bytes lie
from the tensor's strides alone; :class:`EngineBuffers` keeps, per layer, a flat
``uint8`` tensor over the layer's storage and the byte offset of the layer in it, so
every copy is a byte range and no layout is ever assumed.

State: immutable after construction; the tensors stay owned by the engine.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from gpu_agent.layout import KVCacheLayout, PageGeometry
from kvstore.errors import Incompatible, InvalidArgument


def learn_geometry(t: torch.Tensor, num_pages: int, *, block_dim: int | None = None) -> PageGeometry:
    """The :class:`PageGeometry` of one layer's KV tensor of ``num_pages`` pages.

    ``block_dim`` is the dimension that indexes pages; if not given it is the only
    dimension of size ``num_pages`` (ambiguity is an error naming the shape).  The other
    dimensions are the page interior (stride below the page stride: they must cover one
    dense run) and at most one plane dimension (stride above it: K/V or heads kept apart)."""
    shape, strides, item = tuple(t.shape), t.stride(), t.element_size()
    if block_dim is None:
        cands = [d for d, n in enumerate(shape) if n == num_pages]
        if len(cands) != 1:
            raise Incompatible(
                f"cannot tell which dimension of a KV tensor of shape {shape} indexes its {num_pages} pages"
            )
        block_dim = cands[0]
    if shape[block_dim] != num_pages:
        raise Incompatible(
            f"KV tensor of shape {shape}: dimension {block_dim} has {shape[block_dim]} pages, expected {num_pages}"
        )
    page = strides[block_dim]
    inner = sorted(
        (strides[d], shape[d]) for d in range(len(shape)) if d != block_dim and strides[d] < page and shape[d] > 1
    )
    outer = [d for d in range(len(shape)) if d != block_dim and strides[d] >= page and shape[d] > 1]
    run = 1
    for stride, n in inner:
        if stride != run:
            raise Incompatible(f"KV tensor of shape {shape}, strides {strides}: a page's bytes are not one dense run")
        run *= n
    if len(outer) > 1:
        raise Incompatible(
            f"KV tensor of shape {shape}, strides {strides}: pages are split along more than one dimension"
        )
    planes, plane_stride = (shape[outer[0]], strides[outer[0]]) if outer else (1, 0)
    if planes > 1 and plane_stride < (num_pages - 1) * page + run:
        raise Incompatible(f"KV tensor of shape {shape}, strides {strides}: runs of different pages overlap")
    return PageGeometry(
        planes=planes,
        plane_bytes=run * item,
        page_stride=page * item,
        plane_stride=plane_stride * item,
        num_pages=num_pages,
    )


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 tensor over all of ``t``'s storage (no copy)."""
    st = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(st, 0, (st.nbytes(),), (1,))


@dataclasses.dataclass(frozen=True)
class EngineBuffers:
    """Per layer: a flat byte tensor over the layer's storage and the byte offset of its
    page 0's first run in it; one :class:`PageGeometry` shared by every layer."""

    layers: tuple[tuple[torch.Tensor, int], ...]
    geometry: PageGeometry
    dtype: torch.dtype
    device: torch.device
    sources: tuple[torch.Tensor, ...] = ()
    """The engine's own tensors (for ``record_stream``)."""

    @classmethod
    def from_tensors(
        cls, tensors: Sequence[torch.Tensor], num_pages: int, *, block_dim: int | None = None
    ) -> EngineBuffers:
        """Learn the geometry from ``tensors`` (one per layer; all alike)."""
        if not tensors:
            raise InvalidArgument("no KV tensors")
        geos = {learn_geometry(t, num_pages, block_dim=block_dim) for t in tensors}
        if len(geos) != 1:
            raise Incompatible(f"the engine's layers have different page geometries: {sorted(map(str, geos))}")
        t0 = tensors[0]
        for i, t in enumerate(tensors):
            if t.dtype != t0.dtype or t.device != t0.device:
                raise Incompatible(f"KV tensor {i} is {t.dtype} on {t.device}; layer 0 is {t0.dtype} on {t0.device}")
        layers = tuple((_storage_bytes(t), int(t.storage_offset()) * t.element_size()) for t in tensors)
        return cls(layers, geos.pop(), t0.dtype, t0.device, tuple(tensors))

    @classmethod
    def flash(cls, tensors: Sequence[torch.Tensor], layout: KVCacheLayout) -> EngineBuffers:
        """Contiguous ``layout.buffer_shape(num_pages)`` tensors (the agent's default layout)."""
        n = tensors[0].shape[1] if tensors and tensors[0].dim() == 5 else 0
        for i, b in enumerate(tensors):
            if b.dim() != 5 or tuple(b.shape) != layout.buffer_shape(n):
                raise InvalidArgument(
                    f"kv_buffers[{i}] has shape {tuple(b.shape)}; expected (2, num_pages, {layout.page_size}, {layout.num_kv_heads}, {layout.head_dim})"
                )
            if not b.is_contiguous():
                raise InvalidArgument(f"kv_buffers[{i}] must be contiguous")
        layers = tuple((b.reshape(-1).view(torch.uint8), 0) for b in tensors)
        dt = tensors[0].dtype if tensors else torch.float16
        dev = tensors[0].device if tensors else torch.device("cpu")
        return cls(layers, layout.flash_geometry(n), dt, dev, tuple(tensors))

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def span(self) -> int:
        """Bytes a layer's pages reach from its base (for bounds checks)."""
        g = self.geometry
        return (g.planes - 1) * g.plane_stride + (g.num_pages - 1) * g.page_stride + g.plane_bytes

    def check(self) -> None:
        """Every layer's pages lie inside its storage."""
        for i, (flat, base) in enumerate(self.layers):
            if base < 0 or base + self.span() > flat.numel():
                raise InvalidArgument(
                    f"layer {i}'s pages reach past its storage ({base} + {self.span()} > {flat.numel()} bytes)"
                )


def page_layout_name(prefix: str, t: torch.Tensor, block_dim: int) -> str:
    """A stable name for the byte order inside ``t``'s pages: the interior dimensions'
    sizes from outermost to innermost (what two engines must share to exchange blocks)."""
    dims = sorted((d for d in range(t.dim()) if d != block_dim and t.shape[d] > 1), key=lambda d: -t.stride()[d])
    return f"{prefix}:" + "x".join(str(t.shape[d]) for d in dims) + f"@{math.prod(t.shape[d] for d in dims)}"

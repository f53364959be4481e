"""One pass per byte on the host: the connector's copies between an engine's CPU KV pages
and arena blocks, each block's xxh3 checksum computed while its bytes are in cache.

A block is layer-major (``KVCacheLayout``): layer ``l``'s K/V runs of the chunk's pages lie
at ``[l * layer_bytes, (l + 1) * layer_bytes)``.  The copier walks a block a layer at a time:
it copies the layer's page runs, then feeds that layer's arena bytes (about 1 MiB, still
in cache) to a streaming xxh3.  The result equals ``kvstore.block.checksum`` of the whole
payload, and memory is crossed once (copy) instead of twice (copy, then a checksum pass).  Bytes of the block that the copy skips (pages the
engine already holds) are hashed where they fall, so a block's checksum never depends on
which pages a load wrote.

A load checks each block against the checksum it was committed with; a block that does not
match has been written into the engine's pages all the same, so the caller must treat it
(and every chunk after it) as not loaded — vLLM recomputes those pages.  A save returns the
checksums to commit.

Copies are libc ``memmove`` between host addresses (bounds are checked before: the engine's
buffers by ``EngineBuffers.check`` and the page ids by ``PagedAdapter.chunk_copies``, the
block's range by ``Segmented.pieces``), one thread each; torch's ``copy_`` splits every
piece over its intra-op threads, which costs more than it gains at this size.  Blocks are
split between the calling thread and ``threads - 1`` helper threads (memmove through ctypes
and xxh3 release the GIL); ``threads=1`` (what an engine bound to one core gets)
copies inline on the caller's thread, with no executor hop at all.

State: the helper threads (created here, shut down by :meth:`close`); everything else is
the caller's and lives for one call.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
from collections.abc import Sequence

import torch
import xxhash

from gpu_agent.buffers import EngineBuffers
from gpu_agent.copy_engine import Segmented
from gpu_agent.layout import ByteCopy

_memmove = ctypes.memmove  # libc's memmove; a ctypes call drops the GIL while it copies


@dataclasses.dataclass(frozen=True, slots=True)
class BlockJob:
    """One chunk's move: its arena payload (``arena`` for copies, ``views`` over the same
    bytes for hashing) and its copies against one layer of the engine's buffers."""

    arena: Segmented
    views: Sequence[memoryview]
    copies: Sequence[ByteCopy]
    expected: int | None = None
    """A load's committed checksum (None: trust the bytes; verification off)."""


class _Hash:
    """A streaming xxh3 over ranges of a block held in one or more memoryviews."""

    __slots__ = ("h", "views", "starts")

    def __init__(self, views: Sequence[memoryview]) -> None:
        self.h = xxhash.xxh3_64()
        self.views = [v.cast("B") if v.format != "B" or v.ndim != 1 else v for v in views]
        self.starts = []
        pos = 0
        for v in self.views:
            self.starts.append(pos)
            pos += v.nbytes

    def update(self, lo: int, hi: int) -> None:
        if lo >= hi:
            return
        if len(self.views) == 1:
            self.h.update(self.views[0][lo:hi])
            return
        for start, v in zip(self.starts, self.views):
            a, b = max(lo, start), min(hi, start + v.nbytes)
            if a < b:
                self.h.update(v[a - start : b - start])


class HostCopier:
    """Fused copy-and-checksum between CPU engine pages and arena blocks (see the module
    docstring).  ``layer_bytes``: one layer's share of a block; ``threads``: threads that
    share a call's blocks, the caller's included."""

    def __init__(self, layer_bytes: int, num_layers: int, *, threads: int = 1) -> None:
        if threads < 1:
            raise ValueError(f"threads must be positive, got {threads}")
        self.layer_bytes = layer_bytes
        self.num_layers = num_layers
        self.threads = threads
        self._pool = (
            concurrent.futures.ThreadPoolExecutor(threads - 1, thread_name_prefix="kv-hostcopy")
            if threads > 1
            else None
        )

    def plan(self, copies: Sequence[ByteCopy]) -> list[ByteCopy]:
        """A chunk's copies (``PagedAdapter.chunk_copies``) as this copier walks them."""
        return sorted(copies, key=lambda c: c.block_offset)

    # -- one block ----------------------------------------------------------------------
    def _walk(self, job: BlockJob, buffers: EngineBuffers, *, into_engine: bool, hashed: bool) -> int | None:
        """Copy one block, layer by layer; with ``hashed``, each layer's bytes of the block are
        hashed right after that layer's copies (still in cache: a layer is ~1 MiB of a block)."""
        h = _Hash(job.views) if hashed else None
        lb = self.layer_bytes
        single = len(job.arena.parts) == 1
        block = job.arena.parts[0].data_ptr() if single else 0
        if single and job.arena.nbytes < self.num_layers * lb:
            raise ValueError(f"a {job.arena.nbytes}-byte block; the layout needs {self.num_layers * lb}")
        mm = _memmove
        for layer in range(self.num_layers):
            base = layer * lb
            flat, origin = buffers.layers[layer]
            engine = flat.data_ptr() + origin  # bounds: EngineBuffers.check and chunk_copies' page ids
            if single:
                for c in job.copies:
                    if into_engine:
                        mm(engine + c.buffer_offset, block + base + c.block_offset, c.nbytes)
                    else:
                        mm(block + base + c.block_offset, engine + c.buffer_offset, c.nbytes)
            else:
                for c in job.copies:
                    for rel, part in job.arena.pieces(base + c.block_offset, c.nbytes):  # bounds: the block's
                        o = engine + c.buffer_offset + rel
                        if into_engine:
                            mm(o, part.data_ptr(), part.numel())
                        else:
                            mm(part.data_ptr(), o, part.numel())
            if h is not None:
                h.update(base, base + lb)
        return h.h.intdigest() if h is not None else None

    def _run(self, jobs: Sequence[BlockJob], fn: object) -> list[object]:
        """``fn(job)`` for every job: every ``threads``-th on this thread, the rest on the
        helpers; results in job order.  Exceptions come back as results (the caller decides)."""

        def share(k: int) -> list[tuple[int, object]]:
            out: list[tuple[int, object]] = []
            with torch.inference_mode():  # engines keep their KV as inference tensors
                for i in range(k, len(jobs), self.threads):
                    try:
                        out.append((i, fn(jobs[i])))  # type: ignore[operator]
                    except Exception as e:  # handed to the caller per block
                        out.append((i, e))
            return out

        if self._pool is None or len(jobs) < 2:
            return _inline(jobs, fn)
        futs = [self._pool.submit(share, k) for k in range(1, min(self.threads, len(jobs)))]
        got = share(0)
        for f in futs:
            got += f.result()
        return [r for _, r in sorted(got, key=lambda x: x[0])]

    # -- calls ----------------------------------------------------------------------------
    def load(self, dst: EngineBuffers, jobs: Sequence[BlockJob]) -> list[bool | Exception]:
        """Copy each block into the engine's pages; per block True (copied, and its checksum
        matches when ``expected`` is set), False (copied, checksum mismatch) or the error."""

        def one(job: BlockJob) -> bool:
            got = self._walk(job, dst, into_engine=True, hashed=job.expected is not None)
            return got is None or got == job.expected

        return self._run(jobs, one)  # type: ignore[return-value]

    def save(self, src: EngineBuffers, jobs: Sequence[BlockJob]) -> list[int | Exception]:
        """Copy the engine's pages into each block; per block its payload checksum, or the error."""
        return self._run(jobs, lambda job: self._walk(job, src, into_engine=False, hashed=True))  # type: ignore[return-value]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _inline(jobs: Sequence[BlockJob], fn: object) -> list[object]:
    out: list[object] = []
    with torch.inference_mode():
        for job in jobs:
            try:
                out.append(fn(job))  # type: ignore[operator]
            except Exception as e:  # handed to the caller per block
                out.append(e)
    return out

"""The copy engine: one stream per direction, an event per transfer.

State: two streams (``h2d``: into the device, also used for device-to-device scatters
from the HBM pool; ``d2h``: out of the device) and, on CUDA, the host memory it
registered.  Owned by one :class:`~gpu_agent.agent.GPUAgent`; ``submit`` may be called
from several threads (the engine's and the agent's prefetch worker) — copies onto one
stream run in the order they were submitted.

* **CUDA**: real non-default streams; ``submit`` enqueues the copies on the stream
  (``non_blocking=True``, so a copy from host memory registered with
  ``cudaHostRegister`` is asynchronous DMA) and records a ``torch.cuda.Event``.
  Callers wait on that event — :meth:`Event.wait` makes the *current* stream wait
  (no host block), :meth:`Event.synchronize` blocks the host on that event only.
  Nothing here ever synchronizes the whole device.
* **CPU** (no CUDA): each "stream" is one worker thread that runs submitted copy
  functions in order, and an event is the future of the submission.  Same interface,
  same ordering guarantees, so CI runs the agent's real code paths; torch releases
  the GIL inside large copies, so a load still overlaps the caller's compute.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

log = logging.getLogger(__name__)

DIRECTIONS = ("h2d", "d2h")


class Event:
    """Completion of one submitted transfer."""

    def query(self) -> bool:
        raise NotImplementedError

    def synchronize(self) -> None:
        """Block the calling thread until the transfer is done (this transfer only)."""
        raise NotImplementedError

    def wait(self) -> None:
        """Order the caller's work after the transfer: on CUDA the current stream waits
        (the host does not block); on CPU the calling thread blocks."""
        raise NotImplementedError


class CudaEvent(Event):
    """A recorded ``torch.cuda.Event`` and the device it was recorded on: ``wait`` makes
    *that* device's current stream wait, whatever the calling thread's default device."""

    def __init__(self, ev: "torch.cuda.Event", device: torch.device) -> None:
        self.ev = ev
        self.device = device

    def query(self) -> bool:
        return bool(self.ev.query())

    def synchronize(self) -> None:
        self.ev.synchronize()

    def wait(self) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.ev)


class FutureEvent(Event):
    def __init__(self, fut: "concurrent.futures.Future[None]") -> None:
        self.fut = fut

    def query(self) -> bool:
        return self.fut.done()

    def synchronize(self) -> None:
        self.fut.result()  # re-raises a failed copy

    def wait(self) -> None:
        self.synchronize()


class DoneEvent(Event):
    """An event that has already happened (nothing was submitted)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def wait(self) -> None:
        return None


def host_tensor(view: memoryview) -> torch.Tensor:
    """A uint8 CPU tensor over ``view``'s bytes: no copy (``torch.frombuffer``)."""
    with warnings.catch_warnings():
        # read-only arena views (leased blocks) are only ever copy sources
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(view, dtype=torch.uint8)


def normalize_device(device: str | torch.device | None) -> torch.device:
    """The device a copy engine moves KV on, always with an index on CUDA.

    ``torch.device("cuda") != torch.device("cuda:0")``, and every CUDA tensor carries an
    index, so an agent that kept the bare ``cuda`` would refuse every real buffer.  ``None``
    picks the current CUDA device when there is one, else the CPU."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (no copy, any device)."""
    if not t.is_contiguous():
        raise ValueError("KV buffers must be contiguous")
    return t.reshape(-1).view(torch.uint8)


class Segmented:
    """A block's payload as one or more byte tensors (an arena block may span extents)."""

    def __init__(self, parts: Sequence[torch.Tensor]) -> None:
        self.parts = list(parts)
        self.starts: list[int] = []
        pos = 0
        for p in self.parts:
            self.starts.append(pos)
            pos += p.numel()
        self.nbytes = pos

    def pieces(self, offset: int, nbytes: int) -> list[tuple[int, torch.Tensor]]:
        """(relative offset, tensor slice) pieces covering ``[offset, offset + nbytes)``."""
        if offset < 0 or offset + nbytes > self.nbytes:
            raise ValueError(f"range [{offset}, {offset + nbytes}) lies outside a {self.nbytes}-byte block")
        if len(self.parts) == 1:
            return [(0, self.parts[0][offset : offset + nbytes])]
        out = []
        end = offset + nbytes
        for start, p in zip(self.starts, self.parts):
            lo, hi = max(offset, start), min(end, start + p.numel())
            if lo < hi:
                out.append((lo - offset, p[lo - start : hi - start]))
        return out


def copy_range(dst: Segmented | torch.Tensor, dst_off: int, src: Segmented | torch.Tensor, src_off: int, nbytes: int) -> None:
    """Copy ``nbytes`` between byte tensors or segmented blocks (asynchronously on CUDA)."""
    if isinstance(src, Segmented):
        for rel, piece in src.pieces(src_off, nbytes):
            copy_range(dst, dst_off + rel, piece, 0, piece.numel())
        return
    if isinstance(dst, Segmented):
        for rel, piece in dst.pieces(dst_off, nbytes):
            piece.copy_(src[src_off + rel : src_off + rel + piece.numel()], non_blocking=True)
        return
    dst[dst_off : dst_off + nbytes].copy_(src[src_off : src_off + nbytes], non_blocking=True)


class CopyEngine:
    """Streams, events and pinned-host registration for one device."""

    def __init__(self, device: str | torch.device) -> None:
        self.device = normalize_device(device)
        device = self.device
        self.is_cuda = device.type == "cuda"
        self._registered: list[int] = []
        self._closed = False
        if self.is_cuda:
            self._streams = {d: torch.cuda.Stream(device=device) for d in DIRECTIONS}
            self._workers: dict[str, concurrent.futures.ThreadPoolExecutor] = {}
        else:
            self._streams = {}
            self._workers = {d: concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"kv-{d}") for d in DIRECTIONS}
        self._lock = threading.Lock()

    # -- pinned host memory ----------------------------------------------------------
    def register_host(self, buf: memoryview) -> bool:
        """Register ``buf`` (the node's arena) as page-locked memory, once, so copies from
        and to it are asynchronous DMA.  False on CPU (nothing to do) or if CUDA refuses."""
        if not self.is_cuda or buf.nbytes == 0:
            return False
        import numpy as np

        ptr = int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)
        with torch.cuda.device(self.device):
            rc = torch.cuda.cudart().cudaHostRegister(ptr, buf.nbytes, 0)
        code = int(getattr(rc, "value", rc))
        if code != 0:
            log.warning("cudaHostRegister of the %d-byte arena failed (error %d): copies will be staged, not DMA", buf.nbytes, code)
            return False
        self._registered.append(ptr)
        return True

    # -- transfers -------------------------------------------------------------------
    def submit(
        self,
        direction: str,
        fn: Callable[[], None],
        *,
        after: Sequence[Event] = (),
        after_compute: bool = False,
        uses: Sequence[torch.Tensor] = (),
    ) -> Event:
        """Run ``fn`` (which issues tensor copies) on ``direction``'s stream, after the events
        ``after`` and, with ``after_compute``, after work already queued on the current stream.

        ``uses``: device tensors the copies read or write; on CUDA they are marked as used
        by the copy stream (``record_stream``), so the caching allocator never hands their
        memory out again before the copies ran."""
        if self._closed:
            raise RuntimeError("copy engine is closed")
        if self.is_cuda:
            stream = self._streams[direction]
            if after_compute:
                stream.wait_stream(torch.cuda.current_stream(self.device))
            for e in after:
                if isinstance(e, CudaEvent):
                    stream.wait_event(e.ev)
                else:
                    e.synchronize()
            with torch.cuda.stream(stream), torch.inference_mode():
                fn()
                ev = torch.cuda.Event(blocking=True)  # host waits sleep, they do not spin
                ev.record(stream)
            for t in uses:
                if t.device.type == "cuda":
                    t.record_stream(stream)
            return CudaEvent(ev, self.device)
        deps = list(after)

        def run() -> None:
            for e in deps:
                e.synchronize()
            # engines keep their KV cache as inference tensors (vLLM runs under
            # inference_mode): copies into or out of them must run in that mode too
            with torch.inference_mode():
                fn()

        return FutureEvent(self._workers[direction].submit(run))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for w in self._workers.values():
            w.shutdown(wait=True)
        if self.is_cuda:
            for s in self._streams.values():
                s.synchronize()
            for ptr in self._registered:
                torch.cuda.cudart().cudaHostUnregister(ptr)
            self._registered.clear()

    def stats(self) -> dict[str, Any]:
        return {"device": str(self.device), "pinned_registrations": len(self._registered)}

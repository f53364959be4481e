"""The copy engine: one stream per direction, an event per transfer, the pinned arena.

State: three streams (``h2d``: into the device, also device-to-device scatters from the
HBM pool; ``d2h``: out of the device; ``prefetch``: arena -> HBM pool, so a prefetch
never delays a latency-critical load), on CUDA a fourth (``drain``, for staged
device-to-host copies), the host memory it registered (:class:`~gpu_agent.pinned.ArenaPin`)
and two pinned bounce buffers for memory that is not registered.  Owned by one
:class:`~gpu_agent.agent.GPUAgent`; ``submit`` may be called from several threads —
copies onto one stream run in the order they were submitted.

* **CUDA**: real non-default streams; ``submit`` enqueues the copies on the stream
  (``non_blocking=True``: a copy from or to the registered arena is asynchronous DMA)
  and records a blocking ``torch.cuda.Event`` (host waits sleep, they do not spin).
  Callers wait on that event — :meth:`Event.wait` makes the *current* stream of the
  event's device wait (no host block), :meth:`Event.synchronize` blocks the host on
  that event only.  Nothing here ever synchronizes the whole device.  A host range
  outside the registered arena (registration refused, or the client remapped the arena
  and it is not registered yet) is never handed to the DMA engine as if pinned:
  :meth:`CopyEngine.h2d` stages it through a pinned bounce buffer, and device-to-host
  copies into it are left to :meth:`CopyEngine.drain` (a background thread's job).
* **CPU** (no CUDA): each "stream" is one worker thread that runs submitted copy
  functions in order, and an event is the future of the submission.  Same interface,
  same ordering guarantees, so CI runs the agent's real code paths; torch releases
  the GIL inside large copies, so a load still overlaps the caller's compute.  A fake
  CUDA runtime (``cudart=``) makes the registration bookkeeping run here too.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from gpu_agent.pinned import ArenaPin, CudaRuntime, HostRegistry, cuda_runtime

log = logging.getLogger(__name__)

DIRECTIONS = ("h2d", "d2h", "prefetch")


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

    def __init__(self, ev: torch.cuda.Event, device: torch.device) -> None:
        self.ev = ev
        self.device = device

    def query(self) -> bool:
        return bool(self.ev.query())

    def synchronize(self) -> None:
        self.ev.synchronize()

    def wait(self) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.ev)


class FutureEvent(Event):
    def __init__(self, fut: concurrent.futures.Future[None]) -> None:
        self.fut = fut

    def query(self) -> bool:
        return self.fut.done()

    def synchronize(self) -> None:
        self.fut.result()  # re-raises a failed copy

    def wait(self) -> None:
        self.synchronize()


class DeferredEvent(Event):
    """The event of a transfer that another thread issues (a load's later layers): a wait
    first blocks the host until it is issued (a matter of microseconds), then waits on it."""

    def __init__(self, fut: concurrent.futures.Future[Event]) -> None:
        self.fut = fut

    def resolve(self) -> Event:
        return self.fut.result()

    def query(self) -> bool:
        if not self.fut.done():
            return False
        return self.fut.exception() is not None or self.fut.result().query()

    def synchronize(self) -> None:
        self.resolve().synchronize()

    def wait(self) -> None:
        if self.fut.exception() is not None:
            return  # never issued: the load's wait() reports it (False), the engine recomputes
        self.resolve().wait()


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


def copy_range(
    dst: Segmented | torch.Tensor, dst_off: int, src: Segmented | torch.Tensor, src_off: int, nbytes: int
) -> None:
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


class BounceRing:
    """A pinned host buffer used round-robin for staged host-to-device copies: a region is
    reused only after the copy out of it completed (its event)."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.size = nbytes
        self.device = device
        self.lock = threading.Lock()
        self._head = 0
        self._pending: collections.deque[tuple[int, int, Any]] = collections.deque()

    def take(self, n: int) -> torch.Tensor:
        """A region of ``n`` bytes (``n <= size``) no queued copy still reads.  Call under :attr:`lock`."""
        if self._head + n > self.size:
            self._head = 0
        lo, hi = self._head, self._head + n
        keep: collections.deque[tuple[int, int, Any]] = collections.deque()
        for a, b, ev in self._pending:
            if a < hi and lo < b:
                ev.synchronize()  # only when the ring wrapped onto a copy still in flight
            elif not ev.query():
                keep.append((a, b, ev))
        self._pending = keep
        self._head = hi
        return self.buf[lo:hi]

    def used(self, region: torch.Tensor, stream: Any) -> None:
        ev = torch.cuda.Event(blocking=True)
        ev.record(stream)
        off = region.data_ptr() - self.buf.data_ptr()
        self._pending.append((off, off + region.numel(), ev))


class CopyEngine:
    """Streams, events, pinned-host registration and staging for one device.

    ``cudart``: the CUDA runtime that registers host memory (default: the real one on
    CUDA, none on CPU); a fake one runs the registration bookkeeping anywhere (tests).
    ``bounce_bytes``: size of each pinned bounce buffer (allocated on first use)."""

    def __init__(
        self, device: str | torch.device, *, cudart: CudaRuntime | None = None, bounce_bytes: int = 16 << 20
    ) -> None:
        self.device = normalize_device(device)
        device = self.device
        self.is_cuda = device.type == "cuda"
        self._closed = False
        if self.is_cuda:
            with torch.cuda.device(device):
                self._streams = {d: torch.cuda.Stream(device=device) for d in (*DIRECTIONS, "drain")}
            self._workers: dict[str, concurrent.futures.ThreadPoolExecutor] = {}
        else:
            self._streams = {}
            self._workers = {
                d: concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"kv-{d}") for d in DIRECTIONS
            }
        if cudart is None and self.is_cuda:
            cudart = cuda_runtime()
        self.host = ArenaPin(HostRegistry.shared(cudart) if cudart is not None else None, self.fences)
        self._bounce_bytes = bounce_bytes
        self._bounce: dict[str, BounceRing] = {}
        self._lock = threading.Lock()
        self.copies: collections.Counter[str] = collections.Counter()  # "dma" / "staged" host copies

    # -- pinned host memory ----------------------------------------------------------
    def register_host(self, buf: memoryview) -> bool:
        """Register ``buf`` (the node's arena as the client maps it) as page-locked memory, so
        copies from and to it are asynchronous DMA.  A call with the mapping already
        registered is a no-op; a new mapping (the client remapped a restarted node's arena)
        is registered and the old one unregistered once the copies queued so far are done.
        False on CPU (nothing to do, unless a fake runtime was given) or if CUDA refuses."""
        return self.host.pin(buf)

    def host_registered(self, t: torch.Tensor) -> bool:
        """``t`` (a CPU tensor) lies in the registered arena."""
        return self.host.contains(t.data_ptr(), t.numel())

    def fences(self) -> list[Event]:
        """Events that complete once everything submitted so far, on every stream, has."""
        if self._closed:
            return []
        if self.is_cuda:
            out: list[Event] = []
            for s in self._streams.values():
                ev = torch.cuda.Event(blocking=True)
                ev.record(s)
                out.append(CudaEvent(ev, self.device))
            return out
        return [FutureEvent(w.submit(lambda: None)) for w in self._workers.values()]

    def _note(self, kind: str) -> None:
        with self._lock:
            self.copies[kind] += 1

    def _ring(self, name: str) -> BounceRing:
        with self._lock:
            ring = self._bounce.get(name)
            if ring is None:
                ring = self._bounce[name] = BounceRing(self._bounce_bytes, self.device)
            return ring

    def h2d(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy host bytes ``src`` into device bytes ``dst`` on the current stream: DMA from the
        registered arena, else through a pinned bounce buffer (a host memcpy, then DMA).
        Call inside a :meth:`submit` function."""
        if not self.is_cuda or src.device.type != "cpu":
            dst.copy_(src, non_blocking=True)
            return
        if self.host_registered(src) or src.is_pinned():
            self._note("dma")
            dst.copy_(src, non_blocking=True)
            return
        self._note("staged")
        ring = self._ring("h2d")
        stream = torch.cuda.current_stream(self.device)
        for lo in range(0, src.numel(), ring.size):
            hi = min(src.numel(), lo + ring.size)
            with ring.lock:
                region = ring.take(hi - lo)
                region.copy_(src[lo:hi])
                dst[lo:hi].copy_(region, non_blocking=True)
                ring.used(region, stream)

    def d2h(self, dst: torch.Tensor, src: torch.Tensor) -> bool:
        """Queue device bytes ``src`` into host bytes ``dst`` on the current stream if ``dst``
        is registered (DMA; True).  False: not registered, nothing queued — the caller
        keeps ``src`` alive and has :meth:`drain` move it once its event completed (a
        device-to-host copy into pageable memory would block this thread)."""
        if not self.is_cuda:
            dst.copy_(src)
            return True
        if self.host_registered(dst):
            self._note("dma")
            dst.copy_(src, non_blocking=True)
            return True
        return False

    def drain(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Move device bytes ``src`` (already computed) into host bytes ``dst`` through a pinned
        bounce buffer, blocking the calling (background) thread until they are there."""
        self._note("staged")
        ring = self._ring("d2h")
        stream = self._streams["drain"]
        with torch.cuda.device(self.device), torch.cuda.stream(stream), ring.lock:
            for lo in range(0, src.numel(), ring.size):
                hi = min(src.numel(), lo + ring.size)
                region = ring.buf[: hi - lo]
                region.copy_(src[lo:hi], non_blocking=True)
                ev = torch.cuda.Event(blocking=True)
                ev.record(stream)
                ev.synchronize()
                dst[lo:hi].copy_(region)

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
        after = [e.resolve() if isinstance(e, DeferredEvent) else e for e in after]
        if self.is_cuda:
            stream = self._streams[direction]
            with torch.cuda.device(self.device):
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
        """Finish the queued copies, then unregister the arena (before its mapping may go)."""
        if self._closed:
            return
        fences = self.fences()
        for f in fences:
            try:
                f.synchronize()
            except Exception:
                pass  # a failed copy's error belongs to its own waiter
        self.host.close()
        self._closed = True
        for w in self._workers.values():
            w.shutdown(wait=True)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            copies = dict(self.copies)
        return {"device": str(self.device), **self.host.stats(), "host_copies": copies}

"""Page-locked host memory: the arena's ``cudaHostRegister`` registration, tied to its mapping.

Three pieces, each small enough to test on CPU with a fake runtime:

* :class:`CudaRuntime` is the seam: the three runtime calls this module makes
  (``cudaHostRegister``, ``cudaHostUnregister``, ``cudaGetLastError``).  The real one
  (:func:`cuda_runtime`) calls the ``libcudart`` that torch loaded, so clearing the
  last error clears *torch's* error state; tests pass a fake to :class:`CopyEngine`.
* :class:`HostRegistry`: one per runtime and process, reference-counted by address.
  Two agents over one client share one registration (a second ``cudaHostRegister``
  of the same range would fail with 712, *already registered*).  A failed call's
  error is cleared at once: torch checks ``cudaGetLastError`` after its next kernel
  launch on that thread and would raise the stale error there instead.
* :class:`ArenaPin`: what one copy engine registered.  It holds a buffer export of
  the mapping for as long as the range is registered, so the client cannot unmap the
  arena under a live registration (``Arena.close`` then leaves the mapping to us);
  when the client remaps (a node restart), :meth:`ArenaPin.pin` registers the new
  mapping and *retires* the old one: unregistered, and its export dropped, only once
  every copy queued before the switch has completed.

Lock order: ``ArenaPin._lock`` before ``HostRegistry._lock``; neither is held while a
copy is issued.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

log = logging.getLogger(__name__)

ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered


class CudaRuntime(Protocol):
    """The runtime calls host registration needs; each returns a ``cudaError_t`` (0: success)."""

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> Any: ...

    def cudaHostUnregister(self, ptr: int) -> Any: ...

    def cudaGetLastError(self) -> Any: ...


def _code(rc: Any) -> int:
    return int(getattr(rc, "value", rc))


class _LoadedCudart:
    """``libcudart`` as torch loaded it (found in this process's mappings, so its per-thread
    last error is the one torch's launch checks read), called through ctypes."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
        for f in (lib.cudaHostRegister, lib.cudaHostUnregister, lib.cudaGetLastError):
            f.restype = ctypes.c_int

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:
        return int(self._lib.cudaHostRegister(ctypes.c_void_p(ptr), nbytes, flags))

    def cudaHostUnregister(self, ptr: int) -> int:
        return int(self._lib.cudaHostUnregister(ctypes.c_void_p(ptr)))

    def cudaGetLastError(self) -> int:
        return int(self._lib.cudaGetLastError())


class _TorchCudart:
    """torch's own binding (``torch.cuda.cudart()``), where no ``libcudart`` is found loaded
    (a build that links it statically).  It cannot clear the last error, so a failed
    registration is followed by one tiny synchronous call that consumes it."""

    def __init__(self) -> None:
        import torch

        self._torch = torch
        self._rt = torch.cuda.cudart()

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> Any:
        return self._rt.cudaHostRegister(ptr, nbytes, flags)

    def cudaHostUnregister(self, ptr: int) -> Any:
        return self._rt.cudaHostUnregister(ptr)

    def cudaGetLastError(self) -> int:
        # torch's CUDA error checks call cudaGetLastError (which also resets it) and raise:
        # provoke one here, on this thread, where the failure is expected and swallowed
        try:
            self._torch.cuda.current_stream().query()
            self._torch.empty(1, device="cuda").fill_(0)
        except RuntimeError as e:
            log.info("cleared a stale CUDA error: %s", e)
        return 0


def _loaded_cudart_path() -> str | None:
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(None, 1)[-1]
                if "/libcudart" in path and ".so" in path:
                    return path
    except OSError:
        return None
    return None


_runtime: CudaRuntime | None = None
_runtime_lock = threading.Lock()


def cuda_runtime() -> CudaRuntime:
    """The process's CUDA runtime (CUDA must be initialised: torch loads ``libcudart`` then)."""
    global _runtime
    with _runtime_lock:
        if _runtime is None:
            import torch

            torch.cuda.init()
            path = _loaded_cudart_path()
            rt: CudaRuntime | None = None
            if path is not None:
                try:
                    rt = _LoadedCudart(ctypes.CDLL(path))  # the handle torch already holds
                except (OSError, AttributeError) as e:
                    log.info("cannot call %s through ctypes (%s); using torch's cudart binding", path, e)
            _runtime = rt or _TorchCudart()
        return _runtime


class HostRegistry:
    """Process-wide, reference-counted ``cudaHostRegister`` ranges of one runtime."""

    _shared: dict[int, HostRegistry] = {}
    _shared_lock = threading.Lock()

    def __init__(self, runtime: CudaRuntime) -> None:
        self.runtime = runtime
        self._lock = threading.Lock()
        self._ranges: dict[int, list[int]] = {}  # ptr -> [nbytes, refs, owned (we registered it)]

    @classmethod
    def shared(cls, runtime: CudaRuntime) -> HostRegistry:
        """The one registry of ``runtime`` in this process."""
        with cls._shared_lock:
            reg = cls._shared.get(id(runtime))
            if reg is None or reg.runtime is not runtime:
                reg = cls._shared[id(runtime)] = HostRegistry(runtime)
            return reg

    def acquire(self, ptr: int, nbytes: int) -> bool:
        """Register ``[ptr, ptr + nbytes)`` (or count one more user of it); False if refused."""
        with self._lock:
            r = self._ranges.get(ptr)
            if r is not None and r[0] >= nbytes:
                r[1] += 1
                return True
            code = _code(self.runtime.cudaHostRegister(ptr, nbytes, 0))
            if code != 0:
                self.runtime.cudaGetLastError()  # never leave it for the next kernel launch to raise
            if code == ALREADY_REGISTERED:  # pinned by someone outside this registry: use it, never unregister it
                self._ranges[ptr] = [nbytes, 1, 0]
                return True
            if code != 0:
                log.warning(
                    "cudaHostRegister of %d bytes failed (error %d): copies are staged through a pinned bounce buffer",
                    nbytes,
                    code,
                )
                return False
            self._ranges[ptr] = [nbytes, 1, 1]
            return True

    def release(self, ptr: int) -> None:
        with self._lock:
            r = self._ranges.get(ptr)
            if r is None:
                return
            r[1] -= 1
            if r[1] > 0:
                return
            del self._ranges[ptr]
            if r[2]:
                code = _code(self.runtime.cudaHostUnregister(ptr))
                if code != 0:
                    self.runtime.cudaGetLastError()
                    log.warning("cudaHostUnregister failed (error %d)", code)

    def refs(self, ptr: int) -> int:
        with self._lock:
            r = self._ranges.get(ptr)
            return r[1] if r is not None else 0


def buffer_address(buf: memoryview) -> tuple[Any, int]:
    """(an export of ``buf`` that keeps its mapping alive, its address)."""
    import numpy as np

    arr = np.frombuffer(buf, dtype=np.uint8)
    return arr, int(arr.ctypes.data)


class _Pinned:
    __slots__ = ("export", "ptr", "nbytes", "registered")

    def __init__(self, export: Any, ptr: int, nbytes: int, registered: bool) -> None:
        self.export, self.ptr, self.nbytes, self.registered = export, ptr, nbytes, registered


class ArenaPin:
    """The host range one copy engine has registered, and the ranges it retired.

    ``fences()`` (given by the copy engine) returns events that complete once every copy
    queued so far has completed: a retired range is unregistered only after them."""

    def __init__(self, registry: HostRegistry | None, fences: Callable[[], Sequence[Any]]) -> None:
        self.registry = registry
        self._fences = fences
        self._lock = threading.Lock()
        self._current: _Pinned | None = None
        self._retired: list[tuple[_Pinned, Sequence[Any]]] = []
        self.registrations = 0  # ranges registered over this pin's life (a restart adds one)

    @property
    def registered(self) -> bool:
        cur = self._current
        return cur is not None and cur.registered

    @property
    def retired(self) -> int:
        return len(self._retired)

    def pin(self, buf: memoryview) -> bool:
        """Register ``buf`` (the client's arena mapping) unless it is the one already pinned;
        the previous mapping is retired.  True if ``buf`` is registered."""
        if self.registry is None or buf.nbytes == 0:
            return False
        export, ptr = buffer_address(buf)
        with self._lock:
            cur = self._current
            if cur is not None and cur.ptr == ptr and cur.nbytes == buf.nbytes:
                return cur.registered
            ok = self.registry.acquire(ptr, buf.nbytes)
            self._current = _Pinned(export, ptr, buf.nbytes, ok)
            self.registrations += ok
            if cur is not None:
                self._retired.append((cur, self._fences()))
        self.reap()
        return ok

    def contains(self, ptr: int, nbytes: int) -> bool:
        """``[ptr, ptr + nbytes)`` lies in the registered range (DMA may use it directly)."""
        cur = self._current
        return cur is not None and cur.registered and cur.ptr <= ptr and ptr + nbytes <= cur.ptr + cur.nbytes

    def reap(self, *, wait: bool = False) -> int:
        """Unregister retired ranges whose copies are done (all of them, waiting, with ``wait``)."""
        with self._lock:
            keep, done = [], []
            for p, fences in self._retired:
                if wait:
                    for f in fences:
                        f.synchronize()
                if all(f.query() for f in fences):
                    done.append(p)
                else:
                    keep.append((p, fences))
            self._retired = keep
        for p in done:
            self._drop(p)
        return len(done)

    def close(self) -> None:
        """Unregister everything (after the copies queued so far), then let the mappings go."""
        with self._lock:
            cur, self._current = self._current, None
            if cur is not None:
                self._retired.append((cur, self._fences()))
        self.reap(wait=True)

    def _drop(self, p: _Pinned) -> None:
        if p.registered and self.registry is not None:
            self.registry.release(p.ptr)  # unregistered first ...
        p.export = None  # ... then the mapping may go

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "pinned_registrations": int(self.registered),
                "pinned_retired": len(self._retired),
                "pinned_registered_total": self.registrations,
            }

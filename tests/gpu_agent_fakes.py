"""Fakes for the GPU agent's seams (CPU tests): a CUDA runtime that registers host memory."""

from __future__ import annotations

from pathlib import Path

from gpu_agent.pinned import ALREADY_REGISTERED


class FakeCudart:
    """Keeps the registered ranges and the per-thread last error as the runtime does; records
    whether a range was still mapped when it was unregistered."""

    def __init__(self, refuse: int = 0) -> None:
        self.refuse = refuse
        self.registered: dict[int, int] = {}
        self.calls: list[tuple[str, int]] = []
        self.last_error = 0
        self.mapped_at_unregister: list[bool] = []

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:
        self.calls.append(("register", ptr))
        code = self.refuse or (ALREADY_REGISTERED if ptr in self.registered else 0)
        if code:
            self.last_error = code
            return code
        self.registered[ptr] = nbytes
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        self.calls.append(("unregister", ptr))
        self.mapped_at_unregister.append(mapped(ptr))
        if self.registered.pop(ptr, None) is None:
            self.last_error = 713  # cudaErrorHostMemoryNotRegistered
            return 713
        return 0

    def cudaGetLastError(self) -> int:
        code, self.last_error = self.last_error, 0
        return code

    def count(self, what: str) -> int:
        return sum(1 for c, _ in self.calls if c == what)


def mapped(ptr: int) -> bool:
    for line in Path("/proc/self/maps").read_text().splitlines():
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        if lo <= ptr < hi:
            return True
    return False

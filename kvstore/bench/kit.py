"""Measurement method shared by ``kvstore bench``, its references and its TLS path.

Every buffer is allocated page-aligned and pre-faulted before timing (first touch runs
at ~1 GB/s here, architecture §14); a case's figure is its best (shortest) repetition; GB/s
are 10^9 bytes per second.  Stateless: nothing here outlives a call.
"""

from __future__ import annotations

import mmap
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

KiB, MiB = 1 << 10, 1 << 20
PAGE = 4096


def label(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", KiB)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return f"{n}B"


def gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3) if seconds > 0 else 0.0


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def buffer(nbytes: int, *, pattern: bool = False) -> np.ndarray:
    """A page-aligned, pre-faulted private buffer (O_DIRECT-capable; never first-touched in a timed loop)."""
    mm = mmap.mmap(-1, max(nbytes, PAGE), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    arr = np.frombuffer(mm, dtype=np.uint8)[:nbytes]
    if not pattern:
        arr.fill(1)
        return arr
    tile = np.random.default_rng(0).integers(0, 256, size=min(nbytes, MiB), dtype=np.uint8)
    for off in range(0, nbytes, tile.size):
        n = min(tile.size, nbytes - off)
        arr[off : off + n] = tile[:n]
    stamps = np.arange(0, nbytes // 8, 4096, dtype=np.uint64)  # distinct blocks of any size >= 32 KiB
    arr[: nbytes // 8 * 8].view(np.uint64)[stamps] = stamps
    return arr


def blocks(arr: np.ndarray, size: int) -> list[np.ndarray]:
    return [arr[i * size : (i + 1) * size] for i in range(arr.size // size)]


def batched(items: Sequence[Any], n: int) -> Iterator[Sequence[Any]]:
    for i in range(0, len(items), n):
        yield items[i : i + n]


class Best:
    """Best (shortest) time of repeated runs of one case."""

    def __init__(self) -> None:
        self.seconds = float("inf")

    def add(self, seconds: float) -> None:
        self.seconds = min(self.seconds, seconds)

    def gbps(self, nbytes: int) -> float | None:
        return gbps(nbytes, self.seconds) if self.seconds != float("inf") else None


def each(fn: Callable[..., Any], *columns: Iterable[Any]) -> None:
    """``fn(*row)`` for each row of ``columns`` (zipped), results dropped: a timed loop."""
    for row in zip(*columns):
        fn(*row)


def timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)

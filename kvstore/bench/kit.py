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


# -- what every subcommand shares: targets, size arguments, the report ------------------------
REF_SIZE = 4 * MiB  # ratios and targets are stated at 4 MiB (architecture §15)
TARGETS = {  # architecture §15, as ratios against references measured in the same run
    "dram_get_vs_memcpy": 0.8,
    "nvme_read_vs_direct_io": 0.8,
    "local_get_vs_memcpy": 0.8,
    "local_put_vs_memcpy": 0.7,
    "tcp_get_vs_socket": 0.5,
    "tcp_get_vs_redis": 2.0,
}


def sizes_arg(value: str) -> list[int]:
    """An argparse type: comma-separated positive sizes (``256KiB,4MiB``)."""
    import argparse

    from kvstore.errors import InvalidArgument
    from kvstore.node.config import parse_size

    try:
        out = [parse_size(v) for v in value.split(",") if v.strip()]
    except InvalidArgument as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if any(s <= 0 for s in out):
        raise argparse.ArgumentTypeError("sizes must be positive")
    return out


def size_arg(value: str) -> int:
    """An argparse type: one positive size."""
    import argparse

    (s,) = sizes_arg(value) or [0]
    if s <= 0:
        raise argparse.ArgumentTypeError(f"not a positive size: {value!r}")
    return s


def split_targets(targets: str) -> tuple[str | None, str | None]:
    """``unix:///sock,host:port`` → (the Unix target, the TCP target), either may be None."""
    unix = tcp = None
    for t in (x.strip() for x in targets.split(",") if x.strip()):
        if t.startswith("unix:"):
            unix = t
        else:
            tcp = t
    return unix, tcp


def print_targets(r: dict[str, Any], f: Any) -> None:
    """One line per target of ``r["targets"]``: the figure got and met / MISSED / n/a."""
    ratios = r.get("ratios", r)
    for k, t in r["targets"].items():
        v = ratios.get(k)
        verdict = "n/a" if v is None else ("met" if r["targets_met"][k] else "MISSED")
        op = "<=" if k.endswith("_us") else ">="  # latencies are upper bounds
        print(f"target {k:<24} {op} {t:<4} got {'-' if v is None else f'{v:.2f}':>5}  {verdict}", file=f)


def add_report_arguments(p: Any, *, quick: str, rep: str | None = None) -> None:
    """``--json``, ``--quick`` (``quick``: what it makes small) and, given ``rep`` (what one
    repetition times), ``--repeat``: the flags the measuring subcommands share."""
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout (the table goes to stderr)")
    p.add_argument("--quick", action="store_true", help=f"small and fast: {quick}")
    if rep is not None:
        p.add_argument(
            "--repeat", type=int, default=None, metavar="N", help=f"{rep}; the best counts (default 5; --quick 2)"
        )


def repeats(a: Any) -> int:
    """``--repeat``, defaulted by ``--quick`` (2, else 5); InvalidArgument below 1."""
    from kvstore.errors import InvalidArgument

    a.repeat = a.repeat or (2 if a.quick else 5)
    if a.repeat < 1:
        raise InvalidArgument("--repeat must be at least 1")
    return int(a.repeat)


def report(result: dict[str, Any], *, json_out: bool, load_before: float, table: Callable[[Any], None]) -> int:
    """Print a benchmark's result: ``table(file)`` (to stderr under ``--json``), how busy the
    machine was (other processes skew every number), then with ``json_out`` exactly one
    JSON object on stdout."""
    import json
    import os

    result["load_avg_1m"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    result["cpus"] = os.cpu_count()
    f = sys.stderr if json_out else sys.stdout
    table(f)
    print(
        f"load average (1 min) before/after: {load_before:.2f}/{result['load_avg_1m'][1]:.2f} on {result['cpus']} CPUs"
        " (anything else running skews every number)",
        file=f,
        flush=True,
    )
    if json_out:
        print(json.dumps(result, sort_keys=True), flush=True)
    return 0

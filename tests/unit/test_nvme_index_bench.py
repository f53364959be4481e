"""lmdb vs rocksdict for the NVMe tier's index job: 16-byte keys -> 64-byte values.

``python tests/unit/test_nvme_index_bench.py [N]`` prints the figures for N entries
(default 100,000); the test only checks that the measurement runs.  The tier uses
lmdb: it reads the index only at start-up (a full scan) and writes it in batches (one
transaction per ``write_many``), and lmdb needs no background compaction threads.
"""

from __future__ import annotations

import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import lmdb
import pytest


def _rate(n: int, fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return n / (time.perf_counter() - t0)


def measure_index_backends(n: int = 100_000, *, batch: int = 256, durable: bool = False) -> dict[str, dict[str, float]]:
    """Operations per second for batched puts, random gets and a full scan, per backend.

    ``durable``: fsync every batch (lmdb ``sync=True``; rocksdict WAL with ``sync``).
    """
    rng = random.Random(0)
    keys = [rng.randbytes(16) for _ in range(n)]
    value = rng.randbytes(64)
    batches = [keys[i : i + batch] for i in range(0, n, batch)]
    shuffled = keys[:]
    rng.shuffle(shuffled)
    out: dict[str, dict[str, float]] = {}
    root = Path(tempfile.mkdtemp(prefix="nvme-index-bench-", dir=Path.cwd()))  # a real disk, not /tmp
    try:
        env = lmdb.open(str(root / "lmdb"), map_size=1 << 30, sync=durable, metasync=durable, readahead=False)

        def lmdb_puts() -> None:
            for b in batches:
                with env.begin(write=True) as txn:
                    for k in b:
                        txn.put(k, value)

        def lmdb_gets() -> None:
            with env.begin() as txn:
                for k in shuffled:
                    assert txn.get(k) is not None

        def lmdb_scan() -> None:
            with env.begin() as txn:
                assert sum(1 for _ in txn.cursor()) == n

        out["lmdb"] = {"put": _rate(n, lmdb_puts), "get": _rate(n, lmdb_gets), "scan": _rate(n, lmdb_scan)}
        env.close()

        from rocksdict import Options, Rdict, WriteBatch, WriteOptions

        db = Rdict(str(root / "rocks"), options=Options(raw_mode=True))
        wopt = WriteOptions()
        wopt.sync = durable

        def rocks_puts() -> None:
            for b in batches:
                wb = WriteBatch(raw_mode=True)
                for k in b:
                    wb.put(k, value)
                db.write(wb, wopt)

        def rocks_gets() -> None:
            for k in shuffled:
                assert db.get(k) is not None

        def rocks_scan() -> None:
            assert sum(1 for _ in db.items()) == n

        out["rocksdict"] = {"put": _rate(n, rocks_puts), "get": _rate(n, rocks_gets), "scan": _rate(n, rocks_scan)}
        db.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


def test_index_bench_runs() -> None:
    pytest.importorskip("rocksdict")
    r = measure_index_backends(2000, batch=64)
    assert set(r) == {"lmdb", "rocksdict"} and all(v > 0 for d in r.values() for v in d.values())


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
    for durable in (False, True):
        for backend, rates in measure_index_backends(n, durable=durable).items():
            figures = ", ".join(f"{op} {rate:,.0f}/s" for op, rate in rates.items())
            print(f"{'durable' if durable else 'no-sync'} {backend:9s} {figures}")

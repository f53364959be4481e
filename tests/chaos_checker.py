"""The client side of the chaos test (tests/fault/test_chaos.py): the workload, the load
threads and the checker that holds every answer against what was acknowledged.

Keys are chains of chunk keys, and each key has exactly one payload, derived from the key
alone (``tests/fault/_client_worker.py``), as a content-addressed KV cache has: so any
hit can be checked byte for byte, whoever wrote it and whenever.  A read may miss; a hit
with other bytes is *wrong bytes*, the one thing that must never happen.

Owner: one :class:`Ledger` per run, shared by the load threads (each with its own cluster
client and seeded RNG) and the fault driver, under the ledger's one lock (the
:class:`Workload` is not changed once the load begins).  The ledger records

* every put that acknowledged a block (its key and the put's start and end times),
* the windows during which a node's disk was full (the driver opens and closes them),
* the keys whose on-disk record the driver corrupted.

Durability (``durable_keys``): nodes run with ``--write-through``, so a put acknowledged
outside any full-disk window had its block on disk (payload and index entry) on at least
one owner before it answered.  Such a block must survive any number of kill -9s; only the
records the driver damaged may go (their keys are left out), and NVMe never evicts because
the whole working set fits in one node's NVMe tier (``Workload.nvme_bytes``).  A put that
overlapped a full disk may have been acknowledged from DRAM alone (README: Durability), so
it is not counted as durable.
"""

from __future__ import annotations

import importlib.util
import random
import threading
import time
import traceback
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.errors import KVStoreError
from tiers.nvme_format import record_bytes

_WORKER = Path(__file__).resolve().parent / "fault" / "_client_worker.py"
_spec = importlib.util.spec_from_file_location("_client_worker", _WORKER)
assert _spec is not None and _spec.loader is not None
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)

KIB = 1 << 10
FULL_DISK_MARGIN_S = 1.0  # a put that ended this soon after a full disk was freed still counts as overlapping it


class Workload:
    """``n_chains`` chains of ``chain_len`` keys, blocks of 1 to 48 KiB (key-derived).

    The chains in play grow with time (the *frontier*: all of them ``seconds`` after
    :meth:`begin`), so new blocks keep arriving all through the run while the working set
    stays bounded.  Half the picks go to the newest tenth of the chains in play (mostly new
    keys for a put); reads also ask for two chains past the frontier (misses)."""

    MAX_SIZE = 48 * KIB

    def __init__(self, n_chains: int, chain_len: int, *, salt: bytes) -> None:
        self.chains = [worker.chain_keys(c, chain_len, salt=salt) for c in range(n_chains)]
        self.t0, self.seconds = time.monotonic(), 1.0

    def begin(self, seconds: float) -> None:
        """Start the frontier now; every chain is in play after ``seconds``."""
        self.t0, self.seconds = time.monotonic(), seconds

    def frontier(self) -> int:
        n = len(self.chains)
        return min(n, 1 + int(n * (time.monotonic() - self.t0) / self.seconds))

    @classmethod
    def size_of(cls, key: bytes) -> int:
        return KIB + int.from_bytes(key[8:11], "little") % (cls.MAX_SIZE - KIB)

    def payload(self, key: bytes) -> np.ndarray:
        return worker.payload(key, self.size_of(key))

    def nvme_bytes(self) -> int:
        """What every block of the workload takes on one node's NVMe tier."""
        return sum(record_bytes(self.size_of(k)) for ch in self.chains for k in ch)

    def pick(self, rng: random.Random, *, put: bool) -> list[bytes]:
        """A chain prefix to put (a chain in play) or to read (in play or just past it)."""
        top = self.frontier() if put else min(len(self.chains), self.frontier() + 2)
        c = top - 1 - rng.randrange(max(1, top // 10)) if rng.random() < 0.5 else rng.randrange(top)
        chain = self.chains[c]
        return chain[: rng.randint(1, len(chain))]


class Ledger:
    """What was acknowledged, and every read checked against it (see the module docstring)."""

    def __init__(self, workload: Workload) -> None:
        self.workload = workload
        self._lock = threading.Lock()
        self.c: Counter[str] = Counter()
        self.acks: dict[bytes, list[tuple[float, float]]] = {}
        self.full_disk: list[list[float]] = []  # [start, end]; end is +inf while the disk is full
        self.corrupted: set[bytes] = set()
        self.wrong: list[str] = []  # "where: key" of every hit with wrong bytes
        self.errors: list[str] = []  # exceptions a call raised that are not a KVStoreError (there must be none)

    # -- the driver's side --------------------------------------------------------------
    def disk_full(self, full: bool) -> None:
        with self._lock:
            if full:
                self.full_disk.append([time.monotonic(), float("inf")])
            elif self.full_disk and self.full_disk[-1][1] == float("inf"):
                self.full_disk[-1][1] = time.monotonic()

    def corrupt(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            self.corrupted.update(keys)

    # -- the clients' side --------------------------------------------------------------
    def acked(self, keys: Sequence[bytes], stored: Sequence[bool], t0: float, t1: float) -> None:
        with self._lock:
            for k, ok in zip(keys, stored):
                if ok:
                    self.acks.setdefault(k, []).append((t0, t1))
            self.c["blocks_acked"] += sum(stored)
            self.c["blocks_refused"] += len(stored) - sum(stored)

    def check(self, where: str, keys: Sequence[bytes], got: Sequence[Any]) -> None:
        """Hold each answer (bytes, a filled buffer, or None for a miss) against its key's payload."""
        bad, hits = [], 0
        for k, g in zip(keys, got):
            if g is None:
                continue
            hits += 1
            exp = self.workload.payload(k)
            mv = memoryview(g).cast("B")
            if mv.nbytes != exp.nbytes or mv != memoryview(exp):
                bad.append(f"{where}: {k.hex()} ({mv.nbytes} bytes, expected {exp.nbytes})")
        with self._lock:
            self.c["reads"] += len(keys)
            self.c["hits"] += hits
            self.c["misses"] += len(keys) - hits
            self.c["misses_of_acked"] += sum(g is None and k in self.acks for k, g in zip(keys, got))
            self.wrong += bad

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.c[name] += n

    def done(self, op: str, seconds: float, unexpected: str | None = None) -> None:
        """One operation ended (``unexpected``: the traceback of an exception no call may raise)."""
        with self._lock:
            self.c["ops"] += 1
            self.c[f"ops_{op}"] += 1
            self.c["max_op_ms"] = max(self.c["max_op_ms"], int(seconds * 1000))
            if unexpected is not None:
                self.errors.append(f"{op}: {unexpected}")

    # -- the verdict ----------------------------------------------------------------------
    def durable_keys(self) -> list[bytes]:
        """Keys acknowledged by a put that overlapped no full disk, and not corrupted by the driver."""
        with self._lock:
            windows = [(a, b + FULL_DISK_MARGIN_S) for a, b in self.full_disk]
            return [
                k
                for k, puts in self.acks.items()
                if k not in self.corrupted and any(all(t1 < a or t0 > b for a, b in windows) for t0, t1 in puts)
            ]


def load(kv: Any, ledger: Ledger, seed: int, stop: threading.Event) -> None:
    """One client's mixed load until ``stop``: puts of chain prefixes, batched gets (into
    bytes and into buffers) and ``match_prefix`` followed by a read of the matched prefix."""
    rng = random.Random(seed)
    wl = ledger.workload
    outs = [np.empty(wl.MAX_SIZE, dtype=np.uint8) for _ in range(max(map(len, wl.chains)))]
    while not stop.is_set():
        op = rng.choices(("put", "get", "get_into", "match"), weights=(4, 3, 1, 2))[0]
        keys = wl.pick(rng, put=op == "put")
        t0, unexpected = time.monotonic(), None
        try:
            if op == "put":
                stored = kv.put_many(
                    keys, [wl.payload(k) for k in keys], namespace=worker.NAMESPACE, parents=worker.parents_of(keys)
                )
                ledger.acked(keys, stored, t0, time.monotonic())
            elif op == "get":
                ledger.check("get_many", keys, kv.get_many(keys))
            elif op == "get_into":
                sizes = kv.get_many_into(keys, outs[: len(keys)])
                ledger.check("get_many_into", keys, [None if n is None else outs[i][:n] for i, n in enumerate(sizes)])
            else:
                n = kv.match_prefix(keys)
                ledger.count("matched_blocks", n)
                if n:
                    ledger.check("match_prefix+get", keys[:n], kv.get_many(keys[:n]))
        except KVStoreError as e:  # e.g. a put while no owner answers: a typed error, counted
            ledger.count(f"errors_{op}_{type(e).__name__}")
        except Exception:
            unexpected = traceback.format_exc()
        ledger.done(op, time.monotonic() - t0, unexpected)
        if unexpected is not None:
            time.sleep(0.05)

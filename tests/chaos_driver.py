"""The fault side of the chaos test (tests/fault/test_chaos.py): a seeded fault schedule and
the driver that plays it against a real cluster (tests/netns_cluster.py).

``schedule(seed, ...)`` is a pure function: the same seed gives the same faults, in the
same order, on the same nodes, with the same hold times (when they happen in wall time
depends on how fast the machine is; their order does not).  Fault kinds:

* ``kill``: SIGKILL a node, restart it (same id, same data directory) after the hold;
* ``etcd``: stop etcd, start it again with its data after the hold;
* ``partition``: cut a node off from its clients, from etcd, or both (packets dropped,
  tests/netns.py), heal after the hold;
* ``disk_full``: fill the filesystem of the one node whose data directory is a small
  tmpfs, free it after the hold;
* ``corrupt``: flip one payload byte in a few records of a node's segment files (at once).

Faults of one *lane* never overlap: ``node`` (kill, partition: at most one node is down or
cut off at a time, so with R = 2 one owner of every block stays reachable), ``etcd`` and
``disk``; faults of different lanes do.  The first faults are one of each kind, so every
kind is exercised whatever the seed.

Owner: the :class:`Driver` runs in the test's thread and owns every fault it injects; it
reports full-disk windows and corrupted keys to the :class:`chaos_checker.Ledger`, and
:meth:`Driver.repair` undoes whatever is still in place (also after an error), so the
cluster ends whole.  Every step is bounded (node start, etcd start, ``ip``); an injection
that fails is recorded in ``errors``, never retried forever.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import random
import time
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from chaos_checker import Ledger
from netns_cluster import NetCluster
from small_disk import fill

from kvstore.block import HEADER_SIZE, MAGIC, decode_header
from kvstore.errors import BlockFormatError
from tiers.nvme_format import PAGE

KINDS = ("kill", "etcd", "partition", "disk_full", "corrupt")
LANE = {"kill": "node", "partition": "node", "etcd": "etcd", "disk_full": "disk", "corrupt": None}
WEIGHTS = (5, 2, 3, 2, 1)
HOLD_S = {
    "kill": (0.5, 5.0),
    "etcd": (1.0, 6.0),
    "partition": (2.0, 6.0),
    "disk_full": (3.0, 8.0),
    "corrupt": (0.0, 0.0),
}
PARTITIONS = ("both", "clients", "etcd")
CORRUPT_RECORDS = 3  # records damaged per corrupt fault (some may be stale copies nobody reads)
FILLER = "chaos.filler"


@dataclasses.dataclass(frozen=True)
class Fault:
    at: float  # seconds after the chaos starts
    kind: str
    node: str  # "" for etcd
    hold: float  # seconds until it is undone (0: instantaneous)
    detail: str = ""  # partition: which paths are cut

    def __str__(self) -> str:
        what = "/".join(x for x in (self.kind, self.node, self.detail) if x)
        return f"{self.at:5.1f}s {what}" + (f" for {self.hold:.1f}s" if self.hold else "")


def schedule(seed: int, seconds: float, nodes: tuple[str, ...], disk_node: str) -> list[Fault]:
    """The faults of one run, by start time: a pure function of its arguments."""
    rng = random.Random(seed)
    free = {"node": 0.0, "etcd": 0.0, "disk": 0.0}  # when each lane is free again
    forced = list(KINDS)  # one of each kind first, whatever the seed
    rng.shuffle(forced)
    out: list[Fault] = []
    t = 2.0
    while True:
        kind = forced.pop(0) if forced else rng.choices(KINDS, WEIGHTS)[0]
        lane = LANE[kind]
        if len(out) >= len(KINDS) and lane is not None and free[lane] > t:
            t += rng.uniform(0.5, 1.5)  # a drawn kind whose lane is busy: draw again a little later
            continue
        start = max(t, free[lane]) if lane else t
        hold = round(rng.uniform(*HOLD_S[kind]), 1)
        if start + hold > seconds - 2.0:
            break
        node = disk_node if kind == "disk_full" else "" if kind == "etcd" else rng.choice(nodes)
        detail = rng.choice(PARTITIONS) if kind == "partition" else ""
        out.append(Fault(round(start, 1), kind, node, hold, detail))
        if lane:
            free[lane] = start + hold + rng.uniform(0.5, 2.0)  # time to settle before the lane's next fault
        t = start + rng.uniform(1.0, 3.5)
    return sorted(out, key=lambda f: f.at)


def damage_records(data_dir: Path, rng: random.Random, n: int) -> list[bytes]:
    """Flip one payload byte in ``n`` records of the segment files under ``data_dir`` (chosen
    by ``rng`` among the records there); returns their keys."""
    found: list[tuple[Path, int, int, bytes]] = []  # segment, record offset, payload length, key
    for seg in sorted(data_dir.glob("nvme/seg-*.dat")):
        with open(seg, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < PAGE:
                continue
            with mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:
                for off in range(0, size - PAGE + 1, PAGE):
                    if m[off : off + 4] != MAGIC:
                        continue
                    try:
                        meta = decode_header(m[off : off + HEADER_SIZE])
                    except BlockFormatError:
                        continue
                    if meta.payload_len and off + PAGE + meta.payload_len <= size:
                        found.append((seg, off, meta.payload_len, bytes(meta.key)))
    keys = []
    for seg, off, length, key in rng.sample(found, min(n, len(found))):
        at = off + PAGE + rng.randrange(length)
        fd = os.open(seg, os.O_RDWR)
        try:
            os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0x5A]), at)
        finally:
            os.close(fd)
        keys.append(key)
    return keys


class Driver:
    """Plays a schedule against ``cluster``; ``disk_dir`` is ``disk_node``'s data directory (a small tmpfs)."""

    def __init__(
        self, cluster: NetCluster, ledger: Ledger, *, seed: int, node_args: tuple[str, ...], disk_dir: Path
    ) -> None:
        self.cluster = cluster
        self.ledger = ledger
        self.node_args = node_args
        self.disk_dir = disk_dir
        self.rng = random.Random(seed ^ 0x5EED)  # which records a corrupt fault damages
        self.injected: Counter[str] = Counter()
        self.errors: list[str] = []
        self.log: list[str] = []  # every step, with the seconds it took

    def _step(self, what: str, fn: Callable[[], object]) -> None:
        t = time.monotonic()
        try:
            fn()
        except Exception:
            self.errors.append(f"{what}: {traceback.format_exc()}")
        self.log.append(f"{what} ({time.monotonic() - t:.1f}s)")

    def _inject(self, f: Fault) -> None:
        c = self.cluster
        if f.kind == "kill":
            c.nodes[f.node].kill9()
        elif f.kind == "etcd":
            c.etcd.stop()
        elif f.kind == "partition":
            c.net.cut(f.node, clients=f.detail != "etcd", etcd=f.detail != "clients")
        elif f.kind == "disk_full":
            self.ledger.disk_full(True)  # before the first byte: a put from now on may meet a full disk
            fill(self.disk_dir / FILLER)
        elif f.kind == "corrupt":
            keys = damage_records(c.tmp / f.node, self.rng, CORRUPT_RECORDS)
            self.ledger.corrupt(keys)
            self.injected["corrupted_records"] += len(keys)
        self.injected[f.kind] += 1

    def _undo(self, f: Fault) -> None:
        if f.kind == "kill":
            self.cluster.start(f.node, extra=self.node_args)  # same id, same data directory
        elif f.kind == "etcd":
            self.cluster.etcd.start(timeout=30)
        elif f.kind == "partition":
            self.cluster.net.heal(f.node)
        elif f.kind == "disk_full":
            (self.disk_dir / FILLER).unlink(missing_ok=True)
            self.ledger.disk_full(False)

    def run(self, faults: list[Fault], deadline: float) -> None:
        """Inject and undo ``faults`` in schedule order (late steps run at once, never
        skipped, so the order is the seed's); stop injecting at ``deadline`` (monotonic)."""
        steps = sorted(
            [(f.at, 0, i, f) for i, f in enumerate(faults)]
            + [(f.at + f.hold, 1, i, f) for i, f in enumerate(faults) if f.hold],
            key=lambda s: s[:3],
        )
        t0 = time.monotonic()
        injected: set[int] = set()
        for at, undo, i, f in steps:
            time.sleep(max(0.0, min(t0 + at, deadline) - time.monotonic()))
            if undo:
                if i in injected:
                    self._step(f"undo {f}", lambda f=f: self._undo(f))
            elif time.monotonic() < deadline:
                injected.add(i)
                self._step(f"inject {f}", lambda f=f: self._inject(f))

    def repair(self) -> None:
        """Undo whatever is still in place: heal, etcd up, disk freed, every node running."""
        self._step("repair: heal", self.cluster.net.heal_all)
        if not self.cluster.etcd.running():
            self._step("repair: etcd", lambda: self.cluster.etcd.start(timeout=30))
        if (self.disk_dir / FILLER).exists():
            self._step("repair: disk", lambda: self._undo(Fault(0, "disk_full", "", 0)))
        for node, p in list(self.cluster.nodes.items()):
            if p.proc is None or p.proc.poll() is not None:
                self._step(f"repair: start {node}", lambda node=node: self.cluster.start(node, extra=self.node_args))

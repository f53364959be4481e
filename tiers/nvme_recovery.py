"""Recovering the NVMe tier's index: check it before lmdb maps it, rebuild it from the segments.

Role: what :class:`tiers.nvme.NVMeTier` does at open when ``index.lmdb`` cannot be trusted.
lmdb maps its file and trusts its pages: a truncated file faults the process (SIGBUS) on
first touch, zeroed or foreign pages raise ``CorruptedError``/``InvalidError`` or worse.
So the index is first checked where a fault cannot hurt (:func:`index_damage`: its meta
pages here, a full read-only walk in a child process); a damaged one is moved aside
(:func:`move_aside`) and the entries are found again by scanning the segment files for
self-describing records (:func:`scan_segment`), every one verified end to end.

Owner: no state.  Called while :class:`tiers.nvme.NVMeTier` opens and holds the data
directory's lock, before anything else touches the index or the segments: the check by
``tiers/nvme_index.py`` (``LmdbIndex``), the scan by ``tiers/nvme_segments.py`` (``Segments.scan``).

Invariants:

* A damaged index is never opened by this process and never deleted: the latest damaged
  copy stays beside the new one as ``index.lmdb.damaged`` for a post-mortem.
* A scan yields a record only if its header checksum, its payload checksum and its
  bounds (inside its segment) verify; anything else that starts with the block magic is
  counted as dropped.  Verified records never overlap: a record is whole only if no later
  record overwrote any of its pages.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import xxhash

from kvstore.block import HEADER_SIZE, MAGIC, BlockMeta, decode_header
from kvstore.errors import BlockFormatError
from tiers.nvme_format import PAGE, io_all, record_bytes

log = logging.getLogger(__name__)

DAMAGED_SUFFIX = ".damaged"
PROBE_TIMEOUT_S = 300.0
# LMDB's meta pages (pages 0 and 1; 64-bit builds): page header, then MDB_meta
_LMDB_MAGIC = 0xBEEFC0DE
_META = struct.Struct("<16xII8xQ I44x 48x QQ")  # magic, version, mapsize, FREE_DBI md_pad (page size), last_pg, txnid
_PROBE = """
import sys, lmdb
env = lmdb.open(sys.argv[1], readonly=True, lock=False, max_dbs=2, readahead=False)
with env.begin() as txn:
    for name in (b"blocks", b"config"):
        db = env.open_db(name, txn=txn, create=False)
        for _ in txn.cursor(db=db):
            pass
"""


def _meta_damage(data: Path) -> str | None:
    """What is wrong with ``data.mdb``'s meta pages or size, read without mapping it; None if nothing."""
    size = data.stat().st_size
    with open(data, "rb") as f:
        first = f.read(_META.size)
        if len(first) < _META.size:
            return f"{data} has {size} bytes: too short for an lmdb file"
        magic, version, _, psize, _, _ = _META.unpack(first)
        if magic != _LMDB_MAGIC or not 512 <= psize <= 1 << 16 or psize & (psize - 1):
            return f"{data} does not start with an lmdb meta page"
        f.seek(psize)
        second = f.read(_META.size)
    metas = [_META.unpack(first)] + ([_META.unpack(second)] if len(second) == _META.size else [])
    if len(metas) < 2 or any(m[0] != _LMDB_MAGIC or m[1] != version for m in metas):
        return f"{data}: the second lmdb meta page is missing or damaged"
    last_pg = max(metas, key=lambda m: m[5])[4]  # the newest transaction's
    if (last_pg + 1) * psize > size:
        return f"{data} is truncated: its last transaction uses {(last_pg + 1) * psize} bytes, the file has {size}"
    return None


def index_damage(index_dir: Path) -> str | None:
    """Why the lmdb environment in ``index_dir`` cannot be trusted, or None if it reads whole.

    Missing, truncated or foreign files are found from their size and meta pages; anything
    subtler by reading every entry in a child process, where a fault only kills the child."""
    data = index_dir / "data.mdb"
    if not data.exists():
        return f"{data} is missing"
    reason = _meta_damage(data)
    if reason is not None:
        return reason
    try:
        r = subprocess.run(
            [sys.executable, "-c", _PROBE, str(index_dir)], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return f"reading {index_dir} did not finish within {PROBE_TIMEOUT_S:.0f} s"
    except OSError as e:  # no child process to be had: trust the meta pages alone
        log.warning("cannot check %s in a child process (%s); opening it unchecked", index_dir, e)
        return None
    if r.returncode == 0:
        return None
    if r.returncode < 0:
        return f"reading {index_dir} killed the reader with {signal.Signals(-r.returncode).name}"
    lines = r.stderr.strip().splitlines()
    return f"reading {index_dir} failed: {lines[-1] if lines else f'exit status {r.returncode}'}"


def move_aside(index_dir: Path) -> Path | None:
    """Rename a damaged ``index_dir`` to ``<name>.damaged`` (replacing an older one); its new path."""
    if not index_dir.exists():
        return None
    dest = index_dir.with_name(index_dir.name + DAMAGED_SUFFIX)
    if dest.is_dir():
        shutil.rmtree(dest)
    else:
        dest.unlink(missing_ok=True)
    index_dir.rename(dest)
    return dest


@dataclasses.dataclass(frozen=True, slots=True)
class Found:
    """A verified record: its block's meta, where it starts in its segment, its length."""

    meta: BlockMeta
    offset: int
    length: int


@dataclasses.dataclass(slots=True)
class Rebuild:
    """What one rebuild found: ``recovered`` blocks indexed again, ``dropped`` records that
    failed verification (damaged, torn, or partly overwritten after a delete), ``duplicates``
    (second whole copies of a key, not indexed), the bytes scanned and the time it took."""

    reason: str = ""
    recovered: int = 0
    dropped: int = 0
    duplicates: int = 0
    scanned_bytes: int = 0
    seconds: float = 0.0
    started: float = dataclasses.field(default_factory=time.monotonic)

    @staticmethod
    def counts(r: Rebuild | None) -> dict[str, int]:
        """``index_rebuilds`` (0 or 1), ``recovered_blocks``, ``dropped_records`` of ``r`` (None: no rebuild)."""
        return {
            "index_rebuilds": int(r is not None),
            "recovered_blocks": r.recovered if r else 0,
            "dropped_records": r.dropped if r else 0,
        }


Reader = Callable[[int, memoryview], None]
"""``read(offset, buf)``: fill ``buf`` from the segment at ``offset`` (page-aligned both), or raise."""


def scan_segment(read: Reader, size: int, stage: memoryview, report: Rebuild) -> Iterator[Found]:
    """Yield every verified record of a ``size``-byte segment, in offset order.

    Reads go through ``stage`` (page-aligned, a multiple of ``PAGE``): the segment is read
    once in order, plus once more for records longer than ``stage``.  A page that does not
    start with the block magic is skipped; one that does but fails verification is counted
    in ``report.dropped`` and the scan goes on at the next page (an older record may lie
    under a torn one)."""
    window_at, window_len = -1, 0

    def window(pos: int) -> memoryview:  # the stage holding ``pos``, read on demand
        nonlocal window_at, window_len
        if not window_at <= pos < window_at + window_len:
            window_at, window_len = pos, min(stage.nbytes, size - pos)
            read(pos, stage[:window_len])
            report.scanned_bytes += window_len
        return stage[pos - window_at : window_len]

    pos = 0
    while pos + PAGE <= size:
        page = window(pos)
        if page[:4] != MAGIC:
            pos += PAGE
            continue
        try:
            meta = decode_header(page[:HEADER_SIZE])
        except BlockFormatError:
            report.dropped += 1
            pos += PAGE
            continue
        length = record_bytes(meta.payload_len)
        if pos + length > size or not _payload_verifies(meta, pos + PAGE, window):
            report.dropped += 1
            pos += PAGE
            continue
        yield Found(meta, pos, length)
        pos += length


def _read_at(fd: int, off: int, buf: memoryview) -> None:
    """Fill ``buf`` from ``fd`` at ``off`` (a :data:`Reader` once ``fd`` is bound)."""
    io_all(os.preadv, fd, [buf], off)


def scan_segments(
    segments: Sequence[tuple[int, int, int]], stage: memoryview, report: Rebuild
) -> list[tuple[int, Found]]:
    """Every verified record of ``segments`` (``(number, fd, size)``), one per key: a second
    whole copy of a key (rewritten after a delete) is counted in ``report.duplicates``."""
    found: dict[bytes, tuple[int, Found]] = {}
    for seg, fd, size in segments:
        for rec in scan_segment(functools.partial(_read_at, fd), size, stage, report):
            if rec.meta.key in found:
                report.duplicates += 1
            else:
                found[rec.meta.key] = (seg, rec)
    return list(found.values())


def _payload_verifies(meta: BlockMeta, at: int, window: Callable[[int], memoryview]) -> bool:
    h = xxhash.xxh3_64()
    left = meta.payload_len
    while left:
        part = window(at)[:left]
        h.update(part)
        at += part.nbytes
        left -= part.nbytes
    return h.intdigest() == meta.payload_checksum


def segment_bytes_on_disk(directory: Path, seg_name: Callable[[int], str]) -> int | None:
    """The segment size an index-less directory was laid out with: the first segment's size
    (every segment but the last has it; a single one is the whole capacity), if it has one."""
    first = directory / seg_name(0)
    size = first.stat().st_size if first.exists() else 0
    return size // PAGE * PAGE or None


def finish(report: Rebuild, directory: Path) -> Rebuild:
    report.seconds = time.monotonic() - report.started
    log.warning(
        "rebuilt the NVMe index of %s from its segments (%s): %d blocks recovered, %d damaged records dropped, "
        "%d duplicate copies ignored, %.1f MiB scanned in %.2f s",
        directory,
        report.reason,
        report.recovered,
        report.dropped,
        report.duplicates,
        report.scanned_bytes / (1 << 20),
        report.seconds,
    )
    return report


__all__ = [
    "DAMAGED_SUFFIX",
    "Found",
    "Rebuild",
    "finish",
    "index_damage",
    "move_aside",
    "scan_segment",
    "scan_segments",
    "segment_bytes_on_disk",
]

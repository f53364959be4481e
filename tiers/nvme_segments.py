"""The NVMe tier's segment files: their layout, opening and preallocation, and the record I/O
(O_DIRECT through aligned staging buffers, or buffered).

Role: the data half of :class:`tiers.nvme.NVMeTier`.  The tier decides *where* a record goes
(its allocator hands out extents of the :class:`Layout`'s linear space) and *when* it may be
read or overwritten (its index and reader counts); this module moves the bytes of one
record at a place it is given and checks what it reads back.  The record format itself is
``tiers/nvme_format.py``.

Owner: the :class:`Segments` instance owns the segment file descriptors, the set of
preallocated segments and the pool of staging buffers.  The pool has its own lock, taken
for a list operation only; nothing else here is locked: segment file descriptors are
opened before the tier serves and closed after it drained, and ``preallocate`` is
idempotent, so executor threads call ``write_record``/``read_record`` concurrently.

Invariants:

* Every buffer handed to an O_DIRECT ``preadv``/``pwritev`` is page-aligned and a whole
  number of pages: a staging buffer (``mmap``), or the whole pages of a page-aligned
  caller buffer.
* A record read back is returned only once its header matches the meta the index holds
  and its payload checksum verifies (``CorruptBlock`` otherwise): bad bytes never leave.
* Records never straddle segments: the :class:`Layout`'s linear space keeps one reserved
  page after every segment but the last (:meth:`Layout.allocator` reserves them).
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import mmap
import os
import threading
from pathlib import Path

from kvstore.block import HEADER_SIZE, BlockMeta, decode_header, encode_header, verify_payload
from kvstore.errors import CapacityExceeded, CorruptBlock, InvalidArgument
from tiers import failpoints
from tiers.allocator import Extent, ExtentAllocator
from tiers.nvme_format import PAGE, addr, close_stage, io_all, probe_direct_io, segment_name
from tiers.nvme_recovery import Found, Rebuild, scan_segments

log = logging.getLogger("tiers.nvme")  # the tier's log, as before the split

STAGE_BYTES = 8 << 20  # staging buffer: the unit of O_DIRECT I/O for unaligned caller buffers
_STAGE_POOL_MAX = 4
_ZEROS = bytes(PAGE)
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
MEDIA_ERRORS = (errno.EIO, errno.ENODATA, errno.EBADMSG)


def choose_direct_io(directory: Path, asked: bool | None) -> bool:
    """Whether the tier in ``directory`` uses O_DIRECT: ``asked`` if given (True only where the
    filesystem takes it), else whatever the filesystem takes."""
    probe = probe_direct_io(directory) if asked is not False else False
    if probe is None:  # a full disk fails open: the node starts and serves what it holds
        log.warning(
            "cannot probe O_DIRECT on %s: the filesystem is full; using %s I/O",
            directory,
            "direct" if asked else "buffered",
        )
    if asked and probe is False:
        raise InvalidArgument(f"the filesystem of {directory} refuses O_DIRECT (tmpfs?); pass direct_io=None or False")
    return bool(probe) if asked is None else asked


@dataclasses.dataclass(frozen=True, slots=True)
class Layout:
    """How ``capacity`` bytes are cut into segment files, and the linear space the tier allocates in.

    Segment ``i`` starts at ``i * stride`` of the linear space; the page after each segment
    but the last is a gap no extent may cover, so a record lies in one segment:
    ``divmod(vaddr, stride)`` is its ``(segment, offset)``."""

    segment_bytes: int
    capacity: int

    @property
    def sizes(self) -> list[int]:
        n = -(-self.capacity // self.segment_bytes)
        return [self.segment_bytes] * (n - 1) + [self.capacity - (n - 1) * self.segment_bytes]

    @property
    def stride(self) -> int:
        return self.segment_bytes + PAGE

    @property
    def gap_bytes(self) -> int:
        """Bytes of the linear space that are gaps (always allocated, never data)."""
        return (len(self.sizes) - 1) * PAGE

    @property
    def max_record(self) -> int:
        """The longest record one segment can hold."""
        return max(self.sizes)

    def allocator(self) -> ExtentAllocator:
        """A fresh allocator over the linear space, with the gaps already taken."""
        sizes = self.sizes
        alloc = ExtentAllocator((len(sizes) - 1) * self.stride + sizes[-1], unit=PAGE)
        for i in range(len(sizes) - 1):
            alloc.reserve_exact(Extent(i * self.stride + self.segment_bytes, PAGE))
        return alloc

    def place(self, vaddr: int) -> tuple[int, int]:
        """``(segment, offset)`` of a linear address."""
        return divmod(vaddr, self.stride)


class Segments:
    """The open segment files of one tier directory and the I/O of records in them.

    Opening keeps every segment that holds data whole (and preallocates it), truncates one
    longer than the layout wants, and removes segments beyond a reduced capacity."""

    def __init__(self, directory: Path, layout: Layout, *, direct_io: bool) -> None:
        self.directory = directory
        self.layout = layout
        self.direct_io = direct_io
        self.in_use: set[int] = set()  # segments that held data when the tier opened
        self._sizes = layout.sizes
        self._fds: list[int] = []
        self._preallocated: set[int] = set()  # segments whose extent is reserved on disk
        self._stages: list[mmap.mmap] = []
        self._stage_lock = threading.Lock()  # guards _stages and _closed
        self._closed = False
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    def path(self, seg: int) -> Path:
        return self.directory / segment_name(seg)

    def _open(self) -> None:
        flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if self.direct_io else 0)
        for i, size in enumerate(self._sizes):
            fd = os.open(self.path(i), flags, 0o600)  # every tenant's KV bytes: the node's alone, like the arena
            self._fds.append(fd)
            st_size = os.fstat(fd).st_size
            if st_size > size:
                os.ftruncate(fd, size)
            if st_size:  # in use before: keep it whole; an untouched one is preallocated on first write
                self.in_use.add(i)
                try:
                    self.preallocate(i)
                except (CapacityExceeded, OSError) as e:  # the next write tries again; a start must not fail on it
                    log.warning("cannot preallocate %s now: %s", self.path(i), e)
        i = len(self._sizes)
        while self.path(i).exists():  # segments beyond a reduced capacity
            self.path(i).unlink()
            i += 1
        dfd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def preallocate(self, seg: int) -> None:
        """Reserve a segment's whole extent on disk, once, before its first record.

        Segments are preallocated lazily so a large, mostly empty tier does not take its
        full capacity from the filesystem at start-up.  Idempotent and thread-safe
        (``posix_fallocate`` of an allocated range is a no-op)."""
        if seg in self._preallocated:
            return
        size = self._sizes[seg]
        try:
            failpoints.hit("nvme.preallocate")
            os.posix_fallocate(self._fds[seg], 0, size)
        except OSError as e:
            if e.errno in DISK_FULL:
                raise CapacityExceeded(
                    f"cannot preallocate {size} bytes for {self.path(seg)}: the filesystem is full; "
                    "lower the NVMe capacity_bytes or free disk space"
                ) from e
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            os.ftruncate(self._fds[seg], size)  # no fallocate here: sparse file; ENOSPC may come on write
        self._preallocated.add(seg)

    def sync(self, segs: set[int]) -> None:
        """``fdatasync`` the given segments (failure point ``nvme.sync``)."""
        for seg in sorted(segs):
            failpoints.hit("nvme.sync")
            os.fdatasync(self._fds[seg])

    def scan(self, report: Rebuild) -> list[tuple[int, Found]]:
        """Every verified record of the segments that held data at open (an index rebuild)."""
        stage = self._acquire_stage()
        try:
            used = [(i, self._fds[i], size) for i, size in enumerate(self._sizes) if i in self.in_use]
            return scan_segments(used, memoryview(stage), report)
        finally:
            self._release_stage(stage)

    # -- staging buffers ------------------------------------------------------------------
    def _acquire_stage(self) -> mmap.mmap:
        with self._stage_lock:
            if self._stages:
                return self._stages.pop()
        return mmap.mmap(-1, STAGE_BYTES)

    def _release_stage(self, stage: mmap.mmap) -> None:
        with self._stage_lock:
            if len(self._stages) < _STAGE_POOL_MAX and not self._closed:
                self._stages.append(stage)
                return
        close_stage(stage)

    # -- one record ---------------------------------------------------------------------
    def read_header(self, seg: int, off: int, key: bytes) -> BlockMeta:
        """The meta in the header of the record at ``(seg, off)``, which must be ``key``'s."""
        hdr = self._acquire_stage()
        try:
            io_all(os.preadv, self._fds[seg], [memoryview(hdr)[:PAGE]], off)
            return decode_header(memoryview(hdr)[:HEADER_SIZE], expect_key=key)
        finally:
            self._release_stage(hdr)

    def write_header_only(self, seg: int, off: int, meta: BlockMeta) -> None:
        """A torn record (failpoint ``nvme.write=short``): its header, and none of its payload."""
        buf = mmap.mmap(-1, PAGE)  # page-aligned, as O_DIRECT wants
        try:
            buf[:HEADER_SIZE] = encode_header(meta)
            io_all(os.pwritev, self._fds[seg], [memoryview(buf)], off)
        finally:
            close_stage(buf)

    def transfer(self, seg: int, off: int, length: int, meta: BlockMeta, mv: memoryview, *, writing: bool) -> None:
        """Write ``meta``'s record of ``length`` bytes at ``(seg, off)`` from ``mv``, or read it
        into ``mv`` and verify it against ``meta`` (raises on doubt)."""
        fd, n = self._fds[seg], mv.nbytes
        op = os.pwritev if writing else os.preadv
        page = encode_header(meta) + _ZEROS[HEADER_SIZE:] if writing else bytearray(PAGE)
        if not self.direct_io:  # buffered: straight from / into the caller's buffer, any alignment
            pad = memoryview(_ZEROS)[: length - PAGE - n] if writing else mv[:0]
            io_all(op, fd, [memoryview(page), mv, pad], off)
            if not writing:
                _check(meta, page, mv)
            return
        stage = self._acquire_stage()
        s = memoryview(stage)
        try:
            if addr(mv) % PAGE == 0:  # aligned caller buffer: its whole pages move without a copy
                full = n // PAGE * PAGE
                tail = n - full
                if writing:
                    s[:PAGE] = page
                    s[PAGE : PAGE + tail] = mv[full:]
                    s[PAGE + tail : 2 * PAGE] = _ZEROS[tail:]
                io_all(op, fd, [s[:PAGE], mv[:full], s[PAGE : 2 * PAGE] if tail else s[:0]], off)
                if not writing:
                    mv[full:] = s[PAGE : PAGE + tail]
                    _check(meta, s[:HEADER_SIZE], mv)
                return
            for pos in range(0, length, STAGE_BYTES):  # otherwise through the staging buffer
                hi = min(pos + STAGE_BYTES, length)
                a, b = max(pos, PAGE), min(hi, PAGE + n)  # the payload's share of this chunk
                if writing:
                    if pos == 0:
                        s[:PAGE] = page
                    if a < b:
                        s[a - pos : b - pos] = mv[a - PAGE : b - PAGE]
                    z = max(pos, PAGE + n)
                    if z < hi:
                        s[z - pos : hi - pos] = _ZEROS[: hi - z]
                io_all(op, fd, [s[: hi - pos]], off + pos)
                if not writing:
                    if pos == 0:  # a bad header fails before the rest is read
                        _check(meta, s[:HEADER_SIZE], None)
                    if a < b:
                        mv[a - PAGE : b - PAGE] = s[a - pos : b - pos]
            if not writing:
                verify_payload(meta, mv)
        finally:
            del s
            self._release_stage(stage)

    def close(self) -> None:
        """Close the segment files and the staging buffers.  Idempotent."""
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        with self._stage_lock:
            self._closed = True
            stages, self._stages = self._stages, []
        for st in stages:
            close_stage(st)


def _check(meta: BlockMeta, hdr: object, payload: memoryview | None) -> None:
    if decode_header(hdr, expect_key=meta.key) != meta:
        raise CorruptBlock(f"header of {meta.key.hex()} disagrees with the index")
    if payload is not None:
        verify_payload(meta, payload)

"""The NVMe tier: block records in preallocated segment files, the index in lmdb.

Role: the node's persistent, largest and slowest tier (DESIGN §3).  Demotions from
DRAM land here; a hit here is promoted back by the tier manager.

On disk, in one directory::

    LOCK            exclusive flock, held for the tier's lifetime (one owner per directory)
    seg-NNNNN.dat   segment files, each preallocated with posix_fallocate before its first record
    index.lmdb/     key (16 bytes) -> location (segment, offset, record length, seq, checksum)
    index.lmdb.damaged/   the last index found damaged at open, kept for a post-mortem

A record is the 160-byte block header (``kvstore.block``) padded to one 4 KiB page,
then the payload padded to 4 KiB (``tiers/nvme_format.py``).  Records are written with O_DIRECT where the
filesystem takes it (aligned ``mmap`` staging buffers, or straight from a page-aligned
caller buffer) and with buffered ``pwritev`` where it does not.

Owner: the :class:`NVMeTier` instance owns the files, the lmdb environment, the
in-memory index mirror, the allocator and the policy instance.

Invariants:

* An index entry is committed to lmdb only after its payload is durable (written, then
  ``fdatasync`` of the segment); an unfinished write is just free space after a crash.
* lmdb never points at space being rewritten: deletes are queued and committed with the
  next index transaction, and a write whose new extent overlaps a queued delete commits
  the queue before it touches the disk.  So after a crash every indexed record is whole.
* Records never straddle segments: the allocator's linear space has a permanently
  reserved one-page gap after each segment, so no free extent spans two segments.
* Allocated bytes never exceed ``capacity_bytes``; a block's space is freed only when
  it is gone from the in-memory index *and* its last reader has finished.
* A block whose header or payload checksum fails is dropped, counted in
  ``corrupt_blocks`` and reported as a ``CORRUPT`` miss: bad bytes are never served.
* The index is checked before lmdb maps it (``tiers/nvme_recovery.py``); a damaged or
  lost one is moved aside and rebuilt from the segments' self-describing records, each
  verified end to end (``rebuild`` says what was found).  So the tier always opens.
* A write that fails (full disk, failing media, an index that cannot grow) raises
  ``CapacityExceeded`` or ``OSError``, never an lmdb error, and leaves nothing indexed:
  its space is freed and queued deletes stay queued.  The steps of a write are named
  failure points (``kvstore/node/failpoints.py``: ``nvme.preallocate``, ``nvme.write``,
  ``nvme.sync``, ``nvme.index.commit``).
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import gc
import logging
import mmap
import os
import struct
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import lmdb

from kvstore.block import HEADER_SIZE, BlockMeta, checksum, decode_header, encode_header, verify_payload
from kvstore.errors import BlockFormatError, CapacityExceeded, CorruptBlock, DataDirLocked, InvalidArgument, Unavailable
from kvstore.keys import ChunkKey
from kvstore.node import failpoints
from tiers.allocator import Extent, ExtentAllocator
from tiers.base import MissReason, ReadResult, TierKind
from tiers.nvme_format import (
    INDEX_VALUE,
    INDEX_VALUE_V1,
    INDEX_VALUE_VERSION,
    PAGE,
    addr,
    close_stage,
    index_meta,
    index_parent,
    index_payload_len,
    index_value,
    io_all,
    probe_direct_io,
    record_bytes,
    segment_name,
)
from tiers.nvme_recovery import Rebuild, finish, index_damage, move_aside, scan_segments, segment_bytes_on_disk
from tiers.policy import DEFAULT_POLICY, EvictionPolicy, make_policy

log = logging.getLogger(__name__)

STAGE_BYTES = 8 << 20  # staging buffer: the unit of O_DIRECT I/O for unaligned caller buffers
_STAGE_POOL_MAX = 4
_ZEROS = bytes(PAGE)
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
_MEDIA_ERRORS = (errno.EIO, errno.ENODATA, errno.EBADMSG)


class _Entry:
    """One stored block.  Mutable fields (``readers``, ``dead``) change under the tier lock.

    ``meta`` is decoded from the index entry (``raw``) on first use: an open builds no
    :class:`BlockMeta` for the many blocks nobody asks about, which is most of its time
    and memory per block.  Decoding twice in a race yields equal metas (harmless)."""

    __slots__ = ("key", "_meta", "raw", "seg", "off", "length", "vaddr", "seq", "readers", "dead")

    def __init__(
        self,
        key: ChunkKey,
        meta: BlockMeta | None,
        seg: int,
        off: int,
        length: int,
        vaddr: int,
        seq: int,
        raw: bytes = b"",
    ) -> None:
        self.key, self._meta, self.raw = key, meta, raw
        self.seg, self.off, self.length, self.vaddr, self.seq = seg, off, length, vaddr, seq
        self.readers = 0
        self.dead = False

    @property
    def meta(self) -> BlockMeta:
        """The block's meta (``CorruptBlock`` if the index entry it comes from does not describe one)."""
        m = self._meta
        if m is None:
            m = self._meta = index_meta(self.key, self.raw)
        return m

    def value(self) -> bytes:
        if self._meta is None:
            return self.raw  # loaded from lmdb at open: still what lmdb holds
        return index_value(self.seg, self.off, self.length, self.seq, self._meta)


@dataclasses.dataclass(frozen=True, slots=True)
class BlockLocation:
    """Where a block's record lies (diagnostics, fault tests, ``sendfile`` planning)."""

    path: Path
    record_offset: int
    record_length: int
    payload_offset: int
    payload_len: int


class NVMeTier:
    """Blocks on local SSD.  Thread-safe.

    Locks (order: ``_commit_lock`` before ``_lock``; neither is held across data I/O):

    * ``_lock`` guards the in-memory index, the allocator, the policy, reader counts and
      the queue of pending index deletes.  Held only for dictionary-sized work, so the
      manager's event loop (``contains``/``count_prefix``/``meta``/``victims``/``delete``)
      never waits on a disk.
    * ``_commit_lock`` serialises lmdb write transactions together with installing their
      entries in memory, so memory and lmdb see replacements in the same order.

    Readers pin a block (``readers`` count): ``delete`` of a block being read removes it
    from the index at once but frees its space only when the last reader finishes.
    ``close()`` refuses new reads and writes, then waits for those in flight.

    ``write``/``write_many``/``read_into`` block on the disk: call them from executor
    threads.  Everything else touches memory only.
    """

    kind = TierKind.NVME

    def __init__(
        self,
        directory: Path | str,
        capacity_bytes: int,
        *,
        policy: EvictionPolicy | None = None,
        segment_bytes: int = 256 << 20,
        direct_io: bool | None = None,
        sync: bool = True,
    ) -> None:
        self.directory = Path(directory)
        cap = capacity_bytes // PAGE * PAGE
        if cap < 2 * PAGE:
            raise InvalidArgument(f"NVMe capacity_bytes must be at least {2 * PAGE}, got {capacity_bytes}")
        if segment_bytes < 2 * PAGE:
            raise InvalidArgument(f"NVMe segment_bytes must be at least {2 * PAGE}, got {segment_bytes}")
        self.sync = sync
        self.corrupt_blocks = 0
        self.dropped_on_open = 0  # valid entries beyond a reduced capacity
        self.rebuild: Rebuild | None = None  # what rebuilding a damaged or lost index found, if this open did
        self._policy: EvictionPolicy = policy if policy is not None else make_policy(DEFAULT_POLICY)
        self._lock = threading.RLock()  # reentrant: a dropped victims() generator may close under it
        self._commit_lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # signalled when _inflight drops to 0
        self._inflight = 0  # reads and writes under way
        self._index: dict[ChunkKey, _Entry] = {}
        self._pending: list[_Entry] = []  # removed from memory, delete not yet committed to lmdb
        self._stages: list[mmap.mmap] = []
        self._fds: list[int] = []
        self._preallocated: set[int] = set()  # segments whose extent is reserved on disk
        self._in_use: set[int] = set()  # segments that held data when the tier opened
        self._env: lmdb.Environment | None = None
        self._closed = False
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock_fd = self._acquire_dir_lock()
        try:
            self._open(cap, segment_bytes, direct_io)
        except BaseException:
            self._release()
            raise

    # -- opening ----------------------------------------------------------------------
    def _acquire_dir_lock(self) -> int:
        fd = os.open(self.directory / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise DataDirLocked(
                f"NVMe data directory {self.directory} is in use by another NVMeTier (pid {holder}); "
                "stop that node or give this one its own directory"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return fd

    def _open(self, cap: int, segment_bytes: int, direct_io: bool | None) -> None:
        probe = probe_direct_io(self.directory) if direct_io is not False else False
        if probe is None:  # a full disk fails open: the node starts and serves what it holds
            log.warning(
                "cannot probe O_DIRECT on %s: the filesystem is full; using %s I/O",
                self.directory,
                "direct" if direct_io else "buffered",
            )
        can_direct = bool(probe)
        if direct_io and probe is False:
            raise InvalidArgument(
                f"the filesystem of {self.directory} refuses O_DIRECT (tmpfs?); pass direct_io=None or False"
            )
        self.direct_io = can_direct if direct_io is None else direct_io
        index_dir = self.directory / "index.lmdb"
        # never let lmdb map an index it cannot trust (a truncated one faults the process):
        # a damaged or lost one is moved aside and rebuilt from the self-describing segments
        damage = index_damage(index_dir)
        if damage is not None:
            self._set_aside(index_dir, damage)
        seg_hint = min(segment_bytes, cap) // PAGE * PAGE
        raw: list[tuple[bytes, bytes]] = []
        for attempt in (1, 2):
            try:
                if self.rebuild is not None:
                    seg_hint = segment_bytes_on_disk(self.directory, segment_name) or seg_hint
                seg = self._open_env(index_dir, cap, seg_hint, segment_bytes)
                if self.rebuild is None:
                    with self._env.begin() as txn:  # type: ignore[union-attr]
                        raw = list(txn.cursor(db=self._db))
                break
            except lmdb.Error as e:  # damage the check did not see
                if attempt == 2 or self.rebuild is not None:
                    raise
                if self._env is not None:
                    self._env.close()
                    self._env = None
                self._set_aside(index_dir, f"lmdb: {e!r}")
        self.segment_bytes = seg
        n = -(-cap // seg)
        self._seg_sizes = [seg] * (n - 1) + [cap - (n - 1) * seg]
        self._stride = seg + PAGE
        self._capacity = cap
        self._max_record = max(self._seg_sizes)
        self._alloc = ExtentAllocator((n - 1) * self._stride + self._seg_sizes[-1], unit=PAGE)
        for i in range(n - 1):  # the gap pages that keep records inside one segment
            self._alloc.reserve_exact(Extent(i * self._stride + seg, PAGE))
        self._gap_bytes = (n - 1) * PAGE
        self._open_segments()
        if self.rebuild is not None:
            raw = self._rebuild_index(self.rebuild)
        # millions of new objects, none in a cycle: the collector's passes over them
        # (generation 2 several times) were a third of an open
        collecting = gc.isenabled()
        gc.disable()
        try:
            self._load_index(raw)
        finally:
            if collecting:
                gc.enable()
        if self.rebuild is not None:
            self.rebuild.recovered = len(self._index)
            finish(self.rebuild, self.directory)

    def _set_aside(self, index_dir: Path, damage: str) -> None:
        """Move a damaged index aside; plan a rebuild if any segment holds data."""
        moved = move_aside(index_dir)
        if any(p.stat().st_size for p in self.directory.glob("seg-*.dat")):
            self.rebuild = Rebuild(reason=damage)
        if moved is not None:
            log.error(
                "the NVMe index %s cannot be used (%s): moved it to %s%s",
                index_dir,
                damage,
                moved,
                "; rebuilding it from the segment files" if self.rebuild else "",
            )

    def _open_env(self, index_dir: Path, cap: int, seg_hint: int, asked: int) -> int:
        """Open (or create) the lmdb index; its stored segment size, else ``seg_hint`` (stored)."""
        # the index names every stored key and namespace: the node's alone, like the segments.
        # lmdb's ``mode`` is also what it would mkdir the directory with (0600: not searchable
        # by a non-root owner), so the directory is made here first
        index_dir.mkdir(mode=0o700, exist_ok=True)
        self._env = lmdb.open(
            str(index_dir),
            map_size=min(max(32 << 20, cap // (2 * PAGE) * 512), 1 << 40),
            max_dbs=2,
            sync=self.sync,
            metasync=self.sync,
            readahead=False,
            mode=0o600,
        )
        self._db = self._env.open_db(b"blocks")
        config = self._env.open_db(b"config")
        with self._env.begin(write=True) as txn:
            stored = txn.get(b"segment_bytes", db=config)
            if stored is None:
                txn.put(b"segment_bytes", struct.pack("<Q", seg_hint), db=config)
                return seg_hint
        seg = int(
            struct.unpack("<Q", stored)[0]
        )  # locations are (segment, offset): the layout of an existing directory wins
        if seg != asked:
            log.info("%s keeps its segment_bytes=%d (asked for %d)", self.directory, seg, asked)
        return seg

    def _rebuild_index(self, report: Rebuild) -> list[tuple[bytes, bytes]]:
        """Scan the segments in use for verified records and commit them as the index (one txn)."""
        assert self._env is not None
        stage = self._acquire_stage()
        try:
            used = [(i, self._fds[i], size) for i, size in enumerate(self._seg_sizes) if i in self._in_use]
            found = scan_segments(used, memoryview(stage), report)
        finally:
            self._release_stage(stage)
        raw = [
            (bytes(r.meta.key), _Entry(r.meta.key, r.meta, seg, r.offset, r.length, 0, seq).value())
            for seq, (seg, r) in enumerate(found, start=1)
        ]
        with self._env.begin(write=True) as txn:
            for k, v in raw:
                txn.put(k, v, db=self._db)
        self._env.sync(True)
        return raw

    def _seg_path(self, i: int) -> Path:
        return self.directory / segment_name(i)

    def _open_segments(self) -> None:
        flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if self.direct_io else 0)
        for i, size in enumerate(self._seg_sizes):
            fd = os.open(self._seg_path(i), flags, 0o600)  # every tenant's KV bytes: the node's alone, like the arena
            self._fds.append(fd)
            st_size = os.fstat(fd).st_size
            if st_size > size:
                os.ftruncate(fd, size)
            if st_size:  # in use before: keep it whole; an untouched one is preallocated on first write
                self._in_use.add(i)
                try:
                    self._preallocate(i)
                except (CapacityExceeded, OSError) as e:  # the next write tries again; a start must not fail on it
                    log.warning("cannot preallocate %s now: %s", self._seg_path(i), e)
        i = len(self._seg_sizes)
        while self._seg_path(i).exists():  # segments beyond a reduced capacity
            self._seg_path(i).unlink()
            i += 1
        dfd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def _preallocate(self, seg: int) -> None:
        """Reserve a segment's whole extent on disk, once, before its first record.

        Segments are preallocated lazily so a large, mostly empty tier does not take its
        full capacity from the filesystem at start-up.  Idempotent and thread-safe
        (``posix_fallocate`` of an allocated range is a no-op)."""
        if seg in self._preallocated:
            return
        size = self._seg_sizes[seg]
        try:
            failpoints.hit("nvme.preallocate")
            os.posix_fallocate(self._fds[seg], 0, size)
        except OSError as e:
            if e.errno in _DISK_FULL:
                raise CapacityExceeded(
                    f"cannot preallocate {size} bytes for {self._seg_path(seg)}: the filesystem is full; "
                    "lower the NVMe capacity_bytes or free disk space"
                ) from e
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            os.ftruncate(self._fds[seg], size)  # no fallocate here: sparse file; ENOSPC may come on write
        self._preallocated.add(seg)

    def _load_index(self, raw: list[tuple[bytes, bytes]]) -> None:
        """Rebuild memory from lmdb's entries: a scan of the index, no record read.

        Version-2 entries carry their block's meta (checked for self-consistency here,
        decoded on first use; the header on disk is checked on every read).  Version-1
        entries (older directories) have their record's header read and are rewritten as
        version 2.  Entries that overlap keep the newest; bad ones are dropped and counted."""
        assert self._env is not None
        drop: list[bytes] = []
        kept: list[tuple[int, int, int, bytes, bytes]] = []  # (vaddr, length, seq, key, value)
        sizes, stride, nseg = self._seg_sizes, self._stride, len(self._seg_sizes)
        unpack, fixed = INDEX_VALUE.unpack_from, INDEX_VALUE.size
        top = 0
        for key, value in raw:
            fields = unpack(value) if len(key) == 16 and len(value) >= fixed else None
            if fields is not None and fields[4] > top:
                top = fields[4]
            if fields is None or not (
                (
                    fields[0] == INDEX_VALUE_VERSION
                    and (plen := index_payload_len(value)) is not None
                    and record_bytes(plen) == fields[3]
                )
                or (fields[0] == INDEX_VALUE_V1 and len(value) == fixed)
            ):
                self.corrupt_blocks += 1
                drop.append(key)
                continue
            _, seg, off, length, seq, _ = fields
            if seg >= nseg or off + length > sizes[seg]:
                self.dropped_on_open += 1
                drop.append(key)
                continue
            if off % PAGE or length % PAGE or length < PAGE:
                self.corrupt_blocks += 1
                drop.append(key)
                continue
            kept.append((seg * stride + off, length, seq, key, value))
        kept = self._reserve_extents(kept, drop)
        migrate = [k for k in kept if k[4][0] == INDEX_VALUE_V1]
        metas = self._read_headers(migrate, drop) if migrate else {}
        kept.sort(key=lambda k: k[2])  # parents are mostly older: insert them first
        index, order = self._index, []
        for vaddr, length, seq, key, value in kept:
            seg, off = divmod(vaddr, stride)
            if value[0] == INDEX_VALUE_VERSION:
                index[key] = _Entry(ChunkKey(key), None, seg, off, length, vaddr, seq, value)
                order.append((ChunkKey(key), index_parent(value), length))
            elif (meta := metas.get(key)) is not None:
                index[key] = _Entry(ChunkKey(key), meta, seg, off, length, vaddr, seq)
                order.append((ChunkKey(key), meta.parent, length))
        self._policy.insert_many(order)
        del order
        for attempt in (1, 2) if drop or metas else ():
            try:
                with self._env.begin(write=True) as txn:
                    for key in drop:
                        txn.delete(key, db=self._db)
                    for key in metas:  # version 1 -> 2: the next open reads no header
                        txn.put(key, index[key].value(), db=self._db)
                break
            except lmdb.Error as e:  # a full disk: they are only out of memory, and dropped again next time
                if attempt == 1 and isinstance(e, lmdb.MapFullError):  # version 2 entries are longer
                    self._env.set_mapsize(self._env.info()["map_size"] * 2)
                    continue
                log.warning(
                    "could not update %d entries of the NVMe index of %s: %r", len(drop) + len(metas), self.directory, e
                )
        self._seq = top

    def _reserve_extents(
        self, kept: list[tuple[int, int, int, bytes, bytes]], drop: list[bytes]
    ) -> list[tuple[int, int, int, bytes, bytes]]:
        """Reserve the entries' extents in the allocator; of overlapping ones the newest wins."""
        kept.sort()
        try:
            self._alloc.reserve_many(kept)
            return kept
        except InvalidArgument:  # two entries overlap (a damaged index): reserve nothing that way
            pass
        out = []
        for k in sorted(kept, key=lambda k: -k[2]):  # a damaged index: one at a time, newest first
            try:
                self._alloc.reserve_exact(Extent(k[0], k[1]))
            except InvalidArgument:
                self.corrupt_blocks += 1
                drop.append(k[3])
                continue
            out.append(k)
        return out

    def _read_headers(
        self, todo: list[tuple[int, int, int, bytes, bytes]], drop: list[bytes]
    ) -> dict[bytes, BlockMeta]:
        """The metas of version-1 entries, from their records' headers (checked against the entry)."""
        metas: dict[bytes, BlockMeta] = {}
        hdr = self._acquire_stage()
        try:
            for vaddr, length, _, key, value in sorted(todo):
                seg, off = divmod(vaddr, self._stride)
                try:
                    io_all(os.preadv, self._fds[seg], [memoryview(hdr)[:PAGE]], off)
                    meta = decode_header(memoryview(hdr)[:HEADER_SIZE], expect_key=key)
                    if (
                        meta.payload_checksum != INDEX_VALUE.unpack(value)[5]
                        or record_bytes(meta.payload_len) != length
                    ):
                        raise CorruptBlock("header disagrees with the index")
                except (BlockFormatError, OSError) as e:
                    if isinstance(e, OSError) and e.errno not in _MEDIA_ERRORS:
                        raise
                    log.warning("dropping NVMe block %s at open: %s", key.hex(), e)
                    self.corrupt_blocks += 1
                    self._alloc.free([Extent(vaddr, length)])
                    drop.append(key)
                    continue
                metas[key] = meta
        finally:
            self._release_stage(hdr)
        return metas

    @staticmethod
    def _seq_of(value: bytes) -> int:
        return INDEX_VALUE.unpack_from(value)[4] if len(value) >= INDEX_VALUE.size else -1

    # -- queries (event-loop safe: memory only) ---------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def policy(self) -> EvictionPolicy:
        """The eviction policy instance.  Not thread-safe: prefer :meth:`admit`, which locks."""
        return self._policy

    def admit(self, key: ChunkKey, size: int) -> bool:
        """The policy's admission filter (one-hit wonders may be kept off NVMe)."""
        with self._lock:
            return self._policy.admit(key, size)

    @property
    def used_bytes(self) -> int:
        """Bytes allocated: stored records, writes in flight and space awaiting its last reader."""
        with self._lock:
            return self._alloc.used_bytes - self._gap_bytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def contains(self, key: ChunkKey) -> bool:
        with self._lock:
            return key in self._index

    def keys(self) -> list[ChunkKey]:
        """A snapshot of the stored keys."""
        with self._lock:
            return list(self._index)

    def meta(self, key: ChunkKey) -> BlockMeta | None:
        with self._lock:
            e = self._index.get(key)
        return e.meta if e is not None else None

    def count_prefix(self, keys: Sequence[ChunkKey]) -> int:
        with self._lock:
            n = 0
            for k in keys:
                if k not in self._index:
                    break
                n += 1
            return n

    def fits(self, nbytes: int) -> bool:
        """True if a block with an ``nbytes`` payload fits in one free extent right now."""
        with self._lock:
            return record_bytes(nbytes) <= self._alloc.largest_free_bytes

    def locate(self, key: ChunkKey) -> BlockLocation | None:
        """Where ``key``'s record is now (the space may be reused once it is deleted)."""
        with self._lock:
            e = self._index.get(key)
        if e is None:
            return None
        return BlockLocation(self._seg_path(e.seg), e.off, e.length, e.off + PAGE, e.meta.payload_len)

    def stats(self) -> dict[str, object]:
        with self._lock:
            return {
                "blocks": len(self._index),
                "used_bytes": self._alloc.used_bytes - self._gap_bytes,
                "capacity_bytes": self._capacity,
                "corrupt_blocks": self.corrupt_blocks,
                "dropped_on_open": self.dropped_on_open,
                **self.recovery(),
                "pending_index_deletes": len(self._pending),
                "segments": len(self._seg_sizes),
                "segment_bytes": self.segment_bytes,
                "direct_io": self.direct_io,
            }

    def recovery(self) -> dict[str, int]:
        """What this open's index rebuild found (:meth:`Rebuild.counts`; zeros if none ran)."""
        return Rebuild.counts(self.rebuild)

    def victims(self, can_evict: Callable[[ChunkKey], bool] = lambda k: True) -> Iterator[ChunkKey]:
        """The policy's victims, minus blocks being read and those ``can_evict`` rejects.

        The policy generator only advances under the lock; ``can_evict`` runs outside it.
        """
        gen = self._policy.victims()
        try:
            while True:
                with self._lock:
                    key = next(gen, None)
                    if key is None:
                        return
                    e = self._index.get(key)
                    if e is None:  # stale in the policy: drop it there rather than restore it
                        self._policy.remove(key)
                        continue
                    busy = e.readers > 0
                if not busy and can_evict(key):
                    yield key
        finally:
            with self._lock:
                gen.close()

    # -- mutation -----------------------------------------------------------------------
    def delete(self, key: ChunkKey) -> bool:
        """Forget ``key`` now; its lmdb entry goes with the next index commit (or ``flush``)."""
        with self._lock:
            e = self._index.pop(key, None)
            if e is None:
                return False
            self._policy.remove(key)
            self._pending.append(e)
            self._retire(e)
            return True

    def write(self, meta: BlockMeta, payload: object) -> None:
        self.write_many([(meta, payload)])

    def write_many(self, items: Sequence[tuple[BlockMeta, object]]) -> None:
        """Store blocks as one group commit: one fdatasync per touched segment, one lmdb txn.

        All or nothing: on ``CapacityExceeded`` or an I/O error none of them is stored.
        """
        views: list[memoryview] = []
        for meta, payload in items:
            try:
                mv = memoryview(payload).cast("B")  # type: ignore[arg-type]
            except (TypeError, ValueError) as e:
                raise InvalidArgument(f"payload must be a contiguous buffer: {e}") from None
            if mv.nbytes != meta.payload_len:
                raise InvalidArgument(f"payload has {mv.nbytes} bytes but meta says {meta.payload_len}")
            if checksum(mv) != meta.payload_checksum:
                raise InvalidArgument(f"payload checksum does not match meta for key {meta.key.hex()}")
            if record_bytes(mv.nbytes) > self._max_record:
                raise CapacityExceeded(
                    f"a {mv.nbytes}-byte block needs a {record_bytes(mv.nbytes)}-byte record, more than one "
                    f"NVMe segment ({self._max_record} bytes); raise segment_bytes (and capacity_bytes)"
                )
            views.append(mv)
        if not views:
            return
        entries: list[_Entry] = []
        with self._lock:
            self._enter()
            for (meta, _), mv in zip(items, views):
                got = self._alloc.allocate(record_bytes(mv.nbytes), contiguous=True)
                if got is None:
                    self._alloc.free([Extent(e.vaddr, e.length) for e in entries])
                    self._exit()
                    raise CapacityExceeded(
                        f"no free NVMe extent for {len(items)} block(s) now ({self._alloc.free_bytes} bytes free, "
                        f"largest extent {self._alloc.largest_free_bytes}); evict first (fits()/victims())"
                    )
                v = got[0]
                self._seq += 1
                seg, off = divmod(v.offset, self._stride)
                entries.append(_Entry(meta.key, meta, seg, off, v.length, v.offset, self._seq))
            must_flush = any(
                p.vaddr < e.vaddr + e.length and e.vaddr < p.vaddr + p.length for p in self._pending for e in entries
            )
        committed = False
        try:
            for seg in sorted({e.seg for e in entries}):
                self._preallocate(seg)
            if must_flush:
                self.flush()
            for e, mv in zip(entries, views):
                failpoints.hit("nvme.write", short=lambda: self._write_header_only(e))
                self._transfer(e, mv, writing=True)
            if self.sync:
                for seg in sorted({e.seg for e in entries}):
                    failpoints.hit("nvme.sync")
                    os.fdatasync(self._fds[seg])
            self._commit(entries)
            committed = True
        except OSError as err:
            if err.errno in _DISK_FULL:
                raise CapacityExceeded(f"the disk under {self.directory} is full: {err}") from err
            raise
        finally:
            with self._lock:
                if not committed:
                    self._alloc.free([Extent(e.vaddr, e.length) for e in entries])
                self._exit()

    def flush(self) -> None:
        """Commit queued index deletes to lmdb (writes do this on their own)."""
        self._commit([])

    def _commit(self, entries: list[_Entry]) -> None:
        assert self._env is not None
        with self._commit_lock:
            with self._lock:
                drained, self._pending = self._pending, []
            if not drained and not entries:
                return
            try:
                try:
                    self._commit_txn(drained, entries)
                except lmdb.MapFullError:  # the map was sized for typical churn: double it, once
                    self._env.set_mapsize(self._env.info()["map_size"] * 2)
                    self._commit_txn(drained, entries)
            except BaseException as e:
                with self._lock:
                    self._pending[:0] = drained
                if isinstance(e, lmdb.Error):  # mapped once, here: callers see the tier's error types
                    if isinstance(e, (lmdb.MapFullError, lmdb.DiskError)):
                        raise CapacityExceeded(f"the NVMe index under {self.directory} cannot grow: {e}") from e
                    raise OSError(errno.EIO, f"the NVMe index under {self.directory} failed: {e!r}") from e
                raise
            with self._lock:
                for e in entries:
                    old = self._index.get(e.key)
                    self._index[e.key] = e
                    self._policy.insert(e.key, e.meta.parent, e.length)
                    if old is not None:
                        self._retire(old)

    def _commit_txn(self, drained: list[_Entry], entries: list[_Entry]) -> None:
        assert self._env is not None
        with self._env.begin(write=True) as txn:
            failpoints.hit("nvme.index.commit", errors={"enospc": lmdb.DiskError, "edquot": lmdb.DiskError})
            for p in drained:  # only if lmdb still holds that very entry
                v = txn.get(p.key, db=self._db)
                if v is not None and self._seq_of(v) == p.seq:
                    txn.delete(p.key, db=self._db)
            for e in entries:
                txn.put(e.key, e.value(), db=self._db)

    def _write_header_only(self, e: _Entry) -> None:
        """A torn record (failpoint ``nvme.write=short``): its header, and none of its payload."""
        buf = mmap.mmap(-1, PAGE)  # page-aligned, as O_DIRECT wants
        try:
            buf[:HEADER_SIZE] = encode_header(e.meta)
            io_all(os.pwritev, self._fds[e.seg], [memoryview(buf)], e.off)
        finally:
            close_stage(buf)

    def _retire(self, e: _Entry) -> None:
        """Under ``_lock``: ``e`` has left the index; free its space once nobody reads it."""
        e.dead = True
        if e.readers == 0:
            self._alloc.free([Extent(e.vaddr, e.length)])

    # -- data I/O (never under a lock) ----------------------------------------------------
    def _acquire_stage(self) -> mmap.mmap:
        with self._lock:
            if self._stages:
                return self._stages.pop()
        return mmap.mmap(-1, STAGE_BYTES)

    def _release_stage(self, stage: mmap.mmap) -> None:
        with self._lock:
            if len(self._stages) < _STAGE_POOL_MAX and not self._closed:
                self._stages.append(stage)
                return
        close_stage(stage)

    def read_into(self, key: ChunkKey, out: object) -> ReadResult:
        """Copy ``key``'s payload into ``out`` after verifying header and payload checksum."""
        try:
            omv = memoryview(out).cast("B")  # type: ignore[arg-type]
        except (TypeError, ValueError) as e:
            raise InvalidArgument(f"out must be a contiguous writable buffer: {e}") from None
        if omv.readonly:
            raise InvalidArgument("out must be writable")
        with self._lock:
            self._enter()
            e = self._index.get(key)
            if e is None or omv.nbytes < e.meta.payload_len:
                self._exit()
                if e is None:
                    return ReadResult(key, miss=MissReason.NOT_PRESENT)
                raise InvalidArgument(f"out has {omv.nbytes} bytes; block {key.hex()} needs {e.meta.payload_len}")
            e.readers += 1
            self._policy.access(key)
        corrupt = False
        try:
            self._transfer(e, omv[: e.meta.payload_len], writing=False)
        except (BlockFormatError, OSError) as err:
            if isinstance(err, OSError) and err.errno not in _MEDIA_ERRORS:
                raise
            log.warning("NVMe block %s is corrupt, dropping it: %s", key.hex(), err)
            corrupt = True
        finally:
            with self._lock:
                e.readers -= 1
                self._exit()
                if corrupt and self._index.get(key) is e:  # counted once, by whoever drops it
                    self.corrupt_blocks += 1
                    del self._index[key]
                    self._policy.remove(key)
                    self._pending.append(e)
                    e.dead = True
                if e.dead and e.readers == 0:
                    self._alloc.free([Extent(e.vaddr, e.length)])
        if corrupt:
            return ReadResult(key, miss=MissReason.CORRUPT)
        return ReadResult(key, meta=e.meta, nbytes=e.meta.payload_len)

    def _transfer(self, e: _Entry, mv: memoryview, writing: bool) -> None:
        """Write ``e``'s record from ``mv``, or read it into ``mv`` and verify it (raises on doubt)."""
        fd, n = self._fds[e.seg], mv.nbytes
        op = os.pwritev if writing else os.preadv
        page = encode_header(e.meta) + _ZEROS[HEADER_SIZE:] if writing else bytearray(PAGE)
        if not self.direct_io:  # buffered: straight from / into the caller's buffer, any alignment
            pad = memoryview(_ZEROS)[: e.length - PAGE - n] if writing else mv[:0]
            io_all(op, fd, [memoryview(page), mv, pad], e.off)
            if not writing:
                self._check(e, page, mv)
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
                io_all(op, fd, [s[:PAGE], mv[:full], s[PAGE : 2 * PAGE] if tail else s[:0]], e.off)
                if not writing:
                    mv[full:] = s[PAGE : PAGE + tail]
                    self._check(e, s[:HEADER_SIZE], mv)
                return
            for pos in range(0, e.length, STAGE_BYTES):  # otherwise through the staging buffer
                hi = min(pos + STAGE_BYTES, e.length)
                a, b = max(pos, PAGE), min(hi, PAGE + n)  # the payload's share of this chunk
                if writing:
                    if pos == 0:
                        s[:PAGE] = page
                    if a < b:
                        s[a - pos : b - pos] = mv[a - PAGE : b - PAGE]
                    z = max(pos, PAGE + n)
                    if z < hi:
                        s[z - pos : hi - pos] = _ZEROS[: hi - z]
                io_all(op, fd, [s[: hi - pos]], e.off + pos)
                if not writing:
                    if pos == 0:  # a bad header fails before the rest is read
                        self._check(e, s[:HEADER_SIZE], None)
                    if a < b:
                        mv[a - PAGE : b - PAGE] = s[a - pos : b - pos]
            if not writing:
                verify_payload(e.meta, mv)
        finally:
            del s
            self._release_stage(stage)

    @staticmethod
    def _check(e: _Entry, hdr: object, payload: memoryview | None) -> None:
        if decode_header(hdr, expect_key=e.key) != e.meta:
            raise CorruptBlock(f"header of {e.key.hex()} disagrees with the index")
        if payload is not None:
            verify_payload(e.meta, payload)

    # -- lifetime -------------------------------------------------------------------------
    def _enter(self) -> None:
        """Under ``_lock``: start a data operation (``close`` waits for it to end)."""
        if self._closed:
            raise Unavailable(f"the NVMe tier on {self.directory} is closed")
        self._inflight += 1

    def _exit(self) -> None:
        self._inflight -= 1
        if self._inflight == 0:
            self._idle.notify_all()

    def close(self, timeout: float = 60.0) -> None:
        """Refuse new reads and writes, wait for those in flight, commit queued deletes, close
        lmdb and the segment files, release the directory lock.  Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if not self._idle.wait_for(lambda: self._inflight == 0, timeout):
                log.error("closing %s with %d operations still in flight", self.directory, self._inflight)
        try:
            if self._env is not None:
                self.flush()
                if self.sync:
                    self._env.sync(True)
        except (CapacityExceeded, OSError, lmdb.Error) as e:  # a full or failing disk must not stop a shutdown
            log.error(
                "closing %s: could not commit %d index deletes (%r); those blocks may be back after a restart",
                self.directory,
                len(self._pending),
                e,
            )
        finally:
            self._release()

    def _release(self) -> None:
        if self._env is not None:
            self._env.close()
            self._env = None
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        with self._lock:
            stages, self._stages = self._stages, []
        for st in stages:
            close_stage(st)
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = -1

    def __enter__(self) -> NVMeTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

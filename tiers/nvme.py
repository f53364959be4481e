"""The NVMe tier: block records in preallocated segment files, the index in lmdb.

Role: the node's persistent, largest and slowest tier (architecture §3).  Demotions from
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

The tier is composed of parts, each in its own module:

* ``tiers/nvme_segments.py``: the segment files, their layout and the record I/O (O_DIRECT staging);
* ``tiers/nvme_index.py``: index entries, their lmdb copy, and loading them at open;
* ``tiers/nvme_recovery.py``: checking the index before lmdb maps it, rebuilding it from the segments;
* ``tiers/nvme_format.py``: the record and index-entry formats.

This module is the tier itself: the :class:`~tiers.base.Tier` protocol, the in-memory index,
the allocator and the eviction policy, the reader counts and the order of a write's steps.

Owner: the :class:`NVMeTier` instance owns its parts, the in-memory index, the allocator
and the policy instance.

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
  failure points (``tiers/failpoints.py``: ``nvme.preallocate``, ``nvme.write``,
  ``nvme.sync``, ``nvme.index.commit``).
"""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import gc
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import lmdb

from kvstore.block import BlockMeta, checksum
from kvstore.errors import BlockFormatError, CapacityExceeded, DataDirLocked, InvalidArgument, Unavailable
from kvstore.keys import ChunkKey
from tiers import failpoints
from tiers.base import HoldingsHook, MissReason, ReadResult, TierKind
from tiers.nvme_format import PAGE, record_bytes
from tiers.nvme_index import Entry, LmdbIndex, load_entries
from tiers.nvme_recovery import Rebuild, finish
from tiers.nvme_segments import DISK_FULL, MEDIA_ERRORS, Layout, Segments, choose_direct_io
from tiers.policy import DEFAULT_POLICY, EvictionPolicy, make_policy

__all__ = ["PAGE", "BlockLocation", "NVMeTier", "Rebuild", "record_bytes"]

log = logging.getLogger(__name__)


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
        self._index: dict[ChunkKey, Entry] = {}
        # told of every key the index gains or loses, under _lock (set before the tier is shared)
        self.holdings: HoldingsHook | None = None
        self._pending: list[Entry] = []  # removed from memory, delete not yet committed to lmdb
        self._lmdb: LmdbIndex | None = None
        self._segments: Segments | None = None
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
        """Index (checked, or planned for a rebuild), then segments, then memory from the index."""
        self.direct_io = choose_direct_io(self.directory, direct_io)
        idx = self._lmdb = LmdbIndex(self.directory, cap, segment_bytes, sync=self.sync)
        self.rebuild = idx.rebuild
        self.segment_bytes = idx.segment_bytes
        layout = self._layout = Layout(idx.segment_bytes, cap)
        self._stride = layout.stride
        self._nsegments = len(layout.sizes)
        self._capacity = cap
        self._max_record = layout.max_record
        self._alloc = layout.allocator()
        self._gap_bytes = layout.gap_bytes
        seg = self._segments = Segments(self.directory, layout, direct_io=self.direct_io)
        raw = idx.fill(seg.scan(self.rebuild)) if self.rebuild is not None else idx.take_loaded()
        # millions of new objects, none in a cycle: the collector's passes over them
        # (generation 2 several times) were a third of an open
        collecting = gc.isenabled()
        gc.disable()
        try:
            loaded = load_entries(raw, layout, self._alloc, seg.read_header)
        finally:
            if collecting:
                gc.enable()
        del raw
        self._index = loaded.entries
        self.corrupt_blocks += loaded.corrupt
        self.dropped_on_open += loaded.dropped
        self._policy.insert_many(loaded.order)
        idx.tidy(loaded.drop, loaded.rewrite)
        self._seq = loaded.top_seq
        if self.rebuild is not None:
            self.rebuild.recovered = len(self._index)
            finish(self.rebuild, self.directory)

    def _seg_path(self, i: int) -> Path:
        assert self._segments is not None
        return self._segments.path(i)

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
                "segments": self._nsegments,
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
            if self.holdings is not None:
                self.holdings(key, None)
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
        entries: list[Entry] = []
        with self._lock:
            self._enter()
            segments = self._segments  # open until the last operation in flight ends
            assert segments is not None
            for (meta, _), mv in zip(items, views):
                got = self._alloc.allocate(record_bytes(mv.nbytes), contiguous=True)
                if got is None:
                    self._alloc.free([e.extent() for e in entries])
                    self._exit()
                    raise CapacityExceeded(
                        f"no free NVMe extent for {len(items)} block(s) now ({self._alloc.free_bytes} bytes free, "
                        f"largest extent {self._alloc.largest_free_bytes}); evict first (fits()/victims())"
                    )
                v = got[0]
                self._seq += 1
                seg, off = divmod(v.offset, self._stride)
                entries.append(Entry(meta.key, meta, seg, off, v.length, v.offset, self._seq))
            must_flush = any(
                p.vaddr < e.vaddr + e.length and e.vaddr < p.vaddr + p.length for p in self._pending for e in entries
            )
        committed = False
        try:
            for seg in sorted({e.seg for e in entries}):
                segments.preallocate(seg)
            if must_flush:
                self.flush()
            for ent, mv in zip(entries, views):
                failpoints.hit(
                    "nvme.write", short=functools.partial(segments.write_header_only, ent.seg, ent.off, ent.meta)
                )
                self._transfer(ent, mv, writing=True)
            if self.sync:
                segments.sync({e.seg for e in entries})
            self._commit(entries)
            committed = True
        except OSError as err:
            if err.errno in DISK_FULL:
                raise CapacityExceeded(f"the disk under {self.directory} is full: {err}") from err
            raise
        finally:
            with self._lock:
                if not committed:
                    self._alloc.free([e.extent() for e in entries])
                self._exit()

    def flush(self) -> None:
        """Commit queued index deletes to lmdb (writes do this on their own)."""
        self._commit([])

    def _commit(self, entries: list[Entry]) -> None:
        assert self._lmdb is not None
        with self._commit_lock:
            with self._lock:
                drained, self._pending = self._pending, []
            if not drained and not entries:
                return
            try:
                self._lmdb.commit(drained, entries)
            except BaseException:
                with self._lock:
                    self._pending[:0] = drained
                raise
            with self._lock:
                for e in entries:
                    old = self._index.get(e.key)
                    self._index[e.key] = e
                    self._policy.insert(e.key, e.meta.parent, e.length)
                    if old is not None:
                        self._retire(old)
                    if self.holdings is not None:
                        self.holdings(e.key, e.meta)

    def _retire(self, e: Entry) -> None:
        """Under ``_lock``: ``e`` has left the index; free its space once nobody reads it."""
        e.dead = True
        if e.readers == 0:
            self._alloc.free([e.extent()])

    # -- data I/O (never under a lock) ----------------------------------------------------
    def read_into(self, key: ChunkKey, out: object) -> ReadResult:
        """Copy ``key``'s payload into ``out`` after verifying header and payload checksum."""
        try:
            omv = memoryview(out).cast("B")  # type: ignore[arg-type]
        except (TypeError, ValueError) as err:
            raise InvalidArgument(f"out must be a contiguous writable buffer: {err}") from None
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
            if isinstance(err, OSError) and err.errno not in MEDIA_ERRORS:
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
                    if self.holdings is not None:
                        self.holdings(key, None)
                if e.dead and e.readers == 0:
                    self._alloc.free([e.extent()])
        if corrupt:
            return ReadResult(key, miss=MissReason.CORRUPT)
        return ReadResult(key, meta=e.meta, nbytes=e.meta.payload_len)

    def _transfer(self, e: Entry, mv: memoryview, writing: bool) -> None:
        """Write ``e``'s record from ``mv``, or read it into ``mv`` and verify it (raises on doubt)."""
        assert self._segments is not None
        self._segments.transfer(e.seg, e.off, e.length, e.meta, mv, writing=writing)

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
            if self._lmdb is not None:
                self.flush()
                if self.sync:
                    self._lmdb.sync()
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
        if self._lmdb is not None:
            self._lmdb.close()
            self._lmdb = None
        if self._segments is not None:
            self._segments.close()
            self._segments = None
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = -1

    def __enter__(self) -> NVMeTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""The NVMe tier's index: entries in memory, their lmdb copy, and loading them at open.

Role: the metadata half of :class:`tiers.nvme.NVMeTier`.  An :class:`Entry` says where one
block's record lies (and, decoded on first use, the block's meta); :class:`LmdbIndex` is the
durable key → entry map in ``index.lmdb`` (format: ``tiers/nvme_format.py``);
:func:`load_entries` turns lmdb's entries into the in-memory index at open, a scan of the
index that reads no record (but the headers of version-1 entries, once, to migrate them).

Owner: the tier owns the :class:`LmdbIndex` and the in-memory ``dict`` of entries (under its
lock); this module holds no state of its own besides the lmdb environment.

Invariants:

* lmdb is opened only after ``tiers/nvme_recovery.py`` found its file sound; a damaged or
  lost index is moved aside and the tier rebuilds it from the segments (``LmdbIndex.rebuild``
  says so), so the tier always opens.
* A commit is one lmdb write transaction: it deletes the queued entries that lmdb still
  holds *as queued* (same sequence number: a newer write of the key is kept) and puts the
  new ones.  lmdb errors are mapped here, once: the caller sees ``CapacityExceeded`` (the
  index cannot grow) or ``OSError`` (``EIO``), never an lmdb error.
* At open, entries that overlap keep the newest (largest sequence number); malformed ones
  are dropped and counted ``corrupt``, ones beyond a reduced capacity ``dropped``.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import struct
from collections.abc import Callable
from pathlib import Path

import lmdb

from kvstore.block import BlockMeta
from kvstore.errors import BlockFormatError, CapacityExceeded, CorruptBlock, InvalidArgument
from kvstore.keys import ChunkKey
from tiers import failpoints
from tiers.allocator import Extent, ExtentAllocator
from tiers.nvme_format import (
    INDEX_VALUE,
    INDEX_VALUE_V1,
    INDEX_VALUE_VERSION,
    PAGE,
    index_meta,
    index_parent,
    index_payload_len,
    index_value,
    record_bytes,
    segment_name,
)
from tiers.nvme_recovery import Found, Rebuild, index_damage, move_aside, segment_bytes_on_disk
from tiers.nvme_segments import MEDIA_ERRORS, Layout

log = logging.getLogger("tiers.nvme")  # the tier's log, as before the split

RawEntry = tuple[bytes, bytes]
"""An lmdb entry as stored: (16-byte key, ``INDEX_VALUE``-led value)."""


class Entry:
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

    def extent(self) -> Extent:
        """The record's extent in the tier's linear space."""
        return Extent(self.vaddr, self.length)


def seq_of(value: bytes) -> int:
    return INDEX_VALUE.unpack_from(value)[4] if len(value) >= INDEX_VALUE.size else -1


class LmdbIndex:
    """``index.lmdb`` of one tier directory: checked before it is mapped, rebuilt when it must be.

    After construction ``segment_bytes`` is the directory's segment size (an existing
    index's wins over the one asked for), ``rebuild`` is set if the index must be rebuilt
    from the segments (:meth:`fill`), and :meth:`take_loaded` gives the entries read at open.
    """

    def __init__(self, directory: Path, capacity: int, segment_bytes: int, *, sync: bool) -> None:
        self.directory = directory
        self._sync = sync
        self.rebuild: Rebuild | None = None  # what rebuilding a damaged or lost index found, if this open did
        self._env: lmdb.Environment | None = None
        self._loaded: list[RawEntry] = []
        index_dir = directory / "index.lmdb"
        # never let lmdb map an index it cannot trust (a truncated one faults the process):
        # a damaged or lost one is moved aside and rebuilt from the self-describing segments
        damage = index_damage(index_dir)
        if damage is not None:
            self._set_aside(index_dir, damage)
        seg_hint = min(segment_bytes, capacity) // PAGE * PAGE
        try:
            for attempt in (1, 2):
                try:
                    if self.rebuild is not None:
                        seg_hint = segment_bytes_on_disk(directory, segment_name) or seg_hint
                    self.segment_bytes = self._open_env(index_dir, capacity, seg_hint, segment_bytes)
                    if self.rebuild is None:
                        env = self._env
                        assert env is not None
                        with env.begin() as txn:
                            self._loaded = list(txn.cursor(db=self._db))
                    break
                except lmdb.Error as e:  # damage the check did not see
                    if attempt == 2 or self.rebuild is not None:
                        raise
                    self.close()
                    self._set_aside(index_dir, f"lmdb: {e!r}")
        except BaseException:
            self.close()
            raise

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
            sync=self._sync,
            metasync=self._sync,
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

    def take_loaded(self) -> list[RawEntry]:
        """The entries lmdb held at open (once; empty when the index is being rebuilt)."""
        raw, self._loaded = self._loaded, []
        return raw

    def fill(self, found: list[tuple[int, Found]]) -> list[RawEntry]:
        """Commit the records a segment scan found as the whole index (one txn, synced); its entries."""
        assert self._env is not None
        raw = [
            (bytes(r.meta.key), Entry(r.meta.key, r.meta, seg, r.offset, r.length, 0, seq).value())
            for seq, (seg, r) in enumerate(found, start=1)
        ]
        with self._env.begin(write=True) as txn:
            for k, v in raw:
                txn.put(k, v, db=self._db)
        self._env.sync(True)
        return raw

    def commit(self, drained: list[Entry], entries: list[Entry]) -> None:
        """One write transaction: delete ``drained`` (if lmdb still holds them as they were), put ``entries``."""
        assert self._env is not None
        try:
            try:
                self._commit_txn(drained, entries)
            except lmdb.MapFullError:  # the map was sized for typical churn: double it, once
                self._env.set_mapsize(self._env.info()["map_size"] * 2)
                self._commit_txn(drained, entries)
        except lmdb.Error as e:  # mapped once, here: callers see the tier's error types
            if isinstance(e, (lmdb.MapFullError, lmdb.DiskError)):
                raise CapacityExceeded(f"the NVMe index under {self.directory} cannot grow: {e}") from e
            raise OSError(errno.EIO, f"the NVMe index under {self.directory} failed: {e!r}") from e

    def _commit_txn(self, drained: list[Entry], entries: list[Entry]) -> None:
        assert self._env is not None
        with self._env.begin(write=True) as txn:
            failpoints.hit("nvme.index.commit", errors={"enospc": lmdb.DiskError, "edquot": lmdb.DiskError})
            for p in drained:  # only if lmdb still holds that very entry
                v = txn.get(p.key, db=self._db)
                if v is not None and seq_of(v) == p.seq:
                    txn.delete(p.key, db=self._db)
            for e in entries:
                txn.put(e.key, e.value(), db=self._db)

    def tidy(self, drop: list[bytes], rewrite: dict[bytes, bytes]) -> None:
        """After an open: delete the entries it dropped, rewrite migrated ones.  Best effort: a
        full disk leaves them, and the next open drops (or migrates) them again."""
        assert self._env is not None
        for attempt in (1, 2) if drop or rewrite else ():
            try:
                with self._env.begin(write=True) as txn:
                    for key in drop:
                        txn.delete(key, db=self._db)
                    for key, value in rewrite.items():  # version 1 -> 2: the next open reads no header
                        txn.put(key, value, db=self._db)
                break
            except lmdb.Error as e:  # a full disk: they are only out of memory, and dropped again next time
                if attempt == 1 and isinstance(e, lmdb.MapFullError):  # version 2 entries are longer
                    self._env.set_mapsize(self._env.info()["map_size"] * 2)
                    continue
                log.warning(
                    "could not update %d entries of the NVMe index of %s: %r",
                    len(drop) + len(rewrite),
                    self.directory,
                    e,
                )

    def sync(self) -> None:
        """Force what lmdb holds to disk (an index opened with ``sync=False`` needs it at close)."""
        if self._env is not None:
            self._env.sync(True)

    def close(self) -> None:
        """Close the environment.  Idempotent."""
        if self._env is not None:
            env, self._env = self._env, None
            env.close()


@dataclasses.dataclass(slots=True)
class Loaded:
    """The in-memory index an open rebuilt from lmdb's entries, and what it found on the way."""

    entries: dict[ChunkKey, Entry]
    order: list[tuple[ChunkKey, ChunkKey, int]]  # (key, parent, record length), oldest first: for the policy
    drop: list[bytes]  # entries to delete from lmdb
    rewrite: dict[bytes, bytes]  # version-1 entries, as version 2
    corrupt: int  # malformed, overlapping or failing their header check
    dropped: int  # valid, but beyond a reduced capacity
    top_seq: int  # the largest sequence number seen


HeaderReader = Callable[[int, int, bytes], BlockMeta]
"""``read_header(segment, offset, key)``: the meta in a record's header (``Segments.read_header``)."""


def load_entries(raw: list[RawEntry], layout: Layout, alloc: ExtentAllocator, read_header: HeaderReader) -> Loaded:
    """Rebuild memory from lmdb's entries: a scan of the index, no record read.

    Version-2 entries carry their block's meta (checked for self-consistency here,
    decoded on first use; the header on disk is checked on every read).  Version-1
    entries (older directories) have their record's header read and are rewritten as
    version 2.  Entries that overlap keep the newest; bad ones are dropped and counted.
    Every kept entry's extent is reserved in ``alloc``."""
    out = Loaded({}, [], [], {}, 0, 0, 0)
    drop = out.drop
    kept: list[tuple[int, int, int, bytes, bytes]] = []  # (vaddr, length, seq, key, value)
    sizes, stride, nseg = layout.sizes, layout.stride, len(layout.sizes)
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
            out.corrupt += 1
            drop.append(key)
            continue
        _, seg, off, length, seq, _ = fields
        if seg >= nseg or off + length > sizes[seg]:
            out.dropped += 1
            drop.append(key)
            continue
        if off % PAGE or length % PAGE or length < PAGE:
            out.corrupt += 1
            drop.append(key)
            continue
        kept.append((seg * stride + off, length, seq, key, value))
    kept = _reserve_extents(kept, alloc, out)
    migrate = [k for k in kept if k[4][0] == INDEX_VALUE_V1]
    metas = _read_headers(migrate, layout, alloc, read_header, out) if migrate else {}
    kept.sort(key=lambda k: k[2])  # parents are mostly older: insert them first
    index, order = out.entries, out.order
    for vaddr, length, seq, key, value in kept:
        seg, off = divmod(vaddr, stride)
        ck = ChunkKey(key)
        if value[0] == INDEX_VALUE_VERSION:
            index[ck] = Entry(ck, None, seg, off, length, vaddr, seq, value)
            order.append((ck, index_parent(value), length))
        elif (meta := metas.get(key)) is not None:
            index[ck] = Entry(ck, meta, seg, off, length, vaddr, seq)
            order.append((ck, meta.parent, length))
    out.rewrite = {key: index[ChunkKey(key)].value() for key in metas}
    out.top_seq = top
    return out


def _reserve_extents(
    kept: list[tuple[int, int, int, bytes, bytes]], alloc: ExtentAllocator, out: Loaded
) -> list[tuple[int, int, int, bytes, bytes]]:
    """Reserve the entries' extents in the allocator; of overlapping ones the newest wins."""
    kept.sort()
    try:
        alloc.reserve_many(kept)  # type: ignore[arg-type]  # it reads (offset, length) and ignores the rest
        return kept
    except InvalidArgument:  # two entries overlap (a damaged index): reserve nothing that way
        pass
    done = []
    for k in sorted(kept, key=lambda k: -k[2]):  # a damaged index: one at a time, newest first
        try:
            alloc.reserve_exact(Extent(k[0], k[1]))
        except InvalidArgument:
            out.corrupt += 1
            out.drop.append(k[3])
            continue
        done.append(k)
    return done


def _read_headers(
    todo: list[tuple[int, int, int, bytes, bytes]],
    layout: Layout,
    alloc: ExtentAllocator,
    read_header: HeaderReader,
    out: Loaded,
) -> dict[bytes, BlockMeta]:
    """The metas of version-1 entries, from their records' headers (checked against the entry)."""
    metas: dict[bytes, BlockMeta] = {}
    for vaddr, length, _, key, value in sorted(todo):
        seg, off = layout.place(vaddr)
        try:
            meta = read_header(seg, off, key)
            if meta.payload_checksum != INDEX_VALUE.unpack(value)[5] or record_bytes(meta.payload_len) != length:
                raise CorruptBlock("header disagrees with the index")
        except (BlockFormatError, OSError) as e:
            if isinstance(e, OSError) and e.errno not in MEDIA_ERRORS:
                raise
            log.warning("dropping NVMe block %s at open: %s", key.hex(), e)
            out.corrupt += 1
            alloc.free([Extent(vaddr, length)])
            out.drop.append(key)
            continue
        metas[key] = meta
    return metas

"""The NVMe tier's on-disk format (how a record lies in a segment, what an index entry holds)
and the raw I/O helpers that read and write it.

Role: the layout shared by the segment I/O (``tiers/nvme_segments.py``), which writes and
reads records, the index (``tiers/nvme_index.py``), which stores and loads entries, and the
index recovery (``tiers/nvme_recovery.py``), which finds records again without an index.
No state.

A record is the 160-byte block header (``kvstore.block``) padded to one ``PAGE``, then
the payload padded to ``PAGE``; it starts on a page boundary of its segment and never
straddles two segments.  The header is self-describing (magic, key, payload length and
checksum, header checksum), so a segment can be read back with no index at all.

An index entry maps a 16-byte key to ``INDEX_VALUE``: format version, segment, offset,
record length, sequence number (newer writes have larger ones) and payload checksum.
Version 2 (:func:`index_value`) follows it with the rest of the block's header fields
(``INDEX_META`` and the shape), so an open rebuilds every block's meta from the index alone
and reads no record: the header on disk is still checked against it on every read.
Version 1 entries (older directories) are read with their record's header at open and
rewritten as version 2.
"""

from __future__ import annotations

import errno
import mmap
import os
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kvstore.block import DTYPES, MAX_NDIM, BlockMeta
from kvstore.errors import CorruptBlock, InvalidArgument
from kvstore.keys import ChunkKey

PAGE = 4096
INDEX_VALUE = struct.Struct("<BxxxIQQQQ")  # version, segment, offset, record length, seq, payload checksum
INDEX_META = struct.Struct("<8s16sIBBxxQ")  # v2: namespace, parent, token count, dtype code, ndim, payload length
INDEX_VALUE_VERSION = 2
INDEX_VALUE_V1 = 1  # location only: the meta is in the record's header
_META_AT = INDEX_VALUE.size
_SHAPE_AT = INDEX_VALUE.size + INDEX_META.size
_DIMS = [struct.Struct(f"<{n}Q") for n in range(MAX_NDIM + 1)]
_DTYPE_BY_CODE = {code: (name, size) for name, (code, size) in DTYPES.items()}


def record_bytes(payload_len: int) -> int:
    """Bytes one record takes on disk: a header page plus the payload padded to pages."""
    return PAGE + -(-payload_len // PAGE) * PAGE


def index_value(seg: int, off: int, length: int, seq: int, meta: BlockMeta) -> bytes:
    """The version-2 index entry of ``meta``'s record at ``(seg, off)``."""
    code = DTYPES[meta.dtype][0]
    return (
        INDEX_VALUE.pack(INDEX_VALUE_VERSION, seg, off, length, seq, meta.payload_checksum)
        + INDEX_META.pack(meta.namespace, meta.parent, meta.token_count, code, len(meta.shape), meta.payload_len)
        + _DIMS[len(meta.shape)].pack(*meta.shape)
    )


def index_payload_len(value: bytes) -> int | None:
    """The payload length a version-2 entry declares, if the entry is whole and self-consistent
    (known dtype, ndim, length, shape × itemsize == payload length); None if it is not.

    Cheap (no objects beyond a few ints): run on every entry at open, so :func:`index_meta`
    of an entry that passed cannot fail later."""
    if len(value) < _SHAPE_AT:
        return None
    _, _, _, dcode, ndim, plen = INDEX_META.unpack_from(value, _META_AT)
    dt = _DTYPE_BY_CODE.get(dcode)
    if dt is None or ndim > MAX_NDIM or len(value) != _SHAPE_AT + 8 * ndim:
        return None
    if ndim:
        n = dt[1]
        for d in _DIMS[ndim].unpack_from(value, _SHAPE_AT):
            n *= d
        if n != plen:
            return None
    return plen


def index_parent(value: bytes) -> ChunkKey:
    """The parent key of a version-2 entry (the eviction policy needs it at open)."""
    return ChunkKey(value[_META_AT + 8 : _META_AT + 24])


def index_meta(key: ChunkKey, value: bytes) -> BlockMeta:
    """The block meta a version-2 entry holds; ``CorruptBlock`` if it does not describe one."""
    try:
        _, _, _, _, _, pcs = INDEX_VALUE.unpack_from(value)
        ns, parent, tokens, dcode, ndim, plen = INDEX_META.unpack_from(value, _META_AT)
        shape = _DIMS[ndim].unpack_from(value, _SHAPE_AT)
        return BlockMeta(ns, key, ChunkKey(parent), tokens, _DTYPE_BY_CODE[dcode][0], shape, plen, pcs)
    except (struct.error, KeyError, IndexError, InvalidArgument) as e:
        raise CorruptBlock(f"index entry of {bytes(key).hex()} does not describe a block: {e}") from None


def segment_name(i: int) -> str:
    return f"seg-{i:05d}.dat"


def io_all(op: Callable[[int, list, int], int], fd: int, bufs: list[memoryview], off: int) -> None:
    """``os.preadv``/``os.pwritev`` until every buffer is done (short transfers continue)."""
    bufs = [b for b in bufs if b.nbytes]
    while bufs:
        n = op(fd, bufs, off)
        if n <= 0:
            raise OSError(errno.EIO, f"short I/O at offset {off}: the segment file ends early")
        off += n
        while bufs and n >= bufs[0].nbytes:
            n -= bufs[0].nbytes
            bufs.pop(0)
        if n:
            bufs[0] = bufs[0][n:]


def addr(mv: memoryview) -> int:
    """The address of ``mv``'s first byte (O_DIRECT wants page-aligned buffers)."""
    return int(np.frombuffer(mv, dtype=np.uint8).__array_interface__["data"][0]) if mv.nbytes else 0


def probe_direct_io(directory: Path) -> bool | None:
    """True if ``directory``'s filesystem accepts an aligned O_DIRECT write; None if it
    cannot tell because the filesystem is full (a node must still start there)."""
    probe = directory / ".direct_io_probe"
    buf = mmap.mmap(-1, PAGE)
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
        try:
            return os.pwrite(fd, buf, 0) == PAGE
        finally:
            os.close(fd)
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return False
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            return None
        raise
    finally:
        buf.close()
        probe.unlink(missing_ok=True)


def close_stage(stage: mmap.mmap) -> None:
    """Unmap a staging buffer, or leave it to the GC while a view of it lives."""
    try:
        stage.close()
    except BufferError:  # a view still lives (a traceback frame): the GC unmaps it later
        pass

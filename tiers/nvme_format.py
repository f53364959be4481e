"""The NVMe tier's on-disk format (how a record lies in a segment, what an index entry holds)
and the raw I/O helpers that read and write it.

Role: the layout shared by the tier (``tiers/nvme.py``), which writes and reads records,
and the index recovery (``tiers/nvme_recovery.py``), which finds them again without an
index.  No state.

A record is the 160-byte block header (``kvstore.block``) padded to one ``PAGE``, then
the payload padded to ``PAGE``; it starts on a page boundary of its segment and never
straddles two segments.  The header is self-describing (magic, key, payload length and
checksum, header checksum), so a segment can be read back with no index at all.

An index entry maps a 16-byte key to ``INDEX_VALUE``: format version, segment, offset,
record length, sequence number (newer writes have larger ones) and payload checksum.
"""

from __future__ import annotations

import errno
import mmap
import os
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np

PAGE = 4096
INDEX_VALUE = struct.Struct("<BxxxIQQQQ")  # version, segment, offset, record length, seq, payload checksum
INDEX_VALUE_VERSION = 1


def record_bytes(payload_len: int) -> int:
    """Bytes one record takes on disk: a header page plus the payload padded to pages."""
    return PAGE + -(-payload_len // PAGE) * PAGE


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

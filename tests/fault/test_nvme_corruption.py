"""Damaged NVMe data directories: flipped payload and header bytes, bogus index entries, a
truncated segment.  A damaged block is dropped and counted, never served; the rest survive."""

from __future__ import annotations

import os
import shutil
import struct
from pathlib import Path

import lmdb
import pytest
import xxhash

from kvstore.block import BlockMeta
from kvstore.keys import ChunkKey
from tiers.base import MissReason
from tiers.nvme import PAGE, NVMeTier, record_bytes

MiB = 1 << 20
SIZE = 100_000


def key(i: int) -> ChunkKey:
    return ChunkKey(xxhash.xxh3_128_digest(b"fault/%d" % i))


def payload(i: int) -> bytes:
    return (xxhash.xxh3_64_digest(b"%d" % i) * (SIZE // 8 + 1))[:SIZE]


def open_tier(d: Path, **kw: object) -> NVMeTier:
    return NVMeTier(d, 8 * MiB, segment_bytes=2 * MiB, **kw)  # type: ignore[arg-type]


@pytest.fixture
def filled(tmp_path: Path) -> Path:
    d = tmp_path / "nvme"
    with open_tier(d) as t:
        t.write_many([(BlockMeta.for_payload(key(i), payload(i)), payload(i)) for i in range(10)])
    return d


def flip(path: Path, offset: int) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        b = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([b[0] ^ 0x40]), offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def locations(d: Path) -> dict[int, tuple[Path, int]]:
    with open_tier(d) as t:
        return {i: (loc.path, loc.record_offset) for i in range(10) if (loc := t.locate(key(i)))}


def test_flipped_payload_byte_in_segment_file(filled: Path) -> None:
    path, off = locations(filled)[4]
    flip(path, off + PAGE + SIZE - 1)  # the payload's last byte
    with open_tier(filled) as t:
        assert t.contains(key(4)) and t.corrupt_blocks == 0  # restart checks headers, not payloads
        out = bytearray(SIZE)
        assert t.read_into(key(4), out).miss is MissReason.CORRUPT
        assert t.corrupt_blocks == 1 and not t.contains(key(4))
        for i in set(range(10)) - {4}:
            assert t.read_into(key(i), out).hit and bytes(out) == payload(i)
    with open_tier(filled) as t:  # the drop was persisted
        assert not t.contains(key(4)) and len(t) == 9 and t.corrupt_blocks == 0


def test_flipped_header_byte_dropped_on_first_read(filled: Path) -> None:
    path, off = locations(filled)[7]
    flip(path, off + 100)  # inside the 160-byte header: its checksum fails
    with open_tier(filled) as t:  # an open scans the index only (issue 15 #3)
        assert t.corrupt_blocks == 0 and t.contains(key(7))
        assert t.read_into(key(7), bytearray(SIZE)).miss is MissReason.CORRUPT
        assert t.corrupt_blocks == 1 and not t.contains(key(7)) and len(t) == 9
        assert t.used_bytes == 9 * record_bytes(SIZE)
    with open_tier(filled) as t:  # the drop was persisted
        assert not t.contains(key(7)) and len(t) == 9


def test_bogus_index_entries_dropped_at_open(filled: Path) -> None:
    env = lmdb.open(str(filled / "index.lmdb"), max_dbs=2)
    db = env.open_db(b"blocks")
    with env.begin(write=True) as txn:
        value = struct.pack("<BxxxIQQQQ", 1, 3, 2 * MiB - 2 * PAGE, 2 * PAGE, 99, 0)
        txn.put(b"A" * 16, value, db=db)  # points at never-written (zero) space
        txn.put(b"B" * 16, b"garbage", db=db)  # not a location at all
        txn.put(b"C" * 16, struct.pack("<BxxxIQQQQ", 1, 0, 0, PAGE, 0, 0), db=db)  # overlaps a real block
    env.close()
    with open_tier(filled) as t:
        assert t.corrupt_blocks == 3 and len(t) == 10
        out = bytearray(SIZE)
        assert all(t.read_into(key(i), out).hit and bytes(out) == payload(i) for i in range(10))


def test_truncated_segment_file(filled: Path) -> None:
    locs = locations(filled)
    seg0 = [i for i, (p, _) in locs.items() if p.name == "seg-00000.dat"]
    assert len(seg0) > 1
    os.truncate(filled / "seg-00000.dat", 0)  # e.g. a botched copy of the directory
    with open_tier(filled) as t:  # preallocation restores the size; the zeros fail the headers on read
        out = bytearray(SIZE)
        assert [t.read_into(key(i), out).miss for i in seg0] == [MissReason.CORRUPT] * len(seg0)
        assert t.corrupt_blocks == len(seg0) and len(t) == 10 - len(seg0)
        assert all(t.read_into(key(i), out).hit for i in locs if i not in seg0)


def test_version_1_index_read_with_headers_and_rewritten(filled: Path) -> None:
    """An index written before issue 15 (locations only) opens by reading each record's
    header, once: the entries are rewritten with their meta, so the next open reads none."""
    env = lmdb.open(str(filled / "index.lmdb"), max_dbs=2)
    db = env.open_db(b"blocks")
    with env.begin(write=True) as txn:
        for k, v in list(txn.cursor(db=db)):
            txn.put(k, struct.pack("<B", 1) + v[1:40], db=db)  # the version-1 entry: location and checksum
    env.close()
    path, off = locations(filled)[5]  # this open migrates
    env = lmdb.open(str(filled / "index.lmdb"), max_dbs=2)
    with env.begin() as txn:
        assert {v[0] for _, v in txn.cursor(db=env.open_db(b"blocks", txn=txn))} == {2}
    env.close()
    flip(path, off + 100)  # a damaged header is no longer read at open: found on read
    with open_tier(filled) as t:
        assert len(t) == 10 and t.corrupt_blocks == 0
        assert t.meta(key(3)) == BlockMeta.for_payload(key(3), payload(3))
        out = bytearray(SIZE)
        assert all(t.read_into(key(i), out).hit and bytes(out) == payload(i) for i in range(10) if i != 5)
        assert t.read_into(key(5), out).miss is MissReason.CORRUPT


def test_lost_index_rebuilt_from_segments_drops_damaged_records(filled: Path) -> None:
    """Issue 13 #6: with the index gone, the segments' records are found again; a record
    whose payload was damaged meanwhile is dropped and counted, never indexed."""
    path, off = locations(filled)[3]
    flip(path, off + PAGE + 10)
    shutil.rmtree(filled / "index.lmdb")
    with open_tier(filled) as t:
        assert t.recovery() == {"index_rebuilds": 1, "recovered_blocks": 9, "dropped_records": 1}
        assert not t.contains(key(3)) and t.used_bytes == 9 * record_bytes(SIZE)
        out = bytearray(SIZE)
        assert all(t.read_into(key(i), out).hit and bytes(out) == payload(i) for i in set(range(10)) - {3})
        t.write(BlockMeta.for_payload(key(3), payload(3)), payload(3))  # into free space, not over a recovered block
        assert all(t.read_into(key(i), out).hit and bytes(out) == payload(i) for i in range(10))
    with open_tier(filled) as t:  # the rebuilt index is the index now
        assert t.recovery()["index_rebuilds"] == 0 and len(t) == 10

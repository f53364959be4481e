"""NVMe tier: round trips, space accounting, eviction order, restart, locking, corruption, threads."""

from __future__ import annotations

import errno
import mmap
import os
import random
import stat
import threading
from pathlib import Path

import pytest
import xxhash

from kvstore.block import BlockMeta, checksum
from kvstore.errors import CapacityExceeded, DataDirLocked, InvalidArgument, Unavailable
from kvstore.keys import ChunkKey
from tiers.base import MissReason, Tier, TierKind
from tiers.nvme import PAGE, NVMeTier, record_bytes
from tiers.policy import DEFAULT_POLICY, LRUPolicy, PrefixAwareLRUPolicy, make_policy

MiB = 1 << 20


def key(i: int | str) -> ChunkKey:
    return ChunkKey(xxhash.xxh3_128_digest(f"k{i}".encode()))


def payload(i: int | str, size: int, version: int = 0) -> bytes:
    seed = xxhash.xxh3_64_digest(f"{i}/{version}".encode())
    return (seed * (size // 8 + 1))[:size] if size < 64 else random.Random(seed).randbytes(size)


def block(i: int | str, size: int, version: int = 0, parent: bytes | None = None) -> tuple[BlockMeta, bytes]:
    data = payload(i, size, version)
    kw = {"parent": parent} if parent is not None else {}
    return BlockMeta.for_payload(key(i), data, **kw), data


def read(tier: NVMeTier, k: bytes) -> bytes | None:
    m = tier.meta(ChunkKey(k))
    if m is None:
        return None
    out = bytearray(m.payload_len)
    r = tier.read_into(ChunkKey(k), out)
    return bytes(out) if r.hit else None


@pytest.fixture(params=["buffered", "auto"])
def direct_io(request: pytest.FixtureRequest) -> bool | None:
    return False if request.param == "buffered" else None


@pytest.fixture
def make(tmp_path: Path, direct_io: bool | None):
    opened: list[NVMeTier] = []

    def _make(capacity: int = 16 * MiB, **kw: object) -> NVMeTier:
        kw.setdefault("segment_bytes", 4 * MiB)
        kw.setdefault("direct_io", direct_io)
        kw.setdefault("sync", False)
        t = NVMeTier(tmp_path / "nvme", capacity, **kw)  # type: ignore[arg-type]
        opened.append(t)
        return t

    yield _make
    for t in opened:
        t.close()


def test_is_a_tier(make) -> None:
    t = make()
    assert isinstance(t, Tier) and t.kind is TierKind.NVME
    assert t.stats()["direct_io"] is t.direct_io


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 4097, MiB + 3])
def test_round_trip_byte_identical(make, size: int) -> None:
    t = make()
    meta, data = block("x", size)
    t.write(meta, data)
    assert t.contains(meta.key) and t.meta(meta.key) == meta and len(t) == 1
    assert t.used_bytes == record_bytes(size)
    assert read(t, meta.key) == data
    aligned = mmap.mmap(-1, size + PAGE)  # page-aligned caller buffer: the zero-copy path
    r = t.read_into(meta.key, aligned)
    assert r.hit and r.nbytes == size and r.meta == meta and aligned[:size] == data
    src = mmap.mmap(-1, max(size, 1))  # aligned source buffer for the write side
    src[:size] = data
    t.write(meta, memoryview(src)[:size])
    assert read(t, meta.key) == data and t.used_bytes == record_bytes(size)


def test_mixed_sizes_and_unaligned_views(make) -> None:
    t = make(capacity=32 * MiB)
    rng = random.Random(1)
    sizes = {i: rng.choice([1, 100, 4096, 8191, 65536 + 7, 300_000]) for i in range(40)}
    for i, size in sizes.items():
        meta, data = block(i, size)
        t.write(meta, memoryview(b"\0" + data)[1:])  # deliberately misaligned source
    for i, size in sizes.items():
        out = bytearray(size + 9)
        r = t.read_into(key(i), memoryview(out)[3:])  # deliberately misaligned destination
        assert r.hit and bytes(out[3 : 3 + size]) == payload(i, size)
    assert t.used_bytes == sum(record_bytes(s) for s in sizes.values())


def test_miss_and_bad_arguments(make) -> None:
    t = make()
    assert t.read_into(key("absent"), bytearray(10)).miss is MissReason.NOT_PRESENT
    meta, data = block("a", 5000)
    with pytest.raises(InvalidArgument):
        t.write(meta, data[:-1])  # length contradicts meta
    with pytest.raises(InvalidArgument):
        t.write(meta, bytes(5000))  # checksum contradicts meta
    t.write(meta, data)
    with pytest.raises(InvalidArgument):
        t.read_into(meta.key, bytearray(4999))
    with pytest.raises(InvalidArgument):
        t.read_into(meta.key, bytes(5000))
    assert t.used_bytes == record_bytes(5000)


def test_overwrite_replaces_and_frees(make) -> None:
    t = make()
    m1, d1 = block("o", 10_000, version=1)
    m2, d2 = block("o", 50_000, version=2)
    t.write(m1, d1)
    t.write(m2, d2)
    assert len(t) == 1 and t.meta(m2.key) == m2 and read(t, m2.key) == d2
    assert t.used_bytes == record_bytes(50_000)


def test_delete_frees_space(make) -> None:
    t = make()
    for i in range(10):
        t.write(*block(i, 100_000))
    assert t.delete(key(3)) and not t.delete(key(3))
    assert not t.contains(key(3)) and read(t, key(3)) is None and len(t) == 9
    for i in range(10):
        t.delete(key(i))
    assert t.used_bytes == 0 and len(t) == 0


def test_capacity_never_exceeded(make) -> None:
    t = make(capacity=4 * MiB + 5, segment_bytes=MiB)
    assert t.capacity_bytes == 4 * MiB
    with pytest.raises(CapacityExceeded, match="segment"):
        t.write(*block("huge", MiB))  # record = 1 MiB + a header page > one segment
    rng = random.Random(2)
    written = 0
    for i in range(200):
        size = rng.randrange(1, 300_000)
        fits = t.fits(size)
        try:
            t.write(*block(i, size))
            written += 1
            assert fits
        except CapacityExceeded:
            assert not fits
            victim = next(t.victims())
            t.delete(victim)
        assert t.used_bytes <= t.capacity_bytes
    assert written > 20


def test_write_many_all_or_nothing_on_full(make) -> None:
    t = make(capacity=2 * MiB, segment_bytes=MiB)
    items = [block(i, 400_000) for i in range(6)]  # 6 × ~404 KiB > 2 MiB
    with pytest.raises(CapacityExceeded, match="evict first"):
        t.write_many(items)
    assert len(t) == 0 and t.used_bytes == 0
    t.write_many(items[:4])
    assert all(read(t, m.key) == d for m, d in items[:4])


def test_write_many_group_commit(make, monkeypatch: pytest.MonkeyPatch) -> None:
    t = make(sync=True)
    calls: list[int] = []
    real = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (calls.append(fd), real(fd)))
    items = [block(i, 50_000) for i in range(20)]  # ~1 MiB: lands in one 4 MiB segment
    t.write_many(items)
    assert len(calls) == 1
    calls.clear()
    for m, d in items:
        t.write(m, d)
    assert len(calls) == len(items)
    assert all(read(t, m.key) == d for m, d in items)


def test_victims_lru_order_and_skipping(make) -> None:
    t = make(policy=LRUPolicy())
    for name in "abcd":
        t.write(*block(name, 1000))
    read(t, key("a"))
    assert list(t.victims()) == [key(n) for n in "bcda"]
    seen = []
    for k in t.victims(can_evict=lambda k: k != key("b")):
        seen.append(k)
        if k == key("c"):
            t.delete(k)
            break
    assert seen == [key("c")]
    assert list(t.victims()) == [key(n) for n in "bda"]  # the skipped block kept its place


def test_victims_prefix_aware_children_first(make) -> None:
    t = make(policy=PrefixAwareLRUPolicy())
    t.write(*block("root", 1000))
    t.write(*block("child", 1000, parent=key("root")))
    read(t, key("child"))  # touched more recently, but a child still goes first
    order = []
    for k in t.victims():
        order.append(k)
        t.delete(k)
    assert order == [key("child"), key("root")]


def test_reader_defers_free_and_hides_from_victims(make, monkeypatch: pytest.MonkeyPatch) -> None:
    t = make()
    meta, data = block("busy", 200_000)
    t.write(meta, data)
    entered, go = threading.Event(), threading.Event()
    real = os.preadv

    def slow_preadv(fd: int, bufs: list, off: int) -> int:
        entered.set()
        assert go.wait(10)
        return real(fd, bufs, off)

    monkeypatch.setattr(os, "preadv", slow_preadv)
    out = bytearray(meta.payload_len)
    result: list = []
    th = threading.Thread(target=lambda: result.append(t.read_into(meta.key, out)))
    th.start()
    assert entered.wait(10)
    assert list(t.victims()) == []  # being read: not proposed
    assert t.delete(meta.key) and not t.contains(meta.key)
    assert t.used_bytes == record_bytes(200_000)  # space still held by the reader
    go.set()
    th.join(10)
    assert result[0].hit and bytes(out) == data
    assert t.used_bytes == 0


def test_restart_reindexes_byte_identical(make) -> None:
    t = make(sync=True)
    rng = random.Random(3)
    sizes = {i: rng.choice([1, 4097, 100_000, 700_000]) for i in range(30)}
    for i, size in sizes.items():
        t.write(*block(i, size))
    t.write_many([block(f"m{i}", 5000) for i in range(5)])
    for i in range(0, 30, 3):
        t.delete(key(i))
        del sizes[i]
    used = t.used_bytes
    t.close()
    t2 = make(sync=True)
    assert len(t2) == len(sizes) + 5 and t2.used_bytes == used and t2.corrupt_blocks == 0
    for i, size in sizes.items():
        assert read(t2, key(i)) == payload(i, size)
    assert read(t2, key(0)) is None
    # a reopened tier keeps writing into free space without clobbering survivors
    for i in range(100, 110):
        t2.write(*block(i, 100_000))
    assert all(read(t2, key(i)) == payload(i, s) for i, s in sizes.items())


def test_restart_keeps_layout_and_drops_beyond_smaller_capacity(make) -> None:
    t = make(capacity=8 * MiB, segment_bytes=2 * MiB)
    for i in range(12):
        t.write(*block(i, 600_000))  # three records per segment: fills all four
    assert len({t.locate(key(i)).path.name for i in range(12)}) == 4  # type: ignore[union-attr]
    t.close()
    t2 = make(capacity=4 * MiB, segment_bytes=MiB)  # asks for other segments: the stored layout wins
    assert t2.segment_bytes == 2 * MiB and t2.capacity_bytes == 4 * MiB
    assert t2.dropped_on_open == 6 and t2.corrupt_blocks == 0 and len(t2) == 6
    assert sorted(p.name for p in (t2.directory).glob("seg-*")) == ["seg-00000.dat", "seg-00001.dat"]
    for i in range(12):
        got = read(t2, key(i))
        assert got is None or got == payload(i, 600_000)


def test_data_dir_locked(make, tmp_path: Path) -> None:
    t = make()
    with pytest.raises(DataDirLocked, match=str(tmp_path / "nvme")):
        NVMeTier(tmp_path / "nvme", 16 * MiB, sync=False)
    t.close()
    with pytest.raises(Unavailable):
        t.write(*block("late", 10))
    make().close()  # the lock was released


def test_corrupt_header_dropped_on_first_read_not_at_restart(make) -> None:
    """A restart scans the index and reads no record (issue 15 #3): a damaged header is
    found by the first read of its block, which drops and counts it; the others serve."""
    t = make()
    for i in range(5):
        t.write(*block(i, 30_000))
    loc = t.locate(key(2))
    assert loc is not None
    t.close()
    with open(loc.path, "r+b") as f:
        f.seek(loc.record_offset + 20)
        b = f.read(1)
        f.seek(loc.record_offset + 20)
        f.write(bytes([b[0] ^ 0xFF]))
    t2 = make()
    assert t2.corrupt_blocks == 0 and len(t2) == 5
    assert t2.read_into(key(2), bytearray(30_000)).miss is MissReason.CORRUPT
    assert t2.corrupt_blocks == 1 and not t2.contains(key(2)) and len(t2) == 4
    assert t2.used_bytes == 4 * record_bytes(30_000)
    assert all(read(t2, key(i)) == payload(i, 30_000) for i in (0, 1, 3, 4))


def test_flipped_payload_byte_is_a_corrupt_miss(make) -> None:
    t = make()
    for i in range(3):
        t.write(*block(i, 70_000))
    loc = t.locate(key(1))
    assert loc is not None
    with open(loc.path, "r+b") as f:  # behind the open tier's back
        f.seek(loc.payload_offset + 12345)
        b = f.read(1)
        f.seek(loc.payload_offset + 12345)
        f.write(bytes([b[0] ^ 0x01]))
    out = bytearray(70_000)
    r = t.read_into(key(1), out)
    assert r.miss is MissReason.CORRUPT and r.meta is None
    assert t.corrupt_blocks == 1 and not t.contains(key(1)) and len(t) == 2
    assert t.read_into(key(1), out).miss is MissReason.NOT_PRESENT
    assert t.used_bytes == 2 * record_bytes(70_000)
    assert read(t, key(0)) == payload(0, 70_000)
    t.close()
    t2 = make()
    assert not t2.contains(key(1)) and len(t2) == 2


def test_fallback_when_filesystem_refuses_o_direct(make, monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.open

    def no_direct(path, flags, *a, **kw):  # type: ignore[no-untyped-def]
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(path, flags, *a, **kw)

    monkeypatch.setattr(os, "open", no_direct)
    with pytest.raises(InvalidArgument, match="O_DIRECT"):
        make(direct_io=True)
    t = make(direct_io=None)
    assert t.direct_io is False
    meta, data = block("f", 9999)
    t.write(meta, data)
    assert read(t, meta.key) == data


def test_disk_full_on_write_and_on_preallocate(make, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    t = make()
    t.write(*block("keep", 1000))

    def full(*a: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(os, "pwritev", full)
        with pytest.raises(CapacityExceeded, match="full"):
            t.write_many([block("a", 5000), block("b", 5000)])
    assert not t.contains(key("a")) and not t.contains(key("b"))
    assert t.used_bytes == record_bytes(1000)
    t.write(*block("a", 5000))
    assert read(t, key("a")) == payload("a", 5000)
    monkeypatch.setattr(os, "posix_fallocate", full)
    other = NVMeTier(tmp_path / "other", 16 * MiB, sync=False)  # segments are preallocated on first use
    with pytest.raises(CapacityExceeded, match="preallocate"):
        other.write(*block("c", 5000))
    assert not other.contains(key("c")) and other.used_bytes == 0
    monkeypatch.undo()
    other.write(*block("c", 5000))
    assert read(other, key("c")) == payload("c", 5000)
    other.close()


def test_threads_read_write_delete(make) -> None:
    t = make(capacity=24 * MiB, policy=LRUPolicy())
    keys = [f"t{i}" for i in range(24)]
    errors: list[BaseException] = []
    stop = threading.Event()

    def content(name: str, version: int, size: int) -> tuple[BlockMeta, bytes]:
        body = key(name) + version.to_bytes(8, "little") + payload(name, size - 24, version)
        return BlockMeta.for_payload(key(name), body), body

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for n in range(150):
                if stop.is_set():
                    return
                name = rng.choice(keys)
                op = rng.random()
                if op < 0.35:
                    try:
                        t.write(*content(name, n, rng.choice([5000, 70_000, 300_001])))
                    except CapacityExceeded:
                        for v in t.victims():
                            t.delete(v)
                            break
                elif op < 0.45:
                    t.delete(key(name))
                else:
                    out = bytearray(300_001)
                    r = t.read_into(key(name), out)
                    if r.hit:
                        assert r.meta is not None
                        got = out[: r.nbytes]
                        assert bytes(got[:16]) == key(name) and checksum(got) == r.meta.payload_checksum
                    else:
                        assert r.miss is MissReason.NOT_PRESENT
        except BaseException as e:  # reported below
            errors.append(e)
            stop.set()

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors, errors
    assert t.corrupt_blocks == 0 and t.used_bytes <= t.capacity_bytes
    present = [k for k in keys if t.contains(key(k))]
    assert t.used_bytes == sum(record_bytes(t.meta(key(k)).payload_len) for k in present)  # type: ignore[union-attr]
    for k in present:
        assert read(t, key(k)) is not None


@pytest.mark.parametrize("size", [0, 1, 4096, 8191, 8192, 12288, 12289, 50_000])
def test_direct_io_chunks_through_small_staging_buffers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    import tiers.nvme_segments as segments

    monkeypatch.setattr(segments, "STAGE_BYTES", 3 * PAGE)  # records span many staging chunks
    with NVMeTier(tmp_path / "d", 4 * MiB, segment_bytes=MiB, sync=False) as t:
        meta, data = block("c", size)
        t.write(meta, memoryview(b"\0" + data)[1:])  # unaligned: staged in chunks when direct
        out = bytearray(size + 1)
        r = t.read_into(meta.key, memoryview(out)[1:])
        assert r.hit and bytes(out[1:]) == data
        aligned = mmap.mmap(-1, size + PAGE)
        assert t.read_into(meta.key, aligned).hit and aligned[:size] == data


def test_count_prefix_stats_and_queued_deletes(make) -> None:
    t = make()
    for i in range(4):
        t.write(*block(i, 20_000))
    assert t.count_prefix([key(0), key(1), key(9), key(2)]) == 2
    assert t.count_prefix([]) == 0
    t.delete(key(1))
    s = t.stats()
    assert s["blocks"] == 3 and s["pending_index_deletes"] == 1 and s["used_bytes"] == t.used_bytes
    t.write(*block("reuse", 20_000))  # lands in the deleted block's space: the delete commits first
    assert t.stats()["pending_index_deletes"] == 0
    assert t.locate(key("reuse")).record_offset == record_bytes(20_000)  # type: ignore[union-attr]


def test_media_error_is_a_corrupt_miss_other_errors_propagate(make, monkeypatch: pytest.MonkeyPatch) -> None:
    t = make()
    t.write(*block("m", 9000))
    t.write(*block("n", 9000))

    def failing(code: int):  # type: ignore[no-untyped-def]
        def preadv(*a: object) -> int:
            raise OSError(code, os.strerror(code))

        return preadv

    with monkeypatch.context() as m:
        m.setattr(os, "preadv", failing(errno.EBADF))
        with pytest.raises(OSError):
            t.read_into(key("n"), bytearray(9000))
        m.setattr(os, "preadv", failing(errno.EIO))
        assert t.read_into(key("m"), bytearray(9000)).miss is MissReason.CORRUPT
    assert t.contains(key("n")) and not t.contains(key("m")) and t.corrupt_blocks == 1
    assert read(t, key("n")) == payload("n", 9000)


def test_close_waits_for_reads_in_flight(make, monkeypatch: pytest.MonkeyPatch) -> None:
    t = make()
    meta, data = block("slow", 50_000)
    t.write(meta, data)
    entered, go = threading.Event(), threading.Event()
    real = os.preadv

    def slow_preadv(fd: int, bufs: list, off: int) -> int:
        entered.set()
        assert go.wait(10)
        return real(fd, bufs, off)

    monkeypatch.setattr(os, "preadv", slow_preadv)
    out = bytearray(50_000)
    result: list = []
    reader = threading.Thread(target=lambda: result.append(t.read_into(meta.key, out)))
    reader.start()
    assert entered.wait(10)
    closer = threading.Thread(target=t.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive()  # waiting for the reader
    with pytest.raises(Unavailable):
        t.read_into(meta.key, out)
    go.set()
    reader.join(10)
    closer.join(10)
    assert not closer.is_alive() and result[0].hit and bytes(out) == data


def test_default_policy_and_admission(make) -> None:
    t = make()
    assert type(t.policy) is type(make_policy(DEFAULT_POLICY))
    assert t.admit(key("any"), 1000) is True


def test_segments_take_disk_space_only_when_used_regression(tmp_path: Path) -> None:
    """A large, empty tier must not claim its whole capacity from the filesystem at open
    (a test run, or a node with a generous --nvme on a small disk, filled the disk)."""

    def on_disk(d: Path) -> int:
        return sum(p.stat().st_blocks * 512 for p in d.glob("seg-*.dat"))

    t = NVMeTier(tmp_path / "big", 1 << 30, segment_bytes=64 * MiB, sync=False)
    assert on_disk(tmp_path / "big") < MiB
    t.write(*block("first", 5000))
    assert 64 * MiB <= on_disk(tmp_path / "big") < 65 * MiB  # just the first segment, preallocated whole
    t.close()
    t = NVMeTier(tmp_path / "big", 1 << 30, segment_bytes=64 * MiB, sync=False)  # reopen keeps it
    assert read(t, key("first")) == payload("first", 5000)
    t.close()


def test_index_was_world_readable(tmp_path: Path) -> None:
    """``index.lmdb`` (every stored key and namespace) was created 0644; now 0600 like the segments,
    in a directory its owner can still search (lmdb would mkdir it with the file mode)."""
    old = os.umask(0o022)
    try:
        t = NVMeTier(tmp_path / "nvme", 16 * MiB, segment_bytes=4 * MiB, direct_io=False, sync=False)
    finally:
        os.umask(old)
    try:
        index = tmp_path / "nvme" / "index.lmdb"
        assert stat.S_IMODE(index.stat().st_mode) == 0o700
        for name in ("data.mdb", "lock.mdb"):
            assert stat.S_IMODE((index / name).stat().st_mode) == 0o600, name
    finally:
        t.close()

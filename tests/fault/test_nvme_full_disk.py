"""Issue 13 #4: a full disk turned local puts into ``KVStoreError: Unexpected <class
'lmdb.DiskError'> … [UNKNOWN]``.

A real node keeps its NVMe tier on a small tmpfs.  After the segment is preallocated, a
filler file takes the rest of the filesystem, so the next index transaction cannot grow
``index.lmdb`` (ENOSPC inside lmdb: ``lmdb.DiskError``).  Puts that need DRAM space go on
demoting: every one must still succeed (the demotion fails open and is counted), every
block must read back as its own bytes or as a miss, and once space is freed demotions
work again.  Needs root (mount); CI runs the fault suite as root.
"""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import xxhash
from small_disk import fill, small_tmpfs

from client import KVClient

SIZE = 200_000


def key(i: int) -> bytes:
    return xxhash.xxh3_128_digest(b"full-disk/%d" % i)


def payload(i: int) -> bytes:
    return (xxhash.xxh3_64_digest(b"%d" % i) * (SIZE // 8 + 1))[:SIZE]


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 40 MiB tmpfs of this test's own."""
    with small_tmpfs(tmp_path / "disk", 40) as mnt:
        yield mnt


def counters(kv: KVClient) -> dict[str, int]:
    return kv.stats()["counters"]


@pytest.mark.timeout(180)
def test_full_disk_fails_demotions_open_never_puts(small_fs: Path, node_factory: Any) -> None:
    n = node_factory("--dram", "4MiB", "--nvme", "32MiB", "--metrics-port", "0", data_dir=small_fs / "node")
    try:
        with KVClient(n.unix) as kv:
            for i in range(40):  # 8 MB through a 4 MiB arena: the segment is preallocated, demotions work
                assert kv.put(key(i), payload(i))
            assert counters(kv).get("demotions", 0) > 0
            fill(small_fs / "filler")
            failures: list[str] = []
            for i in range(40, 400):
                try:
                    assert kv.put(key(i), payload(i))
                except Exception as e:  # before the fix: KVStoreError … lmdb.DiskError … [UNKNOWN]
                    failures.append(f"put {i}: {e!r}")
            assert not failures, f"{len(failures)} puts failed on a full disk: {failures[:3]}"
            c = counters(kv)
            assert c.get("nvme_write_failures", 0) > 0, f"the full disk was never hit: {c}"
            got = [kv.get(key(i)) for i in range(400)]
            assert all(g is None or g == payload(i) for i, g in enumerate(got)), "wrong bytes after a full disk"
            text = urllib.request.urlopen(n.endpoints["metrics"], timeout=10).read().decode()
            m = re.search(r"^kvstore_nvme_write_failures_total (\S+)$", text, re.M)
            assert m and float(m.group(1)) >= c["nvme_write_failures"]  # reads since may have demoted (and failed) more

            (small_fs / "filler").unlink()  # space again: demotions resume
            before = counters(kv).get("demotions", 0)
            for i in range(400, 440):
                assert kv.put(key(i), payload(i))
            assert counters(kv).get("demotions", 0) > before
            assert all(kv.get(key(i)) in (None, payload(i)) for i in range(440))
    finally:
        assert n.stop(timeout=60) == 0  # the mount goes after the node that holds its files


@pytest.mark.timeout(120)
def test_regression_node_restarted_on_a_full_disk_starts_and_serves_its_blocks(
    small_fs: Path, node_factory: Any
) -> None:
    """Bug (found by the chaos test, tests/fault/test_chaos.py): a node killed and started
    again while its disk was full died at start (rc 1, ``OSError: [Errno 28]`` from the
    O_DIRECT probe's one-page write), so its durable blocks stayed unreachable until
    someone freed space and restarted it.  A full disk fails open at start too: the node
    starts, serves its NVMe blocks, and its puts succeed."""
    data_dir = small_fs / "node"
    n = node_factory("--dram", "4MiB", "--nvme", "32MiB", "--write-through", data_dir=data_dir)
    with KVClient(n.unix) as kv:
        assert all(kv.put(key(i), payload(i)) for i in range(20))
    n.kill9()
    fill(small_fs / "filler")
    again = node_factory("--dram", "4MiB", "--nvme", "32MiB", "--write-through", data_dir=data_dir)
    try:
        with KVClient(again.unix) as kv:
            assert [kv.get(key(i)) == payload(i) for i in range(20)] == [True] * 20  # from NVMe: the arena is new
            assert all(kv.put(key(i), payload(i)) for i in range(20, 40))
            assert all(kv.get(key(i)) in (None, payload(i)) for i in range(40))
    finally:
        assert again.stop(timeout=60) == 0


@pytest.mark.timeout(120)
def test_regression_write_through_put_of_a_block_held_in_dram_alone_is_durable_when_acknowledged(
    small_fs: Path, node_factory: Any
) -> None:
    """Bug (found building the chaos test's durability check): with ``--write-through``, a
    put of a key the node held in DRAM alone (its first put met a full disk, which fails
    open) answered ``EXISTS`` at once, acknowledged, and wrote nothing, also after space was
    freed: kill -9 lost blocks acknowledged by puts made while the disk had room.  (A put racing the first put's group
    commit was acknowledged early the same way.)  Now such an ``EXISTS`` answers once the
    block is on disk, as a commit does."""
    data_dir = small_fs / "node"
    args = ("--dram", "16MiB", "--nvme", "32MiB", "--write-through")
    n = node_factory(*args, data_dir=data_dir)
    with KVClient(n.unix) as kv:
        assert kv.put(key(0), payload(0))  # the segment is preallocated
        fill(small_fs / "filler")
        assert all(kv.put(key(i), payload(i)) for i in range(1, 6))  # acknowledged from DRAM: the disk is full
        assert counters(kv).get("nvme_write_failures", 0) >= 5
        (small_fs / "filler").unlink()
        assert all(kv.put(key(i), payload(i)) for i in range(1, 6))  # room again: these acknowledgements promise disk
    n.kill9()
    again = node_factory(*args, data_dir=data_dir)
    try:
        with KVClient(again.unix) as kv:
            assert [kv.get(key(i)) == payload(i) for i in range(6)] == [True] * 6
    finally:
        assert again.stop(timeout=60) == 0

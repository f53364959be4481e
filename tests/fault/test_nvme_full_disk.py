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

import errno
import os
import re
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import xxhash

from client import KVClient

SIZE = 200_000


def key(i: int) -> bytes:
    return xxhash.xxh3_128_digest(b"full-disk/%d" % i)


def payload(i: int) -> bytes:
    return (xxhash.xxh3_64_digest(b"%d" % i) * (SIZE // 8 + 1))[:SIZE]


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 40 MiB tmpfs of this test's own."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem needs root (CI runs the fault suite as root)")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=40m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(path: Path) -> int:
    """Write ``path`` until the filesystem is full; the bytes written."""
    n = 0
    chunk = bytes(1 << 16)
    with open(path, "wb", buffering=0) as f:
        while True:
            try:
                n += f.write(chunk)
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
                return n


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

"""A small filesystem of a test's own (a tmpfs), and filling it up: for full-disk faults.

``small_tmpfs`` mounts a tmpfs of a given size at a directory and unmounts it (lazily, so
a process still holding files there does not keep it) when the ``with`` block ends; it
skips the test where mounting is not possible (not root, no tmpfs).  ``fill`` writes a
file until the filesystem is full.  Whoever calls them owns the mount and the filler.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_tmpfs(mnt: Path, size_mib: int) -> Iterator[Path]:
    """A ``size_mib`` MiB tmpfs mounted at ``mnt`` (created) for the ``with`` block."""
    mnt.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem needs root (CI runs the fault suite as root)")
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False, timeout=30)


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

"""What killed vLLM servers leave in /dev/shm is removed after them (``reclaim_shm``), and
nothing another process still has open or mapped is ever touched."""

from __future__ import annotations

import subprocess
import sys
import uuid

import pytest

from kvstore.children import SHM, reclaim_shm, shm_names

pytestmark = pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm on this system")


def test_only_new_unheld_entries_of_the_named_kinds_are_removed() -> None:
    tag = f"kvtest{uuid.uuid4().hex[:8]}"
    old = SHM / f"psm_{tag}_old"
    old.write_bytes(b"x" * 4096)  # there before: someone else's
    before = shm_names()
    left, mapped, opened = (SHM / f"psm_{tag}_{n}" for n in ("left", "mapped", "opened"))
    other = SHM / f"kvstore-{tag}.arena"  # not a kind it removes
    for f in (left, mapped, opened):
        f.write_bytes(b"x" * 4096)
    other.write_bytes(b"x")
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import mmap, sys, time\n"
            f"f = open({str(mapped)!r}, 'r+b'); m = mmap.mmap(f.fileno(), 0); f.close()\n"
            f"g = open({str(opened)!r}, 'rb')\n"
            "print('up', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "up"
        gone = reclaim_shm(before, prefixes=(f"psm_{tag}",))
        assert gone == [left.name]
        assert not left.exists() and mapped.exists() and opened.exists() and old.exists() and other.exists()
    finally:
        holder.kill()
        holder.wait()
    assert sorted(reclaim_shm(before, prefixes=(f"psm_{tag}",))) == sorted([mapped.name, opened.name])
    for f in (old, other):
        f.unlink()


def test_a_live_processs_named_semaphore_is_never_removed() -> None:
    """glibc maps a named semaphore under the temporary name it created it as
    (``/dev/shm/sem.XXXXXX (deleted)``), so a check by name alone took a live vLLM
    server's ``sem.mp-*`` for a leftover and unlinked it: the worker that then opened it
    died (``FileNotFoundError`` unpickling a ``SemLock``), and the engine with it.  The
    inode tells; once the holder is gone the semaphore is removed."""
    before = shm_names()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import multiprocessing as mp, time\n"
            "lock = mp.get_context('spawn').Lock()\n"  # a named POSIX semaphore, as vLLM's spawns use
            "print('up', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,  # its resource tracker's complaint when it finds the semaphore gone
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "up"
        sems = [n for n in shm_names() - before if n.startswith("sem.mp-")]
        assert sems, "the holder's semaphore is not in /dev/shm"
        assert [n for n in reclaim_shm(before) if n in sems] == []
        assert all((SHM / n).exists() for n in sems)
    finally:
        holder.kill()
        holder.wait()
    reclaim_shm(before)  # killed: its semaphore is left over now
    assert not any((SHM / n).exists() for n in sems)

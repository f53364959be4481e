"""Issue 13 #5: ``--write-through`` acknowledged puts before they were durable.

A real ``kvstore serve --write-through`` node takes puts from a few client threads; each
thread records a put as acknowledged only once ``put`` returned True.  The node is killed
with SIGKILL mid-stream and restarted on the same data directory: every acknowledged
block must be there, byte for byte (it can only come from NVMe: the arena is new).
Before the fix the persist ran in the background after the answer, and a kill lost the
last tens of acknowledged puts.

The data directory is a filesystem of the test's own (a tmpfs: kill -9 leaves the page cache,
so it keeps what a disk would).  On the machine's shared disk, other tests filling it made
the NVMe writes fail, and write-through fails open on a full disk (an acknowledgement from
DRAM, counted in ``nvme_write_failures``; ``test_nvme_full_disk.py`` checks that case): a
clean-clone CI run lost 143 of 604 acknowledged puts so, on a disk other runs had filled.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import xxhash
from small_disk import small_tmpfs

from client import KVClient
from kvstore.errors import KVStoreError

SIZES = (1, 4097, 65_536, 200_001)
THREADS = 3


def block(thread: int, i: int) -> tuple[bytes, bytes]:
    key = xxhash.xxh3_128_digest(b"wt/%d/%d" % (thread, i))
    size = SIZES[i % len(SIZES)]
    return key, (xxhash.xxh3_64_digest(key) * (size // 8 + 1))[:size]


def _put_until_dead(target: str, thread: int, acked: list[int], stop: threading.Event) -> None:
    kv = KVClient(target)
    try:
        i = 0
        while not stop.is_set():
            key, data = block(thread, i)
            if kv.put(key, data):
                acked.append(i)
            i += 1
    except (KVStoreError, OSError):
        pass  # the node died under us: what was acknowledged before that is all that counts
    finally:
        try:
            kv.close()
        except Exception:
            pass


@pytest.mark.timeout(180)
@pytest.mark.parametrize("run", range(2))
def test_write_through_loses_no_acknowledged_put_under_kill9(node_factory: Any, tmp_path: Path, run: int) -> None:
    with small_tmpfs(tmp_path / "disk", 384) as disk:  # 256 MiB of NVMe, its index, room to spare
        _check_kill9(node_factory, disk / "wt", run)


def _check_kill9(node_factory: Any, data_dir: Path, run: int) -> None:
    node = node_factory("--dram", "256MiB", "--nvme", "256MiB", "--write-through", data_dir=data_dir)
    acked: list[list[int]] = [[] for _ in range(THREADS)]
    stop = threading.Event()
    threads = [
        threading.Thread(target=_put_until_dead, args=(node.unix, t, acked[t], stop), daemon=True)
        for t in range(THREADS)
    ]
    for t in threads:
        t.start()
    time.sleep(1.5 + run)
    node.kill9()  # the clients are mid-put: the last answers went out just before the kill
    stop.set()
    for t in threads:
        t.join(30)
    total = sum(map(len, acked))
    assert total > 20, f"only {total} puts were acknowledged before the kill"

    again = node_factory("--dram", "256MiB", "--nvme", "256MiB", "--write-through", data_dir=data_dir)
    kv = KVClient(again.unix)
    try:
        lost, wrong = [], []
        for t in range(THREADS):
            for i in acked[t]:
                key, data = block(t, i)
                got = kv.get(key)
                if got is None:
                    lost.append((t, i))
                elif got != data:
                    wrong.append((t, i))
        # where the lost ones are (a tier, or nowhere), and what both nodes said: a failure names its cause
        where = kv.lookup([block(t, i)[0] for t, i in lost[:20]]) if lost else []
    finally:
        kv.close()
    assert not wrong, f"{len(wrong)} acknowledged blocks read back with wrong bytes"
    assert not lost, (
        f"{len(lost)} of {total} acknowledged write-through puts were lost by kill -9: {lost[:10]}; "
        f"the restarted node places the first of them in {where}\n"
        f"killed node's log:\n{''.join(node.output[-40:])}\nrestarted node's log:\n{''.join(again.output[-40:])}"
    )
    assert again.stop(timeout=60) == 0  # before its filesystem goes
    print(f"{total} write-through puts acknowledged in {1.5 + run:.1f} s by {THREADS} clients; none lost")

"""Issue 13 #6: a damaged NVMe index stopped the node; a lost one threw away every NVMe block.

A real node stores 400 blocks on NVMe and stops; its ``index.lmdb`` is then truncated to
half (SIGBUS at start before the fix), zeroed for 64 KiB at its start or in its middle
(``lmdb.InvalidError`` / ``CorruptedError``), overwritten with garbage, or deleted (the
node started with 0 blocks and reused their space).  The node must start every time, move
the damaged index aside, rebuild it from the segment files, serve every recovered block
byte for byte, export the counts on ``/metrics``, and not overwrite recovered blocks with
new ones.
"""

from __future__ import annotations

import os
import re
import shutil
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import xxhash
from conftest import NodeProcess

from client import KVClient

BLOCKS = 400
SIZES = (1, 4096, 30_000, 65_536, 100_001)
NODE = ("--dram", "16MiB", "--nvme", "256MiB", "--metrics-port", "0")


def key(i: int) -> bytes:
    return xxhash.xxh3_128_digest(b"index-damage/%d" % i)


def payload(i: int) -> bytes:
    size = SIZES[i % len(SIZES)]
    return (xxhash.xxh3_64_digest(b"%d" % i) * (size // 8 + 1))[:size]


def _overwrite(path: Path, offset: int, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


DAMAGE: dict[str, Callable[[Path], None]] = {
    "truncated_to_half": lambda f: os.truncate(f, f.stat().st_size // 2),
    "zeroed_64k_at_start": lambda f: _overwrite(f, 0, bytes(64 << 10)),
    "zeroed_64k_in_middle": lambda f: _overwrite(f, 8192, bytes(64 << 10)),
    "garbage": lambda f: _overwrite(f, 0, os.urandom(f.stat().st_size)),
    "deleted": lambda f: shutil.rmtree(f.parent),
}


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data directory whose NVMe tier holds the 400 blocks (after a graceful stop)."""
    d = tmp_path_factory.mktemp("index-damage") / "node"
    n = NodeProcess(d, *NODE).start()
    try:
        with KVClient(n.unix) as kv:
            for i in range(0, BLOCKS, 50):
                assert (
                    kv.put_many([key(j) for j in range(i, i + 50)], [payload(j) for j in range(i, i + 50)])
                    == [True] * 50
                )
    finally:
        assert n.stop(timeout=60) == 0  # SIGTERM demotes what is still only in DRAM
        Path(n.arena_path).unlink(missing_ok=True)
    assert len(list((d / "nvme").glob("seg-*.dat"))) >= 1
    return d


def _metric(n: NodeProcess, name: str) -> float:
    text = urllib.request.urlopen(n.endpoints["metrics"], timeout=10).read().decode()
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    assert m, f"{name} is not exported"
    return float(m.group(1))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_node_starts_on_a_damaged_index_and_recovers_its_blocks(
    stored: Path, tmp_path: Path, node_factory: Any, damage: str
) -> None:
    d = tmp_path / "node"
    shutil.copytree(stored, d)
    DAMAGE[damage](d / "nvme" / "index.lmdb" / "data.mdb")
    t0 = time.monotonic()
    n = node_factory(*NODE, data_dir=d)
    started_s = time.monotonic() - t0
    log = "".join(n.output)
    assert "rebuilt the NVMe index" in log, log
    if damage != "deleted":
        assert (d / "nvme" / "index.lmdb.damaged").is_dir()  # kept for a post-mortem, not deleted
    recovered = _metric(n, "kvstore_nvme_recovered_blocks_total")
    assert _metric(n, "kvstore_nvme_index_rebuilds_total") == 1
    assert recovered >= 0.95 * BLOCKS, f"recovered {recovered} of {BLOCKS}"
    with KVClient(n.unix) as kv:
        got = [kv.get(key(i)) for i in range(BLOCKS)]
        assert all(g is None or g == payload(i) for i, g in enumerate(got)), "a recovered block has wrong bytes"
        assert sum(g is not None for g in got) == recovered
        # new blocks go to free space only: the recovered ones are still whole after they are demoted
        more = [(xxhash.xxh3_128_digest(b"after/%d" % i), os.urandom(200_000)) for i in range(200)]
        for j in range(0, len(more), 20):
            assert kv.put_many([k for k, _ in more[j : j + 20]], [v for _, v in more[j : j + 20]]) == [True] * 20
        assert [kv.get(key(i)) for i in range(BLOCKS)] == got
        assert all(kv.get(k) == v for k, v in more)
    print(f"{damage}: started in {started_s:.2f} s, recovered {recovered:.0f} of {BLOCKS} blocks")

"""Every step of an NVMe put and demotion, failed on purpose in a real node (issue 13, "Also").

The node runs with ``KVSTORE_FAILPOINTS`` (``tiers/failpoints.py``): one named step
(``nvme.preallocate``, ``nvme.write``, ``nvme.sync``, ``nvme.index.commit``) passes a few
times, then fails as a full disk (ENOSPC), a failing one (EIO), a short write (a record's
header without its payload) or a crash (SIGKILL at exactly that step).  After each:

* no put fails with the disk's error (a cache fails open) — a crash fails only the put
  under way, which was never acknowledged;
* every block reads back as its own bytes or as a miss, before and after a restart;
* nothing acknowledged as durable is lost: in write-through mode the puts answered before
  the step first failed are on NVMe after kill -9 and a restart;
* a torn record left by a short write is never indexed, not even by an index rebuild.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import xxhash
from conftest import NodeProcess

from client import KVClient
from kvstore.errors import KVStoreError

PASSES = 4  # the step succeeds this many times, then fails for ever
PUTS = 10
SIZE = 100_000


def key(i: int) -> bytes:
    return xxhash.xxh3_128_digest(b"failpoint/%d" % i)


def payload(i: int) -> bytes:
    return (xxhash.xxh3_64_digest(b"%d" % i) * (SIZE // 8 + 1))[:SIZE]


def check(n: NodeProcess, count: int, durable: range) -> list[bytes | None]:
    """Every block is its own bytes or a miss; the ``durable`` ones are all there."""
    with KVClient(n.unix) as kv:
        got = [kv.get(key(i)) for i in range(count)]
    assert all(g is None or g == payload(i) for i, g in enumerate(got)), "a block read back with wrong bytes"
    lost = [i for i in durable if got[i] is None]
    assert not lost, f"acknowledged-durable blocks lost: {lost}"
    return got


WRITE_THROUGH = [
    ("nvme.preallocate", "enospc"),
    ("nvme.preallocate", "eio"),
    ("nvme.preallocate", "kill"),
    ("nvme.write", "enospc"),
    ("nvme.write", "eio"),
    ("nvme.write", "short"),
    ("nvme.write", "kill"),
    ("nvme.sync", "eio"),
    ("nvme.sync", "kill"),
    ("nvme.index.commit", "enospc"),
    ("nvme.index.commit", "eio"),
    ("nvme.index.commit", "kill"),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("point", "action"), WRITE_THROUGH)
def test_write_through_put_fails_at_each_step(node_factory: Any, tmp_path: Path, point: str, action: str) -> None:
    d = tmp_path / "node"
    passes = 0 if point == "nvme.preallocate" else PASSES  # a segment is preallocated once
    node = node_factory(
        "--dram",
        "64MiB",
        "--nvme",
        "64MiB",
        "--write-through",
        data_dir=d,
        env={"KVSTORE_FAILPOINTS": f"{point}={action}@{passes}"},
    )
    acked: list[int] = []
    with KVClient(node.unix) as kv:
        for i in range(PUTS):  # one at a time: each put is one group commit, one pass of each step
            try:
                assert kv.put(key(i), payload(i))
            except KVStoreError:
                assert action == "kill" and i == passes, f"put {i} failed"
                break
            acked.append(i)
    assert acked == list(range(passes if action == "kill" else PUTS))
    if action != "kill":
        check(node, PUTS, range(PUTS))  # all still in DRAM
    node.kill9()
    again = node_factory("--dram", "64MiB", "--nvme", "64MiB", data_dir=d)
    got = check(again, PUTS, range(passes))
    assert all(g is None for g in got[passes + 1 :]), "a put whose NVMe write failed was indexed"
    assert again.stop(timeout=30) == 0
    if action == "short":  # the torn record is in the segment: a rebuild must not take it
        shutil.rmtree(d / "nvme" / "index.lmdb")
        rebuilt = node_factory("--dram", "64MiB", "--nvme", "64MiB", data_dir=d)
        assert "rebuilt the NVMe index" in "".join(rebuilt.output)
        got = check(rebuilt, PUTS, range(passes))
        assert all(g is None for g in got[passes + 1 :])


DEMOTION = [("nvme.write", "enospc"), ("nvme.write", "short"), ("nvme.sync", "eio"), ("nvme.index.commit", "enospc")]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("point", "action"), DEMOTION)
def test_demotion_fails_open_at_each_step(node_factory: Any, tmp_path: Path, point: str, action: str) -> None:
    d = tmp_path / "node"
    node = node_factory(
        "--dram", "4MiB", "--nvme", "64MiB", data_dir=d, env={"KVSTORE_FAILPOINTS": f"{point}={action}@{PASSES}"}
    )
    count = 80  # 8 MB through a 4 MiB arena: most of it must be demoted
    with KVClient(node.unix) as kv:
        for i in range(count):
            assert kv.put(key(i), payload(i)), f"put {i}"
        c = kv.stats()["counters"]
    assert c.get("nvme_write_failures", 0) > 0 and c.get("demotions", 0) >= 1, c
    check(node, count, range(0))
    assert node.stop(timeout=30) == 0  # the shutdown flush fails too: logged, not fatal
    again = node_factory("--dram", "4MiB", "--nvme", "64MiB", data_dir=d)
    got = check(again, count, range(0))
    assert sum(g is not None for g in got) >= 1  # what was demoted before the step failed

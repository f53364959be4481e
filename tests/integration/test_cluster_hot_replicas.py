"""Hot keys with a real etcd and real nodes (issue 19, item 3): a read-hot key's owner publishes
it, readers spread over the extra copies (filling them on first read), deletes reach the
extras, a dead extra costs nothing but a retry, and the copies go when the heat cools."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from cluster_fixtures import Cluster, cluster, etcd, wait_until  # noqa: F401 - fixtures

from client import KVClient, Namespace
from kvstore.cluster.hot import extras
from kvstore.cluster.placement import BoundedTable

NODES = ("h1", "h2", "h3", "h4", "h5")


def start(cluster: Cluster) -> KVClient:
    cluster.set("replication", 1)
    cluster.set("hot_extras", 3)
    cluster.set("hot_reads_per_s", 5)
    cluster.set("hot_window_s", 0.3)
    cluster.start(*NODES)
    kv = cluster.client()
    assert kv.wait_for_nodes(len(NODES), 15)
    return kv


def read_until(kv: KVClient, key: bytes, want: bytes | None, pred, timeout: float = 20.0) -> int:
    """Read ``key`` in a loop (every answer must be ``want``) until ``pred()``; the number of reads."""
    n, deadline = 0, time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        assert kv.get(key) == want
        n += 1
    return n


def holders(cluster: Cluster, key: bytes, skip: set[str] = frozenset()) -> set[str]:  # type: ignore[assignment]
    out = set()
    for nid, p in cluster.nodes.items():
        if nid in skip:
            continue
        with KVClient(p.tcp) as node:
            if node.exists([key])[0]:
                out.add(nid)
    return out


def stored_hot_candidate(
    kv: Any, ns: Namespace, tokens: int, index: int, seed: int, nbytes: int
) -> tuple[bytes, bytes]:
    """One chunk of ``ns`` stored with random bytes: its key and the bytes every copy must hold."""
    key = kv.chunk_keys(np.arange(tokens), ns)[index]
    data = np.random.default_rng(seed).integers(0, 255, nbytes, dtype=np.uint8)
    assert kv.put_many([key], [data], namespace=ns) == [True]
    return key, data.tobytes()


def test_hot_key_spreads_fills_extras_and_deletes_reach_them(cluster: Cluster) -> None:
    kv = start(cluster)
    ns = Namespace("hot-1")
    key, want = stored_hot_candidate(kv, ns, 256, 0, seed=1, nbytes=8192)
    table = BoundedTable(list(NODES))
    owner = table.owners(key, 1)
    ext = extras(table, key, 1, 3)
    assert len(ext) == 3
    # heat: the owner publishes the key with 3 extras
    read_until(kv, key, want, lambda: kv.snapshot().hot.get(key) == 3)
    assert kv.owners(key) == owner
    # readers spread over the 4 copies; the extras fill on first read
    read_until(kv, key, want, lambda: holders(cluster, key) == {*owner, *ext})
    core = kv._core  # type: ignore[attr-defined]
    assert core.hot_reads > 0 and core.hot_fills >= 1
    for _ in range(200):
        assert kv.get(key) == want
    # every copy answers with the block's own bytes (checksums verified end to end)
    for nid in ext:
        with KVClient(cluster.nodes[nid].tcp) as node:
            assert node.get(key) == want
    # a delete reaches every copy, the extras' included
    assert kv.delete([key]) == 4
    assert holders(cluster, key) == set()
    assert kv.get(key) is None and kv.exists([key]) == [False]


def test_hot_key_survives_a_dead_extra_and_its_copies_go_when_it_cools(cluster: Cluster) -> None:
    kv = start(cluster)
    ns = Namespace("hot-2")
    key, want = stored_hot_candidate(kv, ns, 512, 1, seed=2, nbytes=4096)
    table = BoundedTable(list(NODES))
    owner = table.owners(key, 1)
    ext = extras(table, key, 1, 3)
    read_until(kv, key, want, lambda: kv.snapshot().hot.get(key) == 3)
    read_until(kv, key, want, lambda: holders(cluster, key) == {*owner, *ext})
    # an extra dies: every read still answers (it is skipped after its first failure)
    dead = ext[0]
    cluster.nodes[dead].kill9()
    t0 = time.monotonic()
    for _ in range(100):
        assert kv.get(key) == want
        assert kv.match_prefix([key]) == 1
    assert time.monotonic() - t0 < 30
    # the heat cools: the record goes, the live extras drop their copies, the owner keeps its own
    wait_until(lambda: key not in kv.snapshot().hot, 15, "the hot record to go")
    wait_until(lambda: holders(cluster, key, skip={dead}) == set(owner), 15, "the extras to drop their copies")
    assert kv.get(key) == want


def test_invalidation_reaches_the_extra_copies(cluster: Cluster) -> None:
    kv = start(cluster)
    ns = Namespace("hot-3")
    key, want = stored_hot_candidate(kv, ns, 256, 0, seed=3, nbytes=4096)
    table = BoundedTable(list(NODES))
    read_until(kv, key, want, lambda: kv.snapshot().hot.get(key) == 3)
    read_until(kv, key, want, lambda: len(holders(cluster, key)) == 4)
    kv.invalidate(ns)  # counts what the RPC dropped: nodes that saw the epoch bump first reclaimed theirs already
    wait_until(lambda: holders(cluster, key) == set(), 10, "every copy of the old epoch to go")
    assert kv.get(key) is None
    fresh = kv.chunk_keys(np.arange(256), ns)[0]
    assert fresh != key and kv.get(fresh) is None
    assert table.owners(key, 1)  # the placement itself is unchanged

"""The cluster SDK against nodes with a small ``max_batch``: no call it makes to a node carries
more keys or blocks than that node's limit (a node refuses such a request whole).

Regression (hand-off reads over ``max_batch``): the cluster client's own per-node calls
bypassed the single-node SDK's splitting.  A hand-off read fetched every key it wanted from a
previous owner in one ``GetStream`` and copied every block it found to the new owner in one
``PutStream``, so a read that found more than ``max_batch`` blocks on one previous owner
failed with ``InvalidArgument`` (and the copy of more than ``max_batch`` blocks was refused).
"""

from __future__ import annotations

import asyncio

import numpy as np
from cluster_fixtures import Cluster, cluster, etcd  # noqa: F401 - fixtures

from client import KVClient, Namespace, Timeouts, connect_async
from kvstore.cluster.placement import BoundedTable

LIMIT = 4
N = 3 * LIMIT


def keys_and_data(n: int, seed: int) -> tuple[list[bytes], list[bytes]]:
    """Deterministic keys (so placement over fixed node ids is too) and odd-sized payloads."""
    rng = np.random.default_rng(seed)
    keys = [rng.bytes(16) for _ in range(n)]
    return keys, [rng.bytes(1000 + 37 * i) for i in range(n)]


def test_cluster_batches_fit_each_nodes_max_batch(cluster: Cluster) -> None:
    cluster.set("replication", 2)
    cluster.start("m1", "m2", "m3", extra=("--max-batch", str(LIMIT)))
    kv = cluster.client()
    assert kv.wait_for_nodes(3, 10)
    ns = Namespace("m-max-batch")
    keys = kv.chunk_keys(np.arange(256 * N), ns)
    _, data = keys_and_data(N, seed=11)
    ring = BoundedTable(["m1", "m2", "m3"])
    per_node = {n: sum(n in ring.owners(k, 2) for k in keys) for n in ("m1", "m2", "m3")}
    assert max(per_node.values()) > LIMIT, per_node  # some node gets more than one request's worth
    assert kv.put_many(keys, data, namespace=ns) == [True] * N
    assert kv.get_many(keys) == data
    outs = [bytearray(len(d)) for d in data]
    assert kv.get_many_into(keys, outs) == [len(d) for d in data] and [bytes(o) for o in outs] == data
    assert kv.match_prefix(keys) == N and kv.exists(keys) == [True] * N
    assert kv.lookup(keys) == ["dram"] * N
    assert kv.pin(keys, 60) == 2 * N and kv.unpin(keys) == 2 * N
    assert kv.delete(keys) == 2 * N
    assert kv.match_prefix(keys) == 0 and kv.get_many(keys) == [None] * N

    async def the_async_client() -> None:
        async with connect_async(cluster.target, timeouts=Timeouts(rpc=2, data=5, connect=1)) as akv:
            assert await akv.put_many(keys, data, namespace=ns) == [True] * N
            assert await akv.get_many(keys) == data
            assert await akv.match_prefix(keys) == N
            assert await akv.delete(keys) == 2 * N

    asyncio.run(the_async_client())
    assert kv.stats()["suspects"] == {}  # no node failed a call along the way


def test_handoff_read_over_max_batch_regression(cluster: Cluster) -> None:
    cluster.start("h1", "h2", extra=("--max-batch", str(LIMIT)))  # replication 1: each block has one owner
    kv = cluster.client()
    assert kv.wait_for_nodes(2, 10)
    keys, data = keys_and_data(32 * LIMIT, seed=3)
    assert kv.put_many(keys, data) == [True] * len(keys)
    (h3,) = cluster.start("h3", extra=("--max-batch", str(LIMIT)))
    assert kv.wait_for_nodes(3, 10)
    before = BoundedTable(["h1", "h2"])
    # the keys whose owner changed: h3's, and (bounded-v1) the few the bounded overflow moves between h1 and h2
    moved = [i for i, k in enumerate(keys) if kv.owners(k) != before.owners(k, 1)]
    to_h3 = [i for i in moved if kv.owners(keys[i]) == ["h3"]]
    # each previous owner serves more than one request's worth, and the new owner receives that much
    first, second = moved[: len(moved) // 2], moved[len(moved) // 2 :]
    for part in (first, second):
        served = {n: sum(before.owners(keys[i], 1) == [n] for i in part) for n in ("h1", "h2")}
        assert min(served.values()) > LIMIT, served
    with KVClient(h3.tcp) as new_owner:
        assert not any(new_owner.exists([keys[i] for i in to_h3]))
        # the new owner misses; the previous owners answer; the blocks are copied over
        assert kv.get_many([keys[i] for i in first]) == [data[i] for i in first]
        outs = [bytearray(len(data[i])) for i in second]
        assert kv.get_many_into([keys[i] for i in second], outs) == [len(data[i]) for i in second]
        assert [bytes(o) for o in outs] == [data[i] for i in second]
        assert kv.handoffs == len(moved)
        assert new_owner.get_many([keys[i] for i in to_h3]) == [data[i] for i in to_h3]  # the copies, byte for byte
    assert kv.stats()["suspects"] == {}
    # a client that never saw the old membership reads everything, the moved blocks from h3
    assert cluster.client().get_many(keys) == data

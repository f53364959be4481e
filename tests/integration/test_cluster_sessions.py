"""Session hints through a cluster client: every node call of a put, read or lookup carries the
session id, so each node that holds one of the session's blocks has the session open, and
``close_session`` ends it on all of them.

Regression: the cluster client took no ``session_id=`` (the vLLM connector's lookups through an
``etcd://`` target failed with TypeError inside vLLM's scheduler, which killed the engine)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from cluster_fixtures import Cluster, cluster, etcd  # noqa: F401 - fixtures

from client import InvalidArgument, KVClient, Namespace, Timeouts, connect_async


def open_sessions(cluster: Cluster) -> dict[str, int]:
    """Sessions each node has open now, from its counters (opened less closed, expired, evicted)."""
    out = {}
    for node_id, node in cluster.nodes.items():
        with KVClient(node.tcp) as kv:
            c = kv.stats()["counters"]
        out[node_id] = c["sessions_opened"] - c["sessions_closed"] - c["sessions_expired"] - c["sessions_evicted"]
    return out


def test_cluster_calls_carry_the_session_to_every_node_they_reach(cluster: Cluster) -> None:
    cluster.set("replication", 1)
    cluster.start("s1", "s2")
    kv = cluster.client()
    assert kv.wait_for_nodes(2, 10)
    ns = Namespace("sessions-cluster", chunk_tokens=16)
    keys = kv.chunk_keys(np.arange(16 * 32), ns)
    assert len({kv.owners(k)[0] for k in keys}) == 2  # the session's blocks sit on both nodes
    data = [bytes([i]) * 4096 for i in range(len(keys))]
    assert kv.put_many(keys, data, namespace=ns, session_id="chat-1") == [True] * len(keys)
    assert open_sessions(cluster) == {"s1": 1, "s2": 1}
    assert kv.match_prefix_tiers(keys, session_id="chat-1") == (len(keys), ["dram"] * len(keys))
    assert kv.match_prefix(keys, session_id="chat-2") == len(keys)  # a lookup opens its session too
    assert kv.get_many(keys, session_id="chat-3") == data
    assert open_sessions(cluster) == {"s1": 3, "s2": 3}
    assert kv.close_session("chat-1") and kv.close_session("chat-2") and kv.close_session("chat-3")
    assert open_sessions(cluster) == {"s1": 0, "s2": 0}
    assert not kv.close_session("chat-1"), "closed already: no node has it open"
    with pytest.raises(InvalidArgument, match="session id"):
        kv.match_prefix(keys, session_id="bad\nid")
    with pytest.raises(InvalidArgument, match="session id"):
        kv.put(keys[0], data[0], namespace=ns, session_id=7)  # type: ignore[arg-type]

    async def the_async_client() -> None:
        async with connect_async(cluster.target, timeouts=Timeouts(rpc=2, data=5, connect=1)) as akv:
            assert await akv.match_prefix_tiers(keys, session_id="chat-4") == (len(keys), ["dram"] * len(keys))
            assert await akv.lookup(keys[:2], session_id="chat-4") == ["dram", "dram"]
            assert await akv.close_session("chat-4")

    asyncio.run(the_async_client())
    assert open_sessions(cluster) == {"s1": 0, "s2": 0}

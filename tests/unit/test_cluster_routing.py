"""The cluster SDK's routing core on membership changes, without etcd or nodes.

A :class:`client._cluster.ClusterCore` whose etcd never answers publishes nothing by
itself; each test publishes membership views through the view's own ``_publish`` (what
the watcher calls) and drives the core's sans-I/O operations by hand, feeding node results.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import cluster_core
import pytest
from cluster_core import publish, router

from client._cluster import ClusterCore, Fanout
from client._instructions import GetStream, PutStream
from kvstore.cluster.state import ClusterConfig, ClusterSnapshot
from kvstore.errors import DeadlineExceeded, OwnershipUnavailable, Unavailable

CLUSTER = "routing"
KEYS = [bytes([i]) * 16 for i in range(1, 65)]


def view(revision: int, regs: dict[str, tuple[int, int]], replication: int = 2, port: int = 7000) -> ClusterSnapshot:
    """A loaded view of this module's cluster with nodes ``regs`` (node -> (record revision, lease))."""
    return cluster_core.view(CLUSTER, revision, regs, replication, port)


@pytest.fixture
def core() -> Iterator[ClusterCore]:
    with router(CLUSTER) as c:
        yield c


def fail(core: ClusterCore, node: str, err: BaseException | None = None) -> None:
    """A call to ``node``, routed by the current routing, fails."""
    core.failed(node, err or DeadlineExceeded("no answer"), core.routing())


def drive(op: Any, answer: Any) -> Any:
    """Run a sans-I/O operation, answering each fan-out call with ``answer(node, node_op)``."""
    return cluster_core.drive(op, answer)[0]


def test_regression_reregistered_node_stays_suspect_for_the_whole_backoff(core: ClusterCore) -> None:
    """Bug: a node that came back and registered again stayed on the suspect list for up to
    suspect_s (30 s), so reads skipped it and writes went to fewer than R owners."""
    publish(core, view(10, {"a": (3, 101), "b": (4, 102), "c": (5, 103)}))
    fail(core, "b")
    assert "b" in core.suspects
    # a reload after an etcd outage, a keep-alive, another node's change: the same registration
    publish(core, view(11, {"a": (3, 101), "b": (4, 102), "c": (5, 103)}))
    publish(core, view(12, {"a": (3, 101), "b": (4, 102), "c": (12, 104)}))
    assert "b" in core.suspects  # still registered, still failing: the back-off protects the client
    # its lease expires, then it registers again
    publish(core, view(13, {"a": (3, 101), "c": (12, 104)}))
    publish(core, view(14, {"a": (3, 101), "b": (14, 105), "c": (12, 104)}))
    assert "b" not in core.suspects
    assert "b" in core.routing().nodes


def test_regression_node_reregistered_under_a_new_lease_is_cleared_without_leaving(core: ClusterCore) -> None:
    """A restart under the same id (or a new address) rewrites the record in place: the
    node never leaves the view, yet it is a new registration."""
    publish(core, view(10, {"a": (3, 101), "b": (4, 102)}))
    fail(core, "a", Unavailable("connection refused"))
    assert "a" in core.suspects
    publish(core, view(11, {"a": (11, 106), "b": (4, 102)}, port=7001))
    assert "a" not in core.suspects
    assert core.routing().nodes["a"].grpc == "10.0.0.1:7001"


def test_failure_of_an_earlier_registration_does_not_suspect_the_new_one(core: ClusterCore) -> None:
    publish(core, view(10, {"a": (3, 101), "b": (4, 102)}))
    old = core.routing()  # a call is routed to a's first registration ...
    publish(core, view(12, {"a": (12, 107), "b": (4, 102)}))  # ... a registers again meanwhile ...
    assert core.failed("a", DeadlineExceeded("no answer"), old)  # ... and the old call fails
    assert "a" not in core.suspects
    assert core.failed("a", DeadlineExceeded("no answer"), core.routing())  # the new registration failing does count
    assert "a" in core.suspects


def test_a_node_refusing_a_claim_while_etcd_is_down_is_not_suspected(core: ClusterCore) -> None:
    """``OwnershipUnavailable``: the node is up, etcd is not; routing around it would only
    take replicas away from namespaces it can still serve."""
    publish(core, view(5, {"a": (3, 11), "b": (4, 12)}))
    assert core.failed("a", OwnershipUnavailable("cannot claim namespace: etcd is unreachable"), core.routing())
    assert "a" not in core.suspects
    fail(core, "b", Unavailable("connection refused"))
    assert "b" in core.suspects


def test_writes_to_a_suspect_owner_are_counted_as_under_replicated(core: ClusterCore) -> None:
    """While an owner is suspect, a put skips it (no other node stands in): the block has
    fewer than R copies, and the client counts each missing copy."""
    publish(core, view(10, {"a": (3, 101), "b": (4, 102), "c": (5, 103)}))
    routing = core.routing()
    owners = [set(routing.owners(k)) for k in KEYS]
    on = {n: sum(n in o for o in owners) for n in "abc"}
    assert all(0 < v < len(KEYS) for v in on.values())
    fail(core, "b")
    written: dict[str, int] = {}

    def answer(down: str = "") -> Any:
        def call(node: str, make: Any) -> Any:
            if node == down:
                return Unavailable("down")
            keys = make(_Node())
            written[node] = written.get(node, 0) + len(keys)
            return [True] * len(keys)

        return call

    stored = drive(core.put_many(KEYS, [b"x"] * len(KEYS), namespace=None, parents=None, token_counts=None), answer())
    assert stored == [True] * len(KEYS)  # every block still has its other owner: the put succeeds
    assert "b" not in written and written == {"a": on["a"], "c": on["c"]}
    assert core.under_replicated() == {"suspect": on["b"], "failed": 0}
    # an owner whose call fails: its copies count too (a block owned by b and c is not stored)
    stored = drive(
        core.put_many(KEYS, [b"x"] * len(KEYS), namespace=None, parents=None, token_counts=None), answer("c")
    )
    assert stored == [o != {"b", "c"} for o in owners]
    assert core.under_replicated() == {"suspect": 2 * on["b"], "failed": on["c"]}
    assert "c" in core.suspects
    # b registers again: its writes go to it at once; c (still registered) keeps its back-off
    publish(core, view(11, {"a": (3, 101), "b": (11, 108), "c": (5, 103)}))
    written.clear()
    drive(core.put_many(KEYS, [b"x"] * len(KEYS), namespace=None, parents=None, token_counts=None), answer())
    assert written == {"a": on["a"], "b": on["b"]}
    assert core.under_replicated() == {"suspect": 2 * on["b"] + on["c"], "failed": on["c"]}


class _Node:
    """Stands in for a node's client core: a put operation returns the keys it carries."""

    def put_many(self, keys: list[bytes], datas: list[object], **kw: object) -> list[bytes]:
        return keys


class _FakeNodeClient:
    """Stands in for a per-node ``KVClient``: records what it was built for and whether it was closed."""

    made: list[_FakeNodeClient] = []

    def __init__(self, target: str, options: object = None, **kw: object) -> None:
        self.target, self.closed, self._core = target, False, None
        _FakeNodeClient.made.append(self)

    def _run(self, op: Any) -> Any:
        assert not self.closed, f"a call on the closed client of {self.target}"
        return self.target

    def close(self) -> None:
        self.closed = True


def test_a_call_routed_by_an_older_plan_dials_the_nodes_current_address(monkeypatch: pytest.MonkeyPatch) -> None:
    """A node restarted at a new address while an operation runs: a later round of that
    operation (routed by the routing it started with) must reach the new address, and must not
    swap the node's connection back to the old one (closing the client other threads use)."""
    import client._sync
    from client._cluster_clients import ClusterClient

    monkeypatch.setattr(client._sync, "KVClient", _FakeNodeClient)
    _FakeNodeClient.made = []
    kv = ClusterClient(f"etcd://127.0.0.1:1/{CLUSTER}", transport="tcp", prefer_local=False, wait_s=0)
    try:

        def call(routing: Any) -> Any:
            def op() -> Any:
                (res,) = yield Fanout(routing, [("a", lambda core: None)])
                return res

            return kv._run(op())

        publish(kv._core, view(10, {"a": (3, 101), "b": (4, 102)}))
        old = kv._core.routing()
        assert call(old) == "10.0.0.1:7000"
        publish(kv._core, view(11, {"a": (11, 109), "b": (4, 102)}, port=7001))
        new = kv._core.routing()
        assert [call(p) for p in (old, new, old)] == ["10.0.0.1:7001"] * 3
        assert [(c.target, c.closed) for c in _FakeNodeClient.made] == [
            ("10.0.0.1:7000", True),
            ("10.0.0.1:7001", False),
        ]
    finally:
        kv.close()


def test_regression_handoff_calls_fit_the_nodes_max_batch() -> None:
    """The hand-off read's own per-node calls (one ``GetStream`` from a previous owner, one
    ``PutStream`` to the new owner) carried every key of the batch: a node refuses a request
    over its ``max_batch`` whole.  They go in batches of the node's ``Hello`` now."""
    from client._cluster import _fetch_with_meta, _put_blocks
    from client._core import ClientCore
    from kvstore.block import BlockMeta
    from kvstore.wire import meta_from_pb, meta_to_pb
    from protos.kvstore.v1 import kvstore_pb2 as pb

    limit = 4
    node = ClientCore("10.0.0.1:7000", transport="grpc-stream")
    node.hello = pb.HelloResponse(max_batch=limit, arena_size=64 << 20, max_block_bytes=1 << 20)
    payloads = {k: bytes([i]) * (100 + i) for i, k in enumerate(KEYS[: 3 * limit + 1])}
    metas = {k: BlockMeta.for_payload(k, p) for k, p in payloads.items()}
    keys = list(payloads)
    stored: dict[bytes, bytes] = {}
    sizes: list[int] = []

    def run(op: Any) -> Any:
        instr = next(op)
        try:
            while True:
                if isinstance(instr, GetStream):
                    ks = list(instr.request.keys)
                    sizes.append(len(ks))
                    assert len(ks) <= limit, f"GetStream of {len(ks)} keys"
                    result = [
                        pb.BlockChunk(block=meta_to_pb(metas[k]), data=payloads[k], status=pb.KEY_STATUS_OK) for k in ks
                    ]
                else:
                    assert isinstance(instr, PutStream), instr
                    blocks, meta = [], None
                    for c in instr.chunks():
                        if c.HasField("block"):
                            meta = meta_from_pb(c.block)
                            blocks.append([meta.key, b""])
                        blocks[-1][1] += c.data
                    sizes.append(len(blocks))
                    assert len(blocks) <= limit and instr.blocks == len(blocks), (
                        f"PutStream of {len(blocks)} blocks, {instr.blocks} declared"
                    )
                    stored.update((k, v) for k, v in blocks)
                    result = pb.StatusesResponse(statuses=[pb.KEY_STATUS_OK] * len(blocks))
                instr = op.send(result)
        except StopIteration as stop:
            return stop.value

    got = run(_fetch_with_meta(keys, True)(node))
    assert [(m.key, p) for m, p in got] == [(k, payloads[k]) for k in keys]
    assert sizes == [4, 4, 4, 1]
    sizes.clear()
    assert run(_put_blocks([m for m, _ in got], [p for _, p in got])(node)) == [True] * len(keys)
    assert stored == payloads and sizes == [4, 4, 4, 1]


def test_handoff_covers_leaves_and_placement_scheme_changes(core: ClusterCore) -> None:
    """bounded-v1 may move a few keys between nodes that stayed (its bounded overflow), and a
    switch of the placement setting moves most: reads then try the previous owners too."""
    from kvstore.cluster.placement import BoundedTable, Ring

    regs = {n: (i + 1, 100 + i) for i, n in enumerate("abcd")}
    publish(core, view(10, regs, replication=1))
    assert isinstance(core.routing().ring, BoundedTable)
    before = core.routing()
    publish(core, view(11, {n: r for n, r in regs.items() if n != "d"}, replication=1))  # d leaves
    routing = core.routing()
    assert len(routing.previous) == 1 and set(routing.previous[0].nodes) == set("abcd")  # the full previous membership
    for k in KEYS:
        old, new = before.owners(k), routing.owners(k)
        assert routing.handoff(k, new) == [n for n in old if n not in new and n != "d"]
    snap = view(12, {n: r for n, r in regs.items() if n != "d"}, replication=1)
    publish(core, dataclasses.replace(snap, config=ClusterConfig(replication=1, placement="rendezvous-v1")))
    routing = core.routing()
    assert isinstance(routing.ring, Ring) and isinstance(routing.previous[0], BoundedTable)


def test_chunk_keys_follow_the_cluster_chunk_group(core: ClusterCore) -> None:
    import numpy as np

    from kvstore.keys import Namespace, chunk_keys

    ns = Namespace("grouped", chunk_tokens=4)
    tokens = np.arange(4 * 40)
    publish(core, view(10, {"a": (1, 1), "b": (2, 2), "c": (3, 3)}))
    plain = core.chunk_keys(tokens, ns)
    assert plain == chunk_keys(tokens, ns)  # chunk_group 1 (the default): the plain keys
    snap = view(11, {"a": (1, 1), "b": (2, 2), "c": (3, 3)})
    publish(core, dataclasses.replace(snap, config=ClusterConfig(replication=2, chunk_group=8)))
    grouped = core.chunk_keys(tokens, ns)
    assert [k[4:] for k in grouped] == [k[4:] for k in plain] and len(set(grouped)) == len(grouped)
    routing = core.routing()
    assert len({tuple(routing.owners(k)) for k in grouped[:8]}) == 1  # one group, one set of owners
    assert len({tuple(o) for o in routing.owners_many(grouped)}) <= 5  # 40 chunks, 5 groups

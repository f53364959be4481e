"""``PoolView`` against real node processes: it follows each node's ``WatchHoldings`` stream
and ends up holding exactly what the nodes hold, through puts, demotions, evictions,
promotions and deletes, through a dropped stream that resumes or resyncs, a node killed
and a node restarted; and a cluster's membership in a real etcd.

Every wait is for a state (``wait_for`` polls until the view agrees, or fails naming what
it waited for), never for a duration."""

from __future__ import annotations

import os
import signal
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from cluster_fixtures import Cluster, cluster, etcd  # noqa: F401 - fixtures
from conftest import NodeProcess, wait_for

from client import ClientOptions, KVClient, PoolView
from kvstore.errors import InvalidArgument
from protos.kvstore.v1 import kvstore_pb2 as pb
from protos.kvstore.v1 import kvstore_pb2_grpc as pb_grpc

BLOCK = np.zeros(256 * 1024, np.uint8)


def follow(nodes: str | list[str], options: ClientOptions | None = None) -> PoolView:
    """A view quick to notice a silent node (a 0.1 s heartbeat, a 1 s deadline)."""
    return PoolView(nodes, options, heartbeat_s=0.1, node_deadline_s=1.0)


def key(i: int) -> bytes:
    return struct.pack("<QQ", 0x9001, i)


def view_tiers(view: PoolView, keys: Sequence[bytes]) -> list[str | None]:
    """The view's tier for each key on its own ("dram", "nvme", None), as ``KVClient.lookup`` says them."""
    out: list[str | None] = []
    for k in keys:
        m = view.match([k])
        out.append(m.holders[0].tier.name.lower() if m.hits else None)
    return out


def agrees(view: PoolView, kv: KVClient, keys: Sequence[bytes]) -> bool:
    return view_tiers(view, keys) == kv.lookup(keys)


def test_the_view_follows_puts_moves_evictions_promotions_and_deletes(node_factory: Any) -> None:
    n = node_factory("--dram", "4MiB", "--nvme", "8MiB")
    keys = [key(i) for i in range(80)]  # 20 MiB of blocks through 4 MiB of DRAM and 8 MiB of NVMe
    with KVClient(n.unix) as kv:
        for k in keys[:4]:
            kv.put(k, BLOCK)
        with follow([n.unix]) as view:
            assert view.wait_synced(30)
            m = view.match(keys[:6])  # the snapshot
            assert m.hits == 4 and {h.node for h in m.holders} == {n.unix}
            for k in keys[4:]:
                kv.put(k, BLOCK)
            wait_for(lambda: agrees(view, kv, keys), 30, "the view to hold what the node holds after the puts")
            where = kv.lookup(keys)
            # the setup did what it is for: blocks moved to NVMe, and some left the node
            assert {"dram", "nvme", None} <= set(where), where
            on_nvme = keys[where.index("nvme")]
            assert kv.get(on_nvme) is not None  # promoted to DRAM
            wait_for(lambda: view_tiers(view, [on_nvme]) == ["dram"], 30, "the promotion to reach the view")
            held = [k for k, t in zip(keys, kv.lookup(keys)) if t is not None]
            assert kv.delete(held[:3]) == 3
            wait_for(lambda: agrees(view, kv, keys), 30, "the deletes to reach the view")
            assert view_tiers(view, held[:3]) == [None] * 3
            s = view.stats()
            assert s.nodes == s.nodes_synced == 1 and s.blocks == sum(t is not None for t in kv.lookup(keys))
            assert s.deltas > 0 and s.lag_ms_p99 >= s.lag_ms_p50 > 0 and s.resyncs == 0
            lags = view.take_lags()  # the same samples, each once, for an exporter's histogram
            assert lags and all(x >= 0 for x in lags) and max(lags) >= s.lag_ms_p99
            assert view.take_lags() == []


def test_match_counts_leading_chunks_only(node_factory: Any) -> None:
    n = node_factory("--dram", "64MiB", "--nvme", "0")
    chain = [key(100 + i) for i in range(6)]
    with KVClient(n.unix) as kv, follow([n.unix]) as view:
        for k in chain[:3] + chain[4:]:  # chunk 3 missing: chunks 4 and 5 are useless
            kv.put(k, BLOCK)
        wait_for(lambda: view.stats().blocks == 5, 30, "five blocks in the view")
        assert view.match(chain).hits == 3
        assert view.match(chain[1:]).hits == 2
        assert view.match([]).hits == 0
        with pytest.raises(InvalidArgument, match="16 bytes"):
            view.match([b"not a key"])


def test_among_equally_fast_copies_match_names_the_preferred_node(node_factory: Any) -> None:
    a = node_factory("--dram", "64MiB", "--nvme", "0")
    b = node_factory("--dram", "64MiB", "--nvme", "0")
    chain = [key(200 + i) for i in range(3)]
    with KVClient(a.unix) as ka, KVClient(b.unix) as kb, follow([a.unix, b.unix]) as view:
        for k in chain:
            ka.put(k, BLOCK)
            kb.put(k, BLOCK)
        wait_for(lambda: view.stats().blocks == 6, 30, "both nodes' copies in the view")
        first = view.match(chain).holders[0].node  # no preference: the first node followed
        other = b.unix if first == a.unix else a.unix
        for prefer, want in ((other, other), (first, first), (None, first), ("no-such-node", first)):
            m = view.match(chain, prefer=prefer)
            assert m.hits == 3 and {h.node for h in m.holders} == {want}, prefer


def watch(target: str, req: pb.WatchHoldingsRequest, until: Any) -> list[pb.HoldingsUpdate]:
    """Raw ``WatchHoldings`` messages up to the first that ``until`` accepts."""
    with grpc.insecure_channel(target) as ch:
        call = pb_grpc.KVStoreStub(ch).WatchHoldings(req, timeout=30)
        out = []
        for m in call:
            out.append(m)
            if until(m):
                break
        call.cancel()
        return out


def test_a_dropped_stream_resumes_with_what_it_missed_or_resyncs_when_too_far_behind(node_factory: Any) -> None:
    n = node_factory("--dram", "64MiB", "--nvme", "0", env={"KVSTORE_WATCH_HISTORY": "8"})
    with KVClient(n.unix) as kv:
        kv.put(key(1), BLOCK)
        (snap,) = watch(n.unix, pb.WatchHoldingsRequest(), lambda m: m.last)
        assert snap.revision == 1 and snap.keys == key(1) and not snap.resync
        for i in range(2, 5):  # 3 changes: within the history of 8
            kv.put(key(i), BLOCK)
        resumed = watch(
            n.unix,
            pb.WatchHoldingsRequest(incarnation=snap.incarnation, revision=1),
            lambda m: m.kind == pb.HOLDINGS_KIND_DELTAS and m.revision == 4,
        )
        assert all(m.kind == pb.HOLDINGS_KIND_DELTAS for m in resumed)
        assert resumed[0].first_revision == 2 and b"".join(m.keys for m in resumed) == key(2) + key(3) + key(4)
        for i in range(5, 20):  # 15 more: revision 4 is out of the history
            kv.put(key(i), BLOCK)
        (resync, *_) = watch(
            n.unix, pb.WatchHoldingsRequest(incarnation=snap.incarnation, revision=4), lambda m: m.last
        )
        assert resync.kind == pb.HOLDINGS_KIND_SNAPSHOT and resync.resync and resync.revision == 19
        assert kv.stats()["counters"]["watch_resyncs"] == 1


def test_a_killed_node_leaves_the_view_and_a_restarted_one_comes_back_fresh(node_factory: Any, tmp_path: Path) -> None:
    data = tmp_path / "restarting"
    n = node_factory("--dram", "64MiB", "--nvme", "64MiB", data_dir=data)
    other = node_factory("--dram", "64MiB", "--nvme", "0")
    with KVClient(n.unix) as kv, KVClient(other.unix) as kv2:
        kv.put(key(1), BLOCK)
        kv2.put(key(2), BLOCK)
        with follow([n.unix, other.unix]) as view:
            assert view.wait_synced(30)
            assert view.match([key(1)]).hits == 1 and view.match([key(2)]).hits == 1
            n.kill9()  # its DRAM-only block dies with it
            wait_for(lambda: view.match([key(1)]).hits == 0, 30, "the killed node's entries to go")
            assert view.match([key(2)]).hits == 1  # the other node's stay
            assert view.stats().nodes_lost == 1
            os.unlink(n.arena_path)
            restarted = NodeProcess(data, "--dram", "64MiB", "--nvme", "64MiB", node_id=n.node_id).start()
            try:
                assert restarted.unix == n.unix
                with KVClient(restarted.unix) as kv3:
                    kv3.put(key(3), BLOCK)
                    wait_for(lambda: view.match([key(3)]).hits == 1, 30, "the restarted node's snapshot or deltas")
                assert view.match([key(1)]).hits == 0  # lost with the process: not back
            finally:
                restarted.stop(timeout=30)
                Path(restarted.arena_path).unlink(missing_ok=True)


def test_a_silent_node_leaves_the_view_at_its_deadline_and_comes_back_when_it_answers(node_factory: Any) -> None:
    n = node_factory("--dram", "64MiB", "--nvme", "0")
    with KVClient(n.unix) as kv:
        kv.put(key(1), BLOCK)
    with follow([n.unix]) as view:
        assert view.wait_synced(30) and view.match([key(1)]).hits == 1
        assert n.proc is not None
        os.kill(n.proc.pid, signal.SIGSTOP)  # the stream stays open, and says nothing: no heartbeat
        try:
            wait_for(lambda: view.match([key(1)]).hits == 0, 30, "a silent node's entries to go")
            assert view.stats().nodes_lost == 1 and view.stats().nodes_synced == 0
        finally:
            os.kill(n.proc.pid, signal.SIGCONT)
        wait_for(lambda: view.match([key(1)]).hits == 1, 30, "the node's entries back once it answers")
        assert view.stats().restarts == 0


def test_a_restart_within_the_deadline_drops_the_old_incarnations_entries(node_factory: Any, tmp_path: Path) -> None:
    data = tmp_path / "restarting"
    n = node_factory("--dram", "64MiB", "--nvme", "64MiB", data_dir=data)
    with KVClient(n.unix) as kv:
        kv.put(key(1), BLOCK)
    # a deadline far longer than the restart: only the new incarnation can tell the view
    with PoolView([n.unix], heartbeat_s=0.1, node_deadline_s=600) as view:
        assert view.wait_synced(30) and view.match([key(1)]).hits == 1
        n.kill9()
        os.unlink(n.arena_path)
        restarted = NodeProcess(data, "--dram", "64MiB", "--nvme", "64MiB", node_id=n.node_id).start()
        try:
            wait_for(lambda: view.stats().restarts == 1, 30, "the view to see the new incarnation")
            assert view.match([key(1)]).hits == 0 and view.stats().nodes_lost == 0
            with KVClient(restarted.unix) as kv2:
                kv2.put(key(2), BLOCK)
                wait_for(lambda: view.match([key(2)]).hits == 1, 30, "deltas of the new incarnation")
        finally:
            restarted.stop(timeout=30)
            Path(restarted.arena_path).unlink(missing_ok=True)


def test_blocks_kept_on_nvme_across_a_restart_come_back_in_the_new_snapshot(node_factory: Any, tmp_path: Path) -> None:
    data = tmp_path / "kept"
    n = node_factory("--dram", "64MiB", "--nvme", "64MiB", data_dir=data)
    with KVClient(n.unix) as kv:
        kv.put(key(1), BLOCK)
    with PoolView([n.unix], heartbeat_s=0.1, node_deadline_s=600) as view:
        assert view.wait_synced(30)
        assert n.stop(timeout=30) == 0  # SIGTERM: dirty blocks are demoted before it exits
        restarted = NodeProcess(data, "--dram", "64MiB", "--nvme", "64MiB", node_id=n.node_id).start()
        try:
            wait_for(lambda: view.stats().restarts == 1, 30, "the new incarnation's snapshot")
            assert [h.tier.name for h in view.match([key(1)]).holders] == ["NVME"]
        finally:
            restarted.stop(timeout=30)
            Path(restarted.arena_path).unlink(missing_ok=True)


def test_the_view_refuses_what_it_cannot_follow() -> None:
    with pytest.raises(InvalidArgument):
        PoolView([])
    with pytest.raises(InvalidArgument):
        PoolView(["no-port"])
    with pytest.raises(InvalidArgument, match="twice"):
        PoolView(["localhost:1"], heartbeat_s=1.0, node_deadline_s=1.5)


def test_a_tenant_token_may_not_watch(node_factory: Any, tmp_path: Path) -> None:
    tok = tmp_path / "t.token"
    tok.write_text("tenant-a-secret")
    n = node_factory(
        "--dram", "64MiB", "--nvme", "0", env={"KVSTORE_TOKEN": "admin-secret", "KVSTORE_TENANTS": f"a={tok}"}
    )
    with grpc.insecure_channel(n.unix) as ch, pytest.raises(grpc.RpcError) as e:
        list(
            pb_grpc.KVStoreStub(ch).WatchHoldings(
                pb.WatchHoldingsRequest(), metadata=(("authorization", "Bearer tenant-a-secret"),), timeout=30
            )
        )
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with follow([n.unix], ClientOptions(token="admin-secret")) as view:
        assert view.wait_synced(30)


# -- a cluster through etcd ---------------------------------------------------------------------
def test_a_cluster_view_follows_the_membership(cluster: Cluster) -> None:
    a, b = cluster.start("na", "nb")
    with KVClient(a.unix) as ka, KVClient(b.unix) as kb:
        ka.put(key(1), BLOCK)
        kb.put(key(2), BLOCK)
        with follow(cluster.target) as view:
            wait_for(lambda: sorted(view.nodes()) == ["na", "nb"], 30, "both nodes in the view")
            assert view.wait_synced(30)
            m = view.match([key(1), key(2)])
            assert m.hits == 2 and [h.node for h in m.holders] == ["na", "nb"]
            (c,) = cluster.start("nc")
            with KVClient(c.unix) as kc:
                kc.put(key(3), BLOCK)
                wait_for(lambda: view.match([key(3)]).hits == 1, 30, "a node that joined")
            assert b.stop(timeout=30) == 0  # deregisters: its entries go with its record
            wait_for(lambda: view.match([key(2)]).hits == 0, 30, "the entries of a node that left")
            assert sorted(view.nodes()) == ["na", "nc"]
            assert view.match([key(1)]).holders[0].node == "na"


@pytest.mark.parametrize(
    "raw",
    [
        b"\xff\xff\xff",  # not a message
        pb.WatchHoldingsRequest(incarnation=b"short").SerializeToString(),
        pb.WatchHoldingsRequest(heartbeat_ms=1).SerializeToString(),
    ],
)
def test_bad_watch_requests_answer_invalid_argument_and_the_node_serves_on(node_factory: Any, raw: bytes) -> None:
    n = node_factory("--dram", "64MiB", "--nvme", "0")
    with grpc.insecure_channel(n.unix) as ch:
        call: Any = ch.unary_stream("/kvstore.v1.KVStore/WatchHoldings")
        with pytest.raises(grpc.RpcError) as e:
            list(call(raw, timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    (snap,) = watch(n.unix, pb.WatchHoldingsRequest(), lambda m: m.last)
    assert snap.kind == pb.HOLDINGS_KIND_SNAPSHOT

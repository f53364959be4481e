"""A real node's ``/metrics`` after known traffic: exact hits per tier, misses per reason,
bytes per path, evictions, promotions and demotions; authentication and read-only access;
and every metric the Grafana dashboard queries is exported."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import xxhash
from cluster_fixtures import Cluster, cluster, etcd, needs_etcd  # noqa: F401 - fixtures
from conftest import ROOT, NodeProcess, wait_for
from prometheus_client.parser import text_string_to_metric_families

from client import KVClient
from kvstore.block import BlockMeta
from kvstore.wire import meta_to_pb
from protos.kvstore.v1 import kvstore_pb2 as pb
from protos.kvstore.v1 import kvstore_pb2_grpc as pb_grpc

BLOCK = 512 << 10  # 4 of them fill a 2 MiB arena exactly
TOKENS = 16
NS1, NS2 = b"ns-one..", b"ns-two.."


def k(i: int) -> bytes:
    return i.to_bytes(16, "big")


def block(i: int) -> np.ndarray:
    return np.full(BLOCK, i % 251, np.uint8)


def scrape(url: str, token: str = "") -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(req, timeout=10) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def val(m: dict[Any, float], name: str, **labels: str) -> float:
    return m[(name, tuple(sorted(labels.items())))]


def start(tmp: Path, *args: str) -> NodeProcess:
    return NodeProcess(tmp / "node", "--metrics-port", "0", *args).start()


def stop(n: NodeProcess) -> None:
    assert n.stop(timeout=30) == 0
    Path(f"/dev/shm/kvstore-test-{n.node_id}.arena").unlink(missing_ok=True)


def corrupt_put(target: str, i: int) -> int:
    """A streamed put whose bytes do not match the checksum in its header."""
    data = block(i).tobytes()
    meta = BlockMeta.for_payload(k(i), data, namespace=NS1, token_count=TOKENS, payload_checksum=12345)
    with grpc.insecure_channel(target) as ch:
        resp = pb_grpc.KVStoreStub(ch).PutStream(iter([pb.BlockChunk(block=meta_to_pb(meta), data=data)]), timeout=10)
    return resp.statuses[0]


@pytest.fixture(scope="module")
def dram_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    """A DRAM-only node (2 MiB) after known traffic (see test_dram_node_counts)."""
    n = start(tmp_path_factory.mktemp("metrics-dram"), "--dram", "2MiB", "--nvme", "0")
    try:
        with KVClient(n.unix) as local:
            for i in range(6):  # 4 fit: k0 and k1 are evicted (no NVMe: they leave the node)
                assert local.put(k(i), block(i), namespace=NS1, token_count=TOKENS)
            assert local.delete([k(5)]) == 1
            assert local.put(k(6), block(6), namespace=NS2, token_count=TOKENS)
            assert local.invalidate(NS2) == 1
        assert corrupt_put(n.tcp, 50) == pb.KEY_STATUS_CORRUPT
        with (
            grpc.insecure_channel(n.tcp) as ch,
            pytest.raises(grpc.RpcError) as bad,
        ):  # a malformed key: counted as an error
            pb_grpc.KVStoreStub(ch).Lookup(pb.KeysRequest(keys=[b"short"]), timeout=10)
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with KVClient(n.tcp) as remote:  # data channel
            got = remote.get_many([k(2), k(3), k(4), k(0), k(1), k(5), k(6), k(50), k(99)])
            assert [g is not None for g in got] == [True] * 3 + [False] * 6
            assert remote.match_prefix([k(2), k(3), k(0), k(4)]) == 2
            assert remote.lookup([k(4), k(99), k(5)]) == ["dram", None, None]
        yield n
    finally:
        stop(n)


def test_ready_line_names_the_metrics_endpoint(dram_node: NodeProcess) -> None:
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/metrics", dram_node.endpoints["metrics"])


def test_dram_node_counts(dram_node: NodeProcess) -> None:
    m = scrape(dram_node.endpoints["metrics"])
    assert val(m, "kvstore_node_info", node_id=dram_node.node_id, version="0.1.0") == 1
    # lookups = hits + misses, per operation
    assert val(m, "kvstore_lookup_blocks_total", op="get") == 9
    assert val(m, "kvstore_lookup_blocks_total", op="match_prefix") == 4
    assert val(m, "kvstore_lookup_blocks_total", op="exists") == 3
    for op in ("get", "match_prefix", "exists"):
        assert val(m, "kvstore_lookup_requests_total", op=op) == 1
    hits = {
        (op, t): val(m, "kvstore_hit_blocks_total", op=op, tier=t)
        for op in ("get", "match_prefix", "exists")
        for t in ("hbm", "dram", "nvme", "remote")
    }
    assert {key: v for key, v in hits.items() if v} == {
        ("get", "dram"): 3,
        ("match_prefix", "dram"): 2,
        ("exists", "dram"): 1,
    }
    assert val(m, "kvstore_hit_tokens_total", op="get", tier="dram") == 3 * TOKENS
    assert val(m, "kvstore_hit_tokens_total", op="match_prefix", tier="dram") == 2 * TOKENS
    misses = {
        (op, r): val(m, "kvstore_miss_blocks_total", op=op, reason=r)
        for op in ("get", "match_prefix", "exists")
        for r in ("never_stored", "evicted", "invalidated", "corrupt", "node_down", "deadline")
    }
    assert {key: v for key, v in misses.items() if v} == {
        ("get", "evicted"): 2,
        ("get", "invalidated"): 2,
        ("get", "corrupt"): 1,
        ("get", "never_stored"): 1,
        ("match_prefix", "evicted"): 2,  # k0 is gone, so k4 after it is useless too
        ("exists", "never_stored"): 1,
        ("exists", "invalidated"): 1,
    }
    # per namespace: the evicted/invalidated/corrupt keys remember theirs; k99 joins its request's
    assert val(m, "kvstore_namespace_hit_blocks_total", namespace=NS1.hex(), op="get") == 3
    assert val(m, "kvstore_namespace_miss_blocks_total", namespace=NS1.hex(), op="get") == 5
    assert val(m, "kvstore_namespace_miss_blocks_total", namespace=NS2.hex(), op="get") == 1
    # capacity, evictions, bytes per path
    assert val(m, "kvstore_tier_capacity_bytes", tier="dram") == 2 << 20
    assert val(m, "kvstore_tier_blocks", tier="dram") == 3
    assert val(m, "kvstore_tier_used_bytes", tier="dram") == 3 * BLOCK
    assert val(m, "kvstore_evictions_total", tier="dram") == 2
    assert val(m, "kvstore_put_blocks_total", outcome="stored") == 7
    assert val(m, "kvstore_put_blocks_total", outcome="corrupt") == 1
    assert val(m, "kvstore_corrupt_blocks_total", stage="put") == 1
    assert val(m, "kvstore_bytes_total", path="local", direction="write") == 7 * BLOCK
    assert val(m, "kvstore_bytes_total", path="tcp", direction="read") == 3 * BLOCK
    assert val(m, "kvstore_bytes_total", path="grpc", direction="write") == 0
    assert val(m, "kvstore_promotions_total") == 0
    # latency histograms per RPC and per data-channel transfer
    assert val(m, "kvstore_rpc_duration_seconds_count", method="StartGet") == 1
    assert val(m, "kvstore_rpc_duration_seconds_count", method="MatchPrefix") == 1
    assert val(m, "kvstore_rpc_duration_seconds_count", method="PutStream") == 1
    assert val(m, "kvstore_transfer_duration_seconds_count", op="get") == 1
    assert val(m, "kvstore_rpc_errors_total", method="Lookup", error="InvalidArgument") == 1


def test_nvme_node_counts_promotions_and_demotions(tmp_path: Path) -> None:
    # demotions on eviction only (no cleaner writing ahead), so every count is exact
    n = start(tmp_path, "--dram", "2MiB", "--nvme", "64MiB", "--dram-clean-ahead", "0")
    try:
        with KVClient(n.unix) as kv:
            for i in range(6):  # k0 and k1 are demoted to NVMe, not lost
                assert kv.put(k(i), block(i), token_count=TOKENS)
            assert kv.get(k(0)) == block(0).tobytes()  # an NVMe hit: promoted, and k2 demoted to make room
            assert kv.get(k(99)) is None
        m = scrape(n.endpoints["metrics"])
        assert val(m, "kvstore_hit_blocks_total", op="get", tier="nvme") == 1
        assert val(m, "kvstore_hit_tokens_total", op="get", tier="nvme") == TOKENS
        assert val(m, "kvstore_miss_blocks_total", op="get", reason="never_stored") == 1
        assert val(m, "kvstore_promotions_total") == 1
        assert val(m, "kvstore_demotions_total") == 3
        assert val(m, "kvstore_evictions_total", tier="dram") == 3
        assert val(m, "kvstore_tier_blocks", tier="nvme") == 3
        assert val(m, "kvstore_bytes_total", path="nvme", direction="read") == BLOCK
        assert val(m, "kvstore_bytes_total", path="nvme", direction="write") == 3 * BLOCK
        assert val(m, "kvstore_bytes_total", path="local", direction="read") == BLOCK
    finally:
        stop(n)


def test_metrics_need_the_token_and_are_read_only(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("metrics-secret\n")
    n = start(tmp_path, "--dram", "2MiB", "--nvme", "0", "--token-file", str(token_file))
    url = n.endpoints["metrics"]
    try:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10)
            assert e.value.code == 401
        assert val(scrape(url, "metrics-secret"), "kvstore_lookup_blocks_total", op="get") == 0
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(
                urllib.request.Request(
                    url, data=b"x", method="POST", headers={"Authorization": "Bearer metrics-secret"}
                ),
                timeout=10,
            )
        assert e.value.code == 405
    finally:
        stop(n)


def _grafana_metric_names() -> set[str]:
    board = json.loads((ROOT / "deploy" / "grafana" / "kvstore.json").read_text())
    exprs: list[str] = []

    def walk(x: Any) -> None:
        if isinstance(x, dict):
            for key, v in x.items():
                if key in ("expr", "query") and isinstance(v, str):
                    exprs.append(v)
                else:
                    walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(board)
    assert exprs, "the Grafana dashboard has no queries"
    return {name for e in exprs for name in re.findall(r"\bkvstore_[a-z0-9_]+", e)}


def test_every_metric_grafana_queries_is_exported(dram_node: NodeProcess) -> None:
    exported = {name for name, _ in scrape(dram_node.endpoints["metrics"])}
    wanted = _grafana_metric_names()
    assert len(wanted) >= 15
    assert sorted(wanted - exported) == []


def test_prometheus_example_scrapes_kvstore_nodes() -> None:
    text = (ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text()
    assert "scrape_configs:" in text and "/metrics" in text and "kvstore" in text


@needs_etcd
def test_cluster_client_counts_node_down_and_deadline_misses(cluster: Cluster) -> None:
    """The two miss reasons a node cannot count itself: the cluster SDK counts them."""
    cluster.start("m1", "m2", extra=("--membership-ttl", "60", "--metrics-port", "0"))  # a hung node stays registered
    kv = cluster.client(replication=1, suspect_s=30.0)
    # keys as chunk keys are: hashes (placement reads a key's leading bytes, which a counter leaves at zero)
    keys = [xxhash.xxh3_128_digest(i.to_bytes(8, "big")) for i in range(1, 41)]
    assert all(kv.put_many(keys, [block(i)[:4096] for i in range(40)]))
    on_m1 = [key for key in keys if kv.owners(key) == ["m1"]]
    assert on_m1
    assert kv.miss_counts() == {"node_down": 0, "deadline": 0}
    cluster.sigstop("m1")
    assert kv.get_many(on_m1) == [None] * len(on_m1)  # m1 does not answer within the deadline
    assert kv.miss_counts() == {"node_down": 0, "deadline": len(on_m1)}
    assert kv.match_prefix(on_m1) == 0  # m1 is now routed around: its keys miss as node_down
    assert kv.miss_counts() == {"node_down": 1, "deadline": len(on_m1)}  # a prefix stops at its first miss

    # and it reports them to a node that answers (ReportHits), so /metrics and dashboards show them (issue 16 #3)
    def reported() -> dict[tuple[str, str], float]:
        return {
            (dict(lb)["op"], dict(lb)["reason"]): v
            for (name, lb), v in scrape(cluster.nodes["m2"].endpoints["metrics"]).items()
            if name == "kvstore_miss_blocks_total" and dict(lb)["reason"] in ("node_down", "deadline") and v
        }

    wait_for(
        lambda: reported() == {("get", "deadline"): len(on_m1), ("match_prefix", "node_down"): 1},
        10,
        "m2's /metrics to show the client's node_down and deadline misses",
    )
    cluster.sigcont("m1")

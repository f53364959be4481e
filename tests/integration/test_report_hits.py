"""Hits a node cannot see (a GPU agent's HBM pool, another node) reported through ReportHits."""

from __future__ import annotations

import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from client import InvalidArgument, KVClient, Namespace
from protos.kvstore.v1 import kvstore_pb2 as pb
from protos.kvstore.v1 import kvstore_pb2_grpc as pb_grpc


def sample(url: str, name: str, **labels: str) -> float:
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise AssertionError(f"{name}{labels} not exported")


def test_reported_hbm_and_remote_hits_show_in_metrics(node_factory) -> None:
    node = node_factory("--dram", "64MiB", "--nvme", "0", "--metrics-port", "0")
    url = node.endpoints["metrics"]
    ns = Namespace("llama-test")
    with KVClient(node.unix) as kv:
        kv.report_hits(3, 768, tier="hbm", namespace=ns)
        kv.report_hits(2, 512, tier="hbm")
        kv.report_hits(4, 1024, tier="remote", op="match_prefix")
        with pytest.raises(InvalidArgument):
            kv.report_hits(1, tier="dram")
        kv.report_skipped_saves(7, namespace=ns)  # a connector's save policy did not store 7 chunks
        kv.report_skipped_saves(2)
        for bad in (0, -1, True):
            with pytest.raises(InvalidArgument):
                kv.report_skipped_saves(bad)
    assert sample(url, "kvstore_skipped_save_chunks_total") == 9
    assert sample(url, "kvstore_hit_blocks_total", op="get", tier="hbm") == 5
    assert sample(url, "kvstore_hit_tokens_total", op="get", tier="hbm") == 1280
    assert sample(url, "kvstore_hit_blocks_total", op="match_prefix", tier="remote") == 4
    assert sample(url, "kvstore_lookup_blocks_total", op="get") == 5


def test_bad_reports_are_rejected_by_the_node(node) -> None:
    with grpc.insecure_channel(node.tcp) as ch:
        stub = pb_grpc.KVStoreStub(ch)
        for req in (
            pb.ReportHitsRequest(op="scan", tier=pb.TIER_HBM, blocks=1),
            pb.ReportHitsRequest(op="get", tier=pb.TIER_DRAM, blocks=1),
            pb.ReportHitsRequest(op="get", tier=pb.TIER_HBM, blocks=10**12),
            pb.ReportHitsRequest(op="get", tier=pb.TIER_HBM, blocks=1, namespace=b"short"),
            pb.ReportHitsRequest(op="match_prefix", skipped_saves=1 << 40),
        ):
            with pytest.raises(grpc.RpcError) as e:
                stub.ReportHits(req, timeout=5)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        stub.Stats(pb.Empty(), timeout=5)  # still serving

"""Per-agent metrics: a client names its integration (``ClientOptions.agent``) and the node
counts its calls, blocks and bytes under that name, on every data path (shared memory, the
TCP data channel, the gRPC streams), with the label set bounded."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import NodeProcess
from test_metrics import scrape, start, stop, val

from client import ClientOptions, KVClient
from kvstore.errors import InvalidArgument
from kvstore.node.metrics import MAX_AGENTS

BLOCK = 64 << 10
NS = b"agent-ns"


def k(i: int) -> bytes:
    return (1000 + i).to_bytes(16, "big")


def block(i: int) -> np.ndarray:
    return np.full(BLOCK, i % 251, np.uint8)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    n = start(tmp_path_factory.mktemp("agents"), "--dram", "16MiB", "--nvme", "0")
    yield n
    stop(n)


def agent_counts(n: NodeProcess, agent: str) -> dict[str, float]:
    m = scrape(n.endpoints["metrics"])

    def v(name: str, **labels: str) -> float:
        try:
            return val(m, name, agent=agent, **labels)
        except KeyError:
            return 0.0

    return {
        "lookup_hit": v("kvstore_agent_blocks_total", op="lookup", result="hit"),
        "lookup_miss": v("kvstore_agent_blocks_total", op="lookup", result="miss"),
        "read_hit": v("kvstore_agent_blocks_total", op="read", result="hit"),
        "read_miss": v("kvstore_agent_blocks_total", op="read", result="miss"),
        "stored": v("kvstore_agent_blocks_total", op="write", result="stored"),
        "refused": v("kvstore_agent_blocks_total", op="write", result="refused"),
        "read_bytes": v("kvstore_agent_bytes_total", direction="read"),
        "write_bytes": v("kvstore_agent_bytes_total", direction="write"),
        "calls": sum(val for (name, labels), val in m.items()
                     if name == "kvstore_agent_calls_total" and ("agent", agent) in labels),
        "seconds": sum(val for (name, labels), val in m.items()
                       if name == "kvstore_agent_call_seconds_total" and ("agent", agent) in labels),
    }  # fmt: skip


@pytest.mark.parametrize("path", ["local", "tcp", "grpc-stream"])
def test_each_path_counts_the_agents_blocks_and_bytes(node: NodeProcess, path: str) -> None:
    agent = f"test-{path}"
    target = node.unix if path == "local" else node.tcp
    transport = "grpc-stream" if path == "grpc-stream" else "auto"
    base = {"local": 0, "tcp": 10, "grpc-stream": 20}[path]
    with KVClient(target, ClientOptions(agent=agent, transport=transport)) as kv:
        assert kv.put_many([k(base + i) for i in range(3)], [block(i) for i in range(3)], namespace=NS) == [True] * 3
        assert kv.put(k(base), block(0), namespace=NS)  # already there: stored, no new bytes
        got = kv.get_many([k(base), k(base + 1), k(base + 9)])
        assert [g is not None for g in got] == [True, True, False]
        assert kv.lookup([k(base + 2), k(base + 8)]) == ["dram", None]
        assert kv.match_prefix([k(base), k(base + 1), k(base + 7), k(base + 2)]) == 2
    c = agent_counts(node, agent)
    assert (c["stored"], c["refused"], c["write_bytes"]) == (4, 0, 3 * BLOCK)
    assert (c["read_hit"], c["read_miss"], c["read_bytes"]) == (2, 1, 2 * BLOCK)
    assert (c["lookup_hit"], c["lookup_miss"]) == (1 + 2, 1 + 2)
    assert c["calls"] >= 4 and c["seconds"] > 0


def test_calls_without_an_agent_count_as_sdk_and_agents_stay_apart(node: NodeProcess) -> None:
    before = agent_counts(node, "sdk")
    with KVClient(node.unix) as plain, KVClient(node.unix, agent="sglang-hicache") as sg:
        assert plain.put(k(40), block(40), namespace=NS)
        assert sg.get(k(40)) is not None
        assert plain.get(k(41)) is None
    after, sgc = agent_counts(node, "sdk"), agent_counts(node, "sglang-hicache")
    assert after["stored"] - before["stored"] == 1 and after["read_miss"] - before["read_miss"] == 1
    assert after["read_hit"] == before["read_hit"]
    assert (sgc["read_hit"], sgc["read_bytes"], sgc["stored"]) == (1, BLOCK, 0)


def test_agent_labels_are_bounded_and_bad_names_refused(node: NodeProcess, tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="agent"):
        ClientOptions(agent="has spaces")
    with pytest.raises(InvalidArgument, match="agent"):
        KVClient(node.unix, agent="x" * 49)
    n = start(tmp_path, "--dram", "8MiB", "--nvme", "0")
    try:
        for i in range(MAX_AGENTS + 3):
            with KVClient(n.unix, agent=f"agent-{i}") as kv:
                kv.lookup([k(i)])
        m = scrape(n.endpoints["metrics"])
        agents = {dict(labels)["agent"] for (name, labels) in m if name == "kvstore_agent_blocks_total"}
        assert agents == {f"agent-{i}" for i in range(MAX_AGENTS)} | {"other"}
        assert val(m, "kvstore_agent_blocks_total", agent="other", op="lookup", result="miss") == 3
    finally:
        stop(n)

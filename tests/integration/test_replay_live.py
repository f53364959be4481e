"""Live mode against real nodes: the same hit ratio as the simulator, request by request.

Each node is started the way ``kvstore.traces.live`` documents for equivalence: DRAM of
exactly ``capacity`` blocks (block bytes a multiple of the 64 KiB unit), no NVMe tier,
and ``--eviction-policy`` set to the policy under test.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from cluster_fixtures import cluster, etcd  # noqa: F401 - fixtures

from kvstore.cli import main as cli_main
from kvstore.traces.format import Request, Trace
from kvstore.traces.generate import GenParams, generate, generate_events
from kvstore.traces.live import new_salt, replay_live
from kvstore.traces.simulator import simulate

BLOCK = 64 << 10
CAPACITY = 48


@pytest.fixture(scope="module")
def trace() -> Trace:
    # enough reuse (shared prompts, multi-turn) and enough traffic to evict many times over
    reqs = generate(
        GenParams(
            requests=120, seed=11, system_prompts=4, system_tokens=3000, user_tokens=1200, turns=4, think_s=5, rate=8
        )
    )
    t = Trace(reqs)
    assert t.unique_blocks > 4 * CAPACITY
    return t


@pytest.mark.parametrize("policy", ["lru", "prefix-lru", "prefix-reuse"])
def test_live_hits_match_the_simulator(node_factory: Any, trace: Trace, policy: str) -> None:
    node = node_factory("--dram", str(CAPACITY * BLOCK), "--nvme", "0", "--eviction-policy", policy)
    salted = trace.with_salt(new_salt())
    live = replay_live(salted, node.unix, block_bytes=BLOCK, batch=16, log=None)
    sim = simulate(salted, CAPACITY, policy)
    assert live.capacity_blocks == CAPACITY and live.warnings == ()
    assert live.events["dram_evictions"] > 0  # the tier really was too small
    assert live.per_request_hits == sim.per_request_hits
    assert live.hit_ratio == sim.hit_ratio and live.hit_tokens == sim.hit_tokens
    assert 0 < live.hit_ratio < 1
    written = (live.blocks - live.hit_blocks) * BLOCK
    assert 0 < live.bytes_moved["client_to_dram"] <= written
    assert live.bytes_moved["dram_to_client"] == live.hit_blocks * BLOCK
    assert live.bytes_moved["dram_to_nvme"] == 0


def test_live_cli_over_tcp_reports_bytes_and_agrees(
    node_factory: Any, trace: Trace, tmp_path: Any, capsys: Any
) -> None:
    node = node_factory("--dram", str(CAPACITY * BLOCK), "--nvme", "0", "--eviction-policy", "prefix-reuse")
    path = tmp_path / "t.jsonl"
    trace.write(path)
    rc = cli_main(["replay", str(path), "--target", node.tcp, "--policy", "prefix-reuse", "--requests", "60", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["mode"] == "live" and out["capacity_blocks"] == CAPACITY
    assert out["matches_simulator"] is True and out["hit_ratio"] == out["simulated_hit_ratio"]
    assert out["bytes_moved"]["client_to_dram"] > 0
    for k in ("hit_ratio", "optimal_hit_ratio", "lru_hit_ratio", "hit_tokens", "capacity_blocks", "policy"):
        assert k in out
    assert out["optimal_hit_ratio"] >= out["hit_ratio"]


def test_live_warns_when_the_node_is_not_sized_like_the_capacity(node_factory: Any, trace: Trace, capsys: Any) -> None:
    node = node_factory("--dram", str(CAPACITY * BLOCK), "--nvme", "0")
    short = Trace(trace.requests[:10]).with_salt(new_salt())
    live = replay_live(short, node.unix, block_bytes=BLOCK, batch=16, capacity_blocks=CAPACITY * 2)
    assert live.capacity_blocks == CAPACITY
    assert any("--capacity is 96 blocks" in w and "--nvme 0" in w for w in live.warnings)
    assert "warning" in capsys.readouterr().err


def test_live_bad_target_is_a_clear_error(capsys: Any, tmp_path: Any, trace: Trace) -> None:
    path = tmp_path / "t.jsonl"
    Trace(trace.requests[:3]).write(path)
    assert cli_main(["replay", str(path), "--target", "etcd://127.0.0.1:2379"]) == 2
    assert "etcd://HOST:PORT/CLUSTER" in capsys.readouterr().err
    assert cli_main(["replay", str(path), "--target", "nonsense"]) == 2
    assert "host:port" in capsys.readouterr().err


def test_live_honours_timestamps_with_a_speedup(node_factory: Any) -> None:
    node = node_factory("--dram", str(CAPACITY * BLOCK), "--nvme", "0")
    reqs = [Request(ts, 1024, 1, (i, i + 1)) for i, ts in enumerate([0.0, 1000.0, 1000.0, 4000.0])]
    slept: list[float] = []
    live = replay_live(
        Trace(reqs).with_salt(new_salt()),
        node.unix,
        block_bytes=BLOCK,
        batch=16,
        speedup=4.0,
        clock=lambda: 0.0,
        sleep=slept.append,
        log=None,
    )
    assert slept == [0.25, 0.25, 1.0]  # ms / 1000 / speedup, measured from the start
    assert live.requests == 4


def test_live_over_a_cluster(cluster: Any, trace: Trace) -> None:
    """An etcd:// target replays through the SDK's cluster router; capacities and counters are
    summed over the nodes.  Sized so nothing is evicted, the hits equal the simulator's exactly."""
    cluster.start("ra", "rb", extra=("--dram", "64MiB", "--nvme", "0"))
    with cluster.client() as kv:
        assert kv.wait_for_nodes(2, 30)
    salted = Trace(trace.requests[:60]).with_salt(new_salt())
    live = replay_live(salted, cluster.target, block_bytes=BLOCK, batch=16, log=None)
    assert live.capacity_blocks == 2 * (64 << 20) // BLOCK
    assert set(live.node_tiers) == {"ra", "rb"}
    assert any("2 nodes" in w for w in live.warnings)
    assert live.per_request_hits == simulate(salted, live.capacity_blocks, "prefix-reuse").per_request_hits
    assert live.events["dram_evictions"] == 0
    assert live.bytes_moved["client_to_dram"] == (live.blocks - live.hit_blocks) * BLOCK


def test_live_session_hints_match_the_simulator(node_factory: Any) -> None:
    # sessions close 2 s after their last turn: the node's own session code decides, as the simulator's does
    reqs, closes = generate_events(
        GenParams(
            requests=120,
            seed=12,
            system_prompts=4,
            system_tokens=3000,
            user_tokens=1200,
            turns=4,
            think_s=5,
            rate=8,
            close_after_s=2,
        )
    )
    salted = Trace(reqs, closes=closes).with_salt(new_salt())
    assert salted.has_sessions and len(salted.closes) > 10
    node = node_factory("--dram", str(CAPACITY * BLOCK), "--nvme", "0", "--eviction-policy", "prefix-reuse")
    live = replay_live(salted, node.unix, block_bytes=BLOCK, batch=16, log=None)
    hinted = simulate(salted, CAPACITY, "prefix-reuse", sessions=True)
    plain = simulate(salted, CAPACITY, "prefix-reuse")
    assert live.per_request_hits == hinted.per_request_hits
    assert hinted.per_request_hits != plain.per_request_hits  # the hints changed what was kept

"""Simulator mode: the node's own tier manager and policies replaying small traces."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvstore.errors import InvalidArgument
from kvstore.node.manager import TierManager
from kvstore.traces.format import Request, Trace
from kvstore.traces.generate import GenParams, generate
from kvstore.traces.simulator import BytelessArena, build_manager, put_batch, simulate
from tiers.dram import DRAMTier
from tiers.policy import POLICIES, LRUPolicy, PrefixReusePolicy

SHARED = Path(__file__).resolve().parents[1] / "data" / "mooncake_synthetic_trace.jsonl"  # see tests/data/README.md


def test_it_is_the_nodes_own_code() -> None:
    m = build_manager(10, "prefix-reuse")
    assert type(m) is TierManager and type(m.dram) is DRAMTier
    assert type(m.dram.policy) is PrefixReusePolicy and m.nvme is None
    assert m.dram.capacity_bytes == 10  # one unit per block
    with pytest.raises(AttributeError, match="holds no bytes"):
        BytelessArena(10).buf  # noqa: B018


def test_prefix_hits_only() -> None:
    t = Trace.from_hash_ids([[1, 2], [1, 2, 3], [1, 9, 3], [1, 2, 3]])
    r = simulate(t, 100, "lru")
    assert r.per_request_hits == (0, 2, 1, 3)
    assert r.hit_blocks == 6 and r.blocks == 11 and r.hit_ratio == pytest.approx(6 / 11)
    assert r.hit_tokens == 6 * 512 and r.evictions == 0


def test_lru_evicts_the_least_recently_used() -> None:
    t = Trace.from_hash_ids([[1], [2], [1], [3], [1], [2]])
    assert simulate(t, 2, "lru").per_request_hits == (0, 0, 1, 0, 1, 0)  # 3 pushed out 2, not the reused 1


def test_prefix_awareness_through_the_manager() -> None:
    """Two slots, a three-block prompt twice: LRU keeps the useless tail (2, 3) and drops the root;
    prefix-aware LRU drops the leaf 2 before 3 arrives, so the root still hits."""
    t = Trace.from_hash_ids([[1, 2, 3], [1, 2, 3]])
    assert simulate(t, 2, "lru").per_request_hits == (0, 0)
    assert simulate(t, 2, "prefix-lru").per_request_hits == (0, 1)


def test_tokens_count_the_partial_last_block() -> None:
    t = Trace([Request(0, 1000, 0, (1, 2)), Request(1, 1000, 0, (1, 2)), Request(2, 700, 0, (1, 5))])
    r = simulate(t, 10, "lru")
    assert r.per_request_hits == (0, 2, 1)
    assert r.hit_tokens == 1000 + 512 and r.tokens == 2700
    assert r.token_hit_ratio == pytest.approx(1512 / 2700)


def test_put_batch_is_capped_at_a_quarter_of_the_tier() -> None:
    assert put_batch(1000) == 16 and put_batch(1000, 4) == 4
    assert put_batch(40) == 10 and put_batch(7) == 1 and put_batch(1) == 1


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_replays_deterministically(name: str) -> None:
    t = Trace(generate(GenParams(requests=150, seed=3)))
    a, b = simulate(t, 40, name), simulate(t, 40, name)
    assert a == b
    assert 0 < a.hit_ratio <= t.summary()["unlimited_hit_ratio"]
    assert a.evictions > 0


def test_tier_of_one_block() -> None:
    t = Trace.from_hash_ids([[1], [1], [2], [2, 3]])
    assert simulate(t, 1, "prefix-reuse").per_request_hits == (0, 1, 0, 1)


@pytest.mark.parametrize("bad", [0, -3, True, 2.5, "10"])
def test_bad_capacity(bad) -> None:
    with pytest.raises(InvalidArgument, match="--capacity must be a positive number of blocks"):
        simulate(Trace.from_hash_ids([[1]]), bad, "lru")


def test_unknown_policy_names_the_choices() -> None:
    with pytest.raises(InvalidArgument, match=r"unknown policy 'belady' \(--policy\); choose one of .*prefix-reuse"):
        simulate(Trace.from_hash_ids([[1]]), 1, "belady")


def test_lru_class_is_used_for_lru() -> None:
    assert type(build_manager(3, "lru").dram.policy) is LRUPolicy


def test_many_random_traces_never_overfill() -> None:
    rng = random.Random(5)
    chains = [[rng.randrange(8) for _ in range(rng.randint(1, 6))] for _ in range(200)]
    t = Trace.from_hash_ids(chains)
    for name in POLICIES:
        for cap in (1, 3, 8):
            r = simulate(t, cap, name)
            assert r.hit_blocks <= t.total_blocks


def test_issue_lru_figure_on_the_shared_trace() -> None:
    """The issue: at 2,000 blocks plain LRU gets about 15%."""
    r = simulate(Trace.load(SHARED), 2000, "lru")
    assert r.hit_ratio == pytest.approx(0.144, abs=0.005)


def test_replay_loop_runs_on_virtual_time() -> None:
    """A timer wakes only once nothing else is ready, however long the ready work takes in
    real time: the manager's 1 ms back-off cannot make a two-tier replay depend on load."""
    import asyncio
    import time

    from kvstore.traces.simulator import run_replay

    order: list[str] = []

    async def sleeper() -> None:
        await asyncio.sleep(0.001)
        order.append("timer")

    async def worker() -> None:
        for i in range(50):
            time.sleep(0.0002)  # 10 ms of real time in all: a real clock would fire the timer midway
            order.append(str(i))
            await asyncio.sleep(0)

    async def both() -> float:
        loop = asyncio.get_running_loop()
        start = loop.time()
        await asyncio.gather(sleeper(), worker())
        return loop.time() - start

    elapsed = run_replay(both())
    assert order == [str(i) for i in range(50)] + ["timer"]
    assert elapsed == pytest.approx(0.001)  # virtual seconds: only the timer's


def test_two_tier_replays_repeat_exactly() -> None:
    trace = Trace(generate(GenParams(requests=250, seed=202)))
    a = simulate(trace, 28, "prefix-reuse", nvme_blocks=282)
    b = simulate(trace, 28, "prefix-reuse", nvme_blocks=282)
    assert a.per_request_hits == b.per_request_hits and a.tier_hits == b.tier_hits

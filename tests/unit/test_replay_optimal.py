"""The offline optimum: Belady's MIN with bypass equals an exhaustive search on tiny traces,
bounds every policy, and reproduces the issue's figures on the shared Mooncake trace."""

from __future__ import annotations

import functools
import random
from pathlib import Path

import pytest

from kvstore.traces.format import Trace
from kvstore.traces.optimal import optimal
from kvstore.traces.simulator import simulate
from tiers.policy import POLICIES

SHARED = Path(__file__).resolve().parents[1] / "data" / "mooncake_synthetic_trace.jsonl"  # see tests/data/README.md


def brute_force(trace: Trace, capacity: int) -> int:
    """Most prefix-hit blocks any cache of ``capacity`` blocks can get: every choice, at every
    miss, of storing the block or not and of which resident block to drop."""
    refs = [(b, j == 0) for bs in trace.block_ids for j, b in enumerate(bs)]

    @functools.cache
    def best(i: int, cache: frozenset[int], in_run: bool) -> int:
        if i == len(refs):
            return 0
        b, first = refs[i]
        in_run = in_run or first
        if b in cache:
            return int(in_run) + best(i + 1, cache, in_run)
        options = [best(i + 1, cache, False)]  # not stored
        if len(cache) < capacity:
            options.append(best(i + 1, cache | {b}, False))
        else:
            options.extend(best(i + 1, (cache - {v}) | {b}, False) for v in cache)
        return max(options)

    return best(0, frozenset(), False)


def random_trace(rng: random.Random, requests: int, ids: int) -> Trace:
    chains: list[list[int]] = []
    for _ in range(requests):
        base = list(rng.choice(chains)) if chains and rng.random() < 0.7 else []
        base = base[: rng.randint(0, len(base))]
        base += [rng.randrange(ids) for _ in range(rng.randint(0 if base else 1, 2))]
        chains.append(base)
    return Trace.from_hash_ids(chains)


@pytest.mark.parametrize("seed", range(40))
def test_matches_brute_force_on_tiny_traces(seed: int) -> None:
    rng = random.Random(seed)
    trace = random_trace(rng, rng.randint(4, 8), rng.randint(3, 6))
    for capacity in range(1, 5):
        res = optimal(trace, capacity)
        assert res.hit_blocks == brute_force(trace, capacity), (trace.block_ids, capacity)
        assert res.hit_blocks == sum(res.per_request_hits)


def test_hand_worked_example() -> None:
    # A-B used three times, C-D twice in between: with two slots keep A-B (4 hits), not C-D (2)
    trace = Trace.from_hash_ids([[1, 2], [3, 4], [1, 2], [3, 4], [1, 2]])
    assert optimal(trace, 2).per_request_hits == (0, 0, 2, 0, 2)
    assert optimal(trace, 4).per_request_hits == (0, 0, 2, 2, 2)
    # a block behind a missing parent is not a hit, even when it is stored
    trace = Trace.from_hash_ids([[1, 2, 3], [1, 2, 3]])
    assert optimal(trace, 1).per_request_hits == (0, 1)


@pytest.mark.parametrize("seed", range(5))
def test_no_policy_beats_the_optimum(seed: int) -> None:
    rng = random.Random(100 + seed)
    trace = random_trace(rng, 300, 40)
    for capacity in (3, 10, 30):
        bound = optimal(trace, capacity).hit_blocks
        for name in POLICIES:
            assert simulate(trace, capacity, name).hit_blocks <= bound


def test_unlimited_capacity_is_every_repeat() -> None:
    trace = random_trace(random.Random(7), 200, 30)
    res = optimal(trace, trace.unique_blocks)
    assert res.hit_ratio == pytest.approx(trace.summary()["unlimited_hit_ratio"])


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        optimal(Trace.from_hash_ids([[1]]), 0)


def test_issue_figures_on_the_shared_trace() -> None:
    """The issue: unlimited 64.0%; at 2,000 blocks LRU about 15% and the optimum about 38%."""
    trace = Trace.load(SHARED)
    s = trace.summary()
    assert (s["requests"], s["blocks"], s["unique_blocks"]) == (3993, 121877, 43924)
    assert s["unlimited_hit_ratio"] == pytest.approx(0.640, abs=0.0005)
    assert optimal(trace, 2000).hit_ratio == pytest.approx(0.38, abs=0.005)
    assert optimal(trace, trace.unique_blocks).hit_ratio == pytest.approx(s["unlimited_hit_ratio"])

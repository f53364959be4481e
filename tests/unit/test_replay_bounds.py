"""Oracle bounds (``kvstore replay --bounds``): the oracles replay through the node's own
tier manager, read the future correctly, never beat the optimum, and the predictability
figures measure what they say."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.cli import main
from kvstore.traces.bounds import FutureUses, OracleDeadLRU, OracleNextUse, _auc, _r2, bounds, predictability
from kvstore.traces.format import Trace
from kvstore.traces.generate import GenParams, generate
from kvstore.traces.optimal import optimal
from kvstore.traces.simulator import simulate


def _sim(trace: Trace, capacity: int, pol: Any) -> tuple[int, ...]:
    return simulate(trace, capacity, pol, before_request=pol.advance).per_request_hits


def test_oracles_read_the_future_on_a_hand_worked_trace() -> None:
    # one-block requests 1, 2, 3, 1, 2 into 2 slots.  LRU: 3 evicts 1, 1 evicts 2, 2 evicts 3: no hit.
    t = Trace.from_hash_ids([[1], [2], [3], [1], [2]])
    f = FutureUses(t)
    assert simulate(t, 2, "lru").per_request_hits == (0, 0, 0, 0, 0)
    # dead-first LRU: 3 still evicts 1 (nothing resident is dead yet), then 3 (dead) goes first: 2 hits
    assert _sim(t, 2, OracleDeadLRU(f)) == (0, 0, 0, 0, 1)
    # next-use order: 3 evicts 2 (used at 4, later than 1 at 3); 1 hits; 2 then evicts 3 (dead)
    assert _sim(t, 2, OracleNextUse(f)) == (0, 0, 0, 1, 0)
    assert optimal(t, 2).per_request_hits == (0, 0, 0, 1, 1)  # bypassing 3 keeps both


def test_future_uses_and_the_clock() -> None:
    t = Trace.from_hash_ids([[1, 2], [1], [3], [1, 2]])
    f = FutureUses(t)
    k1, k2 = t.keys[0]
    assert [f.next_after(k1, i) for i in range(4)] == [1, 3, 3, None]
    assert [f.next_after(k2, i) for i in range(4)] == [3, 3, 3, None]
    assert f.next_after(t.keys[2][0], 2) is None


@pytest.fixture(scope="module")
def gen_trace() -> Trace:
    return Trace(generate(GenParams(requests=400, seed=11)))


def test_bounds_are_bounded_by_the_optimum_and_deterministic(gen_trace: Trace) -> None:
    cap = max(8, gen_trace.unique_blocks // 20)
    r = bounds(gen_trace, cap)
    rows = {b.name: b for b in r.bounds}
    opt = rows["optimal"].hit_ratio
    assert set(rows) >= {
        "lru",
        "prefix-reuse",
        "oracle-dead-lru",
        "oracle-next-use",
        "oracle-next-use@R2=0.5",
        "oracle-next-use@R2=0.5,dead-unknown",
        "optimal",
    }
    for b in r.bounds:
        assert 0.0 <= b.hit_ratio <= opt + 1e-12, b
    assert rows["oracle-next-use"].hit_ratio > rows["lru"].hit_ratio
    assert rows["lru"].gap_closed == 0.0 and rows["optimal"].gap_closed == 1.0
    again = bounds(gen_trace, cap)
    assert [b.hit_ratio for b in again.bounds] == [b.hit_ratio for b in r.bounds]  # seeded draws
    assert json.loads(json.dumps(r.to_json()))["capacity_blocks"] == cap


def test_noisy_predictor_is_a_regression_not_truth_plus_noise(gen_trace: Trace) -> None:
    f = FutureUses(gen_trace)
    with pytest.raises(ValueError):
        OracleNextUse(f, 1.5)
    p = OracleNextUse(f, 0.25)
    assert p.name == "oracle-next-use@R2=0.25"
    assert OracleNextUse(f, 0.25, dead_known=False).name.endswith(",dead-unknown")
    # the draws of one (request, next use) pair are shared by every block of that turn
    cap = max(8, gen_trace.unique_blocks // 20)
    _sim(gen_trace, cap, p)
    assert 0 < len(p._draws) < gen_trace.total_blocks


def test_auc_and_r2_helpers() -> None:
    assert _auc(np.array([1, 2, 3, 4]), np.array([False, False, True, True])) == 1.0
    assert _auc(np.array([4, 3, 2, 1]), np.array([False, False, True, True])) == 0.0
    assert _auc(np.array([1, 1, 1, 1]), np.array([False, True, False, True])) == 0.5
    x = np.arange(20, dtype=float)
    assert _r2(x[:, None], 2 * x + 1) == pytest.approx(1.0)
    rng = np.random.default_rng(0)
    assert abs(_r2(rng.normal(size=(2000, 1)), rng.normal(size=2000))) < 0.01


def test_predictability_on_a_trace_where_the_turn_tells_everything() -> None:
    # 30 two-turn conversations: a first turn's blocks are always used again, a second's never
    chains = []
    for c in range(30):
        base = [1000 * c + j for j in range(3)]
        chains += [base, base + [1000 * c + 3, 1000 * c + 4]]
    p = predictability(Trace.from_hash_ids(chains))
    assert p.reuse_probability["1"] == 1.0 and p.reuse_probability["2"] == 0.0
    assert p.reuse_auc == 1.0
    assert p.samples == sum(len(c) for c in chains)


def test_cli_bounds(capsys: Any, tmp_path: Path, gen_trace: Trace) -> None:
    f = tmp_path / "t.jsonl"
    gen_trace.write(f)
    assert main(["replay", str(f), "--capacity", "5%", "--bounds", "--json"]) == 0
    o = json.loads(capsys.readouterr().out)
    names = [b["name"] for b in o["oracle_bounds"]["bounds"]]
    assert names[0] == "lru" and names[-1] == "optimal" and "oracle-dead-lru" in names
    assert set(o["oracle_bounds"]["predictability"]) == {"reuse_probability", "reuse_auc", "gap_r2", "samples"}
    assert main(["replay", str(f), "--capacity", "5%", "--bounds"]) == 0
    out = capsys.readouterr().out
    assert "oracle bounds" in out and "oracle-next-use" in out and "AUC" in out
    assert main(["replay", str(f), "--capacity", "5%", "--bounds", "--target", "127.0.0.1:1"]) == 2
    assert "--bounds is a simulator report" in capsys.readouterr().err


def test_closes_at_last_turn_bound_what_a_close_hint_can_tell() -> None:
    from kvstore.traces.bounds import closes_at_last_turn
    from kvstore.traces.generate import generate_events

    reqs, closes = generate_events(GenParams(requests=800, seed=101, close_after_s=60))
    trace = Trace(reqs, closes=closes)
    oracle = closes_at_last_turn(trace)
    # one close per session, right after its last request, at that request's time
    last = {r.session_id: i for i, r in enumerate(trace.requests)}
    assert sorted((c.session_id, c.before) for c in oracle.closes) == sorted((s, i + 1) for s, i in last.items())
    assert all(c.timestamp == trace.requests[c.before - 1].timestamp for c in oracle.closes)
    assert oracle.keys == trace.keys and len(oracle.closes) > len(trace.closes)
    cap = round(0.05 * trace.unique_blocks)
    rows = {b.name: b for b in bounds(trace, cap).bounds}
    assert rows["prefix-reuse+sessions"].hit_ratio > rows["prefix-reuse"].hit_ratio
    assert rows["oracle-close-at-last-turn"].hit_ratio > rows["prefix-reuse+sessions"].hit_ratio
    assert rows["oracle-close-at-last-turn"].hit_ratio < rows["optimal"].hit_ratio
    # without session ids there is nothing to hint
    assert "oracle-close-at-last-turn" not in {b.name for b in bounds(trace.without_sessions(), cap).bounds}

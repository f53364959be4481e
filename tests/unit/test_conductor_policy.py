"""The conductor's decision and cost model, as pure functions: estimates from token counts,
ties, prefill/decode, early rejection, and a model that learns the fleet's speed."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvstore.conductor.cost import CostModel, Load, Priors
from kvstore.conductor.engines import Stream
from kvstore.conductor.policy import (
    EngineLoad,
    PoolMatch,
    Slo,
    _pool_split,
    _Splitter,
    decide,
    early_refusal,
    estimate,
    handoff_load,
)

# a model with exact, easy numbers: 1 ms per computed token, 0.1 ms per DRAM token,
# 0.3 ms per NVMe token, 0.5 ms per remote token, no base cost
PRIORS = Priors(prefill_tokens_per_s=1000, base_s=0.0, load_gbps=(10.0, 10 / 3, 2.0), bytes_per_token=1_000_000)


def model() -> CostModel:
    return CostModel(PRIORS)


def eng(
    eid: str, *, local: int = 0, queued: float = 0, running: int = 0, node: str = "n1", role: str = "both"
) -> EngineLoad:
    # queued: prompt tokens ahead, whose work is 1 ms a token (PRIORS' prefill rate)
    return EngineLoad(eid, role, node, local, queued, running, queued_s=queued / 1000)


def test_the_estimate_counts_compute_queue_and_each_tier() -> None:
    m = model()
    pool = PoolMatch(100, (("n1", "dram"), ("n1", "nvme"), ("n2", "dram")))
    e = estimate(m, eng("a", local=50, queued=200), 1000, pool)
    # local 0..50, pool 50..300: 50 DRAM (rest of chunk 0), 100 NVMe, 100 remote (chunk on n2)
    assert (e.local_tokens, e.pool_tokens) == (50, 250)
    assert (e.load.dram, e.load.nvme, e.load.remote, e.load.compute) == (50, 100, 100, 700)
    assert e.ttft_s == pytest.approx(0.9 + 0.005 + 0.03 + 0.05)


def test_no_hit_covers_the_last_prompt_token() -> None:
    m = model()
    pool = PoolMatch(100, (("n1", "dram"),) * 3)
    e = estimate(m, eng("a", local=300), 300, pool)
    assert e.local_tokens == 299 and e.pool_tokens == 0 and e.load.compute == 1


def test_the_splitter_agrees_with_the_plain_split_everywhere() -> None:
    rng = np.random.default_rng(1)
    where = tuple((f"n{rng.integers(3)}", "dram" if rng.random() < 0.6 else "nvme") for _ in range(40))
    pool = PoolMatch(64, where)
    sp = _Splitter(pool)
    for _ in range(300):
        a, b = sorted(int(x) for x in rng.integers(0, 40 * 64 + 1, 2))
        for node in ("n0", "n1", "n2", ""):
            assert sp.split(a, b, node) == _pool_split(pool, a, b, node), (a, b, node)


def test_the_engine_holding_the_prefix_wins_unless_its_queue_costs_more() -> None:
    m = model()
    d = decide(m, [eng("a", local=800), eng("b")], 1000)
    assert d.engine is not None and d.engine.engine_id == "a" and d.reason == "lowest ttft"
    # a's queue (1,000 tokens) costs more than b's recompute of the 800 it lacks
    d = decide(m, [eng("a", local=800, queued=1000), eng("b")], 1000)
    assert d.engine is not None and d.engine.engine_id == "b"


def test_a_hot_prefix_on_a_saturated_engine_is_served_from_the_pool_by_another() -> None:
    m = model()
    pool = PoolMatch(100, tuple(("n2", "dram") for _ in range(8)))  # a's own node holds it too? no: b's
    d = decide(m, [eng("a", local=800, queued=5000, node="n1"), eng("b", node="n2")], 1000, pool)
    assert d.engine is not None and d.engine.engine_id == "b"
    assert d.engine.pool_tokens == 800 and d.engine.load.dram == 800


def test_near_ties_go_to_the_less_loaded_engine_and_exact_ties_spread() -> None:
    m = model()
    d = decide(m, [eng("a", running=5), eng("b", queued=10, running=0)], 1000, slo=Slo(tie=0.05))
    assert d.engine is not None and d.engine.engine_id == "a"  # b's 10 queued tokens: 1 % slower, a near-tie
    d = decide(m, [eng("a", queued=10), eng("b", queued=0)], 1000)
    assert d.engine is not None and d.engine.engine_id == "b"
    d = decide(m, [EngineLoad("a", "both", "n1", 0, 0, 0, sent=3), EngineLoad("b", "both", "n1", 0, 0, 0, sent=1)], 10)
    assert d.engine is not None and d.engine.engine_id == "b"


def test_an_uncalibrated_model_refuses_nothing_a_calibrated_one_refuses_what_misses() -> None:
    m = model()
    slo = Slo(ttft_s=0.5, min_samples=3)
    busy = [eng("a", queued=5000)]
    assert not decide(m, busy, 1000, slo=slo).refused
    for _ in range(3):
        m.observe_ttft("a", Load(compute=1000, queued_s=0), 1.0)
    d = decide(m, busy, 1000, slo=slo)
    assert d.refused == "ttft" and d.engine is None and d.retry_after_s >= 1
    assert d.predicted_ttft_s > 0.5
    assert not decide(m, [eng("a")], 100, slo=slo).refused


def test_the_tbt_target_excludes_engines_running_too_many_decodes() -> None:
    m = model()
    for r in range(1, 30):  # 10 ms + 2 ms per running decode
        m.observe_tbt(r, 0.010 + 0.002 * r)
    slo = Slo(tbt_s=0.05, min_samples=0)
    d = decide(m, [eng("a", running=25), eng("b", running=3, queued=3000)], 100, slo=slo)
    assert d.engine is not None and d.engine.engine_id == "b"
    d = decide(m, [eng("a", running=25)], 100, slo=slo)
    assert d.refused == "tbt"
    # a target an idle engine misses too is not the load's doing: refusing would only idle the fleet
    d = decide(m, [eng("a", running=25)], 100, slo=Slo(tbt_s=0.011, min_samples=0))
    assert not d.refused and d.engine is not None


def test_an_early_refusal_is_one_the_full_decision_gives_whatever_the_caches_hold() -> None:
    """``early_refusal`` answers before the pool lookup and the cache walk: it may refuse
    only what ``decide`` refuses for every cache and pool state, and must refuse the
    overloaded fleet (every queue alone past the target) without them."""
    rng = np.random.default_rng(3)
    m = model()
    for r in range(1, 30):
        m.observe_tbt(r, 0.010 + 0.002 * r)
    slo = Slo(ttft_s=0.5, tbt_s=0.05, min_samples=0)
    early_count = 0
    for _ in range(400):
        pd = bool(rng.random() < 0.3)
        roles = ["prefill", "decode"] if pd else ["both"]
        engines = [
            eng(
                f"e{i}",
                queued=float(rng.integers(0, 900)),
                running=int(rng.integers(0, 30)),
                node=f"n{rng.integers(2)}",
                role=roles[i % len(roles)],
            )
            for i in range(4)
        ]
        n = int(rng.integers(2, 1000))
        early = early_refusal(m, engines, n, slo, pd=pd)
        if early is None:
            continue
        early_count += 1
        for _ in range(5):  # any cache and pool state: the full decision refuses too, for the same target
            cached = [dataclasses.replace(e, local_tokens=int(rng.integers(0, n + 1))) for e in engines]
            where = tuple(("n0", "dram") for _ in range(int(rng.integers(0, n // 100 + 1))))
            d = decide(m, cached, n, PoolMatch(100, where), slo, pd=pd)
            assert d.refused == early.refused, (early, d)
    assert early_count > 50  # the case was exercised
    overloaded = [eng("a", queued=900), eng("b", queued=700)]  # 0.7 s of queue or more on each
    assert early_refusal(m, overloaded, 100, slo) is not None
    assert early_refusal(m, [eng("a", queued=900), eng("b")], 100, slo) is None  # b is free
    assert early_refusal(model(), overloaded, 100, Slo(ttft_s=0.5)) is None  # uncalibrated: never


def test_a_decode_stream_knows_the_longest_stall_its_tbt_can_take() -> None:
    slo = 0.2
    short = Stream(max_tokens=10, intervals=[0.05, 0.12], started=0.0)  # TBT: its single slowest gap
    assert short.headroom(slo) == pytest.approx(0.2)
    assert Stream(10, [0.05, 0.25], 0.0).headroom(slo) == -1.0  # it misses already
    longer = Stream(max_tokens=20, intervals=[0.05, 0.12, 0.03], started=0.0)  # the mean of its slowest 2
    assert longer.headroom(slo) == pytest.approx(0.4 - 0.12)
    assert longer.remaining_s(now=0.3) == pytest.approx(16 * 0.1)  # 19 gaps in all, 3 done in 0.3 s


def test_a_streams_headroom_read_gap_by_gap_equals_the_whole_reckoning() -> None:
    """The stream reads only the gaps appended since its last answer: after every append,
    its headroom is the one computed from all the gaps sorted afresh."""

    def whole(max_tokens: int, gaps: list[float], slo: float) -> float:
        k = max(1, -(-max(max_tokens - 1, 1) // 10))
        worst = sorted(gaps, reverse=True)[:k]
        return -1.0 if sum(worst) > k * slo else k * slo - sum(worst[: k - 1])

    rng = np.random.default_rng(3)
    for _ in range(200):
        max_tokens, slo = int(rng.integers(1, 120)), float(rng.uniform(0.05, 0.5))
        gaps: list[float] = []
        st = Stream(max_tokens, gaps, 0.0)
        for _ in range(int(rng.integers(0, 60))):
            for _ in range(int(rng.integers(1, 4))):  # one or more gaps between two questions
                gaps.append(float(rng.exponential(0.04)))
            assert st.headroom(slo) == pytest.approx(whole(max_tokens, gaps, slo), abs=1e-12)


def test_with_targets_a_long_prefill_goes_where_it_stalls_no_decode_that_meets_its_tbt() -> None:
    """Goodput placement: a 1,000-token prefill (1 s here) on engine a would stall a's three
    decodes past a 200 ms TBT; b's decodes miss their target already.  The request goes to
    b though its estimate is longer, as long as it meets its own TTFT target; a short
    prompt, whose prefill every decode can take, goes to the lowest estimate as before."""
    m = model()
    for r in range(1, 30):
        m.observe_tbt(r, 0.010 + 0.001 * r)
    healthy = ((0.15, 5.0),) * 3  # each can take a 150 ms stall, and decodes 5 s more
    a = dataclasses.replace(eng("a"), at_risk=healthy)
    b = eng("b", queued=300)  # 0.3 s of queue, no decode at risk
    slo = Slo(ttft_s=2.0, tbt_s=0.2, min_samples=0, reject=False)
    d = decide(m, [a, b], 1000, slo=slo)
    assert d.engine is not None and d.engine.engine_id == "b" and d.reason == "fewest SLOs lost (0)"
    d = decide(m, [a, b], 100, slo=slo)  # 100 ms of prefill: no decode loses its target
    assert d.engine is not None and d.engine.engine_id == "a" and d.reason == "lowest ttft"
    # b's queue would make the request miss its own TTFT: one lost there, three on a
    late_b = dataclasses.replace(b, queued_s=3.0)
    d = decide(m, [a, late_b], 1000, slo=slo)
    assert d.engine is not None and d.engine.engine_id == "b" and d.reason == "fewest SLOs lost (1)"
    # with one decode at risk on a, the request's own target weighs as much: the quicker engine
    one = dataclasses.replace(a, at_risk=healthy[:1])
    d = decide(m, [one, late_b], 1000, slo=slo)
    assert d.engine is not None and d.engine.engine_id == "a"
    # decodes that finish before the queue ahead of the prefill drains cannot be stalled by it
    a_done_soon = dataclasses.replace(a, at_risk=((0.15, 0.01),) * 3, queued_s=0.1)
    d = decide(m, [a_done_soon, b], 1000, slo=slo)
    assert d.engine is not None and d.engine.engine_id == "a"
    # without targets, placement is by estimate alone
    assert decide(m, [a, b], 1000).engine.engine_id == "a"  # type: ignore[union-attr]


def test_with_rejection_a_request_every_placement_would_cost_a_target_is_refused() -> None:
    """Past the knee a request that would push running decodes over their TBT target
    wherever it went, or miss its own TTFT, serves nothing the fleet keeps: with rejection
    on it is refused before any engine works on it (a 429 with the reason); where one
    engine can take it at no cost it goes there; without rejection it is placed (the
    fewest targets lost), as before."""
    m = model()
    for r in range(1, 30):
        m.observe_tbt(r, 0.010 + 0.001 * r)
    healthy = ((0.15, 5.0),) * 3  # each can take a 150 ms stall, and decodes 5 s more
    a = dataclasses.replace(eng("a"), at_risk=healthy)
    late_b = dataclasses.replace(eng("b"), queued_s=3.0)  # the request would miss 2 s there
    reject = Slo(ttft_s=2.0, tbt_s=0.2, min_samples=0, reject=True)
    d = decide(m, [a, late_b], 1000, slo=reject)  # 1 s of prefill: a's decodes lose, or its own TTFT
    assert d.engine is None and d.refused == "tbt" and d.retry_after_s >= 1, d
    assert d.reason == "every placement loses 1" and d.predicted_ttft_s < 2.0
    assert decide(m, [a, late_b], 100, slo=reject).engine.engine_id == "a"  # type: ignore[union-attr]
    free = eng("c", queued=300)
    assert decide(m, [a, late_b, free], 1000, slo=reject).engine.engine_id == "c"  # type: ignore[union-attr]
    placed = decide(m, [a, late_b], 1000, slo=dataclasses.replace(reject, reject=False))
    assert placed.engine is not None and placed.reason == "fewest SLOs lost (1)"


def test_targets_without_rejection_refuse_nothing() -> None:
    m = model()
    for _ in range(3):
        m.observe_ttft("a", Load(compute=1000, queued_s=0), 1.0)
    busy = [eng("a", queued=5000)]
    assert decide(m, busy, 1000, slo=Slo(ttft_s=0.5, min_samples=3)).refused == "ttft"
    quiet = Slo(ttft_s=0.5, tbt_s=0.01, min_samples=3, reject=False)
    d = decide(m, busy, 1000, slo=quiet)
    assert not d.refused and d.engine is not None
    assert early_refusal(m, busy, 1000, quiet) is None


def test_prefill_decode_picks_each_half_by_its_own_measure() -> None:
    m = model()
    engines = [
        eng("p1", role="prefill", queued=2000),
        eng("p2", role="prefill"),
        eng("d1", role="decode", running=9, node="n2"),
        eng("d2", role="decode", running=1, node="n1"),
    ]
    d = decide(m, engines, 1000, PoolMatch(256), pd=True)
    assert d.prefill is not None and d.engine is not None
    assert (d.prefill.engine_id, d.engine.engine_id) == ("p2", "d2")
    # the decode engine loads the prefill's full chunks (768 of 1,000 tokens) from its own node's DRAM
    assert d.handoff is not None and (d.handoff.dram, d.handoff.remote, d.handoff.compute) == (768, 0, 232)
    assert d.predicted_ttft_s == pytest.approx(d.prefill.ttft_s + d.handoff_s)
    assert decide(m, engines[:2], 1000, pd=True).refused


def test_prefill_decode_pairs_by_the_first_token_with_the_handoff() -> None:
    m = model()
    # the fastest prefill engine alone is p_far (1.0 s), but its chunks would cross the
    # network to the only decode engine (768 stored tokens at 0.5 ms: 0.384 s, plus 232
    # computed): 1.616 s; p_near shares the decode engine's node: 1.1 s + 0.077 + 0.232
    engines = [
        eng("p_far", role="prefill", node="n2"),
        eng("p_near", role="prefill", node="n1", queued=100),
        eng("d1", role="decode", node="n1"),
    ]
    d = decide(m, engines, 1000, PoolMatch(256), pd=True)
    assert d.prefill is not None and d.engine is not None
    assert (d.prefill.engine_id, d.engine.engine_id) == ("p_near", "d1")
    assert d.handoff is not None and (d.handoff.dram, d.handoff.remote) == (768, 0)
    assert d.predicted_ttft_s == pytest.approx(1.1 + 0.0768 + 0.232)
    # once p_near's queue costs more than the transfer saves, the faster engine is paired
    engines[1] = eng("p_near", role="prefill", node="n1", queued=500)
    d = decide(m, engines, 1000, PoolMatch(256), pd=True)
    assert d.prefill is not None and d.prefill.engine_id == "p_far"
    assert d.handoff is not None and (d.handoff.dram, d.handoff.remote) == (0, 768)
    # a decode engine on the prefill's node beats a less loaded one across the network while
    # its queue costs less than the transfer, and loses once it costs more
    pre = eng("p", role="prefill", node="n1")
    for queued, want in ((100, "d_same"), (600, "d_other")):
        d = decide(
            m,
            [pre, eng("d_same", role="decode", node="n1", queued=queued), eng("d_other", role="decode", node="n2")],
            1000,
            PoolMatch(256),
            pd=True,
        )
        assert d.engine is not None and d.engine.engine_id == want, queued


def test_prefill_decode_pairing_is_the_best_of_every_pair() -> None:
    # the two-options-per-decode-engine search finds the pair an exhaustive one does
    rng = np.random.default_rng(7)
    for _ in range(200):
        m = model()
        nodes = [f"n{i}" for i in range(int(rng.integers(1, 4)))]
        engines = [
            eng(
                f"{role[0]}{i}",
                role=role,
                node=str(rng.choice(nodes)),
                queued=float(rng.integers(0, 1500)),
                running=int(rng.integers(0, 4)),
            )
            for role in ("prefill", "decode")
            for i in range(int(rng.integers(1, 5)))
        ]
        n = int(rng.integers(300, 3000))
        d = decide(m, engines, n, PoolMatch(256), pd=True, slo=Slo(tie=0.0, tie_s=0.0))
        best = min(
            estimate(m, p, n, PoolMatch(256)).ttft_s + m.ttft(q.engine_id, handoff_load(p, q, n, 256))
            for p in engines
            if p.role == "prefill"
            for q in engines
            if q.role == "decode"
        )
        assert d.predicted_ttft_s == pytest.approx(best)


def test_the_model_learns_an_engine_speed_it_was_not_told() -> None:
    m = CostModel(Priors(prefill_tokens_per_s=2000))
    rng = np.random.default_rng(0)
    for _ in range(60):  # the real engine: 50 ms + 4 ms per token, 1 ms per DRAM token
        load = Load(
            compute=int(rng.integers(50, 2000)), queued_s=float(rng.uniform(0, 3)), dram=int(rng.integers(0, 2000))
        )
        m.observe_ttft("e", load, 0.05 + 0.004 * load.compute + 1.2 * load.queued_s + 0.001 * load.dram)
    assert m.prefill_rate("e") == pytest.approx(250, rel=0.05)
    probe = Load(compute=700, queued_s=0.3, dram=500)
    assert m.ttft("e", probe) == pytest.approx(0.05 + 2.8 + 0.36 + 0.5, rel=0.05)
    # a new engine starts from what the fleet learned
    assert m.ttft("new", probe) == pytest.approx(m.ttft("e", probe), rel=0.01)


def test_an_engine_that_falls_behind_is_followed_within_a_few_requests() -> None:
    """Overload makes an engine slower than any feature says: its recent bias follows
    within a dozen requests, long before the fit itself would."""
    m = CostModel(Priors(prefill_tokens_per_s=1000))
    rng = np.random.default_rng(1)
    loads = [Load(compute=int(rng.integers(100, 1000)), queued_s=0.0) for _ in range(80)]
    for load in loads[:40]:
        m.observe_ttft("e", load, 0.05 + 0.001 * load.compute)
    probe = Load(compute=500, queued_s=0.0)
    assert m.ttft("e", probe) == pytest.approx(0.55, rel=0.05)
    for load in loads[40:52]:  # now everything takes three times as long
        m.observe_ttft("e", load, 3 * (0.05 + 0.001 * load.compute))
    assert m.ttft("e", probe) == pytest.approx(1.65, rel=0.25)


def test_an_engine_whose_own_fit_lost_its_work_still_prices_tokens() -> None:
    """An engine's own fit can wander to zero work (its first tokens under overload are
    mostly queueing the features do not see); estimated at 0 s, its queue of estimated work
    would stay empty and it would get every request.  Its compute and loads are priced at
    least WORK_FLOOR of the fleet's."""
    from kvstore.conductor.cost import OWN_FIT_SAMPLES, WORK_FLOOR

    m = model()
    for i in range(4 * (OWN_FIT_SAMPLES + 10)):
        n = 200 + 50 * (i % 20)
        for e in ("a", "b", "c", "d", "e", "f"):  # the fleet: 1 ms a computed token
            m.observe_ttft(e, Load(compute=n, queued_s=0), n / 1000)
        if i % 4 == 0:  # "z", now and then: the longer the prompt, the sooner its first token
            m.observe_ttft("z", Load(compute=n, queued_s=0), max(0.001, 1.2 - n / 1000))
    assert m.engines["z"].samples >= OWN_FIT_SAMPLES and m.engines["z"].wp[1] == 0.0  # its own fit: no compute cost
    fleet_c = m.fleet.wp[1]
    assert m.work("z", Load(compute=1000, queued_s=0)) >= WORK_FLOOR * fleet_c * 1000 / 1000 > 0
    # with work priced, what is sent to z queues there: it stops being everyone's cheapest
    e = dataclasses.replace(eng("z", queued=0), queued_s=m.work("z", Load(compute=1000, queued_s=0)) * 30)
    d = decide(m, [e, eng("a")], 1000)
    assert d.engine is not None and d.engine.engine_id == "a"


def test_an_engines_queue_sums_equal_a_walk_over_its_requests() -> None:
    """The engine's queue (prompt tokens, seconds of work) is kept as requests are sent,
    reach their first token or end, so a decision walks none of them: at every step of a
    random history, with the clock passing requests' three-quarter marks, both equal the
    walk over the requests queued (the rule as written before the sums)."""
    from kvstore.conductor.engines import EngineState, Inflight

    def walk(e: EngineState, now: float) -> tuple[int, float]:
        fs = e.prefilling.values()
        return sum(f.compute_tokens for f in fs), sum(max(0.25 * f.work_s, f.work_s - (now - f.sent_at)) for f in fs)

    rng = np.random.default_rng(5)
    for _ in range(50):
        e, now, rids = EngineState("e", "http://e.invalid"), float(rng.uniform(0, 1e5)), []
        for i in range(int(rng.integers(1, 300))):
            now += float(rng.exponential(0.05))
            op = rng.random()
            if op < 0.5 or not rids:
                rid = f"r{i}" if rng.random() < 0.9 or not rids else rids[int(rng.integers(len(rids)))]  # sent again
                e.sent(rid, Inflight(int(rng.integers(0, 9000)), now, float(rng.exponential(0.5))))
                rids.append(rid)
            else:
                rid = rids.pop(int(rng.integers(len(rids))))
                if op < 0.8:
                    e.first_token(rid, Stream(16, [], now))
                else:
                    e.end(rid)
            tokens, work = walk(e, now)
            assert e.queued_tokens(now, 100.0) == tokens
            assert e.queued_s(now, 1.0) == pytest.approx(work, abs=1e-6)
        for rid in [*e.prefilling, *e.decoding]:
            e.end(rid)
        assert (e.queued_tokens(now, 1.0), e.queued_s(now, 1.0), e.decoding) == (0, 0.0, {})

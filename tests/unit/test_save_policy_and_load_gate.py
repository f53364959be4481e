"""The connector's save policy (what is stored) and load gate (what is loaded): pure rules,
no engine.  The serving benchmark measures what they buy; these pin what they decide."""

from __future__ import annotations

import types

import pytest

from gpu_agent.vllm.admission import EVERYTHING, EXPLORE, NOTHING, Evidence, SavePlan, Sightings, hinted, plan, retained
from gpu_agent.vllm.gate import LoadCost, LoadGate, Rate
from gpu_agent.vllm.patience import HitOdds, request_class


def _plan(policy: str, counts: list[int], tail: int | None = None, **kw: bool) -> SavePlan:
    return plan(
        policy,
        counts=counts,
        tail_count=tail,
        hint=kw.get("hint", False),
        producer_only=kw.get("producer_only", False),
        save_decode=kw.get("save_decode", True),
    )


def test_second_sighting_stores_the_leading_run_of_chunks_looked_up_before() -> None:
    assert _plan("second-sighting", [1, 1, 1]) == SavePlan(0, False, False)  # a one-off prompt: nothing
    assert _plan("second-sighting", [3, 2, 1, 2]) == SavePlan(2, False, False)  # the run ends at the new chunk
    assert _plan("second-sighting", [2, 2], tail=2) == SavePlan(2, True, False)  # an exact repeat: its tail too
    assert _plan("second-sighting", [2, 2], tail=1) == SavePlan(2, False, False)
    assert not _plan("second-sighting", [2, 2]).decode  # nobody has looked decode chunks up


def test_hinted_stores_everything_of_a_hinted_request_and_nothing_else() -> None:
    assert _plan("hinted", [1, 1], hint=True) == SavePlan(EVERYTHING, False, True)
    assert _plan("hinted", [5, 5], tail=5) == NOTHING
    assert _plan("hinted", [1], hint=True, save_decode=False).decode is False


def test_auto_is_hinted_for_hinted_requests_and_second_sighting_for_the_rest() -> None:
    assert _plan("auto", [1, 1], hint=True) == _plan("hinted", [1, 1], hint=True)
    assert _plan("auto", [2, 1]) == _plan("second-sighting", [2, 1])


def test_always_and_producers_store_every_chunk_whatever_was_seen() -> None:
    for p in ("always",):
        assert _plan(p, [1, 1], tail=1) == SavePlan(EVERYTHING, True, True)
    for p in ("auto", "second-sighting", "hinted"):  # a prefill engine's consumer reads them next
        assert _plan(p, [1, 1], tail=1, producer_only=True) == SavePlan(EVERYTHING, True, True)
    assert not SavePlan().limited and NOTHING.limited


def test_sightings_count_each_lookup_of_a_key() -> None:
    s = Sightings(width=1 << 10)
    a, b = b"a" * 16, b"b" * 16
    assert s.sight([a, b]) == [1, 1]
    assert s.sight([a]) == [2]
    assert s.sight([a, b]) == [3, 2]


@pytest.mark.parametrize(
    ("params", "want"),
    [
        ({"session_id": "conv-1"}, True),
        ({"retain": True}, True),
        ({"session_id": ""}, False),
        ({"retain": "yes"}, False),  # only a JSON true is a hint
        (None, False),
        ("not a dict", False),
    ],
)
def test_a_hint_is_a_session_or_retain(params: object, want: bool) -> None:
    assert hinted(types.SimpleNamespace(kv_transfer_params=params)) is want


def test_the_gate_loads_until_it_has_measured_then_only_what_beats_recompute() -> None:
    g = LoadGate(min_samples=2, explore=0)
    assert g.leading(["local", "remote"]) == 2  # nothing measured: load and learn
    for _ in range(2):  # recompute: 1 ms a token; local loads 10 µs a token; remote pulls 5 ms a token
        g.observe({"prefill_step_us": 512_000, "prefill_step_tokens": 512})
        g.observe(
            {"load_local_us": 2_560, "load_local_tokens": 256, "load_remote_us": 1_280_000, "load_remote_tokens": 256}
        )
    assert g.pays("local") and not g.pays("remote") and g.pays("nvme")  # nvme: not measured yet
    assert g.leading(["local", "local", "remote", "local"]) == 2  # stops at the first that does not pay
    assert g.leading(["remote"]) == 0
    assert LoadGate(enabled=False).leading(["remote"]) == 1


def test_a_gated_kind_is_tried_again_now_and_then_so_a_recovered_tier_is_found() -> None:
    g = LoadGate(min_samples=1, explore=3)
    g.observe(
        {"prefill_step_us": 1000, "prefill_step_tokens": 1000, "load_remote_us": 10_000, "load_remote_tokens": 100}
    )
    got = [g.leading(["remote"]) for _ in range(6)]
    assert got == [0, 0, 1, 0, 0, 1]
    for _ in range(40):  # the remote node recovered: pulls now cost a tenth of recompute
        g.observe({"load_remote_us": 10, "load_remote_tokens": 100})
    assert g.pays("remote")


def test_a_loads_fixed_cost_is_told_apart_from_its_per_token_cost() -> None:
    c = LoadCost()
    assert c.fit() is None and c.predict(100) is None
    for tokens in (256, 1024, 256, 2048, 512):  # 4 ms a load + 2 µs a token
        c.add(0.004 + 2e-6 * tokens, tokens)
    fixed, per = c.fit() or (0.0, 0.0)
    assert fixed == pytest.approx(0.004) and per == pytest.approx(2e-6)
    c.add(2 * 0.004 + 2e-6 * 768, 768, loads=2)  # one step's two loads, summed
    assert c.predict(256) == pytest.approx(0.004 + 2e-6 * 256)


def test_loads_of_one_size_are_taken_proportional_and_a_negative_part_is_never_fit() -> None:
    same = LoadCost()
    for _ in range(3):
        same.add(0.010, 1000)
    assert same.fit() == (0.0, pytest.approx(1e-5))  # cannot split: proportional, right at 1000 tokens
    flat = LoadCost()  # bigger loads took less time: no per-token part, an average fixed cost
    flat.add(0.010, 100)
    flat.add(0.008, 1000)
    fixed, per = flat.fit() or (-1.0, -1.0)
    assert per == 0.0 and fixed == pytest.approx((0.010 * 0.9 + 0.008) / 1.9)
    for bad in ((-1.0, 10, 1), (1.0, 0, 1), (1.0, 10, 0)):
        flat.add(*bad)
    assert flat.samples == 2


def test_a_small_hit_is_recomputed_when_the_loads_fixed_cost_exceeds_its_recompute() -> None:
    """Recompute: 20 µs a token.  A DRAM load: 10 ms fixed + 1 µs a token, so a hit pays
    from 527 tokens on: two chunks of 256 do not, three do, and a longer hit loads all."""
    g = LoadGate(min_samples=2, explore=0)
    for tokens in (256, 2048, 1024):
        g.observe({"prefill_step_us": 20 * 4096, "prefill_step_tokens": 4096})
        g.observe({"load_local_us": 10_000 + tokens, "load_local_tokens": tokens, "load_local_n": 1})
    assert g.saving("local", 256) == pytest.approx(256 * 20e-6 - 0.010 - 256e-6)
    assert not g.pays("local", 512) and g.pays("local", 768)
    assert g.leading(["local"] * 2, 256) == 0
    assert g.leading(["local"] * 3, 256) == 3
    assert g.leading(["local"] * 8, 256) == 8
    # the whole hit is one load of its slowest kind: a remote chunk at the end is cut when
    # remote loads (measured: 50 µs a token) cost more than they save
    for _ in range(2):
        g.observe({"load_remote_us": 50 * 1024, "load_remote_tokens": 1024, "load_remote_n": 1})
    assert g.leading(["local"] * 4 + ["remote"] * 2, 256) == 4
    assert g.snapshot()["local"] == (pytest.approx(0.010), pytest.approx(1e-6))


def test_a_background_load_is_weighed_against_a_recompute_that_holds_up_the_whole_batch() -> None:
    """Recompute: 20 µs a token; a remote pull: 20 ms fixed + 20 µs a token (never cheaper
    than recompute for its own request).  In the step, a load holds up every request of the
    batch as a recompute does: never worth it, whatever the batch.  In the background it
    holds up its own request only, while a recompute of 1,024 tokens (20 ms) lengthens the
    step all 8 requests of the batch wait for: worth it at a batch of 8, not alone."""
    g = LoadGate(min_samples=2, explore=0)
    for tokens in (256, 2048, 1024):
        g.observe({"prefill_step_us": 20 * 4096, "prefill_step_tokens": 4096})
        g.observe({"load_remote_us": 20_000 + 20 * tokens, "load_remote_tokens": tokens, "load_remote_n": 1})
    hit = ["remote"] * 4
    assert g.leading(hit, 256) == 0 and g.leading(hit, 256, batch=8) == 0  # in the step
    assert g.leading(hit, 256, background=("remote",)) == 0  # alone: 20 ms more for the request
    assert g.leading(hit, 256, batch=8, background=("remote",)) == 4
    assert g.saving("remote", 1024, batch=8, background=True) == pytest.approx(8 * 0.02048 - 0.04048)
    assert g.leading(["local", "remote"], 256, batch=8, background=("remote",)) == 2  # one background load
    assert g.leading(["local", "remote"], 256, batch=8, background=()) == 1  # local unmeasured: loads


def test_rates_are_decayed_ratios_and_ignore_empty_samples() -> None:
    r = Rate(decay=0.5)
    assert r.per_token() is None
    r.add(1.0, 0)  # no tokens: nothing learnt
    r.add(-1.0, 10)
    assert r.samples == 0
    r.add(1.0, 100)
    r.add(3.0, 100)  # recent weighs more: (0.5 + 3) / (50 + 100)
    assert r.per_token() == pytest.approx(3.5 / 150)


def test_a_busy_engines_lookup_budget_is_a_fraction_of_its_step_and_one_pass_shares_it() -> None:
    from gpu_agent.vllm.pacing import WaitBudget

    b = WaitBudget(0.002, 0.5, 0.05)
    t = 100.0
    for _ in range(20):  # a busy engine stepping every 40 ms
        b.step(t, 256)
        t += 0.04
    b.step(t, 256)
    assert b.interval_s == pytest.approx(0.04)
    assert b.allowance(t) == pytest.approx(0.02)  # half a step: hidden under the forward pass
    b.spend(0.015)
    assert b.allowance(t + 0.015) == pytest.approx(0.005)  # the pass's next waits share what is left
    b.spend(0.01)
    assert b.allowance(t + 0.025) == 0.0
    b.step(t + 0.04, 256)
    assert b.allowance(t + 0.04) == pytest.approx(0.02)  # a new pass, a new budget


def test_an_idle_engine_waits_longer_once_per_idle_spell_and_never_below_the_floor() -> None:
    from gpu_agent.vllm.pacing import WaitBudget

    b = WaitBudget(0.002, 0.5, 0.05)
    assert b.allowance(0.0) == pytest.approx(0.05)  # a fresh engine is idle
    b.step(1.0, 0)  # a pass that scheduled nothing
    assert b.allowance(1.0) == pytest.approx(0.05)
    b.spend(0.05)
    assert b.allowance(1.05) == 0.0  # the idle budget is granted once, not to every ask
    b.step(2.0, 64)
    b.step(2.001, 64)  # a 1 ms step: half of it is below the floor
    assert b.allowance(2.001) == pytest.approx(0.002)
    b.spend(0.002)
    assert b.allowance(9.0) == pytest.approx(0.05)  # no pass for seconds: idle again, refilled
    assert WaitBudget(0.002, 0.0, 0.0).allowance(0.0) == pytest.approx(0.002)  # adaptivity off: the floor


def test_a_request_class_is_its_hint_else_whether_its_first_chunk_was_looked_up_before() -> None:
    assert request_class(hint=True, first_chunk_sightings=1) == "hinted"
    assert request_class(hint=False, first_chunk_sightings=1) == "new"
    assert request_class(hint=False, first_chunk_sightings=3) == "seen"
    assert request_class(hint=False, first_chunk_sightings=0) == "seen"  # not sighted: no evidence either way


def test_waiting_pays_while_unmeasured_and_then_when_expected_hits_beat_the_step() -> None:
    odds = HitOdds(min_samples=4)
    assert odds.worth_waiting("new", 1e-3, 0.05)  # no outcomes: wait, and learn
    for _ in range(4):
        odds.observe("new", 0)
    assert odds.expected_tokens("new") == 0.0
    assert not odds.worth_waiting("new", 1e-3, 0.05)  # four misses: a step buys nothing
    assert odds.worth_waiting("new", None, 0.05) and odds.worth_waiting("new", 1e-3, 0.0)  # rates unmeasured
    assert odds.worth_waiting("hinted", 1e-3, 0.05)  # classes are apart
    odds.observe("new", 512)  # one hit of 512 tokens in five lookups: about 100 tokens per lookup
    assert 90 < (odds.expected_tokens("new") or 0) < 120
    assert odds.worth_waiting("new", 1e-3, 0.05)  # ~0.1 s of recompute against a 50 ms step
    assert not odds.worth_waiting("new", 1e-4, 0.05)  # a fast prefill: the step costs more


def test_old_outcomes_fade_so_a_class_whose_hits_stopped_is_no_longer_waited_for() -> None:
    odds = HitOdds(decay=0.9, min_samples=1)
    for _ in range(10):
        odds.observe("seen", 1000)
    for _ in range(60):
        odds.observe("seen", 0)
    assert (odds.expected_tokens("seen") or 0) < 5
    with pytest.raises(ValueError, match="decay"):
        HitOdds(decay=0.0)
    with pytest.raises(ValueError, match="probe_every"):
        HitOdds(probe_every=0)


def test_a_class_that_finds_less_than_a_lookup_costs_is_asked_only_by_its_probes() -> None:
    """Asking is priced by a lookup's CPU time on the link thread, not its latency (which
    on a loaded machine is mostly waiting for a core, and which nothing waits on unless
    the scheduler waits for the answer)."""
    odds = HitOdds(min_samples=2, probe_every=4)
    assert odds.worth_asking("new", 1e-3)  # nothing measured: ask
    for _ in range(2):
        odds.observe("new", 0)
    assert odds.worth_asking("new", 1e-3)  # no lookup cost measured yet: ask
    odds.observe_latency(0.4)  # slow answers alone are no reason not to ask
    assert odds.worth_asking("new", 1e-3) and odds.lookup_cpu_s == 0
    odds.observe_cost(0.004)
    odds.observe_cost(0.002)
    assert 0.0035 < odds.lookup_cpu_s < 0.004  # a decayed mean, the first sample its start
    asked = [odds.worth_asking("new", 1e-3) for _ in range(12)]
    assert asked == [False, False, False, True] * 3  # one probe in four
    assert odds.worth_asking("seen", 1e-3)  # classes are apart
    odds.observe("new", 512)  # a probe hit: about 170 tokens a lookup, far above 4 ms of recompute
    assert all(odds.worth_asking("new", 1e-3) for _ in range(5))
    for _ in range(40):  # a class finding 30 tokens a lookup: 30 ms of recompute against 4 ms of CPU
        odds.observe("seen", 30)
    odds.observe_latency(0.4)
    assert all(odds.worth_asking("seen", 1e-3) for _ in range(5))  # asked, however slow the answers
    assert not odds.worth_waiting("new", 1e-6, odds.lookup_s)  # a prefill that fast: not worth the lookup


# -- save_policy evidence: admission by what the node reads back ---------------------------------

NS = b"n" * 8


def _rows(stored: int, read: int, bucket: int = 0, ns: bytes = NS) -> list[dict[str, object]]:
    return [{"namespace": ns.hex(), "bucket": bucket, "stored_blocks": stored, "read_back_blocks": read}]


def _evidence_plan(ev: Evidence, chunks: int = 1, **kw: object) -> SavePlan:
    return ev.plan(
        kw.get("ns", NS),  # type: ignore[arg-type]
        chunks=chunks,
        recompute_s=kw.get("recompute_s", 0.01),  # type: ignore[arg-type]
        retain=bool(kw.get("retain", False)),
        producer_only=bool(kw.get("producer_only", False)),
        save_decode=True,
    )


def test_evidence_stores_everything_while_there_is_no_evidence() -> None:
    ev = Evidence()
    assert _evidence_plan(ev, chunks=8) == SavePlan(EVERYTHING, True, True)  # nothing measured at all
    ev.observe({"save_us": 4000, "save_chunks": 1})  # a save costs 4 ms a chunk, recompute 10 ms
    assert _evidence_plan(ev, chunks=8) == SavePlan(EVERYTHING, True, True)  # the prior: 0.75 × 10 ms > 4 ms
    assert _evidence_plan(ev, chunks=8, recompute_s=None) == SavePlan(EVERYTHING, True, True)  # no prefill yet


def test_evidence_converges_to_storing_almost_nothing_when_nothing_is_read_back() -> None:
    ev = Evidence()
    ev.observe({"save_us": 2000, "save_chunks": 1})
    for poll in range(1, 11):  # every poll, 50 more blocks stored in each bucket, none read back
        ev.update([r for b in range(10) for r in _rows(50 * poll, 0, bucket=b)])
    assert ev.share(NS, 0) < 0.05
    plans = [_evidence_plan(ev, chunks=4) for _ in range(320)]
    stored = sum(p.prompt_chunks == EVERYTHING for p in plans)
    assert stored == 320 // EXPLORE  # only the exploring requests
    assert all(p == SavePlan(0, False, False) for p in plans if p.prompt_chunks != EVERYTHING)
    assert _evidence_plan(ev, ns=b"m" * 8, chunks=4).prompt_chunks == EVERYTHING  # another namespace: no evidence


def test_evidence_stores_everything_where_what_is_stored_is_read_back() -> None:
    ev = Evidence()
    ev.observe({"save_us": 2000, "save_chunks": 1})
    for poll in range(1, 11):
        ev.update([r for b in range(10) for r in _rows(50 * poll, 45 * poll, bucket=b)])
    assert ev.share(NS, 3) > 0.85
    assert all(_evidence_plan(ev, chunks=16) == SavePlan(EVERYTHING, True, True) for _ in range(100))


def test_evidence_weighs_read_back_against_the_measured_costs_per_bucket() -> None:
    ev = Evidence(explore=0)
    for poll in range(1, 11):  # the first chunk is read back, later positions are not
        ev.update(_rows(50 * poll, 50 * poll, bucket=0) + [r for b in range(1, 10) for r in _rows(50 * poll, 0, b)])
    ev.observe({"save_us": 1000, "save_chunks": 1})
    assert _evidence_plan(ev, chunks=4) == SavePlan(1, False, False)  # the run ends at position 1
    ev.observe({"save_us": 10**6, "save_chunks": 1})  # saves now cost more than any recompute
    assert _evidence_plan(ev, chunks=4) == SavePlan(0, False, False)
    # a node restarted: its counters start again from 0, and what they count is all new
    before = ev.share(NS, 1)
    ev.update(_rows(5, 5, bucket=1))
    assert ev.share(NS, 1) > before  # five stored, five read back: not a negative rise
    with pytest.raises(ValueError):
        Evidence(decay=1.0)


def test_a_position_with_no_evidence_of_its_own_follows_its_namespace() -> None:
    """Unique prompts: a few dozen blocks at the first positions, none read back, are
    enough to stop storing at every position, the later ones included (each position
    learning on its own stored a few dozen blocks more per position first); a namespace
    with no evidence still stores, and one whose early chunks are read back stores its
    later positions too."""
    ev = Evidence(explore=0)
    ev.observe({"save_us": 2000, "save_chunks": 1})  # recompute 10 ms a chunk, a save 2 ms
    ev.update(_rows(20, 0, bucket=0) + _rows(20, 0, bucket=1))
    assert ev.share(NS, 7) == ev.namespace_share(NS) == pytest.approx(3 / 44)
    assert _evidence_plan(ev, chunks=12) == SavePlan(0, False, False)
    assert _evidence_plan(ev, ns=b"m" * 8, chunks=12) == SavePlan(EVERYTHING, True, True)
    chats = b"c" * 8
    ev.update(_rows(20, 18, bucket=0, ns=chats) + _rows(20, 16, bucket=1, ns=chats))
    assert ev.share(chats, 7) > 0.8 and _evidence_plan(ev, ns=chats, chunks=12) == SavePlan(EVERYTHING, True, True)


def test_under_evidence_a_session_id_is_no_retention_hint_but_retain_is() -> None:
    session = types.SimpleNamespace(kv_transfer_params={"session_id": "chat-1"})
    retain = types.SimpleNamespace(kv_transfer_params={"retain": True})
    assert hinted(session) and not retained(session)  # auto and hinted still take the session
    assert retained(retain) and hinted(retain)
    ev = Evidence(explore=0)
    for poll in range(1, 11):
        ev.update([r for b in range(10) for r in _rows(50 * poll, 0, bucket=b)])
    ev.observe({"save_us": 2000, "save_chunks": 1})
    assert _evidence_plan(ev, chunks=2, retain=retained(session)) == SavePlan(0, False, False)
    assert _evidence_plan(ev, chunks=2, retain=retained(retain)) == SavePlan(EVERYTHING, True, True)
    assert _evidence_plan(ev, chunks=2, producer_only=True) == SavePlan(EVERYTHING, True, True)
    with pytest.raises(ValueError):
        plan("evidence", counts=[1], tail_count=None, hint=False, producer_only=False, save_decode=True)

"""The dashboard's reading of conductors' ``/conductor/state`` and its merge of their engines
by engine id (no network): sums over conductors, restarts and silent conductors never take
counts away, live figures only from conductors that answer."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from kvstore.dashboard.conductors import ConductorScrape, FleetModel, conductor_url, parse_state
from kvstore.dashboard.model import LEFT_KEPT_S


def engine(eid: str, *, alive: bool = True, served: int = 0, **kw: Any) -> dict[str, Any]:
    """One engine as ``EngineState.describe`` writes it."""
    out: dict[str, Any] = {
        "engine_id": eid,
        "url": f"http://{eid}",
        "role": "both",
        "models": ["m"],
        "alive": alive,
        "source": "static",
        "node": "",
        "node_id": "",
        "kv_events": "",
        "prefilling": 0,
        "decoding": 0,
        "scraped": {"waiting": 0, "running": 0},
        "served": served,
        "tokens": {},
        "hit_ratio": None,
        "last_error": "" if alive else "connection refused",
    }
    out.update(kw)
    return out


def state(engines: list[dict[str, Any]], decisions: dict[str, int], **routing: Any) -> dict[str, Any]:
    """A conductor's ``/conductor/state`` (``Conductor.state``)."""
    return {
        "engines": engines,
        "routing": {
            "predicted_ttft_abs_err_median": routing.get("err"),
            "decisions_per_engine": decisions,
            "decision_us": {"p50": routing.get("p50"), "p99": routing.get("p99")},
            "rejected": routing.get("rejected", {}),
            "pool_errors": routing.get("pool_errors", 0),
            "ttft_per_engine": routing.get("ttft", {}),
        },
        "model": {},
        "views": routing.get("views", {}),
        "pd": False,
        "slo": {"ttft_s": 0, "tbt_s": 0},
    }


A, B = "127.0.0.1:8001", "127.0.0.1:8002"
DOWN = ConductorScrape(at=0.0, ok=False, error="unreachable: [Errno 111] Connection refused")


def engines_of(m: FleetModel) -> dict[str, dict[str, Any]]:
    return {e["engine_id"]: e for e in m.view()["engines"]}


def test_parse_reads_what_the_page_uses() -> None:
    s = parse_state(
        state(
            [
                engine(
                    A,
                    served=17,
                    prefilling=1,
                    decoding=2,
                    scraped={"waiting": 3, "running": 4},
                    tokens={"engine": 1200, "pool_dram": 512, "pool_nvme": 0, "pool_remote": 0, "compute": 900},
                    hit_ratio=0.62,
                )
            ],
            {A: 17},
            err=0.21,
            p50=130.0,
            p99=900.0,
            rejected={"ttft": 3},
            views={A: {"connected": True, "events": 15, "resyncs": 0, "staleness_s": 1.0}},
            ttft={A: {"n": 12, "predicted_p50_ms": 80.5, "measured_p50_ms": 95.0, "abs_err_median": 0.18}},
        )
    )
    assert s.ok and list(s.engines) == [A]
    assert s.engines[A].ttft == {"n": 12, "predicted_p50_ms": 80.5, "measured_p50_ms": 95.0, "abs_err_median": 0.18}
    e = s.engines[A]
    assert (e.decisions, e.served, e.prefilling, e.decoding, e.waiting, e.running) == (17, 17, 1, 2, 3, 4)
    assert e.tokens == {"engine": 1200, "pool_dram": 512, "pool_nvme": 0, "pool_remote": 0, "compute": 900}
    assert e.view == {"connected": 1.0, "events": 15, "resyncs": 0, "staleness_s": 1.0}
    assert s.decision_us == (130.0, 900.0) and s.ttft_err_median == 0.21 and s.rejected == {"ttft": 3}


def test_parse_is_lenient_with_fields_and_refuses_what_is_not_a_conductor() -> None:
    s = parse_state({"engines": [{"engine_id": A}, {"no": "id"}, "junk"], "routing": None})
    assert list(s.engines) == [A] and s.engines[A].alive is False and s.engines[A].tokens == {}
    assert s.engines[A].ttft is None
    assert s.decision_us == (None, None) and s.ttft_err_median is None
    for bad in ({"status": "ok"}, [], "x", {"engines": {}}):
        with pytest.raises(ValueError):
            parse_state(bad)


def test_engines_of_several_conductors_merge_by_engine_id() -> None:
    m = FleetModel({"c1": "u1", "c2": "u2"})
    one = state(
        [
            engine(
                A,
                decoding=2,
                prefilling=1,
                scraped={"waiting": 1, "running": 3},
                tokens={"engine": 300, "compute": 100},
            ),
            engine(B, tokens={"compute": 50}),
        ],
        {A: 4, B: 1},
        p50=100.0,
        p99=800.0,
        views={A: {"connected": True, "events": 10, "resyncs": 1, "staleness_s": 0.5}},
    )
    two = state(
        [
            engine(
                A,
                decoding=2,
                prefilling=2,
                scraped={"waiting": 1, "running": 3},
                tokens={"pool_dram": 100, "compute": 300},
            )
        ],
        {A: 6},
        rejected={"ttft": 2},
        views={A: {"connected": True, "events": 5, "resyncs": 0, "staleness_s": 2.5}},
    )
    m.update({"c1": parse_state(one), "c2": parse_state(two)}, now=100.0)
    e = engines_of(m)
    assert set(e) == {A, B}
    a = e[A]
    assert a["status"] == "up" and a["alive"] is True and a["conductors"] == ["c1", "c2"]
    assert a["routed"] == 10  # 4 + 6: decisions summed over conductors
    assert a["tokens"] == {"engine": 300, "pool_dram": 100, "pool_nvme": 0, "pool_remote": 0, "compute": 400}
    assert a["hit_ratio"] == pytest.approx(1 - 400 / 800)
    # the engine's own /metrics counts everyone's requests; the conductors' own add up
    assert (a["running"], a["queued"]) == (4, 3)
    assert a["view"] == {"connected": True, "events": 15, "resyncs": 1, "staleness_s": 2.5}  # the stalest
    assert e[B]["hit_ratio"] == 0.0 and e[B]["view"] is None and e[B]["conductors"] == ["c1"]
    cs = {c["name"]: c for c in m.view()["conductors"]}
    assert cs["c1"]["decision_us"] == {"p50": 100.0, "p99": 800.0} and cs["c1"]["routed"] == 5
    assert cs["c2"]["rejected"] == {"ttft": 2} and (cs["c2"]["engines"], cs["c2"]["alive"]) == (1, 1)


def test_a_silent_conductor_is_shown_down_and_keeps_what_it_counted() -> None:
    m = FleetModel({"c1": "u1", "c2": "u2", "never": "u3"})
    m.update(
        {
            "c1": parse_state(state([engine(A, tokens={"compute": 10})], {A: 1})),
            "c2": parse_state(state([engine(A, tokens={"engine": 30}), engine(B)], {A: 2, B: 5})),
            "never": DOWN,
        },
        now=100.0,
    )
    m.update(
        {"c1": parse_state(state([engine(A, tokens={"compute": 10})], {A: 1})), "c2": DOWN, "never": DOWN}, now=101.0
    )
    v = m.view()
    cs = {c["name"]: c for c in v["conductors"]}
    assert cs["c2"]["status"] == "down" and "refused" in cs["c2"]["error"] and cs["c2"]["last_seen"] == 100.0
    assert cs["never"]["status"] == "down" and cs["never"]["last_seen"] == 0.0 and cs["never"]["decision_us"] is None
    e = engines_of(m)
    assert e[A]["status"] == "up" and e[A]["routed"] == 3 and e[A]["hit_ratio"] == pytest.approx(0.75)
    assert e[B]["status"] == "unknown" and e[B]["alive"] is None and e[B]["running"] is None  # only c2 knew it
    assert e[B]["routed"] == 5


def test_a_restarted_conductor_counts_whole_and_nothing_goes_backwards() -> None:
    m = FleetModel({"c1": "u1"})
    seen = []
    for t, decisions, compute in ((100.0, 10, 100), (101.0, 12, 120), (102.0, 1, 5), (103.0, 3, 15)):
        m.update({"c1": parse_state(state([engine(A, tokens={"compute": compute})], {A: decisions}))}, now=t)
        a = engines_of(m)[A]
        seen.append((a["routed"], a["tokens"]["compute"]))
    assert seen == [(10, 100), (12, 120), (13, 125), (15, 135)]  # as Prometheus' increase()


def test_dead_engines_and_ones_that_left() -> None:
    m = FleetModel({"c1": "u1", "c2": "u2"})
    m.update(
        {
            "c1": parse_state(state([engine(A, alive=False), engine(B)], {A: 2, B: 1})),
            "c2": parse_state(state([engine(A), engine(B, alive=False)], {})),
        },
        now=100.0,
    )
    e = engines_of(m)
    assert e[A]["status"] == "partial" and e[A]["errors"] == ["c1: connection refused"]
    m.update({"c1": parse_state(state([engine(A, alive=False)], {A: 2})), "c2": DOWN}, now=101.0)
    e = engines_of(m)
    assert e[A]["status"] == "down" and e[A]["alive"] is False
    assert e[B]["status"] == "unknown"  # c1 no longer lists it; c2, silent, did
    m.update({"c1": parse_state(state([engine(A)], {A: 2})), "c2": parse_state(state([engine(A)], {}))}, now=102.0)
    assert engines_of(m)[B]["status"] == "left" and engines_of(m)[B]["routed"] == 1
    later = 102.0 + LEFT_KEPT_S + 1
    m.update({"c1": parse_state(state([engine(A)], {A: 2})), "c2": parse_state(state([engine(A)], {}))}, now=later)
    assert set(engines_of(m)) == {A}  # forgotten, its requests still counted by its conductor
    assert {c["name"]: c["routed"] for c in m.view()["conductors"]} == {"c1": 3, "c2": 0}


def test_an_answer_is_not_changed_by_the_model() -> None:
    raw = state([engine(A, tokens={"compute": 10})], {A: 1})
    kept = copy.deepcopy(raw)
    FleetModel().update({"c": parse_state(raw)}, now=1.0)
    assert raw == kept


def test_conductor_url_forms() -> None:
    assert conductor_url("127.0.0.1:8100") == "http://127.0.0.1:8100/conductor/state"
    assert conductor_url("http://h:1/") == "http://h:1/conductor/state"
    assert conductor_url("https://h:1/custom/state") == "https://h:1/custom/state"
    with pytest.raises(ValueError, match="HOST:PORT"):
        conductor_url("nohost")


def test_an_engines_ttft_comes_from_the_conductor_that_saw_most_of_its_first_tokens() -> None:
    """Two conductors route to one engine: medians do not add up, so the engine's predicted and
    measured TTFT are those of the conductor with more samples; an engine no request reached
    its first token on has none."""
    m = FleetModel({"c1": "http://c1", "c2": "http://c2"})
    few = {A: {"n": 3, "predicted_p50_ms": 10.0, "measured_p50_ms": 50.0, "abs_err_median": 0.8}}
    many = {A: {"n": 40, "predicted_p50_ms": 90.0, "measured_p50_ms": 100.0, "abs_err_median": 0.1}}
    m.update(
        {
            "c1": parse_state(state([engine(A), engine(B)], {A: 3}, ttft=few)),
            "c2": parse_state(state([engine(A)], {A: 40}, ttft=many)),
        },
        now=10.0,
    )
    es = engines_of(m)
    assert es[A]["ttft"] == many[A] and es[B]["ttft"] is None

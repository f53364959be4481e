"""Session hints in traces and the replay: the format, bad lines, the generator's closes, the
hinted replay next to today's figures, and the two-tier replay with its cost model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstore.cli import main as cli_main
from kvstore.errors import InvalidArgument
from kvstore.traces.costmodel import CostModel, from_args
from kvstore.traces.format import Close, Trace
from kvstore.traces.generate import GenParams, generate, generate_events
from kvstore.traces.simulator import simulate

REQ = '{{"timestamp": {t}, "input_length": 1024, "hash_ids": [{a}, {b}]{extra}}}'


def line(t: int, a: int, b: int, session: object = None) -> str:
    return REQ.format(t=t, a=a, b=b, extra=f', "session_id": {json.dumps(session)}' if session is not None else "")


def test_sessions_and_closes_round_trip(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text(
        "\n".join([line(0, 1, 2, "s1"), line(5, 3, 4), '{"timestamp": 7, "close_session": "s1"}', line(9, 1, 2, "s2")])
        + "\n"
    )
    t = Trace.load(p)
    assert [r.session_id for r in t.requests] == ["s1", None, "s2"]
    assert t.closes == (Close(7.0, "s1", 2),) and t.has_sessions
    t.write(tmp_path / "again.jsonl")
    assert (tmp_path / "again.jsonl").read_text().splitlines()[2] == '{"timestamp": 7, "close_session": "s1"}'
    assert not t.without_sessions().has_sessions
    assert t.summary()["sessions"] == 2 and t.summary()["session_closes"] == 1


@pytest.mark.parametrize(
    "bad, why",
    [
        ('{"timestamp": 1, "close_session": "nobody"}', "line 2: close_session 'nobody' names no open session"),
        (line(1, 5, 6, 42), "line 2: 'session_id' must be a non-empty string, got 42"),
        ('{"timestamp": 1, "close_session": ["s1"]}', "line 2: 'close_session' must be a non-empty string"),
    ],
)
def test_bad_session_lines_are_fatal_or_skipped_with_their_line(tmp_path: Path, bad: str, why: str) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text(line(0, 1, 2, "s1") + "\n" + bad + "\n" + line(2, 1, 2, "s1") + "\n")
    with pytest.raises(InvalidArgument, match=why.replace("[", r"\[")):
        Trace.load(p)
    t = Trace.load(p, bad_lines="skip")
    assert len(t.requests) == 2 and len(t.skipped) == 1 and why.split(": ", 1)[1][:20] in t.skipped[0]


def test_generator_closes_after_the_last_turn_and_keeps_the_requests() -> None:
    p = GenParams(requests=400, seed=3, close_after_s=30)
    reqs, closes = generate_events(p)
    assert [r.session_id for r in generate(p)] == [None] * 400  # the plain generator: no hints
    plain = [(r.timestamp, r.hash_ids) for r in generate(p)]
    assert [(r.timestamp, r.hash_ids) for r in reqs] == plain  # hints draw from their own generator
    last = {}
    for r in reqs:
        last[r.session_id] = r.timestamp
    assert closes and all(c.timestamp == pytest.approx(last[c.session_id] + 30_000) for c in closes)
    assert all(reqs[c.before - 1].timestamp <= c.timestamp for c in closes if c.before)
    few = generate_events(GenParams(requests=400, seed=3, close_share=0.5))[1]
    assert 0 < len(few) < len(generate_events(GenParams(requests=400, seed=3))[1])


def test_without_session_ids_the_hinted_replay_is_the_plain_one() -> None:
    t = Trace(generate(GenParams(requests=300, seed=5)))
    assert (
        simulate(t, 200, "prefix-reuse", sessions=True).per_request_hits
        == simulate(t, 200, "prefix-reuse").per_request_hits
    )


def test_closes_help_when_they_come_early_enough() -> None:
    reqs, closes = generate_events(GenParams(requests=1500, seed=7, close_after_s=0))
    t = Trace(reqs, closes=closes)
    cap = round(0.05 * t.unique_blocks)
    assert simulate(t, cap, "lru", sessions=True).hit_ratio > simulate(t, cap, "lru").hit_ratio + 0.03


def test_replay_cli_reports_hinted_and_two_tier_figures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "g.jsonl"
    assert (
        cli_main(["replay", "--generate", str(out), "--requests", "400", "--seed", "4", "--close-after", "5", "--json"])
        == 0
    )
    capsys.readouterr()
    assert cli_main(["replay", str(out), "--capacity", "5%", "--json"]) == 0
    o = json.loads(capsys.readouterr().out)
    assert set(o["hinted"]) == {"session_ttl_s", "prefix-reuse+sessions", "lru+sessions"}
    assert o["hit_ratio"] != o["hinted"]["prefix-reuse+sessions"]["hit_ratio"]
    assert (
        cli_main(
            [
                "replay",
                str(out),
                "--capacity",
                "5%",
                "--nvme-capacity",
                "50%",
                "--bytes-per-token",
                "1000",
                "--recompute-tps",
                "5000",
                "--dram-gbps",
                "10",
                "--nvme-gbps",
                "2",
                "--no-sessions",
                "--json",
            ]
        )
        == 0
    )
    o = json.loads(capsys.readouterr().out)
    assert "hinted" not in o and o["nvme_capacity_blocks"] == round(0.5 * o["unique_blocks"])
    assert o["tier_hits"]["dram"] + o["tier_hits"]["nvme"] == pytest.approx(o["hit_ratio"])
    assert o["tier_hits"]["nvme"] > 0 and o["hit_ratio"] <= o["unlimited_hit_ratio"]
    assert o["prefill_saved_s_per_request"] > 0 and o["cost_model"]["nvme_gbps"] == 2


def test_cost_model_reads_the_engine_bench(tmp_path: Path) -> None:
    bench = tmp_path / "engine.json"
    bench.write_text('progress line\n{"bench": "engine", "dram_get_gbps": 8.0, "nvme_read_gbps": 1.5}\n')
    m = from_args(1000.0, 100, None, None, str(bench))
    assert m == CostModel(1000.0, 100, 8.0, 1.5)
    # 512 tokens recomputed take 0.512 s; loading one 51,200-byte block from NVMe 34 µs
    assert m.saved_s(512, 0, 1, 512) == pytest.approx(0.512 - 51200 / 1.5e9)
    assert from_args(None, 100, 1.0, 1.0, None) is None  # an input missing: no figure


def test_the_default_takes_a_bigger_reuse_bonus_once_hints_name_dead_blocks() -> None:
    from kvstore.keys import NO_PARENT
    from kvstore.node.sessions import SessionHinted, Sessions
    from tiers.policy import PrefixFrequencyPolicy, PrefixReusePolicy

    inner = PrefixReusePolicy()
    hinted = SessionHinted(inner, Sessions(clock=lambda: 0.0))
    plain = (inner.REUSE_CAP, inner.SHARE, inner.PRESSURE)
    hinted.died([])  # a close that killed nothing tells nothing
    assert (inner.REUSE_CAP, inner.SHARE, inner.PRESSURE) == plain
    hinted.insert(b"k" * 16, NO_PARENT, 1)
    hinted.died([b"k" * 16])
    assert (inner.REUSE_CAP, inner.SHARE, inner.PRESSURE) == PrefixReusePolicy.HINTED
    assert (PrefixFrequencyPolicy.REUSE_CAP, PrefixFrequencyPolicy.SHARE, PrefixFrequencyPolicy.PRESSURE) == (
        PrefixReusePolicy.HINTED
    )
    assert (PrefixReusePolicy.REUSE_CAP, PrefixReusePolicy.PRESSURE) == plain[::2]  # the class keeps its own

    class Unmoved(PrefixReusePolicy):
        HINTED = None

    other = Unmoved()
    SessionHinted(other, Sessions()).died([b"x" * 16])
    assert (other.REUSE_CAP, other.SHARE, other.PRESSURE) == plain


def test_hints_close_more_of_the_gap_with_the_default_than_with_lru() -> None:
    reqs, closes = generate_events(GenParams(requests=1500, seed=101, close_after_s=60))
    t = Trace(reqs, closes=closes)
    for f in (0.05, 0.2):
        cap = round(f * t.unique_blocks)
        assert (
            simulate(t, cap, "prefix-reuse", sessions=True).hit_ratio
            > simulate(t, cap, "lru", sessions=True).hit_ratio
            >= simulate(t.without_sessions(), cap, "lru").hit_ratio
        )

"""The trace generator: deterministic per seed, valid Mooncake format, reuse under control."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.errors import InvalidArgument
from kvstore.traces.format import Trace
from kvstore.traces.generate import GenParams, generate


def test_same_seed_same_trace_other_seed_other_trace() -> None:
    p = GenParams(requests=300, seed=4)
    assert generate(p) == generate(p)
    assert generate(p) != generate(GenParams(requests=300, seed=5))


def test_valid_format_round_trip(tmp_path: Path) -> None:
    reqs = generate(GenParams(requests=400, seed=1, block_tokens=256))
    assert len(reqs) == 400 and reqs[0].timestamp == 0
    assert all(a.timestamp <= b.timestamp for a, b in zip(reqs, reqs[1:]))
    path = tmp_path / "g.jsonl"
    Trace(reqs, block_tokens=256).write(path)
    t = Trace.load(path, block_tokens=256)  # every line passes the parser's checks
    assert t.requests == tuple(reqs)
    assert all(r.input_length <= GenParams().max_tokens for r in reqs)


def test_partial_last_blocks_are_never_shared() -> None:
    reqs = generate(GenParams(requests=500, seed=2))
    tails = [r.hash_ids[-1] for r in reqs if r.input_length % 512]
    assert len(tails) == len(set(tails))
    inner = {h for r in reqs for h in r.hash_ids[:-1]}
    assert not inner & set(tails)


def test_multi_turn_extends_the_previous_prompt() -> None:
    reqs = generate(GenParams(requests=300, seed=3, one_shot=0, branch=0, reuse=0))
    full = {r.hash_ids[: r.input_length // 512] for r in reqs}
    extended = sum(1 for r in reqs if any(r.hash_ids[:k] in full for k in range(1, len(r.hash_ids))))
    assert extended > len(reqs) / 2


def test_reuse_is_controllable() -> None:
    def unlimited(**kw) -> float:
        return Trace(generate(GenParams(requests=600, seed=9, **kw))).summary()["unlimited_hit_ratio"]

    none = unlimited(reuse=0.0, turns=1, one_shot=0.5)
    shared = unlimited(reuse=1.0, turns=1, one_shot=0.0, system_prompts=3)
    chatty = unlimited(reuse=1.0, turns=8, one_shot=0.0, system_prompts=3)
    assert none < 0.01 < shared < chatty


@pytest.mark.parametrize(
    "kw, flag",
    [
        ({"requests": 0}, "--requests"),
        ({"reuse": 1.5}, "--reuse"),
        ({"turns": 0.5}, "--turns"),
        ({"think_s": 0}, "--think-time"),
        ({"rate": -1}, "--rate"),
        ({"branch": 1.0}, "--branch"),
        ({"system_prompts": -1}, "--system-prompts"),
        ({"user_tokens": 0}, "--user-tokens"),
    ],
)
def test_bad_parameters_name_the_flag(kw: dict, flag: str) -> None:
    with pytest.raises(InvalidArgument, match=flag):
        generate(GenParams(**kw))

"""Mooncake-format traces: parsing, keys, figures, and clear errors that name the line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstore.errors import InvalidArgument
from kvstore.keys import NO_PARENT
from kvstore.traces.format import Request, Trace, parse_request


def line(ts=0, n=1024, out=5, ids=(1, 2), **extra) -> str:
    obj = {"timestamp": ts, "input_length": n, "output_length": out, "hash_ids": list(ids), **extra}
    return json.dumps(obj)


def write(tmp_path: Path, *lines: str) -> Path:
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_parse_a_line() -> None:
    r = parse_request(line(ts=12.5, n=1000, ids=(7, 8)), "x")
    assert r == Request(12.5, 1000, 5, (7, 8))
    assert parse_request('{"timestamp": 0, "input_length": 0, "hash_ids": []}', "x").output_length == 0


@pytest.mark.parametrize(
    "text, message",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        (json.dumps({"input_length": 512, "hash_ids": [1]}), "missing field 'timestamp'"),
        (json.dumps({"timestamp": 0, "hash_ids": [1]}), "missing field 'input_length'"),
        (json.dumps({"timestamp": 0, "input_length": 512}), "missing field 'hash_ids'"),
        (line(ts=-1), "'timestamp' must be a non-negative number"),
        (line(ts="soon"), "'timestamp' must be a non-negative number"),
        ('{"timestamp": NaN, "input_length": 512, "hash_ids": [1]}', "'timestamp'"),
        (line(n=-5), "'input_length' must be a non-negative integer"),
        (line(n=1.5), "'input_length' must be a non-negative integer"),
        (line(out=True), "'output_length' must be a non-negative integer"),
        (json.dumps({"timestamp": 0, "input_length": 512, "hash_ids": "1"}), "'hash_ids' must be a list"),
        (line(ids=(1, -2)), r"hash_ids\[1\] must be a non-negative integer"),
        (line(ids=(1, "a")), r"hash_ids\[1\]"),
        (line(ids=(1, 2**64)), r"hash_ids\[1\]"),
        (line(n=5000, ids=(1, 2)), "makes 10 blocks of 512 tokens but the line has 2 hash_ids"),
    ],
)
def test_malformed_lines_name_the_line(tmp_path: Path, text: str, message: str) -> None:
    p = write(tmp_path, line(), "", text)
    with pytest.raises(InvalidArgument, match=message) as ei:
        Trace.load(p)
    assert f"{p} line 3:" in str(ei.value)


def test_wrong_block_tokens_is_hinted(tmp_path: Path) -> None:
    p = write(tmp_path, line(n=1024, ids=(1, 2)))
    with pytest.raises(InvalidArgument, match="--block-tokens 256"):
        Trace.load(p, block_tokens=256)
    assert Trace.load(p, block_tokens=512).total_blocks == 2


def test_file_problems(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="cannot read trace"):
        Trace.load(tmp_path / "missing.jsonl")
    with pytest.raises(InvalidArgument, match="holds no requests"):
        Trace.load(write(tmp_path, "", "   "))
    binary = tmp_path / "b.jsonl"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(InvalidArgument, match="not a UTF-8 text file"):
        Trace.load(binary)
    with pytest.raises(InvalidArgument, match="--block-tokens must be positive"):
        Trace.load(write(tmp_path, line()), block_tokens=0)
    with pytest.raises(InvalidArgument, match="--requests must be positive"):
        Trace.load(write(tmp_path, line()), limit=0)


def test_limit_blank_lines_and_round_trip(tmp_path: Path) -> None:
    p = write(tmp_path, line(ts=0, ids=(1, 2)), "", line(ts=5, n=700, ids=(1, 3)), line(ts=9, ids=(4, 5)))
    t = Trace.load(p)
    assert len(t) == 3 and t.total_blocks == 6 and t.total_tokens == 1024 + 700 + 1024
    assert len(Trace.load(p, limit=2)) == 2
    out = tmp_path / "copy.jsonl"
    t.write(out)
    assert Trace.load(out).requests == t.requests


def test_keys_chain_like_chunk_keys() -> None:
    t = Trace.from_hash_ids([[1, 2, 3], [1, 2, 4], [2, 1], [1, 2, 3]])
    k = t.keys
    assert all(len(x) == 16 for ks in k for x in ks)
    assert k[0][:2] == k[1][:2] and k[0][2] != k[1][2]  # shared prefix, then a branch
    assert k[2][0] != k[0][1]  # id 2 at another position (after other ids) is another block
    assert k[3] == k[0]
    assert t.parents(0) == [NO_PARENT, k[0][0], k[0][1]]
    assert t.block_ids == ((0, 1, 2), (0, 1, 3), (4, 5), (0, 1, 2))
    assert t.unique_blocks == 6
    assert Trace.from_hash_ids([[1]], salt="a").keys != Trace.from_hash_ids([[1]], salt="b").keys
    assert Trace.from_hash_ids([[1]]).keys == Trace.from_hash_ids([[1]]).keys  # pure: same in every process


def test_summary_and_tokens() -> None:
    t = Trace([Request(0, 1000, 0, (1, 2)), Request(2000, 1200, 0, (1, 2, 3)), Request(4000, 10, 0, (9,))])
    assert t.block_token_counts(t.requests[0]) == [512, 488]
    assert t.hit_tokens(t.requests[0], 2) == 1000 and t.hit_tokens(t.requests[1], 1) == 512
    s = t.summary()
    assert s["requests"] == 3 and s["blocks"] == 6 and s["unique_blocks"] == 4
    assert s["unlimited_hit_ratio"] == pytest.approx(2 / 6) and s["duration_s"] == 4.0

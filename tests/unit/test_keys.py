"""Namespaces and chunk keys: golden vectors, pinned across processes and releases.

The hex literals below were computed once and are the on-the-wire / on-disk truth:
if one of these tests fails, previously stored KV becomes unreachable.  Never
"update the golden values" to make a change pass; add a new hash scheme instead.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
import xxhash

from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.keys import (
    HASH_SCHEME_V1,
    KEY_BYTES,
    NO_PARENT,
    KVLayout,
    Namespace,
    check_key,
    check_keys,
    chunk_keys,
    parent_keys,
)

BASE = Namespace(
    model_id="meta-llama/Llama-3.1-8B-Instruct",
    kv_dtype="bfloat16",
    layout=KVLayout(num_layers=32, num_kv_heads=8, head_dim=128),
)
NAMESPACES = {
    "default": Namespace(model_id="m"),
    "base": BASE,
    "salt": dataclasses.replace(BASE, tenant_salt="tenant-a"),
    "lora": dataclasses.replace(BASE, lora_id="sql-adapter"),
    "tp1": dataclasses.replace(BASE, tp_rank=1, tp_size=2),
}

GOLDEN_FINGERPRINTS = {
    "default": "c734e7b94e1a83e1",
    "base": "b6ae2b76e85db2dc",
    "salt": "47411287d9dfe759",
    "lora": "c675a5303b127cf4",
    "tp1": "3278b37b032a6878",
}

TOKENS = list(range(1000))  # chunk_tokens=256 -> 3 full chunks, 232 tokens left over
GOLDEN_KEYS = {
    "base": [
        "9181e212f766b2d862d93f8709ab0681",
        "206a90d691de2d68fcaafa8eb1396dd0",
        "82e30e020c63766a30074c43c3fe82e1",
    ],
    "salt": [
        "804a92e52a69fbc5d2a7557ee1adee0d",
        "62dc54bf61cea16b074b80cdf3b4556a",
        "11175d20390620ad71b4888bd1986a83",
    ],
    "lora": [
        "ce8bdfdc7f9325e8a8636c46f3d78244",
        "24885bbd11c0bd3c0f0b1ce2d6e8f0e3",
        "83b4cd3bbd64b3745bb95207f7f1b0a3",
    ],
}


def _hex(keys: list[bytes]) -> list[str]:
    return [k.hex() for k in keys]


# -- golden vectors ------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(GOLDEN_FINGERPRINTS))
def test_fingerprint_golden(name: str) -> None:
    fp = NAMESPACES[name].fingerprint
    assert len(fp) == 8
    assert fp.hex() == GOLDEN_FINGERPRINTS[name]


@pytest.mark.parametrize("name", sorted(GOLDEN_KEYS))
def test_chunk_keys_golden(name: str) -> None:
    keys = chunk_keys(TOKENS, NAMESPACES[name])
    assert len(keys) == 3
    assert all(isinstance(k, bytes) and len(k) == KEY_BYTES for k in keys)
    assert _hex(keys) == GOLDEN_KEYS[name]


def test_golden_keys_follow_the_documented_chain() -> None:
    """Recompute from the spec alone: key_i = xxh3_128(key_{i-1} || tokens_i as u32 LE), key_-1 = fingerprint."""
    ns = NAMESPACES["base"]
    assert ns.fingerprint == xxhash.xxh3_64_digest(ns.canonical())
    prev = ns.fingerprint
    expect = []
    for i in range(len(TOKENS) // 256):
        prev = xxhash.xxh3_128_digest(prev + struct.pack("<256I", *TOKENS[i * 256 : (i + 1) * 256]))
        expect.append(prev.hex())
    assert expect == GOLDEN_KEYS["base"]


def test_every_namespace_field_changes_the_keys() -> None:
    fingerprints = {name: ns.fingerprint for name, ns in NAMESPACES.items()}
    assert len(set(fingerprints.values())) == len(fingerprints)
    variants = [
        dataclasses.replace(BASE, model_revision="r2"),
        dataclasses.replace(BASE, kv_dtype="float16"),
        dataclasses.replace(BASE, layout=KVLayout(32, 8, 128, kv_split=False)),
        dataclasses.replace(BASE, pp_rank=1, pp_size=2),
        dataclasses.replace(BASE, chunk_tokens=128),
        dataclasses.replace(BASE, model_id="other"),
    ]
    all_first_keys = {chunk_keys(TOKENS, ns)[0] for ns in [*NAMESPACES.values(), *variants]}
    assert len(all_first_keys) == len(NAMESPACES) + len(variants)


_CHILD = """
import json, sys
from kvstore.keys import Namespace, chunk_keys
spec = json.load(sys.stdin)
out = {"hash_of_str": hash("kvstore"), "fingerprints": {}, "keys": {}}
for name, d in spec["namespaces"].items():
    ns = Namespace.from_dict(d)
    out["fingerprints"][name] = ns.fingerprint.hex()
    out["keys"][name] = [k.hex() for k in chunk_keys(spec["tokens"], ns)]
print(json.dumps(out))
"""


def _child_keys(hashseed: str) -> dict:
    spec = {"namespaces": {n: ns.to_dict() for n, ns in NAMESPACES.items()}, "tokens": TOKENS}
    env = {**os.environ, "PYTHONHASHSEED": hashseed}
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD],
        input=json.dumps(spec),
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=True,
    )
    return json.loads(proc.stdout)


def test_golden_vectors_hold_in_other_processes_with_other_hash_seeds() -> None:
    results = [_child_keys(seed) for seed in ("1", "4242")]
    # the two children really hashed str differently, so a hash()-based key would have differed
    assert results[0]["hash_of_str"] != results[1]["hash_of_str"]
    for out in results:
        assert out["fingerprints"] == GOLDEN_FINGERPRINTS
        for name, expect in GOLDEN_KEYS.items():
            assert out["keys"][name] == expect


# -- chunking ------------------------------------------------------------------------


def test_partial_trailing_chunk_gets_no_key() -> None:
    ns = NAMESPACES["base"]
    assert chunk_keys(TOKENS[:255], ns) == []
    assert chunk_keys([], ns) == []
    assert _hex(chunk_keys(TOKENS[:256], ns)) == GOLDEN_KEYS["base"][:1]
    assert _hex(chunk_keys(TOKENS[:767], ns)) == GOLDEN_KEYS["base"][:2]
    assert _hex(chunk_keys(TOKENS[:768], ns)) == GOLDEN_KEYS["base"]


def test_keys_of_a_prefix_are_a_prefix_of_the_keys() -> None:
    ns = dataclasses.replace(BASE, chunk_tokens=16)
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, 2**32, size=16 * 20 + 5, dtype=np.uint64)
    full = chunk_keys(tokens, ns)
    assert len(full) == 20
    for n in (0, 1, 15, 16, 17, 100, 160, 319, 320):
        assert chunk_keys(tokens[:n], ns) == full[: n // 16]


def test_a_changed_token_changes_its_chunk_and_every_later_key() -> None:
    ns = dataclasses.replace(BASE, chunk_tokens=16)
    tokens = list(range(64))
    before = chunk_keys(tokens, ns)
    tokens[20] += 1  # inside chunk 1
    after = chunk_keys(tokens, ns)
    assert after[0] == before[0]
    assert all(a != b for a, b in zip(after[1:], before[1:]))


@pytest.mark.parametrize(
    "convert",
    [
        lambda t: np.asarray(t, dtype=np.int64),
        lambda t: np.asarray(t, dtype=np.uint32),
        lambda t: np.asarray(t, dtype=np.uint64),
        lambda t: np.asarray(t, dtype=np.int32),
        lambda t: np.asarray(t, dtype=">u4"),  # big-endian input still hashes as little-endian
        lambda t: np.repeat(np.asarray(t, dtype=np.int64), 2)[::2],  # non-contiguous view
        tuple,
    ],
    ids=["int64", "uint32", "uint64", "int32", "u4-big-endian", "strided", "tuple"],
)
def test_array_inputs_agree_with_lists(convert) -> None:
    ns = NAMESPACES["base"]
    assert _hex(chunk_keys(convert(TOKENS), ns)) == GOLDEN_KEYS["base"]


def test_large_token_ids_in_int64_arrays() -> None:
    ns = dataclasses.replace(BASE, chunk_tokens=4)
    tokens = [0, 2**31, 2**32 - 1, 123_456_789]
    from_list = chunk_keys(tokens, ns)
    assert chunk_keys(np.asarray(tokens, dtype=np.int64), ns) == from_list
    assert chunk_keys(np.asarray(tokens, dtype=np.uint32), ns) == from_list


@pytest.mark.parametrize(
    "tokens",
    [
        [1, -1, 2],
        [2**32],
        np.asarray([0, 2**32], dtype=np.int64),
        np.asarray([-5], dtype=np.int64),
        [2**64],  # numpy makes an object array
        [1.0, 2.0],
        np.asarray([1.5]),
        [True, False],
        [[1, 2], [3, 4]],
        np.zeros((2, 256), dtype=np.int64),
        "abc",
        7,
    ],
    ids=[
        "negative",
        "2**32",
        "int64-2**32",
        "int64-negative",
        "2**64",
        "floats",
        "float-array",
        "bools",
        "nested-list",
        "2-D",
        "str",
        "scalar",
    ],
)
def test_bad_tokens_raise_invalid_argument(tokens) -> None:
    with pytest.raises(InvalidArgument):
        chunk_keys(tokens, NAMESPACES["base"])


def test_parent_keys() -> None:
    keys = chunk_keys(TOKENS, NAMESPACES["base"])
    assert parent_keys(keys) == [NO_PARENT, keys[0], keys[1]]
    assert parent_keys([]) == []
    assert NO_PARENT == bytes(16)


# -- key checking --------------------------------------------------------------------


def test_check_key_accepts_16_bytes_like() -> None:
    raw = bytes(range(16))
    for k in (raw, bytearray(raw), memoryview(raw)):
        out = check_key(k)
        assert type(out) is bytes and out == raw
    assert check_keys([raw, bytearray(raw)]) == [raw, raw]


@pytest.mark.parametrize("bad", [bytes(15), bytes(17), b"", bytearray(15), "0" * 16, 16, None, list(range(16))])
def test_check_key_rejects(bad) -> None:
    with pytest.raises(InvalidArgument) as ei:
        check_key(bad)
    assert "16 bytes" in str(ei.value)
    assert isinstance(ei.value, KVStoreError) and isinstance(ei.value, ValueError)


def test_check_keys_rejects_any_bad_key() -> None:
    with pytest.raises(InvalidArgument):
        check_keys([bytes(16), bytes(17)])


# -- namespace validation and serialisation ---------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"model_id": ""},
        {"model_id": "m", "chunk_tokens": 0},
        {"model_id": "m", "chunk_tokens": -256},
        {"model_id": "m", "tp_rank": 1, "tp_size": 1},
        {"model_id": "m", "tp_rank": -1},
        {"model_id": "m", "pp_rank": 2, "pp_size": 2},
        {"model_id": "m", "tp_size": 0},
        {"model_id": "m", "hash_scheme": "xxh3-64/u32le/v0"},
    ],
    ids=[
        "empty-model",
        "chunk-0",
        "chunk-negative",
        "tp-rank-eq-size",
        "tp-rank-negative",
        "pp-rank-eq-size",
        "tp-size-0",
        "unknown-scheme",
    ],
)
def test_namespace_validation(kwargs) -> None:
    with pytest.raises(InvalidArgument):
        Namespace(**kwargs)


def test_namespace_is_a_frozen_hashable_value() -> None:
    ns = NAMESPACES["base"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        ns.model_id = "x"  # type: ignore[misc]
    assert ns == dataclasses.replace(ns)
    assert hash(ns) == hash(dataclasses.replace(ns))
    assert ns.hash_scheme == HASH_SCHEME_V1


@pytest.mark.parametrize("name", sorted(NAMESPACES))
def test_namespace_dict_round_trip(name: str) -> None:
    ns = NAMESPACES[name]
    d = ns.to_dict()
    assert isinstance(d["layout"], dict)
    back = Namespace.from_dict(json.loads(json.dumps(d)))  # as it would come back from etcd
    assert back == ns
    assert back.fingerprint == ns.fingerprint


def test_namespace_from_dict_keeps_a_layout_object() -> None:
    """Regression: from_dict silently dropped a KVLayout instance (not a dict) and used the default layout."""
    ns = NAMESPACES["base"]
    d = {**ns.to_dict(), "layout": ns.layout}
    back = Namespace.from_dict(d)
    assert back.layout == KVLayout(32, 8, 128)
    assert back.fingerprint == ns.fingerprint


def test_namespace_from_dict_defaults_and_validation() -> None:
    assert Namespace.from_dict({"model_id": "m"}).fingerprint.hex() == GOLDEN_FINGERPRINTS["default"]
    with pytest.raises(InvalidArgument):
        Namespace.from_dict({"model_id": "m", "chunk_tokens": 0})


def test_namespace_from_dict_rejects_unknown_fields() -> None:
    with pytest.raises(InvalidArgument, match="colour"):
        Namespace.from_dict({"model_id": "m", "colour": "red"})
    with pytest.raises(InvalidArgument, match="num_experts"):
        Namespace.from_dict({"model_id": "m", "layout": {"num_layers": 2, "num_experts": 8}})


def test_layout_bytes_per_token() -> None:
    assert KVLayout(32, 8, 128).bytes_per_token(2) == 32 * 2 * 8 * 128 * 2
    assert KVLayout(61, 1, 576, kv_split=False).bytes_per_token(1) == 61 * 576


def test_a_tail_key_names_the_exact_tokens_of_a_trailing_partial_chunk() -> None:
    from kvstore.keys import tail_key

    ns = Namespace("m", chunk_tokens=4)
    toks = [1, 2, 3, 4, 5, 6]
    t = tail_key(toks, ns)
    assert t is not None and len(t) == 16
    assert tail_key(toks, ns, chunk_keys(toks, ns)) == t
    assert tail_key([1, 2, 3, 4], ns) is None  # ends on a chunk boundary: no tail
    assert tail_key([1, 2, 3, 4, 5, 7], ns) != t and tail_key([1, 2, 3, 4, 5], ns) != t
    assert tail_key([9, 2, 3, 4, 5, 6], ns) != t  # the chain before it is hashed in
    assert tail_key(toks, Namespace("other", chunk_tokens=4)) != t
    assert t not in chunk_keys([1, 2, 3, 4, 5, 6, 0, 0], ns)  # never a full chunk's key
    assert tail_key([5, 6], ns) != chunk_keys([5, 6, 0, 0], ns)[0]
    with pytest.raises(InvalidArgument):
        tail_key(toks, ns, [])

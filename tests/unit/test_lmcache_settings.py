"""The LMCache L2 adapter's settings and chunk keys (pure: no LMCache needed)."""

from __future__ import annotations

import dataclasses

import pytest

from gpu_agent.lmcache.settings import (
    ChunkIdentity,
    L2Settings,
    chunk_key,
    chunk_namespace,
    layout_string,
)
from gpu_agent.sglang.settings import PAGE_MARK
from kvstore.errors import InvalidArgument

LAYOUT = layout_string(["torch.float16"], [(2, 28, 256, 1024)])
IDENT = ChunkIdentity("Qwen/Qwen3-8B", (2 << 24) | (1 << 16) | (2 << 8) | 1, 0, "", LAYOUT)
HASH = bytes(range(16))


def test_settings_defaults_and_values() -> None:
    s = L2Settings.from_params({"target": "unix:///run/kv.sock"})
    assert (s.target, s.token_file, s.deadline_s, s.salt, s.lock_ttl_s, s.workers) == (
        "unix:///run/kv.sock",
        None,
        5.0,
        "",
        30.0,
        2,
    )
    s = L2Settings.from_params({"target": "h:1", "deadline_s": 1, "lock_ttl_s": 0, "workers": 4, "salt": "t"})
    assert (s.deadline_s, s.lock_ttl_s, s.workers, s.salt) == (1.0, 0.0, 4, "t")


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({}, "'target'"),
        ({"target": ""}, "'target'"),
        ({"target": 5}, "'target'"),
        ({"target": "h:1", "targt": "x"}, r"unknown kvstore L2 adapter_params key\(s\) \['targt'\]"),
        ({"target": "h:1", "deadline_s": 0}, "deadline_s"),
        ({"target": "h:1", "deadline_s": True}, "deadline_s"),
        ({"target": "h:1", "deadline_s": float("nan")}, "deadline_s"),
        ({"target": "h:1", "lock_ttl_s": -1}, "lock_ttl_s"),
        ({"target": "h:1", "workers": 0}, "workers"),
        ({"target": "h:1", "workers": 2.0}, "workers"),
        ({"target": "h:1", "salt": 3}, "salt"),
    ],
)
def test_bad_params_are_refused_by_name(params: dict[str, object], match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        L2Settings.from_params(params)


def test_layout_string_names_each_tensor() -> None:
    assert LAYOUT == "float16[2,28,256,1024]"
    assert layout_string(["bfloat16", "uint8"], [(4, 8), (3,)]) == "bfloat16[4,8];uint8[3]"
    with pytest.raises(InvalidArgument):
        layout_string(["float16"], [])


def test_the_namespace_decodes_lmcaches_kv_rank() -> None:
    ns = chunk_namespace(IDENT)
    assert (ns.model_id, ns.tp_rank, ns.tp_size, ns.kv_dtype) == ("Qwen/Qwen3-8B", 1, 2, "float16")
    plain = chunk_namespace(dataclasses.replace(IDENT, kv_rank=0))  # no world packed in: rank 0 of 1
    assert (plain.tp_rank, plain.tp_size) == (0, 1)


@pytest.mark.parametrize(
    "change",
    [
        {"model": "Qwen/Qwen3-4B"},
        {"kv_rank": 0},
        {"group": 1},
        {"cache_salt": "user-7"},
        {"layout": layout_string(["bfloat16"], [(2, 28, 256, 1024)])},
        {"layout": layout_string(["float16"], [(2, 28, 128, 1024)])},
    ],
)
def test_every_part_of_a_chunks_identity_changes_its_key(change: dict[str, object]) -> None:
    base = chunk_key(chunk_namespace(IDENT).fingerprint, HASH)
    other = chunk_key(chunk_namespace(dataclasses.replace(IDENT, **change)).fingerprint, HASH)  # type: ignore[arg-type]
    assert other != base


def test_salts_change_the_key_and_do_not_collide() -> None:
    base = chunk_key(chunk_namespace(IDENT).fingerprint, HASH)
    deployment = chunk_key(chunk_namespace(IDENT, salt="x").fingerprint, HASH)
    user = chunk_key(chunk_namespace(dataclasses.replace(IDENT, cache_salt="x")).fingerprint, HASH)
    assert len({base, deployment, user}) == 3


def test_chunk_keys_are_not_another_integrations_keys() -> None:
    fp = chunk_namespace(IDENT).fingerprint
    assert chunk_key(fp, HASH) == chunk_key(fp, HASH)
    assert len(chunk_key(fp, HASH)) == 16
    import xxhash

    assert chunk_key(fp, HASH) != xxhash.xxh3_128_digest(fp + PAGE_MARK + HASH)


@pytest.mark.parametrize("bad", [b"", "abc", None])
def test_a_chunk_hash_that_is_not_bytes_is_refused(bad: object) -> None:
    with pytest.raises(InvalidArgument):
        chunk_key(b"12345678", bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "ident",
    [
        {"model": ""},
        {"kv_rank": -1},
        {"group": -1},
        {"layout": ""},
    ],
)
def test_a_malformed_identity_is_refused(ident: dict[str, object]) -> None:
    with pytest.raises(InvalidArgument):
        dataclasses.replace(IDENT, **ident)  # type: ignore[arg-type]

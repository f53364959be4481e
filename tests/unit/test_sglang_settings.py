"""The SGLang HiCache backend's settings and page keys (pure: no SGLang needed)."""

from __future__ import annotations

import dataclasses

import pytest

from gpu_agent.sglang.settings import HiCacheSettings, PageGeometry, page_key, page_namespace
from kvstore.errors import InvalidArgument
from kvstore.keys import chunk_keys

SGLANG_KEYS = {"backend_name": "kvstore", "module_path": "gpu_agent.sglang", "class_name": "X", "interface_v1": 1}
G = PageGeometry(
    kv_dtype="bfloat16", layer_num=28, head_num=8, head_dim=128, page_size=64, layout="page_first", is_mla=False,
    page_bytes=2 * 28 * 64 * 8 * 128 * 2,
)  # fmt: skip


def ns(**kw: object) -> object:
    args: dict[str, object] = {"model": "Qwen/Qwen3-8B", "geometry": G, "tp_rank": 0, "tp_size": 2, **kw}
    return page_namespace(**args)  # type: ignore[arg-type]


def test_settings_read_kvstore_keys_and_leave_sglangs_alone() -> None:
    s = HiCacheSettings.from_extra_config(
        {**SGLANG_KEYS, "kvstore_target": "unix:///run/kv.sock", "kvstore_deadline_s": 1.5, "kvstore_salt": "t1"}
    )
    assert (s.target, s.deadline_s, s.salt, s.token_file, s.model) == ("unix:///run/kv.sock", 1.5, "t1", None, "")


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({}, "kvstore_target"),
        ({"kvstore_target": ""}, "kvstore_target"),
        ({"kvstore_target": "h:1", "kvstore_taget": "x"}, r"unknown HiCache extra_config key\(s\) \['kvstore_taget'\]"),
        ({"kvstore_target": "h:1", "kvstore_deadline_s": 0}, "kvstore_deadline_s"),
        ({"kvstore_target": "h:1", "kvstore_deadline_s": True}, "kvstore_deadline_s"),
        ({"kvstore_target": "h:1", "kvstore_deadline_s": "5"}, "kvstore_deadline_s"),
        ({"kvstore_target": "h:1", "kvstore_salt": 7}, "kvstore_salt"),
    ],
)
def test_bad_settings_are_refused_naming_the_key(extra: dict[str, object], match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        HiCacheSettings.from_extra_config({**SGLANG_KEYS, **extra})


def test_none_extra_config_asks_for_the_target() -> None:
    with pytest.raises(InvalidArgument, match="kvstore_target"):
        HiCacheSettings.from_extra_config(None)


def test_every_part_of_the_namespace_changes_the_page_key() -> None:
    """The same SGLang page hash gives another kvstore key for another model, rank, size,
    dtype, layout, page size, salt or context-parallel rank."""
    sha = "ab" * 32
    base = page_key(ns().fingerprint, sha)  # type: ignore[attr-defined]
    variants = [
        ns(model="meta-llama/Llama-3.1-8B"),
        ns(tp_rank=1),
        ns(tp_size=4),
        ns(pp_size=2),
        ns(salt="tenant-b"),
        ns(attn_cp_size=2),
        ns(geometry=dataclasses.replace(G, kv_dtype="float16")),
        ns(geometry=dataclasses.replace(G, layout="layer_first")),
        ns(geometry=dataclasses.replace(G, page_size=32)),
        ns(geometry=dataclasses.replace(G, layer_num=32)),
    ]
    keys = {page_key(v.fingerprint, sha) for v in variants}  # type: ignore[attr-defined]
    assert base not in keys and len(keys) == len(variants)
    assert page_key(ns().fingerprint, sha) == base  # type: ignore[attr-defined]  # a pure function
    assert page_key(ns().fingerprint, "cd" * 32) != base  # type: ignore[attr-defined]


def test_mla_pages_are_one_namespace_for_every_tensor_rank() -> None:
    mla = dataclasses.replace(G, is_mla=True, head_num=1, head_dim=576)
    a, b = ns(geometry=mla, tp_rank=0, tp_size=8), ns(geometry=mla, tp_rank=5, tp_size=8)
    assert a == b and a.tp_size == 1 and not a.layout.kv_split  # type: ignore[attr-defined]


def test_a_page_key_is_never_a_chunk_key_of_the_same_namespace() -> None:
    """The page mark keeps SGLang's pages apart from the SDK's and the vLLM connector's chunks."""
    n = ns()
    tokens = list(range(64))
    sha = bytes(4 * 64).hex()
    assert page_key(n.fingerprint, sha) not in chunk_keys(tokens, n)  # type: ignore[attr-defined, arg-type]


@pytest.mark.parametrize("bad", ["", None, 7, b"ab"])
def test_a_malformed_page_key_is_refused(bad: object) -> None:
    with pytest.raises(InvalidArgument, match="SGLang page key"):
        page_key(b"\0" * 8, bad)  # type: ignore[arg-type]


def test_a_geometry_without_pages_or_model_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="page_size"):
        dataclasses.replace(G, page_size=0)
    with pytest.raises(InvalidArgument, match="model name"):
        ns(model="")

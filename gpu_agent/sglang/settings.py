"""The HiCache backend's settings and the namespace its pages are keyed in.

Pure: no SGLang import, so the rules are unit-tested without SGLang.  SGLang hands a
dynamically loaded backend one flat ``extra_config`` dictionary (the JSON of
``--hicache-storage-backend-extra-config``), holding SGLang's own keys (``backend_name``,
``module_path``, ``class_name``, ``interface_v1``, ...) next to the backend's.  kvstore's keys
all start with ``kvstore_``: an unknown one is an error naming the known ones; the others are
SGLang's and left alone.

Keys.  SGLang names a page by a hex SHA-256 chained over the pages before it (its own
``get_hash_str``), the same on every rank and for every model.  Everything that must match for
a page's bytes to be reusable goes into a :class:`~kvstore.keys.Namespace` (model, KV dtype,
the host pool's layout and dimensions, the page size, tensor / pipeline rank and size, and a
salt), and a page's kvstore key is ``xxh3_128(fingerprint || PAGE_MARK || sha)``: a different
model, rank, layout or salt computes different keys for the same SGLang hash, so it misses;
it never reads another's bytes.  MLA pages are the same on every tensor rank (SGLang writes
them from one rank): their namespace has rank 0 of 1, so every rank reads the one copy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import xxhash

from kvstore.errors import InvalidArgument
from kvstore.keys import ChunkKey, KVLayout, Namespace

PAGE_MARK = b"kvstore/sglang-page/v1\x00"
"""Hashed between a namespace's fingerprint and SGLang's page hash: a page key is never a
key the vLLM connector or the SDK's ``chunk_keys`` computes."""

PREFIX = "kvstore_"
DEFAULT_DEADLINE_S = 5.0


@dataclasses.dataclass(frozen=True, slots=True)
class HiCacheSettings:
    """kvstore's keys in SGLang's ``extra_config`` (each spelled with the ``kvstore_`` prefix)."""

    target: str
    """``kvstore_target`` (required): ``unix:///path/kvstore.sock`` (the node on this machine,
    zero-copy shared memory), ``host:port`` or ``etcd://host:port/cluster`` (every node)."""
    token_file: str | None = None
    """``kvstore_token_file``: the node's bearer token, read from this file (else
    ``KVSTORE_TOKEN`` / ``KVSTORE_TOKEN_FILE``; none: no auth)."""
    deadline_s: float = DEFAULT_DEADLINE_S
    """``kvstore_deadline_s``: most seconds one store call may take; past it the pages it
    asked for are misses (SGLang recomputes them) or unsaved."""
    salt: str = ""
    """``kvstore_salt``: folded into the namespace; deployments that must never share KV
    (tenants, model builds under one name) use different salts."""
    model: str = ""
    """``kvstore_model``: the model name keys are made under (default: SGLang's
    ``model_name``, the served model path); set it where two paths hold one model."""

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> HiCacheSettings:
        """Parse SGLang's ``extra_config``; unknown ``kvstore_*`` keys and bad values raise
        :class:`InvalidArgument` naming the key."""
        extra = dict(extra or {})
        ours = {k[len(PREFIX) :]: v for k, v in extra.items() if isinstance(k, str) and k.startswith(PREFIX)}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(ours) - known)
        if unknown:
            raise InvalidArgument(
                f"unknown HiCache extra_config key(s) {[PREFIX + k for k in unknown]}; "
                f"kvstore's are {sorted(PREFIX + k for k in known)}"
            )
        target = ours.get("target")
        if not isinstance(target, str) or not target:
            raise InvalidArgument(
                "the kvstore HiCache backend needs extra_config 'kvstore_target' "
                "(unix:///path/kvstore.sock, host:port or etcd://host:port/cluster)"
            )
        for name in ("token_file", "salt", "model"):
            if name in ours and ours[name] is not None and not isinstance(ours[name], str):
                raise InvalidArgument(f"extra_config '{PREFIX}{name}' must be a string, got {ours[name]!r}")
        deadline = ours.get("deadline_s", DEFAULT_DEADLINE_S)
        if isinstance(deadline, bool) or not isinstance(deadline, int | float) or not deadline > 0:
            raise InvalidArgument(f"extra_config '{PREFIX}deadline_s' must be a positive number, got {deadline!r}")
        return cls(
            target=target,
            token_file=ours.get("token_file") or None,
            deadline_s=float(deadline),
            salt=ours.get("salt") or "",
            model=ours.get("model") or "",
        )


@dataclasses.dataclass(frozen=True, slots=True)
class PageGeometry:
    """What SGLang's host pool says about one page: enough to key it and to check its size."""

    kv_dtype: str  # "bfloat16", "float16", ... (torch's name without "torch.")
    layer_num: int
    head_num: int
    head_dim: int
    page_size: int  # tokens per page
    layout: str  # the host pool's layout: "layer_first", "page_first", "page_first_direct", "page_head"
    is_mla: bool
    page_bytes: int  # bytes of one flat data page (SGLang's get_dummy_flat_data_page)

    def __post_init__(self) -> None:
        for name in ("layer_num", "head_num", "head_dim", "page_size", "page_bytes"):
            if getattr(self, name) <= 0:
                raise InvalidArgument(f"SGLang host pool: {name} must be positive, got {getattr(self, name)}")
        if not self.layout:
            raise InvalidArgument("SGLang host pool: no layout")


def page_namespace(
    *,
    model: str,
    geometry: PageGeometry,
    tp_rank: int,
    tp_size: int,
    pp_rank: int = 0,
    pp_size: int = 1,
    attn_cp_rank: int = 0,
    attn_cp_size: int = 1,
    salt: str = "",
) -> Namespace:
    """The namespace one rank's pages live in (see the module docstring).  MLA pages are
    shared by every tensor rank (rank 0 of 1); context-parallel ranks hold disjoint slices of
    a page, so each keeps its own (their rank is in the page layout's name)."""
    if not model:
        raise InvalidArgument("the kvstore HiCache backend needs a model name (SGLang's model_name or kvstore_model)")
    g = geometry
    page_layout = f"sglang:{g.layout}"
    if attn_cp_size > 1:
        page_layout += f":cp{attn_cp_rank}of{attn_cp_size}"
    return Namespace(
        model_id=model,
        kv_dtype=g.kv_dtype,
        layout=KVLayout(
            num_layers=g.layer_num,
            num_kv_heads=g.head_num,
            head_dim=g.head_dim,
            kv_split=not g.is_mla,
            page_layout=page_layout,
        ),
        tp_rank=0 if g.is_mla else tp_rank,
        tp_size=1 if g.is_mla else tp_size,
        pp_rank=pp_rank,
        pp_size=pp_size,
        chunk_tokens=g.page_size,
        tenant_salt=salt,
    )


def page_key(fingerprint: bytes, sglang_key: str) -> ChunkKey:
    """The kvstore key of the page SGLang calls ``sglang_key`` in the namespace whose
    fingerprint is given; a key that is not a non-empty string is refused."""
    if not isinstance(sglang_key, str) or not sglang_key:
        raise InvalidArgument(f"an SGLang page key is a non-empty string, got {sglang_key!r}")
    return ChunkKey(xxhash.xxh3_128_digest(fingerprint + PAGE_MARK + sglang_key.encode()))

"""Namespaces and chunk keys: pure functions of (namespace, tokens).

A :class:`Namespace` is everything that must match for KV to be reusable.  Its
8-byte :attr:`Namespace.fingerprint` seeds the key chain::

    key_{-1} = fingerprint
    key_i    = xxh3_128(key_{i-1} || tokens_i as little-endian uint32)

No process-random seed, no ``hash()``, no pickle: the bytes are pinned by
golden vectors in ``tests/unit/test_keys.py`` and checked across processes.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Iterable, Sequence
from typing import NewType

import numpy as np
import xxhash

from kvstore.errors import InvalidArgument

ChunkKey = NewType("ChunkKey", bytes)
"""16 bytes that name one chunk of one namespace (and, by chaining, its whole prefix)."""

KEY_BYTES = 16
FINGERPRINT_BYTES = 8
NO_PARENT = ChunkKey(bytes(KEY_BYTES))
"""The parent key recorded for a prefix's first chunk."""

HASH_SCHEME_V1 = "xxh3-128/u32le/v1"
_TOKEN_DTYPE = np.dtype("<u4")
_MAX_TOKEN = 2**32 - 1


@dataclasses.dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape of one token's KV across the model: layers × (K,V) × kv heads × head dim."""

    num_layers: int = 1
    num_kv_heads: int = 1
    head_dim: int = 1
    kv_split: bool = True  # separate K and V tensors (False: MLA-style joint latent)
    page_layout: str = ""  # the engine's byte order inside a block where it is not the default (e.g. "vllm-cpu:LBHNC")

    def bytes_per_token(self, itemsize: int) -> int:
        return self.num_layers * (2 if self.kv_split else 1) * self.num_kv_heads * self.head_dim * itemsize


@dataclasses.dataclass(frozen=True, slots=True)
class Namespace:
    """Everything that must match for cached KV to be reused.  Immutable; KV of one
    namespace is never served to another because the fingerprint seeds every key."""

    model_id: str
    model_revision: str = "main"
    lora_id: str = ""
    kv_dtype: str = "float16"
    layout: KVLayout = KVLayout()
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    chunk_tokens: int = 256
    hash_scheme: str = HASH_SCHEME_V1
    tenant_salt: str = ""

    def __post_init__(self) -> None:
        if not self.model_id:
            raise InvalidArgument("Namespace.model_id must be non-empty")
        if self.chunk_tokens <= 0:
            raise InvalidArgument(f"Namespace.chunk_tokens must be positive, got {self.chunk_tokens}")
        if not (0 <= self.tp_rank < self.tp_size) or not (0 <= self.pp_rank < self.pp_size):
            raise InvalidArgument("Namespace parallel rank must lie in [0, size)")
        if self.hash_scheme != HASH_SCHEME_V1:
            raise InvalidArgument(f"unknown hash scheme {self.hash_scheme!r}; this build knows {HASH_SCHEME_V1!r}")

    def canonical(self) -> bytes:
        """The stable byte encoding the fingerprint is taken over (sorted-key JSON)."""
        d = dataclasses.asdict(self)
        if not self.layout.page_layout:  # the default layout keeps the fingerprints it always had
            del d["layout"]["page_layout"]
        return json.dumps(d, sort_keys=True, separators=(",", ":")).encode()

    @property
    def fingerprint(self) -> bytes:
        """8 stable bytes identifying this namespace (xxh3-64 of :meth:`canonical`); computed
        once per distinct namespace (every key derivation starts from it)."""
        return _fingerprint(self)

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> Namespace:
        d = dict(d)
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise InvalidArgument(f"unknown namespace field(s) {unknown}")
        layout = d.pop("layout", None)
        kw: dict[str, object] = dict(d)
        if isinstance(layout, dict):
            bad = sorted(set(layout) - {f.name for f in dataclasses.fields(KVLayout)})
            if bad:
                raise InvalidArgument(f"unknown KV layout field(s) {bad}")
            kw["layout"] = KVLayout(**layout)
        elif layout is not None:  # already a KVLayout: keep it (dropping it would change the fingerprint)
            kw["layout"] = layout
        return cls(**kw)  # type: ignore[arg-type]


def check_key(key: object) -> ChunkKey:
    """Return ``key`` as a :data:`ChunkKey` or raise :class:`InvalidArgument`."""
    if isinstance(key, (bytearray, memoryview)):
        key = bytes(key)
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        got = f"{len(key)} bytes" if isinstance(key, bytes) else type(key).__name__
        raise InvalidArgument(f"a chunk key is {KEY_BYTES} bytes; got {got}")
    return ChunkKey(key)


def check_keys(keys: Iterable[object]) -> list[ChunkKey]:
    return [check_key(k) for k in keys]


def _as_tokens(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise InvalidArgument(f"tokens must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return arr.astype(_TOKEN_DTYPE)
    if arr.dtype.kind not in "iu":
        raise InvalidArgument(f"token ids must be integers, got dtype {arr.dtype}")
    if int(arr.min()) < 0 or int(arr.max()) > _MAX_TOKEN:
        raise InvalidArgument("token ids must lie in [0, 2**32)")
    return arr.astype(_TOKEN_DTYPE, copy=False)


def chunk_keys(tokens: Sequence[int] | np.ndarray, namespace: Namespace) -> list[ChunkKey]:
    """One 16-byte key per *full* chunk of ``tokens``; a trailing partial chunk gets none."""
    return chunk_keys_from(tokens, namespace.fingerprint, namespace.chunk_tokens)


def chunk_keys_from(tokens: Sequence[int] | np.ndarray, fingerprint: bytes, chunk_tokens: int) -> list[ChunkKey]:
    """:func:`chunk_keys` from a namespace's fingerprint and chunk size alone (what an
    engine registers: a router computes the engine's keys without its whole namespace)."""
    if chunk_tokens <= 0:
        raise InvalidArgument(f"chunk_tokens must be positive, got {chunk_tokens}")
    arr = _as_tokens(tokens)
    buf = arr.tobytes()  # one copy; each chunk is then a slice (a router keys 32k-token prompts per request)
    step = 4 * chunk_tokens
    digest = xxhash.xxh3_128_digest
    prev = fingerprint
    keys: list[ChunkKey] = []
    for off in range(0, len(arr) // chunk_tokens * step, step):
        prev = digest(prev + buf[off : off + step])
        keys.append(ChunkKey(prev))
    return keys


TAIL_MARK = b"kvstore/tail-chunk/v1"
"""Hashed between the chain and a trailing partial chunk's tokens: a tail key is never the
key of a full chunk, nor of a tail of another length (the length is hashed too)."""


def tail_key(
    tokens: Sequence[int] | np.ndarray, namespace: Namespace, chain: Sequence[ChunkKey] | None = None
) -> ChunkKey | None:
    """The key of ``tokens``' trailing partial chunk, keyed by its exact tokens
    (``xxh3_128(key_{n-1} || TAIL_MARK || len || tokens)``), or None when ``tokens`` ends on a
    chunk boundary.  ``chain``: ``chunk_keys(tokens, namespace)`` if the caller has it."""
    arr = _as_tokens(tokens)
    n = namespace.chunk_tokens
    full, rest = divmod(len(arr), n)
    if rest == 0:
        return None
    keys = list(chain) if chain is not None else chunk_keys(arr, namespace)
    if len(keys) != full:
        raise InvalidArgument(f"chain has {len(keys)} keys; tokens have {full} full chunks")
    h = xxhash.xxh3_128()
    h.update(keys[-1] if keys else namespace.fingerprint)
    h.update(TAIL_MARK)
    h.update(rest.to_bytes(4, "little"))
    h.update(arr[full * n :].tobytes())
    return ChunkKey(h.digest())


def parent_keys(keys: Sequence[ChunkKey]) -> list[ChunkKey]:
    """The parent of each key in a chain: ``NO_PARENT`` for the first."""
    return [NO_PARENT, *keys[:-1]] if keys else []


@functools.lru_cache(maxsize=4096)
def _fingerprint(ns: Namespace) -> bytes:
    """:attr:`Namespace.fingerprint`, cached by value (namespaces are immutable and hashable)."""
    return xxhash.xxh3_64_digest(ns.canonical())

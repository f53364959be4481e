"""The LMCache L2 adapter's settings and the namespace its chunks are keyed in.

Pure: no LMCache import, so the rules are unit-tested without LMCache.  LMCache's ``plugin``
L2 adapter type hands the adapter class its ``adapter_params`` dictionary (from
``lmcache server --l2-adapter '{"type": "plugin", ..., "adapter_params": {...}}'``); every key
in it is kvstore's, and an unknown one is an error naming the known ones.

Keys.  LMCache names a chunk by an ``ObjectKey``: its chunk hash (chained over the chunks
before it, so it stands for the whole prefix), the model name, a ``kv_rank`` (the TP/PP world
size and the worker's rank, packed into one integer), the object group (attention, or a hybrid
model's other groups) and a per-user ``cache_salt``.  The hash does not cover the KV's dtype or
shape, so the namespace also folds in the chunk's memory layout (each tensor's dtype and
shape, from the object itself when storing or loading and from LMCache's layout description
when looking up).  Everything that must match goes into a :class:`~kvstore.keys.Namespace`,
and a chunk's kvstore key is ``xxh3_128(fingerprint || CHUNK_MARK || chunk_hash)``: another
model, rank, group, layout, cache salt or deployment salt computes other keys for the same
LMCache hash, so it misses; it never reads another's bytes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import xxhash

from kvstore.errors import InvalidArgument
from kvstore.keys import ChunkKey, KVLayout, Namespace

CHUNK_MARK = b"kvstore/lmcache-chunk/v1\x00"
"""Hashed between a namespace's fingerprint and LMCache's chunk hash: a chunk key is never a
key the vLLM connector, the SGLang backend or the SDK's ``chunk_keys`` computes."""

DEFAULT_DEADLINE_S = 5.0
DEFAULT_LOCK_TTL_S = 30.0
DEFAULT_WORKERS = 2


@dataclasses.dataclass(frozen=True, slots=True)
class L2Settings:
    """kvstore's ``adapter_params`` for LMCache's plugin L2 adapter."""

    target: str
    """(required) ``unix:///path/kvstore.sock`` (the node on this machine, zero-copy shared
    memory), ``host:port`` or ``etcd://host:port/cluster`` (every node of a cluster)."""
    token_file: str | None = None
    """The node's bearer token, read from this file (else ``KVSTORE_TOKEN`` /
    ``KVSTORE_TOKEN_FILE``; none: no auth)."""
    deadline_s: float = DEFAULT_DEADLINE_S
    """Most seconds one store call may take; past it the chunks it asked for are misses
    (LMCache recomputes them) or a failed store task."""
    salt: str = ""
    """Folded into every namespace; deployments that must never share KV (tenants, model
    builds served under one name) use different salts."""
    lock_ttl_s: float = DEFAULT_LOCK_TTL_S
    """LMCache's lookup *locks* what it found until it loads it: here a pin on the node for at
    most this long (an unlock ends it sooner), so a server that dies holding locks leaves no
    block pinned for longer.  0: look up without pinning."""
    workers: int = DEFAULT_WORKERS
    """Threads running the adapter's store calls; LMCache's store and prefetch controllers
    submit from two threads and never wait."""

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> L2Settings:
        """Parse LMCache's ``adapter_params``; unknown keys and bad values raise
        :class:`InvalidArgument` naming the key."""
        ours = dict(params or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(ours) - known)
        if unknown:
            raise InvalidArgument(f"unknown kvstore L2 adapter_params key(s) {unknown}; kvstore's are {sorted(known)}")
        target = ours.get("target")
        if not isinstance(target, str) or not target:
            raise InvalidArgument(
                "the kvstore L2 adapter needs adapter_params 'target' "
                "(unix:///path/kvstore.sock, host:port or etcd://host:port/cluster)"
            )
        for name in ("token_file", "salt"):
            if ours.get(name) is not None and not isinstance(ours[name], str):
                raise InvalidArgument(f"adapter_params '{name}' must be a string, got {ours[name]!r}")
        deadline = ours.get("deadline_s", DEFAULT_DEADLINE_S)
        if not _number(deadline) or not deadline > 0:
            raise InvalidArgument(f"adapter_params 'deadline_s' must be a positive number, got {deadline!r}")
        lock_ttl = ours.get("lock_ttl_s", DEFAULT_LOCK_TTL_S)
        if not _number(lock_ttl) or not lock_ttl >= 0:
            raise InvalidArgument(f"adapter_params 'lock_ttl_s' must be a number >= 0, got {lock_ttl!r}")
        workers = ours.get("workers", DEFAULT_WORKERS)
        if isinstance(workers, bool) or not isinstance(workers, int) or not 1 <= workers <= 64:
            raise InvalidArgument(f"adapter_params 'workers' must be an integer in [1, 64], got {workers!r}")
        return cls(
            target=target,
            token_file=ours.get("token_file") or None,
            deadline_s=float(deadline),
            salt=ours.get("salt") or "",
            lock_ttl_s=float(lock_ttl),
            workers=workers,
        )


def _number(v: object) -> bool:
    return not isinstance(v, bool) and isinstance(v, int | float) and v == v  # NaN is no number here


@dataclasses.dataclass(frozen=True, slots=True)
class ChunkIdentity:
    """What an LMCache ``ObjectKey`` says besides its hash, and the chunk's memory layout:
    everything one namespace stands for.  ``layout`` is ``dtype[shape];...`` per tensor."""

    model: str
    kv_rank: int
    group: int
    cache_salt: str
    layout: str

    def __post_init__(self) -> None:
        if not self.model:
            raise InvalidArgument("an LMCache chunk key without a model name")
        if self.kv_rank < 0 or self.group < 0:
            raise InvalidArgument(f"an LMCache chunk key with kv_rank {self.kv_rank}, group {self.group}")
        if not self.layout:
            raise InvalidArgument("an LMCache chunk without a memory layout")


def layout_string(dtypes: Sequence[object], shapes: Sequence[Sequence[int]]) -> str:
    """``dtype[d0,d1,...]`` for each tensor of a chunk, ``;``-joined (``torch.float16`` is
    written ``float16``)."""
    if len(dtypes) != len(shapes) or not dtypes:
        raise InvalidArgument(f"a chunk layout of {len(dtypes)} dtype(s) and {len(shapes)} shape(s)")
    parts = []
    for dtype, shape in zip(dtypes, shapes, strict=True):
        name = str(dtype).removeprefix("torch.")
        parts.append(f"{name}[{','.join(str(int(d)) for d in shape)}]")
    return ";".join(parts)


def chunk_namespace(ident: ChunkIdentity, *, salt: str = "") -> Namespace:
    """The namespace of one (model, kv rank, object group, cache salt, layout) under a
    deployment salt.  LMCache packs the world size and the worker's global rank into
    ``kv_rank`` (``world << 24 | rank << 16 | local_world << 8 | local_rank``): where that
    decodes to a rank inside its world it becomes the namespace's tensor rank, so the
    dashboard names it; the whole ``kv_rank`` is in the layout either way."""
    world, rank = (ident.kv_rank >> 24) & 0xFF, (ident.kv_rank >> 16) & 0xFF
    tp_rank, tp_size = (rank, world) if 0 <= rank < world else (0, 1)
    dtype = ident.layout.split("[", 1)[0]
    return Namespace(
        model_id=ident.model,
        kv_dtype=dtype,
        layout=KVLayout(page_layout=f"lmcache:{ident.layout}:kv_rank={ident.kv_rank}:group={ident.group}"),
        tp_rank=tp_rank,
        tp_size=tp_size,
        tenant_salt=f"{salt}\x00{ident.cache_salt}" if ident.cache_salt else salt,
    )


def chunk_key(fingerprint: bytes, chunk_hash: bytes) -> ChunkKey:
    """The kvstore key of the chunk LMCache hashes to ``chunk_hash`` in the namespace whose
    fingerprint is given; a hash that is not non-empty bytes is refused."""
    if not isinstance(chunk_hash, bytes | bytearray) or not chunk_hash:
        raise InvalidArgument(f"an LMCache chunk hash is non-empty bytes, got {chunk_hash!r}")
    return ChunkKey(xxhash.xxh3_128_digest(fingerprint + CHUNK_MARK + bytes(chunk_hash)))

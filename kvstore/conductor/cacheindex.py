"""Which prefix each engine's own cache holds, from vLLM's KV events.

The events vLLM publishes (:mod:`kvstore.conductor.kvevents`) turned into the answer the
conductor needs per request: for every engine, how many leading prompt tokens its cache
holds now.

:class:`FleetCacheIndex` keys blocks by their content, not by vLLM's hashes (which depend
on the engine's hash function and seed): :func:`prefix_block_keys` chains full blocks of
tokens from a seed of the LoRA name (:mod:`~kvstore.conductor.prefixhash`: a universal
hash of each prefix, vectorised over the prompt's blocks), so a request's chain is
computed once per block size and walked once against every engine.  A ``BlockStored`` is placed by its parent: each
engine's vLLM hash → our key map resolves ``parent_block_hash`` and later removals.

What counts (never credit KV that is not there; every doubt makes the credit smaller):

* only the engine's own cache: ``medium`` ``"GPU"`` (or ``None``, publishers that predate
  the field), and only events that carry ``group_idx`` (vLLM's KV cache manager always
  sets it; the kvstore connector's events, which report the *pool's* chunks through the
  same publisher with medium ``CPU``, ``STORAGE`` or ``GPU`` for the node's HBM tier, leave
  it ``None``).  ``CPU`` is vLLM's own CPU offload tier and is not counted by default:
  loading it is not free, and the kvstore connector reports the pool as ``CPU`` too; a
  fleet running vLLM's own CPU offload may pass ``local_media=("GPU", "CPU")``.  Events of
  a secondary tier (``ownership`` set) or a remote one (``locality`` other than
  ``"LOCAL"``) never count;
* a block whose ``extra_keys`` hold more than its LoRA name (cache salt, multimodal
  inputs, prompt embeddings) is not indexed, nor are the blocks after it in the event
  (their parent is not indexed).  The LoRA *name* seeds the chain: an adapter's blocks
  never match the base model's (vLLM also hashes the adapter's path; re-pointing a name at
  other weights is not seen here);
* a ``BlockStored`` whose parent is not indexed cannot be placed: skipped;
* a ``BlockStored`` of another shape than full blocks (``token_ids`` not ``block_size``
  per hash: vLLM's masked sliding-window or Mamba blocks, partial entries) or of another
  block size than its group's (group 0: ``add_engine``'s; another group: its first
  event's) is skipped;
* each KV cache group (``group_idx``) is followed on its own and an engine is credited
  with the shortest of its groups' prefixes (a hybrid model needs every group's blocks);
* ``AllBlocksCleared``, an event of a type not known here, or a batch that does not decode
  clear the engine.

Threads: :class:`FleetCacheIndex` is safe to call from any thread: one lock guards all its
state (no other lock is taken under it).  Its writer is :class:`~kvstore.conductor.subscriber.KVEventSubscriber`
(one thread per publisher, a batch at a time); the conductor's loop calls
:meth:`FleetCacheIndex.match`.
"""

from __future__ import annotations

import array
import functools
import logging
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from kvstore.conductor.kvevents import MEDIUM_GPU, BlockHash, event_map
from kvstore.conductor.prefixhash import HASH
from kvstore.errors import InvalidArgument

log = logging.getLogger("kvstore.conductor")

KEY_DOMAIN = b"kvstore/conductor/engine-prefix/v1\x00"
"""Hashed before the LoRA name into the chain's seed: these keys are never a pool ChunkKey."""


# -- keys -------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=256)
def _seed(lora: str) -> int:
    return HASH.seed(KEY_DOMAIN + lora.encode())


def _token_array(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """``tokens`` as a little-endian uint32 array; InvalidArgument for anything else."""
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1:
            raise InvalidArgument(f"tokens must be one-dimensional, got shape {tokens.shape}")
        if tokens.size == 0:
            return np.empty(0, dtype="<u4")
        if tokens.dtype.kind not in "iu":
            raise InvalidArgument(f"token ids must be integers, got dtype {tokens.dtype}")
        if tokens.dtype != np.dtype("<u4"):
            if int(tokens.min()) < 0 or int(tokens.max()) > 0xFFFFFFFF:
                raise InvalidArgument("token ids must lie in [0, 2**32)")
            tokens = tokens.astype("<u4")
        return np.ascontiguousarray(tokens)
    try:
        a = array.array("I", tokens)  # a list converts ~3x faster this way than through numpy
    except (OverflowError, TypeError) as e:
        raise InvalidArgument(f"token ids must be integers in [0, 2**32): {e}") from None
    if a.itemsize != 4:  # pragma: no cover - no mainstream platform
        return np.asarray(a, dtype="<u4")
    return np.frombuffer(a, dtype=np.uint32).astype("<u4", copy=False)


_SEGMENT = 128  # keys turned into Python ints at a time by a walk (most walks stop early)


def _lazy_keys(tokens: np.ndarray, block_size: int, seed: int) -> Iterator[int]:
    """:func:`prefix_block_keys` of ``tokens`` (already an array), as a walk takes them:
    hashed at once (vectorised), handed out as ints a segment at a time."""
    packed = HASH.packed(tokens, block_size, seed)
    for i in range(0, len(packed), _SEGMENT):
        yield from packed[i : i + _SEGMENT].tolist()


def prefix_block_keys(tokens: Sequence[int] | np.ndarray, block_size: int, lora: str = "") -> list[int]:
    """One key per full block of ``block_size`` tokens (a trailing partial block gets none),
    naming the block's whole prefix and the LoRA adapter's name: :mod:`prefixhash`'s chain,
    seeded by ``KEY_DOMAIN || lora``.  Keys are this process's own (random parameters)."""
    if block_size <= 0:
        raise InvalidArgument(f"block_size must be positive, got {block_size}")
    return HASH.keys(_token_array(tokens), block_size, _seed(lora))


# -- the index ----------------------------------------------------------------------------------
class _Slot:
    """One KV cache group of one engine: the blocks it holds, one bit of its size's index."""

    __slots__ = ("engine_id", "group", "block_size", "bit", "held", "refs")

    def __init__(self, engine_id: str, group: int, block_size: int, bit: int) -> None:
        self.engine_id, self.group, self.block_size, self.bit = engine_id, group, block_size, bit
        self.held: dict[tuple[str | None, BlockHash], int] = {}  # (medium, vLLM hash) → our key
        self.refs: dict[int, int] = {}  # our key → entries of `held` naming it (indexed iff > 0)


class _Size:
    """Every slot of one block size: key → bitmask of the slots holding it."""

    __slots__ = ("block_size", "index", "mask", "slots")

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.index: dict[int, int] = {}  # our key → bitmask of the slots holding it
        self.mask = 0
        self.slots: dict[int, _Slot] = {}  # bit → slot


class _Engine:
    __slots__ = ("block_size", "slots", "counts")

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.slots: dict[int, _Slot] = {}  # group → slot
        self.counts: dict[str, int] = dict.fromkeys(_COUNTS, 0)


_COUNTS = ("stored", "removed", "cleared", "foreign", "extra_keys", "orphan", "malformed", "unknown")


class FleetCacheIndex:
    """Every followed engine's prefix cache, indexed by content (see the module docstring).

    Thread-safe: every method takes the one internal lock (``match`` holds it for one walk
    of the request's chain, ``apply`` for one batch).  Engines are added before their events
    are applied; events for an engine not added are ignored."""

    def __init__(self, *, local_media: Iterable[str] = (MEDIUM_GPU,)) -> None:
        self._media = frozenset(local_media)
        self._lock = threading.Lock()
        self._engines: dict[str, _Engine] = {}
        self._sizes: dict[int, _Size] = {}

    # -- engines
    def add_engine(self, engine_id: str, block_size: int) -> None:
        """Follow ``engine_id`` (vLLM's ``block_size``); again with another size starts it afresh."""
        if block_size <= 0:
            raise InvalidArgument(f"block_size must be positive, got {block_size}")
        with self._lock:
            eng = self._engines.get(engine_id)
            if eng is not None and eng.block_size == block_size:
                return
            if eng is not None:
                self._drop(engine_id, eng)
            eng = self._engines[engine_id] = _Engine(block_size)
            self._slot(engine_id, eng, 0, block_size)

    def remove_engine(self, engine_id: str) -> None:
        """Forget ``engine_id`` (no-op if unknown)."""
        with self._lock:
            eng = self._engines.get(engine_id)
            if eng is not None:
                self._drop(engine_id, eng)

    def clear(self, engine_id: str) -> None:
        """``engine_id`` holds nothing now (it restarted, or events may have been missed)."""
        with self._lock:
            eng = self._engines.get(engine_id)
            if eng is not None:
                self._clear(eng)

    def engines(self) -> list[str]:
        with self._lock:
            return list(self._engines)

    def held(self, engine_id: str) -> int:
        """Blocks indexed for ``engine_id`` (all its groups)."""
        with self._lock:
            eng = self._engines.get(engine_id)
            return sum(len(s.refs) for s in eng.slots.values()) if eng else 0

    def counts(self, engine_id: str) -> dict[str, int]:
        """Blocks stored and removed, clears, and blocks skipped by reason (see ``_COUNTS``)."""
        with self._lock:
            eng = self._engines.get(engine_id)
            return dict(eng.counts) if eng else {}

    # -- events
    def apply(self, engine_id: str, events: Iterable[Any]) -> None:
        """Apply one batch of decoded events (``decode_batch(payload).events``), in order."""
        with self._lock:
            eng = self._engines.get(engine_id)
            if eng is None:
                return
            for raw in events:
                ev = event_map(raw)
                kind = ev.get("type")
                try:
                    if kind == "BlockStored":
                        self._stored(engine_id, eng, ev)
                    elif kind == "BlockRemoved":
                        self._removed(eng, ev)
                    elif kind == "AllBlocksCleared":
                        self._clear(eng)
                    else:  # may have been a removal by another name: drop what we know
                        eng.counts["unknown"] += 1
                        self._clear(eng)
                        log.warning("engine %s: unknown KV event %r: its cache view is cleared", engine_id, kind)
                except (TypeError, ValueError, AttributeError) as e:  # fields of the wrong type
                    eng.counts["malformed"] += 1
                    self._clear(eng)
                    log.warning("engine %s: malformed %s (%s): its cache view is cleared", engine_id, kind, e)

    def _local(self, ev: dict[str, Any]) -> bool:
        if ev.get("ownership") is not None or ev.get("locality") not in (None, "LOCAL"):
            return False
        medium = ev.get("medium")
        return medium is None or (medium in self._media and ev.get("group_idx") is not None)

    def _stored(self, engine_id: str, eng: _Engine, ev: dict[str, Any]) -> None:
        hashes = ev.get("block_hashes") or []
        if not self._local(ev):
            eng.counts["foreign"] += len(hashes)
            return
        tokens, bs = ev.get("token_ids") or [], ev.get("block_size")
        group = ev.get("group_idx") or 0
        slot = eng.slots.get(group)
        if slot is None and isinstance(bs, int) and bs > 0:
            slot = self._slot(engine_id, eng, group, bs)
        if slot is None or bs != slot.block_size or len(tokens) != len(hashes) * bs:
            eng.counts["malformed"] += len(hashes)
            return
        lora = ev.get("lora_name") or ""
        parent = ev.get("parent_block_hash")
        prev = _seed(lora) if parent is None else self._key_of(slot, parent)
        if prev is None:
            eng.counts["orphan"] += len(hashes)
            return
        try:
            arr = _token_array(tokens)
        except InvalidArgument:
            eng.counts["malformed"] += len(hashes)
            return
        medium = ev.get("medium")
        extra = ev.get("extra_keys")
        plain = len(hashes)
        if extra:
            plain = next((i for i in range(len(hashes)) if not _plain(extra, i, lora)), plain)
        keys = HASH.keys(arr[: plain * bs], bs, prev) if plain else []
        for h, key in zip(hashes, keys):
            self._hold(slot, (medium, h), key)
        eng.counts["stored"] += plain
        if plain < len(hashes):
            eng.counts["extra_keys"] += len(hashes) - plain

    def _removed(self, eng: _Engine, ev: dict[str, Any]) -> None:
        if not self._local(ev):
            return
        slot = eng.slots.get(ev.get("group_idx") or 0)
        if slot is None:
            return
        medium = ev.get("medium")
        for h in ev.get("block_hashes") or []:
            key = slot.held.pop((medium, h), None)
            if key is not None:
                self._unref(slot, key)
                eng.counts["removed"] += 1

    def _key_of(self, slot: _Slot, h: Any) -> int | None:
        for medium in (*self._media, None):
            key = slot.held.get((medium, h))
            if key is not None:
                return key
        return None

    # -- the request's side
    def match(
        self, tokens: Sequence[int] | np.ndarray, lora: str = "", engines: Iterable[str] | None = None
    ) -> dict[str, int]:
        """For every engine (or those of ``engines``; unknown ones get 0): how many leading
        tokens of ``tokens`` its cache holds, whole blocks from token 0 (a multiple of its
        block size).  ``lora``: the adapter's name the request runs with ("" the base model)."""
        arr = _token_array(tokens)
        only = None if engines is None else set(engines)
        seed = _seed(lora)
        # the prompt's keys are hashed as the walk needs them: past the first block no engine
        # holds, no engine holds any later one (a key names its whole prefix), so a prompt
        # costs the hashing of its longest cached prefix, not of all its blocks
        with self._lock:
            want = set(self._engines) if only is None else only
            out = dict.fromkeys(want, 0)
            best: dict[str, int] = {}
            for bs, size in self._sizes.items():
                alive = 0
                for bit, slot in size.slots.items():
                    if slot.engine_id in want:
                        alive |= 1 << bit
                if not alive:
                    continue
                for bit, got in _walk(size.index, _lazy_keys(arr, bs, seed), alive).items():
                    eid = size.slots[bit].engine_id
                    best[eid] = min(best.get(eid, got * bs), got * bs)
            for eid, tok in best.items():
                out[eid] = tok
            return out

    # -- internals (under the lock)
    def _slot(self, engine_id: str, eng: _Engine, group: int, block_size: int) -> _Slot:
        size = self._sizes.get(block_size)
        if size is None:
            size = self._sizes[block_size] = _Size(block_size)
        bit = next(b for b in range(len(size.slots) + 1) if b not in size.slots)
        slot = eng.slots[group] = size.slots[bit] = _Slot(engine_id, group, block_size, bit)
        size.mask |= 1 << bit
        return slot

    def _hold(self, slot: _Slot, where: tuple[str | None, BlockHash], key: int) -> None:
        old = slot.held.get(where)
        if old == key:  # stored again (vLLM reports prefix-cache hits as stores too)
            return
        if old is not None:
            self._unref(slot, old)
        slot.held[where] = key
        n = slot.refs.get(key, 0)
        slot.refs[key] = n + 1
        if n == 0:
            index = self._sizes[slot.block_size].index
            index[key] = index.get(key, 0) | (1 << slot.bit)

    def _unref(self, slot: _Slot, key: int) -> None:
        n = slot.refs[key] - 1
        if n:
            slot.refs[key] = n
            return
        del slot.refs[key]
        index = self._sizes[slot.block_size].index
        m = index[key] & ~(1 << slot.bit)
        if m:
            index[key] = m
        else:
            del index[key]

    def _clear(self, eng: _Engine) -> None:
        eng.counts["cleared"] += 1
        for slot in eng.slots.values():
            index, bit = self._sizes[slot.block_size].index, 1 << slot.bit
            for key in slot.refs:
                m = index[key] & ~bit
                if m:
                    index[key] = m
                else:
                    del index[key]
            slot.held.clear()
            slot.refs.clear()

    def _drop(self, engine_id: str, eng: _Engine) -> None:
        self._clear(eng)
        for slot in eng.slots.values():
            size = self._sizes[slot.block_size]
            del size.slots[slot.bit]
            size.mask &= ~(1 << slot.bit)
            if not size.slots:
                del self._sizes[slot.block_size]
        del self._engines[engine_id]


def _plain(extra: Any, i: int, lora: str) -> bool:
    """Block ``i``'s extra keys hold nothing but the LoRA name (vLLM publishes the name first)."""
    try:
        e = extra[i]
    except (IndexError, TypeError, KeyError):
        return False
    if not e:
        return True
    return bool(lora) and len(e) == 1 and e[0] == lora


def _walk(index: dict[int, int], keys: Iterable[int], alive: int) -> dict[int, int]:
    """Blocks of ``keys`` each slot of ``alive`` holds from the first: bit → blocks."""
    got: dict[int, int] = {}
    i = 0
    for key in keys:
        m = index.get(key, 0)
        dead = alive & ~m
        if dead:
            while dead:
                low = dead & -dead
                got[low.bit_length() - 1] = i
                dead ^= low
            alive &= m
            if not alive:
                return got
        i += 1
    while alive:
        low = alive & -alive
        got[low.bit_length() - 1] = i
        alive ^= low
    return got

"""Which prefix each engine's own cache holds, from vLLM's KV events.

vLLM publishes what its prefix cache stores and evicts (``--kv-events-config
'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
"replay_endpoint": "tcp://*:5558"}'``).  This module turns that stream into the answer the
conductor needs per request: for every engine, how many leading prompt tokens its cache
holds now.  vLLM is not imported: the wire format is decoded generically (msgspec).

The wire (vLLM 0.33, ``vllm/distributed/kv_events.py``): a ZMQ PUB socket sends
``(topic, seq, payload)``: ``seq`` 8 bytes big-endian, one per batch, counting from 0 when
the publisher starts; ``payload`` a msgpack ``[ts, [event, ...], data_parallel_rank]``;
each event a map tagged ``"type"``: ``BlockStored`` (``block_hashes``,
``parent_block_hash``, ``token_ids``, ``block_size``, ``lora_name``, ``medium``,
``extra_keys``, ``group_idx``, ``locality``, ``ownership``, ...), ``BlockRemoved``
(``block_hashes``, ``medium``, ``group_idx``, ...), ``AllBlocksCleared``.  (Publishers that
encode events as arrays, ``["BlockStored", hashes, ...]``, are read by field position.)
The optional ROUTER replay socket answers ``[b"", start_seq]`` with every buffered batch
from ``start_seq`` on, as ``[b"", topic, seq, payload]``, then ``[b"", b"", -1, b""]``.

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
state (no other lock is taken under it).  :class:`KVEventSubscriber` runs one daemon thread
per publisher that owns its ZMQ sockets and writes the index a batch at a time; the
conductor's loop calls :meth:`FleetCacheIndex.match`.
"""

from __future__ import annotations

import array
import functools
import logging
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import msgspec
import numpy as np
import zmq

from kvstore.conductor.prefixhash import HASH
from kvstore.errors import InvalidArgument

log = logging.getLogger("kvstore.conductor")

KEY_DOMAIN = b"kvstore/conductor/engine-prefix/v1\x00"
"""Hashed before the LoRA name into the chain's seed: these keys are never a pool ChunkKey."""

MEDIUM_GPU, MEDIUM_CPU = "GPU", "CPU"

BlockHash = bytes | int
"""vLLM's hash of a block as published: bytes, or an int with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES."""

# field order of array-encoded events (vLLM's struct declaration order), after the tag
_FIELDS = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
        "locality",
        "ownership",
        "session_id",
    ),
    "BlockRemoved": ("block_hashes", "medium", "group_idx", "locality", "ownership"),
    "AllBlocksCleared": (),
}
_END_SEQ = b"\xff" * 8  # the replay's end marker: -1 as 8 signed big-endian bytes


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


# -- the wire -----------------------------------------------------------------------------------
class Batch(NamedTuple):
    ts: float
    events: list[Any]  # as decoded: maps (or arrays) of plain values
    data_parallel_rank: int | None


_decoder = msgspec.msgpack.Decoder()


def decode_batch(payload: bytes) -> Batch:
    """A publisher's payload (``EventBatch``) decoded generically; InvalidArgument if it is not one."""
    try:
        raw = _decoder.decode(payload)
    except msgspec.DecodeError as e:
        raise InvalidArgument(f"KV event batch does not decode: {e}") from None
    if not isinstance(raw, list | tuple) or len(raw) < 2 or not isinstance(raw[1], list):
        raise InvalidArgument(f"KV event batch is not [ts, events, ...]: {type(raw).__name__}")
    rank = raw[2] if len(raw) > 2 and isinstance(raw[2], int) else None
    return Batch(float(raw[0]) if isinstance(raw[0], int | float) else 0.0, raw[1], rank)


def _as_map(ev: Any) -> dict[str, Any]:
    if isinstance(ev, dict):
        return ev
    if isinstance(ev, list | tuple) and ev and isinstance(ev[0], str):
        fields = _FIELDS.get(ev[0], ())
        return {"type": ev[0], **dict(zip(fields, ev[1:]))}
    return {"type": None}


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
                ev = _as_map(raw)
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


# -- the subscriber -----------------------------------------------------------------------------
class KVEventSubscriber:
    """Follows one engine's publisher into ``index`` on a daemon thread of its own.

    ``endpoint``: the PUB socket to connect to (``tcp://host:5557``; vLLM binds
    ``tcp://*:5557``); ``replay``: its replay (ROUTER) endpoint, or None; ``block_size``:
    given, the engine is added to the index here (else it must have been added).

    Sequence numbers must follow one another.  A gap (batches missed), a number that goes
    back (the publisher restarted) or a lost connection clear the engine's view first (a
    missed batch may have removed blocks); then, with ``replay``, the subscriber asks for
    the batches from the first one missed (from 0 after a restart) and applies them onto
    the empty view: blocks stored since come back, older ones are not credited until stored
    again.  With ``history``, the first batch heard on a connection brings the whole replay
    buffer first (a conductor that starts after its engines learns what they held; asked
    only once the subscription is live, so that no batch falls between the replay and the
    stream; an engine that publishes nothing is credited with nothing until it does).  A
    replay that goes silent for ``replay_timeout_s`` is given up.

    Read from any thread: ``connected``, ``last_event_at`` (``time.monotonic()`` of the last
    batch, None before one), ``batches``, ``events``, ``resyncs`` (views dropped for a gap,
    a restart or a lost connection), ``errors`` (batches that did not decode).  ``close()``
    stops the thread (joined within ``timeout``) and removes the engine from the index."""

    def __init__(
        self,
        engine_id: str,
        endpoint: str,
        index: FleetCacheIndex,
        *,
        replay: str | None = None,
        block_size: int | None = None,
        topic: str = "",
        history: bool = True,
        replay_timeout_s: float = 1.0,
        heartbeat_s: float = 2.0,
    ) -> None:
        if block_size is not None:
            index.add_engine(engine_id, block_size)
        elif engine_id not in index.engines():
            raise InvalidArgument(f"engine {engine_id!r} is not in the index: add it first or pass block_size")
        self.engine_id, self.endpoint, self.index = engine_id, endpoint, index
        self.replay, self.history, self.replay_timeout_s = replay or None, history, replay_timeout_s
        self.connected = False
        self.last_event_at: float | None = None
        self.batches = self.events = self.resyncs = self.errors = 0
        self._expected: int | None = None  # the next seq for an unbroken stream (None: none yet)
        self._dup_from: int | None = None  # live batches from here to _expected came by replay already
        self._fresh = True  # no batch heard on this connection yet
        self._stop = threading.Event()
        self._ctx: zmq.Context[Any] = zmq.Context.instance()
        # made here so that a bad endpoint fails the caller; then the thread alone uses them
        self._sub = self._ctx.socket(zmq.SUB)
        try:
            self._sub.setsockopt(zmq.LINGER, 0)
            self._sub.setsockopt(zmq.RCVHWM, 100_000)
            if heartbeat_s > 0:  # a peer gone without a FIN still shows as a disconnect
                self._sub.setsockopt(zmq.HEARTBEAT_IVL, int(heartbeat_s * 1000))
                self._sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(heartbeat_s * 3000))
            self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
            self._mon = self._sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
            self._sub.connect(endpoint)
        except zmq.ZMQError as e:
            self._sub.close(linger=0)
            if block_size is not None:
                index.remove_engine(engine_id)
            raise InvalidArgument(f"KV events endpoint {endpoint!r}: {e}") from None
        self._thread = threading.Thread(target=self._run, name=f"kvevents-{engine_id}", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 1.0) -> None:
        self._stop.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("engine %s: KV events thread did not stop within %.1f s", self.engine_id, timeout)
        self.index.remove_engine(self.engine_id)

    # -- the thread
    def _run(self) -> None:
        from zmq.utils.monitor import recv_monitor_message

        poller = zmq.Poller()
        poller.register(self._sub, zmq.POLLIN)
        poller.register(self._mon, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                try:
                    self._step(poller, recv_monitor_message)
                except Exception:  # the view is dropped, never left half-true
                    log.exception("engine %s: KV events failed: its cache view is cleared", self.engine_id)
                    self._drop("a batch failed")
                    self._stop.wait(0.1)
        finally:
            self.connected = False
            self.index.clear(self.engine_id)
            self._sub.disable_monitor()
            self._mon.close(linger=0)
            self._sub.close(linger=0)

    def _step(self, poller: zmq.Poller, recv_monitor_message: Any) -> None:
        ready = dict(poller.poll(100))
        while self._mon in ready and self._mon.poll(0):
            self._on_monitor(int(recv_monitor_message(self._mon)["event"]))
        for _ in range(1000):  # then look at the monitor again
            if self._stop.is_set() or not self._sub.poll(0):
                return
            self._on_live(self._sub.recv_multipart(zmq.NOBLOCK))

    def _on_monitor(self, event: int) -> None:
        if event == zmq.EVENT_CONNECTED:
            self.connected = True
            self._fresh = True
        elif event == zmq.EVENT_DISCONNECTED:
            self.connected = False
            self._drop("the publisher disconnected")

    def _on_live(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.errors += 1
            self._drop(f"a message of {len(frames)} frames")
            return
        seq = int.from_bytes(frames[1], "big")
        if self._fresh:  # the first batch heard on a connection: the subscription is live now
            self._fresh = False
            if self.history and self.replay:
                self._drop("", count=False)
                self._replay_from(0)
        exp = self._expected
        if exp is not None and seq != exp:
            if seq < exp and self._dup_from is not None and seq >= self._dup_from:
                return  # a replay brought it already
            restart = seq < exp
            self._drop("the publisher restarted" if restart else f"{seq - exp} batches missed")
            if self.replay:
                self._replay_from(0 if restart else exp)
                exp = self._expected
                if exp is not None and seq < exp:
                    return
                if exp is not None and seq > exp:
                    self._drop(f"{seq - exp} batches missed and not replayed")
        self._dup_from = None
        self._take(seq, frames[2])

    def _take(self, seq: int, payload: bytes) -> None:
        self._expected = seq + 1
        try:
            batch = decode_batch(payload)
        except InvalidArgument as e:
            self.errors += 1
            self.index.clear(self.engine_id)
            log.warning("engine %s: %s: its cache view is cleared", self.engine_id, e)
            return
        self.index.apply(self.engine_id, batch.events)
        self.batches += 1
        self.events += len(batch.events)
        self.last_event_at = time.monotonic()

    def _drop(self, why: str, *, count: bool = True) -> None:
        self.index.clear(self.engine_id)
        self._expected = None
        if count:
            self.resyncs += 1
            log.info("engine %s: %s: its cache view is cleared", self.engine_id, why)

    def _replay_from(self, start: int) -> None:
        """Apply the publisher's buffered batches from ``start`` on (onto the view as it is)."""
        assert self.replay is not None
        sock = self._ctx.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 0)  # the ROUTER drops what does not fit: let it all fit
            sock.connect(self.replay)
            sock.send_multipart([b"", start.to_bytes(8, "big")], zmq.NOBLOCK)
            self._dup_from = start
            quiet_until = time.monotonic() + self.replay_timeout_s
            while not self._stop.is_set():
                if not sock.poll(100):
                    if time.monotonic() > quiet_until:
                        log.info("engine %s: no replay from %s: going on without", self.engine_id, self.replay)
                        return
                    continue
                frames = sock.recv_multipart()
                quiet_until = time.monotonic() + self.replay_timeout_s
                if len(frames) != 4 or frames[2] == _END_SEQ:
                    return
                seq = int.from_bytes(frames[2], "big")
                exp = self._expected
                if exp is not None and seq < exp:
                    continue
                if exp is not None and seq > exp:  # the replay lost some itself
                    self._drop(f"the replay skipped {seq - exp} batches")
                self._take(seq, frames[3])
        except zmq.ZMQError as e:
            log.info("engine %s: replay from %s failed (%s): going on without", self.engine_id, self.replay, e)
        finally:
            sock.close(linger=0)

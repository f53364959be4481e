"""The conductor's view of each engine's own prefix cache, from vLLM's KV events.

Events are encoded here with msgspec in vLLM's wire shape (the struct *shapes* of
``vllm/distributed/kv_events.py``, copied: tagged maps inside an array-like batch); vLLM's
own publisher is exercised in ``tests/vllm/test_vllm_kvevents.py``.  Block hashes are
made the way vLLM makes them (a chain over parent and tokens), with another hash function:
the index must key by content whatever hashes the engine uses.

``python tests/unit/test_conductor_kvevents.py`` prints the timings of a 32k-token prompt
against 64 engines.
"""

from __future__ import annotations

import hashlib
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq

from kvstore.conductor.cacheindex import KEY_DOMAIN, FleetCacheIndex, prefix_block_keys
from kvstore.conductor.kvevents import decode_batch
from kvstore.conductor.prefixhash import HASH, LANES, P, PrefixHash
from kvstore.conductor.subscriber import KVEventSubscriber
from kvstore.errors import InvalidArgument


# -- vLLM's wire shapes ---------------------------------------------------------------------------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, tag=True):  # type: ignore[call-arg]
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


def wire(*events: KVCacheEvent) -> list[Any]:
    """Events as the conductor decodes them off the wire."""
    return decode_batch(msgspec.msgpack.encode(EventBatch(ts=time.time(), events=list(events)))).events


def prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, 150_000, n).tolist()


def vllm_hashes(tokens: list[int], bs: int, salt: bytes = b"") -> list[bytes]:
    """A vLLM-like chain of block hashes (sha256 over parent, tokens and extra keys)."""
    out, prev = [], salt
    for i in range(len(tokens) // bs):
        prev = hashlib.sha256(prev + struct.pack(f"<{bs}I", *tokens[i * bs : (i + 1) * bs])).digest()
        out.append(prev)
    return out


def stored(tokens: list[int], bs: int, lo: int, hi: int, *, salt: bytes = b"", **kw: Any) -> BlockStored:
    """vLLM's BlockStored for blocks ``[lo, hi)`` of ``tokens`` (medium GPU, group 0 unless told)."""
    h = vllm_hashes(tokens, bs, salt)
    fields: dict[str, Any] = dict(lora_id=None, medium="GPU", lora_name=None, group_idx=0)
    fields.update(kw)
    return BlockStored(
        block_hashes=h[lo:hi],
        parent_block_hash=h[lo - 1] if lo else None,
        token_ids=tokens[lo * bs : hi * bs],
        block_size=bs,
        **fields,
    )


def removed(tokens: list[int], bs: int, *blocks: int, **kw: Any) -> BlockRemoved:
    h = vllm_hashes(tokens, bs)
    fields: dict[str, Any] = dict(medium="GPU", group_idx=0)
    fields.update(kw)
    return BlockRemoved(block_hashes=[h[b] for b in blocks], **fields)


BS = 16


@pytest.fixture
def index() -> FleetCacheIndex:
    ix = FleetCacheIndex()
    ix.add_engine("a", BS)
    return ix


# -- keys -----------------------------------------------------------------------------------------
def _reference_keys(h: PrefixHash, toks: list[int], bs: int, seed: int) -> list[int]:
    """The documented chain, in plain Python ints: 16-bit halves, a multilinear hash of each
    block, a polynomial over the blocks, two lanes modulo 2**31 - 1."""
    coef = h.coefficients(bs)
    lanes, out = [seed & P, seed >> 31], []
    for i in range(len(toks) // bs):
        x = [v for t in toks[i * bs : (i + 1) * bs] for v in (t & 0xFFFF, t >> 16)]
        for ln in range(LANES):
            hb = (1 + sum(int(coef[k, ln]) * x[k] for k in range(2 * bs))) % P
            lanes[ln] = (int(h.base[ln]) * lanes[ln] + hb) % P
        out.append(lanes[0] | lanes[1] << 31)
    return out


def test_keys_follow_the_documented_chain_for_every_block_size() -> None:
    toks = [int(t) for t in np.random.default_rng(5).integers(0, 2**32, 700, dtype=np.uint64)]
    toks[:4] = [0, 2**32 - 1, 2**31 - 1, 2**16]  # the ends of the halves and the modulus
    for bs in (1, 16, 17, 128):
        assert prefix_block_keys(toks, bs) == _reference_keys(HASH, toks, bs, HASH.seed(KEY_DOMAIN)), bs
    assert prefix_block_keys(toks[:32], 16, "adapter-a") == _reference_keys(
        HASH, toks[:32], 16, HASH.seed(KEY_DOMAIN + b"adapter-a")
    )
    # a chain continues from any of its keys (how a BlockStored is placed under its parent)
    keys = prefix_block_keys(toks, 16)
    assert HASH.keys(np.asarray(toks[160:], dtype="<u4"), 16, keys[9]) == keys[10:]
    # blocks wider than one exact float64 product (32 halves) are summed in parts, exactly
    big = [2**32 - 1] * 1024
    assert HASH.keys(np.asarray(big, dtype="<u4"), 512, 7) == _reference_keys(HASH, big, 512, 7)


def test_keys_are_this_processs_own_and_spread() -> None:
    toks = np.arange(4096, dtype="<u4")
    mine, other = PrefixHash(secret=1), PrefixHash(secret=2)
    assert mine.keys(toks, 16, 0) == PrefixHash(secret=1).keys(toks, 16, 0)  # parameters, not state
    assert not set(mine.keys(toks, 16, 0)) & set(other.keys(toks, 16, 0))
    keys = HASH.keys(toks, 16, HASH.seed(KEY_DOMAIN))
    assert len(set(keys)) == len(keys) and all(0 <= k < 2**62 for k in keys)
    # one token changed anywhere changes every key from its block on
    for pos in (0, 15, 16, 4000):
        t2 = toks.copy()
        t2[pos] ^= 1 << 20
        got = HASH.keys(t2, 16, HASH.seed(KEY_DOMAIN))
        assert got[: pos // 16] == keys[: pos // 16] and all(
            a != b for a, b in zip(got[pos // 16 :], keys[pos // 16 :])
        )


def test_keys_prefix_property_partial_block_and_input_types() -> None:
    toks = prompt(1, 1000)
    keys = prefix_block_keys(toks, BS)
    assert len(keys) == 1000 // BS and all(isinstance(k, int) for k in keys)
    assert prefix_block_keys(toks[:100], BS) == keys[: 100 // BS]  # the partial block gets no key
    assert prefix_block_keys(toks[:15], BS) == []
    assert prefix_block_keys(np.asarray(toks, dtype=np.int64), BS) == keys
    assert prefix_block_keys(np.asarray(toks, dtype=np.uint32), BS) == keys
    assert prefix_block_keys(tuple(toks), BS) == keys
    other = toks[:500] + [7] + toks[501:]
    got = prefix_block_keys(other, BS)
    assert got[: 500 // BS] == keys[: 500 // BS] and all(a != b for a, b in zip(got[500 // BS :], keys[500 // BS :]))


def test_keys_lora_separates_and_bad_input_is_refused() -> None:
    toks = prompt(2, 64)
    base, a, b = (prefix_block_keys(toks, BS, lora) for lora in ("", "adapter-a", "adapter-b"))
    assert not set(base) & set(a) and not set(a) & set(b)
    for bad in ([-1] * 16, [2**32] * 16, [1.5] * 16, np.zeros((2, 16), dtype=np.int64), np.zeros(16)):
        with pytest.raises(InvalidArgument):
            prefix_block_keys(bad, BS)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        prefix_block_keys(toks, 0)


# -- the index ------------------------------------------------------------------------------------
def test_stored_blocks_credit_the_prompt_prefix_in_tokens(index: FleetCacheIndex) -> None:
    toks = prompt(3, 200)  # 12 full blocks
    index.apply("a", wire(stored(toks, BS, 0, 5)))
    assert index.match(toks) == {"a": 5 * BS}
    assert index.match(toks[:70]) == {"a": 4 * BS}  # whole blocks of the request only
    assert index.match(toks[: 5 * BS] + prompt(4, 100)) == {"a": 5 * BS}  # a request that goes on elsewhere
    assert index.match(toks[:40] + [1] + toks[41:]) == {"a": 2 * BS}  # parts in block 2
    assert index.match(prompt(5, 200)) == {"a": 0} and index.match([]) == {"a": 0}
    assert index.held("a") == 5 and index.counts("a")["stored"] == 5


def test_parents_resolve_through_the_engines_hashes_and_removals_cut_the_prefix(index: FleetCacheIndex) -> None:
    toks = prompt(6, 160)
    index.apply("a", wire(stored(toks, BS, 0, 2)))
    index.apply("a", wire(stored(toks, BS, 2, 4), stored(toks, BS, 4, 6)))  # chained by vLLM's hashes
    assert index.match(toks) == {"a": 6 * BS}
    index.apply("a", wire(removed(toks, BS, 1)))
    assert index.match(toks) == {"a": 1 * BS}  # blocks 2..5 are held but not from token 0
    index.apply("a", wire(stored(toks, BS, 1, 2)))
    assert index.match(toks) == {"a": 6 * BS}
    index.apply("a", wire(removed(toks, BS, 5, 4, 3)))
    assert index.match(toks) == {"a": 3 * BS}
    assert index.counts("a")["removed"] == 4


def test_match_equals_a_block_by_block_reference_through_random_stores_and_removals() -> None:
    """Engines store prefixes of a few shared prompts and remove random blocks (holes
    included); after every batch ``match`` equals the first missing block of each engine,
    counted block by block."""
    rng = np.random.default_rng(11)
    docs = [prompt(100 + d, 40 * BS) for d in range(3)]
    ix = FleetCacheIndex()
    have: dict[str, list[set[int]]] = {}
    for e in range(6):
        ix.add_engine(f"e{e}", BS)
        have[f"e{e}"] = [set() for _ in docs]
    for _ in range(300):
        eid, d = f"e{rng.integers(6)}", int(rng.integers(len(docs)))
        held = have[eid][d]
        if rng.random() < 0.6:  # store a run that extends the held leading run
            lo = next(i for i in range(41) if i not in held)
            if lo < 40:
                hi = int(rng.integers(lo + 1, 41))
                ix.apply(eid, wire(stored(docs[d], BS, lo, hi)))
                held.update(range(lo, hi))
        elif held:  # remove a random held block: often a hole, sometimes the tail
            b = int(rng.choice(sorted(held)))
            ix.apply(eid, wire(removed(docs[d], BS, b)))
            held.discard(b)
        for q, doc in enumerate(docs):
            want = {e: next(i for i in range(41) if i not in have[e][q]) * BS for e in have}
            assert ix.match(doc) == want
    for e in have:  # every hole closed again
        for doc in docs:
            ix.apply(e, wire(stored(doc, BS, 0, 40)))
    assert ix.match(docs[0]) == dict.fromkeys(have, 40 * BS)


def test_a_store_whose_parent_is_unknown_is_skipped_with_its_descendants(index: FleetCacheIndex) -> None:
    toks = prompt(7, 160)
    index.apply("a", wire(stored(toks, BS, 2, 4), stored(toks, BS, 4, 6)))
    assert index.match(toks) == {"a": 0} and index.held("a") == 0
    assert index.counts("a")["orphan"] == 4
    index.apply("a", wire(stored(toks, BS, 0, 2)))  # the parents come later: the children are not placed
    assert index.match(toks) == {"a": 2 * BS}


def test_a_block_stored_again_and_removed_once_is_gone(index: FleetCacheIndex) -> None:
    toks = prompt(8, 64)
    # vLLM reports prefix-cache hits as stores too (emit_cached_block_events): one removal ends it
    index.apply("a", wire(stored(toks, BS, 0, 4), stored(toks, BS, 0, 4)))
    index.apply("a", wire(removed(toks, BS, 0)))
    assert index.match(toks) == {"a": 0}


def test_blocks_with_extra_keys_are_not_indexed(index: FleetCacheIndex) -> None:
    toks = prompt(9, 128)
    salted = stored(toks, BS, 0, 4, salt=b"salt", extra_keys=[("tenant-1",), None, None, None])
    index.apply("a", wire(salted))
    assert index.match(toks) == {"a": 0}
    mm = stored(toks, BS, 0, 8, extra_keys=[None, None, ("img-1", 0), None, None, None, None, None])
    index.apply("a", wire(mm))
    assert index.match(toks) == {"a": 2 * BS}  # up to the image; after it nothing is placed
    assert index.counts("a")["extra_keys"] == 4 + 6


def test_lora_blocks_match_only_requests_of_that_adapter(index: FleetCacheIndex) -> None:
    toks = prompt(10, 96)
    ek = [("adapter-a",)] * 6  # vLLM publishes the adapter's name as each block's extra key
    index.apply("a", wire(stored(toks, BS, 0, 6, salt=b"lora", lora_name="adapter-a", lora_id=1, extra_keys=ek)))
    assert index.match(toks) == {"a": 0}
    assert index.match(toks, "adapter-a") == {"a": 6 * BS}
    assert index.match(toks, "adapter-b") == {"a": 0}
    index.apply("a", wire(stored(toks, BS, 0, 3)))
    assert index.match(toks) == {"a": 3 * BS} and index.match(toks, "adapter-a") == {"a": 6 * BS}
    # an adapter's block with more than its name (a salt as well) is not indexed
    more = stored(toks, BS, 0, 2, salt=b"x", lora_name="adapter-c", extra_keys=[("adapter-c", "s"), ("adapter-c",)])
    index.apply("a", wire(more))
    assert index.match(toks, "adapter-c") == {"a": 0}


def test_the_connectors_pool_events_and_other_tiers_do_not_count(index: FleetCacheIndex) -> None:
    toks = prompt(11, 64)

    def pool(medium: str) -> BlockStored:
        # gpu_agent/vllm/events.py stored_event: the pool's chunks, group_idx left None
        return stored(toks, BS, 0, 4, medium=medium, group_idx=None)

    index.apply("a", wire(pool("CPU"), pool("STORAGE"), pool("GPU")))
    index.apply("a", wire(stored(toks, BS, 0, 4, medium="CPU")))  # vLLM's own CPU tier: not by default
    index.apply("a", wire(stored(toks, BS, 0, 4, ownership="kvcr"), stored(toks, BS, 0, 4, locality="REMOTE")))
    assert index.match(toks) == {"a": 0} and index.counts("a")["foreign"] == 6 * 4
    index.apply("a", wire(stored(toks, BS, 0, 2, medium=None, group_idx=None)))  # a publisher before `medium`
    assert index.match(toks) == {"a": 2 * BS}

    cpu = FleetCacheIndex(local_media=("GPU", "CPU"))
    cpu.add_engine("a", BS)
    cpu.apply("a", wire(pool("CPU"), stored(toks, BS, 0, 3, medium="CPU"), stored(toks, BS, 0, 2)))
    assert cpu.match(toks) == {"a": 3 * BS}
    cpu.apply("a", wire(removed(toks, BS, 1)))  # gone from the GPU, still in vLLM's CPU tier
    assert cpu.match(toks) == {"a": 3 * BS}
    cpu.apply("a", wire(removed(toks, BS, 1, medium="CPU")))
    assert cpu.match(toks) == {"a": 1 * BS}


def test_engines_of_several_block_sizes_and_groups() -> None:
    ix = FleetCacheIndex()
    for eid, bs in (("a", 16), ("b", 32), ("c", 16), ("d", 16)):
        ix.add_engine(eid, bs)
    toks = prompt(12, 320)
    ix.apply("a", wire(stored(toks, 16, 0, 10)))
    ix.apply("b", wire(stored(toks, 32, 0, 3)))
    ix.apply("c", wire(stored(toks, 16, 0, 4)))
    # d: a hybrid model; group 1 holds less than group 0, and the shorter one is what counts
    ix.apply("d", wire(stored(toks, 16, 0, 8), stored(toks, 32, 0, 2, group_idx=1)))
    ix.apply("a", wire(stored(toks, 32, 0, 3)))  # not a's block size (group 0): malformed
    assert ix.match(toks) == {"a": 160, "b": 96, "c": 64, "d": 64}
    assert ix.match(toks, engines=["b", "zz"]) == {"b": 96, "zz": 0}
    assert ix.counts("a")["malformed"] == 3
    ix.remove_engine("c")
    ix.remove_engine("c")
    assert ix.match(toks) == {"a": 160, "b": 96, "d": 64}
    ix.add_engine("b", 16)  # another block size: starts afresh
    assert ix.match(toks)["b"] == 0
    ix.apply("d", wire(removed(toks, 32, 0, group_idx=1)))
    assert ix.match(toks)["d"] == 0


def test_clears_all_blocks_cleared_and_unknown_events() -> None:
    ix = FleetCacheIndex()
    ix.add_engine("a", BS)
    ix.add_engine("b", BS)
    toks = prompt(13, 64)
    for eid in ("a", "b"):
        ix.apply(eid, wire(stored(toks, BS, 0, 4)))
    ix.clear("a")
    assert ix.match(toks) == {"a": 0, "b": 64}
    ix.apply("a", wire(stored(toks, BS, 0, 4)))
    ix.apply("a", wire(AllBlocksCleared()))
    assert ix.match(toks) == {"a": 0, "b": 64}
    ix.apply("b", [{"type": "BlocksSomethingNew", "block_hashes": []}])  # may have removed: cleared
    assert ix.match(toks) == {"a": 0, "b": 0} and ix.counts("b")["unknown"] == 1
    ix.apply("zz", wire(stored(toks, BS, 0, 4)))  # an engine not followed: ignored


def test_array_encoded_events_are_read_by_position(index: FleetCacheIndex) -> None:
    toks = prompt(14, 64)
    h = vllm_hashes(toks, BS)
    index.apply("a", [["BlockStored", h[:4], None, toks, BS, None, "GPU", None, None, 0]])
    assert index.match(toks) == {"a": 64}
    index.apply("a", [["BlockRemoved", [h[2]], "GPU", 0]])
    assert index.match(toks) == {"a": 32}


def test_a_malformed_event_clears_the_engine(index: FleetCacheIndex) -> None:
    toks = prompt(15, 64)
    index.apply("a", wire(stored(toks, BS, 0, 4)))
    index.apply("a", [{"type": "BlockRemoved", "block_hashes": 5, "medium": "GPU", "group_idx": 0}])
    assert index.match(toks) == {"a": 0} and index.counts("a")["malformed"] == 1
    index.apply("a", wire(stored(toks, BS, 0, 4)))
    assert index.match(toks, engines=iter(["a"])) == {"a": 64}


def test_undecodable_batches_are_refused() -> None:
    for bad in (b"\xc1", msgspec.msgpack.encode({"ts": 1}), msgspec.msgpack.encode([1.0])):
        with pytest.raises(InvalidArgument):
            decode_batch(bad)


# -- the subscriber -------------------------------------------------------------------------------
def wait_for(pred: Callable[[], Any], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


class FakePublisher:
    """vLLM's PUB/ROUTER protocol, driven by hand: ``send`` publishes with a chosen seq,
    ``buffer`` keeps batches for replay only (as if the live one had been lost)."""

    def __init__(self) -> None:
        ctx = zmq.Context.instance()
        self.pub = ctx.socket(zmq.PUB)
        self.pub.bind("tcp://127.0.0.1:*")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.router = ctx.socket(zmq.ROUTER)
        self.router.bind("tcp://127.0.0.1:*")
        self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.kept: list[tuple[int, bytes]] = []
        self.seq = 0
        self.replays: list[int] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(50):
                continue
            ident, _, start = self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            self.replays.append(first)
            with self._lock:
                kept = list(self.kept)
            for seq, payload in kept:
                if seq >= first:
                    self.router.send_multipart([ident, b"", b"", seq.to_bytes(8, "big"), payload])
            self.router.send_multipart([ident, b"", b"", b"\xff" * 8, b""])

    def send(self, *events: KVCacheEvent, seq: int | None = None, live: bool = True) -> int:
        seq = self.seq if seq is None else seq
        self.seq = seq + 1
        payload = msgspec.msgpack.encode(EventBatch(ts=time.time(), events=list(events)))
        with self._lock:
            self.kept.append((seq, payload))
        if live:
            self.pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
        return seq

    def sync(self, sub: KVEventSubscriber) -> None:
        """Empty batches until the subscriber hears one more (a SUB misses what came before it joined)."""
        deadline = time.monotonic() + 10
        heard = sub.batches
        while sub.batches == heard:
            assert time.monotonic() < deadline, "the subscriber never heard the publisher"
            self.send()
            time.sleep(0.02)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.pub.close(linger=0)
        self.router.close(linger=0)


@pytest.fixture
def fake() -> Any:
    p = FakePublisher()
    yield p
    p.close()


def test_a_gap_clears_the_engine_before_anything_else_is_credited(fake: FakePublisher) -> None:
    ix = FleetCacheIndex()
    sub = KVEventSubscriber("a", fake.endpoint, ix, block_size=BS)
    try:
        fake.sync(sub)
        x, y = prompt(20, 64), prompt(21, 64)
        fake.send(stored(x, BS, 0, 4))
        wait_for(lambda: ix.match(x)["a"] == 64, "x credited")
        fake.seq += 1  # a batch never heard (it might have removed x)
        fake.send(stored(y, BS, 0, 4))
        wait_for(lambda: ix.match(y)["a"] == 64, "y credited")
        assert ix.match(x)["a"] == 0 and sub.resyncs == 1
        fake.send(stored(x, BS, 0, 2), seq=0)  # the publisher restarted: cleared again
        wait_for(lambda: sub.resyncs == 2, "restart seen")
        assert ix.match(y)["a"] == 0 and ix.match(x)["a"] == 32
        assert sub.connected and sub.last_event_at is not None and sub.events == 3
    finally:
        sub.close()
    assert "a" not in ix.engines()


def test_missed_batches_are_replayed_onto_a_cleared_view(fake: FakePublisher) -> None:
    x, y, z = prompt(22, 64), prompt(23, 64), prompt(24, 64)
    fake.send(stored(z, BS, 0, 4), live=False)  # before the subscriber: history, by replay
    ix = FleetCacheIndex()
    sub = KVEventSubscriber("a", fake.endpoint, ix, replay=fake.replay_endpoint, block_size=BS)
    try:
        fake.sync(sub)  # the first batch heard brings the history
        wait_for(lambda: ix.match(z)["a"] == 64, "history replayed")
        assert fake.replays == [0] and sub.resyncs == 0
        fake.send(stored(x, BS, 0, 4))
        wait_for(lambda: ix.match(x)["a"] == 64, "x credited")
        lost = fake.send(stored(y, BS, 0, 4), live=False)  # lost on the way, kept for replay
        fake.send(removed(y, BS, 3))
        wait_for(lambda: sub.resyncs == 1 and ix.match(y)["a"] == 48, "gap replayed")
        assert fake.replays == [0, lost]
        assert ix.match(x)["a"] == 0 and ix.match(z)["a"] == 0  # cleared first: not credited again
        fake.send(stored(x, BS, 0, 1))
        wait_for(lambda: ix.match(x)["a"] == 16, "live again")
        assert sub.resyncs == 1  # the batches the replay brought, heard live as well, are no gap
    finally:
        sub.close()


def test_a_dead_publisher_hangs_nothing() -> None:
    ix = FleetCacheIndex()
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.PUB)
    s.bind("tcp://127.0.0.1:*")
    endpoint = s.getsockopt_string(zmq.LAST_ENDPOINT)
    r = ctx.socket(zmq.ROUTER)  # a replay endpoint that never answers
    r.bind("tcp://127.0.0.1:*")
    replay = r.getsockopt_string(zmq.LAST_ENDPOINT)
    try:
        subs = [
            KVEventSubscriber("a", endpoint, ix, replay=replay, block_size=BS),
            KVEventSubscriber("b", "tcp://127.0.0.1:9", ix, replay="tcp://127.0.0.1:9", block_size=BS),
        ]
        wait_for(lambda: subs[0].connected, "connected")
        for seq in range(5):  # the first batch heard asks for the history: "a" waits on a replay now
            s.send_multipart([b"", seq.to_bytes(8, "big"), msgspec.msgpack.encode(EventBatch(ts=0.0, events=[]))])
            time.sleep(0.1)
        assert subs[0].batches == 0
        t0 = time.monotonic()
        for sub in subs:
            sub.close()
        assert time.monotonic() - t0 < 2.0
        assert ix.engines() == [] and not subs[1].connected
    finally:
        s.close(linger=0)
        r.close(linger=0)
    with pytest.raises(InvalidArgument):
        KVEventSubscriber("c", "no-such-transport://x", ix, block_size=BS)
    with pytest.raises(InvalidArgument):
        KVEventSubscriber("c", endpoint, ix)  # neither added nor given a block size


def test_a_lost_connection_clears_the_engine(fake: FakePublisher) -> None:
    ix = FleetCacheIndex()
    sub = KVEventSubscriber("a", fake.endpoint, ix, block_size=BS)
    try:
        fake.sync(sub)
        x = prompt(25, 64)
        fake.send(stored(x, BS, 0, 4))
        wait_for(lambda: ix.match(x)["a"] == 64, "x credited")
        fake.pub.close(linger=0)
        wait_for(lambda: not sub.connected, "disconnect seen")
        assert ix.match(x)["a"] == 0 and sub.resyncs == 1
    finally:
        sub.close()


# -- scale ----------------------------------------------------------------------------------------
def fleet(
    n_engines: int = 64, n_tokens: int = 32768, bs: int = 16
) -> tuple[FleetCacheIndex, list[int], dict[str, int]]:
    """64 engines, each holding random prefixes of 20 other 4k-token prompts and a share of
    this prompt's (engine i: i/64 of it); the prefix each should be credited with."""
    ix = FleetCacheIndex()
    rng = np.random.default_rng(0)
    toks = rng.integers(1, 150_000, n_tokens).tolist()
    nb = n_tokens // bs
    want = {}
    for e in range(n_engines):
        eid = f"engine-{e}"
        ix.add_engine(eid, bs)
        for _ in range(20):
            other = rng.integers(1, 150_000, 4096).tolist()
            ix.apply(eid, wire(stored(other, bs, 0, int(rng.integers(1, 4096 // bs)))))
        have = nb * e // n_engines
        if have:
            ix.apply(eid, wire(stored(toks, bs, 0, have)))
        want[eid] = have * bs
    return ix, toks, want


def test_match_scales_to_a_fleet() -> None:
    ix, toks, want = fleet(n_engines=8, n_tokens=4096)
    assert ix.match(toks) == want


def measure() -> None:
    ix, toks, want = fleet()
    arr = np.asarray(toks, dtype=np.uint32)
    assert ix.match(toks) == want

    def best(f: Callable[[], object], n: int = 50) -> float:
        t = []
        for _ in range(n):
            t0 = time.perf_counter()
            f()
            t.append(time.perf_counter() - t0)
        return float(np.median(t)) * 1e3

    from kvstore.conductor import cacheindex

    keys = prefix_block_keys(toks, 16)
    walk = ix._sizes[16]  # the walk alone, keys computed
    print(f"blocks indexed: {sum(ix.held(e) for e in ix.engines())}, distinct keys: {len(walk.index)}")
    print(f"prefix_block_keys(list of 32768, 16): {best(lambda: prefix_block_keys(toks, 16)):.3f} ms median")
    print(f"prefix_block_keys(uint32 array):      {best(lambda: prefix_block_keys(arr, 16)):.3f} ms median")
    print(
        f"walk over 64 engines (keys computed):  {best(lambda: cacheindex._walk(walk.index, keys, walk.mask)):.3f} ms"
    )
    print(f"match(list of 32768) over 64 engines:   {best(lambda: ix.match(toks)):.3f} ms median (keys included)")
    print(f"match(uint32 array):                    {best(lambda: ix.match(arr)):.3f} ms median (keys included)")


if __name__ == "__main__":
    measure()

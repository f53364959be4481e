"""kvstore as vLLM's KV connector, end to end: real vLLM engine processes on the CPU (prefix
caching on, as vLLM ships), a real node, prefill and decode in separate processes, and
the configurations people run: chunked prefill, preemption, aborts, tensor parallelism,
multi-turn conversations (the engines: ``vllm_rig.Rig``).

Greedy tokens and their logprobs must equal the reference engine's (no connector: it
computes every prompt) whether the consumer loaded the whole stored prompt, loaded the part
beyond what its own prefix cache held, loaded a conversation's earlier turns (answers
included), found corrupt KV (the connector's checksum check turns it into recompute), found
nothing (another ``cache_salt`` or LoRA adapter), or lost its node (recompute within the
deadline, no hang).  A decode request learns what its prefill saved from the prefill's
``kv_transfer_params`` (no polling of the store), and every load is checked on the node's
counters: it read exactly the blocks of what the consumer did not hold itself, so an
engine that recomputed everything cannot pass.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import numpy as np
import pytest
from vllm_rig import (  # noqa: F401 - fixtures
    CHUNK,
    MAX,
    RETRY,
    SMALL_STEP,
    N,
    Rig,
    diff,
    expect,
    found,
    healthy_node,
    info,
    made,
    prompt,
    reads,
    rig,
    same,
)

from client import KVClient
from kvstore.children import log_tail
from kvstore.demo.engine import request
from kvstore.keys import Namespace, chunk_keys

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


def reset(engine: Any) -> None:
    """Drop ``engine``'s own prefix cache.  vLLM refuses while any block is in use, and a
    finished request's blocks stay in use until its save commits (``defer_free``): asked
    again until the saves in flight are done (bounded)."""
    deadline = time.monotonic() + 60
    while not engine.reset_prefix_cache():
        assert time.monotonic() < deadline, "vLLM refused to drop its prefix cache for 60 s (blocks still held)"
        time.sleep(0.1)


def consume(
    rig: Rig,
    engine: Any,
    tokens: list[int],
    produced: dict[str, Any] | None,
    *,
    local: int = 0,
    ranks: int = 1,
    max_tokens: int = 8,
    client: Any = None,
    **kw: Any,
) -> dict[str, Any]:
    """``engine`` serves ``tokens`` with ``produced``'s ``kv_transfer_params`` (the
    handoff): its result equals the reference's, the node handed out the blocks of what
    ``produced`` saved beyond the ``local`` tokens of the engine's own prefix cache, and
    the connector says it supplied those tokens (checked in that order).
    ``produced=None``: nothing is stored for ``tokens`` (``kw`` may still carry params)."""
    client = client or rig.client
    want = rig.want(tokens, max_tokens, **{k: v for k, v in kw.items() if k in ("cache_salt", "lora")})
    blocks, external = expect(produced, tokens, local=local, ranks=ranks) if produced else (0, 0)
    if produced:
        kw["kv_transfer_params"] = produced["kv_transfer_params"]
    before = reads(client)
    got = engine.generate(tokens, max_tokens=max_tokens, **kw)
    assert same(got, want), diff(got, want)
    handed = reads(client) - before
    assert handed == blocks, (
        f"the node handed out {handed} blocks, not {blocks}{engine.log_tail()}{log_tail(rig.dir / 'node.log')}{rig.stalls.report()}"
    )
    kv = info(got)
    assert (kv.get("local_tokens"), kv.get("external_tokens")) == (local, external), kv
    return got


def produce(rig: Rig, tokens: list[int], *, max_tokens: int = 1, **kw: Any) -> dict[str, Any]:
    """The prefill engine computes ``tokens`` (nothing stored for them yet) and saves them."""
    got = rig.prefill.generate(tokens, max_tokens=max_tokens, **kw)
    want = rig.want(tokens, max_tokens, **kw)
    assert same(got, want), diff(got, want)
    assert info(got).get("saved"), got["kv_transfer_params"]
    return made(got, tokens)


def committed(rig: Rig, tokens: list[int], p: dict[str, Any]) -> None:
    """Everything the prefill saved is on the node: the decode engine has loaded it (the
    handoff waits for it), then forgets it again (its own prefix cache is reset)."""
    consume(rig, rig.decode, tokens, p, max_tokens=1)
    reset(rig.decode)


def test_decode_loads_what_prefill_saved(rig: Rig) -> None:
    """A full hit, for prompts that end inside a chunk and one that ends on a chunk
    boundary: what the prefill saved is loaded, vLLM computes the rest (at least the last
    prompt token)."""
    for seed, n in ((101, N), (102, 4 * CHUNK), (103, 600)):
        toks = prompt(seed, n)
        p = produce(rig, toks)
        got = consume(rig, rig.decode, toks, p)
        assert got["num_cached_tokens"] == info(got)["external_tokens"] >= min(n // CHUNK * CHUNK, n - 1)
        assert info(p).get("saved_chunks") == n // CHUNK, p["kv_transfer_params"]


def test_a_partial_local_hit_loads_only_what_the_prefix_cache_lacks(rig: Rig) -> None:
    """The decode engine's own prefix cache holds the first L tokens, the store holds the
    prompt: vLLM keeps its L tokens, the connector loads from L on (out of the chunks that
    cover it), the rest is computed.  L on a chunk boundary and inside a chunk."""
    bs = rig.decode.block_size
    for seed, shared, n in ((203, 300, N), (201, 400, N), (202, 650, 1100)):
        head = prompt(seed, shared)
        first, second = head + prompt(seed + 1000, n - shared), head + prompt(seed + 2000, n - shared)
        local = shared // bs * bs  # vLLM caches whole blocks: 256, 384 and 640 tokens of 128-token blocks
        assert 0 < local < n // CHUNK * CHUNK, (bs, local)
        rig.decode.generate(first, max_tokens=1)  # now the decode engine's prefix cache holds `head`
        p = produce(rig, second)
        got = consume(rig, rig.decode, second, p, local=local)
        assert info(got)["external_tokens"] > 0
        assert got["num_cached_tokens"] == local + info(got)["external_tokens"]


def test_the_decode_request_waits_for_exactly_what_its_prefill_saved(rig: Rig) -> None:
    """The prefill's ``kv_transfer_params`` say what it saved: the decode engine loads that
    (a longer prompt does not wait for chunks nobody saves), and chunks that never arrive
    cost at most ``deadline_s``, then the request recomputes."""
    toks = prompt(301)
    p = produce(rig, toks)
    longer = toks + prompt(302, 300)
    got = consume(rig, rig.decode, longer, p)
    assert info(got)["external_tokens"] == 3 * CHUNK  # the whole chunks the two prompts share
    # the same promise for a prompt nothing was saved for: it waits in vain, bounded
    never = prompt(303)
    t0 = time.monotonic()
    got = rig.decode.generate(never, max_tokens=8, kv_transfer_params=p["kv_transfer_params"])
    assert time.monotonic() - t0 < 2.0 + 30  # deadline_s, then recompute (slow CPU margin)
    want = rig.want(never, 8)
    assert same(got, want), diff(got, want)
    assert info(got).get("external_tokens") == 0


def test_a_decode_engine_on_another_node_pulls_the_kv_over_tcp(rig: Rig) -> None:
    toks = prompt(6)
    p = produce(rig, toks)
    keys = chunk_keys(toks[: 3 * CHUNK], Namespace.from_dict(info(p)["namespace"]))
    assert rig.other.match_prefix(keys) == 0
    before = reads(rig.client)
    consume(rig, rig.remote, toks, p, client=rig.other)  # the blocks are read on its own node
    assert reads(rig.client) - before == expect(p, toks)[0]  # after the producer's node handed them out
    assert rig.other.match_prefix(keys) == 3  # fetched from the producer's node, then loaded from its own


def test_a_session_id_in_kv_transfer_params_reaches_the_store(rig: Rig) -> None:
    toks = prompt(10)
    p = produce(rig, toks, session_id="chat-1")
    consume(rig, rig.decode, toks, p, session_id="chat-2")
    assert rig.client.close_session("chat-1")  # the producer's saves opened it
    assert rig.client.close_session("chat-2")  # the consumer's lookup and load did
    assert not rig.client.close_session("chat-3")


def test_a_different_cache_salt_never_hits(rig: Rig) -> None:
    toks = prompt(2)
    p = produce(rig, toks, cache_salt="tenant-a")
    before = found(rig.client)
    # tenant-b's request carries tenant-a's kv_transfer_params: they name another namespace
    consume(rig, rig.decode, toks, None, cache_salt="tenant-b", kv_transfer_params=p["kv_transfer_params"])
    assert found(rig.client) == before  # nothing under tenant-b's keys
    consume(rig, rig.decode, toks, p, cache_salt="tenant-a")


def test_kv_of_a_lora_adapter_never_serves_the_base_model(rig: Rig) -> None:
    toks = prompt(7)
    lora = rig.lora
    p = produce(rig, toks, lora=lora)
    assert info(p)["namespace"]["lora_id"] == "adapter-a"
    before = found(rig.client)
    base = consume(rig, rig.decode, toks, None, max_tokens=1, kv_transfer_params=p["kv_transfer_params"])
    assert found(rig.client) == before  # nothing under the base model's keys
    assert base["tokens"] != p["tokens"]  # the adapter changes the output: sharing KV would show
    consume(rig, rig.decode, toks, p, max_tokens=1, lora=lora)


def test_a_conversation_loads_its_earlier_turns_answers_included(rig: Rig) -> None:
    """Turn 1 on the prefill engine, turn 2 (turn 1's prompt and answer and a new message)
    on the chunked-prefill engine, turn 3 on the decode engine: each loads every earlier
    whole chunk from the store, the answers' chunks included (saved as the decode filled
    them: ``save_decode``)."""
    t1 = prompt(401, 500)
    r1 = produce(rig, t1, max_tokens=300)
    assert info(r1).get("saved_chunks") == (500 + 300 - 1) // CHUNK  # the last token has no KV yet
    t2 = t1 + r1["tokens"] + prompt(402, 100)  # 900 tokens
    r2 = consume(rig, rig.small, t2, r1, max_tokens=200)
    assert info(r2)["external_tokens"] == 3 * CHUNK > len(t1)  # turn 1's answer came from the store
    assert info(r2).get("saved_chunks") == (900 + 200 - 1) // CHUNK
    t3 = t2 + r2["tokens"] + prompt(403, 100)  # 1200 tokens
    r3 = consume(rig, rig.decode, t3, r2)
    assert info(r3)["external_tokens"] == 4 * CHUNK > len(t2)  # and turn 2's


def test_corrupt_kv_in_the_store_is_recomputed_never_loaded(rig: Rig) -> None:
    toks = prompt(3)
    p = produce(rig, toks)
    committed(rig, toks, p)
    keys = chunk_keys(toks[: 3 * CHUNK], Namespace.from_dict(info(p)["namespace"]))
    client = rig.client
    arena = np.frombuffer(client.arena_buffer(), dtype=np.uint8)
    base = arena.ctypes.data
    rng = np.random.default_rng(0)
    with client.acquire(keys) as held:  # overwrite the stored bytes in place, under the same keys
        for views in held.views:
            for v in views:
                off = np.frombuffer(v, dtype=np.uint8).ctypes.data - base
                arena[off : off + v.nbytes] = rng.integers(0, 256, v.nbytes, dtype=np.uint8)
    want = rig.want(toks, 8)
    # with the handoff the decode engine loads whatever is found (a lookup of its own may
    # pass the hit by: its load gate can learn that recomputing 3 chunks on this CPU is
    # cheaper, and then nothing is read and nothing checked)
    got = rig.decode.generate(toks, max_tokens=8, kv_transfer_params=p["kv_transfer_params"])
    assert same(got, want), "corrupt KV reached the engine: " + diff(got, want)
    assert "payload checksum mismatch" in (rig.dir / "decode.log").read_text()


# -- loads that do not stall the batch (issue 24) --
def push_to_nvme(client: Any, keys: list[Any]) -> list[Any]:
    """Fill the node's DRAM with other blocks until ``keys`` are on NVMe only; the filler's keys."""
    import os

    filler: list[Any] = []
    for _ in range(24):
        batch = [os.urandom(16) for _ in range(8)]
        client.put_many(batch, [os.urandom(4 << 20) for _ in batch])
        filler += batch
        if all(t == "nvme" for t in client.lookup(keys)):
            return filler
    raise AssertionError(f"the prompt's chunks did not reach NVMe: {client.lookup(keys)}")


def test_a_hit_on_nvme_loads_in_the_background_while_the_batch_decodes(rig: Rig) -> None:
    """``async_loads=auto``: a hit whose chunks are on NVMe waits in vLLM's
    ``WAITING_FOR_REMOTE_KVS`` while its blocks are promoted and copied, and the request
    already decoding keeps stepping; both answers equal the reference's."""
    toks = prompt(701)
    p = produce(rig, toks)
    committed(rig, toks, p)
    keys = chunk_keys(toks[: 3 * CHUNK], Namespace.from_dict(info(p)["namespace"]))
    filler = push_to_nvme(rig.client, keys)
    try:
        running = prompt(702, 300)
        asked = rig.decode.metrics().get("vllm:kvstore_async_loads", 0)
        before = reads(rig.client)
        got = rig.decode.batch(
            [request(running, max_tokens=48), request(toks, max_tokens=8, kv_transfer_params=p["kv_transfer_params"])]
        )
        for t, g, n in ((running, got[0], 48), (toks, got[1], 8)):
            want = rig.want(t, n)
            assert same(g, want), diff(g, want)
        assert info(got[1])["external_tokens"] == expect(p, toks)[1]
        assert reads(rig.client) - before == expect(p, toks)[0]
        assert rig.decode.metrics().get("vllm:kvstore_async_loads", 0) - asked == 1
        assert len(got[0]["token_ms"]) == 48
    finally:
        rig.client.delete(filler)
        reset(rig.decode)


def test_a_corrupt_block_in_a_background_load_is_recomputed_never_loaded(rig: Rig) -> None:
    """A background load whose first block fails its checksum reports the request's blocks
    failed in the step that reports it finished: vLLM recomputes them."""
    toks = prompt(711)
    p = produce(rig, toks)
    committed(rig, toks, p)
    keys = chunk_keys(toks[: 3 * CHUNK], Namespace.from_dict(info(p)["namespace"]))
    filler = push_to_nvme(rig.client, keys)
    try:
        arena = np.frombuffer(rig.client.arena_buffer(), dtype=np.uint8)
        with rig.client.acquire(keys[:1]) as held:  # promotes chunk 0 to DRAM; flip its bytes there
            v = held.views[0][0]
            off = np.frombuffer(v, dtype=np.uint8).ctypes.data - arena.ctypes.data
            arena[off : off + v.nbytes] ^= 0x5A
        assert rig.client.lookup(keys) == ["dram", "nvme", "nvme"]
        asked = rig.decode.metrics().get("vllm:kvstore_async_loads", 0)
        failed = rig.decode.metrics().get("vllm:kvstore_load_errors", 0)
        got = rig.decode.generate(toks, max_tokens=8, kv_transfer_params=p["kv_transfer_params"])
        want = rig.want(toks, 8)
        assert same(got, want), "corrupt KV reached the engine: " + diff(got, want)
        assert rig.decode.metrics().get("vllm:kvstore_async_loads", 0) - asked == 1
        assert rig.decode.metrics().get("vllm:kvstore_load_errors", 0) > failed
    finally:
        rig.client.delete(filler)
        rig.client.delete(keys[:1])  # its bytes are not what was committed
        reset(rig.decode)


# -- engine configurations: chunked prefill, preemption, aborts (tensor parallelism: test_connector_tp2.py) --
def test_chunked_prefill_saves_and_loads(rig: Rig) -> None:
    """The ``small`` engine computes SMALL_STEP tokens a step: a prompt it computes over
    several steps is saved whole (the decode engine loads it), and of a prompt it loads
    only the tokens past the stored ones are computed, over steps."""
    for seed in (501, 502):
        toks = prompt(seed)
        got = rig.small.generate(toks, max_tokens=8)
        want = rig.want(toks, 8)
        assert same(got, want), diff(got, want)
        consume(rig, rig.decode, toks, made(got, toks))
        assert info(got).get("saved_chunks") == 3, got["kv_transfer_params"]
        toks = prompt(seed + 10, N + 2 * SMALL_STEP)
        consume(rig, rig.small, toks, produce(rig, toks))


def test_preempted_requests_resume_with_the_right_kv(rig: Rig) -> None:
    """Four requests at once in a KV cache that holds about two: vLLM preempts some and
    resumes them later (their KV recomputed, found in its prefix cache or loaded again).
    Every result equals the reference, and what the engine saved for the prompts it
    computed between preemptions loads right on another engine."""
    stored = [prompt(s) for s in (601, 602)]
    params = [produce(rig, t)["kv_transfer_params"] for t in stored]
    fresh = [prompt(s) for s in (603, 604)]
    reqs = [request(t, max_tokens=48, kv_transfer_params=p) for t, p in zip(stored, params)]
    reqs += [request(t, max_tokens=48) for t in fresh]
    preempted, before = rig.small.metrics().get("vllm:num_preemptions", 0), reads(rig.client)
    got = rig.small.batch(reqs)
    for t, g in zip(stored + fresh, got):
        want = rig.want(t, 48)
        assert same(g, want), diff(g, want)
    assert rig.small.metrics().get("vllm:num_preemptions", 0) > preempted, "no request was preempted"
    assert reads(rig.client) - before >= 2 * 3  # each stored prompt's chunks were loaded at least once
    for t, g in zip(fresh, got[2:]):
        consume(rig, rig.decode, t, made(g, t))


def test_an_abort_mid_prefill_frees_its_blocks_and_the_engine_serves_on(rig: Rig) -> None:
    """Requests aborted after their first steps (one loading stored chunks, one computed in
    steps and aborted once its first chunk is complete): their blocks come back (a request
    that needs every block of the KV cache runs; one block kept would leave it waiting
    forever), and both prompts are served right later."""
    toks = prompt(701)
    p = produce(rig, toks)
    r = rig.small.generate(toks, max_tokens=8, kv_transfer_params=p["kv_transfer_params"], abort_after=1)
    assert r["aborted"] and not r["tokens"], r
    fresh = prompt(702)
    r = rig.small.generate(fresh, max_tokens=8, abort_after=CHUNK // SMALL_STEP + 1)
    assert r["aborted"] and not r["tokens"], r
    whole = (rig.small.num_blocks - 1) * rig.small.block_size  # less vLLM's null block
    assert whole == MAX, "the small engine's KV cache is not one MAX-token request"
    consume(rig, rig.small, prompt(703, whole - 8), None, max_tokens=8, timeout=300)
    reset(rig.small)
    consume(rig, rig.small, toks, p)
    want = rig.want(fresh, 8)
    got = rig.decode.generate(fresh, max_tokens=8)  # whatever of it was saved before the abort is right
    assert same(got, want), diff(got, want)


# -- the node fails: these run last, and `healthy_node` brings it back for whatever follows --
def test_saves_that_cannot_start_still_free_their_blocks(rig: Rig, healthy_node: Any) -> None:
    """With the node gone the worker has no agent to save through (it dropped it after the
    first failed call): the requests it held for their saves are still reported finished,
    so their blocks come back and a request that needs every block of the KV cache runs
    (one request's blocks kept would leave it waiting forever)."""
    node = healthy_node
    node.proc.kill()
    node.proc.wait()
    for seed in (1101, 1102, 1103):  # the first fails its save; the next ones find no agent at all
        toks = prompt(seed)
        got = rig.small.generate(toks, max_tokens=4, timeout=120)
        want = rig.want(toks, 4)
        assert same(got, want), diff(got, want)
    whole = (rig.small.num_blocks - 1) * rig.small.block_size  # less vLLM's null block
    big = prompt(1104, whole - 8)
    got = rig.small.generate(big, max_tokens=8, timeout=120)
    want = rig.want(big, 8)
    assert same(got, want), diff(got, want)


def test_a_stopped_node_turns_into_recompute_within_the_deadline(rig: Rig, healthy_node: Any) -> None:
    toks = prompt(4)
    p = produce(rig, toks)
    committed(rig, toks, p)
    os.kill(healthy_node.proc.pid, signal.SIGSTOP)  # a node that answers nothing
    try:
        t0 = time.monotonic()
        got = rig.decode.generate(toks, max_tokens=4, timeout=120)
        assert time.monotonic() - t0 < 60
        want = rig.want(toks, 4)
        assert same(got, want), diff(got, want)
    finally:
        os.kill(healthy_node.proc.pid, signal.SIGCONT)


def test_a_killed_node_turns_into_recompute_and_a_restarted_one_serves_again(rig: Rig, healthy_node: Any) -> None:
    toks = prompt(5)
    p = produce(rig, toks)
    committed(rig, toks, p)
    node = healthy_node
    node.proc.kill()
    node.proc.wait()
    t0 = time.monotonic()
    got = rig.decode.generate(toks, max_tokens=4, timeout=120)
    assert time.monotonic() - t0 < 60
    want = rig.want(toks, 4)
    assert same(got, want), diff(got, want)
    node.start()  # a new process and arena on the same socket: the engines re-attach
    seed = 800
    end = time.monotonic() + 60
    while True:
        toks = prompt(seed)
        p = made(rig.prefill.generate(toks, max_tokens=4), toks)
        if info(p).get("saved"):
            break
        assert time.monotonic() < end, "the prefill engine never saved to the restarted node"
        seed += 1
    time.sleep(RETRY + 1)  # the decode engine's lookups failed a moment ago: it tries again after RETRY
    with KVClient(node.target) as client:
        consume(rig, rig.decode, toks, p, max_tokens=4, client=client)


def test_a_node_that_dies_in_the_middle_of_a_load_turns_into_recompute(rig: Rig, healthy_node: Any) -> None:
    """The scheduler finds the chunks; the node then dies answering the worker's Acquire
    (failure point ``node.acquire``): the engine recomputes, equal tokens, no hang."""
    toks = prompt(9)
    node = healthy_node
    p = produce(rig, toks)
    committed(rig, toks, p)
    node.stop()  # graceful: the chunks come back from NVMe
    node.env["KVSTORE_FAILPOINTS"] = "node.acquire=kill"
    node.start()
    # the decode engine finds the chunks in its view of the pool, which follows a restarted
    # node within about 3 s (its stream's back-off, 1 s, and gRPC's reconnect, 2 s at most):
    # until then a lookup is a miss (never a wait), and this test is about the load
    time.sleep(5.0)
    t0 = time.monotonic()
    got = rig.decode.generate(toks, max_tokens=4, timeout=120)
    assert time.monotonic() - t0 < 60
    assert node.proc.wait(timeout=30) == -signal.SIGKILL  # it died at the Acquire of this load
    want = rig.want(toks, 4)
    assert same(got, want), diff(got, want)

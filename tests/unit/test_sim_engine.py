"""The engine model: vLLM v1's batch formation, chunked prefill, prefix cache, preemption and
external hits, on a tiny profile (blocks of 4 tokens, a 16-token budget) and virtual time."""

from __future__ import annotations

import random
import struct
from collections.abc import Sequence

import pytest
import xxhash

from kvstore.errors import InvalidArgument
from kvstore.sim.engine import (
    BlockHash,
    BlockRemoved,
    BlockStored,
    EngineModel,
    ExternalHit,
    StepResult,
    engine_block_hashes,
    root_hash,
)
from kvstore.sim.profile import EngineProfile
from kvstore.traces.format import Request

BS = 4


def profile(**kw: object) -> EngineProfile:
    base: dict[str, object] = dict(
        name="tiny",
        description="a test engine",
        model="none",
        hardware="none",
        overhead_ms=10.0,
        prefill_ms_per_token=1.0,
        prefill_attn_ms=0.01,
        decode_ms_per_seq=0.5,
        decode_ms_per_kv_token=0.001,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        block_size=BS,
        num_gpu_blocks=65,
        kv_bytes_per_token=1000,
        dram_bandwidth_Bps=1e6,
        nvme_bandwidth_Bps=1e5,
        network_bandwidth_Bps=5e5,
        dram_latency_s=0.001,
        nvme_latency_s=0.002,
        network_latency_s=0.003,
    )
    base.update(kw)
    return EngineProfile(**base)  # type: ignore[arg-type]


def hashes(tag: int, n: int) -> tuple[BlockHash, ...]:
    """n chained blocks, one trace block each: tag 1 and 2 share nothing."""
    return engine_block_hashes([tag * 1000 + i for i in range(n)], n * BS, block_size=BS, trace_block_tokens=BS)


def run(e: EngineModel, now: float = 0.0, limit: int = 10_000) -> list[StepResult]:
    """Step until every request finished, checking the invariants after each step."""
    out: list[StepResult] = []
    while e.num_unfinished:
        assert len(out) < limit, "no progress"
        r = e.step(now)
        e.check()
        out.append(r)
        if r.idle:
            nxt = e.next_ready_s()
            assert nxt is not None and nxt > now, "idle with nothing to wait for"
            now = nxt
        else:
            now = r.end_s
    return out


def outputs(steps: Sequence[StepResult], req_id: str) -> list[int]:
    return [o.output_tokens for s in steps for o in s.outputs if o.req_id == req_id]


# -- block hashes ---------------------------------------------------------------------
def test_trace_blocks_expand_to_chained_engine_blocks() -> None:
    a = engine_block_hashes([1, 2, 3], 192, block_size=16, trace_block_tokens=64)
    b = engine_block_hashes([1, 2, 9], 192, block_size=16, trace_block_tokens=64)
    assert len(a) == 12 and len(set(a)) == 12
    assert a[:8] == b[:8] and not set(a[8:]) & set(b[8:])
    assert engine_block_hashes([1, 2, 3], 192, block_size=16, trace_block_tokens=64) == a  # deterministic
    # the same id at another position is another block; a salt is another namespace
    assert not set(engine_block_hashes([2], 64, block_size=16, trace_block_tokens=64)) & set(a)
    assert engine_block_hashes([1], 64, block_size=16, trace_block_tokens=64, salt=b"x")[0] != a[0]
    assert root_hash(b"x") != root_hash()
    # a partial last block has no hash: 150 tokens make 9 full blocks, 160 make 10
    short = engine_block_hashes([1, 2, 3], 150, block_size=16, trace_block_tokens=64)
    long = engine_block_hashes([1, 2, 3], 160, block_size=16, trace_block_tokens=64)
    assert len(short) == 9 and len(long) == 10 and long[:9] == short
    with pytest.raises(InvalidArgument, match="makes 3 trace blocks"):
        engine_block_hashes([1, 2], 150, block_size=16, trace_block_tokens=64)


def test_an_engine_block_larger_than_a_trace_block_covers_several() -> None:
    """Trace blocks of 16, engine blocks of 128 (the CPU engines'): a block is shared only if all
    eight trace blocks inside it are."""
    ids = list(range(16))
    a = engine_block_hashes(ids, 256, block_size=128, trace_block_tokens=16)
    b = engine_block_hashes(ids[:7] + [99] + ids[8:], 256, block_size=128, trace_block_tokens=16)
    c = engine_block_hashes(ids[:8] + [99] + ids[9:], 256, block_size=128, trace_block_tokens=16)
    assert len(a) == 2 and a[0] != b[0] and a[0] == c[0] and a[1] != c[1]


# -- batch formation -------------------------------------------------------------------
def test_a_batch_respects_max_num_seqs_and_the_token_budget() -> None:
    e = EngineModel(profile())
    for i in range(6):
        e.add_request(f"r{i}", 3, (), 2, 0.0)
    first = e.step(0.0)
    assert first.scheduled == (("r0", 3), ("r1", 3), ("r2", 3), ("r3", 3))  # max_num_seqs 4
    e = EngineModel(profile(max_num_seqs=8))
    for i in range(4):
        e.add_request(f"r{i}", 10, (), 3, 0.0)
    steps = run(e)
    assert steps[0].scheduled == (("r0", 10), ("r1", 6))  # 16 tokens: r1's prompt is split
    assert steps[1].scheduled == (("r0", 1), ("r1", 4), ("r2", 10), ("r3", 1))  # running first, then FCFS
    assert all(sum(n for _, n in s.scheduled) <= 16 for s in steps)


def test_chunked_prefill_emits_the_first_token_in_the_step_that_ends_the_prompt() -> None:
    p = profile()
    e = EngineModel(p)
    e.add_request("long", 40, hashes(1, 10), 2, arrival_s=0.5)
    steps = run(e, now=1.0)
    assert [s.scheduled for s in steps] == [(("long", 16),), (("long", 16),), (("long", 8),), (("long", 1),)]
    assert [len(s.outputs) for s in steps] == [0, 0, 1, 1]
    # chunks attend what came before them: p x (c + p)
    assert [s.attention_pairs for s in steps[:3]] == [16 * 16, 16 * 32, 8 * 40]
    assert [s.step_time_s for s in steps[:3]] == pytest.approx(
        [(p.overhead_ms + 16 + 0.01 * 256) / 1000, (10 + 16 + 0.01 * 512) / 1000, (10 + 8 + 0.01 * 320) / 1000]
    )
    first = steps[2].outputs[0]
    assert first.first_token and first.ttft_s == pytest.approx(steps[2].end_s - 0.5)
    assert steps[3].outputs[0].finished and steps[3].outputs[0].ttft_s is None


def test_a_step_costs_what_the_profile_says() -> None:
    """A decode of a 9-token context beside a 6-token prefill chunk."""
    p = profile()
    e = EngineModel(p)
    e.add_request("a", 8, (), 3, 0.0)
    e.step(0.0)  # a: prompt done, first token
    e.add_request("b", 6, (), 1, 0.0)
    s = e.step(1.0)
    assert s.scheduled == (("a", 1), ("b", 6))
    assert (s.prefill_tokens, s.attention_pairs, s.decode_tokens, s.decode_context_tokens) == (6, 36, 1, 9)
    want = p.overhead_ms + 1.0 * 6 + 0.01 * 36 + 0.5 * 1 + 0.001 * 9
    assert s.step_time_s == pytest.approx(want / 1000) and s.end_s == pytest.approx(1.0 + want / 1000)
    assert p.step_ms(6, 36, 1, 9) == pytest.approx(want) and p.step_ms(0, 0, 0, 0) == 0.0


# -- the prefix cache ------------------------------------------------------------------
def test_a_repeated_prompt_hits_full_blocks_only_and_computes_at_least_one_token() -> None:
    e = EngineModel(profile())
    e.add_request("a", 10, hashes(1, 2), 1, 0.0)  # 2 full blocks + 2 tokens
    stored = [ev for s in run(e) for ev in s.kv_events if isinstance(ev, BlockStored)]
    assert stored == [BlockStored(hashes(1, 2), None, "a")]
    e.add_request("b", 10, hashes(1, 2), 1, 0.0)
    s = e.step(1.0)
    assert s.cached_tokens == 8 and s.scheduled == (("b", 2),) and s.prefill_tokens == 2
    # a prompt of exactly 2 full blocks: its last token is computed, so only 1 block hits
    e.add_request("c", 8, hashes(1, 2), 1, 0.0)
    s = e.step(2.0)
    assert s.cached_tokens == 4 and s.scheduled == (("c", 4),)
    assert s.attention_pairs == 4 * 8  # the hit is attended, not computed
    e.add_request("d", 10, hashes(2, 2), 1, 0.0)
    assert e.lookup_prefix(hashes(1, 2)) == 2 and e.lookup_prefix(hashes(2, 2)) == 0
    assert e.step(3.0).cached_tokens == 0


def test_free_blocks_are_evicted_least_recently_used_first_tail_blocks_before_heads() -> None:
    """Five usable blocks.  a and b (2 blocks each) finish, a first: the free queue is
    f a1 a0 b1 b0 (f never used; a request's tail block goes first).  A hit on a moves a's blocks
    out and, when it finishes, back at the tail; its uncached third block goes to the head,
    reused first.  New blocks then take f, then evict b1, b0, while a stays cached."""
    e = EngineModel(profile(num_gpu_blocks=6))
    a, b = hashes(1, 2), hashes(2, 2)
    e.add_request("a", 8, a, 1, 0.0)
    run(e)
    e.add_request("b", 8, b, 1, 0.0)
    run(e, 1.0)
    assert e.num_free_blocks == 5 and e.kv_usage == 0.0
    e.add_request("a-again", 9, a, 1, 0.0)  # hits both of a's blocks, computes 1 token in a third
    s = e.step(2.0)
    assert s.cached_tokens == 8 and not s.kv_events  # the third block is f: nothing evicted
    removed: list[BlockHash] = []
    for i, tag in enumerate((3, 4, 5)):
        e.add_request(f"new{i}", 4, hashes(tag, 1), 1, 0.0)
        for s in run(e, 3.0 + i):
            removed += [h for ev in s.kv_events if isinstance(ev, BlockRemoved) for h in ev.block_hashes]
    assert removed == [b[1], b[0]]
    assert e.lookup_prefix(a) == 2 and e.lookup_prefix(b) == 0


def test_preemption_under_a_tiny_cache_still_completes_every_request() -> None:
    """Eight usable blocks; six requests that need six blocks each by the end."""
    e = EngineModel(profile(num_gpu_blocks=9))
    for i in range(6):
        e.add_request(f"r{i}", 10, hashes(10 + i, 2), 12, 0.0)
    running: list[str] = []  # the engine's running order, mirrored from its results
    preemptions = 0
    steps = []
    now = 0.0
    while e.num_unfinished:
        s = e.step(now)
        e.check()
        steps.append(s)
        for victim in s.preempted:
            assert victim == running[-1], "the most recently admitted running request is preempted"
            running.pop()
            preemptions += 1
        running += [a.req_id for a in s.admitted]
        running = [r for r in running if not any(o.finished and o.req_id == r for o in s.outputs)]
        now = s.end_s
        assert len(steps) < 1000
    assert preemptions > 0
    for i in range(6):
        assert outputs(steps, f"r{i}") == list(range(1, 13))
        assert sum(o.first_token for s in steps for o in s.outputs if o.req_id == f"r{i}") == 1
    assert e.num_free_blocks == 8


def test_a_request_the_cache_cannot_hold_is_refused() -> None:
    e = EngineModel(profile(num_gpu_blocks=5))
    with pytest.raises(InvalidArgument, match="needs 5 KV blocks, the engine has 4"):
        e.add_request("big", 16, (), 2, 0.0)
    e.add_request("ok", 16, (), 1, 0.0)
    with pytest.raises(InvalidArgument, match="already in the engine"):
        e.add_request("ok", 4, (), 1, 0.0)
    with pytest.raises(InvalidArgument, match="only 1 full blocks"):
        e.add_request("x", 7, hashes(1, 2), 1, 0.0)
    e.step(1.0)
    with pytest.raises(InvalidArgument, match="time went back"):
        e.step(0.5)


# -- jitter ----------------------------------------------------------------------------
def test_jitter_is_reproducible_from_the_seed() -> None:
    def times(seed: int) -> list[float]:
        e = EngineModel(profile(jitter_cv=0.3), rng=random.Random(seed))
        for i in range(3):
            e.add_request(f"r{i}", 20, (), 5, 0.0)
        return [s.step_time_s for s in run(e)]

    assert times(7) == times(7) and times(7) != times(8)
    plain = EngineModel(profile())
    for i in range(3):
        plain.add_request(f"r{i}", 20, (), 5, 0.0)
    assert len(times(7)) == len(run(plain))  # jitter changes times, never the batches
    with pytest.raises(InvalidArgument, match=r"jitter_cv 0.3: pass rng=random.Random\(seed\)"):
        EngineModel(profile(jitter_cv=0.3))


# -- external KV -----------------------------------------------------------------------
class Pool:
    """Supplies every block it is offered from one tier, and records what it was offered."""

    def __init__(self, tier: str = "dram") -> None:
        self.tier = tier
        self.asked: list[tuple[str, tuple[BlockHash, ...]]] = []

    def __call__(self, req_id: str, block_hashes: Sequence[BlockHash]) -> ExternalHit:
        self.asked.append((req_id, tuple(block_hashes)))
        return ExternalHit(**{self.tier: len(block_hashes)})


def test_external_hits_count_as_cached_and_are_not_recomputed() -> None:
    p = profile()
    pool = Pool("nvme")
    e = EngineModel(p, lookup_external=pool)
    e.add_request("a", 20, hashes(1, 5), 1, 0.0)
    s = e.step(0.0)
    assert pool.asked == [("a", hashes(1, 4))]  # never the block holding the last token
    assert s.cached_tokens == s.external_tokens == 16 and s.scheduled == (("a", 4),) and s.prefill_tokens == 4
    load = p.nvme_latency_s + 16 * 1000 / p.nvme_bandwidth_Bps
    assert s.load_s == pytest.approx(load) and s.admitted[0].load_s == pytest.approx(load)
    assert s.step_time_s == pytest.approx(p.step_ms(4, 4 * 20, 0, 0) / 1000 + load)
    assert [ev for ev in s.kv_events if isinstance(ev, BlockStored)] == [BlockStored(hashes(1, 5), None, "a")]
    # a local hit first (a's 5 blocks): the pool is offered only the blocks after it, up to the last token
    e.add_request("b", 32, hashes(1, 8), 1, 0.0)
    s = e.step(1.0)
    assert pool.asked[-1] == ("b", hashes(1, 8)[5:7])
    assert s.cached_tokens == 28 and s.external_tokens == 8 and s.scheduled == (("b", 4),)
    # nothing left to offer: the pool is not asked
    e.add_request("c", 20, hashes(1, 5), 1, 0.0)
    assert e.step(2.0).cached_tokens == 16 and len(pool.asked) == 2


def test_an_async_load_waits_for_remote_kvs_then_runs_first() -> None:
    p = profile()
    e = EngineModel(p, lookup_external=Pool("network"), async_load=True)
    e.add_request("a", 20, hashes(1, 5), 2, 0.0)
    s = e.step(0.0)
    load = p.network_latency_s + 16 * 1000 / p.network_bandwidth_Bps
    assert s.idle and s.step_time_s == 0.0 and not s.kv_events  # loaded blocks are cached once loaded
    assert e.next_ready_s() == pytest.approx(load) and not e.has_work(0.0) and e.has_work(load)
    assert e.num_waiting == 1 and e.kv_usage == pytest.approx(4 / 64)
    e.add_request("b", 4, (), 1, 0.0)  # a plain request runs while a loads
    assert e.step(0.0).scheduled == (("b", 4),)
    s = e.step(load)
    assert s.scheduled == (("a", 4),) and s.cached_tokens == s.external_tokens == 16 and s.load_s == 0.0
    assert s.admitted[0].load_s == pytest.approx(load)
    assert s.kv_events == (BlockStored(hashes(1, 4), None, "a"), BlockStored(hashes(1, 5)[4:], hashes(1, 4)[3], "a"))


def test_many_async_loads_in_a_tiny_cache_never_deadlock() -> None:
    e = EngineModel(profile(num_gpu_blocks=13), lookup_external=Pool("dram"), async_load=True)
    for i in range(8):
        e.add_request(f"r{i}", 30, hashes(20 + i, 7), 6, 0.0)
    steps = run(e)
    for i in range(8):
        assert outputs(steps, f"r{i}") == list(range(1, 7))
    assert sum(s.external_tokens for s in steps) >= 8 * 28


def test_a_seeded_mix_keeps_the_invariants_and_emits_exactly_max_tokens() -> None:
    rng = random.Random(11)
    e = EngineModel(profile(num_gpu_blocks=24, max_num_seqs=6), lookup_external=Pool("dram"))
    want = {}
    now = 0.0
    steps: list[StepResult] = []
    for i in range(40):
        n = rng.randrange(1, 9) * BS + rng.randrange(BS)
        prefix = engine_block_hashes(
            [rng.randrange(3)] + [10_000 + i] * 8, 9 * BS, block_size=BS, trace_block_tokens=BS
        )
        want[f"r{i}"] = rng.randrange(1, 8)
        e.add_request(f"r{i}", n, prefix[: n // BS], want[f"r{i}"], now)
        for _ in range(rng.randrange(3)):
            s = e.step(now)
            e.check()
            steps.append(s)
            now = s.end_s
    steps += run(e, now)
    for r, m in want.items():
        assert outputs(steps, r) == list(range(1, m + 1)), r


def test_a_trace_request_goes_in_as_its_engine_blocks() -> None:
    e = EngineModel(profile(num_gpu_blocks=200, max_num_batched_tokens=128))
    e.add_trace_request("t0", Request(1500.0, 40, 0, (7, 8, 9)), trace_block_tokens=16)
    e.add_trace_request("t1", Request(1700.0, 36, 3, (7, 8, 5)), trace_block_tokens=16)
    steps = run(e, 2.0)
    assert outputs(steps, "t0") == [1] and outputs(steps, "t1") == [1, 2, 3]  # output_length 0: one token
    first = {o.req_id: o.ttft_s for s in steps for o in s.outputs if o.first_token}
    assert first == pytest.approx({"t0": steps[0].end_s - 1.5, "t1": steps[0].end_s - 1.7})
    # t0's blocks are cached when scheduled, so t1 hits them in the same step (as in vLLM):
    # the two shared trace blocks are 8 engine blocks
    assert steps[0].admitted[1].cached_tokens == 32 and steps[0].scheduled == (("t0", 40), ("t1", 4))


def _reference_hashes(ids: list[int], length: int, bs: int, bt: int, salt: bytes) -> tuple[bytes, ...]:
    """The documented chain, block by block: xxh3_128(parent || (id, lo, hi) of each span)."""
    parent, out = root_hash(salt), []
    for i in range(length // bs):
        lo, hi = i * bs, (i + 1) * bs
        content = bytes(parent)
        for j in range(lo // bt, -(-hi // bt)):
            content += struct.pack("<QII", ids[j], max(lo, j * bt) - j * bt, min(hi, (j + 1) * bt) - j * bt)
        parent = BlockHash(xxhash.xxh3_128_digest(content))
        out.append(parent)
    return tuple(out)


def test_block_hashes_are_the_documented_chain_with_or_without_a_memo() -> None:
    rng = random.Random(3)
    for bt, bs in ((64, 16), (16, 16), (24, 16), (16, 32)):
        memo: dict[tuple[bytes, int], tuple[BlockHash, ...]] = {}
        for _ in range(100):
            k = rng.randint(1, 8)
            ids = [rng.randint(0, 3) for _ in range(k)]  # few ids: prefixes repeat, the memo answers
            length = (k - 1) * bt + rng.randint(1, bt)
            want = _reference_hashes(ids, length, bs, bt, b"s")
            assert engine_block_hashes(ids, length, block_size=bs, trace_block_tokens=bt, salt=b"s") == want
            assert engine_block_hashes(ids, length, block_size=bs, trace_block_tokens=bt, salt=b"s", memo=memo) == want
        assert bool(memo) == (bt % bs == 0)

"""One simulated engine: vLLM v1's scheduler and paged prefix cache as a sans-I/O state machine.

No clock, no threads, no asyncio: the caller owns time.  It adds requests as they arrive
(:meth:`EngineModel.add_request`), calls :meth:`EngineModel.step` with its clock's
``now_s`` and advances its clock by the result's ``step_time_s``.  A step that schedules
nothing (``StepResult.idle``) takes no time; the caller then advances to its next arrival
or to :meth:`EngineModel.next_ready_s` (an external load completing).  Step times come
from an :class:`~kvstore.sim.profile.EngineProfile` (its docstring has the formula); the
only randomness is the profile's jitter, drawn from the ``random.Random`` passed in.

A step builds one batch as vLLM v1's ``Scheduler.schedule`` does (vLLM 0.32):

1. running requests first, in admission order: each gets its remaining tokens (a decode:
   1; a prefill: what is left of its prompt), at most the step's leftover token budget
   (``max_num_batched_tokens``; chunked prefill splits a longer prompt over steps).  When
   the blocks for them cannot be had, the most recently admitted running request is
   preempted (recompute: its blocks are freed, it goes back to the front of the waiting
   queue with nothing computed); if that is the request itself, the pass over running
   requests stops;
2. only if nothing was preempted: waiting requests, those holding KV blocks (external
   loads) first, then the rest in FCFS order, while budget is left and fewer than
   ``max_num_seqs`` run.  On admission a request's prefix is looked up in the prefix
   cache (full blocks only, and never its last token: vLLM always computes at least one),
   then in the external pool (``lookup_external``, for the blocks after the local hit);
   when its blocks cannot be allocated, admission stops for this step.

A request samples a token in every step that leaves all its tokens computed: the step
that finishes its prompt emits its first token (TTFT = that step's end − arrival), each
later step one more, until ``max_tokens``; then it finishes and frees its blocks.

External KV (the pool, plugged in later): ``lookup_external(req_id, block_hashes)`` is
given the request's block hashes after the local hit (at most up to its last token) and
answers an :class:`ExternalHit`, how many leading ones each tier supplies (and, after all
of them, the tokens of the prompt's partial last chunk, all but the last token: external
loads are counted in tokens, as vLLM's, not in whole blocks).  Those count as
cached, never recomputed.  Their load takes ``latency + bytes / bandwidth`` per tier
(:meth:`ExternalHit.load_s`), serially.  ``async_load=False`` (the engine's default; the
project's connector answers so for hits on its own node's DRAM, ``async_loads="auto"``)
adds the load to the step that admits the request, before its forward pass, without
overlap.  ``async_load=True`` is vLLM's ``WAITING_FOR_REMOTE_KVS``: the request is
allocated its blocks, waits ``load_s`` from the admitting step's start without being
scheduled, and is then scheduled first among waiting requests; the loaded blocks enter the
prefix cache then (the step that starts it lists it in ``StepResult.loads_started``, the
step that schedules it in ``admitted``).  A hit may choose for itself
(``ExternalHit.async_load``; the connector loads NVMe and remote hits so).  An async load is admitted only if, with it, every request holding
blocks for a load can still allocate the rest of its prompt (vLLM's in-flight
reservation), so loads never deadlock the cache.

The prefix cache is vLLM's ``BlockPool``: ``num_gpu_blocks`` blocks, block 0 its null block
(never handed out).  A block whose ref count drops to 0 goes to the free queue, a cached
(hashed) block at its tail and an uncached one at its head, a request's blocks in reverse
order (its tail first); new blocks come from the head, evicting a cached block from the
prefix cache (``BlockRemoved``).  A hit touches its blocks (out of the free queue, ref +1).
Blocks are hashed only for full prompt blocks: the content of output tokens is not in a
trace, so a block holding any is never shared.  Hashes chain as vLLM's do,
``h_i = xxh3_128(h_{i-1} || content_i)`` (:func:`engine_block_hashes`), and a block is
cached (``BlockStored``) when the step that fills it is scheduled.  Two requests that
computed the same content keep two cached copies (vLLM's hash → blocks map), each stored and
removed on its own.

State: an :class:`EngineModel` and its requests belong to its one caller; nothing is
shared.  Invariants (:meth:`EngineModel.check`): a block is in the free queue iff its ref
count is 0; its ref count is the number of live requests holding it; a block has a hash iff
the prefix cache maps that hash to it; a running or loading request holds
``ceil(num_computed / block_size)`` blocks, a waiting one none; at most ``max_num_seqs``
run; time never goes back.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import math
import random
import struct
from collections.abc import Callable, Sequence
from typing import NewType

import xxhash

from kvstore.errors import InvalidArgument
from kvstore.sim.profile import TIERS, EngineProfile, Tier
from kvstore.traces.format import DEFAULT_BLOCK_TOKENS, Request

BlockHash = NewType("BlockHash", bytes)
"""16 bytes naming one engine block's content and, by chaining, its whole prefix."""

_ROOT = b"kvstore.sim.block/v1"
_SPAN = struct.Struct("<QII")  # a trace block id and the token range of it an engine block covers


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def root_hash(salt: bytes = b"") -> BlockHash:
    """The parent of a prompt's first block (``salt`` separates models or tenants)."""
    return BlockHash(xxhash.xxh3_128_digest(_ROOT + salt))


def engine_block_hashes(
    hash_ids: Sequence[int],
    input_length: int,
    *,
    block_size: int,
    trace_block_tokens: int = DEFAULT_BLOCK_TOKENS,
    salt: bytes = b"",
    memo: dict[tuple[bytes, int], tuple[BlockHash, ...]] | None = None,
) -> tuple[BlockHash, ...]:
    """The chained hashes of a trace request's full engine blocks.

    A Mooncake trace names one id per ``trace_block_tokens``-token block (the last may be
    partial); engine block ``i`` covers tokens ``[i·B, (i+1)·B)`` of ``block_size`` B, and its
    content is the (id, token range) of each trace block it overlaps.  Deterministic; two
    requests sharing leading trace ids share the engine blocks inside them, and the partial
    last engine block has no hash (it is never shared).

    ``memo`` (a dict kept over many calls, of the same block sizes and salt): the engine
    blocks of each whole trace block by (parent hash, id), so a prefix shared by many
    requests is hashed once; the answer is the same with or without it."""
    if block_size <= 0 or trace_block_tokens <= 0:
        raise InvalidArgument(f"block sizes must be positive, got {block_size} and {trace_block_tokens}")
    if len(hash_ids) != -(-input_length // trace_block_tokens):
        raise InvalidArgument(
            f"input_length {input_length} makes {-(-input_length // trace_block_tokens)} trace blocks of "
            f"{trace_block_tokens} tokens, got {len(hash_ids)} hash_ids"
        )
    parent = root_hash(salt)
    out: list[BlockHash] = []
    bt = trace_block_tokens
    n = input_length // block_size
    if bt % block_size == 0:  # each engine block inside one trace block: its one span
        per = bt // block_size
        digest, pack = xxhash.xxh3_128_digest, _SPAN.pack
        for j in range(-(-n // per)):
            key = (parent, hash_ids[j]) if memo is not None and (j + 1) * per <= n else None
            got = memo.get(key) if memo is not None and key is not None else None
            if got is None:
                blocks = []
                for r in range(min(per, n - j * per)):
                    parent = BlockHash(digest(parent + pack(hash_ids[j], r * block_size, (r + 1) * block_size)))
                    blocks.append(parent)
                got = tuple(blocks)
                if memo is not None and key is not None:
                    memo[key] = got
            out.extend(got)
            parent = got[-1]
        return tuple(out)
    for i in range(n):
        lo, hi = i * block_size, (i + 1) * block_size
        content = bytearray(parent)
        for j in range(lo // bt, -(-hi // bt)):
            content += _SPAN.pack(hash_ids[j], max(lo, j * bt) - j * bt, min(hi, (j + 1) * bt) - j * bt)
        parent = BlockHash(xxhash.xxh3_128_digest(bytes(content)))
        out.append(parent)
    return tuple(out)


# -- events and results -------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks entered the prefix cache (vLLM's KV event): consecutive blocks of one request."""

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None  # None: the first block is the prompt's first
    req_id: str


@dataclasses.dataclass(frozen=True, slots=True)
class BlockRemoved:
    """A cached block was evicted (reused for new content)."""

    block_hashes: tuple[BlockHash, ...]


KVEvent = BlockStored | BlockRemoved


@dataclasses.dataclass(frozen=True, slots=True)
class ExternalHit:
    """Leading blocks the external pool supplies after the local hit, per tier (dram first),
    and ``tail_tokens`` past them (the prompt's trailing partial chunk, which the connector
    keys by its exact tokens) from ``tail_tier``: only after every block offered, and at
    most up to the prompt's last token less one (vLLM computes that one)."""

    dram: int = 0
    nvme: int = 0
    network: int = 0
    async_load: bool | None = None  # load while the engine steps on (None: the engine's ``async_load``)
    tail_tokens: int = 0
    tail_tier: Tier = "dram"

    @property
    def blocks(self) -> int:
        return self.dram + self.nvme + self.network

    @property
    def empty(self) -> bool:
        return not self.blocks and not self.tail_tokens

    def tokens(self, block_size: int) -> int:
        return self.blocks * block_size + self.tail_tokens

    def load_s(self, profile: EngineProfile) -> float:
        """Seconds to load them: one transfer per tier that supplies any, one after the other."""
        tail = self.tail_tokens * profile.kv_bytes_per_token
        return sum(
            profile.load_s(t, getattr(self, t) * profile.block_bytes + (tail if t == self.tail_tier else 0))
            for t in TIERS
        )


LookupExternal = Callable[[str, Sequence[BlockHash]], ExternalHit]
"""``(req_id, block hashes after the local hit) -> ExternalHit`` (at most that many blocks)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Admission:
    """A request that started computing this step, and what its prefix hit."""

    req_id: str
    cached_tokens: int  # local + external
    external_tokens: int
    load_s: float  # its external load (sync: inside this step; async: before it)


@dataclasses.dataclass(frozen=True, slots=True)
class RequestOutput:
    """A request that sampled a token this step."""

    req_id: str
    output_tokens: int  # sampled so far, this one included
    first_token: bool
    finished: bool  # it reached max_tokens and freed its blocks
    ttft_s: float | None  # on the first token: the step's end − arrival


@dataclasses.dataclass(frozen=True, slots=True)
class StepResult:
    start_s: float
    step_time_s: float  # forward pass (with jitter) + synchronous external loads
    load_s: float  # of which synchronous loads
    scheduled: tuple[tuple[str, int], ...]  # (req_id, tokens) in batch order
    prefill_tokens: int
    attention_pairs: int
    decode_tokens: int  # = sequences decoding
    decode_context_tokens: int
    cached_tokens: int  # prefix tokens of this step's admissions not computed (local + external)
    external_tokens: int
    admitted: tuple[Admission, ...]
    preempted: tuple[str, ...]
    outputs: tuple[RequestOutput, ...]
    kv_events: tuple[KVEvent, ...]  # in the order they happened
    loads_started: tuple[Admission, ...] = ()  # async loads begun this step (admitted when they end)

    @property
    def end_s(self) -> float:
        return self.start_s + self.step_time_s

    @property
    def idle(self) -> bool:
        return not self.scheduled

    @property
    def num_tokens(self) -> int:
        return self.prefill_tokens + self.decode_tokens


# -- the engine -----------------------------------------------------------------------------
class _Status(enum.Enum):
    WAITING = "waiting"
    LOADING = "waiting_for_remote_kvs"
    RUNNING = "running"


@dataclasses.dataclass(slots=True, eq=False)
class _Req:
    req_id: str
    arrival_s: float
    prompt_tokens: int
    max_tokens: int
    hashes: tuple[BlockHash, ...]
    status: _Status = _Status.WAITING
    num_computed: int = 0
    num_output: int = 0
    blocks: list[int] = dataclasses.field(default_factory=list)
    num_cached_blocks: int = 0  # leading blocks registered in (or hit from) the prefix cache
    in_prefill: bool = True
    ready_s: float = 0.0  # LOADING: when its load completes
    external: tuple[int, ExternalHit] | None = None  # the pool's answer, for that local hit
    hit_tokens: int = 0  # holding blocks for a load: its admission's cached and external tokens
    ext_tokens: int = 0
    ext_load_s: float = 0.0
    first_token_s: float | None = None

    @property
    def num_tokens(self) -> int:
        return self.prompt_tokens + self.num_output


class EngineModel:
    """vLLM v1's scheduler and prefix cache over a profile (see the module docstring)."""

    def __init__(
        self,
        profile: EngineProfile,
        *,
        rng: random.Random | None = None,
        lookup_external: LookupExternal | None = None,
        async_load: bool = False,
    ) -> None:
        if profile.jitter_cv > 0 and rng is None:
            raise InvalidArgument(
                f"profile {profile.name!r} has jitter_cv {profile.jitter_cv}: pass rng=random.Random(seed)"
            )
        self.profile = profile
        self._rng = rng
        self._lookup_external = lookup_external
        self._async_load = async_load
        self._bs = profile.block_size
        n = profile.num_gpu_blocks
        self._ref = [0] * n
        self._hash: list[BlockHash | None] = [None] * n
        self._free: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(range(1, n))
        self._cached: dict[BlockHash, dict[int, None]] = {}
        self._reqs: dict[str, _Req] = {}
        self._running: list[_Req] = []
        self._waiting: collections.deque[_Req] = collections.deque()
        self._holding: collections.deque[_Req] = collections.deque()  # hold blocks for a load
        self._events: list[KVEvent] = []
        self._now = -math.inf

    # -- requests -----------------------------------------------------------------------
    def add_request(
        self, req_id: str, prompt_tokens: int, block_hashes: Sequence[BlockHash], max_tokens: int, arrival_s: float
    ) -> None:
        """Queue a request (FCFS).  ``block_hashes``: the chained hashes of its leading full
        prompt blocks (:func:`engine_block_hashes`); blocks past the list are never shared."""
        if req_id in self._reqs:
            raise InvalidArgument(f"request {req_id!r} is already in the engine")
        if prompt_tokens <= 0 or max_tokens <= 0:
            raise InvalidArgument(f"request {req_id!r}: prompt_tokens and max_tokens must be positive")
        if len(block_hashes) > prompt_tokens // self._bs:
            raise InvalidArgument(
                f"request {req_id!r}: {len(block_hashes)} block hashes but {prompt_tokens} tokens make only "
                f"{prompt_tokens // self._bs} full blocks of {self._bs}"
            )
        need = _cdiv(prompt_tokens + max_tokens - 1, self._bs)
        if need > len(self._ref) - 1:
            raise InvalidArgument(
                f"request {req_id!r} needs {need} KV blocks, the engine has {len(self._ref) - 1}: "
                "raise num_gpu_blocks or shorten the request"
            )
        r = _Req(req_id, arrival_s, prompt_tokens, max_tokens, tuple(block_hashes))
        self._reqs[req_id] = r
        self._waiting.append(r)

    def add_trace_request(
        self,
        req_id: str,
        request: Request,
        *,
        trace_block_tokens: int = DEFAULT_BLOCK_TOKENS,
        salt: bytes = b"",
        arrival_s: float | None = None,
    ) -> None:
        """Queue a Mooncake trace request: its hash ids expanded to engine blocks, at least one
        output token, arriving at its timestamp (ms) unless ``arrival_s`` says otherwise."""
        hashes = engine_block_hashes(
            request.hash_ids,
            request.input_length,
            block_size=self._bs,
            trace_block_tokens=trace_block_tokens,
            salt=salt,
        )
        at = request.timestamp / 1000 if arrival_s is None else arrival_s
        self.add_request(req_id, request.input_length, hashes, max(1, request.output_length), at)

    def abort_request(self, req_id: str) -> bool:
        """Drop a request wherever it is (vLLM's abort: a client went away), freeing its blocks
        as a finished request's are (cached ones stay cached); False if it is not here."""
        req = self._reqs.pop(req_id, None)
        if req is None:
            return False
        if req in self._running:
            self._running.remove(req)
        elif req in self._holding:
            self._holding.remove(req)
        else:
            self._waiting.remove(req)
        self._free_blocks(req)
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block's hash (vLLM's ``reset_prefix_cache``): only when no
        request holds a block, else False and nothing changes.  The free queue keeps its
        order; the caller reports vLLM's ``AllBlocksCleared``."""
        if len(self._free) != len(self._ref) - 1:
            return False
        self._cached.clear()
        self._hash = [None] * len(self._ref)
        return True

    # -- queries ------------------------------------------------------------------------
    def has_work(self, now_s: float) -> bool:
        """Whether a step at ``now_s`` has requests it may schedule (allocation permitting)."""
        return bool(self._running or self._waiting) or any(
            r.status is not _Status.LOADING or r.ready_s <= now_s for r in self._holding
        )

    def next_ready_s(self) -> float | None:
        """When the earliest external load still running completes (None: no load running)."""
        return min((r.ready_s for r in self._holding if r.status is _Status.LOADING), default=None)

    @property
    def num_unfinished(self) -> int:
        return len(self._reqs)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Requests not running: queued, preempted, or holding blocks for an external load."""
        return len(self._waiting) + len(self._holding)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def kv_usage(self) -> float:
        """vLLM's KV cache usage: the share of blocks held by requests (cached free blocks are free)."""
        return 1.0 - len(self._free) / (len(self._ref) - 1)

    def lookup_prefix(self, block_hashes: Sequence[BlockHash]) -> int:
        """Leading blocks of ``block_hashes`` in the prefix cache now (touches nothing: for routers)."""
        n = 0
        for h in block_hashes:
            if h not in self._cached:
                break
            n += 1
        return n

    # -- the step -------------------------------------------------------------------------
    def step(self, now_s: float) -> StepResult:
        """Schedule and run one batch starting at ``now_s`` (see the module docstring)."""
        if now_s < self._now:
            raise InvalidArgument(f"step at {now_s} s after a step at {self._now} s: time went back")
        self._now = now_s
        self._events = []
        sched: list[tuple[_Req, int]] = []
        preempted: list[str] = []
        admitted: list[Admission] = []
        loading: list[Admission] = []
        budget = self._schedule_running(self.profile.max_num_batched_tokens, sched, preempted)
        sync_load_s = 0.0
        if not preempted and (self._waiting or self._holding):  # as vLLM: a step that preempted admits nobody
            sync_load_s = self._schedule_waiting(now_s, budget, sched, admitted, loading)

        prefill = pairs = cached_pairs = decode = context = 0
        for req, n in sched:
            c = req.num_computed
            if req.in_prefill:
                prefill += n
                pairs += n * (c + n)
                cached_pairs += n * c
            else:
                decode += 1
                context += c + 1
            req.num_computed = c + n
        forward_ms = self.profile.step_ms(prefill, pairs, decode, context, cached_pairs, len(admitted))
        if forward_ms > 0 and self._lookup_external is not None:  # the connector's own cost
            forward_ms += self.profile.connector_step_ms + self.profile.connector_request_ms * len(admitted)
        if forward_ms > 0 and self._rng is not None:
            forward_ms *= self.profile.jitter(self._rng)
        step_s = forward_ms / 1000 + sync_load_s
        end_s = now_s + step_s

        outputs: list[RequestOutput] = []
        for req, _ in sched:
            if req.num_computed < req.num_tokens:
                continue  # a chunk of a prefill: nothing sampled
            req.num_output += 1
            req.in_prefill = False
            first = req.first_token_s is None
            if first:
                req.first_token_s = end_s
            finished = req.num_output >= req.max_tokens
            if finished:
                self._finish(req)
            ttft = end_s - req.arrival_s if first else None
            outputs.append(RequestOutput(req.req_id, req.num_output, first, finished, ttft))

        return StepResult(
            start_s=now_s,
            step_time_s=step_s,
            load_s=sync_load_s,
            scheduled=tuple((r.req_id, n) for r, n in sched),
            prefill_tokens=prefill,
            attention_pairs=pairs,
            decode_tokens=decode,
            decode_context_tokens=context,
            cached_tokens=sum(a.cached_tokens for a in admitted),
            external_tokens=sum(a.external_tokens for a in admitted),
            admitted=tuple(admitted),
            preempted=tuple(preempted),
            outputs=tuple(outputs),
            kv_events=tuple(self._events),
            loads_started=tuple(loading),
        )

    def _schedule_running(self, budget: int, sched: list[tuple[_Req, int]], preempted: list[str]) -> int:
        """Running requests, in admission order; the budget left."""
        i = 0
        while i < len(self._running) and budget > 0:
            req = self._running[i]
            n = min(req.num_tokens - req.num_computed, budget)
            ok = self._allocate(req, req.num_computed, n)
            while not ok:  # preempt the most recently admitted, maybe req itself
                victim = self._running.pop()
                self._preempt(victim)
                preempted.append(victim.req_id)
                if victim is req:
                    break
                ok = self._allocate(req, req.num_computed, n)
            if not ok:
                break
            sched.append((req, n))
            budget -= n
            i += 1
        return budget

    def _schedule_waiting(
        self,
        now_s: float,
        budget: int,
        sched: list[tuple[_Req, int]],
        admitted: list[Admission],
        loading: list[Admission],
    ) -> float:
        """Waiting requests, those holding blocks for a load first; the synchronous loads' time."""
        sync_load_s = 0.0
        skipped_holding: list[_Req] = []
        while budget > 0 and len(self._running) < self.profile.max_num_seqs:
            queue = self._holding if self._holding else self._waiting
            if not queue:
                break
            req = queue[0]
            if req.status is _Status.LOADING:
                if now_s < req.ready_s:
                    skipped_holding.append(queue.popleft())
                    continue
                self._register(req, req.num_computed // self._bs)  # the loaded blocks enter the cache
                req.status = _Status.WAITING
            if req.blocks:  # its load is done: no lookup
                hits: list[int] = []
                computed, cached, ext_tokens, load_s = req.num_computed, req.hit_tokens, req.ext_tokens, 0.0
                load_async, ext_load_s = False, req.ext_load_s
            else:
                hits = self._local_hit(req)
                ext = self._external_hit(req, len(hits))
                ext_tokens = ext.tokens(self._bs)
                computed = cached = len(hits) * self._bs + ext_tokens
                load_async = (self._async_load if ext.async_load is None else ext.async_load) and not ext.empty
                load_s = ext_load_s = 0.0 if ext.empty else ext.load_s(self.profile)
            n = 0 if load_async else min(req.num_tokens - computed, budget)
            reserve = None
            if load_async:  # every load holding blocks, this one included, must be able to finish its prompt
                reserve = sum(self._prompt_blocks_left(r) for r in (*self._holding, *skipped_holding))
                reserve += _cdiv(req.num_tokens, self._bs) - _cdiv(computed, self._bs)
            if not self._allocate(req, computed, n, hits, reserve=reserve):
                break
            queue.popleft()
            req.external = None
            req.num_computed = computed
            if load_async:
                req.status, req.ready_s = _Status.LOADING, now_s + load_s
                req.hit_tokens, req.ext_tokens, req.ext_load_s = cached, ext_tokens, load_s
                loading.append(Admission(req.req_id, cached, ext_tokens, load_s))
                skipped_holding.append(req)
                continue
            req.status = _Status.RUNNING
            self._running.append(req)
            sync_load_s += load_s
            admitted.append(Admission(req.req_id, cached, ext_tokens, ext_load_s))
            sched.append((req, n))
            budget -= n
        self._holding.extendleft(reversed(skipped_holding))
        return sync_load_s

    # -- lookups --------------------------------------------------------------------------
    def _max_hit_blocks(self, req: _Req) -> int:
        return min(len(req.hashes), (req.num_tokens - 1) // self._bs)

    def _local_hit(self, req: _Req) -> list[int]:
        hits = []
        for h in req.hashes[: self._max_hit_blocks(req)]:
            copies = self._cached.get(h)
            if not copies:
                break
            hits.append(next(iter(copies)))
        return hits

    def _external_hit(self, req: _Req, local: int) -> ExternalHit:
        if self._lookup_external is None:
            return ExternalHit()
        if req.external is not None and req.external[0] == local:
            return req.external[1]  # asked already, for this local hit
        candidates = req.hashes[local : self._max_hit_blocks(req)]
        hit = self._lookup_external(req.req_id, candidates) if candidates else ExternalHit()
        tail_ok = hit.tail_tokens == 0 or (
            hit.blocks == len(candidates) and (local + hit.blocks) * self._bs + hit.tail_tokens < req.num_tokens
        )
        if min(hit.dram, hit.nvme, hit.network, hit.tail_tokens) < 0 or hit.blocks > len(candidates) or not tail_ok:
            raise InvalidArgument(
                f"lookup_external answered {hit} for request {req.req_id!r}, offered {len(candidates)} blocks "
                f"after {local} of a {req.num_tokens}-token request"
            )
        req.external = (local, hit)
        return hit

    def _prompt_blocks_left(self, req: _Req) -> int:
        return _cdiv(req.num_tokens, self._bs) - len(req.blocks)

    # -- the block pool -------------------------------------------------------------------
    def _allocate(
        self, req: _Req, computed: int, num_new: int, hits: Sequence[int] = (), *, reserve: int | None = None
    ) -> bool:
        """vLLM's ``allocate_slots``: blocks for ``computed + num_new`` tokens, the ``hits``
        touched first; False (nothing changed) when the free queue is too short.  ``reserve``
        (an async load): blocks that must stay free besides; the new blocks are then cached
        only when the load completes."""
        upto = computed + num_new
        need = -(-upto // self._bs) - len(req.blocks) - len(hits)
        if need <= 0 and not hits and reserve is None:  # a decode inside its last block: the common step
            if req.num_cached_blocks < len(req.hashes):
                self._register(req, min(len(req.hashes), upto // self._bs))
            return True
        evictable = sum(1 for b in hits if self._ref[b] == 0) if hits else 0
        if max(need, 0) + evictable + (reserve or 0) > len(self._free):
            return False
        for b in hits:
            if self._ref[b] == 0:
                del self._free[b]
            self._ref[b] += 1
            req.blocks.append(b)
        if hits:
            req.num_cached_blocks = len(hits)
        if need > 0:
            removed: list[BlockHash] = []
            for _ in range(need):
                b, _none = self._free.popitem(last=False)
                h = self._hash[b]
                if h is not None:
                    copies = self._cached[h]
                    del copies[b]
                    if not copies:
                        del self._cached[h]
                    self._hash[b] = None
                    removed.append(h)
                self._ref[b] = 1
                req.blocks.append(b)
            if removed:
                self._events.append(BlockRemoved(tuple(removed)))
        if reserve is None:
            self._register(req, min(len(req.hashes), (computed + num_new) // self._bs))
        return True

    def _register(self, req: _Req, upto: int) -> None:
        """Cache the request's blocks ``[num_cached_blocks, upto)`` under their hashes."""
        start = req.num_cached_blocks
        if upto <= start:
            return
        for i in range(start, upto):
            b, h = req.blocks[i], req.hashes[i]
            self._hash[b] = h
            self._cached.setdefault(h, {})[b] = None
        req.num_cached_blocks = upto
        parent = req.hashes[start - 1] if start else None
        self._events.append(BlockStored(req.hashes[start:upto], parent, req.req_id))

    def _free_blocks(self, req: _Req) -> None:
        first: list[int] = []
        for b in reversed(req.blocks):  # the tail is evicted first
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if self._hash[b] is None:
                    first.append(b)
                else:
                    self._free[b] = None  # LRU: at the tail
        for b in reversed(first):  # uncached blocks are reused first (LIFO), in this order
            self._free[b] = None
            self._free.move_to_end(b, last=False)
        req.blocks = []
        req.num_cached_blocks = 0

    def _preempt(self, req: _Req) -> None:
        self._free_blocks(req)
        req.status, req.num_computed, req.in_prefill, req.external = _Status.WAITING, 0, True, None
        self._waiting.appendleft(req)

    def _finish(self, req: _Req) -> None:
        self._running.remove(req)
        self._free_blocks(req)
        del self._reqs[req.req_id]

    # -- invariants (tests) ---------------------------------------------------------------
    def check(self) -> None:
        """Assert the invariants of the module docstring."""
        refs = [0] * len(self._ref)
        for r in self._reqs.values():
            for b in r.blocks:
                refs[b] += 1
            if r.status is _Status.WAITING and r not in self._holding:
                assert not r.blocks and r.num_computed == 0, r
            else:
                assert len(r.blocks) == _cdiv(r.num_computed, self._bs), r
        assert refs == self._ref, "ref counts"
        assert all((self._ref[b] == 0) == (b in self._free) for b in range(1, len(self._ref))), "free queue"
        assert 0 not in self._free and self._ref[0] == 0, "the null block"
        for h, copies in self._cached.items():
            assert copies and all(self._hash[b] == h for b in copies), "hash map"
        assert sum(len(c) for c in self._cached.values()) == sum(h is not None for h in self._hash), "hashed blocks"
        assert len(self._running) <= self.profile.max_num_seqs
        assert {r.req_id for r in self._running} | {r.req_id for r in self._waiting} | {
            r.req_id for r in self._holding
        } == set(self._reqs), "queues"

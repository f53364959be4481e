"""A simulated engine in real time: :class:`~kvstore.sim.engine.EngineModel` stepped by an
asyncio task against the monotonic clock, for mock engines (``kvstore sim serve``).

:class:`LiveEngine` owns the model, every request in it, the KV-event publisher and the
engine's Prometheus metrics; all of it belongs to one asyncio loop (the HTTP server's),
so nothing takes a lock.  HTTP handlers :meth:`~LiveEngine.submit` requests, read their
tokens from :meth:`~LiveEngine.outputs` and :meth:`~LiveEngine.abort` them when the client
goes away; the step task (:meth:`~LiveEngine.run`) is the only caller of ``step``.

The clock: the model's time is the loop's monotonic time since start, times ``speed``.
A step starts now, and its outputs are delivered when its ``step_time_s`` (divided by
``speed``) has passed: a request's first token reaches its stream at the end of the step
that finished its prompt, as vLLM's does.  Requests that arrive during a step wait for the
next.  With nothing to run the task sleeps until a request arrives.

Per step, in order: the step's KV events are published as one batch (after the step, as
vLLM's engine core publishes them), then its outputs go to their streams.  A prompt's
blocks are hashed by content (:func:`prompt_block_hashes`: the engine model's chained
xxh3-128 over each full block's token ids, from a root salted with the served model's
name), so identical prompts share blocks and the published ``BlockStored`` carries the
blocks' token ids, which is what the conductor indexes.

With a :class:`~kvstore.sim.live_pool.PoolLink` (``kvstore sim serve --kv-node``), the model's
``lookup_external`` is the link's, and each step tells it what started (loads, after
``step``) and what was computed (saves, when the step's time has passed); the link owns
everything about the node.  Its counters join the engine's metrics, and the prompt tokens
the pool supplied count as vLLM counts them (``prompt_tokens_by_source{source=
"external_kv_transfer"}``, ``external_prefix_cache_hits``).

Invariants: a submission is in ``_subs`` from :meth:`submit` until it finished or was
aborted, exactly while the model has it (and the link has its record); its queue receives its tokens in order and then
one end marker (``None``); a failed step loop ends every open stream with an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import random
import struct
import time
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

import xxhash
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from kvstore.errors import InvalidArgument
from kvstore.sim import kvevents_pub
from kvstore.sim.engine import BlockHash, BlockRemoved, BlockStored, EngineModel, StepResult, root_hash
from kvstore.sim.openai import output_token, prompt_digest
from kvstore.sim.profile import EngineProfile

if TYPE_CHECKING:
    from kvstore.sim.live_pool import PoolLink

log = logging.getLogger("kvstore.sim")

IDLE_RETRY_S = 0.005
"""A step that could schedule nothing (blocks held elsewhere) is retried after this long."""


def prompt_block_hashes(tokens: Sequence[int], block_size: int, salt: bytes = b"") -> tuple[BlockHash, ...]:
    """The chained hashes of a prompt's full blocks: ``h_i = xxh3_128(h_{i-1} || tokens_i)``,
    tokens as little-endian uint32, ``h_{-1}`` the engine model's :func:`root_hash` of ``salt``."""
    if block_size <= 0:
        raise InvalidArgument(f"block_size must be positive, got {block_size}")
    raw = struct.pack(f"<{len(tokens)}I", *tokens)
    parent = root_hash(salt)
    out = []
    step = block_size * 4
    for i in range(len(tokens) // block_size):
        parent = BlockHash(xxhash.xxh3_128_digest(parent + raw[i * step : (i + 1) * step]))
        out.append(parent)
    return tuple(out)


@dataclasses.dataclass(slots=True, eq=False)
class Submission:
    """One request in the engine, and what its stream needs to know."""

    req_id: str
    tokens: tuple[int, ...]
    max_tokens: int
    digest: int
    index: dict[BlockHash, int]  # its block hashes → block position (for BlockStored's token ids)
    arrival: float  # the loop's monotonic clock
    queue: asyncio.Queue[int | None]
    cached_tokens: int = 0  # at its (last) admission
    external_tokens: int = 0  # of which the pool supplied
    admitted_at: float | None = None
    first_at: float | None = None
    sent: int = 0  # tokens queued
    error: str | None = None  # the engine failed it
    done: bool = False


class _Metrics:
    """vLLM's metric names (``vllm/v1/metrics/loggers.py``), labelled as vLLM labels them."""

    def __init__(self, model: str, live: LiveEngine) -> None:
        r = self.registry = CollectorRegistry()
        lab = {"model_name": model, "engine": "0"}
        names = list(lab)

        def gauge(name: str, doc: str, fn: Any) -> None:
            Gauge(name, doc, names, registry=r).labels(**lab).set_function(fn)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, names, registry=r).labels(**lab)

        def hist(name: str, doc: str, buckets: Sequence[float]) -> Any:
            return Histogram(name, doc, names, buckets=buckets, registry=r).labels(**lab)

        # vLLM's cache_config_info: its cache config as labels (what `kvstore sim calibrate --served` reads)
        Info("vllm:cache_config", "Information of the LLMEngine CacheConfig", ["engine"], registry=r).labels(
            engine="0"
        ).info({"block_size": str(live.profile.block_size), "num_gpu_blocks": str(live.profile.num_gpu_blocks)})
        gauge("vllm:num_requests_running", "Requests in model execution batches", lambda: live.model.num_running)
        gauge("vllm:num_requests_waiting", "Requests waiting to be processed", lambda: live.model.num_waiting)
        gauge("vllm:kv_cache_usage_perc", "KV-cache usage (1 = 100 %)", lambda: live.model.kv_usage)
        self.queries = counter("vllm:prefix_cache_queries", "Prefix cache queries, in tokens")
        self.hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in tokens")
        self.prompt = counter("vllm:prompt_tokens", "Prefill tokens processed")
        self.generation = counter("vllm:generation_tokens", "Generation tokens processed")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative preemptions")
        by_source = Counter("vllm:prompt_tokens_by_source", "Prompt tokens by source", [*names, "source"], registry=r)
        self.by_source = {s: by_source.labels(**lab, source=s) for s in ("local_cache_hit", "local_compute")}
        self.by_source["external_kv_transfer"] = by_source.labels(**lab, source="external_kv_transfer")
        self.ext_queries = counter("vllm:external_prefix_cache_queries", "External prefix cache queries, in tokens")
        self.ext_hits = counter("vllm:external_prefix_cache_hits", "External prefix cache hits, in tokens")
        if live.pool is not None:  # the kvstore connector's counters (vllm:kvstore_*_total)
            r.register(live.pool.collector(lab))
        success = Counter("vllm:request_success", "Requests finished", [*names, "finished_reason"], registry=r)
        self.success = success.labels(**lab, finished_reason="length")
        tok = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
        sec = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80)
        self.iteration = hist("vllm:iteration_tokens_total", "Tokens per engine step", tok)
        self.req_prompt = hist("vllm:request_prompt_tokens", "Prompt tokens per finished request", tok)
        self.req_gen = hist("vllm:request_generation_tokens", "Generated tokens per finished request", tok)
        self.computed = hist(
            "vllm:request_prefill_kv_computed_tokens", "Prompt tokens computed (not cached) per request", tok
        )
        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token", sec)
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between tokens", sec)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "End-to-end request latency", sec)
        self.queue = hist("vllm:request_queue_time_seconds", "Time waiting before admission", sec)
        self.prefill = hist("vllm:request_prefill_time_seconds", "Admission to first token", sec)
        self.decode = hist("vllm:request_decode_time_seconds", "First token to the last", sec)


class LiveEngine:
    """See the module docstring.  Make it on the loop that serves it; :meth:`start` the step task."""

    def __init__(
        self,
        profile: EngineProfile,
        *,
        model_name: str,
        vocab: int,
        seed: int = 0,
        speed: float = 1.0,
        publisher: kvevents_pub.KVEventPublisher | None = None,
        pool: PoolLink | None = None,
    ) -> None:
        if not speed > 0:
            raise InvalidArgument(f"speed must be positive, got {speed}")
        self.profile = profile
        self.pool = pool
        lookup = pool.lookup_external if pool is not None else None
        self.model = EngineModel(profile, rng=random.Random(seed), lookup_external=lookup)
        self.model_name = model_name
        self.vocab = vocab
        self.speed = speed
        self.publisher = publisher
        self.metrics = _Metrics(model_name, self)
        self.failed: str | None = None  # why the step task died (the engine is unhealthy)
        self._salt = model_name.encode()
        self._subs: dict[str, Submission] = {}
        self._aborted: dict[str, Submission] = {}  # aborted since the running step began: its events may name them
        self._ids = itertools.count()
        self._wake = asyncio.Event()
        self._t0 = time.monotonic()
        self._task: asyncio.Task[None] | None = None
        self.steps = 0

    # -- lifecycle
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.run(), name="sim-engine-steps")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.publisher is not None:
            await self.publisher.close()

    def _now(self) -> float:
        return (time.monotonic() - self._t0) * self.speed

    # -- requests
    def submit(self, tokens: Sequence[int], max_tokens: int, *, prefix: str = "req") -> Submission:
        """Queue a request; InvalidArgument if the engine could never hold it (or has failed)."""
        if self.failed is not None:
            raise InvalidArgument(f"the engine has failed: {self.failed}")
        hashes = prompt_block_hashes(tokens, self.profile.block_size, self._salt)
        rid = f"{prefix}-{next(self._ids)}"
        self.model.add_request(rid, len(tokens), hashes, max_tokens, self._now())
        if self.pool is not None:
            self.pool.arrived(rid, tokens, hashes)
        sub = Submission(
            rid,
            tuple(tokens),
            max_tokens,
            prompt_digest(tokens),
            {h: i for i, h in enumerate(hashes)},
            time.monotonic(),
            asyncio.Queue(),
        )
        self._subs[rid] = sub
        self._wake.set()
        return sub

    def abort(self, sub: Submission) -> None:
        """The client went away: the request leaves the engine (no-op once it finished)."""
        if not sub.done:
            sub.done = True
            self._subs.pop(sub.req_id, None)
            self._aborted[sub.req_id] = sub
            self.model.abort_request(sub.req_id)
            if self.pool is not None:
                self.pool.forget(sub.req_id)

    async def outputs(self, sub: Submission) -> AsyncIterator[int]:
        """Its generated token ids, each as its step ends; raises RuntimeError if the engine failed."""
        while True:
            t = await sub.queue.get()
            if t is None:
                if sub.error is not None:
                    raise RuntimeError(sub.error)
                return
            yield t

    def reset_prefix_cache(self) -> bool:
        """vLLM's ``/reset_prefix_cache``: False (nothing changes) while requests hold blocks."""
        if not self.model.reset_prefix_cache():
            return False
        if self.publisher is not None:
            self.publisher.publish([kvevents_pub.all_blocks_cleared()])
        return True

    # -- the step task
    async def run(self) -> None:
        try:
            while True:
                now = self._now()
                if not self.model.has_work(now):
                    self._wake.clear()
                    ready = self.model.next_ready_s()  # an asynchronous load completing
                    wait = None if ready is None else max(0.0, (ready - now) / self.speed)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), wait)
                    continue
                started = time.monotonic()
                res = self.model.step(self._now())
                if self.pool is not None:
                    self.pool.step_started(res)
                if res.idle:
                    await asyncio.sleep(IDLE_RETRY_S)
                    continue
                self.steps += 1
                delay = started + res.step_time_s / self.speed - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                self._deliver(res, started)
                self._aborted.clear()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # every stream hears it; /health turns 500
            log.exception("the engine's step loop failed")
            self.failed = f"{type(e).__name__}: {e}"
            for sub in self._subs.values():
                sub.error, sub.done = f"the engine failed: {self.failed}", True
                sub.queue.put_nowait(None)
            self._subs.clear()

    def _deliver(self, res: StepResult, started: float) -> None:
        """The step's results, at its end; ``started``: when it began (the loop's clock)."""
        m = self.metrics
        now = time.monotonic()
        m.iteration.observe(res.num_tokens)
        if res.preempted:
            m.preemptions.inc(len(res.preempted))
        if res.kv_events and self.publisher is not None:
            self.publisher.publish([self._event(ev) for ev in res.kv_events])
        if self.pool is not None:
            self.pool.step_ended(res)
        for adm in res.admitted:
            sub = self._subs.get(adm.req_id)
            if sub is None:
                continue
            m.queries.inc(len(sub.tokens))
            m.hits.inc(adm.cached_tokens)
            if self.pool is not None:
                m.ext_queries.inc(len(sub.tokens) - (adm.cached_tokens - adm.external_tokens))
                m.ext_hits.inc(adm.external_tokens)
            if sub.admitted_at is None:
                m.queue.observe(max(0.0, started - sub.arrival))
            sub.admitted_at, sub.cached_tokens, sub.external_tokens = started, adm.cached_tokens, adm.external_tokens
        for out in res.outputs:
            sub = self._subs.get(out.req_id)
            if sub is None:
                continue
            if out.first_token:
                sub.first_at = now
                n, hit, ext = len(sub.tokens), sub.cached_tokens, sub.external_tokens
                m.prompt.inc(n)
                m.by_source["local_cache_hit"].inc(hit - ext)
                m.by_source["external_kv_transfer"].inc(ext)
                m.by_source["local_compute"].inc(n - hit)
                m.ttft.observe(now - sub.arrival)
                m.prefill.observe(now - (sub.admitted_at or sub.arrival))
            else:
                m.itl.observe(res.step_time_s / self.speed)
            m.generation.inc()
            sub.queue.put_nowait(output_token(sub.digest, sub.sent, self.vocab))
            sub.sent += 1
            if out.finished:
                self._finished(sub, now)

    def _finished(self, sub: Submission, now: float) -> None:
        m = self.metrics
        m.success.inc()
        m.req_prompt.observe(len(sub.tokens))
        m.req_gen.observe(sub.sent)
        m.computed.observe(len(sub.tokens) - sub.cached_tokens)
        m.e2e.observe(now - sub.arrival)
        m.decode.observe(now - (sub.first_at or now))
        sub.done = True
        del self._subs[sub.req_id]
        if self.pool is not None:
            self.pool.forget(sub.req_id)
        sub.queue.put_nowait(None)

    def _event(self, ev: BlockStored | BlockRemoved) -> dict[str, Any]:
        if isinstance(ev, BlockRemoved):
            return kvevents_pub.block_removed(ev.block_hashes)
        # stores come from requests the step scheduled: here still, or aborted during the step
        sub = self._subs.get(ev.req_id) or self._aborted[ev.req_id]
        bs = self.profile.block_size
        start = 0 if ev.parent_block_hash is None else sub.index[ev.parent_block_hash] + 1
        tokens = sub.tokens[start * bs : (start + len(ev.block_hashes)) * bs]
        return kvevents_pub.block_stored(ev.block_hashes, ev.parent_block_hash, tokens, bs)

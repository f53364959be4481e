"""The connector's scheduler half: lookups and per-request bookkeeping (scheduler process only).

It owns no KV bytes.  For each request it keeps the live ``Request`` (vLLM appends the
generated tokens to it), the request's block table as vLLM hands it out step by step, and
three counts, each in tokens or leading chunks of the request's tokens:

* ``local_tokens``: what vLLM's own prefix cache supplied at the last lookup (vLLM passes
  it to ``get_num_new_matched_tokens``; it sets ``request.num_computed_tokens`` only
  *after* ``update_state_after_alloc``, so the count is kept here, not read back);
* the load: tokens ``[local_tokens, local_tokens + external)``, nothing below;
* ``saved_chunks``: leading chunks stored already or whose save was issued.  Each step
  the chunks the step completes (prompt chunks as chunked prefill computes them and,
  with ``save_decode``, chunks the decode fills) are saved from ``saved_chunks`` on.  A
  preemption sets it back to 0 (the worker cancels the saves still copying; what did
  commit is found by the resumed request's lookup, the rest is saved again).

Nothing slow runs on vLLM's scheduler thread.  With ``lookups="view"`` (the default) a
request's lookup is answered at once from the pool's in-process view
(:mod:`gpu_agent.vllm.view`: every node streams what it holds), with no store call: a miss
is 0, a hit is planned and confirmed by the node at load time.  The one exception is a
decode engine's request that carries its producer's handoff: it asks the store (the node
says what is committed, whatever the view's lag) and is the only request told "not yet",
while the handoff is still being committed.  With
``lookups="rpc"`` (or where the nodes refuse the view the admin's stream) every store call
goes through :class:`~gpu_agent.vllm.storelink.StoreLink`'s own thread.  A request's lookup is asked
once and its answer kept until vLLM allocates for it (vLLM asks again on every step a
request waits; a hit for at most ``ANSWER_TTL_S``, a miss for as long as the request waits:
a request queued behind others would otherwise pay a step for a second lookup that
almost always misses again).  A scheduling pass waits for answers within
one budget (:mod:`gpu_agent.vllm.pacing`: ``lookup_wait_ms``, or optionally a share of the
engine's step time and more on an idle engine); past it the scheduler answers vLLM ``None``
("not yet") and takes the answer at a later ask, giving up (a miss) after ``deadline_s``.
"Not yet" costs the request a step, so on a busy engine a request whose class of lookups
is measured not to find enough to pay for that step is computed at once instead, and one
whose class finds less than a lookup costs is not looked up at all, but for probes
(:mod:`gpu_agent.vllm.patience`, ``lookup_odds``).  What is saved follows ``save_policy``
(:mod:`gpu_agent.vllm.admission`; under ``evidence``, the default, from the engine's own
node's read-back counters, polled on the store link's thread every ``READ_BACK_EVERY_S``
and taken in when answered, never waited for), what is loaded the load gate
(:mod:`gpu_agent.vllm.gate`).

Invariants: a chunk counts as stored only when every tensor/pipeline rank's shard is
(lookups ask for each rank's keys and take the shortest run); a request held for its
saves (``request_finished`` → True) is one every worker reports finished (the workers
record every save, started or not); a store that fails is not asked again for
``retry_s``, and the waits of one scheduling pass add up to at most its budget.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import KVCacheEvent
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from gpu_agent.vllm import admission, patience
from gpu_agent.vllm.events import KVStoreEvents, StoredChunks
from gpu_agent.vllm.gate import LoadGate, background_kinds
from gpu_agent.vllm.metadata import KVStoreMeta, LoadSpec, SaveSpec
from gpu_agent.vllm.pacing import WaitBudget
from gpu_agent.vllm.prefetcher import Prefetcher
from gpu_agent.vllm.settings import ConnectorSettings
from gpu_agent.vllm.spec import EngineSpec, all_ranks, rank_namespace, request_namespace, request_session, unkeyable
from gpu_agent.vllm.stats import SCHEDULER_KEYS, SCHEDULER_PHASES, KVStoreStats, Timings, delta
from gpu_agent.vllm.storelink import READ_BACK_EVERY_S, LookupAnswer, StoreLink
from gpu_agent.vllm.view import ViewLookups
from kvstore.errors import DeadlineExceeded, KVStoreError
from kvstore.keys import Namespace, chunk_keys, tail_key

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

TIER_SOURCE = {"dram": CacheHitSource.HOST, "nvme": CacheHitSource.DISK, "hbm": CacheHitSource.HOST}
HANDOFF_POLL_S = 0.01
"""How often a request waiting for its producer's chunks asks the store again."""
ANSWER_TTL_S = 1.0
"""How long a request's lookup hit is reused while vLLM keeps asking (it waits for space or
budget): its chunks may have been evicted since.  A miss is kept while the request waits."""


@dataclasses.dataclass
class _Req:
    request: Any  # vLLM's live Request: all_token_ids grows as it decodes
    namespace: Namespace  # rank 0's; workers key their own rank
    session_id: str | None
    skip: str | None  # why it is never loaded or saved (unkeyable), or None
    block_ids: list[int] = dataclasses.field(default_factory=list)
    local_tokens: int = 0
    external_tokens: int = 0
    found_chunks: int = 0  # leading full chunks the last lookup found (every rank's shard)
    tiers: list[str] = dataclasses.field(default_factory=list)
    saved_chunks: int = 0
    tail_saved: bool = False  # the prompt's trailing partial chunk (keyed by its exact tokens)
    saves: int = 0
    wait_until: float = 0.0  # the handoff's deadline (0: not waiting)
    next_ask: float = 0.0
    async_load: bool = False  # the last hit loads in the background (vLLM's load_kv_async)
    plan: admission.SavePlan = admission.SavePlan()  # what it may store (save_policy)
    sighted: bool = False  # its chunks were counted in the sightings sketch
    answer: LookupAnswer | None = None  # the last lookup's answer, kept until vLLM allocates
    answer_key: tuple[int, int] = (-1, -1)  # (first chunk asked, tokens) it answers
    answer_at: float = 0.0
    answer_fresh: bool = False  # collected and not yet used by an ask
    pending: concurrent.futures.Future[LookupAnswer] | None = None  # a lookup in flight
    pending_key: tuple[int, int] = (-1, -1)
    pending_since: float = 0.0
    sched_s: float = 0.0  # the scheduler thread's connector time for it
    kind: str = "local"  # where the last hit's chunks are: local, nvme, remote (the load gate's kinds)
    from_view: bool = False  # the last answer came from the pool's view
    load_blocks: frozenset[int] = frozenset()  # the engine blocks its last planned load writes
    load_failed: bool = False  # a load of it failed: it computes the rest itself, never loads again
    cls: str = "seen"  # its class of lookups (gpu_agent.vllm.patience), set when it is sighted
    given_up: bool = False  # computed without waiting for its pending lookup (its answer is still taken)
    asks: bool | None = None  # whether it is looked up at all (lookup_odds; None: not decided yet)


class SchedulerSide:
    """Lookups and per-request bookkeeping (see the module docstring)."""

    def __init__(
        self,
        spec: EngineSpec,
        settings: ConnectorSettings,
        chunk: int,
        *,
        produce: bool,
        consume: bool,
        events: bool = False,
    ) -> None:
        self.spec, self.settings, self.chunk = spec, settings, chunk
        self.produce, self.consume = produce, consume
        self.ranks = all_ranks(spec)
        self.link = StoreLink(settings, self.ranks)  # every store call, on its own thread
        # lookups from the pool's view (lookups="view"): no store call, no "not yet"
        self.view = ViewLookups(settings, self.ranks) if consume and settings.lookups == "view" else None
        # queued requests' remote chunks pulled while they wait (prefetch: needs the view)
        self.prefetcher = (
            Prefetcher(settings, self.ranks, chunk)
            if self.view is not None and settings.prefetch and settings.lookup_target
            else None
        )
        self._reqs: dict[str, _Req] = {}
        self._loads: dict[str, LoadSpec] = {}
        self._events: KVStoreEvents | None = None
        self.stored = StoredChunks(settings.events_resync_s if events and produce else 0.0)
        self._resync: tuple[Any, concurrent.futures.Future[list[str | None]]] | None = None
        self._down_until = 0.0  # lookups resume then (a store call failed)
        self.sightings = admission.Sightings()
        self.evidence = admission.Evidence()  # save_policy evidence: the node's read-back counters
        self._read_back: concurrent.futures.Future[list[dict[str, Any]]] | None = None  # a poll in flight
        self._read_back_at = 0.0  # the next poll is due then
        self.gate = LoadGate(settings.load_gate)
        self._batch = 0  # requests the last step ran (the gate weighs a recompute by the batch it holds up)
        self.odds = patience.HitOdds()
        self._given_up: list[tuple[_Req, int, float, concurrent.futures.Future[LookupAnswer]]] = []
        self.budget = WaitBudget(
            settings.lookup_wait_ms / 1e3, settings.lookup_wait_step, settings.lookup_idle_wait_ms / 1e3
        )
        self.counters: dict[str, int] = {k: 0 for k in SCHEDULER_KEYS}
        self.timings = Timings(SCHEDULER_PHASES)
        self._reported: dict[str, int] = {}

    # -- the store ----------------------------------------------------------------------
    def _viewing(self) -> bool:
        """Lookups are answered from the pool's view (not refused its stream)."""
        return self.view is not None and not self.view.refused

    def _store_failed(self, e: Exception, what: str) -> None:
        self.counters["lookup_errors"] += 1
        if isinstance(e, KVStoreError):
            log.warning("kvstore %s failed (%s); serving without the store for %.0f s", what, e, self.settings.retry_s)
        else:  # not the store's answer: a bug here or in the SDK; the engine goes on without the store
            log.error(
                "kvstore %s raised; serving without the store for %.0f s", what, self.settings.retry_s, exc_info=e
            )
        self._down_until = time.monotonic() + self.settings.retry_s

    def _answer(self, r: _Req, tokens: list[int], first: int, *, patience: str) -> LookupAnswer | None:
        """The lookup of ``tokens`` from chunk ``first`` on: kept from an earlier ask (or the
        one :meth:`on_new_request` started from chunk 0, when it covers ``first``), or asked now and
        waited on within the pass's budget; None: not answered yet.  ``patience`` (see
        :meth:`_patience`) other than ``step``: a lookup not answered in time is answered as
        a miss, and its answer is still taken when it lands."""
        n = len(tokens)
        if r.pending is not None and r.pending_key[1] == n and r.pending_key[0] in (0, first):
            if not self._collect(r, wait=patience != "none"):
                return self._give_up(r, patience == "step")
        ans = self._usable(r, first, n)
        if ans is not None:
            return ans
        r.pending = self.link.lookup(tokens, r.namespace, first, r.session_id)
        r.pending_key, r.pending_since = (first, n), time.monotonic()
        self.counters["lookups"] += 1
        if not self._collect(r, wait=patience != "none"):
            return self._give_up(r, patience == "step")
        return self._usable(r, first, n)

    def _give_up(self, r: _Req, patient: bool) -> LookupAnswer | None:
        """A lookup not answered in time: "not yet" (None) for a patient ask, else a miss now."""
        if patient:
            self.counters["lookup_pending"] += 1
            return None
        if not r.given_up:
            r.given_up = True
            self.counters["lookup_given_up"] += 1
        return LookupAnswer()

    def _patience(self, r: _Req, handoff: bool) -> str:
        """How long a request's lookup is waited for: ``step`` (the pass's budget, then a
        step: "not yet"), ``pass`` (the pass's budget, then a miss) or ``none`` (a miss
        unless answered already).  ``step`` for a producer's handoff, and where
        :class:`~gpu_agent.vllm.patience.HitOdds` measures the class worth it against the
        step interval (on an idle engine: the lookup's own latency), else ``none``; a class
        not measured yet gets ``step``, but for ``new`` prompts (``pass``: a never-seen,
        unhinted prompt earns a step's wait only by measured hits)."""
        if handoff or not self.settings.lookup_odds:
            return "step"
        if self.odds.expected_tokens(r.cls) is None:
            return "pass" if r.cls == "new" else "step"
        recompute = self.gate.recompute.per_token(self.gate.min_samples)
        idle = self.budget.idle(time.monotonic())
        cost = self.odds.lookup_s if idle else self.budget.interval_s
        return "step" if self.odds.worth_waiting(r.cls, recompute, cost) else "none"

    def _asks(self, r: _Req, handoff: bool) -> bool:
        """Whether the request is looked up at all, decided once: always for a producer's
        handoff; else unless its class is measured to find less than the lookup costs
        (:meth:`~gpu_agent.vllm.patience.HitOdds.worth_asking`, which still probes)."""
        if handoff or not self.settings.lookup_odds:
            return True
        if r.asks is None:
            r.asks = self.odds.worth_asking(r.cls, self.gate.recompute.per_token(self.gate.min_samples))
            if not r.asks:
                self.counters["lookups_skipped"] += 1
        return r.asks

    def _observe(self, r: _Req, asked: int, ans: LookupAnswer) -> None:
        """Count a lookup's outcome for its class: the tokens it found beyond vLLM's own cache."""
        if ans.error is None:
            found = (asked + ans.found) * self.chunk - r.local_tokens
            self.odds.observe(r.cls, max(0, min(found, int(r.request.num_tokens) - 1 - r.local_tokens)))

    def _take_given_up(self) -> None:
        """The answers of lookups the scheduler stopped waiting for, as they land (outcomes)."""
        if not self._given_up:
            return
        now, keep = time.monotonic(), []
        for r, asked, since, fut in self._given_up:
            if fut.done():
                if not fut.cancelled() and fut.exception() is None:
                    ans = fut.result()
                    if ans.error is None:
                        self._observe(r, asked, ans)
                        self.odds.observe_latency(ans.seconds)
                        self.odds.observe_cost(ans.cpu_seconds)
            elif now - since < self.settings.deadline_s:
                keep.append((r, asked, since, fut))
        self._given_up = keep

    def _collect(self, r: _Req, *, wait: bool = True) -> bool:
        """Take the pending lookup's answer (True), waiting for it within the pass's budget
        (not at all without ``wait``), or count it still pending (False); past
        ``deadline_s`` it is given up and answered as a failure."""
        assert r.pending is not None
        now = time.monotonic()
        left = self.settings.deadline_s - (now - r.pending_since)
        timeout = max(0.0, min(self.budget.allowance(now), left)) if wait else 0.0
        ans: LookupAnswer | None
        try:
            ans = r.pending.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            ans = None
        self.budget.spend(time.monotonic() - now)
        if ans is None:
            if time.monotonic() - r.pending_since < self.settings.deadline_s:
                return False
            r.pending.cancel()
            self.counters["lookup_timeouts"] += 1
            ans = LookupAnswer(error=DeadlineExceeded(f"lookup not answered in {self.settings.deadline_s} s"))
        self.counters["lookup_us"] += int(ans.seconds * 1e6)
        if ans.error is None:
            self.timings.add("store_lookup", ans.seconds)
            self.odds.observe_latency(ans.seconds)
            self.odds.observe_cost(ans.cpu_seconds)
            self._observe(r, r.pending_key[0], ans)
        r.answer, r.answer_key, r.answer_at, r.answer_fresh = ans, r.pending_key, time.monotonic(), True
        r.pending = None
        return True

    def _usable(self, r: _Req, first: int, n: int) -> LookupAnswer | None:
        """The kept answer, if it answers an ask from chunk ``first`` of ``n`` tokens: its own,
        or one from chunk 0 that found at least ``first`` chunks (its suffix)."""
        ans = r.answer
        if ans is None or r.answer_key[1] != n:
            return None
        asked = r.answer_key[0]
        miss = ans.error is None and ans.found == 0 and asked == first
        if not miss and time.monotonic() >= r.answer_at + ANSWER_TTL_S:
            return None  # a hit may have been evicted since: asked again
        if asked != first and not (asked == 0 and ans.error is None and ans.found >= first):
            return None
        if not r.answer_fresh:
            self.counters["lookups_cached"] += 1
        r.answer_fresh = False
        if asked == first or ans.error is not None:
            return ans
        return LookupAnswer(ans.found - first, ans.tiers[first:], ans.local[first:], ans.seconds)

    def on_new_request(self, request: Request) -> None:
        """vLLM added a request: its chunks are sighted and its lookup (from chunk 0: vLLM's
        own cache is not asked yet) starts now, so it is answered by the time it is scheduled."""
        if not self.consume:
            return
        t0 = time.perf_counter()
        r = self._track(request)
        try:
            if r.skip is not None or time.monotonic() < self._down_until:
                return
            tokens = list(request.all_token_ids)
            if self.produce and not r.sighted:
                self._sight(r, tokens)
            if self._viewing():
                self._prefetch(r, tokens)
                return  # answered from the view when vLLM asks: nothing to start
            if tokens and self._asks(r, self._handoff_tokens(request, r.namespace, len(tokens)) > 0):
                r.pending = self.link.lookup(tokens, r.namespace, 0, r.session_id)
                r.pending_key, r.pending_since = (0, len(tokens)), time.monotonic()
                self.counters["lookups"] += 1
        finally:
            r.sched_s += time.perf_counter() - t0

    def _prefetch(self, r: _Req, tokens: list[int]) -> None:
        """A request arriving behind waiting ones: the chunks of it the view shows on other
        nodes are pulled into the engine's own node while it waits (``gpu_agent.vllm.prefetcher``)."""
        if self.prefetcher is None or not tokens:
            return
        if not any(x is not r and not x.block_ids for x in self._reqs.values()):
            return  # nothing waits ahead of it: scheduled at the next step, its load pulls
        assert self.view is not None
        ans = self.view.lookup(tokens, r.namespace, 0)
        if ans.error is None and ans.found and not all(ans.local):
            self.prefetcher.submit(r.request.request_id, tokens, r.namespace, ans.found)

    # -- vLLM's calls -------------------------------------------------------------------
    def _track(self, request: Request) -> _Req:
        r = self._reqs.get(request.request_id)
        if r is None:
            why = unkeyable(request)
            if why is not None:
                self.counters["unkeyable_requests"] += 1
                log.info("kvstore: request %s has %s: neither loaded nor saved", request.request_id, why)
            ns = request_namespace(self.spec, self.settings, self.chunk, request)
            r = self._reqs[request.request_id] = _Req(request, ns, request_session(request), why)
            r.cls = patience.request_class(hint=admission.hinted(request), first_chunk_sightings=0)
        return r

    def _handoff_tokens(self, request: Request, ns: Namespace, num_tokens: int) -> int:
        """Leading tokens a producer said it saved for this prompt (its ``kv_transfer_params``),
        when they are keyed as this engine keys them; 0 when there is nothing to wait for."""
        params = getattr(request, "kv_transfer_params", None)
        info = params.get("kvstore") if isinstance(params, dict) else None
        if not isinstance(info, dict):
            return 0
        try:
            if Namespace.from_dict(info["namespace"]).fingerprint != ns.fingerprint:
                return 0  # another model, rank layout or tenant: its chunks are not ours
            saved = int(info.get("saved_tokens", 0))
            if saved == num_tokens:
                return saved  # the whole prompt, its trailing partial chunk too
            return max(0, min(int(info.get("saved_chunks", 0)) * self.chunk, num_tokens // self.chunk * self.chunk))
        except (KeyError, TypeError, ValueError, KVStoreError):
            return 0  # malformed params are no reason to wait

    def get_num_new_matched_tokens(self, request: Request, num_computed: int) -> tuple[int | None, bool]:
        """Tokens beyond vLLM's ``num_computed`` the store supplies (None: ask again next step:
        the lookup is not answered yet, or a producer's chunks are still being committed)."""
        if not self.consume:
            return 0, False
        t0 = time.perf_counter()
        r = self._track(request)
        try:
            return self._matched(r, request, num_computed)
        finally:
            dt = time.perf_counter() - t0
            self.timings.add("lookup", dt)
            r.sched_s += dt

    def _sight(self, r: _Req, tokens: list[int]) -> None:
        """Count the request's chunks as looked up once more, and plan its saves by it."""
        r.sighted = True
        prompt = int(r.request.num_prompt_tokens)
        chain = chunk_keys(tokens[:prompt], r.namespace)
        tail = tail_key(tokens[:prompt], r.namespace, chain)
        counts = self.sightings.sight(chain + ([tail] if tail is not None else []))
        r.cls = patience.request_class(
            hint=admission.hinted(r.request), first_chunk_sightings=counts[0] if counts else 0
        )
        if self.settings.save_policy == "evidence":
            self._poll_read_back()
            per_token = self.gate.recompute.per_token(self.gate.min_samples)
            r.plan = self.evidence.plan(
                rank_namespace(r.namespace, *self.ranks[0]).fingerprint,  # the fingerprint rank 0's node counts
                chunks=len(chain),
                recompute_s=None if per_token is None else per_token * self.chunk,
                retain=admission.retained(r.request),  # a session id is no retention hint here
                producer_only=self.produce and not self.consume,
                save_decode=self.settings.save_decode,
            )
            return
        r.plan = admission.plan(
            self.settings.save_policy,
            counts=counts[: len(chain)],
            tail_count=counts[-1] if tail is not None else None,
            hint=admission.hinted(r.request),
            producer_only=self.produce and not self.consume,
            save_decode=self.settings.save_decode,
        )

    def _poll_read_back(self) -> None:
        """Take the node's read-back counters in if the last poll was answered; ask again
        every ``READ_BACK_EVERY_S`` (on the store link's thread: never waited for here)."""
        f = self._read_back
        if f is not None and f.done():
            self._read_back = None
            try:
                self.evidence.update(f.result())
            except Exception as e:  # no evidence this time: admission keeps what it learnt
                log.debug("kvstore: reading the node's read-back counters failed (%s)", e)
        now = time.monotonic()
        if self._read_back is None and now >= self._read_back_at:
            self._read_back_at = now + READ_BACK_EVERY_S
            self._read_back = self.link.read_back()

    def _found_tokens(self, ans: LookupAnswer, first: int, num_tokens: int) -> int:
        """Prompt tokens an answer covers from token 0: its chunks from ``first`` on, the
        trailing partial chunk (keyed by its exact tokens) counting as the whole prompt."""
        full, partial = divmod(num_tokens, self.chunk)
        found = first + ans.found
        return num_tokens if partial and found > full else found * self.chunk

    def _matched(self, r: _Req, request: Request, num_computed: int) -> tuple[int | None, bool]:
        r.local_tokens = num_computed
        if r.skip is not None or r.load_failed:
            return 0, False
        tokens = list(request.all_token_ids)
        if not r.sighted and self.produce:
            self._sight(r, tokens)
        full, partial = divmod(len(tokens), self.chunk)
        first = num_computed // self.chunk
        if (full <= first and not partial) or time.monotonic() < self._down_until:
            return 0, False
        want = self._handoff_tokens(request, r.namespace, len(tokens))
        now = time.monotonic()
        if r.wait_until and now < r.next_ask and now < r.wait_until:
            self.counters["handoff_waits"] += 1
            return None, False
        ans: LookupAnswer | None = None
        if self._viewing():
            assert self.view is not None
            ans = self.view.lookup(tokens, r.namespace, first)
            self.counters["view_lookups"] += 1
            r.from_view = True
            # a producer's handoff the view does not show whole yet asks the store itself:
            # the node, not a view that may lag it (a node that just restarted, say), says
            # what is committed, and the decode engine is there not to prefill
            if want > 0 and ans.error is None and self._found_tokens(ans, first, len(tokens)) < want:
                ans = None
        if ans is None:
            if not self._asks(r, want > 0):
                return 0, False
            ans = self._answer(r, tokens, first, patience=self._patience(r, want > 0))
            if ans is None:
                return None, False
            r.from_view = False
        if ans.error is not None:
            r.answer = None
            self._store_failed(ans.error, f"lookup for request {request.request_id}")
            return 0, False
        n, tiers = ans.found, list(ans.tiers)
        found = first + n  # chunks, the tail counted as one
        found_tokens = self._found_tokens(ans, first, len(tokens))
        if want > found_tokens:
            now = time.monotonic()
            if not r.wait_until:
                r.wait_until = now + self.settings.deadline_s
            if now < r.wait_until:
                r.next_ask = now + HANDOFF_POLL_S
                r.answer = None  # asked afresh at next_ask
                self.counters["handoff_waits"] += 1
                return None, False
            if r.next_ask >= 0:
                self.counters["handoff_timeouts"] += 1
                log.warning(
                    "kvstore: request %s: its producer saved %d tokens, %d are committed after %.1f s; "
                    "recomputing the rest",
                    request.request_id,
                    want,
                    found_tokens,
                    self.settings.deadline_s,
                )
            r.next_ask = -1.0
        if first == 0:
            r.saved_chunks = max(r.saved_chunks, min(found, full))  # stored already: never saved again
        if partial and found > full and len(tokens) == int(request.num_prompt_tokens):
            r.tail_saved = True  # the whole prompt is stored, its tail too: nothing to save again
        kinds = [
            "nvme" if t == "nvme" and loc else "local" if loc else "remote"
            for t, loc in zip(tiers, ans.local or [True] * n)
        ]
        # a producer's handoff loads whatever the gate says: the decode engine is there not to prefill
        pay = n if want > 0 else self._gate(kinds) if n else 0
        if pay < n:
            skipped_tokens = found_tokens - (first + pay) * self.chunk
            self.counters["gated_tokens"] += max(0, min(skipped_tokens, request.num_tokens - 1 - num_computed))
            n, tiers, kinds = pay, tiers[:pay], kinds[:pay]
            found = first + n
            found_tokens = len(tokens) if partial and found > full else found * self.chunk
        r.found_chunks, r.tiers = min(found, full), tiers
        # vLLM computes at least the last token: a prompt stored whole loads all but that one
        end = min(found_tokens, request.num_tokens - 1)
        n_tokens = max(0, end - num_computed)
        r.async_load = n_tokens > 0 and self._load_async(kinds)
        if r.async_load:
            self.counters["async_loads"] += 1
        r.kind = "remote" if "remote" in kinds else "nvme" if "nvme" in kinds else "local"
        return n_tokens, r.async_load

    def _gate(self, kinds: list[str]) -> int:
        """Leading chunks of a hit (of these kinds) worth loading at the engine's batch: the
        last step's requests and this one."""
        return self.gate.leading(
            kinds, self.chunk, batch=self._batch + 1, background=background_kinds(self.settings.async_loads)
        )

    def _load_async(self, kinds: list[str]) -> bool:
        """Whether the hit loads in the background (``async_loads``): with ``auto``, when any
        chunk is on NVMe or not on this engine's own node (a remote pull)."""
        mode = self.settings.async_loads
        if mode != "auto":
            return mode == "always"
        return any(k != "local" for k in kinds)

    def get_external_cache_hit_sources(self, request: Request, num_external: int) -> dict[CacheHitSource, int]:
        r = self._reqs.get(request.request_id)
        if num_external <= 0 or r is None:
            return {}
        out: dict[CacheHitSource, int] = {}
        left = num_external
        for t in reversed(r.tiers):  # the chunks loaded are the last ones found
            take = min(left, self.chunk)
            src = TIER_SOURCE.get(t, CacheHitSource.EXTERNAL_UNSPECIFIED)
            out[src] = out.get(src, 0) + take
            left -= take
            if left <= 0:
                break
        if left > 0:
            out[CacheHitSource.EXTERNAL_UNSPECIFIED] = out.get(CacheHitSource.EXTERNAL_UNSPECIFIED, 0) + left
        return out

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external: int) -> None:
        t0 = time.perf_counter()
        r = self._track(request)
        r.answer = None  # allocated: a later ask (after a preemption) is a new lookup
        if r.given_up and r.pending is not None:  # computed without its answer: taken as an outcome later
            self._given_up.append((r, r.pending_key[0], r.pending_since, r.pending))
            r.pending = None
        r.given_up = False
        try:
            self._after_alloc(r, request, blocks, num_external)
        finally:
            r.sched_s += time.perf_counter() - t0

    def _after_alloc(self, r: _Req, request: Request, blocks: KVCacheBlocks, num_external: int) -> None:
        if num_external <= 0 or r.skip is not None:
            return
        start = r.local_tokens  # not request.num_computed_tokens: vLLM sets it after this call
        end = start + num_external
        whole = -(-end // self.chunk) * self.chunk
        tokens = list(request.all_token_ids[:whole])
        tail = len(tokens) % self.chunk != 0  # the load reaches into the trailing partial chunk
        self._loads[request.request_id] = LoadSpec(
            request.request_id,
            tokens,
            list(blocks.get_block_ids()[0]),  # with load_kv_async: every block of the request
            start,
            end,
            r.namespace,
            r.session_id,
            tail,
            async_load=r.async_load,
            kind=r.kind,
            from_view=r.from_view,
        )
        bs = self.spec.block_size
        r.load_blocks = frozenset(blocks.get_block_ids()[0][start // bs : -(-end // bs)])
        r.external_tokens = num_external
        self.counters["hit_tokens"] += num_external
        self.counters["local_hit_tokens"] += start
        self.link.report_hits(r.namespace, start, self.chunk)

    def build_connector_meta(self, out: SchedulerOutput) -> KVStoreMeta:
        t0 = time.perf_counter()
        try:
            return self._build_meta(out)
        finally:
            self.timings.add("sched_step", time.perf_counter() - t0)
            self.budget.step(time.monotonic(), int(out.total_num_scheduled_tokens))

    def _build_meta(self, out: SchedulerOutput) -> KVStoreMeta:
        self._take_given_up()
        self._batch = len(out.num_scheduled_tokens)
        meta = KVStoreMeta(
            preempted=set(getattr(out, "preempted_req_ids", None) or ()),
            step_tokens=int(out.total_num_scheduled_tokens),
        )
        for rid in meta.preempted:  # its saves still copying are cancelled (the worker's handle_preemptions)
            r = self._reqs.get(rid)
            if r is not None:  # issued again as it runs again: saved_chunks never counts a cancelled save
                r.saved_chunks, r.tail_saved = 0, False
        for req in out.scheduled_new_reqs:
            r = self._reqs.get(req.req_id)
            if r is None:
                continue
            r.block_ids = list(req.block_ids[0])
            self._take_load(meta, req.req_id, r)
            done = req.num_computed_tokens + out.num_scheduled_tokens.get(req.req_id, 0)
            meta.prefill_tokens += out.num_scheduled_tokens.get(req.req_id, 0)
            self._maybe_save(meta, req.req_id, r, done)
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            r = self._reqs.get(rid)
            if r is None:
                continue
            new = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:  # preempted and back: a new block table
                r.block_ids = list(new[0]) if new is not None else []
                self._take_load(meta, rid, r)
            elif new is not None:
                r.block_ids.extend(new[0])
            if cached.num_computed_tokens[i] < int(r.request.num_prompt_tokens):  # still prefilling
                meta.prefill_tokens += out.num_scheduled_tokens.get(rid, 0)
            self._maybe_save(meta, rid, r, cached.num_computed_tokens[i] + out.num_scheduled_tokens.get(rid, 0))
        for rid, load in self._loads.items():  # waiting for their KV: not scheduled, loaded now
            if load.async_load and rid in self._reqs:
                self._reqs[rid].block_ids = list(load.block_ids)
                meta.loads.append(load)
        self._loads.clear()  # an allocation vLLM did not schedule is asked again next time
        return meta

    def _take_load(self, meta: KVStoreMeta, rid: str, r: _Req) -> None:
        load = self._loads.pop(rid, None)
        if load is not None:
            meta.loads.append(dataclasses.replace(load, block_ids=list(r.block_ids)))

    def _maybe_save(self, meta: KVStoreMeta, rid: str, r: _Req, done: int) -> None:
        """Save the full chunks this step completes (their KV is written once it ran), and
        when it completes the prompt, the prompt's trailing partial chunk (keyed by its
        exact tokens, so a repeated prompt of any length loads all but its last token):
        as far as the request's :class:`~gpu_agent.vllm.admission.SavePlan` admits."""
        if not self.produce or r.skip is not None:
            return
        tokens = r.request.all_token_ids
        prompt = int(r.request.num_prompt_tokens)
        bs = self.spec.block_size
        plan = r.plan
        full_p, partial = divmod(prompt, self.chunk)
        if not r.tail_saved and done >= prompt and len(tokens) >= prompt:
            r.tail_saved = True
            pages = -(-prompt // bs)
            admitted = plan.tail and plan.prompt_chunks >= full_p
            if admitted and partial and r.saved_chunks <= full_p and len(r.block_ids) >= pages:
                # the tail's chunk spans whole pages: those past the prompt repeat its last page
                ids = r.block_ids[:pages]
                ids = ids + [ids[-1]] * ((full_p + 1) * (self.chunk // bs) - pages)
                meta.saves.append(
                    SaveSpec(rid, list(tokens[:prompt]), ids, r.saved_chunks, r.namespace, r.session_id, tail=True)
                )
                self._note_saving(r, tokens, r.saved_chunks, full_p)
                r.saved_chunks = full_p
                r.saves += 1
                return
        limit = done if self.settings.save_decode and plan.decode else min(done, prompt)
        full = min(limit, len(tokens)) // self.chunk  # only chunks whose every token is known
        if plan.prompt_chunks < full_p:
            full = min(full, plan.prompt_chunks)  # the run ends at the first chunk not admitted
        pages = full * self.chunk // bs
        if full <= r.saved_chunks or len(r.block_ids) < pages:
            return
        meta.saves.append(
            SaveSpec(
                rid, list(tokens[: full * self.chunk]), r.block_ids[:pages], r.saved_chunks, r.namespace, r.session_id
            )
        )
        self._note_saving(r, tokens, r.saved_chunks, full)
        r.saved_chunks = full
        r.saves += 1

    def _note_saving(self, r: _Req, tokens: Any, lo: int, hi: int) -> None:
        """Chunks ``[lo, hi)`` are being saved: their keys on every rank, for :class:`StoredChunks`."""
        if self.stored.resync_s <= 0 or hi <= lo:
            return
        head = list(tokens[: hi * self.chunk])
        self.stored.saving([chunk_keys(head, rank_namespace(r.namespace, t, p)) for t, p in self.ranks], lo, hi)

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Hold the blocks of a request whose saves run (every worker reports it once they are
        committed); tell the caller where its KV went (``kv_transfer_params["kvstore"]``: the
        namespace and chunk size to key the same prefix, and ``saved_chunks`` for a decode
        engine to wait for exactly those)."""
        rid = request.request_id
        r = self._reqs.pop(rid, None)
        self._loads.pop(rid, None)
        if r is None:
            return False, None
        if r.pending is not None:
            r.pending.cancel()
        self.timings.add("request_sched", r.sched_s)
        if self.produce and r.plan.limited and r.skip is None:
            n = len(request.all_token_ids) if self.settings.save_decode else int(request.num_prompt_tokens)
            skipped = max(0, n // self.chunk - r.saved_chunks)
            self.counters["skipped_save_chunks"] += skipped
            self.link.report_skipped(r.namespace, skipped)
        hold = r.saves > 0 and self.settings.defer_free
        params = {
            "kvstore": {
                "namespace": r.namespace.to_dict(),
                "chunk_tokens": self.chunk,
                "saved": r.saves > 0,
                "saved_chunks": r.saved_chunks if self.produce else 0,
                "saved_tokens": (
                    0
                    if not self.produce
                    else int(request.num_prompt_tokens)
                    if r.tail_saved and r.saved_chunks == int(request.num_prompt_tokens) // self.chunk
                    else r.saved_chunks * self.chunk
                ),
                "hit_chunks": r.found_chunks,
                "local_tokens": r.local_tokens,
                "external_tokens": r.external_tokens,
            }
        }
        return hold, params

    def update_connector_output(self, out: KVConnectorOutput) -> None:
        bad = getattr(out, "invalid_block_ids", None) or set()
        failed = getattr(out, "failed_recving", None) or set()
        if bad or failed:
            # vLLM recomputes what did not load; the request is not planned a load again (a
            # dead node the view still lists, or a stale view, would fail it the same way at
            # every reschedule: a loop of empty steps)
            for rid, r in self._reqs.items():
                if rid in failed or (r.load_blocks and not bad.isdisjoint(r.load_blocks)):
                    r.load_failed, r.load_blocks = True, frozenset()
                    self.counters["loads_failed"] += 1
        stats = out.kv_connector_stats
        if stats is not None and isinstance(getattr(stats, "data", None), dict):
            self.gate.observe(stats.data)  # the workers' step and load times: what a load must beat
            self.evidence.observe(stats.data)  # and their save times: what a store must beat
        ev = out.kv_cache_events
        if not isinstance(ev, KVStoreEvents):
            return
        if self._events is None:
            self._events = ev
        else:
            self._events.add_events(ev.get_all_events())
            self._events.increment_workers(ev.get_number_of_workers())

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The workers' events every worker reported, then what the store changed on its own
        (the resync's lookup runs on the store link's thread; its events come a call later)."""
        events: list[KVCacheEvent] = []
        if self._events is not None:
            self._events.aggregate()
            events = list(self._events.get_all_events())
            self._events = None
            for ev in events:
                self.stored.stored(ev)
        now = time.monotonic()
        if self._resync is not None and self._resync[1].done():
            held, fut = self._resync
            self._resync = None
            try:
                events.extend(self.stored.finish_resync(held, fut.result()))
            except Exception as e:  # events are advice: the engine goes on
                self._store_failed(e, "event resync")
        if self._resync is None and self.stored.due(now) and now >= self._down_until:
            held, keys = self.stored.begin_resync(now)
            self._resync = held, self.link.tiers(keys)
        return events

    def get_kv_connector_stats(self) -> KVStoreStats | None:
        if self.view is not None:
            for ms in self.view.take_lags():
                self.timings.add("view_lag", ms / 1e3)
        if self.prefetcher is not None:
            for k, v in self.prefetcher.snapshot().items():
                self.counters[k] = int(v)
        return delta(self.counters, self._reported, SCHEDULER_KEYS, self.timings)

    def shutdown(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()
        if self.view is not None:
            self.view.close()
        self.link.close()

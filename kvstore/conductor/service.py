"""The conductor's state and its background work: engines, the KV view, the cost model.

:class:`Conductor` is owned by one asyncio loop (the HTTP front's): every field is read
and written there, so nothing here takes a lock.  The pieces it owns:

* :class:`~kvstore.conductor.engines.Engines` (who, alive, how loaded);
* the view of where KV is, per request:
  - each engine's own prefix cache, from its vLLM KV events
    (:class:`~kvstore.conductor.cacheindex.FleetCacheIndex`, fed by one subscriber thread
    per engine: the only state shared with other threads, behind the index's own lock);
  - the pool's chunks, node and tier (``match_prefix_locations`` on the cluster: one
    lookup per distinct namespace; see "Pool lookups" below);
* the :class:`~kvstore.conductor.cost.CostModel` fitted from the requests it served;
* the routing record (decisions per engine, decision time, predicted against measured
  TTFT, pool lookups late or failed) that ``/conductor/state`` and ``/metrics`` report.

Background tasks (started by :meth:`Conductor.start`): the etcd registry (engines and
nodes), the pool client (made off the loop, retried while etcd is out), a probe of every
engine each ``probe_s`` (``/health``, ``/metrics`` for its load, ``/v1/models`` once), all
best effort: a failure marks an engine dead, never the conductor.

Pool lookups.  Two budgets, never one:

* ``pool_timeout_s`` (``--pool-timeout-ms``, 50 ms) is how long a *decision* waits for the
  pool.  A lookup not answered by then is *late*: the decision goes on without pool
  information (``pool_late`` in the routing record, ``kvstore_conductor_pool_late_total``)
  and the lookup is not cancelled: it ends in the background, within the client's own
  deadlines, and nothing about the pool or its nodes is concluded from its lateness.  At
  most ``POOL_INFLIGHT`` lookups run at once; past that, requests are routed without
  asking (counted late too), so a hung pool costs bounded work and never a decision more
  than ``pool_timeout_s``.  The lookup is a coroutine on the loop (gRPC aio): nothing
  here blocks the loop, and the client itself is made in a worker thread (its
  constructor waits for etcd's first answer).
* ``POOL_RPC_S`` (2 s) is the pool client's deadline for one node call (its connect
  deadline half of it, its membership's etcd calls the same): past it a node is late or
  down, the cluster client routes around it (*suspect*, with back-off), and the lookups
  that miss chunks because of it count as ``pool_errors``, as do lookups that raise
  (the pool is then not asked for ``POOL_RETRY_S``).

Why (the ``pool_errors`` bug): the conductor used to build its cluster client with
``Timeouts(rpc=pool_timeout_s, data=pool_timeout_s, connect=pool_timeout_s)`` and wait for
each lookup with ``asyncio.wait_for(..., pool_timeout_s)``: one 50 ms figure was the
decision's budget, the wait's cancellation point, every node RPC's gRPC deadline and
connect deadline, and (``min(2, rpc)``) the client's etcd deadline.  On a loaded 2-core
machine (two vLLM engines busy-waiting, the nodes saving and loading their KV) a
lookup's answer takes over 50 ms now and then: against real nodes and etcd with four
busy loops beside them, lookups took 6 ms at the median and 52 ms at the worst, and with
two processes saving and loading through the nodes a lookup failed about every 2 s.  Each
such lookup was counted an error, whichever deadline fired first: the
``wait_for`` (a ``TimeoutError``, logged as "pool lookup failed ()", after which *no*
request asked the pool for ``POOL_RETRY_S``), or the node RPC's (``DeadlineExceeded``: the
cluster client marked a healthy node suspect for 2 s, doubling while it stayed slow, and
every lookup of a chunk it owns counted a ``node_down`` miss, so one slow answer became
an error on every decision of the next seconds).  Slow was taken for down.  The fix gives
the nodes a real deadline (``POOL_RPC_S``), makes the decision's budget a wait that
cancels nothing (a late lookup is late, not an error), and moves the client's
construction off the loop (it blocked the loop up to 10 s while etcd did not answer, and
raised out of :meth:`Conductor.start`).  Regression test:
tests/integration/test_conductor_pool_errors_under_load.py.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import aiohttp
import numpy as np

from kvstore.aio import cancel_and_wait
from kvstore.conductor.cost import CostModel, Load, Priors
from kvstore.conductor.engines import Engines, EngineState, Stream, scrape_counts
from kvstore.conductor.metrics import ConductorMetrics
from kvstore.conductor.policy import NO_POOL, Decision, EngineLoad, PoolMatch, Slo, decide, early_refusal
from kvstore.vocabulary import percentiles

log = logging.getLogger("kvstore.conductor")

SLOW_PROBES = 3
"""Probes in a row an engine may leave unanswered (timed out) before it is taken out;
a refused connection or a failed health check takes it out at once."""
POOL_RETRY_S = 2.0
"""After a failed pool lookup, how long requests are routed without the pool."""
POOL_RPC_S = 2.0
"""The pool client's deadline for one node call: past it the node is late or down (and
routed around).  Not the decision's budget, ``pool_timeout_s`` (see the module docstring)."""
POOL_INFLIGHT = 16
"""Pool lookups that may run at once, late ones included; past that the pool is not asked."""
ENGINE_TTFT_SAMPLES = 200
"""First tokens kept per engine for its predicted-against-measured TTFT (``ttft_per_engine``)."""


Outcome = Literal["served", "rejected", "bad_request", "engine_error", "client_gone"]
"""How a request the front took ended: the ``outcome`` label of ``kvstore_conductor_outcomes_total``."""


@dataclasses.dataclass(frozen=True)
class ConductorConfig:
    """What ``kvstore conductor`` is told (its flags)."""

    engines: tuple[tuple[str, str], ...] = ()  # static (url, role)
    etcd: str = ""  # etcd://host:port/cluster: registered engines and the pool ("" none)
    pd: bool = False
    slo: Slo = Slo()
    priors: Priors = Priors()
    probe_s: float = 1.0
    pool_timeout_s: float = 0.05  # the lookup is on every request's path: a slow pool is skipped
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 2.0
    tokenizer: str = ""
    max_body_bytes: int = 32 << 20
    attempts: int = 3  # engines tried for one request before it fails (connection refused etc.)


@dataclasses.dataclass
class Sent:
    """One request in flight: what was decided, and what was measured (the loop's)."""

    rid: str
    decision: Decision
    prompt_tokens: int
    arrived: float
    tokenized: bool = True  # the prompt's token ids are known (else its length is estimated)
    running_at_start: int = 0
    max_tokens: int = 16  # the tokens it asked for (its TBT counts the slowest tenth of their gaps)
    first_token_at: float | None = None
    last_token_at: float | None = None
    intervals: list[float] = dataclasses.field(default_factory=list)
    completed: bool = False  # the engine's answer reached its end


class Conductor:
    """See the module docstring."""

    def __init__(self, cfg: ConductorConfig, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        # the clock of the engines' load accounting (sent, first token, probes): the loop's
        # monotonic clock; ``kvstore sim`` passes its virtual one
        self.clock = clock
        self.engines = Engines(cfg.engines)
        self.model = CostModel(cfg.priors)
        self.metrics = ConductorMetrics()
        self.decisions: collections.Counter[str] = collections.Counter()
        self.decision_us: collections.deque[float] = collections.deque(maxlen=10_000)
        # the same decisions in this thread's CPU time: wall above CPU is time the process
        # was not scheduled (a conductor sharing its cores with busy engines)
        self.decision_cpu_us: collections.deque[float] = collections.deque(maxlen=10_000)
        self.refusal_s: collections.deque[float] = collections.deque(maxlen=10_000)
        self.ttft_err: collections.deque[float] = collections.deque(maxlen=10_000)
        # per engine (the one that computes the first token: the prefill engine in PD), the last
        # ENGINE_TTFT_SAMPLES (predicted, measured) pairs: the dashboard's per-engine columns
        self.engine_ttft: dict[str, collections.deque[tuple[float, float]]] = {}
        self.mean_prompt = 0.0
        self.mean_work_s = 0.0
        self.pool_down_until = 0.0
        self.pool_errors = 0
        self.pool_late = 0  # decisions that went on without a pool lookup that had not answered in time
        self._pool_inflight: set[asyncio.Task[PoolMatch | None]] = set()
        self.rejected: collections.Counter[str] = collections.Counter()
        self.http: aiohttp.ClientSession | None = None
        self.tokenizer: Any = None
        self._pool: Any = None
        self._membership: Any = None
        self._tasks: list[asyncio.Task[None]] = []
        self._seq = 0
        from kvstore.conductor.localview import LocalView

        self.local = LocalView()

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        self.http = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(
                total=self.cfg.request_timeout_s, sock_connect=self.cfg.connect_timeout_s, connect=None
            ),
            connector=aiohttp.TCPConnector(limit=0, force_close=False),
        )
        if self.cfg.etcd:
            self._tasks.append(asyncio.create_task(self._connect_pool(), name="conductor-pool"))
            self._tasks.append(asyncio.create_task(self._follow_registry(), name="conductor-registry"))
        self._tasks.append(asyncio.create_task(self._probe_loop(), name="conductor-probes"))
        if self.cfg.tokenizer:
            self._tasks.append(asyncio.create_task(self._load_tokenizer(), name="conductor-tokenizer"))
        for e in self.engines.by_id.values():
            self.local.follow(e)

    async def close(self) -> None:
        stuck = await cancel_and_wait([*self._tasks, *self._pool_inflight])
        if stuck:
            log.warning("closing: %d conductor tasks did not end on cancellation: %s", len(stuck), stuck)
        self.local.close()
        if self._membership is not None:
            await asyncio.to_thread(self._membership.close)
        if self._pool is not None:
            with contextlib.suppress(Exception):
                await self._pool.close()
        if self.http is not None:
            await self.http.close()

    async def _load_tokenizer(self) -> None:
        from transformers import AutoTokenizer

        try:
            self.tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, self.cfg.tokenizer)
            log.info("tokenizer %s loaded", self.cfg.tokenizer)
        except Exception as e:  # text prompts then route by load alone
            log.warning("tokenizer %s did not load (%s): text prompts are routed by load only", self.cfg.tokenizer, e)

    async def _connect_pool(self) -> None:
        """Make the pool's cluster client, in a worker thread: its constructor waits for etcd's
        first answer (up to its ``wait_s``), which must not stall the loop; retried while etcd is out."""
        from client import Timeouts, connect_async

        timeouts = Timeouts(rpc=POOL_RPC_S, data=POOL_RPC_S, connect=POOL_RPC_S / 2)
        warned = False
        while self._pool is None:
            try:
                self._pool = await asyncio.to_thread(connect_async, self.cfg.etcd, timeouts=timeouts, wait_s=3.0)
            except Exception as e:  # routing goes on without the pool meanwhile
                if not warned:
                    log.warning(
                        "the pool at %s is unreachable (%s): routing without it until it answers", self.cfg.etcd, e
                    )
                warned = True
                await asyncio.sleep(POOL_RETRY_S)

    # -- the registry -------------------------------------------------------------------------
    async def _follow_registry(self) -> None:
        from kvstore.cluster.membership import Membership
        from kvstore.cluster.state import parse_target

        endpoints, cluster = parse_target(self.cfg.etcd)
        warned = False
        while True:
            if self._membership is None:
                m = Membership(endpoints, cluster)
                try:
                    await asyncio.to_thread(m.start, 3.0)
                    self._membership = m
                    log.info("following engines and nodes in etcd at %s", self.cfg.etcd)
                except Exception as e:  # static engines serve on; retried
                    await asyncio.to_thread(m.close)
                    if not warned:
                        log.warning(
                            "etcd at %s unreachable (%s): routing over the engines known so far", self.cfg.etcd, e
                        )
                    warned = True
                    await asyncio.sleep(2.0)
                    continue
            snap = self._membership.snapshot()
            added, gone = self.engines.apply_registry(getattr(snap, "engines", {}), snap.nodes)
            for eid in added:
                log.info("engine %s joined (%s)", eid, self.engines.by_id[eid].url)
            for eid in gone:
                log.info("engine %s left (its registration lapsed)", eid)
                self.local.drop(eid)
            for engine in self.engines.by_id.values():
                self.local.follow(engine)
            await asyncio.sleep(0.5)

    # -- probes ---------------------------------------------------------------------------------
    async def _probe_loop(self) -> None:
        while True:
            engines = list(self.engines.by_id.values())
            await asyncio.gather(*(self._probe(e) for e in engines), return_exceptions=True)
            await asyncio.sleep(self.cfg.probe_s)

    async def _probe(self, e: EngineState) -> None:
        assert self.http is not None
        timeout = aiohttp.ClientTimeout(total=max(self.cfg.probe_s, 2.0))
        try:
            async with self.http.get(e.url + "/health", timeout=timeout) as r:
                ok = r.status == 200
            if ok:
                async with self.http.get(e.url + "/metrics", timeout=timeout) as r:
                    if r.status == 200:
                        e.scraped_waiting, e.scraped_running = scrape_counts(await r.text())
                        e.scraped_at = self.clock()
                if not e.models:
                    async with self.http.get(e.url + "/v1/models", timeout=timeout) as r:
                        if r.status == 200:
                            data = await r.json()
                            e.models = tuple(str(m["id"]) for m in data.get("data", []) if "id" in m)
        except TimeoutError:
            # a busy engine answers late (its API server shares the cores with the model):
            # slow is not dead until it has been slow SLOW_PROBES times in a row
            e.slow_probes += 1
            if e.slow_probes >= SLOW_PROBES and self.engines.mark_dead(
                e, f"no answer to {SLOW_PROBES} probes of {timeout.total:.0f} s in a row"
            ):
                self.local.clear(e.engine_id)
            return
        except (aiohttp.ClientError, ValueError, KeyError, TypeError) as err:
            ok = False
            why = f"probe failed: {type(err).__name__}: {err}"
        else:
            why = "health check failed"
        e.slow_probes = 0
        if ok:
            self.engines.mark_alive(e)
        elif self.engines.mark_dead(e, why):
            self.local.clear(e.engine_id)

    def engine_failed(self, e: EngineState, why: str) -> None:
        """A request could not reach ``e``: out until a probe finds it answering."""
        if self.engines.mark_dead(e, why):
            self.local.clear(e.engine_id)

    # -- the view and the decision --------------------------------------------------------------
    async def pool_match(
        self, tokens: list[int] | None, engines: list[EngineState]
    ) -> dict[tuple[bytes, int], PoolMatch]:
        """The pool's leading chunks per (fingerprint, chunk size) the engines key by; {} (no
        pool information) when the pool is unknown, down, or not answered within
        ``pool_timeout_s`` (see the module docstring).  Never raises, never waits longer."""
        out: dict[tuple[bytes, int], PoolMatch] = {}
        if tokens is None or self._pool is None or time.monotonic() < self.pool_down_until:
            return out
        from kvstore.keys import chunk_keys_from

        spaces = {(e.fingerprint, e.chunk_tokens) for e in engines if e.fingerprint and e.chunk_tokens}
        arr = np.asarray(tokens, dtype=np.uint32)
        asked: dict[tuple[bytes, int], asyncio.Task[PoolMatch | None]] = {}
        for fp, chunk in spaces:
            assert fp is not None
            keys = chunk_keys_from(arr, fp, chunk)
            if not keys:
                out[(fp, chunk)] = PoolMatch(chunk)
                continue
            if len(self._pool_inflight) >= POOL_INFLIGHT:  # earlier lookups still running: do not pile up
                self._late()
                return {}
            task = asyncio.ensure_future(self._ask_pool(keys, chunk))
            self._pool_inflight.add(task)
            task.add_done_callback(self._pool_inflight.discard)
            asked[(fp, chunk)] = task
        if not asked:
            return out
        # a wait, not wait_for: a lookup past the budget is left to end by itself, not cancelled
        _, pending = await asyncio.wait(asked.values(), timeout=self.cfg.pool_timeout_s)
        if pending:
            self._late()
            return {}
        for space, task in asked.items():
            got = task.result()
            if got is None:  # failed (counted where it failed)
                return {}
            out[space] = got
        return out

    def _late(self) -> None:
        """This decision goes on without the pool (its lookups, if any, end in the background)."""
        self.pool_late += 1
        self.metrics.pool_late.inc()
        log.debug("pool lookup not answered within %.0f ms: routing without it", self.cfg.pool_timeout_s * 1e3)

    async def _ask_pool(self, keys: Sequence[bytes], chunk: int) -> PoolMatch | None:
        """One lookup, to its end; its failures are counted here (whether or not a decision
        still waits for it).  None if it failed."""
        pool = self._pool
        before = _owner_misses(pool)
        try:
            n, where = await pool.match_prefix_locations(keys)
        except Exception as err:  # the pool is a hint: route without it for a while
            self.pool_errors += 1
            self.metrics.pool_errors.inc()
            self.pool_down_until = time.monotonic() + POOL_RETRY_S
            log.warning("pool lookup failed (%r): routing by load and engine caches for %.0f s", err, POOL_RETRY_S)
            return None
        if _owner_misses(pool) > before:
            # an owner was down or past POOL_RPC_S: the cluster client answered a miss for its
            # chunks (and routes around the node itself), so this lookup went without them
            self.pool_errors += 1
            self.metrics.pool_errors.inc()
        return PoolMatch(chunk, tuple((str(w), str(t)) for w, t in where[:n]))

    def _loads(self, live: list[EngineState], local: dict[str, int]) -> list[EngineLoad]:
        now = self.clock()
        slo_tbt = self.cfg.slo.tbt_s
        return [
            EngineLoad(
                e.engine_id,
                e.role,
                e.node_id,
                local.get(e.engine_id, 0),
                e.queued_tokens(now, self.mean_prompt),
                e.running(now),
                self.decisions[e.engine_id],
                e.queued_s(now, self.mean_work_s),
                _at_risk(e, now, slo_tbt) if slo_tbt else (),
            )
            for e in live
        ]

    def refuse_early(self, prompt_tokens: int, model_name: str | None) -> Decision | None:
        """The refusal :meth:`decide` would give, known before any lookup (see
        :func:`~kvstore.conductor.policy.early_refusal`), or None.  Under overload, when
        refusals happen, the 429 then costs no pool RPC and no cache walk."""
        slo = self.cfg.slo
        if not slo.reject or not (slo.ttft_s or slo.tbt_s) or self.model.samples < slo.min_samples:
            return None
        live = self.engines.live(model_name)
        return early_refusal(self.model, self._loads(live, {}), prompt_tokens, slo, pd=self.cfg.pd)

    def decide(
        self,
        tokens: list[int] | None,
        prompt_tokens: int,
        model_name: str | None,
        pools: dict[tuple[bytes, int], PoolMatch],
    ) -> tuple[Decision, dict[str, EngineState]]:
        t0, c0 = time.perf_counter(), time.thread_time()
        live = self.engines.live(model_name)
        local = self.local.match(tokens, [e.engine_id for e in live]) if tokens is not None else {}
        loads = self._loads(live, local)
        # one pool view per request: engines of several namespaces each get their own
        pool = NO_POOL
        if pools:
            pool = max(pools.values(), key=lambda p: p.tokens)
        d = decide(self.model, loads, prompt_tokens, pool, self.cfg.slo, pd=self.cfg.pd)
        us = (time.perf_counter() - t0) * 1e6
        self.decision_us.append(us)
        self.decision_cpu_us.append((time.thread_time() - c0) * 1e6)
        self.metrics.decision_seconds.observe(us / 1e6)
        return d, {e.engine_id: e for e in live}

    # -- what requests report back ------------------------------------------------------------
    def next_id(self) -> str:
        self._seq += 1
        return f"cond-{self._seq}"

    def dispatched(self, e: EngineState, rid: str, load: Load) -> None:
        from kvstore.conductor.engines import Inflight

        work = self.model.work(e.engine_id, load)
        self.mean_work_s = work if self.mean_work_s == 0 else 0.95 * self.mean_work_s + 0.05 * work
        e.sent(rid, Inflight(load.compute, self.clock(), work))
        self.decisions[e.engine_id] += 1
        self.metrics.requests.labels(e.engine_id).inc()

    def first_token(self, e: EngineState, sent: Sent, load: Load, measured_s: float) -> None:
        """The first token of what ``e`` was sent came (for a prefill engine: its answer):
        the request decodes now, and the TTFT model learns from the engine's part."""
        e.first_token(sent.rid, Stream(sent.max_tokens, sent.intervals, self.clock()))
        self.model.observe_ttft(e.engine_id, load, measured_s)

    def ttft_seen(self, sent: Sent, measured_s: float) -> None:
        """The client got its first token ``measured_s`` after the request arrived."""
        predicted = sent.decision.predicted_ttft_s
        if measured_s > 0:
            self.ttft_err.append(abs(predicted - measured_s) / measured_s)
            first = sent.decision.prefill or sent.decision.engine
            if first is not None:
                pairs = self.engine_ttft.setdefault(first.engine_id, collections.deque(maxlen=ENGINE_TTFT_SAMPLES))
                pairs.append((predicted, measured_s))
        self.metrics.ttft.labels("predicted").observe(predicted)
        self.metrics.ttft.labels("measured").observe(measured_s)
        log.info(
            "request %s: first token after %.0f ms (predicted %.0f ms)", sent.rid, measured_s * 1e3, predicted * 1e3
        )

    def ended(self, e: EngineState, rid: str, *, ok: bool, tbt_s: float | None = None, running: float = 0) -> None:
        e.end(rid)
        if ok:
            e.served += 1
            if tbt_s is not None:
                self.model.observe_tbt(running, tbt_s)

    def outcome(self, what: Outcome) -> None:
        """How one request ended: the one writer of the ``outcome`` counter (the front calls it
        where a request's answer is settled; :meth:`refused` for a refusal)."""
        self.metrics.outcomes.labels(what).inc()

    def refused(self, why: str, seconds: float) -> None:
        """A request was answered 429 (``why``: the target it would miss) ``seconds`` after it arrived."""
        self.rejected[why] += 1
        self.metrics.rejected.labels(why).inc()
        self.outcome("rejected")
        self.metrics.refusal_seconds.observe(seconds)
        self.refusal_s.append(seconds)

    def note_prompt(self, n: int) -> None:
        self.mean_prompt = n if self.mean_prompt == 0 else 0.95 * self.mean_prompt + 0.05 * n

    # -- reports ------------------------------------------------------------------------------
    def routing(self) -> dict[str, Any]:
        return {
            "predicted_ttft_abs_err_median": round(statistics.median(self.ttft_err), 4) if self.ttft_err else None,
            "ttft_per_engine": {eid: _ttft_report(pairs) for eid, pairs in sorted(self.engine_ttft.items()) if pairs},
            "decisions_per_engine": dict(sorted(self.decisions.items())),
            "decision_us": percentiles(self.decision_us, digits=1),
            "decision_cpu_us": percentiles(self.decision_cpu_us, digits=1),
            "rejected": dict(self.rejected),
            "refusal_ms": percentiles(self.refusal_s, scale=1e3, digits=1),
            "pool_errors": self.pool_errors,
            "pool_late": self.pool_late,
        }

    def state(self) -> dict[str, Any]:
        now = self.clock()
        return {
            "engines": [e.describe(now) for e in self.engines.by_id.values()],
            "routing": self.routing(),
            "model": self.model.describe(),
            "views": self.local.describe(),
            "pd": self.cfg.pd,
            "slo": {"ttft_s": self.cfg.slo.ttft_s, "tbt_s": self.cfg.slo.tbt_s},
        }


def _owner_misses(pool: Any) -> int:
    """Keys the cluster client found missing because their owner was down or past its
    deadline (``miss_counts()``: node_down, deadline); 0 for a client that counts none."""
    counts = getattr(pool, "miss_counts", None)
    return sum(counts().values()) if counts is not None else 0


def _ttft_report(pairs: Iterable[tuple[float, float]]) -> dict[str, float | int]:
    """One engine's recent first tokens: predicted and measured TTFT medians (ms) and the
    median of |predicted - measured| / measured, over the same requests."""
    ps = list(pairs)
    return {
        "n": len(ps),
        "predicted_p50_ms": round(statistics.median(p for p, _ in ps) * 1e3, 1),
        "measured_p50_ms": round(statistics.median(m for _, m in ps) * 1e3, 1),
        "abs_err_median": round(statistics.median(abs(p - m) / m for p, m in ps), 4),
    }


def _at_risk(e: EngineState, now: float, slo_tbt_s: float) -> tuple[tuple[float, float], ...]:
    """(headroom, seconds left) of each of ``e``'s decodes that still meets ``slo_tbt_s``."""
    out = []
    for st in e.decoding.values():
        h = st.headroom(slo_tbt_s)
        if h >= 0:
            out.append((h, st.remaining_s(now)))
    return tuple(out)

"""A simulated fleet in virtual time: a workload's requests through N engine models behind a
front, as ``kvstore bench serving`` sends them to N vLLM servers.

A discrete-event loop over one heap of events, ordered by (virtual time, kind, sequence):

* **arrival** of request *i* at its workload time (``Work.arrival_s``, the trace's scaled
  timestamps): the front (a :class:`Router`: by default :class:`RoundRobinRouter`, the
  benchmark's own :class:`~kvstore.bench.serving.front.RoundRobin` over stand-in
  :class:`~kvstore.bench.serving.fleet.Engine` records; the conductor's for ``conductor``)
  picks the engine, which queues it (:meth:`~kvstore.sim.engine.EngineModel.add_request`),
  or refuses it (a 429, answered at once);
* **handoff** of a ``pd`` request (the front routed it to a (prefill, decode) pair): its
  prefill engine ran it for one token (``max_tokens`` 1, as the benchmark's
  :class:`~kvstore.bench.serving.front.PrefillDecode` and the conductor send it; that token
  is not streamed), and once what the prefill saved is committed (``Hooks.handoff``: the
  producer's last save) the decode engine gets the whole request;
* a session's **close** (``Workload.closes``), handed to the hooks (the nodes' session hints);
* a **prefetch** lands: the hooks started it when a request was queued (``Hooks.arrived``
  said when it lands) and now put its chunks into the engine's node (``Hooks.prefetched``);
* **step end** of engine *e*: the tokens its step sampled were emitted at that time; the engine
  then steps again at once if it has work (an engine's next step starts at
  ``max(now, its previous step's end)``: a request arriving mid-step waits for the next one);
* **wake** of engine *e*: an asynchronous external load completes
  (:meth:`~kvstore.sim.engine.EngineModel.next_ready_s`) while the engine had nothing else to run;
* **tick** every ``Router.tick_s`` while other events are left (the conductor's probes).

A step that schedules nothing but begins asynchronous loads takes no time; its KV events
and loads are handed to the hooks and the router at once.

At equal times arrivals come first, so a request arriving exactly at a step's end is in the
next step, as it would be in vLLM's queue.  Per request it records the arrival, the time of
every output token (TTFT = first − arrival; the inter-token gaps, which give TBT) and the
completion; :meth:`Served.record` turns that into the benchmark's own
:class:`~kvstore.bench.serving.runner.Record`, so :func:`kvstore.bench.serving.report.summarise`
computes the figures exactly as it does for real fleets.

External KV (the ``pool`` configuration) plugs in through :class:`Hooks`
(:class:`kvstore.sim.pool.PoolHooks`): each engine's ``lookup_external``, and calls at a
request's arrival, right after a step is scheduled (its loads) and at its end (its saves).
The hooks' coroutines run on the replay simulator's virtual-time event loop
(:func:`kvstore.traces.simulator.run_replay`), which the node's tier manager needs.

No wall clock anywhere: the only clock is ``TraceClock.now``, set to each event's time
before it is handled (the nodes read it).  The only randomness is the profile's jitter,
one ``random.Random`` per engine seeded from ``(seed, engine)``: a run is a pure function of
the workload, the profile, the engine count, the seed and the hooks.

State: a :class:`_Loop` owns its engines, its heap and its records for one run; nothing is
shared between runs.  Invariants: an engine has at most one step in flight; events are
handled in non-decreasing time; every request ends with its ``output_tokens`` tokens or an
error (refused by the engine: a prompt longer than its KV cache); a ``pd`` request is on
one engine at a time (its decode engine gets it only after its prefill engine finished it),
and only its decode engine's tokens are its ``token_s``.
"""

from __future__ import annotations

import dataclasses
import heapq
import random
from collections.abc import Sequence
from typing import Any, Protocol

from kvstore.bench.serving.fleet import Engine
from kvstore.bench.serving.front import front_for
from kvstore.bench.serving.runner import Record
from kvstore.bench.serving.workload import Work, Workload
from kvstore.errors import InvalidArgument
from kvstore.sim.engine import BlockHash, EngineModel, LookupExternal, StepResult, engine_block_hashes
from kvstore.sim.profile import EngineProfile
from kvstore.traces.simulator import TraceClock, run_replay

_ARRIVE, _HANDOFF, _CLOSE, _PREFETCH, _STEP_END, _WAKE, _TICK = range(7)  # the order of events at equal times


class Router(Protocol):
    """The fleet's front: picks each request's engine and hears what the engines did (the
    ``conductor`` configuration's is :class:`kvstore.sim.conductor.ConductorRouter`)."""

    tick_s: float | None
    """Seconds between calls of :meth:`tick` while the run has events left (None: never)."""

    def route(
        self, index: int, req_id: str, work: Work, hashes: tuple[BlockHash, ...], now: float
    ) -> int | tuple[int, int] | str:
        """The engine request ``index`` goes to, a (prefill, decode) pair of engines (it
        prefills on the first, then decodes on the second), or why it is refused (answered
        429 at once)."""
        ...

    def step_ended(self, engine: int, result: StepResult) -> None:
        """Engine ``engine``'s step ended at ``result.end_s``: its tokens were sampled and its
        KV events published then."""
        ...

    def tick(self, now: float) -> None: ...

    def attach(self, engines: Sequence[EngineModel]) -> None:
        """The fleet's engines, before the first event (read only)."""
        ...

    def summary(self) -> dict[str, Any]:
        """Figures for the configuration's JSON (merged into it)."""
        ...


def roles(engines: int, prefill: int = 0) -> list[str]:
    """Each engine's role, as the benchmark gives them: ``both``, or with ``prefill`` > 0 the
    first ``prefill`` engines ``prefill`` and the rest ``decode``."""
    if not prefill:
        return ["both"] * engines
    if isinstance(prefill, bool) or not 1 <= prefill < engines:
        raise InvalidArgument(f"--prefill must be between 1 and --engines - 1 ({engines - 1}), got {prefill!r}")
    return ["prefill"] * prefill + ["decode"] * (engines - prefill)


class RoundRobinRouter:
    """The benchmark's own front (:func:`~kvstore.bench.serving.front.front_for`) over the
    engines: :class:`~kvstore.bench.serving.front.RoundRobin` (``baseline``, ``pool``), or
    with prefill engines :class:`~kvstore.bench.serving.front.PrefillDecode` (``pd``: each
    role in turn)."""

    tick_s: float | None = None

    def __init__(self, engines: int, prefill: int = 0) -> None:
        fronts = [Engine(f"engine{i}", f"sim:{i}", role, "") for i, role in enumerate(roles(engines, prefill))]
        self._index = {e.name: i for i, e in enumerate(fronts)}
        self._front = front_for(fronts)

    def route(
        self, index: int, req_id: str, work: Work, hashes: tuple[BlockHash, ...], now: float
    ) -> int | tuple[int, int] | str:
        r = self._front.route(index)
        d = self._index[r.decode.name]
        return d if r.prefill is None else (self._index[r.prefill.name], d)

    def step_ended(self, engine: int, result: StepResult) -> None:
        pass

    def tick(self, now: float) -> None:
        pass

    def attach(self, engines: Sequence[EngineModel]) -> None:
        pass

    def summary(self) -> dict[str, Any]:
        return {}


class Hooks(Protocol):
    """What a configuration with external KV plugs into the fleet (see the module docstring)."""

    def lookup_for(self, engine: int) -> LookupExternal | None:
        """Engine ``engine``'s ``lookup_external`` (None: it never looks up)."""
        ...

    def arrived(self, engine: int, req_id: str, work: Work, hashes: tuple[BlockHash, ...]) -> float | None:
        """The request is queued on ``engine``: the seconds until a prefetch for it lands
        (its :meth:`prefetched` then), or None."""
        ...

    async def prefetched(self, engine: int, req_id: str) -> None:
        """The prefetch :meth:`arrived` started for the request landed."""
        ...

    async def step_started(self, engine: int, result: StepResult) -> None:
        """The step was scheduled at ``result.start_s`` (its loads begin)."""
        ...

    async def step_ended(self, engine: int, result: StepResult) -> None:
        """The step ended at ``result.end_s`` (what it computed may be saved)."""
        ...

    def handoff(self, prefill: int, decode: int, req_id: str) -> float:
        """The request's prefill on engine ``prefill`` finished (its step has ended): the
        seconds until what it saved is committed, when engine ``decode`` gets the request
        (its ``arrived`` follows then)."""
        ...

    def close_session(self, session_id: str) -> None: ...

    def summary(self) -> dict[str, Any]:
        """Figures for the configuration's JSON (merged into it)."""
        ...


@dataclasses.dataclass(slots=True)
class Served:
    """What happened to one request, in virtual seconds."""

    work: Work
    engine: int  # the engine that streams its tokens (pd: the decode engine)
    token_s: list[float] = dataclasses.field(default_factory=list)  # when each output token was sampled
    engine_cache_tokens: int = 0  # at its last admission: the engine's own prefix cache
    store_tokens: int = 0  # and the external pool
    prefill: int = -1  # pd: the engine it prefilled on (-1: none)
    prefill_end_s: float | None = None  # pd: when its prefill engine's answer came (its one token)
    prefill_cache_tokens: int = 0  # pd: the prefill engine's own prefix cache, at its last admission there
    prefill_store_tokens: int = 0
    preemptions: int = 0
    error: str | None = None
    rejected: str | None = None  # refused by the front (why), answered at once

    @property
    def done(self) -> bool:
        return self.error is None and self.rejected is None and len(self.token_s) == self.work.output_tokens

    def record(self, config: str) -> Record:
        """The benchmark's record of this request (token ids are not simulated: zeros)."""
        w = self.work
        r = Record(config, w.index, w.arrival_s, len(w.tokens), w.output_tokens, engine=f"engine{self.engine}")
        if self.prefill >= 0:
            r.prefill_engine = f"engine{self.prefill}"
            if self.prefill_end_s is not None:
                r.prefill_ms = (self.prefill_end_s - w.arrival_s) * 1e3
        if self.rejected is not None:  # as the benchmark records a 429
            r.engine, r.status, r.rejected, r.reject_ms = "", 429, True, 0.0
            r.error = f"HTTP 429: {self.rejected}"
            return r
        if self.error is not None or not self.token_s:
            r.error = self.error or "no token"
            return r
        t = self.token_s
        r.ttft_ms = (t[0] - w.arrival_s) * 1e3
        r.itl_ms = [(b - a) * 1e3 for a, b in zip(t, t[1:])]
        r.e2e_ms = (t[-1] - w.arrival_s) * 1e3
        r.tokens = [0] * len(t)
        r.cached_tokens = self.engine_cache_tokens + self.store_tokens
        return r


@dataclasses.dataclass(frozen=True, slots=True)
class FleetRun:
    """One configuration's run."""

    served: tuple[Served, ...]
    virtual_s: float  # the last event's time
    steps: int  # steps that ran tokens, over all engines
    step_tokens: int

    def records(self, config: str) -> list[Record]:
        return [s.record(config) for s in self.served]

    def prompt_tokens(self) -> dict[str, int]:
        """Prompt tokens of the completed requests by where their KV came from at their last
        admission (the benchmark's ``prompt_tokens``: ``engine_cache + store + recomputed == total``;
        as the benchmark sums its engines' counters, a ``pd`` prompt counts on its prefill
        and on its decode engine)."""
        done = [s for s in self.served if s.done]
        total = sum(len(s.work.tokens) * (2 if s.prefill >= 0 else 1) for s in done)
        cache = sum(s.engine_cache_tokens + s.prefill_cache_tokens for s in done)
        store = sum(s.store_tokens + s.prefill_store_tokens for s in done)
        return {"engine_cache": cache, "store": store, "recomputed": total - cache - store, "total": total}

    def engine_steps(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "tokens_per_step": round(self.step_tokens / self.steps, 2) if self.steps else None,
            "preemptions": sum(s.preemptions for s in self.served),
        }


def workload_hashes(workload: Workload, block_size: int) -> list[tuple[BlockHash, ...]]:
    """Each request's chained engine-block hashes (its trace ids cut into ``block_size``-token
    blocks; the workload's salt separates runs of other tokens)."""
    bt = workload.scaling.block_tokens
    salt = workload.scaling.salt.encode()
    memo: dict[tuple[bytes, int], tuple[BlockHash, ...]] = {}  # shared prefixes are hashed once
    return [
        engine_block_hashes(
            w.hash_ids, len(w.tokens), block_size=block_size, trace_block_tokens=bt, salt=salt, memo=memo
        )
        for w in workload.items
    ]


def run_fleet(
    workload: Workload,
    profile: EngineProfile,
    *,
    engines: int,
    seed: int = 0,
    hooks: Hooks | None = None,
    router: Router | None = None,
    clock: TraceClock | None = None,
    hashes: Sequence[tuple[BlockHash, ...]] | None = None,
    prefill: int = 0,
) -> FleetRun:
    """Run ``workload`` through ``engines`` engine models of ``profile`` (see the module docstring).

    ``router``: the front (default :class:`RoundRobinRouter`, over ``prefill`` prefill
    engines and the rest decode engines when ``prefill`` > 0); ``clock``: the one the hooks'
    nodes read (set to each event's time); ``hashes``: the requests' block hashes if
    computed already (:func:`workload_hashes`)."""
    if isinstance(engines, bool) or not isinstance(engines, int) or engines < 1:
        raise InvalidArgument(f"--engines must be a positive number, got {engines!r}")
    loop = _Loop(
        workload,
        profile,
        engines,
        seed,
        hooks,
        router or RoundRobinRouter(engines, prefill),
        clock or TraceClock(),
        hashes,
    )
    out: list[FleetRun] = []

    async def main() -> None:
        # the task returns nothing: asyncio.Runner formats the main task's repr (its result's
        # too) when it restores the SIGINT handler, which took seconds for a whole trace's run
        out.append(await loop.run())

    run_replay(main())
    return out[0]


class _Loop:
    def __init__(
        self,
        workload: Workload,
        profile: EngineProfile,
        n: int,
        seed: int,
        hooks: Hooks | None,
        router: Router,
        clock: TraceClock,
        hashes: Sequence[tuple[BlockHash, ...]] | None,
    ) -> None:
        self.workload = workload
        self.hooks = hooks
        self.router = router
        self.clock = clock
        self.hashes = hashes if hashes is not None else workload_hashes(workload, profile.block_size)
        if len(self.hashes) != len(workload.items):
            raise InvalidArgument(f"{len(self.hashes)} hash chains for {len(workload.items)} requests")
        self.engines = [
            EngineModel(
                profile,
                rng=random.Random(f"kvstore.sim/{seed}/{i}"),
                lookup_external=hooks.lookup_for(i) if hooks is not None else None,
            )
            for i in range(n)
        ]
        router.attach(self.engines)
        self.busy = [False] * n
        self.pending: list[StepResult | None] = [None] * n
        self.wake: list[float | None] = [None] * n
        self.served: dict[str, Served] = {}
        self.heap: list[tuple[float, int, int, Any]] = []
        self.seq = 0
        self.steps = self.step_tokens = 0

    def push(self, t: float, kind: int, x: Any) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, kind, self.seq, x))

    async def run(self) -> FleetRun:
        for i, w in enumerate(self.workload.items):
            self.push(w.arrival_s, _ARRIVE, i)
        for t, sid in self.workload.closes:
            self.push(t, _CLOSE, sid)
        tick = self.router.tick_s
        if tick is not None and self.heap:
            self.push(0.0, _TICK, None)
        now = 0.0
        while self.heap:
            now, kind, _, x = heapq.heappop(self.heap)
            self.clock.now = now
            if kind == _ARRIVE:
                await self.arrive(x, now)
            elif kind == _HANDOFF:
                await self.handoff(x, now)
            elif kind == _STEP_END:
                self.busy[x] = False
                res = self.pending[x]
                self.pending[x] = None
                if res is not None:
                    if self.hooks is not None:
                        await self.hooks.step_ended(x, res)
                    self.router.step_ended(x, res)
                    self.prefilled(x, res)
                await self.step(x, now)
            elif kind == _TICK:
                assert tick is not None
                self.router.tick(now)
                if self.heap:  # only while something else is to happen
                    self.push(now + tick, _TICK, None)
            elif kind == _PREFETCH:
                if self.hooks is not None:
                    await self.hooks.prefetched(*x)
            elif kind == _WAKE:
                if self.wake[x] == now:
                    self.wake[x] = None
                await self.step(x, now)
            elif self.hooks is not None:  # _CLOSE
                self.hooks.close_session(x)
        stuck = [f"engine{i}: {e.num_unfinished}" for i, e in enumerate(self.engines) if e.num_unfinished]
        if stuck:
            raise RuntimeError(f"the fleet stopped with unfinished requests ({', '.join(stuck)})")
        return FleetRun(tuple(self.served.values()), now, self.steps, self.step_tokens)

    async def arrive(self, i: int, now: float) -> None:
        w = self.workload.items[i]
        req_id = f"r{i}"
        hashes = self.hashes[i]
        e = self.router.route(i, req_id, w, hashes, now)
        if isinstance(e, str):
            self.served[req_id] = Served(w, -1, rejected=e)
            return
        if isinstance(e, tuple):  # pd: the prefill engine first, for one token (as the benchmark sends it)
            p, d = e
            s = self.served[req_id] = Served(w, d, prefill=p)
            await self.send(s, p, req_id, 1, now)
            return
        s = self.served[req_id] = Served(w, e)
        await self.send(s, e, req_id, w.output_tokens, now)

    async def send(self, s: Served, e: int, req_id: str, max_tokens: int, now: float) -> None:
        """Queue request ``req_id`` on engine ``e`` (for ``max_tokens``) and let it step."""
        w = s.work
        hashes = self.hashes[w.index]
        try:
            self.engines[e].add_request(req_id, len(w.tokens), hashes, max_tokens, w.arrival_s)
        except InvalidArgument as err:  # a real engine answers 400: too long for its KV cache
            s.error = str(err)
            return
        if self.hooks is not None:
            lands = self.hooks.arrived(e, req_id, w, hashes)
            if lands is not None:
                self.push(now + lands, _PREFETCH, (e, req_id))
        await self.step(e, now)

    def prefilled(self, e: int, res: StepResult) -> None:
        """pd: the requests whose prefill on engine ``e`` finished in ``res`` go to their
        decode engine once what the prefill saved is committed (``Hooks.handoff``)."""
        for o in res.outputs:
            if not o.finished:
                continue
            s = self.served[o.req_id]
            if s.prefill != e:
                continue
            s.prefill_end_s = res.end_s
            delay = self.hooks.handoff(e, s.engine, o.req_id) if self.hooks is not None else 0.0
            self.push(res.end_s + delay, _HANDOFF, o.req_id)

    async def handoff(self, req_id: str, now: float) -> None:
        s = self.served[req_id]
        await self.send(s, s.engine, req_id, s.work.output_tokens, now)

    async def step(self, e: int, now: float) -> None:
        """Start engine ``e``'s next step at ``now`` unless one is in flight or it has nothing to run."""
        if self.busy[e]:
            return
        eng = self.engines[e]
        res = eng.step(now) if eng.has_work(now) else None
        if res is None or res.idle:
            if res is not None and (res.kv_events or res.loads_started):
                # a step that only began async loads takes no time, but what it did (blocks
                # allocated for the loads, evicting cached ones) is heard as of any step
                if self.hooks is not None:
                    await self.hooks.step_started(e, res)
                    await self.hooks.step_ended(e, res)
                self.router.step_ended(e, res)
            nxt = eng.next_ready_s()
            if nxt is not None and nxt > now:
                pending = self.wake[e]
                if pending is None or nxt < pending:
                    self.wake[e] = nxt
                    self.push(nxt, _WAKE, e)
            elif res is not None:
                raise RuntimeError(f"engine{e} cannot schedule its {eng.num_unfinished} requests and waits for nothing")
            return
        self.busy[e] = True
        self.pending[e] = res
        self.steps += 1
        self.step_tokens += res.num_tokens
        served = self.served
        for a in res.admitted:
            s = served[a.req_id]
            if s.prefill == e:
                s.prefill_cache_tokens, s.prefill_store_tokens = a.cached_tokens - a.external_tokens, a.external_tokens
            else:
                s.engine_cache_tokens, s.store_tokens = a.cached_tokens - a.external_tokens, a.external_tokens
        for rid in res.preempted:
            served[rid].preemptions += 1
        end = res.end_s
        for o in res.outputs:
            s = served[o.req_id]
            if s.prefill != e:  # a prefill engine's one token is not streamed: its answer carries the handoff
                s.token_s.append(end)
        if self.hooks is not None:
            await self.hooks.step_started(e, res)
        self.push(end, _STEP_END, e)

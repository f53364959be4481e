"""The ``conductor`` configuration of ``kvstore sim``: the ``pool`` fleet behind the project's
own conductor, on the fleet's virtual clock.

What decides is :class:`kvstore.conductor.service.Conductor` itself, configured as
``kvstore bench serving`` starts ``kvstore conductor`` (:func:`conductor_config`: the
conductor's own flags and ``config_from``, ``--conductor-args`` and the SLO targets, which
refuse requests only with ``--conductor-reject``): its engines' load accounting
(:class:`~kvstore.conductor.engines.EngineState`), its cost model fitted online, and
:func:`~kvstore.conductor.policy.decide`.  :class:`ConductorRouter` drives it through the
path the HTTP front (:mod:`kvstore.conductor.front`) takes for a streamed request, in the
same order: ``note_prompt``, ``refuse_early``, the pool lookup, ``decide``, ``refused`` or
``dispatched``; at the first token ``first_token`` and ``ttft_seen``; the gaps between
tokens in the request's ``intervals``; at the last token ``ended`` with the front's TBT.
What the conductor is fed, it gets as it would live:

* **each engine's prefix cache**: the engine model's ``BlockStored``/``BlockRemoved``, as
  vLLM publishes them (wire maps: ``block_hashes``, ``parent_block_hash``, the blocks'
  ``token_ids``, ``block_size``, ``medium`` ``GPU``, ``group_idx`` 0), applied to the
  conductor's :class:`~kvstore.conductor.cacheindex.FleetCacheIndex` when the step that
  made them ends (vLLM publishes a step's events after it), by :class:`EventView`, the
  conductor's :class:`~kvstore.conductor.localview.LocalView` with the subscribers' ZMQ
  left out;
* **the pool**: for each request, the leading chunks the fleet's nodes hold and the
  (node, tier) of each (:meth:`kvstore.sim.pool.Pool.match_prefix_locations`, the
  cluster's ``match_prefix_locations``), answered at once (never late);
* **engine load**: every ``--probe-s`` (the conductor's, 1 s) each engine's waiting and
  running requests, as its ``/metrics`` scrape reads them.

``conductor-pd``: the conductor in its ``--pd`` mode over prefill and decode engines
(``roles``): ``decide`` picks both and the handoff's load; the route is the front's
``_dispatch``: ``dispatched`` to the prefill engine at arrival; at its answer (the prefill
request's one token) ``first_token`` and ``ended`` for it, then ``dispatched`` to the
decode engine with the handoff's load, whose first streamed token is ``first_token``
(timed from that dispatch) and ``ttft_seen`` (from arrival).

The conductor's clock is the fleet's (``Conductor(clock=...)``).  Only time is simulated:
the decision takes no virtual time, though its real cost on this machine is measured as
the conductor measures it (``routing.decision_us``).  Engine ``i`` is ``engine{i}`` and
loads through its node (``node{j}``, ``j`` from ``node_of``: ``--nodes``).

State: a :class:`ConductorRouter` and its conductor belong to one fleet run, on its loop.
Invariant: ``_sent`` holds exactly the requests dispatched and not yet finished; a pd
request's ``prefill`` is its prefill engine until that one answered, -1 after.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
from collections.abc import Sequence
from typing import Any

from kvstore.bench.serving.workload import Work
from kvstore.conductor.cacheindex import FleetCacheIndex
from kvstore.conductor.cost import Load
from kvstore.conductor.engines import EngineState
from kvstore.conductor.front import _tbt
from kvstore.conductor.localview import LocalView
from kvstore.conductor.policy import PoolMatch
from kvstore.conductor.service import Conductor, ConductorConfig, Sent
from kvstore.errors import InvalidArgument
from kvstore.sim.engine import BlockHash, BlockRemoved, BlockStored, EngineModel, StepResult
from kvstore.sim.pool import Pool, chunk_keys
from kvstore.sim.profile import EngineProfile
from kvstore.traces.simulator import TraceClock

POOL_SPACE = (b"kvstore.sim", 0)
"""The one (fingerprint, chunk size) every simulated engine keys the pool by (one model)."""


def profile_priors(profile: EngineProfile) -> list[str]:
    """The conductor's prior flags for ``profile``'s hardware, as an operator sets them from
    measured rates (``kvstore bench connector``): the prefill rate, the DRAM, NVMe and
    network load rates, and the KV bytes per token.  A prior is what the conductor believes
    of a tier until requests load from it; one whose tier it never sends a request to is
    never corrected (left at the defaults, 1 GB/s over the network, the pool looks slower
    than computing on an H100 and a hot prefix stays on the engines that computed it)."""
    gbps = ",".join(
        f"{b / 1e9:g}" for b in (profile.dram_bandwidth_Bps, profile.nvme_bandwidth_Bps, profile.network_bandwidth_Bps)
    )
    return [
        "--prefill-tokens-per-s",
        f"{1000 / profile.prefill_ms_per_token:g}",
        "--tier-gbps",
        gbps,
        "--bytes-per-token",
        str(profile.kv_bytes_per_token),
    ]


def conductor_config(
    slo_ttft_ms: float,
    slo_tbt_ms: float,
    *,
    reject: bool = False,
    extra: str = "",
    pd: bool = False,
    profile: EngineProfile | None = None,
) -> ConductorConfig:
    """The conductor's configuration as ``kvstore bench serving`` starts it: with ``profile``
    its priors for that hardware (:func:`profile_priors`), then its own flags (``extra``:
    ``--conductor-args``, which may set the priors otherwise), the SLO targets, ``--no-reject``
    unless ``reject``, ``--pd`` with ``pd`` (``conductor-pd``)."""
    from kvstore.conductor.cli import add_arguments, config_from

    p = argparse.ArgumentParser(prog="kvstore conductor", add_help=False, exit_on_error=False)
    add_arguments(p)
    priors = profile_priors(profile) if profile is not None else []
    args = [*priors, *shlex.split(extra), "--slo-ttft-ms", str(slo_ttft_ms), "--slo-tbt-ms", str(slo_tbt_ms)]
    args += [] if reject else ["--no-reject"]
    args += ["--pd"] if pd else []
    try:
        a = p.parse_args(["--engine", "http://sim:1", *args])  # (it wants an engine; the sim adds its own)
    except (argparse.ArgumentError, SystemExit) as e:
        raise InvalidArgument(f"--conductor-args {extra!r}: {e}") from None
    return dataclasses.replace(config_from(a), engines=())


class EventView(LocalView):
    """The conductor's view of each engine's prefix cache, fed in-process: the engines' KV
    events go straight into the :class:`FleetCacheIndex` (as the subscribers would put them)."""

    def __init__(self, engine_ids: Sequence[str], block_size: int) -> None:
        super().__init__()
        self.index = FleetCacheIndex()
        for eid in engine_ids:
            self.index.add_engine(eid, block_size)
        self.events = 0

    def apply(self, engine_id: str, events: list[dict[str, Any]]) -> None:
        self.index.apply(engine_id, events)
        self.events += len(events)

    def follow(self, e: EngineState) -> None:
        return  # every engine is followed from the start

    def drop(self, engine_id: str) -> None:
        self.index.remove_engine(engine_id)

    def clear(self, engine_id: str) -> None:
        self.index.clear(engine_id)

    def match(self, tokens: Sequence[int], engine_ids: Sequence[str]) -> dict[str, int]:
        got: dict[str, int] = self.index.match(tokens, engines=engine_ids)
        return got

    def staleness(self, engine_id: str) -> float:
        return 0.0

    def describe(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        return


@dataclasses.dataclass(slots=True, eq=False)
class _Flight:
    """A request the conductor sent: its engine, the front's record of it, what was dispatched."""

    engine: EngineState  # the engine it decodes on
    sent: Sent
    load: Load  # what the decode engine was dispatched (pd: the handoff)
    work: Work
    hashes: tuple[BlockHash, ...]
    registered: int = 0  # leading blocks the engine has published as stored (for token_ids)
    sent_at: float = 0.0  # when the decode engine was sent it (pd: the prefill's answer)
    prefill: int = -1  # pd: its prefill engine until that one answered (-1: none, or answered)


class ConductorRouter:
    """The ``conductor`` configuration's front (a :class:`kvstore.sim.fleet.Router`; see the
    module docstring)."""

    def __init__(
        self,
        profile: EngineProfile,
        engines: int,
        *,
        pool: Pool,
        cfg: ConductorConfig,
        clock: TraceClock,
        node_of: Sequence[int] | None = None,
        roles: Sequence[str] | None = None,
    ) -> None:
        roles = list(roles) if roles is not None else ["both"] * engines
        if len(roles) != engines:
            raise InvalidArgument(f"{len(roles)} roles for {engines} engines")
        if cfg.pd != ("prefill" in roles):
            raise InvalidArgument("the conductor's --pd and prefill engines go together (conductor-pd)")
        self.profile, self.pool, self.bs = profile, pool, profile.block_size
        self.k = pool.chunk_tokens // profile.block_size
        self.c = Conductor(cfg, clock=clock)
        ids = [f"engine{i}" for i in range(engines)]
        nodes = list(node_of) if node_of is not None else list(range(engines))
        self.states = [
            EngineState(
                eid,
                f"sim://{eid}",
                roles[i],
                static=True,
                chunk_tokens=pool.chunk_tokens,
                block_size=profile.block_size,
                node=f"node{nodes[i]}",
                node_id=f"node{nodes[i]}",
                bytes_per_token=profile.kv_bytes_per_token,
            )
            for i, eid in enumerate(ids)
        ]
        for st in self.states:
            self.c.engines.by_id[st.engine_id] = st
        self.index = {eid: i for i, eid in enumerate(ids)}
        self.view = EventView(ids, profile.block_size)
        self.c.local = self.view
        self.tick_s: float | None = cfg.probe_s
        self._sent: dict[str, _Flight] = {}
        self._models: Sequence[EngineModel] = ()

    def attach(self, engines: Sequence[EngineModel]) -> None:
        """The fleet's engine models (what the probes read)."""
        self._models = engines

    # -- the request's path (front._serve, _dispatch) ----------------------------------------
    def route(
        self, index: int, req_id: str, work: Work, hashes: tuple[BlockHash, ...], now: float
    ) -> int | tuple[int, int] | str:
        c = self.c
        n = len(work.tokens)
        c.note_prompt(n)
        d = c.refuse_early(n, None)
        if d is None:
            where = self.pool.match_prefix_locations(chunk_keys(hashes, self.k))
            pools = {POOL_SPACE: PoolMatch(self.pool.chunk_tokens, tuple((f"node{j}", t) for j, t in where))}
            d, _ = c.decide(list(work.tokens), n, None, pools)
        if d.refused:
            if d.refused in ("ttft", "tbt"):
                c.refused(d.refused, 0.0)
            return d.refused
        assert d.engine is not None
        st = c.engines.by_id[d.engine.engine_id]
        sent = Sent(c.next_id(), d, n, now, tokenized=True, max_tokens=work.output_tokens)
        if d.prefill is not None:  # pd: the prefill engine first; the decode engine at its answer
            pre = c.engines.by_id[d.prefill.engine_id]
            c.dispatched(pre, sent.rid, d.prefill.load)
            p = self.index[pre.engine_id]
            load = d.handoff if d.handoff is not None else d.engine.load
            self._sent[req_id] = _Flight(st, sent, load, work, hashes, prefill=p)
            return p, self.index[st.engine_id]
        load = d.engine.load
        c.dispatched(st, sent.rid, load)
        sent.running_at_start = st.running(now)
        self._sent[req_id] = _Flight(st, sent, load, work, hashes, sent_at=now)
        return self.index[st.engine_id]

    def _prefilled(self, f: _Flight, now: float) -> None:
        """pd: the prefill engine answered (its one token): the conductor hears it as the
        front does, and sends the request on to its decode engine with the handoff's load."""
        c, sent = self.c, f.sent
        d = sent.decision
        assert d.prefill is not None
        pre = c.engines.by_id[d.prefill.engine_id]
        c.first_token(pre, sent, d.prefill.load, now - sent.arrived)
        c.ended(pre, sent.rid, ok=True)
        c.dispatched(f.engine, sent.rid, f.load)
        sent.running_at_start = f.engine.running(now)
        f.prefill, f.sent_at, f.registered = -1, now, 0

    def step_ended(self, engine: int, result: StepResult) -> None:
        eid = self.states[engine].engine_id
        if result.kv_events:
            self.view.apply(eid, [self._wire(ev) for ev in result.kv_events])
        c, now = self.c, result.end_s
        for o in result.outputs:
            f = self._sent.get(o.req_id)
            if f is None:
                continue
            if f.prefill == engine:
                self._prefilled(f, now)
                continue
            sent = f.sent
            if sent.first_token_at is None:
                sent.first_token_at = now
                c.first_token(f.engine, sent, f.load, now - f.sent_at)
                c.ttft_seen(sent, now - sent.arrived)
            elif sent.last_token_at is not None:
                sent.intervals.append(now - sent.last_token_at)
            sent.last_token_at = now
            if o.finished:
                sent.completed = True
                c.ended(f.engine, sent.rid, ok=True, tbt_s=_tbt(sent.intervals), running=sent.running_at_start + 1)
                del self._sent[o.req_id]

    def _wire(self, ev: BlockStored | BlockRemoved) -> dict[str, Any]:
        """One engine event as vLLM publishes it (decoded)."""
        if isinstance(ev, BlockRemoved):
            return {"type": "BlockRemoved", "block_hashes": list(ev.block_hashes), "medium": "GPU", "group_idx": 0}
        f = self._sent.get(ev.req_id)
        start = 0
        if f is not None and ev.parent_block_hash is not None:
            hs = f.hashes
            start = f.registered
            if not (0 < start <= len(hs) and hs[start - 1] == ev.parent_block_hash):
                start = hs.index(ev.parent_block_hash) + 1
        tokens: Sequence[int] = ()
        if f is not None:
            f.registered = start + len(ev.block_hashes)
            tokens = f.work.tokens[start * self.bs : f.registered * self.bs]
        return {
            "type": "BlockStored",
            "block_hashes": list(ev.block_hashes),
            "parent_block_hash": ev.parent_block_hash,
            "token_ids": tokens,
            "block_size": self.bs,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
            "extra_keys": None,
            "group_idx": 0,
        }

    def tick(self, now: float) -> None:
        """The probes: each engine's ``/metrics`` (waiting and running requests)."""
        for st, m in zip(self.states, self._models):
            st.scraped_waiting, st.scraped_running, st.scraped_at = m.num_waiting, m.num_running, now

    def summary(self) -> dict[str, Any]:
        """The benchmark's ``routing`` (the conductor's ``/conductor/state`` record) and the
        view's event count."""
        return {"routing": self.c.routing(), "kv_events": self.view.events}

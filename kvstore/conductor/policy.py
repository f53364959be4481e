"""The decision: which engine serves a request, or whether it is refused (pure; no I/O).

Mooncake's Conductor algorithm, made measurable.  For each candidate engine::

    estimated TTFT = queue wait + prefill of the tokens neither it nor the pool holds
                                + load of the pool's tokens from their tier and node

(the :class:`~kvstore.conductor.cost.CostModel` turns those token counts into seconds).
The lowest estimate wins; estimates within ``tie`` of it count as ties and go to the less
loaded engine (fewer queued prefill tokens, then fewer running decodes).  With SLOs set,
an engine whose predicted time between tokens misses ``slo_tbt_s`` is no candidate, a
request whose best estimated TTFT misses ``slo_ttft_s`` is refused before any engine
spends time on it, and so is one that every placement would cost a target (its own TTFT,
or a running decode's TBT: :func:`_lost`); all only once the model has ``min_samples``
measurements (an uncalibrated model refuses nothing), and the TBT target only while an idle engine would
meet it (when even one decode alone misses it, load is not the cause and refusing
requests would only idle the fleet).

Prefill/decode: the pair is picked by the first token's estimated time, the prefill
engine's estimated TTFT plus the decode engine's handoff (its queue and decodes, and the
prefill's stored chunks loaded from its node's DRAM when both engines share a node, else
pulled over the network: :func:`_pair`), among ``prefill`` engines and the ``decode``
engines that meet the TBT target; near-ties go to the decode engine with the lower
predicted TBT.  The KV goes through the store.

:func:`early_refusal` gives, before the pool lookup and the cache walk, the refusals
:func:`decide` is certain to give whatever the caches hold (a 429 under overload then
costs no RPC).

What an engine holds comes in two parts, both as leading tokens of the prompt:
``local_tokens`` (its own prefix cache, from its KV events) and the pool's chunks
(:class:`PoolMatch`: for each leading chunk the pool holds, its node and tier).  A chunk on
the engine's own node loads from that tier; one on another node is a remote pull.  vLLM
computes at least the prompt's last token, so no hit covers the whole prompt.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Sequence
from typing import NamedTuple

from kvstore.conductor.cost import CostModel, Load


@dataclasses.dataclass(slots=True)  # not frozen: one per engine per request (frozen init costs 3 x)
class EngineLoad:
    """One candidate engine at decision time (the decision reads it, never changes it)."""

    engine_id: str
    role: str  # "both", "prefill" or "decode"
    node_id: str  # the kvstore node it loads through ("": none known: every pool chunk is remote)
    local_tokens: int  # leading prompt tokens its own prefix cache holds
    queued_tokens: float  # prompt tokens queued ahead of a new request
    running: int  # decodes it runs
    sent: int = 0  # requests sent to it so far (exact ties spread over the engines)
    queued_s: float = 0.0  # seconds of work queued ahead of a new request
    # its decodes that still meet the TBT target: (the longest stall each can take, seconds
    # of decoding it has left); filled only with a TBT target set
    at_risk: tuple[tuple[float, float], ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class PoolMatch:
    """The leading chunks the pool holds: ``where[i]`` = (node id, tier) of chunk ``i``."""

    chunk_tokens: int
    where: tuple[tuple[str, str], ...] = ()

    @property
    def tokens(self) -> int:
        return len(self.where) * self.chunk_tokens


NO_POOL = PoolMatch(1)


@dataclasses.dataclass(slots=True)  # not frozen: one per engine per request (frozen init costs twice as much)
class Estimate:
    """One candidate's estimate."""

    engine_id: str
    load: Load
    local_tokens: int  # of the prompt, from its own cache (capped at prompt - 1)
    pool_tokens: int  # loaded from the pool beyond ``local_tokens``
    ttft_s: float
    tbt_s: float

    def source(self) -> str:
        if self.pool_tokens > 0:
            return "pool"
        return "engine" if self.local_tokens > 0 else "compute"


@dataclasses.dataclass(frozen=True, slots=True)
class Decision:
    """Where a request goes (``engine``, and ``prefill`` first in prefill/decode mode) or,
    with ``refused`` set, why it is refused and when to try again."""

    engine: Estimate | None
    prefill: Estimate | None = None
    refused: str = ""
    retry_after_s: int = 0
    reason: str = ""
    handoff: Load | None = None  # prefill/decode: what the decode engine loads from the pool
    handoff_s: float = 0.0
    best_ttft_s: float = math.inf  # refused: the best candidate's estimate
    considered: int = 0  # engines estimated

    @property
    def predicted_ttft_s(self) -> float:
        first = self.prefill or self.engine
        if first is None:  # refused: the best candidate's
            return self.best_ttft_s + self.handoff_s
        return first.ttft_s + self.handoff_s


@dataclasses.dataclass(frozen=True, slots=True)
class Slo:
    ttft_s: float = 0.0  # 0: no target
    tbt_s: float = 0.0
    min_samples: int = 8  # measurements before the model may refuse or exclude anyone
    reject: bool = True  # refuse early what misses; False: the targets only guide placement
    tie: float = 0.05  # estimates within this share (or tie_s) of the best are ties
    tie_s: float = 0.02


def _pool_split(pool: PoolMatch, start: int, end: int, node_id: str) -> tuple[int, int, int]:
    """Tokens ``[start, end)`` of the pool's chunks as (dram, nvme, remote) for an engine on ``node_id``."""
    out = [0, 0, 0]
    c = pool.chunk_tokens
    i = start // c
    while i * c < end and i < len(pool.where):
        lo, hi = max(start, i * c), min(end, (i + 1) * c)
        node, tier = pool.where[i]
        slot = 2 if node != node_id or not node_id else (1 if tier == "nvme" else 0)
        out[slot] += hi - lo
        i += 1
    return out[0], out[1], out[2]


class _Splitter:
    """:func:`_pool_split` for many engines at once: the pool's chunk indices per (node,
    tier), so each engine's split is a few bisections, not a walk over the chunks."""

    def __init__(self, pool: PoolMatch) -> None:
        self.pool = pool
        self._at: dict[tuple[str, str], list[int]] = {}
        for i, (node, tier) in enumerate(pool.where):
            self._at.setdefault((node, "nvme" if tier == "nvme" else "dram"), []).append(i)

    def _count(self, node_id: str, tier: str, lo: int, hi: int) -> int:
        at = self._at.get((node_id, tier))
        return bisect.bisect_left(at, hi) - bisect.bisect_left(at, lo) if at else 0

    def split(self, start: int, end: int, node_id: str) -> tuple[int, int, int]:
        c = self.pool.chunk_tokens
        if end <= start:
            return 0, 0, 0
        first, last = start // c, -(-end // c)  # chunks touched: [first, last)
        if last - first <= 2 or not node_id:
            return _pool_split(self.pool, start, end, node_id)
        # whole chunks strictly inside, plus the two partial ends
        out = [
            self._count(node_id, "dram", first + 1, last - 1) * c,
            self._count(node_id, "nvme", first + 1, last - 1) * c,
            0,
        ]
        out[2] = (last - first - 2) * c - out[0] - out[1]
        for i, part in ((first, (first + 1) * c - start), (last - 1, end - (last - 1) * c)):
            node, tier = self.pool.where[i]
            out[2 if node != node_id else 1 if tier == "nvme" else 0] += part
        return out[0], out[1], out[2]


def estimate(
    model: CostModel, e: EngineLoad, prompt_tokens: int, pool: PoolMatch, splitter: _Splitter | None = None
) -> Estimate:
    """One candidate's estimate (what :func:`decide` computes for every engine)."""
    return _Estimator(model, prompt_tokens, pool, splitter).estimate(e)


class _Estimator:
    """Estimates for one request, engine by engine, as plain floats: the decision runs this
    for every engine per request (64 engines in ``kvstore bench conductor-sim``), so only
    the engines it picks become :class:`Estimate` objects."""

    __slots__ = ("model", "prompt_tokens", "pool", "split", "cap", "pooled", "_tbt")

    def __init__(self, model: CostModel, prompt_tokens: int, pool: PoolMatch, splitter: _Splitter | None = None):
        self.model, self.prompt_tokens, self.pool = model, prompt_tokens, pool
        self.cap = max(prompt_tokens - 1, 0)
        self.pooled = min(pool.tokens, self.cap)
        self.split = (splitter or _Splitter(pool)).split
        self._tbt: dict[int, float] = {}

    def ttft(self, e: EngineLoad) -> float:
        return self.ttft_and_work(e)[0]

    def ttft_and_work(self, e: EngineLoad) -> tuple[float, float]:
        """The estimate, and the request's own work in seconds (its prefill and loads: how
        long the engine's decodes stall while it runs)."""
        local = min(e.local_tokens, self.cap)
        pooled = self.pooled
        b, c, q, d, n, r, k, times = self.model.coefficients(e.engine_id)
        if pooled > local:
            dram, nvme, remote = self.split(local, pooled, e.node_id)
            work = c * (self.prompt_tokens - pooled) + d * dram + n * nvme + r * remote
        else:
            work = c * (self.prompt_tokens - local)
        return (b + work / 1000 + q * e.queued_s + k * e.running) * times, work / 1000 * times

    def tbt(self, e: EngineLoad) -> float:
        t = self._tbt.get(e.running)
        if t is None:
            t = self._tbt[e.running] = self.model.tbt(e.running + 1)
        return t

    def estimate(self, e: EngineLoad) -> Estimate:
        local = min(e.local_tokens, self.cap)
        pooled = self.pooled
        dram = nvme = remote = 0
        if pooled > local:
            dram, nvme, remote = self.split(local, pooled, e.node_id)
        load = Load(
            compute=self.prompt_tokens - max(local, pooled),
            queued_s=e.queued_s,
            dram=dram,
            nvme=nvme,
            remote=remote,
            running=e.running,
        )
        return Estimate(e.engine_id, load, local, max(pooled - local, 0), self.ttft(e), self.tbt(e))


class _Cand(NamedTuple):
    """One engine's figures, before it is picked (cheap: one per engine per request)."""

    ttft_s: float
    tbt_s: float
    engine: EngineLoad
    lost: int = 0  # requests sending it here would likely lose their SLO (see _lost)


def _lost(e: EngineLoad, ttft_s: float, stall_s: float, slo: Slo) -> int:
    """Goodput a placement costs: 1 if the request itself would miss the TTFT target, plus
    each of the engine's decodes that meets the TBT target now and would not after a stall
    of ``stall_s`` (the request's prefill runs in the engine's steps and holds its decodes
    back), counting only decodes still running once the queue ahead of it has drained."""
    n = 1 if slo.ttft_s and ttft_s > slo.ttft_s else 0
    for headroom, left in e.at_risk:
        if stall_s > headroom and left > e.queued_s:
            n += 1
    return n


def _pick(cands: Sequence[_Cand], slo: Slo, key: str) -> _Cand:
    best = min(getattr(c, key) for c in cands)
    near = [c for c in cands if getattr(c, key) <= best * (1 + slo.tie) + slo.tie_s]
    return min(
        near,
        key=lambda c: (
            c.engine.queued_s,
            c.engine.queued_tokens,
            c.engine.running,
            getattr(c, key),
            c.engine.sent,
            c.engine.engine_id,
        ),
    )


def decide(
    model: CostModel,
    engines: Sequence[EngineLoad],
    prompt_tokens: int,
    pool: PoolMatch = NO_POOL,
    slo: Slo | None = None,
    *,
    pd: bool = False,
) -> Decision:
    """The decision for one request of ``prompt_tokens`` tokens (see the module docstring)."""
    slo = slo or Slo()
    calibrated = model.samples >= slo.min_samples
    est = _Estimator(model, prompt_tokens, pool)
    if pd:
        pre = [_Cand(est.ttft(e), est.tbt(e), e) for e in engines if e.role == "prefill"]
        dec = [_Cand(est.ttft(e), est.tbt(e), e) for e in engines if e.role == "decode"]
        if not pre or not dec:
            return Decision(None, refused="no live prefill and decode engines", retry_after_s=1)
        p = _pick(pre, slo, "ttft_s")
        if calibrated and slo.tbt_s and model.tbt(1) <= slo.tbt_s:  # (as below: only what load causes)
            meet = [c for c in dec if c.tbt_s <= slo.tbt_s]
            if not meet and slo.reject:
                return Decision(None, refused="tbt", retry_after_s=1, best_ttft_s=p.ttft_s)
            dec = meet or dec
        p, d, handoff, handoff_s = _pair(model, pre, p, dec, prompt_tokens, pool.chunk_tokens, slo)
        if calibrated and slo.reject and slo.ttft_s and p.ttft_s + handoff_s > slo.ttft_s:
            return Decision(
                None,
                refused="ttft",
                retry_after_s=_retry(p.ttft_s + handoff_s, slo.ttft_s),
                best_ttft_s=p.ttft_s,
                handoff_s=handoff_s,
            )
        return Decision(
            est.estimate(d.engine),
            prefill=est.estimate(p.engine),
            reason="prefill and decode paired by ttft with the handoff",
            handoff=handoff,
            handoff_s=handoff_s,
            considered=len(pre) + len(dec),
        )
    if calibrated and slo.tbt_s:  # targets known: count what each placement costs in goodput
        cands = []
        for e in engines:
            if e.role != "prefill":
                ttft, work = est.ttft_and_work(e)
                cands.append(_Cand(ttft, est.tbt(e), e, _lost(e, ttft, work, slo)))
    else:
        cands = [_Cand(est.ttft(e), est.tbt(e), e) for e in engines if e.role != "prefill"]
    if not cands:
        return Decision(None, refused="no live engine", retry_after_s=1)
    lowest_any = min(c.ttft_s for c in cands)
    ok = cands
    if calibrated and slo.tbt_s and model.tbt(1) <= slo.tbt_s:  # (missed even when idle: load is not why)
        ok = [c for c in cands if c.tbt_s <= slo.tbt_s]
        if not ok:
            if slo.reject:
                return Decision(None, refused="tbt", retry_after_s=1, best_ttft_s=lowest_any)
            ok = cands
    lowest = min(c.ttft_s for c in ok)
    if calibrated and slo.reject and slo.ttft_s and lowest > slo.ttft_s:  # no engine meets it
        return Decision(None, refused="ttft", retry_after_s=_retry(lowest, slo.ttft_s), best_ttft_s=lowest_any)
    least_lost = min(c.lost for c in ok)
    if calibrated and slo.reject and slo.tbt_s and least_lost > 0:
        # every placement costs a target (some engine meets the request's own TTFT, above:
        # what it costs there is decodes' TBT): refused before any engine works on it, it
        # costs none; past the knee a request sent to miss, or to push decodes over, serves
        # nothing the fleet keeps
        return Decision(
            None, refused="tbt", retry_after_s=1, best_ttft_s=lowest_any, reason=f"every placement loses {least_lost}"
        )
    fewest = [c for c in ok if c.lost == least_lost]
    best = _pick(fewest, slo, "ttft_s")
    if best.ttft_s == lowest:
        reason = "lowest ttft"
    elif len(fewest) < len(ok):
        reason = f"fewest SLOs lost ({least_lost})"
    else:
        reason = "near-tie, less loaded"
    return Decision(est.estimate(best.engine), reason=reason, considered=len(cands))


def _pair(
    model: CostModel,
    pre: Sequence[_Cand],
    best: _Cand,
    dec: Sequence[_Cand],
    prompt_tokens: int,
    chunk_tokens: int,
    slo: Slo,
) -> tuple[_Cand, _Cand, Load, float]:
    """The prefill and decode engines whose first token comes soonest: the prefill's estimate
    plus the decode engine's handoff (its queue and decodes, and the stored chunks loaded
    from its node's DRAM when the prefill engine shares that node, else pulled over the
    network).  ``best`` is the prefill engine picked alone (:func:`_pick` by TTFT); for each
    decode engine the candidates are ``best`` and the best prefill engine on the decode
    engine's own node, so a pair costs two handoff estimates per decode engine, not one per
    pair.  Pairs within :attr:`Slo.tie` of the soonest are ties and go to the decode engine
    with the lower predicted TBT, then fewer running."""
    on_node: dict[str, list[_Cand]] = {}
    for c in pre:
        if c.engine.node_id:
            on_node.setdefault(c.engine.node_id, []).append(c)
    local_best = {node: _pick(cs, slo, "ttft_s") for node, cs in on_node.items()}
    pairs: list[tuple[float, _Cand, _Cand, Load, float]] = []
    for d in dec:
        options = [best]
        near = local_best.get(d.engine.node_id) if d.engine.node_id else None
        if near is not None and near is not best:
            options.append(near)
        for p in options:
            handoff = handoff_load(p.engine, d.engine, prompt_tokens, chunk_tokens)
            handoff_s = model.ttft(d.engine.engine_id, handoff)
            pairs.append((p.ttft_s + handoff_s, p, d, handoff, handoff_s))
    soonest = min(x[0] for x in pairs)
    near_pairs = [x for x in pairs if x[0] <= soonest * (1 + slo.tie) + slo.tie_s]
    _, p, d, handoff, handoff_s = min(
        near_pairs,
        key=lambda x: (
            x[2].tbt_s,
            x[2].engine.running,
            x[2].engine.queued_s,
            x[0],
            x[2].engine.sent,
            x[2].engine.engine_id,
        ),
    )
    return p, d, handoff, handoff_s


def early_refusal(
    model: CostModel, engines: Sequence[EngineLoad], prompt_tokens: int, slo: Slo, *, pd: bool = False
) -> Decision | None:
    """A refusal :func:`decide` is certain to give whatever the engines' caches and the pool
    hold, or None (then ask :func:`decide`).

    Each engine is credited with the whole prompt in its own cache: every coefficient of the
    estimate is non-negative, so that is its least possible estimate, and when even the
    least of those misses ``slo.ttft_s`` every full estimate does too (and so the engine
    :func:`decide` picks).  The TBT test does not depend on caches: it is :func:`decide`'s.
    Prefill/decode: the prefill engines' least estimate alone (the handoff only adds)."""
    if model.samples < slo.min_samples or not slo.reject or not (slo.ttft_s or slo.tbt_s):
        return None
    full = [dataclasses.replace(e, local_tokens=prompt_tokens) for e in engines]
    est = _Estimator(model, prompt_tokens, NO_POOL)
    if pd:
        first = [e for e in full if e.role == "prefill"]
        dec = [e for e in full if e.role == "decode"]
        if not first or not dec:
            return None
        if slo.tbt_s and model.tbt(1) <= slo.tbt_s and min(est.tbt(e) for e in dec) > slo.tbt_s:
            return Decision(None, refused="tbt", retry_after_s=1)
    else:
        first = [e for e in full if e.role != "prefill"]
        if not first:
            return None
        if slo.tbt_s and model.tbt(1) <= slo.tbt_s and all(est.tbt(e) > slo.tbt_s for e in first):
            return Decision(None, refused="tbt", retry_after_s=1)
        if slo.tbt_s and model.tbt(1) <= slo.tbt_s:
            first = [e for e in first if est.tbt(e) <= slo.tbt_s]
    least = min(est.ttft(e) for e in first)
    if slo.ttft_s and least > slo.ttft_s:
        return Decision(None, refused="ttft", retry_after_s=_retry(least, slo.ttft_s), best_ttft_s=least)
    return None


def handoff_load(prefill: EngineLoad, decode: EngineLoad, prompt_tokens: int, chunk_tokens: int) -> Load:
    """What the decode engine does for a prompt its prefill engine stored: loads every full
    chunk from DRAM (same node) or over the network, and computes the rest."""
    stored = (max(prompt_tokens - 1, 0) // chunk_tokens) * chunk_tokens
    same = bool(prefill.node_id) and prefill.node_id == decode.node_id
    return Load(
        compute=prompt_tokens - stored,
        queued_s=decode.queued_s,
        running=decode.running,
        dram=stored if same else 0,
        remote=0 if same else stored,
    )


def _retry(estimate_s: float, target_s: float) -> int:
    """Seconds until the queue that makes the estimate miss its target has likely drained."""
    return max(1, min(30, math.ceil(estimate_s - target_s)))

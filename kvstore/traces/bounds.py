"""Oracle bounds: what an eviction policy could reach if it knew what the node cannot.

``kvstore replay TRACE --capacity 5% --bounds`` replays the trace through the node's own
tier manager (:func:`kvstore.traces.simulator.simulate`) with policies that read the future from
the trace, and measures how much of each kind of knowledge the block stream itself holds.
It answers "how much better could a policy be?" with numbers instead of guesses:

* ``oracle-dead-lru`` knows which resident blocks will never be used again and evicts
  them first; otherwise LRU.  The bound of any dead-block predictor.
* ``oracle-next-use`` knows each block's next use and evicts the farthest first (Belady's
  order without bypass, restricted to leaves like every prefix-aware policy here).
* ``oracle-next-use@R2=x`` knows deadness exactly but each conversation turn's next use
  only through a predictor that explains a share ``x`` of the variance of the log reuse
  gap (a regression's prediction: ``μ + x(y − μ) + √(x(1 − x))·σ·Z``, one draw ``Z`` per
  request and next use, so all blocks of one turn share it).
* ``oracle-next-use@R2=x,dead-unknown``: the same predictor, but a block that will never
  be used again gets a prediction drawn like everyone else's: what happens when a
  policy holds on to the blocks it believes in and cannot tell the dead ones.
* With session ids in the trace: ``POLICY+sessions``, the policy with the trace's own hints
  (its closes, the node's idle TTL), and ``oracle-close-at-last-turn``, the same with every
  session closed the moment its last request is stored: the most any close hint can tell
  (which sessions come back, not when).

:func:`predictability` measures what the block stream itself tells: the reuse
probability by the turn of the chain (how many requests have used its first block), the
AUC of the best table of (turn, uses of the block) for "will be used again", and the R²
of the log reuse gap regressed on those features and the previous gap — all fitted on
the trace itself, so optimistic.

Owner: nothing persistent; each oracle is built for one replay and reads a
:class:`FutureUses` of the same trace.  Times are request indices.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import random
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvstore.keys import ChunkKey
from kvstore.traces.format import Close, Trace
from kvstore.traces.optimal import optimal
from kvstore.traces.simulator import DEFAULT_PUT_BATCH, DEFAULT_SESSION_TTL, simulate
from tiers.policy import DEFAULT_POLICY, _PrefixHeapPolicy

if TYPE_CHECKING:
    from kvstore.progress import Progress

_DEAD = -(1 << 62)  # priority of a block known never to be used again: first to go


class FutureUses:
    """For every key of a trace, the sorted request indices that use it."""

    def __init__(self, trace: Trace) -> None:
        self.keys: tuple[tuple[ChunkKey, ...], ...] = trace.keys
        uses: dict[ChunkKey, list[int]] = {}
        for i, ks in enumerate(self.keys):
            for k in ks:
                u = uses.setdefault(k, [])
                if not u or u[-1] != i:
                    u.append(i)
        self._uses = uses
        gaps = [math.log(b - a) for u in uses.values() for a, b in zip(u, u[1:])]
        self.log_gap_mean = float(np.mean(gaps)) if gaps else 0.0
        self.log_gap_sd = float(np.std(gaps)) if gaps else 0.0

    def next_after(self, key: ChunkKey, now: int) -> int | None:
        u = self._uses.get(key)
        if not u:
            return None
        j = bisect.bisect_right(u, now)
        return u[j] if j < len(u) else None


class _OraclePolicy(_PrefixHeapPolicy):
    """A prefix-aware heap policy whose priorities read the future.

    :meth:`advance` is the clock (the simulator calls it before each request); it also
    re-prioritises the resident blocks of the previous request, whose next use moved on
    even where the node did not touch them (a block stored again after a miss is not).
    """

    def __init__(self, future: FutureUses) -> None:
        super().__init__()
        self._future = future
        self._now = 0

    def advance(self, request: int) -> None:
        self._now = request
        if request > 0:
            for k in self._future.keys[request - 1]:
                if k in self._prio:
                    self._touch(k, False)


class OracleDeadLRU(_OraclePolicy):
    """LRU that evicts blocks never used again first."""

    name = "oracle-dead-lru"

    def _priority(self, key: ChunkKey, new: bool) -> int:
        return 0 if self._future.next_after(key, self._now) is None else 1


class OracleNextUse(_OraclePolicy):
    """Evicts the leaf whose (predicted) next use is farthest; see the module docstring."""

    def __init__(self, future: FutureUses, r2: float = 1.0, *, dead_known: bool = True, seed: int = 1) -> None:
        super().__init__(future)
        if not 0.0 <= r2 <= 1.0:
            raise ValueError(f"r2 must be in [0, 1], got {r2}")
        self.r2 = r2
        self.dead_known = dead_known
        self._rng = random.Random(seed)
        self._draws: dict[tuple[int, int | None], float] = {}
        self.name = (
            "oracle-next-use" if r2 == 1.0 else f"oracle-next-use@R2={r2:g}" + ("" if dead_known else ",dead-unknown")
        )

    def _priority(self, key: ChunkKey, new: bool) -> int:
        nxt = self._future.next_after(key, self._now)
        if nxt is None and self.dead_known:
            return _DEAD
        if self.r2 == 1.0 and nxt is not None:
            return -nxt
        turn = (self._now, nxt)
        pred = self._draws.get(turn)
        if pred is None:
            mu, sd = self._future.log_gap_mean, self._future.log_gap_sd
            y = math.log(nxt - self._now) if nxt is not None else self._rng.gauss(mu, sd)
            pred = mu + self.r2 * (y - mu) + math.sqrt(self.r2 * (1 - self.r2)) * sd * self._rng.gauss(0.0, 1.0)
            self._draws[turn] = pred
        return -int((self._now + math.exp(pred)) * 1000)


@dataclasses.dataclass(frozen=True, slots=True)
class Bound:
    name: str
    hit_ratio: float
    gap_closed: float | None
    what: str


@dataclasses.dataclass(frozen=True, slots=True)
class Predictability:
    """What the block stream tells about reuse, fitted in-sample (optimistic)."""

    reuse_probability: dict[str, float]  # by chain turn: "1", "2", "3+"
    reuse_auc: float  # of the best (turn, uses) table for "used again"
    gap_r2: float  # share of log reuse-gap variance explained by (turn, uses, previous gap)
    samples: int


@dataclasses.dataclass(frozen=True, slots=True)
class BoundsReport:
    capacity_blocks: int
    bounds: tuple[Bound, ...]
    predictability: Predictability

    def to_json(self) -> dict[str, object]:
        return {
            "capacity_blocks": self.capacity_blocks,
            "bounds": [dataclasses.asdict(b) for b in self.bounds],
            "predictability": dataclasses.asdict(self.predictability),
        }


R2_LEVELS = (0.25, 0.5)


def bounds(
    trace: Trace,
    capacity_blocks: int,
    policy: str = DEFAULT_POLICY,
    *,
    batch: int = DEFAULT_PUT_BATCH,
    progress: Progress | None = None,
    session_ttl: float = DEFAULT_SESSION_TTL,
) -> BoundsReport:
    """LRU, ``policy``, the oracles and the optimum at one capacity, and :func:`predictability`.
    ``progress`` counts each replay as it ends."""

    def done(name: str, h: float) -> float:
        if progress is not None:
            progress.update(note=f"{name}: {100 * h:.2f}%")
        return h

    hints = trace.has_sessions
    if progress is not None:
        # lru, optimum, policy, oracles, predictability, and the two hinted replays
        progress.total = 3 + (policy != "lru") + 3 + len(R2_LEVELS) + 2 * hints
    future = FutureUses(trace)
    lru = done("lru", simulate(trace, capacity_blocks, "lru", batch=batch).hit_ratio)
    opt = done("optimal", optimal(trace, capacity_blocks).hit_ratio)

    def closed(h: float) -> float | None:
        return (h - lru) / (opt - lru) if opt - lru > 1e-9 else None

    rows = [Bound("lru", lru, closed(lru), "baseline")]
    if policy != "lru":
        h = done(policy, simulate(trace, capacity_blocks, policy, batch=batch).hit_ratio)
        rows.append(Bound(policy, h, closed(h), "the policy (what the node runs)"))
    oracles: list[tuple[_OraclePolicy, str]] = [
        (OracleDeadLRU(future), "LRU that knows which blocks are never used again"),
        *(
            (OracleNextUse(future, r2), f"knows dead blocks; predicts next use with R²={r2:g} on the log gap")
            for r2 in R2_LEVELS
        ),
        (
            OracleNextUse(future, R2_LEVELS[-1], dead_known=False),
            f"R²={R2_LEVELS[-1]:g} predictor, cannot tell dead blocks",
        ),
        (OracleNextUse(future), "knows every next use (Belady's order, no bypass)"),
    ]
    for pol, what in oracles:
        h = done(pol.name, simulate(trace, capacity_blocks, pol, batch=batch, before_request=pol.advance).hit_ratio)
        rows.append(Bound(pol.name, h, closed(h), what))
    if hints:
        for t, name, what in (
            (trace, f"{policy}+sessions", "the policy with the trace's session hints"),
            (
                closes_at_last_turn(trace),
                "oracle-close-at-last-turn",
                "the policy, every session closed as its last turn ends (which sessions come back)",
            ),
        ):
            h = done(
                name,
                simulate(t, capacity_blocks, policy, batch=batch, sessions=True, session_ttl=session_ttl).hit_ratio,
            )
            rows.append(Bound(name, h, closed(h), what))
    rows.append(Bound("optimal", opt, closed(opt), "Belady's MIN with bypass"))
    pred = predictability(trace, future)
    if progress is not None:
        progress.update(note="predictability")
    return BoundsReport(capacity_blocks, tuple(rows), pred)


def closes_at_last_turn(trace: Trace) -> Trace:
    """``trace`` with its close events replaced by one per session, right after the session's
    last request (at that request's timestamp): a perfect, immediate close hint."""
    last: dict[str, int] = {}
    for i, r in enumerate(trace.requests):
        if r.session_id is not None:
            last[r.session_id] = i
    closes = [Close(trace.requests[i].timestamp, sid, i + 1) for sid, i in last.items()]
    return Trace(trace.requests, block_tokens=trace.block_tokens, name=trace.name, salt=trace.salt, closes=closes)


def _auc(score: np.ndarray, label: np.ndarray) -> float:
    """Area under the ROC curve (Mann–Whitney, ties at average rank)."""
    pos = int(label.sum())
    neg = len(label) - pos
    if pos == 0 or neg == 0:
        return float("nan")
    _, inv, counts = np.unique(score, return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)
    avg_rank = ends - (counts - 1) / 2.0  # 1-based average rank of each distinct score
    ranks = avg_rank[inv]
    return float((ranks[label].sum() - pos * (pos + 1) / 2) / (pos * neg))


def _r2(x: np.ndarray, y: np.ndarray) -> float:
    """In-sample R² of an ordinary least-squares fit of ``y`` on ``x`` (plus an intercept)."""
    if len(y) < x.shape[1] + 2:
        return float("nan")
    a = np.column_stack([np.ones(len(y)), x])
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    resid = y - a @ coef
    tot = float(((y - y.mean()) ** 2).sum())
    return 1.0 - float((resid**2).sum()) / tot if tot > 0 else float("nan")


def predictability(trace: Trace, future: FutureUses | None = None) -> Predictability:
    """Features the node can see at each block use, against when the block is used next.

    Per use of a block in request ``i``: the chain's turn (requests so far whose first
    block is this request's first block), the block's uses so far, and its previous gap.
    """
    keys: Sequence[tuple[ChunkKey, ...]] = trace.keys
    future = future or FutureUses(trace)
    root_uses: dict[ChunkKey, int] = {}
    uses: dict[ChunkKey, int] = {}
    last: dict[ChunkKey, int] = {}
    turn_l, uses_l, prev_l, nxt_l = [], [], [], []
    for i, ks in enumerate(keys):
        if not ks:
            continue
        t = root_uses[ks[0]] = root_uses.get(ks[0], 0) + 1
        for k in ks:
            u = uses[k] = uses.get(k, 0) + 1
            p = last.get(k)
            last[k] = i
            n = future.next_after(k, i)
            turn_l.append(t)
            uses_l.append(u)
            prev_l.append(i - p if p is not None else 0)
            nxt_l.append(n - i if n is not None else 0)
    turn, use, prev, gap = (np.asarray(v, dtype=np.int64) for v in (turn_l, uses_l, prev_l, nxt_l))
    reused = gap > 0
    prob = {}
    for label, sel in (("1", turn == 1), ("2", turn == 2), ("3+", turn >= 3)):
        prob[label] = float(reused[sel].mean()) if sel.any() else float("nan")
    cell = np.minimum(turn, 8) * 16 + np.minimum(use, 8)  # the (turn, uses) table, capped at 8 each
    rate = np.zeros(cell.max() + 1 if len(cell) else 1)
    if len(cell):
        rate = np.bincount(cell, weights=reused).astype(float) / np.maximum(np.bincount(cell), 1)
    auc = _auc(rate[cell], reused) if len(cell) else float("nan")
    r = reused
    has_prev = prev[r] > 0
    x = np.column_stack(
        [np.log(turn[r]), np.log(use[r]), has_prev, np.where(has_prev, np.log(np.maximum(prev[r], 1)), 0.0)]
    )
    gap_r2 = _r2(x, np.log(gap[r].astype(float))) if r.any() else float("nan")
    return Predictability(reuse_probability=prob, reuse_auc=auc, gap_r2=gap_r2, samples=int(len(gap)))

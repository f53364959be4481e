"""Capacity sweeps: hit ratios of several policies and the optimum over a list of capacities.

Pure orchestration over :func:`kvstore.traces.simulator.simulate` and :func:`kvstore.traces.optimal.optimal`;
independent replays run in worker processes (each gets the trace once, at start-up).
``jobs=1`` runs everything in this process (tests, small traces).  Results do not depend
on ``jobs``: every replay is deterministic.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import TYPE_CHECKING

from kvstore.traces.format import Trace
from kvstore.traces.optimal import optimal
from kvstore.traces.simulator import DEFAULT_PUT_BATCH, check_capacity, check_policy, simulate

if TYPE_CHECKING:
    from kvstore.progress import Progress

DEFAULT_FRACTIONS = (0.01, 0.02, 0.05, 0.10, 0.20, 0.50)
"""The sweep's capacities, as fractions of a trace's unique blocks."""
OPTIMAL = "optimal"


@dataclasses.dataclass(frozen=True, slots=True)
class SweepPoint:
    capacity_blocks: int
    fraction: float  # of the trace's unique blocks
    hit_ratio: dict[str, float]  # policy name (and "optimal") -> prefix hit ratio
    hit_tokens: dict[str, int]


def capacities_for(trace: Trace, fractions: Sequence[float]) -> list[int]:
    out = sorted({max(1, round(trace.unique_blocks * f)) for f in fractions})
    return [check_capacity(c) for c in out]


_trace: Trace | None = None


def _init(trace: Trace) -> None:
    global _trace
    _trace = trace


def _one(job: tuple[str, int, int]) -> tuple[str, int, float, int]:
    name, capacity, batch = job
    assert _trace is not None
    r = optimal(_trace, capacity) if name == OPTIMAL else simulate(_trace, capacity, name, batch=batch)
    return name, capacity, r.hit_ratio, r.hit_tokens


def _done(r: tuple[str, int, float, int], progress: Progress | None) -> tuple[str, int, float, int]:
    if progress is not None:
        progress.update(note=f"{r[0]} at {r[1]:,} blocks: {100 * r[2]:.1f}%")
    return r


def run_jobs(
    trace: Trace, jobs_list: list[tuple[str, int, int]], jobs: int, progress: Progress | None = None
) -> list[tuple[str, int, float, int]]:
    """Every ``(policy, capacity, batch)`` replay; ``progress`` counts each one as it ends."""
    if progress is not None:
        progress.total = (progress.total or 0) + len(jobs_list)
    if jobs <= 1 or len(jobs_list) <= 1:
        _init(trace)
        return [_done(_one(j), progress) for j in jobs_list]
    # the slow ones first, so a worker is not left with a long replay at the end
    order = sorted(jobs_list, key=lambda j: (j[0] == OPTIMAL, -j[1]))
    with ProcessPoolExecutor(max_workers=min(jobs, len(order)), initializer=_init, initargs=(trace,)) as ex:
        return [_done(r, progress) for r in ex.map(_one, order)]


def sweep(
    trace: Trace,
    capacities: Sequence[int],
    policies: Sequence[str],
    *,
    batch: int = DEFAULT_PUT_BATCH,
    jobs: int | None = None,
    progress: Progress | None = None,
) -> list[SweepPoint]:
    """Every policy and the optimum at every capacity, smallest capacity first."""
    for p in policies:
        check_policy(p)
    caps = sorted({check_capacity(c) for c in capacities})
    names = [*dict.fromkeys(policies), OPTIMAL]
    results = run_jobs(
        trace,
        [(n, c, batch) for c in caps for n in names],
        jobs if jobs is not None else (os.cpu_count() or 1),
        progress,
    )
    ratio = {(n, c): h for n, c, h, _ in results}
    tokens = {(n, c): t for n, c, _, t in results}
    return [
        SweepPoint(c, c / trace.unique_blocks, {n: ratio[(n, c)] for n in names}, {n: tokens[(n, c)] for n in names})
        for c in caps
    ]


def smallest_capacity(
    trace: Trace,
    policy: str,
    target: float,
    lo: int,
    hi: int,
    *,
    batch: int = DEFAULT_PUT_BATCH,
    rel: float = 0.01,
    progress: Progress | None = None,
) -> int:
    """Smallest capacity in ``(lo, hi]`` whose hit ratio reaches ``target``, by bisection.

    Assumes the hit ratio at ``hi`` reaches ``target`` and grows with capacity (true of the
    optimum; true up to small wiggles of the online policies, so the answer is within
    ``rel`` of the smallest capacity that reaches it, or just above a wiggle).
    """

    def ratio(c: int) -> float:
        h = optimal(trace, c).hit_ratio if policy == OPTIMAL else simulate(trace, c, policy, batch=batch).hit_ratio
        if progress is not None:
            progress.update(note=f"bisecting {policy}: {c:,} blocks give {100 * h:.1f}%")
        return h

    while hi - lo > max(1, int(lo * rel)):
        mid = (lo + hi) // 2
        if ratio(mid) >= target:
            hi = mid
        else:
            lo = mid
    return hi


@dataclasses.dataclass(frozen=True, slots=True)
class GridPoint:
    """One DRAM × NVMe split of a two-tier sweep (``nvme_blocks`` 0: DRAM only)."""

    dram_blocks: int
    nvme_blocks: int
    hit_ratio: float
    hit_tokens: int
    dram_hits: int  # hit blocks the lookups found in DRAM
    nvme_hits: int  # ... and in NVMe


def _one_split(job: tuple[str, int, int, int]) -> GridPoint:
    name, dram, nvme, batch = job
    assert _trace is not None
    r = simulate(_trace, dram, name, batch=batch, nvme_blocks=nvme)
    by_tier = dict(r.tier_hits)
    return GridPoint(dram, nvme, r.hit_ratio, r.hit_tokens, by_tier.get("dram", 0), by_tier.get("nvme", 0))


def grid(
    trace: Trace,
    dram_capacities: Sequence[int],
    nvme_capacities: Sequence[int],
    policy: str,
    *,
    batch: int = DEFAULT_PUT_BATCH,
    jobs: int | None = None,
    progress: Progress | None = None,
) -> list[GridPoint]:
    """Every ``(DRAM, NVMe)`` split through the node's two tier managers (NVMe 0: DRAM only),
    in DRAM-major order, smallest first.  Deterministic whatever ``jobs``."""
    check_policy(policy)
    drams = sorted({check_capacity(c) for c in dram_capacities})
    nvmes = sorted({c if c == 0 else check_capacity(c) for c in nvme_capacities})
    work = [(policy, d, n, batch) for d in drams for n in nvmes]
    if progress is not None:
        progress.total = (progress.total or 0) + len(work)

    def done(p: GridPoint) -> GridPoint:
        if progress is not None:
            progress.update(note=f"DRAM {p.dram_blocks:,} + NVMe {p.nvme_blocks:,} blocks: {100 * p.hit_ratio:.1f}%")
        return p

    n_jobs = jobs if jobs is not None else (os.cpu_count() or 1)
    if n_jobs <= 1 or len(work) <= 1:
        _init(trace)
        points = [done(_one_split(j)) for j in work]
    else:
        order = sorted(work, key=lambda j: -(j[1] + j[2]))  # the slow (large) ones first
        with ProcessPoolExecutor(max_workers=min(n_jobs, len(order)), initializer=_init, initargs=(trace,)) as ex:
            points = [done(p) for p in ex.map(_one_split, order)]
    return sorted(points, key=lambda p: (p.dram_blocks, p.nvme_blocks))

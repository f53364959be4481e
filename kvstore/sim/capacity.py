"""``kvstore sim --capacity``: the highest offered rate at which a configuration still meets
its SLO for at least 90 % of requests.

The SLO is the benchmark's own (:func:`kvstore.bench.serving.report.summarise`: a request
meets it when it completed, its TTFT is within ``--slo-ttft-ms`` and its TBT, if it has
one, within ``--slo-tbt-ms``; ``slo_met`` is the share of all requests, refused and failed
ones included, that did).  The offered rate is the workload's ``--rate`` scaling
(:func:`at_rate`: the same arrivals ``kvstore bench serving --rate R`` would send, and the
session closes with them); the tokens, hence the prefix sharing, do not change with it.

The search (:func:`find_capacity`) is a pure function of ``run``, a deterministic run of
the fleet at a rate: from the workload's own rate it doubles (or halves) the rate until
one run meets the target and another does not, then bisects between them (geometrically)
until the two are within ``tolerance`` of each other.  The answer is the highest rate
seen that met the target.  It assumes that meeting the target is monotone in the rate,
which holds for a fleet's queues (more load never shortens them) up to the noise of
batching; where it does not, the answer is still a rate that met the target, one of the
steps reported.  A search that finds no rate meeting the target down to
``start / 2**max_halvings`` answers 0.

State: none; each call owns its steps.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from kvstore.bench.serving.workload import Workload
from kvstore.errors import InvalidArgument

SLO_TARGET = 0.9
"""The share of requests that must meet the SLO at capacity (the issue's: >= 90 %)."""
DEFAULT_TOLERANCE = 0.02
"""Bisection stops once the passing and the failing rate are within this share of each other."""


def at_rate(workload: Workload, rate: float) -> Workload:
    """``workload`` offered at ``rate`` requests/s: its arrivals (and session closes) rescaled
    as :func:`kvstore.bench.serving.workload.build` does for ``--rate`` (equal up to float
    rounding), its scaling's ``rate`` set; the same requests, tokens and hashes."""
    if not rate > 0 or not math.isfinite(rate):
        raise InvalidArgument(f"the offered rate must be a positive number of requests/s, got {rate}")
    items = workload.items
    span = workload.duration_s
    n = len(items)
    if n > 1 and span > 0:
        stretch = (n - 1) / rate / span
        new = [dataclasses.replace(w, arrival_s=w.arrival_s * stretch) for w in items]
        closes = tuple((t * stretch, sid) for t, sid in workload.closes)
    else:  # every request at once (or only one): one every 1/rate s, as build does
        stretch = 1.0
        new = [dataclasses.replace(w, arrival_s=i / rate) for i, w in enumerate(items)]
        closes = workload.closes
    return dataclasses.replace(
        workload, scaling=dataclasses.replace(workload.scaling, rate=rate), items=tuple(new), closes=closes
    )


@dataclasses.dataclass(frozen=True, slots=True)
class Capacity:
    """A search's answer: ``capacity_rps`` (0: no rate tried met the target) and every run,
    in the order they ran, as (rate, share of requests that met the SLO)."""

    capacity_rps: float
    steps: tuple[tuple[float, float], ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "capacity_rps": round(self.capacity_rps, 4),
            "steps": [{"rate_rps": round(r, 4), "slo_met": m} for r, m in self.steps],
        }


def find_capacity(
    run: Callable[[float], float],
    start: float,
    *,
    target: float = SLO_TARGET,
    tolerance: float = DEFAULT_TOLERANCE,
    max_doublings: int = 12,
    max_halvings: int = 12,
) -> Capacity:
    """The highest rate at which ``run(rate)`` (the share of requests meeting the SLO) is at
    least ``target``, to within ``tolerance`` (see the module docstring)."""
    if not start > 0 or not math.isfinite(start):
        raise InvalidArgument(f"the search must start at a positive rate, got {start}")
    if not 0 < tolerance < 1:
        raise InvalidArgument(f"--capacity-tolerance must be in (0, 1), got {tolerance}")
    steps: list[tuple[float, float]] = []

    def ok(rate: float) -> bool:
        met = run(rate)
        steps.append((rate, met))
        return met >= target

    lo: float | None = None  # the highest rate known to pass
    hi: float | None = None  # the lowest rate known to fail
    if ok(start):
        lo = start
        for _ in range(max_doublings):
            r = lo * 2
            if not ok(r):
                hi = r
                break
            lo = r
        else:  # never failed: the fleet keeps up with anything tried
            return Capacity(lo, tuple(steps))
    else:
        hi = start
        for _ in range(max_halvings):
            r = hi / 2
            if ok(r):
                lo = r
                break
            hi = r
        else:
            return Capacity(0.0, tuple(steps))
    assert lo is not None and hi is not None
    while hi / lo > 1 + tolerance:
        mid = math.sqrt(lo * hi)
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return Capacity(lo, tuple(steps))

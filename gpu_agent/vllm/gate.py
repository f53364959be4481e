"""Load only when it pays: the load gate (``load_gate``), pure and clock-free.

Reusing a hit pays when loading it takes less time than recomputing its tokens (the
Mooncake paper's break-even: a tier's bandwidth above KV bytes per token × prefill tokens
per second), **fixed cost included**: a load pays RPCs, pins and a thread hop whatever its
size, so a small hit can cost more than its recompute even from DRAM (peers measured that
this floor, not bandwidth, decides for small hits).  Both sides are measured by the engine
as it runs, from the workers' stats:

* recompute: seconds per token of the steps that prefill (``prefill_step_us`` over
  ``prefill_step_tokens``: the step's forward pass over the tokens it scheduled); a hit's
  tokens would have been computed in a step that runs anyway, so the marginal cost per
  token is what a load saves;
* load, per kind of load: ``local`` (the engine's own node, DRAM), ``nvme`` (its own node,
  promoted from NVMe first) and ``remote`` (pulled from another node first), each an affine
  cost ``fixed + per_token × tokens`` (:class:`LoadCost`) fit to ``load_<kind>_us``,
  ``load_<kind>_tokens`` and ``load_<kind>_n`` (loads) by decayed least squares.  A load is
  of its slowest chunk's kind (one request's load waits for all of its chunks).

For a hit the gate loads the leading chunks whose saving (recompute of their tokens less
the load's predicted cost) is largest, nothing if no prefix saves time.  Savings are
counted at the engine's current batch (``batch``: the requests one step runs, this one
included): a recompute lengthens the step every one of them waits for, and so does a load
made in the step; a load made in the background (``background``: the kinds the scheduler
loads asynchronously) holds up only its own request, so its cost is weighed once against
a recompute that costs the whole batch.  Each estimate is
decayed (recent loads weigh most).  A kind with no measurement yet, or an engine that has
not prefilled yet, loads: the gate learns from loads it lets through.  A hit the gate cut
short is still loaded whole once every ``explore`` times, so a tier that recovers (a node
no longer overloaded) is found.

State: :class:`LoadGate` belongs to the scheduler half (its thread only).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from typing import Any

KINDS = ("local", "nvme", "remote")
PREFILL_STEP_TOKENS = 32
"""A step that prefills at least this many tokens measures the engine's recompute rate."""


def background_kinds(async_loads: str) -> tuple[str, ...]:
    """The kinds of load the connector makes in the background under its ``async_loads``
    setting (``auto``: from NVMe or another node; ``always``: all; ``never``: none)."""
    return KINDS if async_loads == "always" else ("nvme", "remote") if async_loads == "auto" else ()


@dataclasses.dataclass
class Rate:
    """Seconds per token, a ratio of exponentially decayed sums."""

    decay: float = 0.9
    seconds: float = 0.0
    tokens: float = 0.0
    samples: int = 0

    def add(self, seconds: float, tokens: float) -> None:
        if tokens <= 0 or seconds < 0:
            return
        self.seconds = self.seconds * self.decay + seconds
        self.tokens = self.tokens * self.decay + tokens
        self.samples += 1

    def per_token(self, min_samples: int = 1) -> float | None:
        return self.seconds / self.tokens if self.samples >= min_samples and self.tokens > 0 else None


@dataclasses.dataclass
class LoadCost:
    """Seconds one load of a kind takes, ``fixed_s + per_token_s × tokens``, fit by least
    squares over exponentially decayed sums of ``(loads, tokens, seconds)`` samples (a
    sample may aggregate several loads: one engine step's).  While the samples cannot tell
    the fixed part from the per-token part (every load of one size), the cost is taken
    proportional to tokens (the prediction at the sizes seen is right either way)."""

    decay: float = 0.9
    samples: int = 0
    _sums: list[float] = dataclasses.field(default_factory=lambda: [0.0] * 8)  # n, t, s, nn, nt, tt, ns, ts

    def add(self, seconds: float, tokens: float, loads: float = 1.0) -> None:
        if tokens <= 0 or seconds < 0 or loads <= 0:
            return
        x = (loads, tokens, seconds, loads * loads, loads * tokens, tokens * tokens, loads * seconds, tokens * seconds)
        self._sums = [v * self.decay + d for v, d in zip(self._sums, x)]
        self.samples += 1

    def fit(self, min_samples: int = 1) -> tuple[float, float] | None:
        """``(fixed_s, per_token_s)``, both ≥ 0, or None before ``min_samples`` samples."""
        n, t, s, nn, nt, tt, ns, ts = self._sums
        if self.samples < min_samples or t <= 0:
            return None
        det = nn * tt - nt * nt
        if det > 1e-9 * nn * tt:  # the sizes vary enough to separate the two parts
            fixed, per = (ns * tt - ts * nt) / det, (nn * ts - nt * ns) / det
            if fixed >= 0 and per >= 0:
                return fixed, per
            if per < 0:
                return s / n, 0.0
        return 0.0, s / t

    def predict(self, tokens: float, min_samples: int = 1) -> float | None:
        """Seconds one load of ``tokens`` is expected to take (None: not measured yet)."""
        f = self.fit(min_samples)
        return None if f is None else f[0] + f[1] * tokens

    def per_token(self, min_samples: int = 1) -> float | None:
        """Seconds per token over everything measured (fixed costs spread over tokens)."""
        n, t, s, *_ = self._sums
        return s / t if self.samples >= min_samples and t > 0 else None


class LoadGate:
    """Which leading chunks of a hit load (see the module docstring)."""

    def __init__(self, enabled: bool = True, *, margin: float = 1.0, explore: int = 20, min_samples: int = 3) -> None:
        self.enabled, self.margin, self.explore, self.min_samples = enabled, margin, explore, min_samples
        self.recompute = Rate()
        self.loads = {k: LoadCost() for k in KINDS}
        self._gated = 0

    def observe(self, data: Mapping[str, Any]) -> None:
        """Take the workers' stats of one step (their counters' deltas).  ``load_<kind>_n``
        (how many loads) is 1 when a sender does not count them."""
        self.recompute.add(float(data.get("prefill_step_us", 0)) / 1e6, float(data.get("prefill_step_tokens", 0)))
        for k in KINDS:
            tokens = float(data.get(f"load_{k}_tokens", 0))
            loads = float(data.get(f"load_{k}_n", 1 if tokens > 0 else 0))
            self.loads[k].add(float(data.get(f"load_{k}_us", 0)) / 1e6, tokens, loads)

    def saving(self, kind: str, tokens: int, *, batch: float = 1.0, background: bool = False) -> float | None:
        """Request-seconds a load of ``tokens`` of ``kind`` is expected to save over
        recomputing them, summed over a step of ``batch`` requests (negative: it costs
        more); None while either side is unmeasured.  A load in the step and the recompute
        both hold up the whole batch; a ``background`` load holds up only its request."""
        recompute = self.recompute.per_token(self.min_samples)
        load = self.loads[kind].predict(tokens, self.min_samples)
        if recompute is None or load is None:
            return None
        n = max(1.0, batch)
        return n * recompute * self.margin * tokens - (load if background else n * load)

    def pays(self, kind: str, tokens: int = 1, *, batch: float = 1.0, background: bool = False) -> bool:
        """Whether loading ``tokens`` of ``kind`` in one load is expected to beat recomputing them."""
        if not self.enabled:
            return True
        gain = self.saving(kind, tokens, batch=batch, background=background)
        return gain is None or gain > 0

    def leading(
        self,
        kinds: Sequence[str],
        chunk_tokens: int = 1,
        *,
        batch: float = 1.0,
        background: Collection[str] = (),
    ) -> int:
        """How many leading chunks (of these kinds, ``chunk_tokens`` each) to load: the
        prefix whose load saves the most time at a step of ``batch`` requests (none if none
        saves any; all while a kind is unmeasured), a load being in the background when its
        slowest kind is one of ``background``; except once every ``explore`` times the gate
        would cut a hit short."""
        if not self.enabled or not kinds:
            return len(kinds)
        best, best_gain, worst = 0, 0.0, 0
        for i, k in enumerate(kinds, 1):
            worst = max(worst, KINDS.index(k))  # one load: its slowest chunk's kind
            kind = KINDS[worst]
            gain = self.saving(kind, i * chunk_tokens, batch=batch, background=kind in background)
            if gain is None:  # unmeasured: load, and learn from it
                best, best_gain = i, float("inf")
            elif gain > best_gain or (best_gain == float("inf") and gain > 0):
                best, best_gain = i, gain
        if best < len(kinds):
            self._gated += 1
            if self.explore and self._gated % self.explore == 0:
                return len(kinds)  # measure again: the tier may have recovered
        return best

    def snapshot(self) -> dict[str, Any]:
        """Seconds per token of recompute and ``(fixed_s, per_token_s)`` per kind of load, as
        measured now (for logs and tests)."""
        return {
            "recompute": self.recompute.per_token(self.min_samples),
            **{k: c.fit(self.min_samples) for k, c in self.loads.items()},
        }

"""Load only when it pays: the load gate (``load_gate``), pure and clock-free.

Reusing a chunk pays when loading it takes less time than recomputing its tokens (the
Mooncake paper's break-even: a tier's bandwidth above KV bytes per token × prefill tokens
per second).  Both sides are measured by the engine as it runs, from the workers' stats:

* recompute: seconds per token of the steps that prefill (``prefill_step_us`` over
  ``prefill_step_tokens``: the step's forward pass over the tokens it scheduled);
* load, per kind of chunk: ``local`` (the engine's own node, DRAM), ``nvme`` (its own
  node, promoted from NVMe first) and ``remote`` (pulled from another node first):
  ``load_<kind>_us`` over ``load_<kind>_tokens``.

Each rate is a decayed ratio of sums (recent loads weigh most).  A kind with no
measurement yet, or an engine that has not prefilled yet, loads: the gate learns from
loads it lets through.  A kind found slower than recompute is still let through once
every ``explore`` hits, so a tier that recovers (a node no longer overloaded) is found.

State: :class:`LoadGate` belongs to the scheduler half (its thread only).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

KINDS = ("local", "nvme", "remote")
PREFILL_STEP_TOKENS = 32
"""A step that prefills at least this many tokens measures the engine's recompute rate."""


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


class LoadGate:
    """Which leading chunks of a hit load (see the module docstring)."""

    def __init__(self, enabled: bool = True, *, margin: float = 1.0, explore: int = 20, min_samples: int = 3) -> None:
        self.enabled, self.margin, self.explore, self.min_samples = enabled, margin, explore, min_samples
        self.recompute = Rate()
        self.loads = {k: Rate() for k in KINDS}
        self._gated = 0

    def observe(self, data: Mapping[str, Any]) -> None:
        """Take the workers' stats of one step (their counters' deltas)."""
        self.recompute.add(float(data.get("prefill_step_us", 0)) / 1e6, float(data.get("prefill_step_tokens", 0)))
        for k in KINDS:
            self.loads[k].add(float(data.get(f"load_{k}_us", 0)) / 1e6, float(data.get(f"load_{k}_tokens", 0)))

    def pays(self, kind: str) -> bool:
        """Whether loading a chunk of ``kind`` is expected to beat recomputing it."""
        if not self.enabled:
            return True
        recompute = self.recompute.per_token(self.min_samples)
        load = self.loads[kind].per_token(self.min_samples)
        return recompute is None or load is None or load < recompute * self.margin

    def leading(self, kinds: Sequence[str]) -> int:
        """How many leading chunks (of these kinds) to load: up to the first that does not
        pay, except once every ``explore`` times the gate would stop a hit."""
        n = next((i for i, k in enumerate(kinds) if not self.pays(k)), len(kinds))
        if n < len(kinds):
            self._gated += 1
            if self.explore and self._gated % self.explore == 0:
                return len(kinds)  # measure again: the tier may have recovered
        return n

    def snapshot(self) -> dict[str, float | None]:
        """Seconds per token as measured now (for logs and tests)."""
        return {
            "recompute": self.recompute.per_token(self.min_samples),
            **{k: r.per_token(self.min_samples) for k, r in self.loads.items()},
        }

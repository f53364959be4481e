"""Whether a lookup is worth asking, and worth a step: the hit odds, pure and clock-free.

When vLLM schedules a request whose lookup is still running on the store link's thread,
the scheduler can answer "not yet" (``None``: the request sits out this step and takes
the answer at a later ask) or "nothing" (0: it is computed now; a hit the lookup would
have found is lost, never wrong KV).  "Not yet" costs the request a step; it pays only
when the hit it may find saves more recompute than that step:

    E[hit tokens per lookup | class] × recompute seconds per token  ≥  the step interval

Both right-hand figures are the engine's own measurements (the load gate's recompute
rate, the wait budget's step interval).  On an idle engine nothing waits for the pass,
and the wait costs the request only what is left of its lookup: the right-hand side is
then the measured lookup latency.  Asking at all costs far less than waiting: a lookup
runs beside the engine from the request's arrival, so its price is the CPU it takes
(the link thread's time, measured per lookup: the cores the engine steps on pay it), not
its latency, which on a loaded machine is mostly waiting for a core.  A class whose
expected saving is below that CPU time is not asked at all, but for one request in
``probe_every`` (the probe that keeps its odds measured, so a class whose prefixes
start being stored is asked again).  The expectation is measured per **class** of
request, from what the scheduler knows before the answer:

* ``hinted``: it carries a retention hint (a session, ``retain``): a later turn's prefix
  was stored by the turn before;
* ``seen``: this engine has looked its first chunk up before (the sightings sketch): a
  shared prefix, likely stored under ``second-sighting``;
* ``new``: neither; with no reuse, every request.

Every lookup's answer is an outcome, those the scheduler stopped waiting for included
(they still run; their answers are taken when they land), so a class whose hits return
is waited for again without exploration.  A class with fewer than ``min_samples``
outcomes, or an engine that has not measured both rates yet, is waited for (the
behaviour without this module), but for ``new`` prompts, which the scheduler waits for
within one pass's budget only (a never-seen, unhinted prompt earns a step's wait by
measured hits alone).  A producer's handoff is always waited for (the caller's
rule: its decode engine is there not to prefill).

State: :class:`HitOdds` belongs to the scheduler half (vLLM's scheduler thread only).
"""

from __future__ import annotations

import dataclasses

CLASSES = ("hinted", "seen", "new")


def request_class(*, hint: bool, first_chunk_sightings: int) -> str:
    """The class of a request (see the module docstring); ``first_chunk_sightings`` counts
    this lookup's own sighting (1: never looked up before; 0: not sighted, e.g. a
    consumer-only engine, which never counts sightings)."""
    if hint:
        return "hinted"
    return "seen" if first_chunk_sightings != 1 else "new"


@dataclasses.dataclass
class _Class:
    lookups: float = 0.0  # decayed count of outcomes
    hit_tokens: float = 0.0  # decayed sum of tokens found beyond vLLM's own cache
    samples: int = 0
    skipped: int = 0  # requests not asked since the last probe


class HitOdds:
    """Expected hit tokens per lookup, per request class (see the module docstring).

    ``decay`` weighs recent outcomes most (0.98: about the last 50 of a class); one request
    in ``probe_every`` of a class not worth asking is asked all the same."""

    def __init__(self, *, decay: float = 0.98, min_samples: int = 8, probe_every: int = 8) -> None:
        if not 0 < decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {decay!r}")
        if probe_every < 1:
            raise ValueError(f"probe_every must be at least 1, got {probe_every!r}")
        self.decay, self.min_samples, self.probe_every = decay, min_samples, probe_every
        self._classes = {c: _Class() for c in CLASSES}
        self.lookup_s = 0.0  # decayed mean latency of answered lookups (0: none yet)
        self.lookup_cpu_s = 0.0  # decayed mean CPU time of answered lookups on the link thread (0: none yet)

    def observe(self, cls: str, hit_tokens: int) -> None:
        """A lookup of class ``cls`` was answered: ``hit_tokens`` beyond vLLM's own cache
        (0: a miss)."""
        c = self._classes[cls]
        c.lookups = c.lookups * self.decay + 1.0
        c.hit_tokens = c.hit_tokens * self.decay + max(0, hit_tokens)
        c.samples += 1

    def observe_latency(self, seconds: float) -> None:
        """A lookup was answered after ``seconds`` on the store link's thread."""
        seconds = max(0.0, seconds)
        self.lookup_s = seconds if self.lookup_s <= 0 else 0.9 * self.lookup_s + 0.1 * seconds

    def observe_cost(self, cpu_seconds: float) -> None:
        """A lookup took ``cpu_seconds`` of the store link thread's CPU time (what asking costs)."""
        cpu_seconds = max(0.0, cpu_seconds)
        self.lookup_cpu_s = cpu_seconds if self.lookup_cpu_s <= 0 else 0.9 * self.lookup_cpu_s + 0.1 * cpu_seconds

    def expected_tokens(self, cls: str) -> float | None:
        """Expected hit tokens per lookup of ``cls`` (None: too few outcomes yet)."""
        c = self._classes[cls]
        if c.samples < self.min_samples or c.lookups <= 0:
            return None
        return c.hit_tokens / c.lookups

    def worth_waiting(self, cls: str, recompute_s_per_token: float | None, step_s: float) -> bool:
        """Whether a request of ``cls`` should hear "not yet" rather than be computed now."""
        expected = self.expected_tokens(cls)
        if expected is None or recompute_s_per_token is None or step_s <= 0:
            return True  # not measured yet: wait, and learn
        return expected * recompute_s_per_token >= step_s

    def worth_asking(self, cls: str, recompute_s_per_token: float | None) -> bool:
        """Whether a request of ``cls`` is looked up at all, its expected saving against a
        lookup's CPU time (a False is counted towards the class's next probe: call once per
        request)."""
        if self.lookup_cpu_s <= 0 or self.worth_waiting(cls, recompute_s_per_token, self.lookup_cpu_s):
            return True
        c = self._classes[cls]
        c.skipped += 1
        if c.skipped >= self.probe_every:
            c.skipped = 0
            return True
        return False

    def snapshot(self) -> dict[str, float | None]:
        """Expected hit tokens per lookup, per class (for logs and tests)."""
        return {c: self.expected_tokens(c) for c in CLASSES}

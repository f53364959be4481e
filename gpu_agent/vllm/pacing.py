"""How long vLLM's scheduler thread may wait for lookups: the wait budget, pure and clock-free.

A lookup runs on the store link's own thread; vLLM's scheduler asks for its answer in
``get_num_new_matched_tokens``.  Answering "not yet" (``None``) costs the request a whole
step; waiting costs the scheduler thread time.  Under vLLM's async scheduling the
scheduler plans step N+1 while step N's forward pass runs, so a wait shorter than that
forward pass delays nobody.  The budget is therefore per scheduling pass and follows the
engine's step time:

* busy (the last pass scheduled tokens, recently): ``step_fraction`` × the measured step
  interval (an exponentially weighted mean of the time between passes that scheduled
  work), never less than ``floor_s``;
* idle (the last pass scheduled nothing, or the engine has not stepped for several
  step intervals): ``idle_s``: nothing runs that the wait could delay, and a request that
  hears "not yet" on an idle engine would only poll.

Every wait of a pass draws on the one budget, so however many requests arrive at once
the pass waits at most the budget in all.  The step share and the idle wait are off by
default (``lookup_wait_step`` and ``lookup_idle_wait_ms`` 0: the budget is the floor,
``lookup_wait_ms``): on CPU engines, whose scheduler shares cores with the forward pass,
``kvstore bench serving`` measured a share of 0.5 tripling the scheduler thread's
connector time per request (no-reuse: 15.8 ms against 4.9-6.3 ms) for no measurable
gain.  No wait is ever longer than the caller's own deadline (the caller bounds it).

State: :class:`WaitBudget` belongs to the scheduler half (vLLM's scheduler thread only).
"""

from __future__ import annotations

STALE_STEPS = 4.0  # no pass for this many step intervals: the engine is idle
MAX_INTERVAL_S = 1.0  # a longer gap between passes is idleness, not a step


class WaitBudget:
    """The scheduler thread's wait budget for one scheduling pass (see the module docstring)."""

    def __init__(self, floor_s: float, step_fraction: float, idle_s: float, *, decay: float = 0.8) -> None:
        self.floor_s, self.step_fraction, self.idle_s, self.decay = floor_s, step_fraction, idle_s, decay
        self.interval_s = 0.0  # the mean time between busy passes (0: not measured yet)
        self._last_pass = -1.0  # when the last pass ended (monotonic seconds; <0: never)
        self._last_busy = False  # whether it scheduled any tokens
        self._left = max(floor_s, idle_s)  # the current pass's budget left (an engine starts idle)
        self._refilled = True  # the idle budget was granted since the last pass

    def step(self, now: float, scheduled_tokens: int) -> None:
        """A scheduling pass ended at ``now`` having scheduled ``scheduled_tokens``: measure the
        step interval and set the next pass's budget."""
        gap = now - self._last_pass
        if self._last_busy and self._last_pass >= 0 and 0 <= gap <= MAX_INTERVAL_S:
            self.interval_s = gap if self.interval_s <= 0 else self.decay * self.interval_s + (1 - self.decay) * gap
        self._last_pass, self._last_busy = now, scheduled_tokens > 0
        self._left = self._full(busy=self._last_busy)
        self._refilled = not self._last_busy

    def _full(self, *, busy: bool) -> float:
        if not busy:
            return max(self.floor_s, self.idle_s)
        return max(self.floor_s, self.step_fraction * self.interval_s)

    def idle(self, now: float) -> bool:
        """Whether the engine looks idle at ``now`` (nothing the wait would delay)."""
        if not self._last_busy or self._last_pass < 0:
            return True
        stale = max(MAX_INTERVAL_S / 10, STALE_STEPS * self.interval_s)
        return now - self._last_pass > stale

    def allowance(self, now: float) -> float:
        """Seconds the next wait of this pass may take."""
        if not self._refilled and self.idle(now):  # once per idle spell, not once per ask
            self._left, self._refilled = max(self._left, self._full(busy=False)), True
        return self._left

    def spend(self, seconds: float) -> None:
        """A wait of this pass took ``seconds``."""
        self._left = max(0.0, self._left - max(0.0, seconds))

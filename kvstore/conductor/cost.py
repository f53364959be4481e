"""The conductor's cost model: time to first token and time between tokens, fitted online
to the fleet's own measurements.

Owned by the conductor's event loop (not thread-safe).  Two linear models, each a
recursive least-squares fit with forgetting (old measurements fade, so a fleet that slows
down or speeds up is followed within a few dozen requests):

* **TTFT** (seconds) of a request on an engine::

      ttft = base + compute · tokens to compute
                  + queue · seconds of work queued ahead on the engine (the requests sent
                            there with no first token yet: what their own estimates said
                            their work would take, less what has passed, see
                            :meth:`EngineState.queued_s`)
                  + dram · tokens loaded from the engine's node's DRAM
                  + nvme · tokens loaded from its NVMe
                  + remote · tokens pulled from another node
                  + decodes · decodes the engine runs (each makes every step of the prefill longer)

  Token counts enter in thousands (the fit is better conditioned).  Each engine has its
  own fit (engines may differ in speed), started from the fleet-wide fit when the engine
  joins and used once it has ``OWN_FIT_SAMPLES`` measurements; every measurement updates
  both.  ``compute`` is the engine's prefill cost per
  thousand tokens, so ``1000 / compute`` is its prefill rate in tokens/s.
* **TBT** (seconds, Mooncake's: the mean of a request's slowest 10 % inter-token gaps) on
  an engine running ``r`` decodes: ``tbt = base + per_decode · r``.  Fleet-wide.

The priors (before any measurement) come from :class:`Priors`: a prefill rate and, per
tier, a load rate in GB/s with the engine's KV bytes per token; ``kvstore bench
--connector`` measures the tier rates of a machine.  Predictions clamp every coefficient at
0 (a fit may wander negative on a few noisy samples; no cost is negative).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

TTFT_FEATURES = ("base", "compute", "queue", "dram", "nvme", "remote", "decodes")
TIERS = ("dram", "nvme", "remote")
TBT_FEATURES = ("base", "per_decode")
BIAS_ALPHA = 0.15
BIAS_LIMIT = math.log(8.0)  # the bias stays within 1/8 .. 8
BIAS_MIN_SAMPLES = 5
QUEUE_FLOOR = 0.5
"""The least weight queued work ahead has in an estimate, whatever the fit says."""
OWN_FIT_SAMPLES = 20
"""Measurements of an engine before its own fit replaces the fleet's in its estimates."""
WORK_FLOOR = 1 / 8
"""An engine's own fit prices a token's compute, and each tier's load, at least this share
of the fleet's fit.  Without it an engine whose own fit wandered to zero work (measured
under overload, where queueing the features do not see dominates its first tokens) had
every request estimated at 0 s, so its queue of estimated work stayed empty and it got
every request: 6,372 of 12,000 on one of 16 simulated engines, first tokens after 12
minutes (``kvstore sim``, a hot-prompt trace at 200 req/s)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Priors:
    """Where the fits start.  Defaults: a prefill rate of 2,000 tokens/s, a TBT of 50 ms
    plus 5 ms per running decode, and loads at 10 (DRAM), 2 (NVMe) and 1 (remote) GB/s of
    128 KiB of KV per token (Llama-3-8B in bf16).  Every fit leaves these behind within a
    few requests."""

    prefill_tokens_per_s: float = 2000.0
    base_s: float = 0.02
    per_decode_s: float = 0.005  # TTFT added by each decode the engine runs
    load_gbps: tuple[float, float, float] = (10.0, 2.0, 1.0)  # dram, nvme, remote
    bytes_per_token: int = 128 << 10
    tbt_base_s: float = 0.05
    tbt_per_decode_s: float = 0.005

    def ttft_weights(self) -> np.ndarray:
        per_ktok = [1000 * self.bytes_per_token / (g * 1e9) for g in self.load_gbps]
        per_compute = 1000.0 / self.prefill_tokens_per_s
        return np.array([self.base_s, per_compute, 1.0, *per_ktok, self.per_decode_s], dtype=np.float64)

    def tbt_weights(self) -> np.ndarray:
        return np.array([self.tbt_base_s, self.tbt_per_decode_s], dtype=np.float64)


class RLS:
    """Recursive least squares with exponential forgetting: ``y ≈ w · x``."""

    def __init__(self, w: np.ndarray, var: np.ndarray | float = 1.0, forget: float = 0.98) -> None:
        self.w = np.array(w, dtype=np.float64)
        self.P = np.diag(np.broadcast_to(np.asarray(var, dtype=np.float64), self.w.shape)).copy()
        self.forget = forget
        self.samples = 0
        self.wp = tuple(float(x) for x in np.maximum(self.w, 0.0))  # clamped, as plain floats: cheap to predict with

    def copy(self) -> RLS:
        c = RLS(self.w, 1.0, self.forget)
        c.P, c.samples, c.wp = self.P.copy(), self.samples, self.wp
        return c

    def update(self, x: np.ndarray, y: float) -> None:
        px = self.P @ x
        k = px / (self.forget + float(x @ px))
        self.w = self.w + k * (y - float(x @ self.w))
        self.P = (self.P - np.outer(k, px)) / self.forget
        # keep P symmetric and bounded: features that never vary would otherwise blow it up
        self.P = np.clip((self.P + self.P.T) / 2, -1e6, 1e6)
        self.samples += 1
        self.wp = tuple(float(x) for x in np.maximum(self.w, 0.0))

    def predict(self, x: np.ndarray) -> float:
        return float(x @ np.maximum(self.w, 0.0))


@dataclasses.dataclass(slots=True)  # not frozen: built per engine per request, and frozen init costs twice as much
class Load:
    """What one request would cost an engine, in tokens (the TTFT model's inputs)."""

    compute: int  # prompt tokens the engine computes (neither its cache nor the pool has them)
    queued_s: float  # seconds of work queued ahead of it on the engine
    dram: int = 0
    nvme: int = 0
    remote: int = 0
    running: int = 0  # decodes the engine runs

    def features(self) -> np.ndarray:
        return np.array(
            [
                1.0,
                self.compute / 1000,
                self.queued_s,
                self.dram / 1000,
                self.nvme / 1000,
                self.remote / 1000,
                float(self.running),
            ]
        )


class CostModel:
    """The TTFT and TBT fits (see the module docstring); owned by the conductor's loop."""

    def __init__(self, priors: Priors | None = None, *, forget: float = 0.98) -> None:
        self.priors = priors or Priors()
        w = self.priors.ttft_weights()
        self.fleet = RLS(w, np.maximum(w, 0.1) ** 2 * 1e4, forget)  # weak priors: measurements win fast
        self.engines: dict[str, RLS] = {}
        self.bias: dict[str, float] = {}  # engine → measured / fitted, recent (see observe_ttft)
        self.fleet_bias = 1.0  # the same over every engine's measurements
        t = self.priors.tbt_weights()
        self.tbt_fit = RLS(t, np.maximum(t, 0.01) ** 2 * 100, forget)
        self._coef: dict[str, tuple[float, ...]] = {}  # engine → coefficients(), until the next measurement

    def _engine(self, engine_id: str) -> RLS:
        """The fit to predict ``engine_id`` with: its own once it has ``OWN_FIT_SAMPLES``
        measurements, the fleet's until then (an engine judged on one unlucky measurement
        would be sent nothing, and so never measured again)."""
        fit = self.engines.get(engine_id)
        if fit is None:
            fit = self.engines[engine_id] = self.fleet.copy()
        return fit if fit.samples >= OWN_FIT_SAMPLES else self.fleet

    @property
    def samples(self) -> int:
        """TTFT measurements seen (fleet-wide)."""
        return self.fleet.samples

    def _wp(self, engine_id: str) -> tuple[float, ...]:
        """The clamped weights to predict ``engine_id`` with: its own fit's once it has
        ``OWN_FIT_SAMPLES`` measurements (compute and loads at least :data:`WORK_FLOOR` of
        the fleet's), the fleet's until then."""
        fit = self._engine(engine_id)
        if fit is self.fleet:
            return fit.wp
        b, c, q, d, n, r, k = fit.wp
        f = self.fleet.wp
        return (
            b,
            max(c, f[1] * WORK_FLOOR),
            q,
            max(d, f[3] * WORK_FLOOR),
            max(n, f[4] * WORK_FLOOR),
            max(r, f[5] * WORK_FLOOR),
            k,
        )

    def coefficients(self, engine_id: str) -> tuple[float, ...]:
        """``(base, compute, queue, dram, nvme, remote, decodes, times)``: :meth:`ttft` is
        ``(base + (compute·tokens + dram·… + nvme·… + remote·…) / 1000 + queue·queued_s +
        decodes·running) · times``, with ``queue`` at least ``QUEUE_FLOOR``.  Cached per
        engine until the next measurement: the decision asks for every engine per request."""
        c = self._coef.get(engine_id)
        if c is None:
            fit = self.engines.get(engine_id)
            own = fit is not None and fit.samples >= BIAS_MIN_SAMPLES
            b, k, q, d, n, r, dec = self._wp(engine_id)
            times = self.bias.get(engine_id, 1.0) if own else self.fleet_bias
            c = self._coef[engine_id] = (b, k, max(q, QUEUE_FLOOR), d, n, r, dec, times)
        return c

    def ttft(self, engine_id: str, load: Load) -> float:
        """The estimate: the fit's, times the engine's recent bias (see :meth:`observe_ttft`):
        its own once it has ``BIAS_MIN_SAMPLES`` measurements, the fleet's until then (one
        lucky first token must not make an engine look faster than the rest)."""
        fit = self.engines.get(engine_id)
        own = fit is not None and fit.samples >= BIAS_MIN_SAMPLES
        return self._fitted(engine_id, load) * (self.bias.get(engine_id, 1.0) if own else self.fleet_bias)

    def _fitted(self, engine_id: str, load: Load) -> float:
        # the decision asks this once per engine and request: plain arithmetic, no numpy call
        b, c, q, d, n, r, k = self._wp(engine_id)
        work = c * load.compute + d * load.dram + n * load.nvme + r * load.remote
        # queued work is done before this request's (FCFS): however noisy the fit, it counts
        # at least half (a fit that lost it would pile every request on one engine)
        return b + work / 1000 + max(q, QUEUE_FLOOR) * load.queued_s + k * load.running

    def work(self, engine_id: str, load: Load) -> float:
        """The request's own work on the engine, in seconds: its compute and loads, no queue
        (what it adds to the queue of the requests sent after it)."""
        _, c, _, d, n, r, _ = self._wp(engine_id)
        return (c * load.compute + d * load.dram + n * load.nvme + r * load.remote) / 1000

    def prefill_rate(self, engine_id: str) -> float:
        """The engine's fitted prefill rate in tokens/s."""
        per_ktok = max(float(self._engine(engine_id).w[1]), 1e-6)
        return 1000.0 / per_ktok

    def observe_ttft(self, engine_id: str, load: Load, seconds: float) -> None:
        """A measured first token.  Two things learn from it: the fit (slowly: it forgets
        with ``forget``), and the engine's bias, the moving geometric mean of measured
        over fitted (fast: ``BIAS_ALPHA``), which follows what the features do not see
        (an engine that falls behind under overload took 3-5 x its fitted estimate in one
        run; the fit alone took a hundred requests to catch up)."""
        fitted = self._fitted(engine_id, load)
        if fitted > 0 and seconds > 0:
            old = math.log(self.bias.get(engine_id, 1.0))
            new = (1 - BIAS_ALPHA) * old + BIAS_ALPHA * math.log(seconds / fitted)
            self.bias[engine_id] = math.exp(min(max(new, -BIAS_LIMIT), BIAS_LIMIT))
            fleet = (1 - BIAS_ALPHA) * math.log(self.fleet_bias) + BIAS_ALPHA * math.log(seconds / fitted)
            self.fleet_bias = math.exp(min(max(fleet, -BIAS_LIMIT), BIAS_LIMIT))
        self._fit_ttft(engine_id, load, seconds)
        self._coef.clear()  # the fleet's fit and bias moved: every engine's may have

    def _fit_ttft(self, engine_id: str, load: Load, seconds: float) -> None:
        # weighted by 1/TTFT: the fit minimises relative error (a 50 ms miss on a 100 ms
        # request matters as much as a 500 ms miss on a second), which measured 0.47-0.55
        # median relative error where plain least squares gave 0.61-0.67 (a 2-core fleet)
        scale = 1.0 / max(seconds, 0.05)
        x = load.features() * scale
        seconds *= scale
        if engine_id not in self.engines:
            self.engines[engine_id] = self.fleet.copy()
        self.engines[engine_id].update(x, seconds)
        self.fleet.update(x, seconds)

    def tbt(self, running: int) -> float:
        b, per = self.tbt_fit.wp
        return b + per * running

    def observe_tbt(self, running: float, seconds: float) -> None:
        self.tbt_fit.update(np.array([1.0, float(running)]), seconds)

    def describe(self) -> dict[str, object]:
        """The fits, for ``/conductor/state``."""
        return {
            "samples": self.fleet.samples,
            "fleet": dict(zip(TTFT_FEATURES, np.round(np.maximum(self.fleet.w, 0), 6).tolist())),
            "engines": {
                e: {
                    "samples": f.samples,
                    "bias": round(self.bias.get(e, 1.0), 3),
                    "prefill_tokens_per_s": round(self.prefill_rate(e), 1),
                    **dict(zip(TTFT_FEATURES, np.round(np.maximum(f.w, 0), 6).tolist())),
                }
                for e, f in sorted(self.engines.items())
            },
            "tbt": {
                "samples": self.tbt_fit.samples,
                **dict(zip(TBT_FEATURES, np.round(np.maximum(self.tbt_fit.w, 0), 6).tolist())),
            },
        }

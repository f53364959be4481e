"""``kvstore sim calibrate``: a profile's step-time constants measured on a real vLLM engine.

It starts one vLLM engine (:class:`kvstore.demo.engine.EngineProcess`: vLLM's own engine,
stepped one step at a time, prefix caching on) on one CPU, as ``kvstore bench serving`` runs
each engine, with the benchmark's locally made model (``--layers``, ``--hidden``) and KV
cache (``--engine-kv``), and times three kinds of step:

* **prefill**: one fresh prompt of T tokens, one output token, on an idle engine: its TTFT
  is one step of T prefill tokens and T² attention pairs (T from 32 to ``--max-prefill``);
* **prefill over a cached prefix**: a C-token prompt is computed first (into the engine's
  prefix cache, C a whole number of KV blocks), then the same C tokens and T new ones: its
  TTFT is one step of T prefill tokens and T × (C + T) attention pairs, what a hit from the
  pool leaves the engine to compute (T of 32, 128, 384; C of 2, 4, 8 blocks);
* **decode**: B requests of P-token prompts decoding together: the gaps between their
  tokens, past the first few, are steps of B sequences over a context of B × (P + i) tokens.

With ``--served`` the same steps are timed through the engine's OpenAI server, started as
``kvstore bench serving`` starts each engine of ``baseline`` (``vllm.entrypoints.openai.api_server``,
its API server, engine core and worker on the one CPU) and asked by the benchmark's own
streaming client (:class:`ServedEngine`): a TTFT is then one step plus what the server adds, a
gap between streamed tokens one decode step as a served engine takes it (its three processes
hand each step over on one core).  That is what ``kvstore bench serving`` measures, so a served
profile is the one to validate against it (docs/sim.md).

Each kind is repeated ``--repeats`` times; the step model of :mod:`kvstore.sim.profile`
(``overhead_ms`` + ``prefill_ms_per_token``·T + ``prefill_attn_ms``·T² +
``prefill_cached_attn_ms``·T·C + ``decode_ms_per_seq``·B + ``decode_ms_per_kv_token``·context
+ ``request_ms`` for a prefill, the step that takes its request in) is fitted to every
sample by non-negative least squares (a coefficient the data makes negative is dropped and
the rest refitted), and ``jitter_cv`` is the coefficient of variation of the samples around
the fit.  ``request_ms`` is what a served engine spends taking a request in besides its
tokens (4.7 ms on the project's CPU engines, which a decode step does not pay: without it
the per-step overhead, set by the many decode steps, left every served TTFT short).
``--samples FILE`` fits the samples of an earlier ``--json`` run instead of measuring (no vLLM needed; the block geometry is ``--base``'s).
The profile written (``--out``, default stdout) is ``--base`` (default ``local``) with
those eight constants, the engine's block size and KV blocks, and each constant's source
saying what was measured, when and on what CPU.  ``--json`` also prints the samples and
the fit's residuals.

Run it where vLLM is installed (``.venv-vllm``), with nothing else busy: it takes a few
minutes.  Holds no state between calls.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import platform
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.errors import InvalidArgument

COLUMNS = (
    "overhead_ms",
    "prefill_ms_per_token",
    "prefill_attn_ms",
    "prefill_cached_attn_ms",
    "decode_ms_per_seq",
    "decode_ms_per_kv_token",
    "request_ms",
)
"""The fitted constants, in the order of a sample's regressors (1, T, the new tokens' pairs
among themselves, their pairs with a cached prefix, B, context, new requests: 1 for a
prefill's TTFT, the step that takes the request in, 0 for a decode step)."""


def cached_pairs(sample: dict[str, Any]) -> int:
    """A sample's attention pairs of new tokens with a cached prefix (``cached_pairs``; a
    ``prefill-cached`` sample saved before it was recorded: its pairs less T²)."""
    if "cached_pairs" in sample:
        return int(sample["cached_pairs"])
    return int(sample["pairs"]) - int(sample["t"]) ** 2 if sample.get("kind") == "prefill-cached" else 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base", default="local", metavar="NAME|FILE", help="the profile to update (default local)")
    p.add_argument("--name", default=None, help="the new profile's name (default: the base's)")
    p.add_argument("--out", default=None, metavar="FILE", help="write the profile here (default: stdout)")
    p.add_argument("--layers", type=int, default=4, help="layers of the locally made model (default 4)")
    p.add_argument("--hidden", type=int, default=512, help="hidden size of the locally made model (default 512)")
    p.add_argument("--engine-kv", default="64MiB", help="the engine's KV cache (default 64MiB, as the benchmark)")
    p.add_argument("--cpu", default=None, help="the CPU the engine runs on (default: the first of this process's)")
    p.add_argument("--max-prefill", type=int, default=2048, help="longest prompt timed (default 2048)")
    p.add_argument("--repeats", type=int, default=3, help="times each measurement is taken (default 3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts' token ids (default 0)")
    p.add_argument("--json", action="store_true", help="print the samples and the fit as JSON (after the profile)")
    p.add_argument(
        "--samples",
        metavar="FILE",
        help="fit the samples of an earlier run's --json output instead of measuring (no vLLM needed; the block "
        "size and KV blocks stay --base's)",
    )
    p.add_argument(
        "--served",
        action="store_true",
        help="time the engine through its OpenAI server, as `kvstore bench serving` runs it (default: vLLM's "
        "engine stepped directly)",
    )


def nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient ≥ 0: columns whose coefficient comes out
    negative are dropped one at a time (the most negative first) and the rest refitted."""
    keep = list(range(x.shape[1]))
    while True:
        coef = np.zeros(x.shape[1])
        sol, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
        coef[keep] = sol
        neg = [k for k in keep if coef[k] < 0]
        if not neg:
            return coef
        keep.remove(min(neg, key=lambda k: coef[k]))


def fit(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """The step model fitted to ``samples`` (each: ``t`` prefill tokens, ``pairs``, ``b``
    decode sequences, ``ctx`` context tokens, ``ms`` the step's time)."""
    if len(samples) < len(COLUMNS):
        raise InvalidArgument(f"{len(samples)} samples cannot fit {len(COLUMNS)} constants")
    x = np.array(
        [
            [1.0, s["t"], s["pairs"] - cached_pairs(s), cached_pairs(s), s["b"], s["ctx"], 0.0 if s["b"] else 1.0]
            for s in samples
        ]
    )
    y = np.array([s["ms"] for s in samples])
    coef = nnls(x, y)
    if coef[0] <= 0 or coef[1] <= 0:
        raise InvalidArgument(
            "the fit found no positive per-step overhead or prefill cost: the measurements are too noisy "
            "(is something else running?); run again with more --repeats"
        )
    pred = x @ coef
    rel = (y - pred) / pred
    return {
        "constants": {k: float(v) for k, v in zip(COLUMNS, coef)},
        "jitter_cv": float(np.std(rel)),
        "r2": float(1 - np.sum((y - pred) ** 2) / max(1e-12, np.sum((y - y.mean()) ** 2))),
        "median_abs_rel_err": float(np.median(np.abs(rel))),
    }


def prompts(rng: random.Random, n: int, length: int) -> list[list[int]]:
    """``n`` prompts of ``length`` fresh token ids (no prefix shared with any other)."""
    return [[rng.randrange(1, 32000) for _ in range(length)] for _ in range(n)]


def measure(engine: Any, a: argparse.Namespace) -> list[dict[str, Any]]:
    """The samples (see :func:`fit`) of one engine."""
    from kvstore.demo.engine import request

    rng = random.Random(a.seed)
    samples: list[dict[str, Any]] = []
    engine.generate(prompts(rng, 1, 64)[0], max_tokens=4)  # warm-up: not measured
    sizes = [t for t in (32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072) if t <= a.max_prefill]
    for _ in range(a.repeats):
        for t in sizes:
            r = engine.generate(prompts(rng, 1, t)[0], max_tokens=1)
            samples.append({"kind": "prefill", "t": t, "pairs": t * t, "b": 0, "ctx": 0, "ms": float(r["ttft_ms"])})
    # a prefill over a cached prefix: the C-token prefix is computed first (not timed), then
    # the prompt of C + T tokens, whose TTFT is one step of T new tokens attending to C + T:
    # what a hit from the pool leaves the engine to do (C in whole KV blocks, so all of it hits)
    bs = max(1, int(getattr(engine, "block_size", 16) or 16))
    cached = [c for c in (2, 4, 8) if c * bs + 384 <= a.max_prefill]
    for _ in range(a.repeats):
        for blocks in cached:
            c = blocks * bs
            for t in (32, 128, 384):
                prefix = prompts(rng, 1, c)[0]
                engine.generate(prefix, max_tokens=1)  # into the engine's prefix cache
                r = engine.generate(prefix + prompts(rng, 1, t)[0], max_tokens=1)
                samples.append(
                    {
                        "kind": "prefill-cached",
                        "t": t,
                        "pairs": t * (c + t),
                        "cached_pairs": t * c,
                        "b": 0,
                        "ctx": 0,
                        "ms": float(r["ttft_ms"]),
                    }
                )
    decode_tokens = 24
    for _ in range(a.repeats):
        for b, p in ((1, 32), (4, 32), (16, 32), (32, 32), (1, 512), (4, 512), (8, 512)):
            res = engine.batch([request(tok, max_tokens=decode_tokens) for tok in prompts(rng, b, p)])
            # every request decodes in the same steps once all are prefilled: the gaps of one
            # request, past the first few tokens, are whole decode steps of the batch
            times = res[0]["token_ms"]
            for i in range(4, len(times)):
                gap = times[i] - times[i - 1]
                if gap > 0:
                    samples.append({"kind": "decode", "t": 0, "pairs": 0, "b": b, "ctx": b * (p + i), "ms": gap})
    return samples


class ServedEngine:
    """One vLLM OpenAI server of a ``baseline`` fleet (:class:`kvstore.bench.serving.fleet.Fleet`),
    driven the way :func:`measure` drives an :class:`~kvstore.demo.engine.EngineProcess`:
    ``generate`` and ``batch`` send the requests through the benchmark's streaming client
    (:class:`kvstore.bench.serving.runner.Replay`) and answer the same fields (``ttft_ms``;
    ``token_ms``, each streamed token's time since the request was sent).  ``block_size`` and
    ``num_blocks`` come from the server's ``vllm:cache_config_info``.  Owns nothing: the fleet
    owns the processes."""

    def __init__(self, engine: Any, served_name: str, timeout_s: float = 300.0) -> None:
        from kvstore.bench.serving.fleet import _get

        self.engine = engine
        self.served_name = served_name
        self.timeout_s = timeout_s
        code, text = _get(engine.url + "/metrics", timeout=10.0)
        if code != 200:
            raise RuntimeError(f"{engine.name}: GET /metrics answered HTTP {code}")
        self.block_size, self.num_blocks = cache_config(text)

    def _send(self, reqs: list[tuple[list[int], int]]) -> list[Any]:
        from kvstore.bench.serving.front import RoundRobin
        from kvstore.bench.serving.runner import Replay
        from kvstore.bench.serving.workload import Scaling, Work, Workload

        items = tuple(Work(i, 0.0, tuple(t), n, ()) for i, (t, n) in enumerate(reqs))
        wl = Workload("calibrate", Scaling(), items, ())
        recs = Replay(
            "calibrate", wl, RoundRobin([self.engine]), model=self.served_name, timeout_s=self.timeout_s, sessions=False
        ).run()
        for r in recs:
            if r.error is not None or r.ttft_ms is None:
                raise RuntimeError(f"a calibration request failed: {r.error or 'no token came back'}")
        return recs

    def generate(self, tokens: list[int], max_tokens: int = 1) -> dict[str, Any]:
        r = self._send([(tokens, max_tokens)])[0]
        return {"ttft_ms": r.ttft_ms}

    def batch(self, reqs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        recs = self._send([(list(q["tokens"]), int(q["max_tokens"])) for q in reqs])
        out = []
        for r in recs:
            times = [float(r.ttft_ms)]
            for gap in r.itl_ms:
                times.append(times[-1] + gap)
            out.append({"token_ms": times})
        return out


def cache_config(metrics: str) -> tuple[int, int]:
    """``(block_size, num_gpu_blocks)`` from a vLLM server's ``/metrics`` text (its
    ``vllm:cache_config_info`` labels); a clear error where they are missing."""
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(metrics):
        for smp in fam.samples:
            if smp.name.startswith("vllm:cache_config_info"):
                try:
                    return int(smp.labels["block_size"]), int(smp.labels["num_gpu_blocks"])
                except (KeyError, ValueError):
                    break
    raise RuntimeError("the server's /metrics has no vllm:cache_config_info with block_size and num_gpu_blocks")


def _served(stack: Any, model: Path, a: argparse.Namespace, cpu: str, kv: int) -> ServedEngine:
    """A one-engine ``baseline`` fleet on CPU ``cpu``, as the benchmark starts one (entered on ``stack``)."""
    from kvstore.bench.serving.fleet import SERVED_NAME, Fleet, FleetSpec

    spec = FleetSpec(model=str(model), engines=1, max_model_len=a.max_prefill + 64, kv_cache_bytes=kv, cpus=(cpu,))
    fleet = stack.enter_context(Fleet("baseline", spec).start())
    return ServedEngine(fleet.engines[0], SERVED_NAME)


def run(a: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """The calibrated profile (as a dict) and the report (samples, fit)."""
    import importlib.util
    import os

    from kvstore.demo.engine import EngineProcess, make_model
    from kvstore.node.config import parse_size
    from kvstore.sim.profile import EngineProfile

    if a.repeats < 1 or a.max_prefill < 64:
        raise InvalidArgument("--repeats must be at least 1 and --max-prefill at least 64")
    if getattr(a, "samples", None):
        return refit(a)
    if importlib.util.find_spec("vllm") is None:
        raise InvalidArgument("calibrating needs vLLM in this interpreter: run `.venv-vllm/bin/kvstore sim calibrate`")
    base = EngineProfile.load(a.base)
    cpu = a.cpu if a.cpu is not None else str(min(os.sched_getaffinity(0)))
    with tempfile.TemporaryDirectory(prefix="kvstore-calibrate-") as d:
        model = make_model(Path(d) / "model", layers=a.layers, hidden=a.hidden, max_tokens=a.max_prefill + 64)
        kv = parse_size(a.engine_kv)
        env = {"VLLM_CPU_OMP_THREADS_BIND": cpu}
        with contextlib.ExitStack() as stack:
            if a.served:
                engine: Any = _served(stack, model, a, cpu, kv)
            else:
                engine = stack.enter_context(EngineProcess(model, max_tokens=a.max_prefill + 64, kv_bytes=kv, env=env))
                engine.wait_ready(timeout=900)
            samples = measure(engine, a)
            block_size, blocks = engine.block_size, engine.num_blocks
    f = fit(samples)
    when = datetime.date.today().isoformat()
    cpu_name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    how = (
        "through its OpenAI server as `kvstore bench serving` starts it (--served)" if a.served else "stepped directly"
    )
    where = (
        f"measured: `kvstore sim calibrate` on {when}, one vLLM CPU engine {how} on CPU {cpu} ({cpu_name}), "
        f"the made model of {a.layers} layers x {a.hidden}, {len(samples)} steps fitted by non-negative "
        f"least squares (R^2 {f['r2']:.3f}, median |error| {f['median_abs_rel_err']:.1%})"
    )
    prof = fitted_profile(base, a.name, f, where)
    sources = prof["sources"]
    prof["block_size"], prof["num_gpu_blocks"] = block_size, max(1, blocks - 1)  # less vLLM's null block
    sources["block_size"] = sources["num_gpu_blocks"] = (
        f"measured: `kvstore sim calibrate` on {when}: the engine's KV cache ({a.engine_kv}), less vLLM's null block"
    )
    prof["sources"] = sources
    EngineProfile.from_dict(prof, "the calibrated profile")  # refuses anything out of range
    return prof, {"samples": samples, "fit": f}


def fitted_profile(base: Any, name: str | None, f: dict[str, Any], where: str) -> dict[str, Any]:
    """``base`` (an :class:`~kvstore.sim.profile.EngineProfile`) as a dict with the fit
    ``f``'s constants and jitter, each cited as ``where``."""
    prof: dict[str, Any] = base.to_dict()
    prof["name"] = name or base.name
    sources = dict(prof.get("sources") or {})
    for k, v in f["constants"].items():
        prof[k] = round(v, 9)
        sources[k] = where
    prof["jitter_cv"] = round(f["jitter_cv"], 4)
    sources["jitter_cv"] = where + ": the coefficient of variation of the steps around the fit"
    prof["sources"] = sources
    return prof


def load_samples(path: str) -> list[dict[str, Any]]:
    """The samples of an earlier ``--json`` run (its second JSON document, or the only one)."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise InvalidArgument(f"--samples: cannot read {path}: {e.strerror or e}") from None
    dec, i, found = json.JSONDecoder(), 0, None
    while i < len(text):
        if text[i].isspace():
            i += 1
            continue
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError as e:
            raise InvalidArgument(f"--samples: {path} is not `kvstore sim calibrate --json` output ({e.msg})") from None
        if isinstance(obj, dict) and isinstance(obj.get("samples"), list):
            found = obj["samples"]
    need = {"kind", "t", "pairs", "b", "ctx", "ms"}
    if not found or not all(isinstance(x, dict) and need <= set(x) for x in found):
        raise InvalidArgument(f"--samples: {path} has no samples ({', '.join(sorted(need))} each)")
    return list(found)


def refit(a: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """``--samples``: the fit of an earlier run's samples into ``--base``."""
    from kvstore.sim.profile import EngineProfile

    base = EngineProfile.load(a.base)
    samples = load_samples(a.samples)
    f = fit(samples)
    where = (
        f"fitted: `kvstore sim calibrate --samples` on {datetime.date.today().isoformat()} to the {len(samples)} "
        f"steps of an earlier calibration ({Path(a.samples).name}) by non-negative least squares "
        f"(R^2 {f['r2']:.3f}, median |error| {f['median_abs_rel_err']:.1%})"
    )
    prof = fitted_profile(base, a.name, f, where)
    EngineProfile.from_dict(prof, "the calibrated profile")
    return prof, {"samples": samples, "fit": f}


def main(a: argparse.Namespace) -> int:
    prof, rep = run(a)
    text = json.dumps(prof, indent=2) + "\n"
    if a.out:
        Path(a.out).write_text(text)
        print(f"wrote {a.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    f = rep["fit"]
    consts = ", ".join(f"{k} {v:.4g}" for k, v in f["constants"].items())
    print(
        f"fit: {consts}; jitter_cv {f['jitter_cv']:.3f}; R^2 {f['r2']:.3f}; "
        f"median |error| {f['median_abs_rel_err']:.1%} over {len(rep['samples'])} steps",
        file=sys.stderr,
    )
    by_kind: dict[str, list[float]] = {}
    for s in rep["samples"]:
        by_kind.setdefault(str(s["kind"]), []).append(float(s["ms"]))
    for kind, ms in by_kind.items():
        print(f"  {kind}: {len(ms)} steps, median {statistics.median(ms):.1f} ms", file=sys.stderr)
    if a.json:
        print(json.dumps(rep), flush=True)
    return 0

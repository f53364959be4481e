"""Figures of a serving run: per-configuration summaries (the JSON contract), the table a
person reads, and the plot.  Pure functions of the records and counters they are given.

Per configuration (``summarise``): ``requests``, ``completed``, ``errors``, ``rejected``;
p50/p90/p99 of TTFT and TBT (Mooncake's: the mean of a request's slowest 10 % of
inter-token intervals), ITL p50/p99 over every interval, end-to-end p50/p99;
``throughput_tok_s`` (output tokens over the makespan: first arrival to last token);
``goodput_rps``: requests that met both ``slo.ttft_ms`` and ``slo.tbt_ms``, per second of
makespan; ``prompt_tokens`` by source, each token once by where its KV finally came from
(``engine_cache`` + ``store`` + ``recomputed`` == ``total``, see :func:`prompt_sources`;
from the engines' ``/metrics`` counters over the run, summed over the fleet's engines, so
in ``pd`` a prompt counts on its prefill and on its decode engine), ``store_blocks`` (DRAM
and NVMe reads, remote pulls, from the nodes' and the connector's counters; the bytes the
nodes stored and, of those, read back: ``stored_bytes``, ``read_back_bytes``),
``connector_ms`` (count, mean, p50, p99 of each phase of the connector's time, from its
histograms: :func:`connector_ms`) and ``tokens_equal_baseline``;
``reject_ms`` (p50/p99/p100 of how soon a refused request was answered).  The conductor
configurations add ``routing``: the conductor's ``predicted_ttft_abs_err_median``,
``decisions_per_engine`` and ``decision_us`` (p50, p99), and beside them
``decision_cpu_us`` (the same decisions in the conductor thread's CPU time: the rest is
time the process waited for a core), ``refusal_ms`` (arrival to 429, inside the
conductor), ``rejected`` and ``pool_errors``.

Repeated runs (``--repeat N``, :func:`combine_runs`): every numeric figure of a
configuration's summary is the median over its runs (the keys stay where they are),
``repeats`` gives ``n`` and the ``[min, max]`` of the figures of :data:`RANGE_KEYS`, and
``runs`` every run's own summary.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

import numpy as np

from kvstore.bench.serving.runner import Record
from kvstore.sim.capacity import SLO_TARGET
from kvstore.vocabulary import percentiles


def delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


BY_SOURCE = "vllm:prompt_tokens_by_source_total"
LOAD_TOKENS = "vllm:kvstore_load_tokens_total"


def prompt_sources(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]], *, tp: int = 1
) -> dict[str, Any]:
    """Prompt tokens over the run by where their KV finally came from, each token once,
    summed over the engines' ``/metrics``: ``engine_cache + store + recomputed == total``,
    each at least 0.

    What vLLM's counters mean (``vllm/v1/metrics``): ``vllm:request_prompt_tokens`` sums
    the prompts of finished requests (``total``).  ``vllm:external_prefix_cache_hits``
    counts the connector's hits when the scheduler allocates for them, before any load,
    and again each time a request is admitted anew (an asynchronous load that failed
    sends it back), so where loads fail it counts tokens that were recomputed, some more
    than once; ``vllm:request_prefill_kv_computed_tokens`` is the prompt less the tokens
    cached at the request's first scheduling, so it misses the same recomputations.
    ``vllm:prompt_tokens_by_source{source}`` counts each request once (at its first
    output, from its last scheduling): ``local_cache_hit`` (vLLM's own prefix cache),
    ``external_kv_transfer`` (what the connector promised) and ``local_compute``.  The
    connector's ``vllm:kvstore_load_tokens_total`` counts the tokens its workers did
    load (summed over a tensor-parallel engine's ``tp`` workers).

    So: ``engine_cache`` = ``local_cache_hit``; ``store`` = the least of what was promised
    and what was loaded (``load_tokens / tp``, where the connector exports it), and of what
    the prompts left beside the engine cache; ``recomputed`` = the rest, failed loads
    included; ``store_failed`` = promised but not loaded (so recomputed).  Without
    ``prompt_tokens_by_source`` (older vLLM) the promise is the external-hits counter and
    the engine cache what the prompts left after ``prefill_kv_computed`` and it."""
    total = computed = external = local = promised = loaded = 0.0
    have = by_source = have_loads = False
    for name, a in after.items():
        b = before.get(name, {})
        if "vllm:request_prompt_tokens_sum" not in a:
            continue
        have = True
        total += delta(a, b, "vllm:request_prompt_tokens_sum")
        computed += delta(a, b, "vllm:request_prefill_kv_computed_tokens_sum")
        external += delta(a, b, "vllm:external_prefix_cache_hits_total")
        if f'{BY_SOURCE}{{source="local_cache_hit"}}' in a:
            by_source = True
            local += delta(a, b, f'{BY_SOURCE}{{source="local_cache_hit"}}')
            promised += delta(a, b, f'{BY_SOURCE}{{source="external_kv_transfer"}}')
        if LOAD_TOKENS in a:
            have_loads = True
            loaded += delta(a, b, LOAD_TOKENS) / max(1, tp)
    if not have:
        return {"engine_cache": None, "store": None, "recomputed": None, "total": None, "store_failed": None}
    if not by_source:
        promised = external
        local = total - computed - external
    engine_cache = min(max(0.0, local), max(0.0, total))
    store = min(promised, loaded) if have_loads else promised
    store = max(0.0, min(store, total - engine_cache))
    e, st, t = int(round(engine_cache)), int(round(store)), int(round(total))
    return {
        "engine_cache": e,
        "store": st,
        "recomputed": max(0, t - e - st),
        "total": t,
        "store_failed": max(0, int(round(promised)) - st),
    }


# -- the connector's histograms ------------------------------------------------------------

CONNECTOR_PHASES = (
    "lookup",
    "request_sched",
    "sched_step",
    "store_lookup",
    "view_lag",
    "load_wait",
    "save_wait",
    "step_wait",
    "background_save",
)
"""The connector's ``vllm:kvstore_<phase>_seconds`` histograms: one sample per scheduler
lookup, per request (its scheduler-thread time), per scheduler step, per store lookup, per
update the pool's view applied (its lag), per worker step with loads (its wait), per worker
step with saves (``wait_for_save``), per worker step (every connector call of its forward
pass)."""


def histogram(metrics: dict[str, float], family: str) -> tuple[list[tuple[float, float]], float, float] | None:
    """``family``'s buckets in ``metrics`` (as :func:`kvstore.bench.serving.fleet.parse_metrics`
    keys them: ``family_bucket{le="..."}``) as sorted ``[(upper bound, cumulative count)]``
    (the last bound ``inf``), with its ``_count`` and ``_sum``; None when it has no bucket."""
    prefix = f'{family}_bucket{{le="'
    buckets = [(float(k[len(prefix) : -2]), v) for k, v in metrics.items() if k.startswith(prefix)]
    if not buckets:
        return None
    buckets.sort()
    count = metrics.get(f"{family}_count", buckets[-1][1])
    return buckets, count, metrics.get(f"{family}_sum", 0.0)


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """The ``q`` quantile of a histogram by Prometheus's ``histogram_quantile`` rule:
    ``buckets`` are (upper bound, cumulative count), sorted, the last ``+Inf``.  The rank
    ``q * total`` falls in the first bucket whose cumulative count reaches it; the value
    is interpolated linearly between that bucket's lower bound (the previous bucket's
    upper bound, 0 for the first) and its upper bound, as if its observations were spread
    evenly over it.  A rank in the ``+Inf`` bucket gives the highest finite bound; an
    empty histogram None (Prometheus: NaN)."""
    if not buckets or not buckets[-1][0] == math.inf:
        raise ValueError("a histogram's last bucket must be +Inf")
    if not 0 <= q <= 1:
        raise ValueError(f"a quantile is in [0, 1], got {q}")
    counts = [c for _, c in buckets]
    for i in range(1, len(counts)):  # as Prometheus: a non-monotonic scrape is made monotonic
        counts[i] = max(counts[i], counts[i - 1])
    total = counts[-1]
    if total <= 0:
        return None
    if len(buckets) < 2:
        return None
    rank = q * total
    b = next((i for i in range(len(buckets) - 1) if counts[i] >= rank), len(buckets) - 1)
    if b == len(buckets) - 1:
        return buckets[-2][0]
    upper = buckets[b][0]
    if b == 0 and upper <= 0:
        return upper
    lower = buckets[b - 1][0] if b > 0 else 0.0
    below = counts[b - 1] if b > 0 else 0.0
    inside = counts[b] - below
    if inside <= 0:
        return lower
    return lower + (upper - lower) * (rank - below) / inside


def _hist_delta(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]], family: str
) -> tuple[list[tuple[float, float]], float, float] | None:
    """``family`` over the run: after minus before, per bucket, summed over the engines."""
    by_le: dict[float, float] = {}
    count = total = 0.0
    found = False
    for name, a in after.items():
        h = histogram(a, family)
        if h is None:
            continue
        found = True
        hb = histogram(before.get(name, {}), family)
        was = dict(hb[0]) if hb else {}
        for le, c in h[0]:
            by_le[le] = by_le.get(le, 0.0) + c - was.get(le, 0.0)
        count += h[1] - (hb[1] if hb else 0.0)
        total += h[2] - (hb[2] if hb else 0.0)
    if not found:
        return None
    return sorted(by_le.items()), count, total


def connector_ms(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, Any] | None:
    """Per phase of :data:`CONNECTOR_PHASES` the engines export: ``{"count", "mean",
    "p50", "p99"}`` over the run (after minus before, summed over the fleet's engines),
    in milliseconds, the percentiles by :func:`histogram_quantile` (so within a bucket's
    resolution: 1-1.5-2-3-5-7 steps a decade); ``mean`` is ``_sum / _count``.  None
    where no engine exports any (``baseline``, a connector without them)."""
    out: dict[str, Any] = {}
    for phase in CONNECTOR_PHASES:
        h = _hist_delta(before, after, f"vllm:kvstore_{phase}_seconds")
        if h is None:
            continue
        buckets, count, total = h
        n = int(round(count))

        def ms(x: float | None) -> float | None:
            return None if x is None else round(x * 1e3, 4)

        out[phase] = {
            "count": n,
            "mean": ms(total / count) if count > 0 else None,
            "p50": ms(histogram_quantile(0.5, buckets)) if n else None,
            "p99": ms(histogram_quantile(0.99, buckets)) if n else None,
        }
    return out or None


ENGINE_HISTOGRAMS = {
    "queue_ms": "vllm:request_queue_time_seconds",
    "prefill_ms": "vllm:request_prefill_time_seconds",
    "decode_ms": "vllm:request_decode_time_seconds",
}
"""vLLM's own per-request phase histograms :func:`engine_steps` reports (seconds, shown in ms)."""


def engine_steps(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, Any] | None:
    """How the engines spent the run, from vLLM's own metrics (after minus before, summed
    over the fleet): ``steps`` (iterations that ran tokens, ``vllm:iteration_tokens_total``'s
    count), ``tokens_per_step`` (its mean) and, per request, the mean and p50 of its time
    waiting to be scheduled (``queue_ms``), in prefill and in decode.  Configurations that
    do the same work in more, smaller steps pay each step's fixed cost more often: where a
    connector's "not yet" answers split batches, it shows here.  None: no engine exports them."""
    h = _hist_delta(before, after, "vllm:iteration_tokens_total")
    if h is None:
        return None
    _, count, total = h
    out: dict[str, Any] = {
        "steps": int(round(count)),
        "tokens_per_step": round(total / count, 2) if count > 0 else None,
    }
    for key, family in ENGINE_HISTOGRAMS.items():
        r = _hist_delta(before, after, family)
        if r is None or r[1] <= 0:
            continue
        buckets, n, sec = r
        p50 = histogram_quantile(0.5, buckets)
        out[key] = {"mean": round(sec / n * 1e3, 2), "p50": None if p50 is None else round(p50 * 1e3, 2)}
    return out


def store_blocks(
    before: dict[str, dict[str, int]],
    after: dict[str, dict[str, int]],
    engines_before: dict[str, dict[str, float]],
    engines_after: dict[str, dict[str, float]],
) -> dict[str, int] | None:
    """Blocks the store handed out over the run: the nodes' DRAM and NVMe reads, and the
    blocks engines' connectors pulled from another node into their own (a pull is also
    a read on the node it came from); and the payload bytes the nodes stored over the run
    (``stored_bytes``) and, of those stored blocks, read back at least once
    (``read_back_bytes``, counted at a block's first read: ``kvstore/node/readback.py``)."""
    if not after:
        return None

    def reads(name: str) -> int:
        # a node restarted during the run (--fault) starts its counters again from 0
        return sum(_counter_delta(after[n].get(name, 0), before.get(n, {}).get(name, 0)) for n in after)

    pulled = sum(
        delta(engines_after[e], engines_before.get(e, {}), "vllm:kvstore_pulled_blocks_total") for e in engines_after
    )
    return {
        "dram_reads": reads("get_hits_dram"),
        "nvme_reads": reads("get_hits_nvme"),
        "remote_pulls": int(pulled),
        "stored_bytes": reads("stored_bytes"),
        "read_back_bytes": reads("read_back_bytes"),
    }


def _counter_delta(after: int, before: int) -> int:
    """A counter's increase; one that went down was reset (its process restarted): all of it."""
    return after - before if after >= before else after


def connector_counters(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]], *, requests: int = 0
) -> dict[str, Any] | None:
    """The kvstore connector's counters over the run (``vllm:kvstore_*_total``, summed over
    the fleet's engines: lookups and their errors, handoff waits and timeouts, loads, load
    errors, pulls, ...); None where no engine runs the connector.  With ``requests`` (the
    run's), two deterministic figures per request beside them: ``deferred_per_request``,
    the scheduling passes in which vLLM was told "not yet" (a lookup not answered, a
    producer's handoff not committed), and ``lookup_rpcs_per_request``, the lookups that
    asked the store (the pool's view answers the rest in-process: ``view_lookups``); and
    where the engines follow the pool's view, ``view_lag_ms`` (``{"p50", "p99"}``: from a
    change on a node to the view applying it) beside ``view_stale_hits`` (loads the view
    planned that found fewer chunks than it promised)."""
    out: dict[str, float] = {}
    for name, a in after.items():
        for k, v in a.items():
            if k.startswith("vllm:kvstore_") and k.endswith("_total"):
                short = k[len("vllm:kvstore_") : -len("_total")]
                out[short] = out.get(short, 0.0) + v - before.get(name, {}).get(k, 0.0)
    counts: dict[str, Any] = {k: int(v) for k, v in sorted(out.items())}
    if counts and requests > 0:
        deferred = counts.get("lookup_pending", 0) + counts.get("handoff_waits", 0)
        counts["deferred_per_request"] = round(deferred / requests, 3)
        counts["lookup_rpcs_per_request"] = round(counts.get("lookups", 0) / requests, 3)
    lag = _hist_delta(before, after, "vllm:kvstore_view_lag_seconds")
    if counts and lag is not None and lag[1] > 0:
        counts["view_lag_ms"] = {
            q: round((histogram_quantile(p, lag[0]) or 0.0) * 1e3, 3) for q, p in (("p50", 0.5), ("p99", 0.99))
        }
    return counts or None


def summarise(
    records: Sequence[Record],
    *,
    slo_ttft_ms: float,
    slo_tbt_ms: float,
    baseline: Sequence[Record] | None,
    greedy: bool,
) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    ttft = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    tbts = [t for r in ok if (t := r.tbt_ms) is not None]
    itl = [x for r in ok for x in r.itl_ms]
    e2e = [r.e2e_ms for r in ok if r.e2e_ms is not None]
    start = min((r.arrival_s for r in records), default=0.0)
    # the makespan runs to the last answer of any kind: a front that refuses the second half
    # of a trace has not served its first half in a shorter time
    end = max(
        (r.arrival_s + (r.e2e_ms or r.ttft_ms or r.reject_ms or 0.0) / 1e3 for r in records),
        default=start,
    )
    span = max(end - start, 1e-9)
    good = [r for r in ok if (r.ttft_ms or 0.0) <= slo_ttft_ms and (r.tbt_ms is None or r.tbt_ms <= slo_tbt_ms)]
    out_tokens = sum(len(r.tokens) for r in ok)
    equal: float | None = None
    if baseline is not None and greedy:
        want = {r.index: r.tokens for r in baseline if r.ok}
        pairs = [(r.tokens, want[r.index]) for r in records if r.index in want]
        equal = round(sum(1 for a, b in pairs if list(a) == list(b)) / len(pairs), 4) if pairs else None
    return {
        "requests": len(records),
        "completed": len(ok),
        "errors": sum(1 for r in records if r.error is not None and not r.rejected),
        "rejected": sum(1 for r in records if r.rejected),
        "reject_ms": percentiles([r.reject_ms for r in records if r.reject_ms is not None], (50, 99, 100), digits=3),
        "ttft_ms": percentiles(ttft, (50, 90, 99), digits=3),
        "tbt_ms": percentiles(tbts, (50, 90, 99), digits=3),
        "itl_ms": percentiles(itl, (50, 99), digits=3),
        "e2e_ms": percentiles(e2e, (50, 99), digits=3),
        "throughput_tok_s": round(out_tokens / span, 2),
        "goodput_rps": round(len(good) / span, 4),
        "slo_met": round(len(good) / len(records), 4) if records else None,
        "makespan_s": round(span, 3),
        "tokens_equal_baseline": equal,
    }


RANGE_KEYS = (
    "ttft_ms.p50",
    "ttft_ms.p90",
    "ttft_ms.p99",
    "tbt_ms.p50",
    "tbt_ms.p90",
    "tbt_ms.p99",
    "itl_ms.p50",
    "itl_ms.p99",
    "e2e_ms.p50",
    "e2e_ms.p99",
    "throughput_tok_s",
    "goodput_rps",
    "slo_met",
    "makespan_s",
    "tokens_equal_baseline",
    "prompt_tokens.engine_cache",
    "prompt_tokens.store",
    "prompt_tokens.recomputed",
)
"""The figures whose spread over repeated runs ``repeats.ranges`` gives (dotted paths)."""


def _is_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _median_tree(values: Sequence[Any]) -> Any:
    """The runs' values of one key combined: dicts key by key, numbers by their median
    (over the runs that have one; an int where every run's is and the median is whole),
    anything else (strings, lists, flags) as the first run that has it gives it."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    if all(isinstance(v, dict) for v in present):
        keys: list[str] = []
        for v in present:
            keys += [k for k in v if k not in keys]
        return {k: _median_tree([v.get(k) for v in present]) for k in keys}
    if all(_is_number(v) for v in present):
        m = float(np.median(np.asarray(present, dtype=float)))
        if all(isinstance(v, int) for v in present) and m.is_integer():
            return int(m)
        return round(m, 4)
    return present[0]


def _at(d: dict[str, Any], path: str) -> Any:
    for part in path.split("."):
        if not isinstance(d, dict):
            return None
        d = d.get(part)  # type: ignore[assignment]
    return d


def combine_runs(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's summary over repeated runs (``--repeat``): each numeric figure
    the median of the runs' (same keys), with ``repeats`` ``{"n", "ranges": {path: [min,
    max]}}`` for :data:`RANGE_KEYS` (those some run has) and ``runs``, every run's summary."""
    out = _median_tree(list(runs))
    ranges: dict[str, list[float]] = {}
    for path in RANGE_KEYS:
        xs = [v for r in runs if _is_number(v := _at(r, path))]
        if xs:
            ranges[path] = [min(xs), max(xs)]
    out["repeats"] = {"n": len(runs), "ranges": ranges}
    out["runs"] = list(runs)
    return dict(out)


def summarise_runs(
    runs: Mapping[str, Sequence[Sequence[Record]]],
    extras: Mapping[str, Sequence[dict[str, Any]]],
    *,
    slo_ttft_ms: float,
    slo_tbt_ms: float,
    greedy: bool,
) -> dict[str, dict[str, Any]]:
    """Each configuration's summary from its runs' records (``runs[name][i]``: run ``i``) and
    counters (``extras[name][i]``, merged in): run ``i`` is compared with ``baseline``'s run
    ``i`` (``baseline``'s own runs with its first); one run is its summary, several are
    combined (:func:`combine_runs`)."""
    base_runs = runs.get("baseline") or []
    out: dict[str, dict[str, Any]] = {}
    for name, recs_by_run in runs.items():
        per_run = []
        more = extras.get(name) or []
        for i, recs in enumerate(recs_by_run):
            j = 0 if name == "baseline" else i
            one = summarise(
                recs,
                slo_ttft_ms=slo_ttft_ms,
                slo_tbt_ms=slo_tbt_ms,
                baseline=base_runs[j] if j < len(base_runs) else None,
                greedy=greedy,
            )
            one.update(more[i] if i < len(more) else {})
            per_run.append(one)
        out[name] = per_run[0] if len(per_run) == 1 else combine_runs(per_run)
    return out


def _ratio(x: float | None, y: float | None) -> str:
    if x is None or y is None or y == 0 or (isinstance(y, float) and math.isnan(y)):
        return ""
    return f"{x / y:.2f}x"


def print_table(result: dict[str, Any], f: TextIO, title: str = "kvstore bench serving") -> None:
    """One block per configuration, with ratios to ``baseline`` where it ran."""
    slo = result["slo"]
    print(
        f"{title}: {result['trace']['path']}, {result['trace']['requests']} requests over "
        f"{result['trace']['duration_s']:.0f} s (offered {result['trace']['offered_rps']} req/s); "
        f"SLO: TTFT <= {slo['ttft_ms']:.0f} ms, TBT <= {slo['tbt_ms']:.0f} ms",
        file=f,
    )
    for step in result.get("steps") or [{"offered_rps": None, "configs": result["configs"]}]:
        if step["offered_rps"] is not None:
            print(f"\noffered load {step['offered_rps']:.3f} req/s", file=f)
        configs = step["configs"]
        base = configs.get("baseline")
        rows = [
            ("TTFT p50 ms", lambda c: c["ttft_ms"]["p50"]),
            ("TTFT p90 ms", lambda c: c["ttft_ms"]["p90"]),
            ("TTFT p99 ms", lambda c: c["ttft_ms"]["p99"]),
            ("TBT p50 ms", lambda c: c["tbt_ms"]["p50"]),
            ("TBT p99 ms", lambda c: c["tbt_ms"]["p99"]),
            ("ITL p50 ms", lambda c: c["itl_ms"]["p50"]),
            ("ITL p99 ms", lambda c: c["itl_ms"]["p99"]),
            ("e2e p50 ms", lambda c: c["e2e_ms"]["p50"]),
            ("throughput tok/s", lambda c: c["throughput_tok_s"]),
            ("goodput req/s", lambda c: c["goodput_rps"]),
        ]
        names = list(configs)
        w = 14
        print(f"\n{'':20}" + "".join(f"{n:>{w}}{'(x base)':>{10}}" for n in names), file=f)
        for label, get in rows:
            line = f"{label:20}"
            for n in names:
                v = get(configs[n])
                b = get(base) if base is not None else None
                line += f"{'-' if v is None else f'{v:.1f}':>{w}}{_ratio(v, b) if n != 'baseline' else '':>10}"
            print(line, file=f)
        for n in names:
            c = configs[n]
            pt = c.get("prompt_tokens") or {}
            tiers = c.get("store_blocks")
            eq = c.get("tokens_equal_baseline")
            print(
                f"  {n}: {c['completed']}/{c['requests']} completed, {c['errors']} errors, {c['rejected']} rejected; "
                f"prompt tokens: engine cache {pt.get('engine_cache')}, store {pt.get('store')}, "
                f"recomputed {pt.get('recomputed')}"
                + (f" (store blocks: {tiers})" if tiers else "")
                + (f"; greedy tokens equal to baseline: {eq:.0%}" if eq is not None else ""),
                file=f,
            )
            for line in _detail_lines(c):
                print(f"    {line}", file=f)
    for n, info in (result.get("fleets") or {}).items():
        cpus = ", ".join(f"{e['name']} on CPU {e['cpus']}" for e in info["engines"])
        print(f"  {n} fleet: {cpus}; started in {info['started_s']:.0f} s", file=f)
    faults = result.get("faults")
    if faults:
        plan = ", ".join(f"{x['action']} node{x['node']} at {x['at_s']:g} s" for x in faults["plan"])
        skipped = "; ".join(f"{n}: {why}" for n, why in faults["not_applied"].items())
        print(f"  faults: {plan}" + (f" (not applied to {skipped})" if skipped else ""), file=f)
    for msg in result.get("failures") or []:
        print(f"  failure: {msg}", file=f)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def _detail_lines(c: dict[str, Any]) -> list[str]:
    """The compact extra lines of one configuration: connector time, spread over repeats, faults."""
    lines = []
    cms = c.get("connector_ms")
    if cms:
        parts = [
            f"{phase} {h['count']}× {_fmt(h['mean'])}/{_fmt(h['p50'])}/{_fmt(h['p99'])}" for phase, h in cms.items()
        ]
        lines.append("connector ms (samples× mean/p50/p99): " + ", ".join(parts))
    es = c.get("engine_steps")
    if es:
        parts = [f"{es['steps']} steps, {_fmt(es['tokens_per_step'])} tokens/step"]
        parts += [f"{k[:-3]} {_fmt(es[k]['mean'])}/{_fmt(es[k]['p50'])}" for k in ENGINE_HISTOGRAMS if k in es]
        lines.append("engine (per request mean/p50 ms): " + ", ".join(parts))
    rep = c.get("repeats")
    if rep:
        rg = rep["ranges"]
        shown = [k for k in ("ttft_ms.p50", "ttft_ms.p99", "tbt_ms.p99", "goodput_rps") if k in rg]
        lines.append(
            f"median of {rep['n']} runs; ranges: " + ", ".join(f"{k} {_fmt(rg[k][0])}..{_fmt(rg[k][1])}" for k in shown)
        )
    for fault in c.get("faults") or []:
        done = f"done at {fault['done_at_s']:.1f} s" if fault["done_at_s"] is not None else "not done"
        err = f" ({fault['error']})" if fault["error"] else ""
        lines.append(f"fault: {fault['action']} node{fault['node']} at {fault['at_s']:g} s: {done}{err}")
    return lines


def sweep_capacity(result: dict[str, Any], target: float = SLO_TARGET) -> dict[str, float | None]:
    """Per configuration, the knee the plot marks: the highest offered rate of a
    ``--sweep-rate`` up to which every rate had at least ``target`` of its requests within the
    SLO (``slo_met``; ``kvstore sim --capacity``'s rule); a passing rate above a failing one
    does not count (noise, not capacity).  None where the lowest rate already failed."""
    out: dict[str, float | None] = {}
    for name in result["configs"]:
        knee = None
        for s in sorted(result.get("steps") or [], key=lambda s: s["offered_rps"]):
            if name not in s["configs"]:
                continue
            if (s["configs"][name].get("slo_met") or 0) < target:
                break
            knee = s["offered_rps"]
        out[name] = knee
    return out


def plot(result: dict[str, Any], records: Sequence[Record], path: str) -> None:
    """TTFT CDF per configuration (the last step's records) and goodput against offered load."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = result.get("steps") or []
    fig, axes = plt.subplots(1, 2 if steps else 1, figsize=(12 if steps else 6, 4.5), squeeze=False)
    ax = axes[0][0]
    last = max((r.step for r in records), default=0)
    for name in result["configs"]:
        xs = sorted(r.ttft_ms for r in records if r.config == name and r.step == last and r.ok and r.ttft_ms)
        if xs:
            ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=name)
    ax.axvline(result["slo"]["ttft_ms"], color="grey", linestyle=":", label="TTFT SLO")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("share of requests")
    ax.set_title("TTFT CDF")
    ax.legend()
    if steps:
        ax = axes[0][1]
        knees = sweep_capacity(result)
        for name in result["configs"]:
            pts = [(s["offered_rps"], s["configs"][name]["goodput_rps"]) for s in steps if name in s["configs"]]
            (line,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
            knee = knees.get(name)
            if knee is not None:  # the capacity: the highest rate with >= 90 % within the SLO
                y = next(g for r, g in pts if r == knee)
                ax.plot([knee], [y], marker="*", markersize=16, color=line.get_color())
                ax.annotate(f"{knee:.3g}", (knee, y), textcoords="offset points", xytext=(6, -12), fontsize=8)
        ax.set_xlabel("offered load (req/s)")
        ax.set_ylabel("goodput at SLO (req/s)")
        ax.set_title(f"capacity (*) at >= {SLO_TARGET:.0%} within the SLO")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

"""Figures of a serving run: per-configuration summaries (the JSON contract), the table a
person reads, and the plot.  Pure functions of the records and counters they are given.

Per configuration (``summarise``): ``requests``, ``completed``, ``errors``, ``rejected``;
p50/p90/p99 of TTFT and TBT (Mooncake's: the mean of a request's slowest 10 % of
inter-token intervals), ITL p50/p99 over every interval, end-to-end p50/p99;
``throughput_tok_s`` (output tokens over the makespan: first arrival to last token);
``goodput_rps``: requests that met both ``slo.ttft_ms`` and ``slo.tbt_ms``, per second of
makespan; ``prompt_tokens`` by source (``engine_cache``: vLLM's own prefix cache,
``store``: the connector, ``recomputed``: the rest; from the engines' ``/metrics``
counters over the run, summed over the fleet's engines, so in ``pd`` a prompt counts on
its prefill and on its decode engine), ``store_blocks`` (DRAM and NVMe reads, remote
pulls, from the nodes' and the connector's counters) and ``tokens_equal_baseline``;
``reject_ms`` (p50/p99/p100 of how soon a refused request was answered).  The conductor
configurations add ``routing``: the conductor's ``predicted_ttft_abs_err_median``,
``decisions_per_engine`` and ``decision_us`` (p50, p99), and beside them
``decision_cpu_us`` (the same decisions in the conductor thread's CPU time: the rest is
time the process waited for a core), ``refusal_ms`` (arrival to 429, inside the
conductor), ``rejected`` and ``pool_errors``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, TextIO

import numpy as np

from kvstore.bench.serving.runner import Record


def pct(values: Sequence[float], qs: Sequence[int]) -> dict[str, float | None]:
    if not values:
        return {f"p{q}": None for q in qs}
    a = np.asarray(values, dtype=float)
    return {f"p{q}": round(float(np.percentile(a, q)), 3) for q in qs}


def delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def prompt_sources(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, Any]:
    """Prompt tokens by source over the run, from every engine's ``/metrics``, per finished
    request: ``total`` (``vllm:request_prompt_tokens``), ``recomputed`` (vLLM's
    ``vllm:request_prefill_kv_computed_tokens``: the prompt less its cached tokens),
    ``store`` (the connector's hits, ``vllm:external_prefix_cache_hits``) and
    ``engine_cache`` (the rest: vLLM's own prefix cache)."""
    total = computed = external = 0.0
    have = False
    for name, a in after.items():
        b = before.get(name, {})
        if "vllm:request_prompt_tokens_sum" not in a:
            continue
        have = True
        total += delta(a, b, "vllm:request_prompt_tokens_sum")
        computed += delta(a, b, "vllm:request_prefill_kv_computed_tokens_sum")
        external += delta(a, b, "vllm:external_prefix_cache_hits_total")
    if not have:
        return {"engine_cache": None, "store": None, "recomputed": None, "total": None}
    return {
        "engine_cache": int(max(0.0, total - computed - external)),
        "store": int(external),
        "recomputed": int(computed),
        "total": int(total),
    }


def store_blocks(
    before: dict[str, dict[str, int]],
    after: dict[str, dict[str, int]],
    engines_before: dict[str, dict[str, float]],
    engines_after: dict[str, dict[str, float]],
) -> dict[str, int] | None:
    """Blocks the store handed out over the run: the nodes' DRAM and NVMe reads, and the
    blocks engines' connectors pulled from another node into their own (a pull is also
    a read on the node it came from)."""
    if not after:
        return None

    def reads(name: str) -> int:
        return sum(after[n].get(name, 0) - before.get(n, {}).get(name, 0) for n in after)

    pulled = sum(
        delta(engines_after[e], engines_before.get(e, {}), "vllm:kvstore_pulled_blocks_total") for e in engines_after
    )
    return {"dram_reads": reads("get_hits_dram"), "nvme_reads": reads("get_hits_nvme"), "remote_pulls": int(pulled)}


def connector_counters(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]
) -> dict[str, int] | None:
    """The kvstore connector's counters over the run (``vllm:kvstore_*_total``, summed over
    the fleet's engines: lookups and their errors, handoff waits and timeouts, loads, load
    errors, pulls, ...); None where no engine runs the connector."""
    out: dict[str, float] = {}
    for name, a in after.items():
        for k, v in a.items():
            if k.startswith("vllm:kvstore_") and k.endswith("_total"):
                short = k[len("vllm:kvstore_") : -len("_total")]
                out[short] = out.get(short, 0.0) + v - before.get(name, {}).get(k, 0.0)
    return {k: int(v) for k, v in sorted(out.items())} or None


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
        "reject_ms": pct([r.reject_ms for r in records if r.reject_ms is not None], (50, 99, 100)),
        "ttft_ms": pct(ttft, (50, 90, 99)),
        "tbt_ms": pct(tbts, (50, 90, 99)),
        "itl_ms": pct(itl, (50, 99)),
        "e2e_ms": pct(e2e, (50, 99)),
        "throughput_tok_s": round(out_tokens / span, 2),
        "goodput_rps": round(len(good) / span, 4),
        "slo_met": round(len(good) / len(records), 4) if records else None,
        "makespan_s": round(span, 3),
        "tokens_equal_baseline": equal,
    }


def _ratio(x: float | None, y: float | None) -> str:
    if x is None or y is None or y == 0 or (isinstance(y, float) and math.isnan(y)):
        return ""
    return f"{x / y:.2f}x"


def print_table(result: dict[str, Any], f: TextIO) -> None:
    """One block per configuration, with ratios to ``baseline`` where it ran."""
    slo = result["slo"]
    print(
        f"kvstore bench serving: {result['trace']['path']}, {result['trace']['requests']} requests over "
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
    for n, info in (result.get("fleets") or {}).items():
        cpus = ", ".join(f"{e['name']} on CPU {e['cpus']}" for e in info["engines"])
        print(f"  {n} fleet: {cpus}; started in {info['started_s']:.0f} s", file=f)
    for msg in result.get("failures") or []:
        print(f"  failure: {msg}", file=f)


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
        for name in result["configs"]:
            pts = [(s["offered_rps"], s["configs"][name]["goodput_rps"]) for s in steps if name in s["configs"]]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax.set_xlabel("offered load (req/s)")
        ax.set_ylabel("goodput at SLO (req/s)")
        ax.set_title("capacity")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

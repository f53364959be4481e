"""``kvstore plan``: the DRAM and NVMe sizes that reach a target prefix hit ratio on a trace.

    kvstore plan TRACE --target-hit-ratio 0.3 --bytes-per-token 131072 --plot plan.png
    kvstore plan TRACE --target-hit-ratio 30% --layers 32 --kv-heads 8 --head-dim 128 --dtype bfloat16 --json

Method (parsing and reporting here; replays in :mod:`kvstore.traces.sweep`):

1. sweep the capacities (``--fractions`` of the trace's unique blocks) for every policy and
   the offline optimum;
2. for the planned policy (the node's default unless ``--policy``) and for the optimum,
   find the smallest capacity that reaches the target: the first sweep point that does,
   then bisection between it and the point before (to 1 %);
3. bytes = blocks × ``block_tokens`` × bytes per token (``--bytes-per-token``, or from the
   model's KV layout: layers × 2 (K and V; 1 with ``--mla``) × kv heads × head dim × dtype size);
4. split, the way the node's tiers work together: DRAM victims are demoted to NVMe and NVMe
   hits are promoted back (keeping their NVMe copy), so NVMe must hold the whole planned set
   and DRAM only the part that should be served at memory speed.  DRAM is sized as the
   smallest capacity whose hit ratio reaches ``--dram-share`` × target (by default 80 % of
   the hits come from DRAM); NVMe as the planned capacity.  A DRAM-only plan (``--nvme 0``)
   is the planned capacity in DRAM.

The optimum's capacity is a lower bound no online policy reaches.

Two tiers, priced (``--nvme-fractions``, ``--dram-price-per-gib``, ``--nvme-price-per-gib``,
``--budget``): the planned policy is replayed through the node's DRAM *and* NVMe tier
managers (:func:`kvstore.traces.sweep.grid`) at every split of the grid DRAM
``--fractions`` × NVMe (0 and ``--nvme-fractions``), each split's cost is
``dram GiB × dram price + nvme GiB × nvme price``, and the planner answers

* ``cheapest_for_target``: the cheapest split whose hit ratio reaches the target
  (ties: fewer bytes); if none does, it says so and names the best split it found;
* ``best_for_budget``: the split with the highest hit ratio costing at most ``--budget``
  (ties: cheaper), with its prefill time saved per request when the cost model's inputs
  are given (:mod:`kvstore.traces.costmodel`: ``--recompute-tps``, ``--dram-gbps``,
  ``--nvme-gbps`` or ``--bench``).

Answers are grid points: as fine as the fractions asked for (no bisection in two dimensions).
``--heatmap PNG`` draws the grid's hit ratios with both answers marked.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from kvstore.block import DTYPES
from kvstore.errors import InvalidArgument
from kvstore.keys import KVLayout
from kvstore.progress import Progress
from kvstore.traces import costmodel
from kvstore.traces.format import DEFAULT_BLOCK_TOKENS, Trace
from kvstore.traces.plan_plot import amount
from kvstore.traces.replay import gap_closed, positive_int
from kvstore.traces.simulator import DEFAULT_PUT_BATCH, check_policy
from kvstore.traces.sweep import (
    DEFAULT_FRACTIONS,
    OPTIMAL,
    GridPoint,
    SweepPoint,
    capacities_for,
    grid,
    smallest_capacity,
    sweep,
)
from tiers.policy import DEFAULT_POLICY, POLICIES

GiB = 1 << 30
DEFAULT_NVME_FRACTIONS = (0.1, 0.2, 0.5, 1.0)
"""The two-tier grid's NVMe sizes (with 0, DRAM only), as fractions of unique blocks."""


def parse_ratio(v: str) -> float:
    s = v.strip()
    try:
        r = float(s[:-1]) / 100 if s.endswith("%") else float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--target-hit-ratio must be a ratio like 0.3 or 30%, got {v!r}") from None
    if not 0 < r <= 1:
        raise argparse.ArgumentTypeError(f"--target-hit-ratio must lie in (0, 1] (or (0%, 100%]), got {v!r}")
    return r


def parse_fractions(v: str) -> list[float]:
    try:
        out = [float(x[:-1]) / 100 if x.strip().endswith("%") else float(x) for x in v.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--fractions must be comma-separated fractions like 0.01,0.05,0.2 (or 1%,5%), got {v!r}"
        ) from None
    if not out or any(not 0 < f <= 1 for f in out):
        raise argparse.ArgumentTypeError(f"--fractions must each lie in (0, 1], got {v!r}")
    return out


def money(flag: str):  # argparse type factory: a finite, non-negative amount
    def conv(v: str) -> float:
        try:
            x = float(v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be a number, got {v!r}") from None
        if not (math.isfinite(x) and x >= 0):
            raise argparse.ArgumentTypeError(f"{flag} must be a non-negative number, got {v!r}")
        return x

    return conv


def parse_nvme_fractions(v: str) -> list[float]:
    try:
        return parse_fractions(v)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(str(e).replace("--fractions", "--nvme-fractions")) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", metavar="TRACE", help="Mooncake-format JSON-lines trace")
    p.add_argument(
        "--target-hit-ratio",
        type=parse_ratio,
        metavar="R",
        help="prefix hit ratio to reach, e.g. 0.3 or 30%% (required unless --budget is given)",
    )
    size = p.add_argument_group("KV bytes per token (one of)")
    size.add_argument("--bytes-per-token", type=positive_int("--bytes-per-token"), metavar="N")
    size.add_argument("--layers", type=positive_int("--layers"), metavar="L")
    size.add_argument("--kv-heads", type=positive_int("--kv-heads"), metavar="H")
    size.add_argument("--head-dim", type=positive_int("--head-dim"), metavar="D")
    size.add_argument("--dtype", default="float16", help=f"KV dtype (default float16; one of {sorted(DTYPES)})")
    size.add_argument("--mla", action="store_true", help="one joint latent per token instead of separate K and V")
    p.add_argument(
        "--block-tokens",
        type=positive_int("--block-tokens"),
        default=DEFAULT_BLOCK_TOKENS,
        help="tokens per hash id (default 512)",
    )
    p.add_argument("--requests", type=positive_int("--requests"), metavar="N", help="use only the first N requests")
    p.add_argument("--policy", default=DEFAULT_POLICY, help=f"policy to plan for (default {DEFAULT_POLICY})")
    p.add_argument(
        "--policies", help=f"policies to sweep and plot, comma-separated (default: all of {sorted(POLICIES)})"
    )
    p.add_argument(
        "--fractions",
        type=parse_fractions,
        default=list(DEFAULT_FRACTIONS),
        help="sweep capacities as fractions of unique blocks (default 0.01,0.02,0.05,0.1,0.2,0.5)",
    )
    p.add_argument(
        "--dram-share",
        type=float,
        default=0.8,
        metavar="S",
        help="share of the target hit ratio DRAM alone must reach (default 0.8)",
    )
    p.add_argument(
        "--put-batch",
        type=positive_int("--put-batch"),
        default=DEFAULT_PUT_BATCH,
        help="blocks per put call in the replays (default 16)",
    )
    p.add_argument("--jobs", type=positive_int("--jobs"), help="replays in parallel (default: CPU count)")
    p.add_argument("--plot", metavar="PNG", help="write hit ratio against capacity for every policy and the optimum")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    two = p.add_argument_group("two tiers and prices (a DRAM x NVMe grid through the node's tier managers)")
    two.add_argument(
        "--nvme-fractions",
        type=parse_nvme_fractions,
        metavar="F,F,...",
        help="NVMe sizes to sweep, fractions of unique blocks (default with prices or --budget: 0.1,0.2,0.5,1; "
        "NVMe 0, DRAM only, is always in the grid)",
    )
    two.add_argument(
        "--dram-price-per-gib", type=money("--dram-price-per-gib"), metavar="P", help="price of 1 GiB of DRAM"
    )
    two.add_argument(
        "--nvme-price-per-gib", type=money("--nvme-price-per-gib"), metavar="P", help="price of 1 GiB of NVMe"
    )
    two.add_argument(
        "--budget",
        type=money("--budget"),
        metavar="B",
        help="what DRAM + NVMe may cost (same unit as the prices): report the best split within it",
    )
    costmodel.add_arguments(two)
    two.add_argument("--heatmap", metavar="PNG", help="write the grid's hit ratios as a heat map, answers marked")


def bytes_per_token(a: argparse.Namespace) -> int:
    shape = (a.layers, a.kv_heads, a.head_dim)
    if a.bytes_per_token and any(shape):
        raise InvalidArgument("give --bytes-per-token or --layers/--kv-heads/--head-dim, not both")
    if a.bytes_per_token:
        return int(a.bytes_per_token)
    if not all(shape):
        missing = [f for f, v in zip(("--layers", "--kv-heads", "--head-dim"), shape) if not v]
        if len(missing) == 3:
            raise InvalidArgument(
                "give the KV size: --bytes-per-token N, or --layers, --kv-heads and --head-dim (with --dtype)"
            )
        raise InvalidArgument(f"the model's KV layout also needs {', '.join(missing)}")
    if a.dtype not in DTYPES:
        raise InvalidArgument(f"unknown --dtype {a.dtype!r}; choose one of {sorted(DTYPES)}")
    layout = KVLayout(num_layers=a.layers, num_kv_heads=a.kv_heads, head_dim=a.head_dim, kv_split=not a.mla)
    return layout.bytes_per_token(DTYPES[a.dtype][1])


def _needed(
    trace: Trace, points: list[SweepPoint], name: str, target: float, batch: int, progress: Progress | None = None
) -> int | None:
    """Smallest capacity (blocks) at which ``name`` reaches ``target``; None if even all unique blocks do not."""
    prev = 0
    for p in points:
        if p.hit_ratio[name] >= target:
            return smallest_capacity(trace, name, target, prev, p.capacity_blocks, batch=batch, progress=progress)
        prev = p.capacity_blocks
    top = trace.unique_blocks  # no eviction at all: the unlimited hit ratio
    if prev >= top or trace.summary()["unlimited_hit_ratio"] < target:  # type: ignore[operator]
        return None
    return smallest_capacity(trace, name, target, prev, top, batch=batch, progress=progress)


def _plan(
    trace: Trace, points: list[SweepPoint], a: argparse.Namespace, target: float, prog: Progress
) -> tuple[int | None, int | None, int]:
    """The capacities that reach ``target``: the policy's, the optimum's, and the policy's DRAM share."""
    need = _needed(trace, points, a.policy, target, a.put_batch, prog)
    need_opt = _needed(trace, points, OPTIMAL, target, a.put_batch, prog)
    dram = (
        (_needed(trace, points, a.policy, a.dram_share * target, a.put_batch, prog) or need) if need is not None else 0
    )
    return need, need_opt, dram


def _gib(blocks: int, block_bytes: int) -> float:
    return blocks * block_bytes / GiB


def _two_tier(a: argparse.Namespace) -> bool:
    return a.nvme_fractions is not None or any(
        v is not None for v in (a.dram_price_per_gib, a.nvme_price_per_gib, a.budget)
    )


def check_arguments(a: argparse.Namespace) -> None:
    """What argparse cannot check alone: which flags need which."""
    if a.target_hit_ratio is None and a.budget is None:
        raise InvalidArgument(
            "give --target-hit-ratio R (the cheapest size that reaches it), --budget B (the best split it buys), or both"
        )
    if _two_tier(a) and (a.dram_price_per_gib is None or a.nvme_price_per_gib is None):
        raise InvalidArgument(
            "a two-tier plan (--nvme-fractions, --budget) prices its splits: give --dram-price-per-gib and "
            "--nvme-price-per-gib (any currency, the same as --budget's)"
        )
    if not 0 < a.dram_share <= 1:
        raise InvalidArgument(f"--dram-share must lie in (0, 1], got {a.dram_share}")


def main(a: argparse.Namespace) -> int:
    bpt = bytes_per_token(a)
    check_policy(a.policy)
    policies = [s.strip() for s in a.policies.split(",") if s.strip()] if a.policies else sorted(POLICIES)
    for name in policies:
        check_policy(name)
    if a.policy not in policies:
        policies.append(a.policy)
    check_arguments(a)
    two_tier = _two_tier(a)
    model = None
    if two_tier:
        model = costmodel.from_args(a.recompute_tps, bpt, a.dram_gbps, a.nvme_gbps, a.bench)
    trace = Trace.load(a.trace, block_tokens=a.block_tokens, limit=a.requests)
    summary = trace.summary()
    block_bytes = a.block_tokens * bpt
    target = a.target_hit_ratio
    prog = Progress("kvstore plan", unit="replays")  # the sweep's count, then the bisections' (open-ended)
    with prog:
        points = sweep(
            trace, capacities_for(trace, a.fractions), policies, batch=a.put_batch, jobs=a.jobs, progress=prog
        )
        splits: list[GridPoint] = []
        if two_tier:
            nvme_caps = [0, *capacities_for(trace, a.nvme_fractions or DEFAULT_NVME_FRACTIONS)]
            splits = grid(
                trace,
                capacities_for(trace, a.fractions),
                nvme_caps,
                a.policy,
                batch=a.put_batch,
                jobs=a.jobs,
                progress=prog,
            )
        prog.total = None  # bisections: as many as it takes
        need, need_opt, dram = _plan(trace, points, a, target, prog) if target is not None else (None, None, 0)
    out: dict[str, Any] = {
        "trace": a.trace,
        **summary,
        "target_hit_ratio": target,
        "policy": a.policy,
        "bytes_per_token": bpt,
        "block_tokens": a.block_tokens,
        "block_bytes": block_bytes,
        "sweep": [
            {
                "capacity_blocks": p.capacity_blocks,
                "fraction": p.fraction,
                "capacity_bytes": p.capacity_blocks * block_bytes,
                "hit_ratio": p.hit_ratio,
                "gap_closed": {
                    n: gap_closed(p.hit_ratio[n], p.hit_ratio["lru"], p.hit_ratio[OPTIMAL]) for n in policies
                }
                if "lru" in p.hit_ratio
                else None,
            }
            for p in points
        ],
    }
    ok = True
    if target is not None:
        out["reachable"] = need is not None
        ok = need is not None
    if need is not None:
        out["plan"] = {
            "capacity_blocks": need,
            "total_bytes": need * block_bytes,
            "dram_bytes": dram * block_bytes,
            "dram_blocks": dram,
            "nvme_bytes": need * block_bytes,
            "dram_only_bytes": need * block_bytes,
            "dram_share": a.dram_share,
        }
    if need_opt is not None:
        out["optimal_capacity_blocks"] = need_opt
        out["optimal_bytes"] = need_opt * block_bytes
    if two_tier:
        rows = [_split_json(p, trace, a, block_bytes, model) for p in splits]
        out["prices"] = {"dram_per_gib": a.dram_price_per_gib, "nvme_per_gib": a.nvme_price_per_gib}
        out["grid"] = {
            "dram_blocks": sorted({p.dram_blocks for p in splits}),
            "nvme_blocks": sorted({p.nvme_blocks for p in splits}),
            "splits": rows,
        }
        if model is not None:
            out["cost_model"] = model.to_json()
        unlimited = float(summary["unlimited_hit_ratio"])  # type: ignore[arg-type]
        if target is not None:
            out["cheapest_for_target"] = cheapest_for_target(rows, target, unlimited)
            ok = ok and out["cheapest_for_target"]["found"]
        if a.budget is not None:
            out["budget"] = a.budget
            out["best_for_budget"] = best_for_budget(rows, a.budget)
            ok = ok and out["best_for_budget"]["found"]
    if a.plot:
        from kvstore.traces.plan_plot import plot_sweep

        marks = {}
        if need is not None:
            marks[f"{a.policy}: {_gib(need, block_bytes):.3g} GiB"] = need
        if need_opt is not None:
            marks[f"optimum: {_gib(need_opt, block_bytes):.3g} GiB"] = need_opt
        plot_sweep(
            points,
            a.plot,
            title=f"{a.trace}: {summary['requests']} requests, {summary['unique_blocks']:,} unique blocks of {a.block_tokens} tokens",
            unique_blocks=trace.unique_blocks,
            unlimited=float(summary["unlimited_hit_ratio"]),  # type: ignore[arg-type]
            block_bytes=block_bytes,
            target=target,
            marks=marks,
        )
        out["plot"] = a.plot
    if a.heatmap:
        if not two_tier:
            raise InvalidArgument("--heatmap draws the two-tier grid: give the prices (and --nvme-fractions)")
        from kvstore.traces.plan_plot import plot_grid

        plot_grid(
            out["grid"]["splits"],
            a.heatmap,
            title=f"{a.trace}: {a.policy}, DRAM x NVMe ({summary['unique_blocks']:,} unique blocks of {a.block_tokens} tokens)",
            unlimited=float(summary["unlimited_hit_ratio"]),  # type: ignore[arg-type]
            marks={
                k: out[k]["split"]
                for k in ("cheapest_for_target", "best_for_budget")
                if k in out and out[k]["split"] is not None
            },
        )
        out["heatmap"] = a.heatmap
    if a.json:
        print(json.dumps(out))
    else:
        _print_report(out, policies, block_bytes)
    return 0 if ok else 1


def _split_json(p: GridPoint, trace: Trace, a: argparse.Namespace, block_bytes: int, model: Any) -> dict[str, Any]:
    """One split of the grid as ``kvstore plan --json`` reports it."""
    u = trace.unique_blocks
    unlimited = float(trace.summary()["unlimited_hit_ratio"])  # type: ignore[arg-type]
    dram_gib, nvme_gib = _gib(p.dram_blocks, block_bytes), _gib(p.nvme_blocks, block_bytes)
    row: dict[str, Any] = {
        "dram_blocks": p.dram_blocks,
        "nvme_blocks": p.nvme_blocks,
        "dram_fraction": p.dram_blocks / u,
        "nvme_fraction": p.nvme_blocks / u,
        "dram_bytes": p.dram_blocks * block_bytes,
        "nvme_bytes": p.nvme_blocks * block_bytes,
        "cost": dram_gib * a.dram_price_per_gib + nvme_gib * a.nvme_price_per_gib,
        "hit_ratio": p.hit_ratio,
        "fraction_of_unlimited": p.hit_ratio / unlimited if unlimited else None,
        "tier_hits": {"dram": p.dram_hits / trace.total_blocks, "nvme": p.nvme_hits / trace.total_blocks}
        if trace.total_blocks
        else {"dram": 0.0, "nvme": 0.0},
    }
    if model is not None:
        saved = model.saved_s(p.hit_tokens, p.dram_hits, p.nvme_hits, trace.block_tokens)
        row["prefill_saved_s_per_request"] = saved / len(trace) if len(trace) else 0.0
    return row


def _describe(r: dict[str, Any]) -> str:
    return (
        f"DRAM {amount(r['dram_bytes'] / GiB)} GiB ({r['dram_blocks']:,} blocks) + NVMe {amount(r['nvme_bytes'] / GiB)} GiB "
        f"({r['nvme_blocks']:,} blocks), cost {amount(r['cost'])}: hit ratio {100 * r['hit_ratio']:.2f}%"
    )


def cheapest_for_target(rows: list[dict[str, Any]], target: float, unlimited: float) -> dict[str, Any]:
    """The cheapest split of the grid that reaches ``target`` (ties: fewer bytes), or why none does."""
    ok = [r for r in rows if r["hit_ratio"] >= target]
    if ok:
        r = min(ok, key=lambda r: (r["cost"], r["dram_bytes"] + r["nvme_bytes"], -r["hit_ratio"]))
        return {"found": True, "split": r, "answer": f"cheapest for {100 * target:.1f}%: {_describe(r)}"}
    best = max(rows, key=lambda r: (r["hit_ratio"], -r["cost"]), default=None)
    if target > unlimited:
        why = f"even unlimited capacity gives {100 * unlimited:.2f}% on this trace"
    else:
        why = "add larger --fractions or --nvme-fractions"
    found = f"; the best split of the grid is {_describe(best)}" if best is not None else ""
    return {
        "found": False,
        "split": None,
        "best_split": best,
        "answer": f"no split reaches {100 * target:.1f}%: {why}{found}",
    }


def best_for_budget(rows: list[dict[str, Any]], budget: float) -> dict[str, Any]:
    """The split of the grid with the highest hit ratio costing at most ``budget`` (ties: cheaper), or why none."""
    ok = [r for r in rows if r["cost"] <= budget * (1 + 1e-12)]
    if ok:
        r = max(ok, key=lambda r: (r["hit_ratio"], -r["cost"], -(r["dram_bytes"] + r["nvme_bytes"])))
        saved = (
            f"; prefill saved {1000 * r['prefill_saved_s_per_request']:.1f} ms per request"
            if "prefill_saved_s_per_request" in r
            else ""
        )
        return {"found": True, "split": r, "answer": f"best for a budget of {budget:.4g}: {_describe(r)}{saved}"}
    cheap = min(rows, key=lambda r: r["cost"], default=None)
    return {
        "found": False,
        "split": None,
        "answer": f"a budget of {budget:.4g} buys no split of the grid"
        + (f": the cheapest is {_describe(cheap)}" if cheap is not None else ""),
    }


def _print_report(o: dict[str, Any], policies: list[str], block_bytes: int) -> None:
    print(
        f"trace  {o['trace']}: {o['requests']} requests, {o['unique_blocks']:,} unique blocks of {o['block_tokens']} tokens "
        f"({block_bytes / 2**20:.1f} MiB each at {o['bytes_per_token']:,} bytes/token); unlimited-capacity hit ratio "
        f"{100 * o['unlimited_hit_ratio']:.2f}%"
    )
    names = [*policies, OPTIMAL]
    print(f"{'capacity':>9} {'blocks':>8} {'GiB':>9} " + " ".join(f"{n:>13}" for n in names))
    for p in o["sweep"]:
        print(
            f"{100 * p['fraction']:8.1f}% {p['capacity_blocks']:8,} {p['capacity_bytes'] / GiB:9.2f} "
            + " ".join(f"{100 * p['hit_ratio'][n]:12.2f}%" for n in names)
        )
    if o["target_hit_ratio"] is not None:
        _print_one_tier(o)
    if "grid" in o:
        _print_grid(o)
    if "plot" in o:
        print(f"plot   {o['plot']}")
    if "heatmap" in o:
        print(f"heatmap {o['heatmap']}")


def _print_one_tier(o: dict[str, Any]) -> None:
    t = 100 * o["target_hit_ratio"]
    if not o["reachable"]:
        print(f"target {t:.1f}% is out of reach: even unlimited capacity gives {100 * o['unlimited_hit_ratio']:.2f}%")
    else:
        pl = o["plan"]
        print(
            f"plan for {t:.1f}% with {o['policy']}: {pl['capacity_blocks']:,} blocks = {pl['total_bytes'] / GiB:.2f} GiB of KV"
        )
        print(
            f"  DRAM {pl['dram_bytes'] / GiB:.2f} GiB ({pl['dram_blocks']:,} blocks: alone they reach {pl['dram_share'] * t:.1f}%) "
            f"+ NVMe {pl['nvme_bytes'] / GiB:.2f} GiB (holds the whole set)"
        )
        print(f"  or DRAM only: {pl['dram_only_bytes'] / GiB:.2f} GiB with --nvme 0")
    if "optimal_capacity_blocks" in o:
        print(
            f"  lower bound (offline optimum): {o['optimal_capacity_blocks']:,} blocks = {o['optimal_bytes'] / GiB:.2f} GiB"
        )


def _print_grid(o: dict[str, Any]) -> None:
    g = o["grid"]
    by = {(r["dram_blocks"], r["nvme_blocks"]): r for r in g["splits"]}
    u = o["unique_blocks"]
    print(
        f"two tiers ({o['policy']}; prices per GiB: DRAM {o['prices']['dram_per_gib']:g}, NVMe {o['prices']['nvme_per_gib']:g}): "
        "hit ratio (cost) by DRAM row x NVMe column, % of unique blocks"
    )
    print(f"{'DRAM':>8} " + " ".join(f"{'NVMe ' + format(100 * n / u, '.3g') + '%':>20}" for n in g["nvme_blocks"]))
    for d in g["dram_blocks"]:
        cells = [by[(d, n)] for n in g["nvme_blocks"]]
        print(
            f"{100 * d / u:7.3g}% "
            + " ".join(f"{format(100 * r['hit_ratio'], '.2f') + '% (' + amount(r['cost']) + ')':>20}" for r in cells)
        )
    for k in ("cheapest_for_target", "best_for_budget"):
        if k in o:
            print(("" if o[k]["found"] else "NOT FOUND: ") + o[k]["answer"])

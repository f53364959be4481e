"""``kvstore sim``: ``kvstore bench serving``'s workload through a simulated fleet, in virtual time.

The same trace and workload flags as the benchmark (``kvstore.bench.serving.cli.add_workload_arguments``,
the same :func:`~kvstore.bench.serving.workload.build`), ``--engines`` engine models of one
profile (``--profile``: a bundled name or a JSON file) behind a round-robin front
(:mod:`kvstore.sim.fleet`), for each configuration of ``--configs``:

* ``baseline``: each engine with its own prefix cache only;
* ``pool``: one kvstore node per engine (``--node-dram``, ``--node-nvme``; ``--nodes M``: M
  nodes shared by the engines) and the connector's
  lookup, load gate and save policy (:mod:`kvstore.sim.pool`);
* ``pd``: ``pool``'s nodes, the first ``--prefill P`` engines (default half, at least 1,
  as the benchmark's ``--prefill``) prefill and the others decode: each request goes to a
  prefill engine for one token (``max_tokens`` 1, as the benchmark's front sends it), whose
  connector saves its chunks to its node, then to a decode engine, whose connector loads
  exactly those (from its own node's DRAM, or another node's over the network) and which
  computes the prompt's last token and decodes (:mod:`kvstore.sim.fleet`,
  :mod:`kvstore.sim.pool`); the front takes each role in turn;
* ``conductor``: ``pool``'s fleet behind the project's conductor (:mod:`kvstore.sim.conductor`),
  configured as the benchmark starts it (priors for the profile's hardware, ``--conductor-args``, the SLO targets, refusals
  only with ``--conductor-reject``);
* ``conductor-pd``: ``pd``'s fleet behind the conductor in its ``--pd`` mode.

The JSON (``--json``) has the benchmark's shape: ``trace``, ``scaling``, ``slo`` and per
configuration the figures of :func:`kvstore.bench.serving.report.summarise` (``ttft_ms``,
``tbt_ms``, ``itl_ms``, ``e2e_ms`` percentiles, ``throughput_tok_s``, ``goodput_rps``, ...),
``prompt_tokens`` (``engine_cache``, ``store``, ``recomputed``, ``total``), ``engine_steps``,
for every configuration but ``baseline`` ``store_blocks`` (with ``stored_bytes`` and
``read_back_bytes``: the nodes' read-back accounting in the profile's KV bytes), ``connector`` (``pd``: with
``handoffs`` and ``handoff_short``) and ``nodes``, for the conductor's the conductor's
``routing`` record (as the benchmark reports it) and ``kv_events`` (events its view
applied); ``fleets.NAME.engines`` each engine's name, role and node, as the benchmark's
``fleets``; ``sim`` says what ran (profile, engines, prefill engines, seed, virtual and
wall seconds).  ``tokens_equal_baseline`` is always null: no token ids are simulated.
Figures the benchmark reads from processes the sim does not have (``connector_ms``,
``cpu_s``) are absent.  In ``pd`` a prompt counts in ``prompt_tokens`` on its prefill and
on its decode engine, as in the benchmark.  Without ``--json``, the benchmark's table.

``--capacity`` (:mod:`kvstore.sim.capacity`) also searches, per configuration, the highest
offered rate (the workload's ``--rate`` scaling) at which at least 90 % of requests meet
the SLO (the benchmark's ``slo_met``): ``configs.NAME.capacity_rps`` and
``configs.NAME.capacity`` (every rate tried and its ``slo_met``); and runs every
configuration at ``baseline``'s capacity (``baseline`` is searched even when not in
``--configs``): ``at_baseline_capacity`` with ``rate_rps`` and ``configs.NAME``, the same
figures as ``configs``.  ``--overload F`` also runs each configuration at F × its own
capacity: ``configs.NAME.overload`` (its goodput, the search's peak goodput, their ratio
``goodput_vs_peak``, ``slo_met``, ``rejected``).  ``sim.runs`` counts the fleet runs.

``--repeat N`` runs each configuration N times, seeds ``--seed`` to ``--seed + N - 1`` (the
profile's step-time jitter), and reports each figure's median over the runs with
``repeats`` and ``runs`` as the benchmark's ``--repeat`` does; records carry their
``repeat``.  A percentile of a small run can move between seeds the way it moves between
real runs (a run's TTFTs with a gap at the median), so a simulation is compared with a real
``--repeat 3`` run at ``--repeat 3``.

Runs are deterministic for a seed: only the ``wall_s`` figures differ between two runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import sys
import time
from collections.abc import Callable
from typing import Any

from kvstore.bench.serving import report
from kvstore.bench.serving.cli import add_workload_arguments, scaling
from kvstore.bench.serving.workload import Workload, build
from kvstore.errors import InvalidArgument
from kvstore.sim.capacity import DEFAULT_TOLERANCE, SLO_TARGET, Capacity, at_rate, find_capacity
from kvstore.sim.profile import EngineProfile, list_profiles

CONFIGS = ("baseline", "pool", "pd", "conductor", "conductor-pd")
"""The configurations ``kvstore sim`` can run (``--configs``; all by default, as the benchmark)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_workload_arguments(p)
    p.add_argument(
        "--configs", default=",".join(CONFIGS), help=f"configurations to run, in order (default {','.join(CONFIGS)})"
    )
    g = p.add_argument_group("fleet")
    g.add_argument("--engines", type=int, default=2, help="engines per configuration (default 2)")
    g.add_argument(
        "--prefill", type=int, default=None, help="pd, conductor-pd: prefill engines (default half, at least 1)"
    )
    g.add_argument(
        "--profile",
        default="local",
        metavar="NAME|FILE",
        help=f"engine profile: bundled ({', '.join(list_profiles())}) or a JSON file (default local)",
    )
    g.add_argument(
        "--nodes",
        type=int,
        metavar="M",
        help="pool, conductor: M kvstore nodes shared by the engines, consecutive engines on one node "
        "(default: one per engine)",
    )
    g.add_argument("--node-dram", default="1GiB", help="pool: each kvstore node's DRAM tier (default 1GiB)")
    g.add_argument("--node-nvme", default="2GiB", help="pool: each kvstore node's NVMe tier (default 2GiB; 0: none)")
    g.add_argument(
        "--connector-extra",
        default="{}",
        metavar="JSON",
        help="pool: the connector's kv_connector_extra_config, as the benchmark's; the simulation honours "
        "chunk_tokens, save_policy (default evidence: learnt from the simulated nodes' read-back counters), "
        "load_gate, async_loads and prefetch (with lookups view, the default; rpc: no prefetch) (default {})",
    )
    g.add_argument("--seed", type=int, default=0, help="seed of the engines' step-time jitter (default 0)")
    g.add_argument(
        "--repeat",
        type=int,
        default=1,
        metavar="N",
        help="run each configuration N times, seeds --seed to --seed+N-1, and report each figure's median over "
        "the runs as `kvstore bench serving --repeat N` does (repeats.ranges, runs; default 1). With a profile's "
        "jitter a percentile moves between seeds as it does between real runs; compare like with like",
    )
    g.add_argument(
        "--conductor-reject",
        action="store_true",
        help="conductor: early rejection on, at --slo-ttft-ms and --slo-tbt-ms (429 before any engine works)",
    )
    g.add_argument("--conductor-args", default="", help="conductor: more flags for `kvstore conductor` (one string)")
    g = p.add_argument_group("capacity")
    g.add_argument(
        "--capacity",
        action="store_true",
        help="search each configuration's capacity: the highest offered rate at which >= 90%% of requests meet "
        "the SLO (bisected from the workload's rate), and run every configuration at baseline's",
    )
    g.add_argument(
        "--capacity-tolerance",
        type=float,
        default=DEFAULT_TOLERANCE,
        metavar="F",
        help=f"stop the search once the passing and failing rates are within this share (default {DEFAULT_TOLERANCE})",
    )
    g.add_argument(
        "--overload",
        type=float,
        default=None,
        metavar="F",
        help="with --capacity: also run each configuration at F times its capacity and report its goodput against "
        "the search's peak (configs.NAME.overload; with --conductor-reject, what early rejection holds)",
    )
    g = p.add_argument_group("output")
    g.add_argument("--json", action="store_true", help="print one JSON object on stdout (the table goes to stderr)")
    g.add_argument(
        "--records",
        metavar="FILE",
        help="write every request's record here (JSON lines, as `kvstore bench serving --records`; not the "
        "--capacity search's runs)",
    )
    g.add_argument(
        "--plot",
        metavar="PNG",
        help="with --capacity: goodput (and TTFT p50) against offered load per configuration, each capacity marked",
    )


def parse_configs(text: str) -> list[str]:
    names = [c.strip() for c in text.split(",") if c.strip()]
    bad = [c for c in names if c not in CONFIGS]
    if bad or not names:
        raise InvalidArgument(
            f"--configs: unknown configuration(s) {', '.join(bad) if bad else repr(text)} (known: {', '.join(CONFIGS)})"
        )
    return names


def connector_settings(text: str) -> Any:
    """``--connector-extra``: the connector's own settings (``ConnectorSettings.from_extra``)."""
    from gpu_agent.vllm.settings import ConnectorSettings

    try:
        extra = json.loads(text)
        if not isinstance(extra, dict):
            raise ValueError("not an object")
    except ValueError as e:
        raise InvalidArgument(f"--connector-extra must be a JSON object: {e}") from None
    return ConnectorSettings.from_extra(extra)


def run_config(
    name: str,
    workload: Workload,
    profile: EngineProfile,
    *,
    engines: int,
    seed: int,
    node_dram: int,
    node_nvme: int,
    slo_ttft_ms: float,
    slo_tbt_ms: float,
    settings: Any = None,
    hashes: Any = None,
    conductor: Any = None,
    nodes: int | None = None,
    prefill: int | None = None,
    records: list[Any] | None = None,
) -> dict[str, Any]:
    """One configuration's summary (the benchmark's figures and the simulator's); with
    ``records``, every request's :class:`~kvstore.bench.serving.runner.Record` is appended to it.
    ``conductor``: the conductor's configuration (default :func:`kvstore.sim.conductor.conductor_config`
    at the SLO targets, ``--pd`` for ``conductor-pd``); ``prefill``: the prefill engines of
    ``pd`` and ``conductor-pd`` (default :func:`default_prefill`)."""
    from kvstore.sim.fleet import Router, roles, run_fleet
    from kvstore.traces.simulator import TraceClock

    if name not in CONFIGS:
        parse_configs(name)
    t0 = time.perf_counter()
    clock = TraceClock()
    hooks = None
    router: Router | None = None
    pool: dict[str, Any] = {"store_blocks": None}
    n_prefill = (default_prefill(engines) if prefill is None else prefill) if name in PD_CONFIGS else 0
    role = roles(engines, n_prefill)
    if name != "baseline":
        from kvstore.sim.pool import PoolHooks

        hooks = PoolHooks(
            profile,
            engines,
            nodes=nodes,
            node_dram=node_dram,
            node_nvme=node_nvme,
            clock=clock,
            settings=settings,
            roles=role,
        )
    if name in ("conductor", "conductor-pd"):
        from kvstore.sim.conductor import ConductorRouter, conductor_config

        assert hooks is not None
        cfg = conductor if conductor is not None else conductor_config(slo_ttft_ms, slo_tbt_ms, profile=profile)
        if cfg.pd != (name == "conductor-pd"):
            cfg = dataclasses.replace(cfg, pd=name == "conductor-pd")
        router = ConductorRouter(
            profile, engines, pool=hooks.pool, cfg=cfg, clock=clock, node_of=hooks.node_of, roles=role
        )
    try:
        fr = run_fleet(
            workload,
            profile,
            engines=engines,
            seed=seed,
            hooks=hooks,
            router=router,
            clock=clock,
            hashes=hashes,
            prefill=n_prefill,
        )
        if hooks is not None:
            pool = hooks.summary()
        if router is not None:
            pool.update(router.summary())
    finally:
        if hooks is not None:
            hooks.close()
    recs = fr.records(name)
    if records is not None:
        records.extend(recs)
    out = report.summarise(recs, slo_ttft_ms=slo_ttft_ms, slo_tbt_ms=slo_tbt_ms, baseline=None, greedy=False)
    out["prompt_tokens"] = fr.prompt_tokens()
    out["engine_steps"] = fr.engine_steps()
    out.update(pool)
    out["sim"] = {"virtual_s": round(fr.virtual_s, 3), "wall_s": round(time.perf_counter() - t0, 2)}
    return out


PD_CONFIGS = ("pd", "conductor-pd")
"""The configurations with prefill and decode engines."""


def default_prefill(engines: int) -> int:
    """The benchmark's default ``--prefill``: half the engines, at least 1."""
    return max(1, engines // 2)


def fleet_engines(name: str, engines: int, prefill: int, nodes: int | None) -> list[dict[str, Any]]:
    """A configuration's engines as the benchmark's ``fleets.NAME.engines`` lists them: name,
    role and node (None: no kvstore node)."""
    from kvstore.sim.fleet import roles
    from kvstore.sim.pool import node_of

    where = node_of(engines, nodes) if name != "baseline" else None
    return [
        {"name": f"engine{i}", "role": r, "node": f"node{where[i]}" if where is not None else None}
        for i, r in enumerate(roles(engines, prefill if name in PD_CONFIGS else 0))
    ]


def run(a: argparse.Namespace) -> dict[str, Any]:
    from kvstore.node.config import parse_size
    from kvstore.sim.fleet import workload_hashes

    t0 = time.perf_counter()
    configs = parse_configs(a.configs)
    if a.slo_ttft_ms <= 0 or a.slo_tbt_ms <= 0:
        raise InvalidArgument("--slo-ttft-ms and --slo-tbt-ms must be positive")
    if getattr(a, "plot", None) and not a.capacity:
        raise InvalidArgument("--plot needs --capacity: it plots the capacity search's runs")
    if getattr(a, "overload", None) is not None and (not a.capacity or not a.overload > 1):
        raise InvalidArgument("--overload F needs --capacity and F above 1 (a multiple of each capacity)")
    if a.engines < 1:
        raise InvalidArgument(f"--engines must be at least 1, got {a.engines}")
    repeat = int(getattr(a, "repeat", 1))
    if not 1 <= repeat <= 100:
        raise InvalidArgument(f"--repeat must be 1 to 100, got {repeat}")
    if a.nodes is not None:
        from kvstore.sim.pool import node_of

        node_of(a.engines, a.nodes)  # checked before anything runs
    prefill = default_prefill(a.engines) if a.prefill is None else a.prefill
    if any(c in PD_CONFIGS for c in configs):
        from kvstore.sim.fleet import roles

        roles(a.engines, prefill)  # checked before anything runs
    profile = EngineProfile.load(a.profile)
    node_dram, node_nvme = parse_size(a.node_dram), parse_size(a.node_nvme)
    settings = connector_settings(a.connector_extra)
    cond = None
    if "conductor" in configs or "conductor-pd" in configs:
        from kvstore.sim.conductor import conductor_config

        cond = conductor_config(
            a.slo_ttft_ms, a.slo_tbt_ms, reject=a.conductor_reject, extra=a.conductor_args, profile=profile
        )
    wl = build(a.trace, scaling(a))
    hashes = workload_hashes(wl, profile.block_size)
    result: dict[str, Any] = {
        "trace": wl.summary(),
        "scaling": wl.scaling.to_json(),
        "slo": {"ttft_ms": a.slo_ttft_ms, "tbt_ms": a.slo_tbt_ms},
        "configs": {},
        "fleets": {},
        "failures": [f"trace: {s}" for s in wl.skipped],
    }
    runs = 0

    records: list[Any] = []

    def one(name: str, w: Workload, keep: list[Any] | None = None) -> dict[str, Any]:
        """``name`` on ``w``, ``--repeat`` times (seeds ``--seed`` on): one run's summary, or
        the runs' medians (:func:`kvstore.bench.serving.report.combine_runs`); each run's
        records, tagged with its repeat, appended to ``keep``."""
        each = []
        for i in range(repeat):
            mine: list[Any] = []
            each.append(single(name, w, a.seed + i, mine if keep is not None else None))
            for r in mine:
                r.repeat = i
            if keep is not None:
                keep.extend(mine)
        if repeat == 1:
            return each[0]
        out = report.combine_runs(each)
        out["sim"] = {
            "virtual_s": max(c["sim"]["virtual_s"] for c in each),
            "wall_s": round(sum(c["sim"]["wall_s"] for c in each), 2),
        }
        return out

    def single(name: str, w: Workload, seed: int, keep: list[Any] | None) -> dict[str, Any]:
        nonlocal runs
        runs += 1
        return run_config(
            name,
            w,
            profile,
            engines=a.engines,
            seed=seed,
            node_dram=node_dram,
            node_nvme=node_nvme,
            slo_ttft_ms=a.slo_ttft_ms,
            slo_tbt_ms=a.slo_tbt_ms,
            settings=settings,
            hashes=hashes,
            conductor=cond,
            nodes=a.nodes,
            prefill=prefill,
            records=keep,
        )

    for name in configs:
        c = result["configs"][name] = one(name, wl, records)
        result["fleets"][name] = {"engines": fleet_engines(name, a.engines, prefill, a.nodes)}
        if c["errors"]:
            result["failures"].append(f"{name}: {c['errors']} requests refused by their engine (too long for its KV)")
    if a.capacity:
        capacity(result, wl, configs, one, tolerance=a.capacity_tolerance, overload=getattr(a, "overload", None))
    result["sim"] = {
        "profile": profile.name,
        "engines": a.engines,
        "prefill": prefill if any(c in PD_CONFIGS for c in configs) else None,
        "seed": a.seed,
        "repeat": repeat,
        "nodes": a.nodes if a.nodes is not None else a.engines,
        "node_dram_bytes": node_dram,
        "node_nvme_bytes": node_nvme,
        "connector": {
            "chunk_tokens": settings.chunk_for(profile.block_size),
            "save_policy": settings.save_policy,
            **{k: getattr(settings, k) for k in ("load_gate", "async_loads")},
        },
        "virtual_s": max(c["sim"]["virtual_s"] for c in result["configs"].values()),
        "runs": runs,
        "wall_s": round(time.perf_counter() - t0, 2),
    }
    if getattr(a, "records", None):
        with open(a.records, "w") as f:
            for r in records:
                f.write(json.dumps(r.to_json()) + "\n")
    return result


def steps_json(found: Capacity, at: Callable[[float], dict[str, Any]]) -> dict[str, Any]:
    """A search's JSON, each run with the goodput and TTFT p50 it gave (``--plot``'s points)."""
    out = found.to_json()
    for step, (r, _) in zip(out["steps"], found.steps):
        got = at(r)
        step["goodput_rps"] = got["goodput_rps"]
        step["ttft_p50_ms"] = got["ttft_ms"]["p50"]
    return out


def capacity(
    result: dict[str, Any],
    wl: Workload,
    configs: list[str],
    run: Callable[[str, Workload], dict[str, Any]],
    *,
    tolerance: float,
    overload: float | None = None,
) -> None:
    """``--capacity``: each configuration's search and the runs at ``baseline``'s capacity
    (and with ``overload`` F, each configuration at F × its own capacity), into ``result``
    (see the module docstring).  A run at a rate is made once and reused."""
    rate = wl.offered_rps
    if not math.isfinite(rate):
        raise InvalidArgument("--capacity needs a workload of at least two requests over some time")
    # the workload as given is the search's first step (exactly: at_rate would round)
    seen: dict[tuple[str, float], dict[str, Any]] = {(n, rate): dict(c) for n, c in result["configs"].items()}

    def at(name: str, r: float) -> dict[str, Any]:
        got = seen.get((name, r))
        if got is None:
            got = seen[(name, r)] = run(name, at_rate(wl, r))
        return got

    found: dict[str, Capacity] = {}
    for name in (*configs, *(() if "baseline" in configs else ("baseline",))):

        def met(r: float, name: str = name) -> float:
            return float(at(name, r)["slo_met"] or 0.0)

        found[name] = find_capacity(met, rate, tolerance=tolerance)
        if name in result["configs"]:
            result["configs"][name]["capacity_rps"] = round(found[name].capacity_rps, 4)
            result["configs"][name]["capacity"] = steps_json(found[name], functools.partial(at, name))
    base = found["baseline"].capacity_rps
    out: dict[str, Any] = {"rate_rps": round(base, 4), "slo_target": SLO_TARGET, "configs": {}}
    if "baseline" not in configs:
        out["baseline_capacity"] = steps_json(found["baseline"], functools.partial(at, "baseline"))
    if base > 0:
        for name in (*(() if "baseline" in configs else ("baseline",)), *configs):
            out["configs"][name] = at(name, base)
    else:
        result["failures"].append("capacity: baseline met the SLO at no rate tried: nothing runs at its capacity")
    result["at_baseline_capacity"] = out
    if overload is not None:
        for name in configs:
            result["configs"][name]["overload"] = overloaded(found[name], overload, functools.partial(at, name))


def overloaded(found: Capacity, factor: float, at: Callable[[float], dict[str, Any]]) -> dict[str, Any] | None:
    """``--overload``: the run at ``factor`` × the capacity against the peak goodput of every
    run made (the search's and this one; what early rejection should hold: goodput near its
    peak past the knee, not collapsing); None where the capacity is 0."""
    if found.capacity_rps <= 0:
        return None
    rate = found.capacity_rps * factor
    got = at(rate)
    # the peak over every rate run (the search's and this one: past the SLO's knee goodput may still rise)
    peak = max(float(at(r)["goodput_rps"] or 0.0) for r in (*(r for r, _ in found.steps), rate))
    return {
        "factor": factor,
        "rate_rps": round(rate, 4),
        "goodput_rps": got["goodput_rps"],
        "peak_goodput_rps": round(peak, 4),
        "goodput_vs_peak": round(float(got["goodput_rps"] or 0.0) / peak, 4) if peak > 0 else None,
        "slo_met": got["slo_met"],
        "rejected": got["rejected"],
        "ttft_ms": got["ttft_ms"],
    }


def main(a: argparse.Namespace) -> int:
    result = run(a)
    out = sys.stderr if a.json else sys.stdout
    table = {k: v for k, v in result.items() if k != "fleets"}  # (the benchmark's line says CPUs and start times)
    report.print_table(table, out, title=f"kvstore sim ({result['sim']['profile']}, {a.engines} engines)")
    for name, fleet in result["fleets"].items():
        if name in PD_CONFIGS:
            n = sum(e["role"] == "prefill" for e in fleet["engines"])
            print(f"  {name} fleet: {n} prefill, {len(fleet['engines']) - n} decode engines", file=out)
    at_base = result.get("at_baseline_capacity")
    if at_base is not None:
        caps = result["configs"]
        base = caps.get("baseline", {}).get("capacity_rps", at_base["rate_rps"])
        line = ", ".join(
            f"{n} {c['capacity_rps']:.3f}" + (f" ({c['capacity_rps'] / base:.2f}x)" if base and n != "baseline" else "")
            for n, c in caps.items()
        )
        print(f"\ncapacity (req/s at >= {at_base['slo_target']:.0%} of requests within the SLO): {line}", file=out)
        if at_base["configs"]:
            steps = [{"offered_rps": at_base["rate_rps"], "configs": at_base["configs"]}]
            report.print_table({**table, "steps": steps}, out, title="at baseline's capacity")
        for n, c in caps.items():
            o = c.get("overload")
            if o:
                print(
                    f"  {n} at {o['factor']:g}x its capacity ({o['rate_rps']:.3f} req/s): goodput {o['goodput_rps']:.3f} "
                    f"req/s, {o['goodput_vs_peak']:.2f}x its peak; {o['slo_met']:.0%} within the SLO, "
                    f"{o['rejected']} rejected",
                    file=out,
                )
    sim = result["sim"]
    print(f"  simulated {sim['virtual_s']:.1f} s in {sim['wall_s']:.1f} s ({sim['runs']} runs)", file=out)
    if getattr(a, "plot", None):
        from kvstore.sim.plot import plot_capacity

        plot_capacity(result, a.plot, title=f"{sim['profile']}, {a.engines} engines")
        print(f"  plot: {a.plot}", file=out)
    if a.json:
        print(json.dumps(result), flush=True)
    return 1 if any(c["completed"] == 0 for c in result["configs"].values()) else 0

"""``kvstore sim validate``: the simulator against real vLLM engines, on the same requests.

It runs one workload twice: through real vLLM servers (``kvstore bench serving --json``, in a
child process of this interpreter, which must have vLLM; or a saved result of one with
``--real FILE``) and through ``kvstore sim`` (``--profile``, default ``local``: the profile
of this project's CPU engines), then prints, per configuration, the relative error of the
simulator's TTFT p50 and p90, TBT p50 and output throughput against the real run's, and
whether the ``pool``/``baseline`` TTFT ratio falls on the same side of 1 in both.

``--fit-connector FILE`` first fits the profile's two connector constants
(``connector_step_ms``, ``connector_request_ms``: what the pool's connector costs an engine
besides bytes) to the real run's ``pool``/``baseline`` ratios by a grid search of simulated
runs, writes that profile to FILE and compares with it: a fit on one workload (best one
without reuse, where the pool can only cost), to validate on another.

Both sides take the workload from the same flags (:func:`kvstore.bench.serving.cli.add_workload_arguments`
and :func:`~kvstore.bench.serving.cli.scaling`), so they replay the same requests at the
same offered times; a ``--real`` file made with other flags is refused, naming what
differs.  The JSON (``--json``): ``{"configs": {NAME: {"real": {...}, "sim": {...},
"error": {...}, "within": bool}}, "ttft_ratio": {"real", "sim", "same_side"}, "tolerance",
"real_run", "sim"}``, and with ``--real-records`` (the real run's ``--records``)
``per_request``: TTFT compared request by request (:func:`per_request`), which a gap in a
run's TTFTs cannot swing as it swings a percentile.  The simulator runs as many times as
the real run did (its ``--repeat``; seeds 0 to N-1 of the profile's jitter; ``--sim-repeat``
to choose), and both sides' figures are medians over their runs: like against like.  The exit status is 0 when every error is within ``--tolerance``
(default 0.25) and the ratios agree, else 1.

Holds no state between calls.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvstore.errors import InvalidArgument

METRICS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("ttft_p50_ms", ("ttft_ms", "p50")),
    ("ttft_p90_ms", ("ttft_ms", "p90")),
    ("tbt_p50_ms", ("tbt_ms", "p50")),
    ("throughput_tok_s", ("throughput_tok_s",)),
)
"""The figures compared (name, path in a configuration's summary)."""

DEFAULT_TOLERANCE = 0.25


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvstore.bench.serving.cli import add_workload_arguments

    add_workload_arguments(p)
    p.add_argument("--configs", default="baseline,pool", help="configurations to compare (default baseline,pool)")
    p.add_argument("--engines", type=int, default=2, help="engines per configuration, both sides (default 2)")
    p.add_argument("--profile", default="local", metavar="NAME|FILE", help="the simulator's profile (default local)")
    p.add_argument(
        "--real",
        metavar="FILE",
        help="a saved `kvstore bench serving --json` of the same workload flags, instead of running one",
    )
    p.add_argument(
        "--real-records",
        metavar="FILE",
        help="the real run's `--records` (with --real): also compare TTFT request by request (a run this "
        "command makes keeps its own)",
    )
    p.add_argument(
        "--bench-args",
        default="",
        help="more flags for the real run (`kvstore bench serving`), one string, e.g. '--repeat 3'",
    )
    p.add_argument(
        "--tolerance",
        type=float,
        default=DEFAULT_TOLERANCE,
        help=f"largest relative error that passes (default {DEFAULT_TOLERANCE})",
    )
    p.add_argument(
        "--sim-repeat",
        type=int,
        default=None,
        metavar="N",
        help="simulated runs per configuration, seeds 0 to N-1, their medians compared (default: as many as the "
        "real run's --repeat)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout (the table goes to stderr)")
    p.add_argument(
        "--fit-connector",
        metavar="FILE",
        help="fit --profile's connector_step_ms and connector_request_ms to this run's `pool` (a grid "
        "search), write the profile to FILE and compare with it; validate it on another workload",
    )


def workload_argv(a: argparse.Namespace) -> list[str]:
    """The workload flags of ``a`` as a command line (both runs are given exactly these)."""
    from kvstore.bench.serving.cli import add_workload_arguments

    probe = argparse.ArgumentParser(add_help=False)
    add_workload_arguments(probe)
    argv: list[str] = []
    for action in probe._actions:
        if not action.option_strings or action.dest == "help":
            continue
        value = getattr(a, action.dest, None)
        flag = action.option_strings[-1] if action.option_strings[-1].startswith("--") else action.option_strings[0]
        if action.nargs == 0:  # a store_true flag
            if value:
                argv.append(flag)
        elif value is not None and value != action.default:
            argv += [flag, str(value)]
        elif action.dest == "trace":
            argv += [flag, str(value)]
    return argv


def figure(summary: dict[str, Any], path: tuple[str, ...]) -> float | None:
    v: Any = summary
    for k in path:
        if not isinstance(v, dict) or k not in v:
            return None
        v = v[k]
    return float(v) if isinstance(v, int | float) else None


def compare(real: dict[str, Any], sim: dict[str, Any], configs: list[str], tolerance: float) -> dict[str, Any]:
    """The validation report of two results of the benchmark's JSON shape (see the module docstring)."""
    out: dict[str, Any] = {"configs": {}, "tolerance": tolerance}
    for name in configs:
        r, s = real["configs"].get(name), sim["configs"].get(name)
        if r is None or s is None:
            raise InvalidArgument(
                f"configuration {name!r} is missing from the {'real' if r is None else 'simulated'} run"
            )
        row: dict[str, Any] = {"real": {}, "sim": {}, "error": {}}
        for key, path in METRICS:
            rv, sv = figure(r, path), figure(s, path)
            row["real"][key], row["sim"][key] = rv, sv
            row["error"][key] = None if rv is None or sv is None or rv == 0 else round(sv / rv - 1, 4)
        errs = [e for e in row["error"].values() if e is not None]
        row["within"] = bool(errs) and len(errs) == len(METRICS) and all(abs(e) <= tolerance for e in errs)
        out["configs"][name] = row
    ratio: dict[str, Any] = {"real": None, "sim": None, "same_side": None}
    if "baseline" in configs and "pool" in configs:
        b, p = out["configs"]["baseline"], out["configs"]["pool"]
        for side in ("real", "sim"):
            base, pool = b[side]["ttft_p50_ms"], p[side]["ttft_p50_ms"]
            ratio[side] = round(pool / base, 4) if base and pool is not None else None
        if ratio["real"] is not None and ratio["sim"] is not None:
            ratio["same_side"] = (ratio["real"] - 1) * (ratio["sim"] - 1) > 0 or ratio["real"] == ratio["sim"]
    out["ttft_ratio"] = ratio
    out["ok"] = all(c["within"] for c in out["configs"].values()) and ratio["same_side"] is not False
    return out


def check_same_workload(real: dict[str, Any], scaling_json: dict[str, Any], requests: int) -> None:
    """Refuse a ``--real`` result made of another workload (its flags or its trace)."""
    got = real.get("scaling")
    if got != scaling_json:
        diff = sorted(k for k in set(got or {}) | set(scaling_json) if (got or {}).get(k) != scaling_json.get(k))
        raise InvalidArgument(f"--real: made with other workload flags ({', '.join(diff) or 'no scaling recorded'})")
    n = (real.get("trace") or {}).get("requests")
    if n is not None and n != requests:
        raise InvalidArgument(f"--real: {n} requests, this workload has {requests}")


def real_run(a: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """``kvstore bench serving --json`` of the workload, in a child process (needs vLLM here)."""
    import importlib.util
    import shlex

    if a.real:
        try:
            data: dict[str, Any] = json.loads(Path(a.real).read_text())
        except (OSError, ValueError) as e:
            raise InvalidArgument(f"--real {a.real}: {e}") from None
        if not isinstance(data, dict) or not isinstance(data.get("configs"), dict):
            raise InvalidArgument(f"--real {a.real}: not the JSON of `kvstore bench serving --json`")
        return data
    if importlib.util.find_spec("vllm") is None:
        raise InvalidArgument(
            "the real run needs vLLM in this interpreter (run `.venv-vllm/bin/kvstore sim validate`), "
            "or pass --real FILE from an earlier `kvstore bench serving --json`"
        )
    cmd = [sys.executable, "-m", "kvstore", "bench", "serving", *argv]
    cmd += ["--configs", a.configs, "--engines", str(a.engines), "--json", *shlex.split(a.bench_args)]
    if a.real_records:
        cmd += ["--records", a.real_records]
    print("real run: " + " ".join(shlex.quote(c) for c in cmd[1:]), file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=False)
    if proc.returncode not in (0, 1) or not proc.stdout.strip():
        raise InvalidArgument(f"the real run failed (exit {proc.returncode}); its messages are above")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def sim_run(a: argparse.Namespace, argv: list[str], records: str | None = None) -> dict[str, Any]:
    """``kvstore sim --json`` of the workload, in this process (its records to ``records``)."""
    from kvstore.sim import cli as simcli

    p = argparse.ArgumentParser(prog="kvstore sim")
    simcli.add_arguments(p)
    more = ["--records", records] if records else []
    if getattr(a, "sim_repeat", None):
        more += ["--repeat", str(a.sim_repeat)]
    ns = p.parse_args([*argv, "--configs", a.configs, "--engines", str(a.engines), "--profile", a.profile, *more])
    return simcli.run(ns)


def read_ttfts(path: str) -> dict[tuple[str, int], float]:
    """``(config, request index) -> TTFT`` (ms) of a records file, the median over its repeats
    (requests that failed are left out)."""
    import statistics

    runs: dict[tuple[str, int], list[float]] = {}
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise InvalidArgument(f"records {path}: {e}") from None
    for n, line in enumerate(lines, 1):
        try:
            r = json.loads(line)
            key, ttft = (str(r["config"]), int(r["index"])), r.get("ttft_ms")
        except (ValueError, KeyError, TypeError) as e:
            raise InvalidArgument(f"records {path}, line {n}: not a request's record ({e})") from None
        if isinstance(ttft, int | float) and r.get("error") is None:
            runs.setdefault(key, []).append(float(ttft))
    return {k: statistics.median(v) for k, v in runs.items()}


def per_request(
    real: dict[tuple[str, int], float], sim: dict[tuple[str, int], float], configs: list[str]
) -> dict[str, Any]:
    """TTFT request by request: per configuration the median of sim ÷ real − 1 and of its
    absolute value over the requests both completed; with ``baseline`` and ``pool``, the
    median per-request difference pool − baseline (ms) on each side.  Unlike a percentile of
    the whole run, these do not jump where the run's TTFTs have a gap."""
    import statistics

    out: dict[str, Any] = {"configs": {}}
    for name in configs:
        rel = [sim[k] / real[k] - 1 for k in real if k[0] == name and k in sim and real[k] > 0]
        out["configs"][name] = {
            "requests": len(rel),
            "ttft_median_rel_err": round(statistics.median(rel), 4) if rel else None,
            "ttft_median_abs_rel_err": round(statistics.median(abs(x) for x in rel), 4) if rel else None,
        }
    if "baseline" in configs and "pool" in configs:
        diff: dict[str, float | None] = {}
        for side, t in (("real", real), ("sim", sim)):
            d = [t[("pool", i)] - t[("baseline", i)] for (c, i) in t if c == "pool" and ("baseline", i) in t]
            diff[side] = round(statistics.median(d), 2) if d else None
        out["pool_minus_baseline_ttft_ms"] = diff
    return out


FIT_STEP_MS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0)
FIT_REQUEST_MS = (0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 15.0, 20.0, 30.0)
"""The grid ``--fit-connector`` searches (ms): every pair is one simulated ``pool`` run."""

FIT_FIGURES = ("ttft_p50_ms", "ttft_p90_ms", "tbt_p50_ms")
"""The figures whose pool/baseline ratios the fit matches (throughput follows the offered load)."""


def _shown(argv: list[str]) -> list[str]:
    """``argv`` as a profile's source cites it: the trace's path relative to the working
    directory where it lies under it, else its name (no machine's paths in a profile)."""
    out = list(argv)
    for i, v in enumerate(out[:-1]):
        if v == "--trace":
            path = Path(out[i + 1]).resolve()
            out[i + 1] = str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else path.name
    return out


def fit_connector(
    a: argparse.Namespace, argv: list[str], real: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The profile ``a.profile`` with ``connector_step_ms`` and ``connector_request_ms`` set to
    the grid's pair whose simulated ``pool`` costs what the real one did *relative to
    baseline*: least sum over :data:`FIT_FIGURES` of the squared log of (sim pool ÷ sim
    baseline) ÷ (real pool ÷ real baseline).  Ratios, so that the profile's own error on
    ``baseline`` (which these constants do not touch) is not loaded onto the connector.

    With the real run's records (``a.real_records``) TTFT is matched request by request
    instead: the loss is the squared log of the TBT p50 ratio as above plus the square of
    (sim − real median per-request ``pool`` − ``baseline`` TTFT difference) ÷ real
    ``baseline``'s TTFT p50.  A percentile of a run whose TTFTs have a gap at it swings
    between grid points a millisecond a request apart; the per-request difference does not."""
    import datetime
    import math

    from kvstore.sim.profile import EngineProfile

    if not {"baseline", "pool"} <= set(real["configs"]):
        raise InvalidArgument("--fit-connector needs `baseline` and `pool` in the real run (--configs baseline,pool)")

    def figures(summary: dict[str, Any], what: str) -> dict[str, float]:
        got = {k: figure(summary, path) for k, path in METRICS if k in FIT_FIGURES}
        ok = {k: v for k, v in got.items() if v is not None and v > 0}
        if len(ok) != len(FIT_FIGURES):
            raise InvalidArgument(f"--fit-connector: {what}'s figures are incomplete: {got}")
        return ok

    real_base, real_pool = (
        figures(real["configs"]["baseline"], "the real baseline"),
        figures(real["configs"]["pool"], "the real pool"),
    )
    target = {k: real_pool[k] / real_base[k] for k in FIT_FIGURES}
    by_request = bool(getattr(a, "real_records", None))
    matched = ("tbt_p50_ms",) if by_request else FIT_FIGURES
    real_diff = 0.0
    if by_request:
        diff = per_request(read_ttfts(a.real_records), {}, ["baseline", "pool"])["pool_minus_baseline_ttft_ms"]
        if diff["real"] is None:
            raise InvalidArgument("--fit-connector: the real records have no request both baseline and pool completed")
        real_diff = float(diff["real"])
    base = EngineProfile.load(a.profile).to_dict()
    grid: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvstore-fit-") as d:
        recs = str(Path(d) / "records.jsonl") if by_request else None
        sim_base = figures(
            sim_run(argparse.Namespace(**{**vars(a), "configs": "baseline"}), argv, recs)["configs"]["baseline"],
            "the simulated baseline",
        )
        base_ttfts = read_ttfts(recs) if recs else {}
        path = Path(d) / "profile.json"
        for step_ms in FIT_STEP_MS:
            for request_ms in FIT_REQUEST_MS:
                path.write_text(json.dumps({**base, "connector_step_ms": step_ms, "connector_request_ms": request_ms}))
                one = argparse.Namespace(**{**vars(a), "configs": "pool", "profile": str(path)})
                sim = figures(sim_run(one, argv, recs)["configs"]["pool"], "the simulated pool")
                ratio = {k: sim[k] / sim_base[k] for k in FIT_FIGURES}
                loss = sum(math.log(ratio[k] / target[k]) ** 2 for k in matched)
                point: dict[str, Any] = {"connector_step_ms": step_ms, "connector_request_ms": request_ms}
                if recs:
                    got = per_request({}, {**base_ttfts, **read_ttfts(recs)}, ["baseline", "pool"])
                    sim_diff = got["pool_minus_baseline_ttft_ms"]["sim"]
                    if sim_diff is None:
                        raise InvalidArgument("--fit-connector: the simulated runs completed no request in common")
                    loss += ((sim_diff - real_diff) / real_base["ttft_p50_ms"]) ** 2
                    point["pool_minus_baseline_ttft_ms"] = sim_diff
                grid.append({**point, "loss": loss, "ratio": ratio})
    best = min(grid, key=lambda g: g["loss"])
    when = datetime.date.today().isoformat()
    if by_request:
        how = (
            f"the simulated pool's median per-request TTFT over baseline's and TBT p50 ratio to a real `kvstore bench "
            f"serving` run's ({' '.join(_shown(argv))}, its --records): real +{real_diff:.1f} ms and "
            f"{target['tbt_p50_ms']:.3f}, fitted +{best['pool_minus_baseline_ttft_ms']:.1f} ms and "
            f"{best['ratio']['tbt_p50_ms']:.3f}"
        )
    else:
        how = (
            f"the simulated pool/baseline ratios of TTFT p50/p90 and TBT p50 to a real `kvstore bench serving` run "
            f"({' '.join(_shown(argv))}): real "
            + ", ".join(f"{target[k]:.3f}" for k in FIT_FIGURES)
            + ", fitted "
            + ", ".join(f"{best['ratio'][k]:.3f}" for k in FIT_FIGURES)
        )
    where = f"fitted: `kvstore sim validate --fit-connector` on {when}, a grid search matching " + how
    prof = dict(base)
    sources = dict(prof.get("sources") or {})
    for k in ("connector_step_ms", "connector_request_ms"):
        prof[k] = best[k]
        sources[k] = where
    prof["sources"] = sources
    EngineProfile.from_dict(prof, "the fitted profile")
    return prof, {"best": best, "target": target, "grid": grid}


def run(a: argparse.Namespace) -> dict[str, Any]:
    from kvstore.bench.serving.cli import scaling
    from kvstore.bench.serving.workload import build

    configs = [c.strip() for c in a.configs.split(",") if c.strip()]
    if not configs:
        raise InvalidArgument("--configs: none given")
    if not 0 < a.tolerance:
        raise InvalidArgument(f"--tolerance must be positive, got {a.tolerance}")
    argv = workload_argv(a)
    wl = build(a.trace, scaling(a))
    real = real_run(a, argv)
    check_same_workload(real, wl.scaling.to_json(), len(wl.items))
    real_repeats = {n: int((c.get("repeats") or {}).get("n", 1)) for n, c in real["configs"].items()}
    if a.sim_repeat is None:
        a = argparse.Namespace(**{**vars(a), "sim_repeat": max(real_repeats.values(), default=1)})
    elif not 1 <= a.sim_repeat <= 100:
        raise InvalidArgument(f"--sim-repeat must be 1 to 100, got {a.sim_repeat}")
    if a.real_records and a.real and not Path(a.real_records).exists():
        raise InvalidArgument(f"--real-records {a.real_records}: no such file")
    fitted = None
    if a.fit_connector:
        prof, fitted = fit_connector(a, argv, real)
        Path(a.fit_connector).write_text(json.dumps(prof, indent=2) + "\n")
        b = fitted["best"]
        print(
            f"fitted connector_step_ms {b['connector_step_ms']}, connector_request_ms {b['connector_request_ms']} "
            f"over {len(fitted['grid'])} simulated runs; wrote {a.fit_connector}",
            file=sys.stderr,
        )
        a = argparse.Namespace(**{**vars(a), "profile": a.fit_connector})
    with tempfile.TemporaryDirectory(prefix="kvstore-validate-") as d:
        sim_records = str(Path(d) / "sim.jsonl") if a.real_records else None
        sim = sim_run(a, argv, sim_records)
        by_request = per_request(read_ttfts(a.real_records), read_ttfts(sim_records), configs) if sim_records else None
    out = compare(real, sim, configs, a.tolerance)
    if by_request is not None:
        out["per_request"] = by_request
    out["real_run"] = {
        "configs": list(real["configs"]),
        "repeats": real_repeats,
    }
    out["sim"] = sim["sim"]
    out["workload"] = {"argv": argv, "requests": len(wl.items)}
    if fitted is not None:
        out["fit_connector"] = {"best": fitted["best"], "target": fitted["target"], "profile": a.profile}
    return out


def print_table(out: dict[str, Any], f: Any) -> None:
    print(f"{'config':<10} {'figure':<18} {'real':>10} {'sim':>10} {'error':>8}", file=f)
    for name, row in out["configs"].items():
        for key, _ in METRICS:
            rv, sv, e = row["real"][key], row["sim"][key], row["error"][key]
            fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
            print(f"{name:<10} {key:<18} {fmt(rv):>10} {fmt(sv):>10} {'-' if e is None else f'{e:+.0%}':>8}", file=f)
    pr = out.get("per_request")
    if pr is not None:
        for name, row in pr["configs"].items():
            if row["requests"]:
                print(
                    f"{name:<10} TTFT request by request: median error {row['ttft_median_rel_err']:+.0%}, "
                    f"median |error| {row['ttft_median_abs_rel_err']:.0%} over {row['requests']} requests",
                    file=f,
                )
        d = pr.get("pool_minus_baseline_ttft_ms")
        if d and d["real"] is not None and d["sim"] is not None:
            print(f"pool - baseline TTFT, median per request: real {d['real']:+.1f} ms, sim {d['sim']:+.1f} ms", file=f)
    r = out["ttft_ratio"]
    if r["real"] is not None:
        print(
            f"pool/baseline TTFT p50: real {r['real']:.2f}, sim {r['sim']:.2f} "
            f"({'same side of 1' if r['same_side'] else 'OPPOSITE sides of 1'})",
            file=f,
        )
    print(f"{'within' if out['ok'] else 'NOT within'} {out['tolerance']:.0%}", file=f)


def main(a: argparse.Namespace) -> int:
    out = run(a)
    print_table(out, sys.stderr if a.json else sys.stdout)
    if a.json:
        print(json.dumps(out), flush=True)
    return 0 if out["ok"] else 1

"""``kvstore bench serving``: a request trace through a fleet of real vLLM servers, side
by side with and without the store.

For each configuration (``--configs``, default ``baseline,pool,pd``; see
:mod:`kvstore.bench.serving.fleet`) it starts the fleet (``--engines`` vLLM OpenAI servers
with prefix caching on, vLLM's default; for the store's configurations one kvstore node
per engine in one cluster over a private etcd), warms every engine up with the same few
requests, replays the same workload open-loop through the front
(:mod:`kvstore.bench.serving.front`), reads the engines' and nodes' counters, and stops
it all before the next configuration starts, so each configuration has the machine, and
the same CPUs per engine, to itself.  ``--target URL`` replays through a fleet someone
else started (any OpenAI-compatible endpoint) as configuration ``target``.
``--sweep-rate R1,R2,...`` replays the workload at each offered rate (requests/s), with
other tokens at each step so no step reuses another's KV, and reports goodput per step
(the capacity curve).  ``--repeat N`` runs every configuration N times, each on a fleet
of its own, interleaved (``baseline, pool, baseline, pool, ...``: drift over the session
hits every configuration alike), and reports the medians, their ranges and every run
(:func:`kvstore.bench.serving.report.combine_runs`); run *i* of a configuration is
compared token for token with ``baseline``'s run *i*.  ``--fault kill:node1@20,restart:node1@40``
kills (SIGKILL) and restarts kvstore nodes at those seconds of the replay
(:class:`kvstore.bench.serving.fleet.FaultScheduler`), in the configurations that have
nodes (the others run unchanged, and the JSON's ``faults.not_applied`` says so); each
such configuration reports what was done and when in ``faults``.

The model is made locally (the random-weight Llama of ``kvstore demo vllm``;
``--layers``, ``--hidden``) unless ``--model PATH``; prompts are token ids
(``--skip-tokenizer-init``), sampling is greedy, EOS ignored, so every configuration
generates exactly the trace's output lengths and ``tokens_equal_baseline`` can compare
them token for token.  Run it where vLLM is installed (``.venv-vllm``), or with
``--target`` from anywhere.  ``--engine sim`` starts mock engines instead
(``kvstore sim serve``, ``--profile``; no GPU, no vLLM, from any Python with the
``serving`` and ``conductor`` extras) for ``baseline``, ``pool`` and ``conductor``: the
harness, the conductor, etcd and (``pool``) the kvstore nodes are real, the engines are the
simulator's model in real time, moving their KV scaled down ``--kv-scale`` times through
the nodes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile
import time
import urllib.error
from pathlib import Path
from typing import Any

from kvstore.bench.serving import fleet as fleetmod
from kvstore.bench.serving import report
from kvstore.bench.serving.fleet import (
    CONFIGS,
    DEFAULT_CONFIGS,
    DEFAULT_KV_SCALE,
    ENGINE_KINDS,
    SIM_CONFIGS,
    STORELESS_CONFIGS,
    Engine,
    Fault,
    FaultScheduler,
    Fleet,
    FleetSpec,
    parse_faults,
    renice,
)
from kvstore.bench.serving.front import front_for
from kvstore.bench.serving.runner import Record, Replay
from kvstore.bench.serving.workload import Scaling, Workload, build, parse_window
from kvstore.errors import InvalidArgument
from kvstore.progress import Progress

DEFAULT_TRACE = Path(__file__).resolve().parents[3] / "tests" / "data" / "mooncake_synthetic_trace.jsonl"
"""Mooncake's published trace, as the repository keeps it (``tests/data/README.md``)."""
WARMUP_TOKENS = 200


def add_workload_arguments(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """``--trace``, the flags that make a workload of it (:func:`scaling`) and the SLO flags:
    shared with ``kvstore sim``.  Returns the ``workload`` group, for more flags of its kind."""
    p.add_argument(
        "--trace",
        default=os.environ.get("KVSTORE_TRACE", str(DEFAULT_TRACE)),
        help="Mooncake-format trace (JSON lines); default $KVSTORE_TRACE, else Mooncake's published trace "
        "(tests/data/mooncake_synthetic_trace.jsonl)",
    )
    g = p.add_argument_group("workload")
    g.add_argument("--requests", type=int, help="replay the first N requests of the slice")
    g.add_argument(
        "--window", type=parse_window, metavar="A:B", help="replay the requests in seconds A..B of the trace"
    )
    g.add_argument(
        "--sample",
        type=float,
        metavar="F",
        help="keep the requests of a share F of the trace's prefix trees (thins the trace, keeps its reuse)",
    )
    g.add_argument(
        "--block-tokens", type=int, default=16, help="tokens per trace block (the trace's are 512; default 16)"
    )
    g.add_argument(
        "--output-scale", type=float, help="scale of output lengths (default: the same as the input's, B/512)"
    )
    g.add_argument("--min-output-tokens", type=int, default=8, help="at least this many output tokens (default 8)")
    g.add_argument("--max-output-tokens", type=int, help="at most this many output tokens")
    g.add_argument("--time-scale", type=float, default=1.0, help="multiply the trace's timestamps (2: half the load)")
    g.add_argument("--rate", type=float, help="offered load in requests/s (rescales the trace's arrival times)")
    g.add_argument("--unique-prompts", action="store_true", help="no shared prefixes (the no-reuse overhead run)")
    g.add_argument("--salt", default="kvstore-bench-serving", help="seed of the synthesised token ids")
    s = p.add_argument_group("SLO")
    s.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="TTFT target for goodput (default 2000)")
    s.add_argument("--slo-tbt-ms", type=float, default=200.0, help="TBT target for goodput (default 200)")
    return g


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = add_workload_arguments(p)
    p.add_argument(
        "--configs",
        help=f"configurations to run, in order (default {','.join(DEFAULT_CONFIGS)}; with --engine sim "
        f"{','.join(SIM_CONFIGS)}, the only ones it runs; also null-connector: vLLM with a KV connector that "
        "does nothing, no node, the reference for what vLLM's connector path costs by itself)",
    )
    p.add_argument("--target", metavar="URL", help="benchmark this OpenAI-compatible endpoint instead of a fleet")
    g.add_argument("--sweep-rate", metavar="R1,R2,...", help="replay at each offered rate and report goodput per step")
    g.add_argument(
        "--repeat",
        type=int,
        default=1,
        metavar="N",
        help="run every configuration N times, interleaved, and report medians and ranges (default 1)",
    )
    g.add_argument(
        "--fault",
        action="append",
        metavar="SPEC",
        help="kill (SIGKILL) or restart kvstore nodes during the replay: ACTION:NODE@SECONDS[,...], e.g. "
        "kill:node1@20,restart:node1@40 (NODE: the node's index, node0 = the first engine's; seconds from the "
        "replay's start); configurations without nodes run unchanged",
    )
    g = p.add_argument_group("fleet")
    g.add_argument("--engines", type=int, default=2, help="vLLM servers per configuration (default 2)")
    g.add_argument(
        "--engine",
        choices=ENGINE_KINDS,
        default="vllm",
        help="vllm: real vLLM servers (from a Python with vLLM); sim: mock engines (`kvstore sim serve`, the "
        f"simulator's engine model in real time, no GPU nor vLLM), configurations {','.join(SIM_CONFIGS)} only "
        "(default vllm)",
    )
    g.add_argument(
        "--profile",
        metavar="NAME|FILE",
        help="--engine sim: the mock engines' step-time profile and KV cache (default local; see `kvstore sim`)",
    )
    g.add_argument(
        "--kv-scale",
        type=int,
        default=None,
        metavar="N",
        help="--engine sim, pool: the mock engines' KV bytes, and their nodes' --node-dram/--node-nvme, "
        f"divided by N (default {DEFAULT_KV_SCALE})",
    )
    g.add_argument("--prefill", type=int, default=None, help="pd: prefill engines (default half, at least 1)")
    g.add_argument("--model", help="model directory (default: a random-weight Llama made locally)")
    g.add_argument("--layers", type=int, default=4, help="layers of the locally made model (default 4)")
    g.add_argument("--hidden", type=int, default=512, help="hidden size of the locally made model (default 512)")
    g.add_argument("--engine-kv", default="64MiB", help="each engine's own KV cache, its 'HBM' (default 64MiB)")
    g.add_argument("--max-num-batched-tokens", type=int, help="vLLM's per-step token budget (default: vLLM's)")
    g.add_argument("--node-dram", default="1GiB", help="each kvstore node's DRAM tier (default 1GiB)")
    g.add_argument("--node-nvme", default="2GiB", help="each kvstore node's NVMe tier (default 2GiB)")
    g.add_argument("--connector-extra", default="{}", help="JSON merged into the connector's kv_connector_extra_config")
    g.add_argument(
        "--conductor-reject",
        action="store_true",
        help="conductor configurations: early rejection on, at --slo-ttft-ms and --slo-tbt-ms (429 before any engine works)",
    )
    g.add_argument("--conductor-args", default="", help="more flags for `kvstore conductor` (one string, shell-split)")
    g.add_argument(
        "--front-nice",
        type=int,
        default=-10,
        help="nice value of the front (this client during replays, and the conductor): on a machine shared with "
        "the engines' busy-waiting workers, scheduled first as on hosts of its own (default -10; 0: off; "
        "needs root, else it stays 0 and the JSON says so)",
    )
    g.add_argument(
        "--node-nice",
        type=int,
        default=0,
        help="nice value of the fleet's kvstore nodes and etcd, set as they start (default 0): a positive value "
        "gives the engines' workers the cores first, as on hosts where the node has cores of its own",
    )
    g.add_argument("--warmup", type=int, default=2, help="warm-up requests per engine, not measured (default 2)")
    g.add_argument("--request-timeout", type=float, default=300.0, help="seconds one request may take (default 300)")
    g.add_argument("--start-timeout", type=float, default=900.0, help="seconds a fleet may take to start (default 900)")
    g.add_argument("--log-dir", help="keep the fleets' logs here (default: a temporary directory, removed)")
    g = p.add_argument_group("output")
    g.add_argument("--json", action="store_true", help="print one JSON object on stdout (the table goes to stderr)")
    g.add_argument("--records", metavar="FILE", help="write every request's record here (JSON lines)")
    g.add_argument("--plot", metavar="PNG", help="TTFT CDF per configuration and goodput against offered load")


def scaling(a: argparse.Namespace, vocab: int = 32000) -> Scaling:
    """The :class:`Scaling` of :func:`add_workload_arguments`' flags."""
    return Scaling(
        block_tokens=a.block_tokens,
        output_scale=a.output_scale,
        min_output_tokens=a.min_output_tokens,
        max_output_tokens=a.max_output_tokens,
        time_scale=a.time_scale,
        rate=a.rate,
        requests=a.requests,
        window=a.window,
        sample=a.sample,
        unique=a.unique_prompts,
        vocab=vocab,
        salt=a.salt,
    )


def _rates(text: str | None) -> list[float | None]:
    if not text:
        return [None]
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InvalidArgument(f"--sweep-rate must be a comma-separated list of requests/s, got {text!r}") from None
    if not rates or any(r <= 0 or not math.isfinite(r) for r in rates):
        raise InvalidArgument(f"--sweep-rate must list positive rates, got {text!r}")
    return list(rates)


def _configs(text: str | None, target: str | None, engine: str = "vllm") -> list[str]:
    if target:
        return ["target"]
    if text is None:
        text = ",".join(SIM_CONFIGS if engine == "sim" else DEFAULT_CONFIGS)
    names = [c.strip() for c in text.split(",") if c.strip()]
    bad = [c for c in names if c not in CONFIGS]
    if bad or not names:
        raise InvalidArgument(f"--configs: unknown configuration(s) {bad or text!r} (known: {', '.join(CONFIGS)})")
    if engine == "sim" and any(c not in SIM_CONFIGS for c in names):
        raise InvalidArgument(
            f"--engine sim runs the configurations {', '.join(SIM_CONFIGS)} only, got --configs {text}: "
            "pd and conductor-pd hand KV from prefill to decode engines, which mock engines do not do yet"
        )
    return names


def _check_engine(a: argparse.Namespace) -> None:
    """The flags that go with ``--engine`` (clear errors before anything starts)."""
    if a.engine != "sim":
        if a.profile is not None or a.kv_scale is not None:
            flag = "--profile" if a.profile is not None else "--kv-scale"
            raise InvalidArgument(f"{flag} is for --engine sim (mock engines); vLLM servers run --model")
        return
    for flag, given in (
        ("--target", a.target),
        ("--model", a.model),
        ("--fault", a.fault),
        ("--max-num-batched-tokens", a.max_num_batched_tokens),
    ):
        if given:
            raise InvalidArgument(
                f"{flag} does not go with --engine sim (mock engines take their model, batch and cache from "
                "--profile; faults are for vLLM fleets)"
            )


def _vocab(model: str | None) -> int:
    if model is None:
        return 32000
    cfg = Path(model) / "config.json"
    try:
        v = json.loads(cfg.read_text()).get("vocab_size")
    except (OSError, ValueError) as e:
        raise InvalidArgument(f"--model {model}: cannot read config.json ({e})") from None
    if not isinstance(v, int):
        raise InvalidArgument(f"--model {model}: config.json has no integer vocab_size")
    return v


def _target_model(url: str) -> str:
    """The first model an OpenAI-compatible endpoint serves (a clear error when it does not answer)."""
    try:
        code, text = fleetmod._get(url.rstrip("/") + "/v1/models", timeout=10.0)
    except (OSError, urllib.error.URLError) as e:
        raise InvalidArgument(f"--target {url} does not answer: {e}") from None
    if code != 200:
        raise InvalidArgument(f"--target {url}: GET /v1/models answered HTTP {code}")
    try:
        return str(json.loads(text)["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise InvalidArgument(f"--target {url}: /v1/models lists no model") from None


def _warm_up(engines: list[Engine], front_cfg: str, model: str, n: int, timeout_s: float) -> None:
    """``n`` requests per engine through the front, of tokens no trace request has, unmeasured."""
    if n <= 0:
        return
    import dataclasses

    from kvstore.bench.serving.workload import TokenSynth, Work

    synth = TokenSynth(WARMUP_TOKENS, 1000, "warm-up")
    items = tuple(
        Work(i, 0.0, synth.block(i), 4, (i,))
        for i in range(n * max(1, len([e for e in engines if e.role != "prefill"])))
    )
    wl = Workload("warm-up", Scaling(), items, ())
    front = front_for(engines)
    for w in items:  # one at a time: every engine's first requests pay their one-off costs here
        r = Replay(front_cfg, dataclasses.replace(wl, items=(w,)), front, model=model, timeout_s=timeout_s).run()[0]
        if r.error:
            raise RuntimeError(f"warm-up request failed: {r.error}")


def run(a: argparse.Namespace) -> tuple[dict[str, Any], list[Record]]:
    _check_engine(a)
    configs = _configs(a.configs, a.target, a.engine)
    rates = _rates(a.sweep_rate)
    if a.slo_ttft_ms <= 0 or a.slo_tbt_ms <= 0:
        raise InvalidArgument("--slo-ttft-ms and --slo-tbt-ms must be positive")
    try:
        extra = json.loads(a.connector_extra)
        if not isinstance(extra, dict):
            raise ValueError("not an object")
    except ValueError as e:
        raise InvalidArgument(f"--connector-extra must be a JSON object: {e}") from None
    if a.repeat < 1:
        raise InvalidArgument(f"--repeat must be at least 1, got {a.repeat}")
    plan: tuple[Fault, ...] = ()
    if a.fault:
        if a.target:
            raise InvalidArgument("--fault needs the benchmark's own fleet of kvstore nodes: not with --target")
        if rates != [None]:
            raise InvalidArgument("--fault: not with --sweep-rate (a fault plan is timed from one replay's start)")
        plan = parse_faults(a.fault, nodes=a.engines)
    base = build(a.trace, scaling(a, _vocab(a.model)))
    steps = []
    for k, rate in enumerate(rates):
        import dataclasses

        wl = base
        if rate is not None or k:
            wl = build(a.trace, dataclasses.replace(base.scaling, rate=rate or base.scaling.rate, salt=f"{a.salt}/{k}"))
        steps.append(wl)
    result: dict[str, Any] = {
        "trace": base.summary(),
        "scaling": base.scaling.to_json(),
        "slo": {"ttft_ms": a.slo_ttft_ms, "tbt_ms": a.slo_tbt_ms},
        "configs": {},
        "fleets": {},
        "failures": [f"trace: {s}" for s in base.skipped],
        "cpus": sorted(os.sched_getaffinity(0)),
    }
    if a.node_nice:
        result["node_nice"] = a.node_nice
    if len(steps) > 1:
        result["steps"] = [{"offered_rps": round(w.offered_rps, 4), "configs": {}} for w in steps]
    if plan:
        result["faults"] = {
            "plan": [f.to_json() for f in plan],
            "applied_to": [n for n in configs if n != "baseline"],
            "not_applied": {n: "no kvstore nodes: it ran without faults" for n in configs if n == "baseline"},
        }
    records: list[Record] = []
    by_step: list[dict[str, list[list[Record]]]] = [{} for _ in steps]  # step -> config -> one list per run
    with contextlib.ExitStack() as stack:
        model = a.model
        if a.target:
            served = _target_model(a.target)
        elif a.engine == "sim":
            from kvstore.sim.profile import EngineProfile

            served = fleetmod.SERVED_NAME
            result["model"] = {"sim_profile": EngineProfile.load(a.profile or "local").name}
        else:
            served = fleetmod.SERVED_NAME
            if model is None:
                from kvstore.demo.engine import make_model

                d = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvstore-serving-model-")))
                model = str(make_model(d / "model", layers=a.layers, hidden=a.hidden, max_tokens=_model_len(steps, a)))
                result["model"] = {"layers": a.layers, "hidden": a.hidden, "made_locally": True}
            else:
                result["model"] = {"path": model}
        from kvstore.node.config import parse_size

        spec = FleetSpec(
            model=model or "",
            engines=a.engines,
            prefill=a.prefill if a.prefill is not None else max(1, a.engines // 2),
            max_model_len=_model_len(steps, a),
            kv_cache_bytes=parse_size(a.engine_kv),
            max_num_batched_tokens=a.max_num_batched_tokens,
            node_dram=a.node_dram,
            node_nvme=a.node_nvme,
            connector_extra=tuple(sorted(extra.items())),
            conductor_args=_conductor_args(a),
            front_nice=a.front_nice,
            node_nice=a.node_nice,
            start_timeout_s=a.start_timeout,
            engine=a.engine,
            profile=a.profile or "local",
            kv_scale=a.kv_scale if a.kv_scale is not None else DEFAULT_KV_SCALE,
        )
        log_dir = Path(a.log_dir) if a.log_dir else None
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)
        for r in range(a.repeat):  # interleaved: baseline, pool, baseline, pool, ...
            for name in configs:
                _run_config(name, a, spec, served, steps, log_dir, result, by_step, records, repeat=r, plan=plan)
    greedy = True
    counters = result.pop("_counters", {})
    for k, step_records in enumerate(by_step):
        summaries = report.summarise_runs(
            step_records,
            {name: counters.get((k, name), []) for name in step_records},
            slo_ttft_ms=a.slo_ttft_ms,
            slo_tbt_ms=a.slo_tbt_ms,
            greedy=greedy,
        )
        for name, summary in summaries.items():
            if "steps" in result:
                result["steps"][k]["configs"][name] = summary
            if k == len(steps) - 1:
                result["configs"][name] = summary
    if "steps" in result:
        result["capacity_goodput_rps"] = {
            n: max(s["configs"][n]["goodput_rps"] for s in result["steps"] if n in s["configs"]) for n in configs
        }
        result["capacity_rps"] = report.sweep_capacity(result)
    return result, records


def _conductor_args(a: argparse.Namespace) -> tuple[str, ...]:
    import shlex

    args = shlex.split(a.conductor_args)
    # the conductor is told the targets the benchmark grades by (as an operator would set
    # them): they guide placement always, and refuse requests only with --conductor-reject
    args += ["--slo-ttft-ms", str(a.slo_ttft_ms), "--slo-tbt-ms", str(a.slo_tbt_ms)]
    if not a.conductor_reject:
        args += ["--no-reject"]
    return tuple(args)


def _model_len(steps: list[Workload], a: argparse.Namespace) -> int:
    need = max(max(w.max_len for w in steps), WARMUP_TOKENS + 8)
    return -(-(need + 16) // 128) * 128


def _run_config(
    name: str,
    a: argparse.Namespace,
    spec: FleetSpec,
    served: str,
    steps: list[Workload],
    log_dir: Path | None,
    result: dict[str, Any],
    by_step: list[dict[str, list[list[Record]]]],
    records: list[Record],
    *,
    repeat: int = 0,
    plan: tuple[Fault, ...] = (),
) -> None:
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if a.target:
            engines = [Engine("target", a.target.rstrip("/"), "both", "?")]
            fleet = None
        else:
            with Progress(f"serving: starting {name}", unit="fleets") as p:
                if spec.engine == "sim":
                    more = {"baseline": "", "pool": " and kvstore nodes"}.get(name, " and etcd")
                    p.step(f"{spec.engines} mock engines{more}")
                else:
                    p.step(
                        f"{spec.engines} vLLM servers" + (" and kvstore nodes" if name not in STORELESS_CONFIGS else "")
                    )
                fleet = stack.enter_context(Fleet(name, spec, log_dir=log_dir).start())
                p.update()
            engines = fleet.engines
            if fleet.conductor is not None:  # requests go to the conductor, which picks the engine
                engines = [fleet.conductor]
            result["fleets"][name] = {
                "started_s": round(fleet.started_s, 1),
                "engines": [
                    {"name": e.name, "role": e.role, "cpus": e.cpus, "node": bool(e.node)} for e in fleet.engines
                ],
            }
        _warm_up(engines, name, served, a.warmup, a.request_timeout)
        for k, wl in enumerate(steps):
            before = _engine_metrics(fleet.engines if fleet is not None else engines)
            nodes_before = fleet.node_counters() if fleet is not None else {}
            cpu_before = fleet.cpu_seconds() if fleet is not None else {}
            label = (
                f"serving: {name}"
                + (f" at {wl.offered_rps:.2f} req/s" if len(steps) > 1 else "")
                + (f" (run {repeat + 1} of {a.repeat})" if a.repeat > 1 else "")
            )
            faults = FaultScheduler(fleet.nodes, plan) if plan and fleet is not None and fleet.nodes else None
            with Progress(label, total=len(wl.items), unit="requests") as p:
                errors = [0]

                def done(r: Record, p: Progress = p, errors: list[int] = errors) -> None:
                    errors[0] += r.error is not None
                    p.update(note=f"{errors[0]} failed" if errors[0] else None)

                rep = Replay(
                    name,
                    wl,
                    front_for(engines),
                    model=served,
                    timeout_s=a.request_timeout,
                    step=k,
                    on_done=done,
                    on_close=fleet.close_session if fleet is not None and fleet.uses_store else None,
                    sessions=name not in STORELESS_CONFIGS,
                    repeat=repeat,
                    on_start=faults.start if faults is not None else None,
                )
                was = os.getpriority(os.PRIO_PROCESS, 0)
                niced = bool(a.front_nice) and fleet is not None and renice(0, a.front_nice)
                if a.front_nice and fleet is not None:
                    result["front_nice"] = a.front_nice if niced else 0
                try:
                    recs = rep.run()
                finally:
                    if niced:
                        renice(0, was)
                    fault_results = faults.finish() if faults is not None else None
            for why in [*rep.dead.values(), *rep.closes_failed]:
                result["failures"].append(f"{name}: {why}")
            after = _engine_metrics(fleet.engines if fleet is not None else engines)
            nodes_after = fleet.node_counters() if fleet is not None else {}
            cpu_after = fleet.cpu_seconds() if fleet is not None else {}
            counters: dict[str, Any] = {
                "prompt_tokens": report.prompt_sources(before, after),
                "connector_ms": report.connector_ms(before, after),
                "engine_steps": report.engine_steps(before, after),
                "store_blocks": report.store_blocks(nodes_before, nodes_after, before, after)
                if fleet is not None and fleet.uses_store
                else None,
                "connector": report.connector_counters(before, after, requests=len(recs)),
                # where the machine's time went during the replay: CPU seconds per process tree
                "cpu_s": {n: round(cpu_after[n] - cpu_before.get(n, 0.0), 2) for n in cpu_after} or None,
                "offered_rps": round(wl.offered_rps, 4),
                "wall_s": round(rep.wall_s, 2),
                "closes_skipped": rep.closes_skipped,
            }
            if plan:
                counters["faults"] = fault_results  # None: a configuration without nodes
            if fleet is not None and fleet.conductor is not None:
                counters["routing"] = fleet.routing()
            result.setdefault("_counters", {}).setdefault((k, name), []).append(counters)
            by_step[k].setdefault(name, []).append(recs)
            records.extend(recs)
    if name in result["fleets"]:
        result["fleets"][name]["total_s"] = round(time.perf_counter() - t0, 1)


def _engine_metrics(engines: list[Engine]) -> dict[str, dict[str, float]]:
    return {e.name: fleetmod.scrape(e.url) for e in engines if e.alive}


def main(a: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    result, records = run(a)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    if a.records:
        with open(a.records, "w") as f:
            for r in records:
                f.write(json.dumps(r.to_json()) + "\n")
    if a.plot:
        report.plot(result, records, a.plot)
    report.print_table(result, sys.stderr if a.json else sys.stdout)
    if a.json:
        print(json.dumps(result), flush=True)
    failed = any(c["completed"] == 0 for c in result["configs"].values())
    return 1 if failed else 0

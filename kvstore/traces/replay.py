"""``kvstore replay``: a Mooncake-format trace through the eviction policies, or a live node.

    kvstore replay TRACE --capacity 5%                     # simulator: the node's own tier manager
    kvstore replay TRACE --capacity 2000 --policy lru --json
    kvstore replay TRACE --target unix:///run/kvstore.sock --block-bytes 64KiB [--speedup 10]
    kvstore replay --generate OUT.jsonl --requests 3000 --seed 7 [--system-prompts 20 --reuse 0.7 ...]
    kvstore replay TRACE --capacity 5% --bounds            # oracle bounds: what knowing the future is worth
    kvstore replay TRACE --capacity 5% --nvme-capacity 50% --bytes-per-token 131072 --recompute-tps 8000 --bench engine.json

Session hints: a trace whose requests carry ``session_id`` (or that has ``close_session``
events) is replayed twice, without hints (today's figures) and through the node's session
code (``hinted``: the same policy, and LRU, with ``+sessions``).  Two tiers
(``--nvme-capacity``): the node's DRAM and NVMe tier managers, with hits per tier and,
given the cost model's inputs (:mod:`kvstore.traces.costmodel`), the prefill time saved.

Parsing and reporting only: the work is in :mod:`kvstore.traces.simulator` (simulator mode),
:mod:`kvstore.traces.live` (live mode), :mod:`kvstore.traces.optimal` (the offline optimum) and
:mod:`kvstore.traces.generate` (``--generate``) and :mod:`kvstore.traces.bounds` (``--bounds``).  Every figure is reported next to LRU and the
optimum at the same capacity, with the share of the LRU → optimum gap the policy closes.

Hit ratio: prefix-hit blocks ÷ all blocks of all requests (a block is a hit only if it
and every block before it in its request were cached); hit tokens count the tokens of
those blocks (the last block of a prompt may be partial).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from kvstore.errors import InvalidArgument
from kvstore.node.config import parse_size
from kvstore.traces import costmodel
from kvstore.traces.format import DEFAULT_BLOCK_TOKENS, Trace
from kvstore.traces.generate import GenParams, generate_events
from kvstore.traces.optimal import optimal
from kvstore.traces.simulator import DEFAULT_PUT_BATCH, DEFAULT_SESSION_TTL, SimResult, check_policy, simulate
from tiers.policy import DEFAULT_POLICY, POLICIES

DEFAULT_BLOCK_BYTES = 64 << 10


def parse_capacity(spec: str, trace: Trace, *, block_bytes: int | None = None, flag: str = "--capacity") -> int:
    """``2000`` (blocks), ``5%`` (of the trace's unique blocks), ``8GiB`` (÷ block bytes) or ``unlimited``."""
    s = str(spec).strip()
    if s.lower() in ("unlimited", "inf", "all"):
        return max(1, trace.unique_blocks)
    if s.endswith("%"):
        try:
            pct = float(s[:-1])
        except ValueError:
            raise InvalidArgument(f"{flag}: not a capacity: {spec!r} (examples: 2000, 5%, 8GiB, unlimited)") from None
        if not math.isfinite(pct) or pct <= 0:
            raise InvalidArgument(f"{flag} must be a positive percentage, got {spec!r}")
        return max(1, round(trace.unique_blocks * pct / 100))
    if s.lstrip("+-").isdigit():
        n = int(s)
        if n <= 0:
            raise InvalidArgument(f"{flag} must be a positive number of blocks, got {spec!r}")
        return n
    if s.startswith("-"):
        raise InvalidArgument(f"{flag} must be positive, got {spec!r}")
    if not any(c.isalpha() for c in s):
        raise InvalidArgument(f"{flag}: not a capacity: {spec!r} (examples: 2000, 5%, 8GiB, unlimited)")
    try:
        nbytes = parse_size(s)
    except InvalidArgument:
        raise InvalidArgument(f"{flag}: not a capacity: {spec!r} (examples: 2000, 5%, 8GiB, unlimited)") from None
    if block_bytes is None:
        raise InvalidArgument(
            f"{flag} {spec} is a size: give --bytes-per-token (simulator) or --block-bytes (live) to turn it into blocks"
        )
    blocks = nbytes // block_bytes
    if blocks <= 0:
        raise InvalidArgument(f"{flag} {spec} holds no block of {block_bytes} bytes")
    return blocks


def positive_int(flag: str):  # argparse type factories: errors name the flag
    def conv(v: str) -> int:
        try:
            n = int(v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be an integer, got {v!r}") from None
        if n <= 0:
            raise argparse.ArgumentTypeError(f"{flag} must be positive, got {v}")
        return n

    return conv


def size_arg(flag: str):
    def conv(v: str) -> int:
        try:
            n = parse_size(v)
        except InvalidArgument as e:
            raise argparse.ArgumentTypeError(f"{flag}: {e}") from None
        if n <= 0:
            raise argparse.ArgumentTypeError(f"{flag} must be positive, got {v}")
        return n

    return conv


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", nargs="?", metavar="TRACE", help="Mooncake-format JSON-lines trace")
    p.add_argument(
        "--capacity",
        metavar="N|N%%|SIZE",
        help="tier size: blocks, %% of the trace's unique blocks, a byte size (8GiB), or 'unlimited'",
    )
    p.add_argument(
        "--policy",
        default=DEFAULT_POLICY,
        help=f"eviction policy, one of {sorted(POLICIES)} (default {DEFAULT_POLICY}); in live mode, the node's --eviction-policy",
    )
    p.add_argument(
        "--block-tokens",
        type=positive_int("--block-tokens"),
        default=DEFAULT_BLOCK_TOKENS,
        help="tokens per hash id in the trace (default 512)",
    )
    p.add_argument(
        "--requests",
        type=positive_int("--requests"),
        metavar="N",
        help="replay only the first N requests (with --generate: how many to write, default 2000)",
    )
    p.add_argument(
        "--bytes-per-token",
        type=positive_int("--bytes-per-token"),
        metavar="N",
        help="KV bytes per token, to read a --capacity given in bytes (simulator)",
    )
    p.add_argument(
        "--put-batch",
        type=positive_int("--put-batch"),
        default=DEFAULT_PUT_BATCH,
        help="blocks per put call (default 16; capped at a quarter of the tier)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--bounds",
        action="store_true",
        help="simulator: also replay oracle policies that know the future (dead blocks, next uses) and report how predictable reuse is",
    )
    p.add_argument(
        "--session-ttl",
        type=float,
        default=DEFAULT_SESSION_TTL,
        metavar="S",
        help=f"sessions idle this many trace-seconds are closed (default {DEFAULT_SESSION_TTL:.0f}, the node's session_idle_ttl_s)",
    )
    p.add_argument(
        "--no-sessions",
        action="store_true",
        help="ignore the trace's session ids and close events (with --generate: write none)",
    )
    p.add_argument(
        "--skip-bad-lines",
        action="store_true",
        help="skip malformed trace lines (bad session ids, closes of sessions never opened, ...) and report them by line, instead of stopping at the first",
    )
    tiers = p.add_argument_group("two tiers and the cost model")
    tiers.add_argument(
        "--nvme-capacity",
        metavar="N|N%%|SIZE",
        help="simulator: add an NVMe tier of this size (as --capacity) behind the DRAM one; hits are reported per tier",
    )
    costmodel.add_arguments(tiers)
    live = p.add_argument_group("live mode")
    live.add_argument(
        "--target",
        metavar="URL",
        help="unix:///path/kvstore.sock or host:port of a running node, or etcd://HOST:PORT/CLUSTER for a cluster",
    )
    live.add_argument(
        "--block-bytes",
        type=size_arg("--block-bytes"),
        default=DEFAULT_BLOCK_BYTES,
        help="synthetic payload per block (default 64KiB; keep it a multiple of 64KiB)",
    )
    live.add_argument(
        "--speedup",
        type=float,
        default=0.0,
        metavar="F",
        help="honour the trace's timestamps, F times faster (default 0: as fast as possible)",
    )
    live.add_argument("--token-file", metavar="FILE", help="bearer token for the node")
    from kvstore.tls import add_client_arguments

    add_client_arguments(p)
    gen = p.add_argument_group("trace generator (--generate OUT)")
    gen.add_argument(
        "--generate",
        metavar="OUT",
        help="write a synthetic trace (multi-turn conversations over shared system prompts) and exit",
    )
    d = GenParams()
    gen.add_argument("--seed", type=int, default=d.seed)
    gen.add_argument(
        "--system-prompts",
        type=int,
        default=d.system_prompts,
        help=f"shared system prompts (default {d.system_prompts})",
    )
    gen.add_argument(
        "--system-tokens",
        type=int,
        default=d.system_tokens,
        help=f"mean system prompt length (default {d.system_tokens})",
    )
    gen.add_argument(
        "--zipf", type=float, default=d.zipf, help=f"Zipf exponent of system prompt popularity (default {d.zipf})"
    )
    gen.add_argument(
        "--reuse",
        type=float,
        default=d.reuse,
        help=f"share of conversations opening with a shared system prompt (default {d.reuse})",
    )
    gen.add_argument("--turns", type=float, default=d.turns, help=f"mean turns per conversation (default {d.turns})")
    gen.add_argument(
        "--think-time",
        type=float,
        default=d.think_s,
        metavar="S",
        help=f"mean seconds between turns (default {d.think_s})",
    )
    gen.add_argument(
        "--user-tokens",
        type=int,
        default=d.user_tokens,
        help=f"mean new user tokens per turn (default {d.user_tokens})",
    )
    gen.add_argument(
        "--output-tokens",
        type=int,
        default=d.output_tokens,
        help=f"mean output tokens per turn (default {d.output_tokens})",
    )
    gen.add_argument(
        "--branch",
        type=float,
        default=d.branch,
        help=f"chance a turn re-asks from an earlier turn (default {d.branch})",
    )
    gen.add_argument(
        "--one-shot", type=float, default=d.one_shot, help=f"share of single unrelated requests (default {d.one_shot})"
    )
    gen.add_argument("--rate", type=float, default=d.rate, help=f"requests per second (default {d.rate})")
    gen.add_argument(
        "--close-after",
        type=float,
        default=d.close_after_s,
        metavar="S",
        help=f"a session's close_session event comes S seconds after its last turn (default {d.close_after_s:.0f}); "
        "session length is --turns",
    )
    gen.add_argument(
        "--close-share",
        type=float,
        default=d.close_share,
        metavar="F",
        help=f"share of ended sessions that send a close (default {d.close_share}); the rest are left to the idle TTL",
    )


def gap_closed(hit: float, lru: float, opt: float) -> float | None:
    """Share of the LRU → optimum gap closed; None when there is no gap to speak of."""
    return (hit - lru) / (opt - lru) if opt - lru > 1e-9 else None


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.2f}%"


def _generate(a: argparse.Namespace) -> int:
    if a.trace:
        raise InvalidArgument("give either TRACE (to replay) or --generate OUT (to write one), not both")
    params = GenParams(
        requests=a.requests or 2000,
        seed=a.seed,
        system_prompts=a.system_prompts,
        system_tokens=a.system_tokens,
        zipf=a.zipf,
        reuse=a.reuse,
        turns=a.turns,
        think_s=a.think_time,
        user_tokens=a.user_tokens,
        output_tokens=a.output_tokens,
        branch=a.branch,
        one_shot=a.one_shot,
        rate=a.rate,
        block_tokens=a.block_tokens,
        sessions=not a.no_sessions,
        close_after_s=a.close_after,
        close_share=a.close_share,
    ).check()
    reqs, closes = generate_events(params)
    trace = Trace(reqs, closes=closes, block_tokens=a.block_tokens, name=a.generate)
    try:
        trace.write(a.generate)
    except OSError as e:
        raise InvalidArgument(f"--generate: cannot write {a.generate}: {e.strerror or e}") from None
    summary = {"generated": a.generate, **trace.summary()}
    if a.json:
        print(json.dumps(summary))
    else:
        print(
            f"wrote {a.generate}: {summary['requests']} requests, {summary['blocks']} blocks ({summary['unique_blocks']} unique), "
            f"{summary['duration_s']:.0f} s; unlimited-capacity hit ratio {_pct(summary['unlimited_hit_ratio'])}"
        )
    return 0


def main(a: argparse.Namespace) -> int:
    if a.generate:
        return _generate(a)
    if not a.trace:
        raise InvalidArgument("give a TRACE to replay (or --generate OUT to write one)")
    check_policy(a.policy)
    if not (a.session_ttl > 0 and math.isfinite(a.session_ttl)):
        raise InvalidArgument(f"--session-ttl must be a positive number of seconds, got {a.session_ttl}")
    trace = Trace.load(
        a.trace, block_tokens=a.block_tokens, limit=a.requests, bad_lines="skip" if a.skip_bad_lines else "fail"
    )
    for why in trace.skipped:
        print(f"kvstore replay: skipped {why}", file=sys.stderr)
    if a.no_sessions:
        trace = trace.without_sessions()
    live = bool(a.target)
    if live and a.bounds:
        raise InvalidArgument("--bounds is a simulator report; drop --target")
    if live and a.nvme_capacity:
        raise InvalidArgument("--nvme-capacity is a simulator report; a live node's tiers are its own (drop --target)")
    if not live and a.capacity is None:
        raise InvalidArgument("--capacity is required in simulator mode (blocks, N%, a size like 8GiB, or unlimited)")
    bytes_per_block = a.block_bytes if live else (a.bytes_per_token * a.block_tokens if a.bytes_per_token else None)
    capacity = parse_capacity(a.capacity, trace, block_bytes=bytes_per_block) if a.capacity is not None else None
    nvme = (
        parse_capacity(a.nvme_capacity, trace, block_bytes=bytes_per_block, flag="--nvme-capacity")
        if a.nvme_capacity
        else 0
    )
    out: dict[str, Any] = {"mode": "live" if live else "simulator", "trace": a.trace, **trace.summary()}
    if trace.skipped:
        out["skipped_lines"] = list(trace.skipped)
    if live:
        from kvstore.tls import client_kwargs
        from kvstore.traces.live import new_salt, replay_live

        trace = trace.with_salt(new_salt())
        res = replay_live(
            trace,
            a.target,
            block_bytes=a.block_bytes,
            batch=a.put_batch,
            speedup=a.speedup,
            capacity_blocks=capacity,
            token_file=a.token_file,
            client_options=client_kwargs(a),
        )
        capacity = res.capacity_blocks
        # what the node did: with the trace's sessions sent along (its own hints), the hinted simulation
        sim = simulate(
            trace, capacity, a.policy, batch=a.put_batch, sessions=trace.has_sessions, session_ttl=a.session_ttl
        )
        out.update(
            target=a.target,
            block_bytes=a.block_bytes,
            elapsed_s=round(res.elapsed_s, 3),
            bytes_moved=res.bytes_moved,
            node_events=res.events,
            simulated_hit_ratio=sim.hit_ratio,
            matches_simulator=res.per_request_hits == sim.per_request_hits,
            warnings=list(res.warnings),
        )
        hit_ratio, hit_blocks, hit_tokens, token_ratio = (
            res.hit_ratio,
            res.hit_blocks,
            res.hit_tokens,
            res.token_hit_ratio,
        )
    else:
        assert capacity is not None
        sim = simulate(trace, capacity, a.policy, batch=a.put_batch, nvme_blocks=nvme)
        out["evictions"] = sim.evictions
        hit_ratio, hit_blocks, hit_tokens, token_ratio = (
            sim.hit_ratio,
            sim.hit_blocks,
            sim.hit_tokens,
            sim.token_hit_ratio,
        )
    unhinted = trace.without_sessions() if trace.has_sessions else trace
    lru = (
        sim
        if a.policy == "lru" and not live
        else simulate(unhinted, capacity, "lru", batch=a.put_batch, nvme_blocks=nvme)
    )
    opt = optimal(trace, capacity + nvme)
    out.update(
        policy=a.policy,
        capacity_blocks=capacity,
        capacity_fraction=capacity / trace.unique_blocks,
        hit_ratio=hit_ratio,
        hit_blocks=hit_blocks,
        hit_tokens=hit_tokens,
        token_hit_ratio=token_ratio,
        lru_hit_ratio=lru.hit_ratio,
        optimal_hit_ratio=opt.hit_ratio,
        optimal_hit_tokens=opt.hit_tokens,
        gap_closed=gap_closed(hit_ratio, lru.hit_ratio, opt.hit_ratio),
    )
    if trace.has_sessions and not live:
        out["hinted"] = _hinted(trace, capacity, a, nvme, lru.hit_ratio, opt.hit_ratio)
    if nvme:
        model = costmodel.from_args(a.recompute_tps, a.bytes_per_token, a.dram_gbps, a.nvme_gbps, a.bench)
        out.update(
            nvme_capacity_blocks=nvme,
            nvme_capacity_fraction=nvme / trace.unique_blocks,
            fraction_of_unlimited=hit_ratio / out["unlimited_hit_ratio"] if out["unlimited_hit_ratio"] else None,
            **_tier_figures(sim, trace, model, "", out),
        )
    if a.bounds:
        from kvstore.progress import Progress
        from kvstore.traces.bounds import bounds

        with Progress("kvstore replay --bounds", unit="replays") as prog:
            out["oracle_bounds"] = bounds(
                trace, capacity, a.policy, batch=a.put_batch, progress=prog, session_ttl=a.session_ttl
            ).to_json()
    if a.json:
        print(json.dumps(out))
    else:
        _print_report(out)
    return 0


def _hinted(trace: Trace, capacity: int, a: argparse.Namespace, nvme: int, lru: float, opt: float) -> dict[str, Any]:
    """The policy and LRU with the trace's session hints honoured (the node's session code)."""
    out: dict[str, Any] = {"session_ttl_s": a.session_ttl}
    for name in dict.fromkeys([a.policy, "lru"]):
        r = simulate(
            trace, capacity, name, batch=a.put_batch, nvme_blocks=nvme, sessions=True, session_ttl=a.session_ttl
        )
        out[r.policy] = {
            "hit_ratio": r.hit_ratio,
            "hit_tokens": r.hit_tokens,
            "gap_closed": gap_closed(r.hit_ratio, lru, opt),
            **({"tier_hits": r.tier_hit_ratios} if nvme else {}),
        }
    return out


def _tier_figures(sim: SimResult, trace: Trace, model: Any, prefix: str, out: dict[str, Any]) -> dict[str, Any]:
    """``tier_hits`` as ratios of all blocks and, with a cost model, the prefill time saved per request."""
    fig: dict[str, Any] = {prefix + "tier_hits": sim.tier_hit_ratios}
    if model is not None:
        blocks = dict(sim.tier_hits)
        saved = model.saved_s(sim.hit_tokens, blocks.get("dram", 0), blocks.get("nvme", 0), trace.block_tokens)
        fig[prefix + "prefill_saved_s_per_request"] = saved / len(trace)
        out["cost_model"] = model.to_json()
    return fig


def _print_report(o: dict[str, Any]) -> None:
    print(
        f"trace     {o['trace']}: {o['requests']} requests, {o['blocks']} blocks ({o['unique_blocks']} unique), "
        f"unlimited-capacity hit ratio {_pct(o['unlimited_hit_ratio'])}"
    )
    print(
        f"capacity  {o['capacity_blocks']} blocks ({100 * o['capacity_fraction']:.1f}% of unique blocks), mode {o['mode']}"
    )
    print(f"{'':14}{'hit ratio':>10}  {'hit tokens':>14}")
    print(
        f"{o['policy']:14}{_pct(o['hit_ratio']):>10}  {o['hit_tokens']:>14,}   ({_pct(o['token_hit_ratio'])} of tokens)"
    )
    print(f"{'lru':14}{_pct(o['lru_hit_ratio']):>10}")
    print(f"{'optimal':14}{_pct(o['optimal_hit_ratio']):>10}  {o['optimal_hit_tokens']:>14,}")
    print(f"gap closed: {_pct(o['gap_closed'])} of the LRU → optimum gap")
    if "hinted" in o:
        h = o["hinted"]
        print(
            f"with session hints ({o['sessions']} sessions, {o['session_closes']} closes, idle TTL {h['session_ttl_s']:.0f} s):"
        )
        for name, r in h.items():
            if isinstance(r, dict):
                print(f"  {name:24}{_pct(r['hit_ratio']):>10}  gap closed {_pct(r['gap_closed'])}")
    if "tier_hits" in o:
        th = o["tier_hits"]
        print(
            f"two tiers  DRAM {o['capacity_blocks']} + NVMe {o['nvme_capacity_blocks']} blocks "
            f"({100 * o['nvme_capacity_fraction']:.1f}% of unique): hits DRAM {_pct(th.get('dram'))}, NVMe {_pct(th.get('nvme'))}; "
            f"{_pct(o['fraction_of_unlimited'])} of the unlimited-capacity hit ratio"
        )
        if "prefill_saved_s_per_request" in o:
            print(
                f"           prefill saved per request: {1000 * o['prefill_saved_s_per_request']:.1f} ms (cost model {o['cost_model']})"
            )
    if "oracle_bounds" in o:
        _print_bounds(o["oracle_bounds"])
    if o["mode"] == "live":
        mb = {k: f"{v / 2**20:.1f} MiB" for k, v in o["bytes_moved"].items()}
        print(f"live      {o['elapsed_s']:.1f} s against {o['target']}; bytes moved: {mb}")
        print(
            f"          simulator at the same capacity: {_pct(o['simulated_hit_ratio'])} "
            f"({'identical per request' if o['matches_simulator'] else 'DIFFERS'})"
        )
    sys.stdout.flush()


def _print_bounds(b: dict[str, Any]) -> None:
    print("oracle bounds (same capacity, the node's tier manager; the oracles read the trace's future):")
    for row in b["bounds"]:
        print(f"  {row['name']:38}{_pct(row['hit_ratio']):>9}  gap closed {_pct(row['gap_closed']):>8}   {row['what']}")
    p = b["predictability"]
    probs = ", ".join(f"{k}: {_pct(v)}" for k, v in p["reuse_probability"].items())
    print(
        f"what the block stream tells (in-sample): P(block used again) by chain turn ({probs}); "
        f"AUC of the best (turn, uses) table {p['reuse_auc']:.3f}; R² of log reuse gap {p['gap_r2']:.3f}"
    )

"""The ``kvstore`` command line: ``serve``, ``stats``, and the subcommands of other modules.

Parsing only: each subcommand builds its typed inputs and calls one function that
does the work (``kvstore.node.server.serve``, ``kvstore.bench.cli.parse``, ...).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys

from kvstore.errors import KVStoreError


def _cmd_serve(a: argparse.Namespace) -> int:
    """The node's composition root: its config from the flags, the file and the environment,
    and, with ``etcd`` set, the cluster link (``kvstore.node`` never names ``kvstore.cluster``)."""
    from kvstore.node.args import overrides
    from kvstore.node.config import load_config
    from kvstore.node.server import serve

    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = load_config(a.config, overrides=overrides(a))
    cluster = None
    if cfg.etcd:
        from kvstore.cluster.node import ClusterLink

        cluster = ClusterLink()
    return asyncio.run(serve(cfg, cluster=cluster))


def _cmd_stats(a: argparse.Namespace) -> int:
    from client import connect
    from kvstore.tls import client_kwargs

    with connect(a.target, **client_kwargs(a)) as kv:
        print(json.dumps(kv.stats(), indent=2, sort_keys=True))
    return 0


def _cmd_close_session(a: argparse.Namespace) -> int:
    """Exit 0: closed (on some node); 1: no such session open for this caller."""
    from client import connect
    from kvstore.tls import client_kwargs

    with connect(a.target, token_file=a.token_file, **client_kwargs(a)) as kv:
        closed = kv.close_session(a.session_id)
    print(
        f"session {a.session_id!r} {'closed' if closed else 'was not open (never used, closed already, or idle past the TTL)'}"
    )
    return 0 if closed else 1


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The full parser.  Plugin modules are imported only for ``command`` (the subcommand
    being run), so one plugin's import cost or failure never affects the others."""
    p = argparse.ArgumentParser(prog="kvstore", description="Tiered KV-cache store for LLM inference.")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="run one node (DRAM arena + NVMe tier, gRPC on a Unix socket and TCP)")
    from kvstore.node.args import add_arguments as serve_arguments

    serve_arguments(s)
    s.set_defaults(fn=_cmd_serve)
    st = sub.add_parser("stats", help="print a node's tiers and counters as JSON")
    st.add_argument(
        "--target",
        default=os.environ.get("KVSTORE_TARGET", "127.0.0.1:50151"),
        help="unix:///path or host:port (default: $KVSTORE_TARGET, else 127.0.0.1:50151, the default node)",
    )
    from kvstore.tls import add_client_arguments

    add_client_arguments(st)
    st.set_defaults(fn=_cmd_stats)
    cs = sub.add_parser(
        "close-session", help="session hints: a session sends no more requests (its own blocks are evicted first)"
    )
    cs.add_argument("session_id", metavar="SESSION_ID")
    cs.add_argument(
        "--target",
        default=os.environ.get("KVSTORE_TARGET", "127.0.0.1:50151"),
        help="unix:///path, host:port or etcd://HOST:PORT/CLUSTER (default: $KVSTORE_TARGET, else 127.0.0.1:50151)",
    )
    cs.add_argument("--token-file", metavar="FILE", help="bearer token of the tenant whose session it is")
    add_client_arguments(cs)
    cs.set_defaults(fn=_cmd_close_session)
    # `kvstore bench SUBCOMMAND`: parsed by kvstore.bench.cli (see main); listed here for --help
    sub.add_parser(
        "bench",
        help="benchmarks against references measured in the same run: sdk, engine, index, latency, connector, gpu, "
        "placement, cluster-sim, conductor-sim, serving (`kvstore bench --help`)",
        add_help=False,
    )
    # subcommands that live in their own modules register themselves here
    for name, module, help_text in _PLUGINS:
        sp = sub.add_parser(name, help=help_text, add_help=name == command)
        if name == command:
            mod = __import__(module, fromlist=["add_arguments"])
            mod.add_arguments(sp)
            sp.set_defaults(fn=mod.main)
    return p


# (subcommand, module with add_arguments(parser) and main(args) -> int, help)
_PLUGINS: list[tuple[str, str, str]] = [
    (
        "replay",
        "kvstore.traces.replay",
        "replay a Mooncake-format request trace through the eviction policies or a live store",
    ),
    (
        "sim",
        "kvstore.sim.cli",
        "a trace through simulated engines in virtual time, with and without the store (kvstore bench serving's figures)",
    ),
    ("plan", "kvstore.traces.plan", "capacity planner: DRAM and NVMe sizes that reach a target hit ratio on a trace"),
    (
        "demo",
        "kvstore.demo.cli",
        "end-to-end demos with a real transformer (e.g. `kvstore demo pd`: prefill -> decode handoff)",
    ),
    (
        "up",
        "kvstore.local.up",
        "a whole local cluster in the foreground: a private etcd and N nodes (Ctrl-C stops it all)",
    ),
    (
        "cluster",
        "kvstore.cluster.cli",
        "cluster configuration and namespaces in etcd: set, show, invalidate, owners, release",
    ),
    (
        "conductor",
        "kvstore.conductor.cli",
        "KV-cache-aware request scheduler: an OpenAI-compatible front over vLLM engines using the connector",
    ),
    (
        "dashboard",
        "kvstore.dashboard.cli",
        "live cache-hit dashboard (web page) for one node, a whole cluster, and conductors' engines",
    ),
    ("health", "kvstore.node.health", "one gRPC health check of a node (exit 0: SERVING), for container probes"),
    ("certs", "kvstore.local.ca", "a throwaway CA and node certificate for trying TLS (needs the 'tls' extra)"),
    (
        "wipe",
        "kvstore.node.wipe",
        "remove a stopped node's data: its data directory (NVMe tier, owners, socket) and its arena",
    ),
]


_SIM_TOOLS = {"validate": "validate", "calibrate": "calibrate", "serve": "server"}
"""``kvstore sim TOOL``: the module (under ``kvstore.sim``) with its ``add_arguments`` and ``main``."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    if argv[:1] == ["bench"]:  # `kvstore bench SUBCOMMAND`: one module per benchmark (kvstore/bench/cli.py)
        from kvstore.bench import cli as bench

        args = bench.parse(argv[1:])
    elif argv[:2] == ["cluster", "bench-placement"]:  # deprecated: `kvstore bench placement`
        from kvstore.bench import cli as bench

        args = bench.cluster_bench_placement(argv[2:])
    elif argv[:1] == ["sim"] and argv[1:2] and argv[1] in _SIM_TOOLS:  # the simulator's tools: parsers of their own
        import importlib

        mod = importlib.import_module(f"kvstore.sim.{_SIM_TOOLS[argv[1]]}")
        sp = argparse.ArgumentParser(prog=f"kvstore sim {argv[1]}", description=str(mod.__doc__).split("\n\n")[0])
        mod.add_arguments(sp)
        args = sp.parse_args(argv[2:])
        args.fn = mod.main
    else:
        args = build_parser(command).parse_args(argv)
    from kvstore.children import exit_on_sigterm

    exit_on_sigterm()  # SIGTERM unwinds: private nodes, redis-server, workers and temp dirs are cleaned up
    try:
        return int(args.fn(args) or 0)
    except KVStoreError as e:
        print(f"kvstore: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

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
from typing import Any

from kvstore.errors import KVStoreError


class DeprecatedSpelling(argparse.Action):
    """Stores a flag's value like ``store``, and warns on stderr when the flag was given by one
    of its ``deprecated`` spellings (kept for one release after a rename; see CHANGELOG.md)."""

    def __init__(self, option_strings: list[str], dest: str, *, deprecated: tuple[str, ...] = (), **kw: Any) -> None:
        self.deprecated = deprecated
        super().__init__(option_strings, dest, **kw)

    def __call__(
        self, parser: argparse.ArgumentParser, ns: argparse.Namespace, values: Any, option_string: str | None = None
    ) -> None:
        if option_string in self.deprecated:
            print(
                f"{parser.prog}: warning: {option_string} is deprecated, use {self.option_strings[0]}", file=sys.stderr
            )
        setattr(ns, self.dest, values)


def _serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config", metavar="FILE", help="TOML config file ([node] table); KVSTORE_* env and flags override it"
    )
    p.add_argument("--listen", metavar="HOST:PORT", help="gRPC TCP listener (default 127.0.0.1:50151; port 0 = any)")
    p.add_argument("--data-listen", metavar="HOST:PORT", help="TCP data channel (default: listen host, any free port)")
    p.add_argument("--socket", metavar="PATH", help="Unix socket for local clients (default <data-dir>/kvstore.sock)")
    p.add_argument("--data-dir", metavar="DIR", help="NVMe tier directory (default ~/.local/share/kvstore)")
    p.add_argument("--dram", metavar="SIZE", help="DRAM arena size, e.g. 4GiB (default 1GiB)")
    p.add_argument("--nvme", metavar="SIZE", help="NVMe tier size, e.g. 100GiB; 0 disables (default 4GiB)")
    p.add_argument("--node-id", metavar="ID", help="node name (default: hostname)")
    p.add_argument(
        "--arena-path",
        metavar="PATH",
        help="shared-memory file of the arena (default /dev/shm/kvstore-<id>-<hash>.arena)",
    )
    p.add_argument(
        "--eviction-policy", metavar="NAME", help="eviction policy (default prefix-reuse; see `kvstore replay`)"
    )
    p.add_argument("--write-through", action="store_true", default=None, help="persist every block to NVMe at commit")
    p.add_argument(
        "--dram-clean-ahead",
        type=float,
        default=None,
        metavar="SHARE",
        help="share of DRAM at the eviction end a background writer keeps free or already on NVMe (default 0.25; 0: off)",
    )
    p.add_argument("--token-file", metavar="FILE", help="require this bearer token on every call")
    p.add_argument(
        "--tenant",
        dest="tenants",
        action="append",
        metavar="NAME=TOKEN_FILE",
        help="a tenant and the file holding its token (repeat for more tenants or tokens); tenants own the namespaces they write",
    )
    p.add_argument(
        "--read-lease-ttl",
        dest="read_lease_ttl_s",
        type=float,
        metavar="S",
        help="read lease lifetime in seconds (default 30)",
    )
    p.add_argument(
        "--etcd", metavar="HOST:PORT[,HOST:PORT]", help="join the cluster whose membership lives in this etcd"
    )
    p.add_argument("--cluster", metavar="NAME", help="cluster name in etcd (default 'default')")
    p.add_argument("--zone", metavar="ZONE", help="failure zone published in this node's membership record")
    p.add_argument(
        "--membership-ttl",
        "--lease-ttl",
        dest="membership_ttl_s",
        action=DeprecatedSpelling,
        deprecated=("--lease-ttl",),
        type=float,
        metavar="S",
        help="TTL of this node's etcd membership lease in seconds (default 10; kept alive every TTL/3); "
        "--lease-ttl is its deprecated spelling",
    )
    p.add_argument(
        "--reservation-ttl",
        dest="reservation_ttl_s",
        type=float,
        metavar="S",
        help="unfinished writes are reclaimed after S seconds",
    )
    p.add_argument(
        "--max-pin-ttl",
        dest="max_pin_ttl_s",
        type=float,
        metavar="S",
        help="longest pin in seconds (default 3600); pins asking for more, or forever, are cut to it",
    )
    p.add_argument(
        "--session-idle-ttl",
        dest="session_idle_ttl_s",
        type=float,
        metavar="S",
        help="session hints: close sessions idle this long (default 1800)",
    )
    p.add_argument(
        "--max-batch",
        type=int,
        metavar="N",
        help="most keys or blocks in one request (default 4096); larger requests are refused, the SDK splits its batches to fit",
    )
    p.add_argument(
        "--drain-timeout",
        dest="drain_timeout_s",
        type=float,
        metavar="S",
        help="on SIGTERM, running calls and transfers get S seconds to finish before they are cancelled (default 10)",
    )
    p.add_argument("--metrics-port", type=int, metavar="PORT", help="serve Prometheus /metrics on this port")
    p.add_argument(
        "--metrics-tls",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="serve /metrics over HTTPS with --tls-cert-file (default: whenever the node serves TLS); "
        "--no-metrics-tls: plain HTTP even then",
    )
    p.add_argument(
        "--tls-cert-file",
        metavar="FILE",
        help="PEM certificate: serve TLS on the TCP listeners (gRPC and data channel); needs --tls-key-file",
    )
    p.add_argument("--tls-key-file", metavar="FILE", help="PEM private key of --tls-cert-file")
    p.add_argument(
        "--tls-client-ca-file",
        metavar="FILE",
        help="PEM CA: require TCP clients to present a certificate it signed (mutual TLS)",
    )
    p.add_argument("--log-level", default="INFO")


def _cmd_serve(a: argparse.Namespace) -> int:
    from kvstore.node.config import load_config
    from kvstore.node.server import serve

    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    overrides: dict[str, Any] = {
        k: getattr(a, k)
        for k in (
            "listen",
            "data_listen",
            "socket",
            "data_dir",
            "dram",
            "nvme",
            "node_id",
            "arena_path",
            "eviction_policy",
            "write_through",
            "dram_clean_ahead",
            "token_file",
            "tenants",
            "read_lease_ttl_s",
            "reservation_ttl_s",
            "max_pin_ttl_s",
            "session_idle_ttl_s",
            "max_batch",
            "drain_timeout_s",
            "metrics_port",
            "metrics_tls",
            "etcd",
            "cluster",
            "zone",
            "membership_ttl_s",
            "tls_cert_file",
            "tls_key_file",
            "tls_client_ca_file",
        )
    }
    cfg = load_config(a.config, overrides=overrides)
    return asyncio.run(serve(cfg))


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
    _serve_args(s)
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

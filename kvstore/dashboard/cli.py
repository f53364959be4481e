"""``kvstore dashboard``: parse the flags, run :class:`~kvstore.dashboard.server.Dashboard`
in the foreground until SIGINT/SIGTERM.  Prints a ``READY {json}`` line with the URL.
``--conductor`` (repeatable) adds the conductors' engines; with it the nodes are optional.

The TLS flags (for nodes that serve ``/metrics`` over HTTPS) default to ``KVSTORE_TLS_*``
variables, so a deployment can add them without rewriting the command line (compose
overrides and strategic-merge patches replace a command as a whole)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

DEFAULT_LISTEN = "127.0.0.1:8600"
ENV = "KVSTORE_TLS_"  # + the variables below (kvstore.node.config.CLIENT_ENV: the node ignores them)
TLS_FLAGS = (  # flag, its variable after ENV, help
    ("--tls-ca-file", "CA_FILE", "PEM CA that signed the nodes' certificates (else the system trust roots)"),
    ("--tls-cert-file", "CLIENT_CERT_FILE", "PEM client certificate, for nodes that require one (mutual TLS)"),
    ("--tls-key-file", "CLIENT_KEY_FILE", "PEM private key of --tls-cert-file"),
    ("--tls-server-name", "SERVER_NAME", "name to verify in every node's certificate instead of the host dialled"),
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--listen",
        default=DEFAULT_LISTEN,
        metavar="HOST:PORT",
        help=f"where the page is served (default {DEFAULT_LISTEN}; port 0: any free port)",
    )
    p.add_argument(
        "--nodes",
        metavar="HOST:PORT,...",
        help="the nodes' Prometheus endpoints (what `kvstore serve --metrics-port` serves), comma-separated",
    )
    p.add_argument(
        "--etcd",
        metavar="HOST:PORT[,...] | etcd://HOST:PORT/CLUSTER",
        help="take the node list from this cluster's membership in etcd",
    )
    p.add_argument(
        "--cluster",
        default=None,
        metavar="NAME",
        help="cluster name in etcd (default 'default', or the one in etcd://.../CLUSTER)",
    )
    p.add_argument(
        "--conductor",
        action="append",
        default=[],
        metavar="HOST:PORT | URL",
        help="a `kvstore conductor` to show the engines of (polled at its /conductor/state every --interval): "
        "per engine its role, whether it is alive, requests routed, running and queued, hit ratio and prompt "
        "tokens by source, and per conductor its decision time, TTFT prediction error and rejections; "
        "repeat for conductors side by side (engines merge by id). With it, --nodes and --etcd are optional",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="with --etcd: scrape this port on each node's host when its membership record names no metrics endpoint",
    )
    p.add_argument(
        "--token-file",
        metavar="FILE",
        help="the nodes' bearer token: sent to the nodes, and required from viewers (any user name, the token as password)",
    )
    p.add_argument(
        "--interval", type=float, default=1.0, metavar="S", help="refresh period in seconds, 0.1 to 2 (default 1)"
    )
    p.add_argument("--title", default="", help="page title")
    g = p.add_argument_group(
        "TLS of the nodes' /metrics (nodes that serve TLS serve it over HTTPS; their membership records say https://)"
    )
    for flag, var, help_text in TLS_FLAGS:
        g.add_argument(
            flag, metavar="NAME" if var == "SERVER_NAME" else "FILE", help=f"{help_text} (default ${ENV}{var})"
        )
    g.add_argument(
        "--tls",
        action="store_true",
        default=False,
        help="HTTPS with the system trust roots (implied by the flags above); with any of these, "
        "--nodes HOST:PORT and --metrics-port mean https://",
    )


def tls_options(a: argparse.Namespace, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``ClientTLS.from_options`` arguments: each flag, else its ``KVSTORE_TLS_*`` variable."""
    environ = os.environ if environ is None else environ
    out: dict[str, Any] = {"tls": bool(a.tls)}
    for flag, var, _ in TLS_FLAGS:
        dest = flag.removeprefix("--").replace("-", "_")
        out[dest.removeprefix("tls_")] = getattr(a, dest) or environ.get(ENV + var) or None
    return out


def _fail(msg: str) -> int:
    print(f"kvstore dashboard: {msg}", file=sys.stderr)
    return 2


def main(a: argparse.Namespace) -> int:
    from kvstore.dashboard.conductors import conductor_url
    from kvstore.dashboard.server import Dashboard, EtcdNodes, NoNodes, StaticNodes
    from kvstore.errors import KVStoreError

    if a.nodes and a.etcd or not (a.nodes or a.etcd or a.conductor):
        return _fail(
            "name the nodes with --nodes HOST:PORT,... or take them from etcd with --etcd HOST:PORT (one of the two), "
            "or show only conductors' engines with --conductor HOST:PORT"
        )
    for c in a.conductor:
        try:
            conductor_url(c)
        except ValueError as e:
            return _fail(f"--conductor: {e}")
    host, sep, port = a.listen.rpartition(":")
    if not sep or not port.isdigit():
        return _fail(f"--listen must be HOST:PORT, got {a.listen!r}")
    token = ""
    if a.token_file:
        try:
            token = Path(a.token_file).read_text().strip()
        except OSError as e:
            return _fail(f"cannot read --token-file {a.token_file}: {e}")
    elif os.environ.get("KVSTORE_TOKEN"):
        token = os.environ["KVSTORE_TOKEN"]
    from kvstore.tls import ClientTLS

    try:
        tls = ClientTLS.from_options(**tls_options(a))
    except KVStoreError as e:
        return _fail(str(e))
    scheme = "https" if tls is not None else "http"
    try:
        source: StaticNodes | EtcdNodes | NoNodes
        if a.nodes:
            source = StaticNodes(a.nodes.split(","), scheme=scheme)
        elif not a.etcd:
            source = NoNodes()
        else:
            from kvstore.cluster.state import parse_target

            endpoints, cluster = (
                parse_target(a.etcd) if a.etcd.startswith("etcd://") else (a.etcd, a.cluster or "default")
            )
            if a.cluster and a.etcd.startswith("etcd://") and a.cluster != cluster:
                return _fail(f"--cluster {a.cluster!r} contradicts {a.etcd!r}")
            source = EtcdNodes(endpoints, cluster, metrics_port=a.metrics_port, scheme=scheme)
    except (ValueError, KVStoreError) as e:
        return _fail(str(e))
    try:
        dash = Dashboard(
            source,
            host=host.strip("[]") or "127.0.0.1",
            port=int(port),
            token=token,
            interval=a.interval,
            title=a.title,
            tls=tls,
            conductors=a.conductor,
        )
    except (ValueError, OSError) as e:
        source.close()
        return _fail(f"cannot serve the dashboard on {a.listen}: {e}")
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    dash.start()
    try:
        print(
            f"kvstore dashboard: {dash.url} ({dash.description}, every {a.interval:g} s){' — token required' if token else ''}"
        )
        print(f"READY {json.dumps({'url': dash.url, 'pid': os.getpid()})}", flush=True)
        stop.wait()
        return 0
    finally:
        dash.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)

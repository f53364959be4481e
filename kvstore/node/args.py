"""``kvstore serve``'s flags: the node's settings as a command line.

:func:`add_arguments` declares them, :func:`overrides` turns parsed flags into the
``load_config`` overrides they make (flags win over the TOML file and ``KVSTORE_*``);
:class:`DeprecatedSpelling` keeps a renamed flag's old spelling working for one release
(``kvstore up`` uses it too).  Parsing only: ``kvstore.cli`` (the composition root) loads
the config and starts the node, with the cluster link when ``etcd`` is set.

Owns no state.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


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


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``kvstore serve``."""
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


def overrides(a: argparse.Namespace) -> dict[str, Any]:
    """The settings the parsed flags set (None: not given), for ``load_config(overrides=)``."""
    return {
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

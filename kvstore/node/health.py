"""``kvstore health``: one standard gRPC health check of a node, for container probes.

Exit status 0 when the node answers SERVING, 1 otherwise (unreachable, not serving,
unreadable config): Docker's HEALTHCHECK treats 1 as unhealthy and reserves 2.

The target is ``--target`` (``unix:///path`` or ``host:port``), or else the Unix socket
of the node that ``--config FILE`` and the ``KVSTORE_*`` environment describe: the
same file and environment ``kvstore serve`` reads, so a probe in the node's container
follows the node wherever its socket is configured.  Health checks need no token (the
node exempts ``grpc.health.v1.Health`` from authentication, so probes stay simple).
A ``host:port`` target of a node serving TLS needs ``--tls-ca-file`` (and, under mutual
TLS, ``--tls-cert-file`` / ``--tls-key-file``); the Unix socket is always plaintext.
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--target",
        metavar="TARGET",
        help="unix:///path or host:port (default: the Unix socket of the node configured by --config and KVSTORE_*)",
    )
    p.add_argument(
        "--config", metavar="FILE", help="the node's TOML config file (as given to `kvstore serve --config`)"
    )
    p.add_argument(
        "--service", default="", help="service to check: '' (the whole server, default) or kvstore.v1.KVStore"
    )
    p.add_argument(
        "--timeout", type=float, default=3.0, metavar="S", help="deadline of the check in seconds (default 3)"
    )
    p.add_argument("--quiet", "-q", action="store_true", help="print nothing; the exit status says it")
    from kvstore.tls import add_client_arguments

    add_client_arguments(p)


def resolve_target(a: argparse.Namespace) -> str:
    if a.target:
        return str(a.target)
    from kvstore.node.config import load_config

    return f"unix://{load_config(a.config).socket_path()}"


def main(a: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvstore.errors import KVStoreError
    from kvstore.tls import ClientTLS, client_kwargs, explain, secure_channel

    def say(msg: str) -> None:
        if not a.quiet:
            print(msg, file=sys.stdout if msg.startswith("SERVING") else sys.stderr)

    try:
        target = resolve_target(a)
        kw = client_kwargs(a)
        tls = ClientTLS.from_options(
            tls=kw["tls"],
            ca_file=kw["tls_ca_file"],
            cert_file=kw["tls_cert_file"],
            key_file=kw["tls_key_file"],
            server_name=kw["tls_server_name"],
        )
    except KVStoreError as e:
        say(f"kvstore health: {e}")
        return 1
    try:
        with secure_channel(target, tls, []) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=a.service), timeout=a.timeout
            )
    except grpc.RpcError as e:
        say(f"kvstore health: {target}: {e.code().name}: {explain(str(e.details()), tls, target)}")
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    say(
        f"{status} {target}"
        if reply.status == health_pb2.HealthCheckResponse.SERVING
        else f"kvstore health: {target}: {status}"
    )
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1

"""``kvstore up``: a whole local cluster in the foreground, for trying kvstore and for tests.

Starts a private etcd on free loopback ports, sets the cluster's replication factor,
then N ``kvstore serve`` nodes (each with its own data directory, free ports and small
tiers), prints every endpoint, the SDK target ``etcd://HOST:PORT/CLUSTER`` and a
``READY {json}`` line, and waits.  Ctrl-C or SIGTERM stops everything it started: the
nodes first (SIGTERM: they deregister, drain and flush), then etcd; exit status 0.

With ``--tls`` the nodes serve TLS on their TCP listeners with a throwaway CA and node
certificate made for this run (``kvstore/local/ca.py``, the ``tls`` extra) in
``<data dir>/tls``, naming the host the nodes advertise; ``--tls-cert-file`` /
``--tls-key-file`` (``--tls-ca-file``, ``--tls-client-ca-file``) pass the user's own
instead.  Either way ``up`` first checks that a client trusting the printed CA can reach
every node (not under mutual TLS: it holds no client certificate), then prints the CA and
the client arguments.  The nodes serve ``/metrics`` over HTTPS too, and ``up``'s dashboard
scrapes it trusting that CA; under mutual TLS, where ``up`` holds no client certificate for
its dashboard, the nodes keep ``/metrics`` on plain HTTP (``--no-metrics-tls``; pass
``--node-arg=--metrics-tls`` to keep it on HTTPS and scrape it with your own client certificate).

Owns its child processes, started by :mod:`kvstore.children`: each runs in its own session
(a Ctrl-C at the terminal reaches only ``up``, which stops them in order) and is asked by the
kernel to exit if ``up`` itself dies (``PR_SET_PDEATHSIG``), so a killed ``up`` leaves no
orphans; a node that was killed has its arena file removed when ``up`` stops.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from kvstore.children import NodeStartError, ServeProcess, private_node
from kvstore.cluster.local_etcd import ETCD_HINT, LocalEtcd, find_etcd
from kvstore.errors import KVStoreError
from kvstore.node.args import DeprecatedSpelling


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", type=int, default=3, metavar="N", help="number of nodes (default 3)")
    p.add_argument("--replication", type=int, default=1, metavar="R", help="copies of each block (default 1)")
    p.add_argument(
        "--data-dir",
        metavar="DIR",
        help="etcd and node data under DIR (default: a temporary directory, removed at exit)",
    )
    p.add_argument("--cluster", default="local", metavar="NAME", help="cluster name (default 'local')")
    p.add_argument("--host", default="127.0.0.1", help="address every listener binds (default 127.0.0.1)")
    p.add_argument("--dram", default="256MiB", metavar="SIZE", help="DRAM arena per node (default 256MiB)")
    p.add_argument("--nvme", default="1GiB", metavar="SIZE", help="NVMe tier per node (default 1GiB; 0 disables)")
    p.add_argument(
        "--membership-ttl",
        "--lease-ttl",
        dest="membership_ttl",
        action=DeprecatedSpelling,
        deprecated=("--lease-ttl",),
        type=float,
        default=10.0,
        metavar="S",
        help="etcd membership lease TTL of each node (default 10 s); --lease-ttl is its deprecated spelling",
    )
    p.add_argument("--etcd-bin", metavar="PATH", help="etcd server binary (default: `etcd` on PATH)")
    p.add_argument(
        "--node-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for every `kvstore serve` (repeatable, e.g. --node-arg=--write-through)",
    )
    p.add_argument("--log-level", default="WARNING", help="log level of the nodes (default WARNING)")
    p.add_argument(
        "--dashboard-port",
        type=int,
        default=0,
        metavar="PORT",
        help="port of the cache-hit dashboard (default 0: any free port; -1: no dashboard)",
    )
    g = p.add_argument_group(
        "TLS on the nodes' TCP listeners (gRPC, data channel and /metrics; the Unix sockets stay plaintext)"
    )
    g.add_argument(
        "--tls",
        action="store_true",
        help="make a throwaway CA and node certificate for --host in <data-dir>/tls and serve TLS with them "
        "(needs the 'cryptography' package: pip install 'kvstore[tls]')",
    )
    g.add_argument(
        "--tls-cert-file", metavar="FILE", help="your own PEM node certificate for every node (it must name --host)"
    )
    g.add_argument("--tls-key-file", metavar="FILE", help="PEM private key of --tls-cert-file")
    g.add_argument(
        "--tls-ca-file",
        metavar="FILE",
        help="PEM CA that signed --tls-cert-file, for clients (default: the system trust roots)",
    )
    g.add_argument(
        "--tls-client-ca-file",
        metavar="FILE",
        help="PEM CA: the nodes require client certificates it signed (mutual TLS)",
    )


@dataclasses.dataclass(frozen=True)
class TLSFiles:
    """The PEM files every node serves TLS with, and what clients need to trust them."""

    cert_file: str
    key_file: str
    ca_file: str | None  # None: the system trust roots
    client_ca_file: str | None  # mutual TLS
    generated: bool  # a throwaway CA made by `up --tls`

    def node_args(self) -> list[str]:
        args = ["--tls-cert-file", self.cert_file, "--tls-key-file", self.key_file]
        # under mutual TLS up's dashboard has no client certificate: /metrics stays plain HTTP
        return args + (["--tls-client-ca-file", self.client_ca_file, "--no-metrics-tls"] if self.client_ca_file else [])

    def dashboard_tls(self) -> Any:
        """What up's dashboard trusts when it scrapes the nodes' https ``/metrics`` (no client certificate)."""
        from kvstore.tls import ClientTLS

        return ClientTLS.from_options(tls=True, ca_file=self.ca_file)

    def client_kwargs(self) -> dict[str, Any]:
        """The SDK keyword arguments that reach the nodes (client certificate as placeholders under mutual TLS)."""
        kw: dict[str, Any] = {"tls_ca_file": self.ca_file} if self.ca_file else {"tls": True}
        if self.client_ca_file:
            kw |= {"tls_cert_file": "CLIENT.crt", "tls_key_file": "CLIENT.key"}
        return kw

    def describe(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "mutual": bool(self.client_ca_file), "client_kwargs": self.client_kwargs()}


def tls_files(a: argparse.Namespace) -> TLSFiles | None:
    """What the TLS flags ask for, checked before anything starts (None: plaintext).  Own
    files are loaded as the node and a client would, so a bad one fails here, clearly;
    ``--tls`` needs only the ``cryptography`` package now (the files are made in ``start``)."""
    from kvstore.errors import InvalidArgument
    from kvstore.tls import ClientTLS, ServerTLS

    own = a.tls_cert_file or a.tls_key_file
    if a.tls and (own or a.tls_ca_file):
        raise InvalidArgument(
            "--tls makes its own CA and certificate: pass either --tls or --tls-cert-file/--tls-key-file "
            "(with --tls-ca-file), not both"
        )
    if not (a.tls or own):
        if a.tls_ca_file or a.tls_client_ca_file:
            raise InvalidArgument(
                "--tls-ca-file and --tls-client-ca-file need TLS: add --tls, or --tls-cert-file and --tls-key-file"
            )
        return None
    client_ca = str(Path(a.tls_client_ca_file).absolute()) if a.tls_client_ca_file else None
    if a.tls:
        from kvstore.local.ca import require_cryptography

        require_cryptography("kvstore up --tls")
        if client_ca:
            ClientTLS.from_options(ca_file=client_ca)  # readable, and a CA
        return TLSFiles("", "", None, client_ca, generated=True)
    if not (a.tls_cert_file and a.tls_key_file):
        raise InvalidArgument(
            "--tls-cert-file and --tls-key-file go together: a node certificate needs its private key"
        )
    cert, key = (str(Path(f).absolute()) for f in (a.tls_cert_file, a.tls_key_file))
    ca = str(Path(a.tls_ca_file).absolute()) if a.tls_ca_file else None
    ServerTLS.load(cert, key, client_ca or "")
    if ca:
        ClientTLS.from_options(ca_file=ca)
    return TLSFiles(cert, key, ca, client_ca, generated=False)


def client_snippet(target: str, tls: TLSFiles | None) -> str:
    """``connect(...)`` for ``target``, ready to copy."""
    kw = "".join(f", {k}={v!r}" for k, v in (tls.client_kwargs() if tls else {}).items())
    return f"connect({target!r}{kw})"


def node_args(a: argparse.Namespace, cluster: str, etcd: str, tls: TLSFiles | None = None) -> list[str]:
    """The ``kvstore serve`` flags of every node of the cluster (beyond its data dir, id, listener and tiers)."""
    return [
        "--etcd",
        etcd,
        "--cluster",
        cluster,
        "--data-listen",
        f"{a.host}:0",
        "--membership-ttl",
        str(a.membership_ttl),
        "--metrics-port",
        "0",
        *(tls.node_args() if tls else []),
        *a.node_arg,
    ]


class LocalCluster:
    """etcd + N nodes; ``start`` then ``stop`` (which is safe to call at any point)."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.tls: TLSFiles | None = tls_files(a)  # first: bad TLS flags leave nothing behind
        self.own_dir = a.data_dir is None
        self.dir = Path(a.data_dir) if a.data_dir else Path(tempfile.mkdtemp(prefix="kvstore-up-"))
        self.etcd: LocalEtcd | None = None
        self.nodes: list[ServeProcess] = []
        self.dashboard: Any = None

    def start(self) -> dict[str, Any]:
        from kvstore.progress import Progress

        # etcd, its settings, every node ready, the dashboard
        with Progress("kvstore up", total=3 + self.a.nodes, unit="steps") as prog:
            return self._start(prog)

    def _start(self, prog: Any) -> dict[str, Any]:
        a = self.a
        self.dir.mkdir(parents=True, exist_ok=True)
        if self.tls is not None and self.tls.generated:
            from kvstore.local.ca import advertised_hosts, make

            certs = make(self.dir / "tls", advertised_hosts(a.host), name=f"kvstore up {a.cluster}", overwrite=True)
            self.tls = dataclasses.replace(self.tls, cert_file=certs.cert, key_file=certs.key, ca_file=certs.ca)
        prog.step("starting etcd")
        self.etcd = LocalEtcd(self.dir / "etcd", host=a.host, binary=a.etcd_bin, name="kvstore-up").start()
        prog.update(note="setting the replication factor")
        asyncio.run(self._configure())
        prog.update(note=f"starting {a.nodes} node{'s' if a.nodes != 1 else ''}")
        self._start_nodes(prog)
        if self.tls is not None and not self.tls.client_ca_file:
            self._check_tls(self.tls)
        if a.dashboard_port >= 0:
            from kvstore.dashboard.server import Dashboard, EtcdNodes

            self.dashboard = Dashboard(
                EtcdNodes(self.etcd.endpoint, a.cluster),
                host=a.host,
                port=a.dashboard_port,
                tls=self.tls.dashboard_tls() if self.tls is not None else None,
            ).start()
        prog.update(note="ready")
        return self.describe()

    def _start_nodes(self, prog: Any) -> None:
        """Start every node at once: each is spawned here (this thread lives as long as ``up``:
        ``kvstore.children``), then a thread per node reads it up to READY.  All join ``nodes``
        (which ``stop`` stops); those that did not start are named."""
        a = self.a
        assert self.etcd is not None
        args = node_args(a, a.cluster, self.etcd.endpoint, self.tls)
        self.nodes = [
            private_node(
                self.dir / f"n{i}",
                *args,
                node_id=f"{a.cluster}-n{i}",
                listen=f"{a.host}:0",
                dram=a.dram,
                nvme=a.nvme,
                log_level=a.log_level,
                log_path=self.dir / f"n{i}" / "node.log",
                start=False,
            )
            for i in range(a.nodes)
        ]
        for n in self.nodes:
            n.spawn()
        failed: list[str | None] = [None] * a.nodes

        def ready(i: int) -> None:
            n = self.nodes[i]
            try:
                n.wait_ready(120.0)
            except NodeStartError as e:
                failed[i] = f"node {e.node} did not start (rc={e.returncode}); see {n.data_dir / 'node.log'}"

        threads = [threading.Thread(target=ready, args=(i,), daemon=True) for i in range(a.nodes)]
        for t in threads:
            t.start()
        for i, (t, n) in enumerate(zip(threads, self.nodes)):
            t.join()
            prog.update(note=f"node {n.node_id} {'failed' if failed[i] else 'ready'}")
        if any(failed):
            raise KVStoreError("; ".join(f for f in failed if f))

    def _check_tls(self, files: TLSFiles) -> None:
        """Every node answers a health check over TLS from a client that trusts what ``up``
        prints: a certificate that does not name the advertised host fails here, not later."""
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        from kvstore.tls import ClientTLS, explain, secure_channel

        client = ClientTLS.from_options(tls=True, ca_file=files.ca_file)
        assert client is not None  # tls=True always gives one
        for n in self.nodes:
            target = str(n.endpoints.get("grpc"))
            try:
                with secure_channel(target, client, []) as channel:
                    health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10.0)
            except grpc.RpcError as e:
                raise KVStoreError(
                    f"node {n.node_id} serves TLS at {target}, but a client trusting {client.describe} cannot "
                    f"reach it: {e.code().name}: {explain(str(e.details()), client, target)}"
                ) from None

    async def _configure(self) -> None:
        from kvstore.cluster.etcd import ClusterStore

        assert self.etcd is not None
        store = ClusterStore(self.etcd.endpoint, self.a.cluster)
        try:
            await store.set_config("replication", self.a.replication)
        finally:
            await store.close()

    def describe(self) -> dict[str, Any]:
        assert self.etcd is not None
        return {
            "target": f"etcd://{self.etcd.endpoint}/{self.a.cluster}",
            "etcd": self.etcd.endpoint,
            "etcd_pid": self.etcd.pid,
            "cluster": self.a.cluster,
            "replication": self.a.replication,
            "data_dir": str(self.dir),
            "dashboard": self.dashboard.url if self.dashboard is not None else None,
            "tls": self.tls.describe() if self.tls is not None else None,
            "nodes": [
                {k: n.endpoints.get(k) for k in ("node_id", "grpc", "unix", "data", "pid", "data_dir")}
                for n in self.nodes
            ],
            "pid": os.getpid(),
        }

    def dead_nodes(self) -> list[str]:
        return [str(n.node_id) for n in self.nodes if not n.running()]

    def stop(self) -> None:
        if self.dashboard is not None:
            self.dashboard.close()
            self.dashboard.source.close()
            self.dashboard = None
        for n in self.nodes:
            n.terminate()
        for n in self.nodes:
            n.close()  # waits (SIGKILL after 60 s) and removes the arena of a node that was killed
        if self.etcd is not None:
            self.etcd.stop()
        if self.own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)


def main(a: argparse.Namespace) -> int:
    if a.nodes < 1 or a.replication < 1:
        print("kvstore up: --nodes and --replication must be at least 1", file=sys.stderr)
        return 2
    if find_etcd(a.etcd_bin) is None:
        print(f"kvstore up: {ETCD_HINT}", file=sys.stderr)
        return 2
    try:
        cluster = LocalCluster(a)  # checks the TLS flags and files before anything starts
    except KVStoreError as e:
        print(f"kvstore up: error: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        info = cluster.start()
        if stop.is_set():
            return 0
        print(f"kvstore up: cluster {info['cluster']!r}, {len(info['nodes'])} nodes, replication {info['replication']}")
        print(f"  etcd          {info['etcd']} (pid {info['etcd_pid']})")
        tls = cluster.tls
        on = " (TLS)" if tls else ""
        for n in info["nodes"]:
            print(
                f"  node {n['node_id']:<10} grpc {n['grpc']}{on}  data {n['data']}{on}  {n['unix']}  (pid {n['pid']})"
            )
        print(f"  data          {info['data_dir']}{' (removed at exit)' if cluster.own_dir else ''}")
        if tls is not None:
            made = " (a throwaway CA made for this run)" if tls.generated else ""
            print(f"  TLS CA        {tls.ca_file or 'the system trust roots'}{made}")
            if tls.client_ca_file:
                print(
                    f"  mutual TLS    client certificates signed by {tls.client_ca_file} are required "
                    "(/metrics stays plain HTTP for up's dashboard)"
                )
            else:
                print("  metrics       HTTPS with the same certificate (the dashboard trusts the CA above)")
        print(f"  SDK           from client import connect; kv = {client_snippet(info['target'], tls)}")
        if tls is not None:
            cli = f" --tls-ca-file {tls.ca_file}" if tls.ca_file else " --tls"
            cli += " --tls-cert-file CLIENT.crt --tls-key-file CLIENT.key" if tls.client_ca_file else ""
            print(f"  CLI           kvstore stats --target {info['nodes'][0]['grpc']}{cli}")
        if info["dashboard"]:
            print(f"  dashboard     {info['dashboard']}")
        print(f"  manage        kvstore cluster show --etcd {info['etcd']} --cluster {info['cluster']}")
        print("  Ctrl-C stops everything")
        print(f"READY {json.dumps(info)}", flush=True)
        reported: set[str] = set()
        while not stop.wait(1.0):
            for node_id in set(cluster.dead_nodes()) - reported:
                print(f"kvstore up: node {node_id} exited; see its node.log", file=sys.stderr, flush=True)
                reported.add(node_id)
        return 0
    except KVStoreError as e:
        print(f"kvstore up: error: {e}", file=sys.stderr)
        return 2
    finally:
        print("kvstore up: stopping nodes, then etcd", flush=True)
        cluster.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        print("kvstore up: stopped", flush=True)

"""``kvstore up``: a whole local cluster in the foreground, for trying kvstore and for tests.

Starts a private etcd on free loopback ports, sets the cluster's replication factor,
then N ``kvstore serve`` nodes (each with its own data directory, free ports and small
tiers), prints every endpoint, the SDK target ``etcd://HOST:PORT/CLUSTER`` and a
``READY {json}`` line, and waits.  Ctrl-C or SIGTERM stops everything it started: the
nodes first (SIGTERM: they deregister, drain and flush), then etcd; exit status 0.

Owns its child processes.  Each child runs in its own session (a Ctrl-C at the terminal
reaches only ``up``, which stops them in order) and is asked by the kernel to exit if
``up`` itself dies (``PR_SET_PDEATHSIG``), so a killed ``up`` leaves no orphans.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, IO

from kvstore.cluster.local_etcd import ETCD_HINT, LocalEtcd, find_etcd
from kvstore.errors import KVStoreError

PR_SET_PDEATHSIG = 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", type=int, default=3, metavar="N", help="number of nodes (default 3)")
    p.add_argument("--replication", type=int, default=1, metavar="R", help="copies of each block (default 1)")
    p.add_argument("--data-dir", metavar="DIR", help="etcd and node data under DIR (default: a temporary directory, removed at exit)")
    p.add_argument("--cluster", default="local", metavar="NAME", help="cluster name (default 'local')")
    p.add_argument("--host", default="127.0.0.1", help="address every listener binds (default 127.0.0.1)")
    p.add_argument("--dram", default="256MiB", metavar="SIZE", help="DRAM arena per node (default 256MiB)")
    p.add_argument("--nvme", default="1GiB", metavar="SIZE", help="NVMe tier per node (default 1GiB; 0 disables)")
    p.add_argument("--lease-ttl", type=float, default=10.0, metavar="S", help="membership lease TTL of each node (default 10 s)")
    p.add_argument("--etcd-bin", metavar="PATH", help="etcd server binary (default: `etcd` on PATH)")
    p.add_argument("--node-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for every `kvstore serve` (repeatable, e.g. --node-arg=--write-through)")
    p.add_argument("--log-level", default="WARNING", help="log level of the nodes (default WARNING)")
    p.add_argument("--dashboard-port", type=int, default=0, metavar="PORT",
                   help="port of the cache-hit dashboard (default 0: any free port; -1: no dashboard)")


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM when the parent (``up``) dies."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class NodeChild:
    def __init__(self, index: int, cluster: str, etcd: str, data_dir: Path, a: argparse.Namespace) -> None:
        self.node_id = f"{cluster}-n{index}"
        self.data_dir = data_dir
        self.cmd = [
            sys.executable, "-m", "kvstore", "serve",
            "--etcd", etcd, "--cluster", cluster, "--node-id", self.node_id,
            "--data-dir", str(data_dir), "--listen", f"{a.host}:0", "--data-listen", f"{a.host}:0",
            "--dram", a.dram, "--nvme", a.nvme, "--lease-ttl", str(a.lease_ttl), "--log-level", a.log_level,
            "--metrics-port", "0",
            *a.node_arg,
        ]
        self.proc: subprocess.Popen[str] | None = None
        self.endpoints: dict[str, Any] = {}
        self.error = ""
        self._log: IO[str] | None = None

    def spawn(self) -> None:
        """Start the process.  Call from the main thread: the kernel's parent-death signal
        follows the *thread* that forked, and a helper thread's exit would kill the node."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.data_dir / "node.log", "a")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     text=True, env=env, start_new_session=True, preexec_fn=_die_with_parent)

    def wait_ready(self, timeout: float) -> None:
        """Read output up to the READY line (a thread per node)."""
        assert self.proc is not None and self.proc.stdout is not None and self._log is not None
        deadline = time.monotonic() + timeout
        for line in self.proc.stdout:
            self._log.write(line)
            self._log.flush()
            if line.startswith("READY "):
                self.endpoints = json.loads(line[len("READY "):])
                threading.Thread(target=self._drain, daemon=True).start()
                return
            if time.monotonic() > deadline:
                break
        self.error = f"node {self.node_id} did not start (rc={self.proc.poll()}); see {self.data_dir / 'node.log'}"

    def _drain(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None and self._log is not None
        for line in self.proc.stdout:
            self._log.write(line)
            self._log.flush()

    def terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> None:
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self._log is not None:
            with contextlib.suppress(Exception):
                self._log.close()


class LocalCluster:
    """etcd + N nodes; ``start`` then ``stop`` (which is safe to call at any point)."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.own_dir = a.data_dir is None
        self.dir = Path(a.data_dir) if a.data_dir else Path(tempfile.mkdtemp(prefix="kvstore-up-"))
        self.etcd: LocalEtcd | None = None
        self.nodes: list[NodeChild] = []
        self.dashboard: Any = None

    def start(self) -> dict[str, Any]:
        a = self.a
        self.dir.mkdir(parents=True, exist_ok=True)
        self.etcd = LocalEtcd(self.dir / "etcd", host=a.host, binary=a.etcd_bin, name="kvstore-up").start()
        asyncio.run(self._configure())
        self.nodes = [NodeChild(i, a.cluster, self.etcd.endpoint, self.dir / f"n{i}", a) for i in range(a.nodes)]
        for n in self.nodes:
            n.spawn()
        threads = [threading.Thread(target=n.wait_ready, args=(120.0,), daemon=True) for n in self.nodes]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        failed = [n.error for n in self.nodes if n.error]
        if failed:
            raise KVStoreError("; ".join(failed))
        if a.dashboard_port >= 0:
            from kvstore.dashboard.server import Dashboard, EtcdNodes

            self.dashboard = Dashboard(EtcdNodes(self.etcd.endpoint, a.cluster), host=a.host, port=a.dashboard_port).start()
        return self.describe()

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
            "nodes": [
                {k: n.endpoints.get(k) for k in ("node_id", "grpc", "unix", "data", "pid", "data_dir")} for n in self.nodes
            ],
            "pid": os.getpid(),
        }

    def dead_nodes(self) -> list[str]:
        return [n.node_id for n in self.nodes if n.proc is not None and n.proc.poll() is not None]

    def stop(self) -> None:
        if self.dashboard is not None:
            self.dashboard.close()
            self.dashboard.source.close()
            self.dashboard = None
        for n in self.nodes:
            n.terminate()
        for n in self.nodes:
            n.wait(timeout=60)
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
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    cluster = LocalCluster(a)
    try:
        info = cluster.start()
        if stop.is_set():
            return 0
        print(f"kvstore up: cluster {info['cluster']!r}, {len(info['nodes'])} nodes, replication {info['replication']}")
        print(f"  etcd          {info['etcd']} (pid {info['etcd_pid']})")
        for n in info["nodes"]:
            print(f"  node {n['node_id']:<10} grpc {n['grpc']}  data {n['data']}  {n['unix']}  (pid {n['pid']})")
        print(f"  data          {info['data_dir']}{' (removed at exit)' if cluster.own_dir else ''}")
        print(f"  SDK           KVClient({info['target']!r})")
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

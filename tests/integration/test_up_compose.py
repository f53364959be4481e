"""``kvstore up`` runs the topology of deploy/compose.yaml with local processes: etcd,
the compose file's nodes (same count, cluster, tier sizes and lease TTL) and the
dashboard.  End to end: put/get through the printed SDK target, every node registered
in etcd and healthy by ``kvstore health`` (the image's health check), up's dashboard and
compose's dashboard command both list and scrape every node, and one SIGTERM stops
everything.  ``kvstore up --tls``: the nodes serve TLS with a throwaway CA, the client
line it prints round-trips bytes over TLS, a plaintext client is refused, and the
dashboard scrapes every node's ``/metrics``, now HTTPS with the same CA.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from conftest import ROOT

from kvstore.cli import build_parser
from kvstore.cluster.local_etcd import find_etcd

pytestmark = pytest.mark.skipif(
    find_etcd() is None, reason="etcd is not installed (Debian: apt-get install etcd-server)"
)

COMPOSE = yaml.safe_load((ROOT / "deploy" / "compose.yaml").read_text())


def compose_topology() -> dict[str, Any]:
    nodes = {n: s for n, s in COMPOSE["services"].items() if s.get("command", [None])[0] == "serve"}
    envs = [s["environment"] for s in nodes.values()]
    shared = {k for k in envs[0] if all(e.get(k) == envs[0][k] for e in envs)}
    env = {k: str(envs[0][k]) for k in shared}
    dash = build_parser("dashboard").parse_args(COMPOSE["services"]["dashboard"]["command"])
    return {
        "nodes": len(nodes),
        "cluster": env["KVSTORE_CLUSTER"],
        "dram": env["KVSTORE_DRAM"],
        "nvme": env["KVSTORE_NVME"],
        "lease_ttl": env["KVSTORE_MEMBERSHIP_TTL_S"],
        "dashboard": dash,
    }


class Proc:
    """A child whose stdout is read up to its ``READY {json}`` line, then drained."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvstore", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.lines: list[str] = []

    def ready(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        found: dict[str, Any] = {}

        def read() -> None:
            for line in self.proc.stdout:  # type: ignore[union-attr]
                self.lines.append(line)
                if line.startswith("READY ") and not found:
                    found.update(json.loads(line[len("READY ") :]))

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + timeout
        while not found and self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert found, f"no READY line (rc={self.proc.poll()}):\n{''.join(self.lines)}"
        return found

    def stop(self, timeout: float) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie not yet reaped by its parent counts as gone
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    return False


def health(target: str) -> int:
    return subprocess.run(
        [sys.executable, "-m", "kvstore", "health", "--quiet", "--timeout", "3", "--target", target],
        cwd=ROOT,
        timeout=30,
    ).returncode


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as r:
        assert r.status == 200
        return json.loads(r.read())


def test_up_runs_the_compose_topology_end_to_end(tmp_path: Path) -> None:
    from client import Namespace, Timeouts, connect
    from kvstore.cluster.membership import Membership

    topo = compose_topology()
    assert topo["nodes"] == 3
    up = Proc(
        "up",
        "--nodes",
        str(topo["nodes"]),
        "--cluster",
        topo["cluster"],
        "--dram",
        topo["dram"],
        "--nvme",
        topo["nvme"],
        "--membership-ttl",
        topo["lease_ttl"],
        "--data-dir",
        str(tmp_path / "up"),
    )
    dash: Proc | None = None
    info: dict[str, Any] = {}
    try:
        info = up.ready(timeout=120)
        nodes = {n["node_id"]: n for n in info["nodes"]}
        assert len(nodes) == topo["nodes"] and info["cluster"] == topo["cluster"]
        assert info["target"] == f"etcd://{info['etcd']}/{topo['cluster']}"

        # every node registered, under the addresses it serves
        with Membership(info["etcd"], topo["cluster"]) as view:
            snap = view.wait_for(lambda s: set(s.nodes) == set(nodes), 15)
            assert snap is not None, f"registered: {sorted(view.snapshot().nodes)}"
            for node_id, rec in snap.nodes.items():
                assert rec.grpc == nodes[node_id]["grpc"] and rec.data == nodes[node_id]["data"]
                assert rec.dram_bytes == 256 << 20 and str(topo["dram"]) == "256MiB"

        # the image's health check, against every node's TCP listener and Unix socket
        for n in nodes.values():
            assert health(n["grpc"]) == 0 and health(n["unix"]) == 0

        # put/get through the SDK target that `up` printed
        with connect(info["target"], timeouts=Timeouts(rpc=5.0, data=10.0, connect=5.0)) as kv:
            assert kv.wait_for_nodes(topo["nodes"], 15)
            ns = Namespace("deploy-compose")
            keys = kv.chunk_keys(np.arange(256 * 12), ns)
            rng = np.random.default_rng(8)
            data = [rng.integers(0, 255, 64 << 10, dtype=np.uint8) for _ in keys]
            assert kv.put_many(keys, data, namespace=ns) == [True] * len(keys)
            assert [bytes(g) for g in kv.get_many(keys)] == [d.tobytes() for d in data]
            assert kv.match_prefix(keys) == len(keys)
            owners = {o for k in keys for o in kv.owners(k)}
            assert len(owners) > 1, "blocks spread over the nodes"

        # the dashboard: the one `up` serves, and compose's dashboard command against up's etcd
        assert info.get("dashboard"), "kvstore up serves the dashboard, as compose does"
        a = topo["dashboard"]
        dash = Proc(
            "dashboard",
            "--etcd",
            info["etcd"],
            "--cluster",
            a.cluster,
            "--metrics-port",
            str(a.metrics_port),
            "--listen",
            "127.0.0.1:0",
        )
        for url in (str(info["dashboard"]), dash.ready(timeout=60)["url"]):
            url = url.rstrip("/") + "/"
            deadline = time.monotonic() + 20
            while True:
                seen = {n["name"]: n["status"] for n in get_json(url + "api/cluster")["nodes"]}
                if seen == dict.fromkeys(nodes, "up") or time.monotonic() > deadline:
                    break
                time.sleep(0.3)
            assert seen == dict.fromkeys(nodes, "up"), f"{url}: {seen}"  # listed, and their metrics scraped
    finally:
        if dash is not None:
            assert dash.stop(timeout=30) == 0
        rc = up.stop(timeout=120)

    # one SIGTERM stopped everything `up` started
    assert rc == 0, "".join(up.lines)
    assert "kvstore up: stopped" in "".join(up.lines)
    for pid in [info["etcd_pid"], *(n["pid"] for n in info["nodes"])]:
        deadline = time.monotonic() + 10
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(pid), f"pid {pid} outlived `kvstore up`"
    assert health(info["nodes"][0]["grpc"]) == 1
    from kvstore.node.config import NodeConfig

    for n in info["nodes"]:  # the nodes removed their arenas from /dev/shm
        assert not NodeConfig(node_id=n["node_id"], data_dir=n["data_dir"]).arena_file().exists()


def test_up_tls_serves_tls_with_the_ca_it_prints(tmp_path: Path) -> None:
    import ssl

    from client import KVClient, Namespace, Timeouts, Unavailable

    up = Proc("up", "--tls", "--nodes", "2", "--dram", "64MiB", "--nvme", "0", "--data-dir", str(tmp_path / "up"))
    info: dict[str, Any] = {}
    try:
        info = up.ready(timeout=120)
        tls, nodes = info["tls"], info["nodes"]
        assert tls["generated"] and not tls["mutual"] and Path(tls["ca_file"]).is_file()
        assert Path(tls["ca_file"]).parent == tmp_path / "up" / "tls"
        out = "".join(up.lines)
        assert f"TLS CA        {tls['ca_file']}" in out and out.count("(TLS)") == 2 * len(nodes)

        # the printed client line, copied as is: a cluster client over TLS
        (sdk,) = [ln.split("SDK", 1)[1].strip() for ln in up.lines if ln.lstrip().startswith("SDK")]
        assert f"tls_ca_file={tls['ca_file']!r}" in sdk
        scope: dict[str, Any] = {}
        exec(sdk, scope)  # the line `kvstore up` prints for users to paste
        with scope["kv"] as kv:
            assert kv.wait_for_nodes(len(nodes), 15)
            ns = Namespace("up-tls")
            keys = kv.chunk_keys(np.arange(256 * 8), ns)
            rng = np.random.default_rng(9)
            data = [rng.integers(0, 255, (1 << 20) + 7, dtype=np.uint8) for _ in keys]
            assert kv.put_many(keys, data, namespace=ns) == [True] * len(keys)
            assert [bytes(g) for g in kv.get_many(keys)] == [d.tobytes() for d in data]

        # one node by host:port: bytes over the TLS data channel
        fast = Timeouts(rpc=10.0, data=10.0, connect=10.0)
        with KVClient(nodes[0]["grpc"], tls_ca_file=tls["ca_file"], timeouts=fast) as kv:
            k, payload = os.urandom(16), os.urandom((3 << 20) + 5)
            assert kv.put(k, payload) and kv.get(k) == payload
            pool = getattr(kv._core.transport, "pool", None)  # the data channel's
            assert kv._core.transport.name == "data-channel" and pool is not None and pool._idle
            assert all(isinstance(s, ssl.SSLSocket) for s in pool._idle)

        # a plaintext client is refused, at once, with the setting to change
        t0 = time.monotonic()
        with KVClient(nodes[0]["grpc"], timeouts=Timeouts(rpc=20.0, data=20.0, connect=20.0)) as kv:
            with pytest.raises(Unavailable, match="tls_ca_file"):
                kv.get(os.urandom(16))
        assert time.monotonic() - t0 < 5.0
        # the Unix socket stays plaintext: the container health check works as before
        assert all(health(n["unix"]) == 0 for n in nodes) and health(nodes[0]["grpc"]) == 1

        # the dashboard lists and scrapes both nodes: /metrics is HTTPS, trusted through the printed CA
        url = str(info["dashboard"]).rstrip("/") + "/"
        deadline = time.monotonic() + 20
        while True:
            listed = get_json(url + "api/cluster")["nodes"]
            seen = {n["name"]: n["status"] for n in listed}
            if seen == {n["node_id"]: "up" for n in nodes} or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert seen == {n["node_id"]: "up" for n in nodes}, listed
        assert all(n["url"].startswith("https://") for n in listed) and "metrics       HTTPS" in out
        import urllib.error

        with pytest.raises(urllib.error.HTTPError, match="400"):  # plain HTTP to the metrics port is refused
            urllib.request.urlopen(listed[0]["url"].replace("https://", "http://", 1), timeout=5)
    finally:
        rc = up.stop(timeout=120)
    assert rc == 0, "".join(up.lines)
    for pid in [info["etcd_pid"], *(n["pid"] for n in info["nodes"])]:
        deadline = time.monotonic() + 10
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(pid), f"pid {pid} outlived `kvstore up`"


def test_up_refuses_a_certificate_that_does_not_name_the_host(tmp_path: Path) -> None:
    """Own certificates are checked with the CA `up` would print before it reports READY:
    one that names another host stops everything with the setting to change."""
    from kvstore.local.ca import make

    c = make(tmp_path / "pki", ["node1.example"])
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvstore",
            "up",
            "--nodes",
            "1",
            "--dram",
            "64MiB",
            "--nvme",
            "0",
            "--data-dir",
            str(tmp_path / "up"),
            "--tls-cert-file",
            c.cert,
            "--tls-key-file",
            c.key,
            "--tls-ca-file",
            c.ca,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "READY" not in r.stdout, r.stdout + r.stderr
    assert "does not name the host dialled" in r.stderr and "kvstore up: stopped" in r.stdout

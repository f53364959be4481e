"""``kvstore dashboard`` against real nodes: the JSON the page draws equals the nodes'
``/metrics``; unreachable nodes show as down; read-only; the nodes' token is required and
passed on; the node list can come from etcd membership; assets are served offline;
conductors (``--conductor``) that do not answer, or answer something else, are shown as
such (their engines against real conductors: test_dashboard_browser.py)."""

from __future__ import annotations

import base64
import contextlib
import json
import re
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cluster_fixtures import etcd  # noqa: F401 - fixture
from conftest import ROOT, NodeProcess, wait_for

from client import KVClient
from kvstore.cluster.local_etcd import LocalEtcd, free_port
from kvstore.dashboard.scrape import fetch
from kvstore.dashboard.server import Dashboard, EtcdNodes, NoNodes, StaticNodes

BLOCK = 256 << 10


def k(i: int) -> bytes:
    return i.to_bytes(16, "big")


def get(
    url: str, headers: dict[str, str] | None = None, method: str = "GET", data: bytes | None = None
) -> tuple[int, bytes, Any]:
    req = urllib.request.Request(url, headers=headers or {}, method=method, data=data)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read(), r.headers
    except urllib.error.HTTPError as e:
        return e.code, e.read(), e.headers


def host_port(metrics_url: str) -> str:
    return metrics_url.split("/")[2]


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    n = NodeProcess(
        tmp_path_factory.mktemp("dash") / "node", "--dram", "4MiB", "--nvme", "0", "--metrics-port", "0"
    ).start()
    with KVClient(n.unix) as kv:
        for i in range(3):
            assert kv.put(k(i), np.full(BLOCK, i, np.uint8), token_count=64)
        assert kv.delete([k(2)]) == 1
        assert [x is not None for x in kv.get_many([k(0), k(1), k(2), k(9)])] == [True, True, False, False]
    yield n
    assert n.stop(timeout=30) == 0
    Path(f"/dev/shm/kvstore-test-{n.node_id}.arena").unlink(missing_ok=True)


@pytest.fixture
def dashboard() -> Iterator[Callable[..., Dashboard]]:
    made: list[Dashboard] = []

    def make(source: Any, **kw: Any) -> Dashboard:
        d = Dashboard(source, port=0, interval=kw.pop("interval", 0.2), **kw).start()
        made.append(d)
        return d

    yield make
    for d in made:
        d.close()


def api(d: Dashboard, headers: dict[str, str] | None = None) -> dict[str, Any]:
    code, body, _ = get(d.url + "api/cluster", headers)
    assert code == 200, body
    return json.loads(body)


def test_api_equals_the_nodes_metrics_and_down_nodes_do_not_break_it(node: NodeProcess, dashboard: Any) -> None:
    d = dashboard(StaticNodes([host_port(node.endpoints["metrics"]), "127.0.0.1:1"]))
    v = api(d)
    nodes = {n["name"]: n for n in v["nodes"]}
    assert nodes["127.0.0.1:1"]["status"] == "down" and "unreachable" in nodes["127.0.0.1:1"]["error"]
    up = nodes[host_port(node.endpoints["metrics"])]
    assert up["status"] == "up" and up["node_id"] == node.node_id
    assert up["tiers"]["dram"] == {"capacity": 4 << 20, "used": 2 * BLOCK, "blocks": 2}
    direct = fetch(node.endpoints["metrics"]).counters
    for key in (
        "lookups/get",
        "hits/get/dram",
        "hit_tokens/get/dram",
        "misses/get/invalidated",
        "misses/get/never_stored",
    ):
        assert v["totals"][key] == direct[key]
    assert (
        v["totals"]["hits/get/dram"],
        v["totals"]["misses/get/invalidated"],
        v["totals"]["misses/get/never_stored"],
    ) == (2, 1, 1)
    # new traffic shows up as a history delta
    seq = v["seq"]
    with KVClient(node.unix) as kv:
        kv.get_many([k(0), k(1), k(7)])
    fresh = wait_for(
        lambda: sum(p["d"].get("lookups/get", 0) for p in api(d)["history"] if p["seq"] > seq) == 3,
        10,
        "the new lookups",
    )
    assert fresh


def test_read_only_and_served_offline(node: NodeProcess, dashboard: Any) -> None:
    d = dashboard(StaticNodes([host_port(node.endpoints["metrics"])]))
    code, page, headers = get(d.url)
    assert code == 200 and headers["Content-Type"].startswith("text/html")
    for asset in re.findall(rb'(?:src|href)="([^"]+)"', page):
        assert asset.startswith(b"/static/"), asset  # no CDN: every asset comes from the package
        acode, body, _ = get(d.url.rstrip("/") + asset.decode())
        assert acode == 200 and body
    js = get(d.url + "static/app.js")[1]
    assert not re.search(rb"https?://(?!www\.w3\.org/2000/svg)", js)
    for method in ("POST", "PUT", "DELETE"):
        assert get(d.url + "api/cluster", method=method, data=b"{}")[0] == 405
    assert get(d.url + "static/../server.py")[0] == 404
    assert get(d.url + "nope")[0] == 404


def test_token_is_required_from_viewers_and_sent_to_nodes(tmp_path: Path, dashboard: Any) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("dash-secret\n")
    n = NodeProcess(
        tmp_path / "node", "--dram", "2MiB", "--nvme", "0", "--metrics-port", "0", "--token-file", str(token_file)
    ).start()
    try:
        target = [host_port(n.endpoints["metrics"])]
        blind = dashboard(StaticNodes(target))  # without the token the node refuses it, visibly
        assert "401" in api(blind)["nodes"][0]["error"]
        d = dashboard(StaticNodes(target), token="dash-secret")
        code, _, headers = get(d.url)
        assert code == 401 and headers["WWW-Authenticate"].startswith("Basic")
        assert get(d.url, {"Authorization": "Bearer wrong"})[0] == 401
        basic = {"Authorization": "Basic " + base64.b64encode(b"anyone:dash-secret").decode()}
        assert get(d.url, basic)[0] == 200
        assert api(d, {"Authorization": "Bearer dash-secret"})["nodes"][0]["status"] == "up"
    finally:
        assert n.stop(timeout=30) == 0
        Path(f"/dev/shm/kvstore-test-{n.node_id}.arena").unlink(missing_ok=True)


def test_node_list_from_etcd_membership(etcd: LocalEtcd, tmp_path: Path, dashboard: Any) -> None:
    port = free_port()
    n = NodeProcess(
        tmp_path / "node",
        "--dram",
        "2MiB",
        "--nvme",
        "0",
        "--metrics-port",
        str(port),
        "--etcd",
        etcd.endpoint,
        "--cluster",
        "dash",
        "--membership-ttl",
        "2",
        node_id="dash-n1",
    ).start()
    try:
        d = dashboard(EtcdNodes(etcd.endpoint, "dash", metrics_port=port))
        wait_for(
            lambda: [(x["name"], x["status"]) for x in api(d)["nodes"]] == [("dash-n1", "up")], 15, "the node from etcd"
        )
        assert api(d)["source_status"] == ""
        # replication health from the cluster's settings in etcd (issue 16 #3)
        assert api(d)["replication"] == {"factor": 1, "nodes": 1, "suspected": [], "under_replicated": 0}
    finally:
        assert n.stop(timeout=30) == 0
        Path(f"/dev/shm/kvstore-test-{n.node_id}.arena").unlink(missing_ok=True)
    # the node deregistered: it is shown as having left, not silently dropped
    wait_for(lambda: [x["status"] for x in api(d)["nodes"]] == ["left"], 15, "the node to leave")


class NotAConductor(BaseHTTPRequestHandler):
    """JSON that is not a conductor's state, an HTML page, and 404s."""

    def do_GET(self) -> None:
        body, ctype, code = {
            "/conductor/state": (b'{"status": "ok"}', "application/json", 200),
            "/html": (b"<html>a proxy's page</html>", "text/html", 200),
        }.get(self.path, (b"not found", "text/plain", 404))
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: Any) -> None:
        pass


def test_conductors_that_do_not_answer_or_answer_garbage_are_shown_never_crash(dashboard: Any) -> None:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), NotAConductor)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        d = dashboard(NoNodes(), conductors=["127.0.0.1:1", base, base + "/html", base + "/nope"])
        v = api(d)
        assert v["title"] == "kvstore — 4 conductors" and v["nodes"] == [] and v["engines"] == []
        errors = {c["name"]: (c["status"], c["error"]) for c in v["conductors"]}
        assert errors["127.0.0.1:1"][0] == "down" and errors["127.0.0.1:1"][1].startswith("unreachable")
        assert errors[base] == ("down", "bad answer: not a conductor's state (no engines list)")
        assert errors[base + "/html"][0] == "down" and errors[base + "/html"][1].startswith("bad answer")
        assert errors[base + "/nope"] == ("down", "HTTP 404 Not Found")
        assert get(d.url)[0] == 200  # the page itself is served
    finally:
        srv.shutdown()
        srv.server_close()


@contextlib.contextmanager
def dashboard_process(*args: str) -> Iterator[str]:
    """``kvstore dashboard ARGS --listen 127.0.0.1:0`` as a process; yields its URL once it
    is READY, then SIGTERMs it and checks it exits 0."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore", "dashboard", *args, "--listen", "127.0.0.1:0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
    )
    try:
        assert proc.stdout is not None
        line = wait_for(
            lambda: next((x for x in iter(proc.stdout.readline, "") if x.startswith("READY ")), None), 30, "READY"
        )
        yield json.loads(line[len("READY ") :])["url"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_serves_until_sigterm(node: NodeProcess) -> None:
    with dashboard_process("--nodes", host_port(node.endpoints["metrics"]), "--interval", "0.5") as url:
        assert get(url + "healthz")[0] == 200


def test_cli_shows_conductors_alone() -> None:
    """``--conductor`` without ``--nodes`` or ``--etcd``: the page serves, the conductor that is
    not there is shown as such."""
    with dashboard_process("--conductor", "127.0.0.1:1") as url:
        code, body, _ = get(url + "api/cluster")
        v = json.loads(body)
        assert code == 200 and v["title"] == "kvstore — 1 conductor"
        assert [(c["name"], c["status"]) for c in v["conductors"]] == [("127.0.0.1:1", "down")]


def test_cli_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    from kvstore.cli import main

    for args, needle in (
        ((), "--nodes"),
        (("--nodes", "nohost"), "HOST:PORT"),
        (("--nodes", "127.0.0.1:1", "--interval", "5"), "interval"),
        (("--nodes", "127.0.0.1:1", "--etcd", "127.0.0.1:2"), "one of the two"),
        (("--conductor", "nohost"), "--conductor"),
        (("--conductor", "127.0.0.1:1", "--listen", "nope"), "--listen"),
    ):
        assert main(["dashboard", *args]) == 2
        assert needle in capsys.readouterr().err

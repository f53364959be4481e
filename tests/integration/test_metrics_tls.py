"""``/metrics`` of a real TLS node is HTTPS, and the dashboard scrapes it.

A node with ``--tls-cert-file`` serves ``/metrics`` with the same certificate (its admin
token then never crosses the network in clear): plain HTTP to the metrics port is refused,
HTTPS with the CA works, the token is still required, and under mutual TLS a client without
a trusted certificate is refused.  ``--no-metrics-tls`` opts out.  The READY line and the
membership record say ``https://``, so the dashboard, given the CA (flags or
``KVSTORE_TLS_*``), scrapes TLS nodes found in etcd or named on its command line.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cluster_fixtures import etcd  # noqa: F401 - fixture
from conftest import ROOT, NodeProcess, clean_env, start_clean, stop_clean, wait_for
from tls_pki import PKI, other, pki  # noqa: F401 - fixtures

from kvstore.cluster.local_etcd import LocalEtcd
from kvstore.dashboard.scrape import fetch
from kvstore.dashboard.server import Dashboard, EtcdNodes, StaticNodes
from kvstore.tls import ClientTLS

TOKEN = "metrics-tls-s3cret"


def start_node(tmp: Path, *args: str, node_id: str | None = None) -> NodeProcess:
    (tmp / "token").parent.mkdir(parents=True, exist_ok=True)
    (tmp / "token").write_text(TOKEN)
    return start_clean(
        tmp / "node",
        "--dram",
        "4MiB",
        "--nvme",
        "0",
        "--metrics-port",
        "0",
        "--token-file",
        str(tmp / "token"),
        *args,
        node_id=node_id,
    )


stop_node = stop_clean


@pytest.fixture(scope="module")
def tls_node(tmp_path_factory: pytest.TempPathFactory, pki: PKI) -> Iterator[NodeProcess]:
    n = start_node(
        tmp_path_factory.mktemp("tls-metrics"), "--tls-cert-file", pki.server_cert, "--tls-key-file", pki.server_key
    )
    yield n
    stop_node(n)


@pytest.fixture(scope="module")
def mtls_node(tmp_path_factory: pytest.TempPathFactory, pki: PKI) -> Iterator[NodeProcess]:
    n = start_node(
        tmp_path_factory.mktemp("mtls-metrics"),
        "--tls-cert-file",
        pki.server_cert,
        "--tls-key-file",
        pki.server_key,
        "--tls-client-ca-file",
        pki.ca,
    )
    yield n
    stop_node(n)


def http_get(url: str, token: str = "") -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def statuses(d: Dashboard) -> dict[str, tuple[str, str]]:
    return {n["name"]: (n["status"], n.get("error", "")) for n in d.api(0)["nodes"]}


# -- the node ----------------------------------------------------------------------------------
def test_tls_node_serves_metrics_over_https_only(tls_node: NodeProcess, pki: PKI, other: PKI) -> None:
    url = tls_node.endpoints["metrics"]
    assert url.startswith("https://127.0.0.1:") and "metrics      https://" in "".join(tls_node.output)
    plain = "http://" + url.removeprefix("https://")
    # plain HTTP fails, even with the right token: the request is refused before it is served
    code, body = http_get(plain, TOKEN)
    assert code == 400 and b"serves HTTPS" in body
    assert not fetch(plain, token=TOKEN).ok
    # HTTPS: the CA works; the token is still required
    ca = ClientTLS.from_options(ca_file=pki.ca)
    s = fetch(url, token=TOKEN, tls=ca)
    assert s.ok and s.info["node_id"] == tls_node.node_id, s.error
    refused = fetch(url, tls=ca)
    assert not refused.ok and "HTTP 401" in refused.error
    assert "HTTP 401" in fetch(url, token="wrong", tls=ca).error
    # a client that does not trust the node's CA is refused before it sends the token
    for tls in (None, ClientTLS.from_options(ca_file=other.ca)):
        s = fetch(url, token=TOKEN, tls=tls)
        assert not s.ok and "CERTIFICATE_VERIFY_FAILED" in s.error and "--tls-ca-file" in s.error


def test_mtls_node_metrics_need_a_trusted_client_certificate(mtls_node: NodeProcess, pki: PKI, other: PKI) -> None:
    url = mtls_node.endpoints["metrics"]
    assert url.startswith("https://")
    no_cert = fetch(url, token=TOKEN, tls=ClientTLS.from_options(ca_file=pki.ca))
    assert not no_cert.ok and "--tls-cert-file" in no_cert.error
    stranger = ClientTLS.from_options(ca_file=pki.ca, cert_file=other.client_cert, key_file=other.client_key)
    assert not fetch(url, token=TOKEN, tls=stranger).ok
    client = ClientTLS.from_options(ca_file=pki.ca, cert_file=pki.client_cert, key_file=pki.client_key)
    assert "HTTP 401" in fetch(url, tls=client).error  # a certificate does not replace the token
    assert fetch(url, token=TOKEN, tls=client).ok
    assert http_get("http://" + url.removeprefix("https://"), TOKEN)[0] == 400


def test_metrics_tls_opt_out(tmp_path: Path, pki: PKI) -> None:
    n = start_node(tmp_path, "--tls-cert-file", pki.server_cert, "--tls-key-file", pki.server_key, "--no-metrics-tls")
    try:
        url = n.endpoints["metrics"]
        assert url.startswith("http://") and n.endpoints["tls"] == "on"
        assert fetch(url, token=TOKEN).ok
        assert "admin token in clear" in "".join(n.output)  # said at start, since the token now crosses in clear
    finally:
        stop_node(n)


# -- the dashboard -----------------------------------------------------------------------------
def test_dashboard_scrapes_tls_nodes_found_in_etcd(etcd: LocalEtcd, tmp_path: Path, pki: PKI) -> None:
    from kvstore.cluster.membership import Membership

    n = start_node(
        tmp_path,
        "--tls-cert-file",
        pki.server_cert,
        "--tls-key-file",
        pki.server_key,
        "--etcd",
        etcd.endpoint,
        "--cluster",
        "mtls",
        "--membership-ttl",
        "2",
        node_id="mtls-n1",
    )
    made: list[Dashboard] = []
    try:
        with Membership(etcd.endpoint, "mtls") as view:
            snap = view.wait_for(lambda s: "mtls-n1" in s.nodes, 15)
            assert snap is not None and snap.nodes["mtls-n1"].metrics == n.endpoints["metrics"]
            assert snap.nodes["mtls-n1"].metrics.startswith("https://")  # the record tells the dashboard the scheme
        d = Dashboard(
            EtcdNodes(etcd.endpoint, "mtls"),
            port=0,
            interval=0.2,
            token=TOKEN,
            tls=ClientTLS.from_options(ca_file=pki.ca),
        ).start()
        made.append(d)
        wait_for(lambda: statuses(d).get("mtls-n1", ("",))[0] == "up", 15, f"the TLS node scraped: {statuses(d)}")
        blind = Dashboard(EtcdNodes(etcd.endpoint, "mtls"), port=0, interval=0.2, token=TOKEN).start()  # no CA
        made.append(blind)
        status, error = wait_for(lambda: statuses(blind).get("mtls-n1"), 15, "the node listed")
        assert status == "down" and "--tls-ca-file" in error
    finally:
        for d in made:
            d.close()
        stop_node(n)


def test_dashboard_cli_scrapes_an_mtls_node(mtls_node: NodeProcess, pki: PKI, tmp_path: Path) -> None:
    """``--nodes HOST:PORT`` means https:// once a TLS option is given; the CA comes from
    ``KVSTORE_TLS_CA_FILE`` (how the deployments add it), the client certificate from flags."""
    (tmp_path / "token").write_text(TOKEN)
    hostport = mtls_node.endpoints["metrics"].split("/")[2]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvstore",
            "dashboard",
            "--nodes",
            hostport,
            "--listen",
            "127.0.0.1:0",
            "--interval",
            "0.5",
            "--token-file",
            str(tmp_path / "token"),
            "--tls-cert-file",
            pki.client_cert,
            "--tls-key-file",
            pki.client_key,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        env={**clean_env(), "KVSTORE_TLS_CA_FILE": pki.ca},
    )
    try:
        assert proc.stdout is not None
        line = wait_for(
            lambda: next((x for x in iter(proc.stdout.readline, "") if x.startswith("READY ")), None), 30, "READY"
        )
        url = json.loads(line[len("READY ") :])["url"] + "api/cluster"

        def node() -> dict[str, Any]:
            code, body = http_get(url, TOKEN)
            assert code == 200, body
            (x,) = json.loads(body)["nodes"]
            return x

        assert wait_for(lambda: node()["status"] == "up", 15, "the mTLS node scraped"), node()
        assert node()["url"].startswith("https://")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_static_https_endpoints(tls_node: NodeProcess, pki: PKI) -> None:
    d = Dashboard(
        StaticNodes([tls_node.endpoints["metrics"]]),
        port=0,
        interval=0.2,
        token=TOKEN,
        tls=ClientTLS.from_options(ca_file=pki.ca),
    )
    try:
        d.poll_once()
        ((status, error),) = statuses(d).values()
        assert status == "up", error
    finally:
        d.close()


def test_up_under_mutual_tls_keeps_its_dashboard_scraping(tmp_path: Path, pki: PKI) -> None:
    """``kvstore up`` holds no client certificate for its dashboard: under mutual TLS the
    nodes keep /metrics on plain HTTP (``--no-metrics-tls``) and the dashboard scrapes them."""
    from kvstore.cluster.local_etcd import find_etcd

    if find_etcd() is None:
        pytest.skip("etcd is not installed")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvstore",
            "up",
            "--nodes",
            "1",
            "--dram",
            "4MiB",
            "--nvme",
            "0",
            "--data-dir",
            str(tmp_path / "up"),
            "--tls-cert-file",
            pki.server_cert,
            "--tls-key-file",
            pki.server_key,
            "--tls-ca-file",
            pki.ca,
            "--tls-client-ca-file",
            pki.ca,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        env=clean_env(),
    )
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        line = wait_for(
            lambda: next(
                (x for x in iter(proc.stdout.readline, "") if lines.append(x) or x.startswith("READY ")), None
            ),
            120,
            "READY",
        )
        info = json.loads(line[len("READY ") :])
        assert info["tls"]["mutual"] and "/metrics stays plain HTTP" in "".join(lines)
        url = str(info["dashboard"]) + "api/cluster"

        def listed() -> list[dict[str, Any]]:
            code, body = http_get(url)
            assert code == 200, body
            return json.loads(body)["nodes"]

        wait_for(lambda: [n["status"] for n in listed()] == ["up"], 20, "the node scraped")
        assert listed()[0]["url"].startswith("http://")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(timeout=60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

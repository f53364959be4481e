"""``/metrics`` over TLS, in process: the config switch (``metrics_tls``: unset follows the
node's TLS, false opts out, true requires TLS), the HTTPS endpoint built on the node's own
server context (a plain-HTTP request is answered 400 without being served, a slow client
never blocks the accept loop), and the dashboard's scraper (``fetch``) with a CA, a client
certificate and a server name, and the hints it gives when one of those is wrong.
Real nodes and the dashboard against them: tests/integration/test_metrics_tls.py."""

from __future__ import annotations

import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from tls_pki import PKI, other, pki  # noqa: F401 - fixtures

from kvstore.cli import build_parser
from kvstore.dashboard.cli import tls_options
from kvstore.dashboard.scrape import fetch, metrics_url
from kvstore.errors import InvalidArgument
from kvstore.node.config import NodeConfig, load_config
from kvstore.node.ledger import Ledger
from kvstore.node.metrics import MetricsServer, NodeMetrics
from kvstore.tls import ClientTLS, ServerTLS

TOKEN = "metrics-s3cret"


def snapshot() -> dict[str, Any]:
    """An idle node's snapshot (as ``manager_snapshot`` builds it, without a manager)."""
    return {"counters": {}, "ledger": Ledger().snapshot(), "tiers": {}, "history": {"capacity": 0, "records": 0}}


def serve(ctx: Any, token: str = "") -> MetricsServer:
    m = NodeMetrics("n1", "0.0", snapshot)
    return MetricsServer("127.0.0.1", 0, m, token=token, ssl_context=ctx).start()


@pytest.fixture
def server(pki: PKI) -> Iterator[MetricsServer]:
    s = serve(ServerTLS.load(pki.server_cert, pki.server_key).context, TOKEN)
    yield s
    s.close()


@pytest.fixture
def mtls_server(pki: PKI) -> Iterator[MetricsServer]:
    s = serve(ServerTLS.load(pki.server_cert, pki.server_key, pki.ca).context)
    yield s
    s.close()


def url(s: MetricsServer, scheme: str = "https", host: str = "127.0.0.1") -> str:
    return f"{scheme}://{host}:{s.address[1]}/metrics"


# -- config ------------------------------------------------------------------------------------
def test_metrics_tls_follows_the_node_unless_opted_out(pki: PKI) -> None:
    tls = {"tls_cert_file": pki.server_cert, "tls_key_file": pki.server_key}
    assert not NodeConfig().serves_metrics_tls()
    assert NodeConfig(**tls).serves_metrics_tls()
    assert NodeConfig(**tls, metrics_tls=True).serves_metrics_tls()
    assert not NodeConfig(**tls, metrics_tls=False).serves_metrics_tls()
    # the file, the environment and the flag all reach it
    assert not load_config(
        environ={
            "KVSTORE_METRICS_TLS": "false",
            "KVSTORE_TLS_CERT_FILE": pki.server_cert,
            "KVSTORE_TLS_KEY_FILE": pki.server_key,
        }
    ).serves_metrics_tls()
    args = build_parser("serve").parse_args(["serve", "--no-metrics-tls"])
    assert args.metrics_tls is False and build_parser("serve").parse_args(["serve"]).metrics_tls is None
    with pytest.raises(InvalidArgument, match="metrics_tls = true needs tls_cert_file"):
        load_config(overrides={"metrics_tls": True})


def test_dashboard_tls_variables_are_not_node_settings(pki: PKI) -> None:
    """The dashboard's KVSTORE_TLS_* variables do not trip the node's unknown-variable check."""
    env = {
        "KVSTORE_TLS_CA_FILE": pki.ca,
        "KVSTORE_TLS_SERVER_NAME": "localhost",
        "KVSTORE_TLS_CLIENT_CERT_FILE": pki.client_cert,
        "KVSTORE_TLS_CLIENT_KEY_FILE": pki.client_key,
    }
    assert load_config(environ=env) == load_config(environ={})
    a = build_parser("dashboard").parse_args(["dashboard", "--nodes", "h:1", "--tls-server-name", "flag"])
    assert tls_options(a, env) == {
        "tls": False,
        "ca_file": pki.ca,
        "cert_file": pki.client_cert,
        "key_file": pki.client_key,
        "server_name": "flag",
    }  # a flag wins over its variable
    assert metrics_url("h:1") == "http://h:1/metrics" and metrics_url("h:1", "https") == "https://h:1/metrics"
    assert metrics_url("http://h:1", "https") == "http://h:1/metrics"  # a URL keeps its scheme


# -- the endpoint ------------------------------------------------------------------------------
def test_https_with_the_ca_and_the_token(server: MetricsServer, pki: PKI) -> None:
    s = fetch(url(server), token=TOKEN, tls=ClientTLS.from_options(ca_file=pki.ca))
    assert s.ok and s.info["node_id"] == "n1", s.error
    no_token = fetch(url(server), tls=ClientTLS.from_options(ca_file=pki.ca))
    assert not no_token.ok and "HTTP 401" in no_token.error and "--token-file" in no_token.error


def test_plain_http_to_the_https_port_is_refused_unserved(server: MetricsServer) -> None:
    req = urllib.request.Request(url(server, "http"), headers={"Authorization": f"Bearer {TOKEN}"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=5)
    assert e.value.code == 400 and b"serves HTTPS" in e.value.read()
    s = fetch(url(server, "http"), token=TOKEN)
    assert not s.ok and "HTTP 400" in s.error and "https://" in s.error


def test_untrusted_or_misnamed_certificates_fail_with_what_to_change(
    server: MetricsServer, pki: PKI, other: PKI
) -> None:
    system = fetch(url(server), token=TOKEN)  # the system roots do not know the test CA
    assert not system.ok and "--tls-ca-file" in system.error
    wrong = fetch(url(server), token=TOKEN, tls=ClientTLS.from_options(ca_file=other.ca))
    assert not wrong.ok and "--tls-ca-file" in wrong.error
    # the certificate names localhost and 127.0.0.1: another name fails, unless the name checked is overridden
    misnamed = ClientTLS.from_options(ca_file=pki.ca, server_name="elsewhere.example")
    bad = fetch(url(server), token=TOKEN, tls=misnamed)
    assert not bad.ok and "--tls-server-name" in bad.error
    named = ClientTLS.from_options(ca_file=pki.ca, server_name="localhost")
    assert fetch(url(server), token=TOKEN, tls=named).ok


def test_mutual_tls_needs_a_trusted_client_certificate(mtls_server: MetricsServer, pki: PKI, other: PKI) -> None:
    bare = fetch(url(mtls_server), tls=ClientTLS.from_options(ca_file=pki.ca))
    assert not bare.ok and "--tls-cert-file" in bare.error
    stranger = ClientTLS.from_options(ca_file=pki.ca, cert_file=other.client_cert, key_file=other.client_key)
    assert not fetch(url(mtls_server), tls=stranger).ok
    client = ClientTLS.from_options(ca_file=pki.ca, cert_file=pki.client_cert, key_file=pki.client_key)
    assert fetch(url(mtls_server), tls=client).ok


def test_a_silent_client_does_not_block_others(server: MetricsServer, pki: PKI) -> None:
    """Handshakes run on the connection's thread: a client that connects and says nothing
    (or a plain-text one) holds no one else up."""
    idle = [socket.create_connection(server.address) for _ in range(3)]
    try:
        t0 = time.monotonic()
        s = fetch(url(server), token=TOKEN, tls=ClientTLS.from_options(ca_file=pki.ca), timeout=5)
        assert s.ok and time.monotonic() - t0 < 3
    finally:
        for c in idle:
            c.close()


def test_plain_server_is_unchanged() -> None:
    s = serve(None)
    try:
        assert not s.tls and fetch(url(s, "http")).ok
    finally:
        s.close()


def test_close_does_not_wait_for_a_handshake(pki: PKI) -> None:
    s = serve(ServerTLS.load(pki.server_cert, pki.server_key).context)
    c = socket.create_connection(s.address)
    try:
        done = threading.Event()
        threading.Thread(target=lambda: (s.close(), done.set()), daemon=True).start()
        assert done.wait(3), "close waited on a client mid-handshake"
    finally:
        c.close()

"""TLS settings without a node: the config schema's rules, reading PEM files into server and
client material (every failure names the setting and the file), and the hints added to
connection errors.  The end-to-end behaviour is in tests/integration/test_tls.py."""

from __future__ import annotations

import socket
import ssl
import threading
from pathlib import Path

import pytest
from tls_pki import PKI, make_pki, other, pki  # noqa: F401 - fixtures

from kvstore.cli import build_parser
from kvstore.errors import InvalidArgument
from kvstore.node.config import load_config
from kvstore.tls import ClientTLS, ServerTLS, explain, secure_channel


# -- config ---------------------------------------------------------------------------------
def test_tls_is_off_by_default() -> None:
    cfg = load_config(environ={})
    assert (cfg.tls_cert_file, cfg.tls_key_file, cfg.tls_client_ca_file) == ("", "", "")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"tls_cert_file": "c.pem"}, "tls_cert_file is set but tls_key_file is not"),
        ({"tls_key_file": "k.pem"}, "tls_key_file is set but tls_cert_file is not"),
        ({"tls_client_ca_file": "ca.pem"}, "tls_client_ca_file (mutual TLS) needs tls_cert_file and tls_key_file"),
        ({"tls_key_file": "k.pem", "tls_client_ca_file": "ca.pem"}, "tls_key_file is set but tls_cert_file is not"),
    ],
)
def test_tls_settings_go_together(overrides: dict[str, str], message: str) -> None:
    with pytest.raises(InvalidArgument) as ei:
        load_config(environ={}, overrides=overrides)
    assert str(ei.value).startswith("invalid configuration: ") and message in str(ei.value)


def test_tls_settings_from_file_env_and_flags(tmp_path: Path) -> None:
    f = tmp_path / "node.toml"
    f.write_text('[node]\ntls_cert_file = "/etc/kvstore/tls/tls.crt"\ntls_key_file = "/etc/kvstore/tls/tls.key"\n')
    cfg = load_config(f, environ={"KVSTORE_TLS_CLIENT_CA_FILE": "/etc/kvstore/tls/ca.crt"})
    assert cfg.tls_cert_file.endswith("tls.crt") and cfg.tls_client_ca_file.endswith("ca.crt")
    # the flags reach the same fields (kvstore serve passes them as overrides)
    a = build_parser("serve").parse_args(
        ["serve", "--tls-cert-file", "c", "--tls-key-file", "k", "--tls-client-ca-file", "ca"]
    )
    assert (a.tls_cert_file, a.tls_key_file, a.tls_client_ca_file) == ("c", "k", "ca")
    cfg = load_config(f, environ={}, overrides={"tls_cert_file": "c", "tls_key_file": "k"})
    assert (cfg.tls_cert_file, cfg.tls_key_file) == ("c", "k")


def test_config_does_not_read_the_files() -> None:
    # the schema checks the shape; the node reads (and checks) the files at start-up
    cfg = load_config(
        environ={}, overrides={"tls_cert_file": "/nonexistent/c.pem", "tls_key_file": "/nonexistent/k.pem"}
    )
    with pytest.raises(InvalidArgument, match="cannot read tls_cert_file /nonexistent/c.pem"):
        ServerTLS.load(cfg.tls_cert_file, cfg.tls_key_file)


# -- server material ------------------------------------------------------------------------
def test_server_tls(pki: PKI) -> None:
    t = ServerTLS.load(pki.server_cert, pki.server_key)
    assert not t.mutual and t.context.verify_mode == ssl.CERT_NONE
    assert t.context.minimum_version == ssl.TLSVersion.TLSv1_2
    m = ServerTLS.load(pki.server_cert, pki.server_key, pki.ca)
    assert m.mutual and m.context.verify_mode == ssl.CERT_REQUIRED


def test_server_tls_errors_name_the_setting_and_file(tmp_path: Path, pki: PKI, other: PKI) -> None:
    junk = tmp_path / "junk.pem"
    junk.write_text("hello\n")
    cases = [
        ((str(tmp_path / "nope.pem"), pki.server_key), f"cannot read tls_cert_file {tmp_path / 'nope.pem'}"),
        ((pki.server_cert, str(tmp_path)), f"cannot read tls_key_file {tmp_path}"),
        ((str(junk), pki.server_key), f"tls_cert_file {junk} is not a PEM file"),
        ((pki.server_cert, str(junk)), f"tls_key_file {junk} is not a PEM file"),
        ((pki.server_cert, other.server_key), "are not a PEM certificate and its private key"),
        ((pki.server_key, pki.server_cert), "are not a PEM certificate and its private key"),
        (
            (pki.server_cert, pki.server_key, pki.server_key),
            f"tls_client_ca_file {pki.server_key} holds no usable PEM CA certificate",
        ),
        ((pki.server_cert, pki.server_key, str(junk)), f"tls_client_ca_file {junk} is not a PEM file"),
    ]
    for args, message in cases:
        with pytest.raises(InvalidArgument) as ei:
            ServerTLS.load(*args)
        assert message in str(ei.value), (args, str(ei.value))


# -- client material ------------------------------------------------------------------------
def test_client_tls_is_off_without_options() -> None:
    assert ClientTLS.from_options() is None
    assert ClientTLS.from_options(tls=False, ca_file=None, cert_file="", key_file=None) is None


def test_client_tls(pki: PKI) -> None:
    t = ClientTLS.from_options(ca_file=pki.ca)
    assert t is not None and t.ca == Path(pki.ca).read_bytes() and t.cert is None
    assert t.context.verify_mode == ssl.CERT_REQUIRED and t.context.check_hostname
    assert t.context.minimum_version == ssl.TLSVersion.TLSv1_2
    assert t.channel_options() == [] and "CA " + pki.ca == t.describe
    m = ClientTLS.from_options(ca_file=pki.ca, cert_file=pki.client_cert, key_file=pki.client_key, server_name="node-1")
    assert m is not None and m.cert and m.key and m.channel_options() == [("grpc.ssl_target_name_override", "node-1")]
    s = ClientTLS.from_options(tls=True)
    assert s is not None and s.ca is None and s.describe == "the system trust roots"


def test_client_tls_errors(tmp_path: Path, pki: PKI) -> None:
    with pytest.raises(InvalidArgument, match="tls_cert_file and tls_key_file go together"):
        ClientTLS.from_options(ca_file=pki.ca, cert_file=pki.client_cert)
    with pytest.raises(InvalidArgument, match="cannot read tls_ca_file"):
        ClientTLS.from_options(ca_file=str(tmp_path / "missing.pem"))
    with pytest.raises(InvalidArgument, match="are not a PEM certificate and its private key"):
        ClientTLS.from_options(ca_file=pki.ca, cert_file=pki.client_cert, key_file=pki.server_key)


def test_sdk_reads_tls_files_at_construction(tmp_path: Path) -> None:
    from client import AsyncKVClient, KVClient

    for cls in (KVClient, AsyncKVClient):
        with pytest.raises(InvalidArgument, match="cannot read tls_ca_file"):
            cls("127.0.0.1:1", tls_ca_file=str(tmp_path / "missing.pem"))


def test_unix_targets_stay_plaintext(pki: PKI) -> None:
    t = ClientTLS.from_options(ca_file=pki.ca)
    ch = secure_channel("unix:///tmp/nowhere.sock", t, [])
    try:
        assert type(ch).__name__ == "Channel"  # an insecure channel: nothing to wrap on a Unix socket
    finally:
        ch.close()


# -- hints on failed connections -------------------------------------------------------------
def test_explain(pki: PKI) -> None:
    tls = ClientTLS.from_options(ca_file=pki.ca)
    mtls = ClientTLS.from_options(ca_file=pki.ca, cert_file=pki.client_cert, key_file=pki.client_key)
    t = "10.0.0.5:50151"
    closed = "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:10.0.0.5:50151: Socket closed"
    assert "pass tls_ca_file=" in explain(closed, None, t)
    assert "requires a client certificate" in explain(closed, tls, t)
    assert "may not accept this client certificate" in explain(closed, mtls, t)
    verify = "Tls handshake failed (TSI_PROTOCOL_FAILURE): ... CERTIFICATE_VERIFY_FAILED: unable to get local issuer certificate"
    assert f"not signed by CA {pki.ca}" in explain(verify, tls, t)
    assert "does not serve TLS" in explain("SSL_ERROR_SSL: ... WRONG_VERSION_NUMBER", tls, t)
    alert = "data channel TLS error: [SSL: TLSV1_ALERT_UNKNOWN_CA] tlsv1 alert unknown ca (_ssl.c:2580)"
    assert "did not accept this client certificate" in explain(alert, mtls, t)
    assert "tls_server_name" in explain("Hostname Verification Check failed.", tls, t)
    # not a TLS problem, or not a TCP target: unchanged
    refused = "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:10.0.0.5:50151: Connection refused"
    assert explain(refused, None, t) == refused and explain(refused, tls, t) == refused
    assert explain(closed, None, "unix:///run/kvstore.sock") == closed


# -- TLS 1.2 cipher suites -------------------------------------------------------------------
CBC_SUITE = "ECDHE-ECDSA-AES128-SHA256"  # what OpenSSL's default list offered under TLS 1.2
GCM_SUITE = "ECDHE-ECDSA-AES128-GCM-SHA256"


def tls12_client(pki: PKI, suites: str) -> ssl.SSLContext:
    """A plain client context that trusts ``pki``, speaks TLS 1.2 only and offers only ``suites``."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(cafile=pki.ca)
    ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_ciphers(suites)
    return ctx


def handshake(server: ssl.SSLContext, client: ssl.SSLContext) -> tuple[str, str]:
    """Run a handshake over a socket pair; the (version, suite) the client got, or ``ssl.SSLError``."""
    a, b = socket.socketpair()
    a.settimeout(10)
    b.settimeout(10)
    refused: list[BaseException] = []

    def serve() -> None:
        try:
            with server.wrap_socket(a, server_side=True) as s:
                s.recv(1)  # until the client closes
        except (ssl.SSLError, OSError) as e:
            refused.append(e)

    t = threading.Thread(target=serve)
    t.start()
    try:
        with client.wrap_socket(b, server_hostname="localhost") as c:
            version, suite = c.version(), c.cipher()[0]
    finally:
        b.close()
        t.join(10)
        a.close()
    assert version is not None and not refused, refused
    return version, suite


def test_tls12_suites_are_aead_only_on_both_sides(pki: PKI) -> None:
    default_13 = {
        c["name"] for c in ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).get_ciphers() if c["protocol"] == "TLSv1.3"
    }
    for ctx in (
        ServerTLS.load(pki.server_cert, pki.server_key).context,
        ClientTLS.from_options(ca_file=pki.ca).context,
    ):
        suites = ctx.get_ciphers()
        tls12 = [c for c in suites if c["protocol"] == "TLSv1.2"]
        assert tls12 and all(c["aead"] and c["kea"] == "kx-ecdhe" for c in tls12), [c["name"] for c in tls12]
        assert {c["name"] for c in tls12} >= {GCM_SUITE, "ECDHE-ECDSA-CHACHA20-POLY1305", "ECDHE-RSA-AES128-GCM-SHA256"}
        assert {c["name"] for c in suites if c["protocol"] == "TLSv1.3"} == default_13  # TLS 1.3 defaults kept


def test_data_channel_accepted_cbc_suites_under_tls12_regression(pki: PKI) -> None:
    server = ServerTLS.load(pki.server_cert, pki.server_key).context
    # the node's side: a TLS 1.2 client offering only a CBC suite is refused; AES-GCM works
    with pytest.raises(ssl.SSLError):
        handshake(server, tls12_client(pki, CBC_SUITE))
    assert handshake(server, tls12_client(pki, GCM_SUITE)) == ("TLSv1.2", GCM_SUITE)
    # the SDK's side: it will not agree to a CBC suite either
    client = ClientTLS.from_options(ca_file=pki.ca)
    assert client is not None
    cbc_only = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    cbc_only.load_cert_chain(pki.server_cert, pki.server_key)
    cbc_only.maximum_version = ssl.TLSVersion.TLSv1_2
    cbc_only.set_ciphers(CBC_SUITE)
    with pytest.raises(ssl.SSLError):
        handshake(cbc_only, client.context)
    # and between the two, TLS 1.3 is still what they speak
    assert handshake(server, client.context)[0] == "TLSv1.3"

"""Throwaway TLS material (kvstore/local/ca.py, ``kvstore certs``) and the TLS flags of ``kvstore up``.

The certificates are checked the way they are used: the node's and the SDK's own TLS
contexts (kvstore/tls.py) complete a handshake over a socket pair, verifying the names
the certificate was made for and refusing others; mutual TLS with the client
certificate.  Without the ``cryptography`` package every entry point says what to
install.  ``kvstore up``'s flags are checked before anything starts.
"""

from __future__ import annotations

import socket
import ssl
import stat
import sys
import threading
from pathlib import Path

import pytest

from kvstore.cli import build_parser, main
from kvstore.errors import InvalidArgument
from kvstore.local.ca import CA_FILE, CERT_FILE, KEY_FILE, advertised_hosts, make, require_cryptography
from kvstore.tls import ClientTLS, ServerTLS


def handshake(server: ssl.SSLContext, client: ClientTLS, name: str) -> str:
    """Both sides of one TLS handshake over a socket pair, then a first record from the
    server; the client checks ``name``.  Either side's failure raises."""
    a, b = socket.socketpair()
    a.settimeout(10)
    b.settimeout(10)
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            with server.wrap_socket(a, server_side=True) as s:
                s.sendall(b"ok")
        except (ssl.SSLError, OSError) as e:
            errors.append(e)

    t = threading.Thread(target=serve)
    t.start()
    try:
        with client.wrap(b, name) as s:
            got, version = s.recv(2), str(s.version())
    finally:
        t.join(10)
        a.close()
        b.close()
    if errors:
        raise errors[0]
    assert got == b"ok"
    return version


def test_certificates_name_the_hosts_and_pass_the_node_and_sdk_contexts(tmp_path: Path) -> None:
    c = make(tmp_path / "pki", ["127.0.0.1", "node1", "*.kvstore.default.svc", "::1"], client=True)
    assert sorted(p.name for p in (tmp_path / "pki").iterdir()) == sorted(
        [CA_FILE, CERT_FILE, KEY_FILE, "client.crt", "client.key"]
    )
    for key in (c.key, c.client_key):  # the CA's key is never written; the others are private
        assert stat.S_IMODE(Path(str(key)).stat().st_mode) == 0o600
    node = ServerTLS.load(c.cert, c.key, c.ca)  # what `kvstore serve --tls-client-ca-file` loads
    assert node.mutual
    client = ClientTLS.from_options(ca_file=c.ca, cert_file=c.client_cert, key_file=c.client_key)
    assert client is not None
    for name in ("127.0.0.1", "node1", "n7.kvstore.default.svc", "::1"):
        assert handshake(node.context, client, name) in ("TLSv1.2", "TLSv1.3")
    with pytest.raises(ssl.SSLCertVerificationError, match="match|mismatch"):
        handshake(node.context, client, "node2")
    # a client that does not present the client certificate is refused under mutual TLS
    anonymous = ClientTLS.from_options(ca_file=c.ca)
    assert anonymous is not None
    with pytest.raises(ssl.SSLError, match="CERTIFICATE"):  # the server's verdict (or its alert, seen by the client)
        handshake(node.context, anonymous, "node1")
    # another throwaway CA is not trusted
    other = make(tmp_path / "other", ["node1"])
    with pytest.raises(ssl.SSLCertVerificationError, match="certificate verify failed"):
        handshake(ServerTLS.load(other.cert, other.key).context, anonymous, "node1")


@pytest.mark.parametrize(
    "hosts,error",
    [
        ([], "at least one host"),
        (["bad host"], "neither an IP address nor a DNS name"),
        (["a..b"], "neither an IP address nor a DNS name"),
    ],
)
def test_bad_hosts_are_refused(hosts: list[str], error: str, tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match=error):
        make(tmp_path, hosts)


def test_existing_files_are_not_overwritten_unless_asked(tmp_path: Path) -> None:
    first = make(tmp_path, ["node1"])
    before = Path(first.cert).read_bytes()
    with pytest.raises(InvalidArgument, match="already holds ca.crt, tls.crt, tls.key"):
        make(tmp_path, ["node1"])
    assert Path(first.cert).read_bytes() == before
    make(tmp_path, ["node1"], overwrite=True)
    assert Path(first.cert).read_bytes() != before


def test_advertised_hosts_follow_what_the_node_publishes() -> None:
    assert advertised_hosts("127.0.0.1") == ["127.0.0.1", "localhost"]
    assert advertised_hosts("10.0.0.5") == ["10.0.0.5"]
    assert advertised_hosts("[::1]") == ["::1", "localhost"]
    assert advertised_hosts("localhost") == ["localhost", "127.0.0.1", "::1"]
    wild = advertised_hosts("0.0.0.0")  # the node publishes its fully qualified name (kvstore/node/server.py)
    assert wild[0] == socket.getfqdn() and "127.0.0.1" in wild


def test_without_cryptography_every_entry_point_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for mod in [m for m in sys.modules if m == "cryptography" or m.startswith("cryptography.")]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setitem(sys.modules, "cryptography", None)  # import fails as if not installed
    with pytest.raises(InvalidArgument, match=r"kvstore up --tls .*pip install 'kvstore\[tls\]'"):
        require_cryptography("kvstore up --tls")
    with pytest.raises(InvalidArgument, match=r"'cryptography' package.*kvstore\[tls\]"):
        make(tmp_path, ["node1"])
    from kvstore.local.up import tls_files

    with pytest.raises(InvalidArgument, match=r"kvstore up --tls .*kvstore\[tls\]"):
        tls_files(build_parser("up").parse_args(["up", "--tls"]))
    assert main(["certs", "--out", str(tmp_path / "c"), "node1"]) == 2
    assert "kvstore[tls]" in capsys.readouterr().err and not (tmp_path / "c").exists()


def test_certs_command_writes_a_secret_ready_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tls"
    assert main(["certs", "--out", str(out), "--client", "node1", "127.0.0.1"]) == 0
    printed = capsys.readouterr().out
    assert (
        f"tls_ca_file={str((out / CA_FILE).absolute())!r}" in printed
        and "kubectl create secret generic kvstore-tls" in printed
    )
    c = ClientTLS.from_options(
        ca_file=str(out / CA_FILE), cert_file=str(out / "client.crt"), key_file=str(out / "client.key")
    )
    assert c is not None
    assert handshake(ServerTLS.load(str(out / CERT_FILE), str(out / KEY_FILE), str(out / CA_FILE)).context, c, "node1")
    assert main(["certs", "--out", str(out), "node1"]) == 2  # never overwrites keys
    assert "already holds" in capsys.readouterr().err


# -- `kvstore up`: TLS flags, checked before anything starts -----------------------------
def up_args(*argv: str) -> object:
    return build_parser("up").parse_args(["up", *argv])


@pytest.mark.parametrize(
    "argv,error",
    [
        (["--tls", "--tls-cert-file", "c.pem", "--tls-key-file", "k.pem"], "either --tls or --tls-cert-file"),
        (["--tls", "--tls-ca-file", "ca.pem"], "either --tls or --tls-cert-file"),
        (["--tls-ca-file", "ca.pem"], "need TLS"),
        (["--tls-client-ca-file", "ca.pem"], "need TLS"),
        (["--tls-cert-file", "c.pem"], "go together"),
        (
            ["--tls-cert-file", "/nonexistent/c.pem", "--tls-key-file", "/nonexistent/k.pem"],
            "cannot read tls_cert_file /nonexistent/c.pem",
        ),
    ],
)
def test_up_refuses_tls_flags_that_cannot_work(argv: list[str], error: str) -> None:
    from kvstore.local.up import tls_files

    with pytest.raises(InvalidArgument, match=error):
        tls_files(up_args(*argv))  # type: ignore[arg-type]


def test_up_passes_own_certificates_and_prints_what_clients_need(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvstore.local.up import client_snippet, tls_files

    assert tls_files(up_args()) is None  # type: ignore[arg-type]
    assert client_snippet("etcd://h:1/c", None) == "connect('etcd://h:1/c')"
    c = make(tmp_path / "pki", ["127.0.0.1"])
    monkeypatch.chdir(tmp_path)  # relative paths become absolute: the nodes run elsewhere
    own = tls_files(
        up_args("--tls-cert-file", "pki/tls.crt", "--tls-key-file", "pki/tls.key", "--tls-ca-file", "pki/ca.crt")
    )  # type: ignore[arg-type]
    assert own is not None and not own.generated
    assert own.node_args() == ["--tls-cert-file", c.cert, "--tls-key-file", c.key]
    assert client_snippet("etcd://h:1/c", own) == f"connect('etcd://h:1/c', tls_ca_file={c.ca!r})"
    mutual = tls_files(up_args("--tls-cert-file", c.cert, "--tls-key-file", c.key, "--tls-client-ca-file", c.ca))  # type: ignore[arg-type]
    assert mutual is not None and mutual.node_args()[-3:] == [
        "--tls-client-ca-file",
        c.ca,
        "--no-metrics-tls",
    ]  # no dashboard cert
    assert mutual.describe()["mutual"] and mutual.client_kwargs() == {
        "tls": True,
        "tls_cert_file": "CLIENT.crt",
        "tls_key_file": "CLIENT.key",
    }
    generated = tls_files(up_args("--tls"))  # type: ignore[arg-type]
    assert generated is not None and generated.generated and generated.cert_file == ""  # made when the cluster starts
    # a serve flag the nodes already get, given again through --node-arg, still parses (the last one wins)
    assert build_parser("serve").parse_args(["serve", *own.node_args(), "--tls-cert-file", "x"]).tls_cert_file == "x"

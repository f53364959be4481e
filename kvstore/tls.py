"""TLS for a node's TCP listeners and for the SDK's connections to them (architecture §10).

A node configured with ``tls_cert_file`` / ``tls_key_file`` serves gRPC on its TCP
listener with ``grpc.ssl_server_credentials`` and wraps every accepted data-channel
socket with the :class:`ssl.SSLContext` built here (TLS 1.2 or later); with
``tls_client_ca_file`` both require a client certificate signed by that CA (mutual
TLS).  The Unix socket stays plaintext: file permissions protect it, and local bytes
never cross it anyway (they move through the shared-memory arena).  Bearer tokens are
checked on top of TLS exactly as without it.

This module only reads PEM files, once, and builds credentials and contexts; it owns
no state.  What it returns belongs to the caller: the node's wiring function
(``kvstore/node/server.py``) holds one :class:`ServerTLS` for the node's life, and each
client holds one :class:`ClientTLS` (immutable, shared by its gRPC channel and its
data-channel pool; ``ssl.SSLContext`` is safe to use from several threads).

Every failure to read or parse a file is an :class:`~kvstore.errors.InvalidArgument`
that names the setting and the file, raised before anything listens or dials.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import socket
import ssl
from typing import Any

from kvstore.errors import InvalidArgument

log = logging.getLogger(__name__)

MIN_VERSION = ssl.TLSVersion.TLSv1_2
# TLS 1.2 suites for the data channel, both sides: forward-secret (ECDHE) and AEAD only
# (AES-GCM, ChaCha20-Poly1305), as gRPC's own default list is.  OpenSSL's default also
# offers CBC suites (ECDHE-*-AES*-SHA256/384: MAC-then-encrypt, the Lucky13 family) and
# DHE.  TLS 1.3 suites are all AEAD and are not affected by ``set_ciphers``.
TLS12_CIPHERS = "ECDHE+AESGCM:ECDHE+CHACHA20:!aNULL:!eNULL"


def read_pem(path: str, setting: str) -> bytes:
    """The bytes of a PEM file, or an ``InvalidArgument`` naming ``setting`` and the file."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise InvalidArgument(f"cannot read {setting} {path}: {e.strerror or e}") from None
    if b"-----BEGIN " not in data:
        raise InvalidArgument(f"{setting} {path} is not a PEM file (no '-----BEGIN' line)")
    return data


def _load_chain(ctx: ssl.SSLContext, cert_file: str, key_file: str, cert_setting: str, key_setting: str) -> None:
    try:
        ctx.load_cert_chain(cert_file, key_file)
    except ssl.SSLError as e:
        raise InvalidArgument(
            f"{cert_setting} {cert_file} and {key_setting} {key_file} are not a PEM certificate and its private key "
            f"({e.reason or e}); the key must be unencrypted and match the certificate"
        ) from None


def _load_roots(ctx: ssl.SSLContext, ca_file: str, setting: str) -> None:
    try:
        ctx.load_verify_locations(cafile=ca_file)
    except ssl.SSLError as e:
        raise InvalidArgument(f"{setting} {ca_file} holds no usable PEM CA certificate ({e.reason or e})") from None


@dataclasses.dataclass(frozen=True, slots=True)
class ServerTLS:
    """A node's TLS material: gRPC server credentials and the data channel's context."""

    credentials: Any  # grpc.ServerCredentials
    context: ssl.SSLContext
    mutual: bool  # client certificates are required and verified

    @classmethod
    def load(cls, cert_file: str, key_file: str, client_ca_file: str = "") -> ServerTLS:
        import grpc

        cert = read_pem(cert_file, "tls_cert_file")
        key = read_pem(key_file, "tls_key_file")
        mode = os.stat(key_file).st_mode & 0o777
        if mode & 0o007:  # anyone on the machine can read the node's private key and impersonate it
            log.warning(
                "tls_key_file %s is readable by other users (mode %04o): chmod 600 it (or 640 for a group)",
                key_file,
                mode,
            )
        ca = read_pem(client_ca_file, "tls_client_ca_file") if client_ca_file else None
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = MIN_VERSION
        ctx.set_ciphers(TLS12_CIPHERS)
        _load_chain(ctx, cert_file, key_file, "tls_cert_file", "tls_key_file")
        if ca is not None:
            _load_roots(ctx, client_ca_file, "tls_client_ca_file")
            ctx.verify_mode = ssl.CERT_REQUIRED
        creds = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)
        return cls(creds, ctx, ca is not None)


@dataclasses.dataclass(frozen=True, slots=True)
class ClientTLS:
    """What a client trusts and presents when it dials a node's TCP listeners.

    ``ca`` is None for the system's trust roots (gRPC's bundled roots for the control
    channel, OpenSSL's defaults for the data channel).  ``server_name``, if set, is the
    name checked against the node's certificate instead of the host dialled (for nodes
    reached by an address their certificate does not list).
    """

    ca: bytes | None
    cert: bytes | None
    key: bytes | None
    server_name: str
    context: ssl.SSLContext
    describe: str  # for error messages: where the trust roots came from

    @classmethod
    def from_options(
        cls,
        *,
        tls: bool = False,
        ca_file: str | None = None,
        cert_file: str | None = None,
        key_file: str | None = None,
        server_name: str | None = None,
    ) -> ClientTLS | None:
        """None when no option asks for TLS (a plaintext client, as before)."""
        if not (tls or ca_file or cert_file or key_file or server_name):
            return None
        if bool(cert_file) != bool(key_file):
            raise InvalidArgument(
                "tls_cert_file and tls_key_file go together (a client certificate needs its key); pass both or neither"
            )
        ca = read_pem(ca_file, "tls_ca_file") if ca_file else None
        cert = read_pem(cert_file, "tls_cert_file") if cert_file else None
        key = read_pem(key_file, "tls_key_file") if key_file else None
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies the certificate and the host name
        ctx.minimum_version = MIN_VERSION
        ctx.set_ciphers(TLS12_CIPHERS)
        if ca_file:
            _load_roots(ctx, ca_file, "tls_ca_file")
        else:
            ctx.load_default_certs()
        if cert_file and key_file:
            _load_chain(ctx, cert_file, key_file, "tls_cert_file", "tls_key_file")
        return cls(ca, cert, key, server_name or "", ctx, f"CA {ca_file}" if ca_file else "the system trust roots")

    def channel_credentials(self) -> Any:
        import grpc

        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )

    def channel_options(self) -> list[tuple[str, Any]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []

    def wrap(self, sock: socket.socket, host: str) -> ssl.SSLSocket:
        """Handshake on a connected socket (under its current timeout); raises ``ssl.SSLError``/``OSError``."""
        return self.context.wrap_socket(sock, server_hostname=self.server_name or host)


def secure_channel(target: str, tls: ClientTLS | None, options: list[tuple[str, Any]], *, aio: bool = False) -> Any:
    """A gRPC channel to ``target``: TLS when ``tls`` is set and the target is TCP, else plaintext.

    Unix-socket targets are always plaintext: the node never serves TLS there."""
    import grpc

    mod = grpc.aio if aio else grpc
    if tls is None or target.startswith("unix:"):
        return mod.insecure_channel(target, options=options)
    return mod.secure_channel(target, tls.channel_credentials(), options=[*options, *tls.channel_options()])


def explain(message: str, tls: ClientTLS | None, target: str) -> str:
    """A failed connection's message plus what to check, when TLS is the likely cause.

    gRPC reports a handshake failure as UNAVAILABLE with a terse, transport-level detail
    (``Socket closed``, ``Ssl handshake failed``); this names the setting to change."""
    if target.startswith("unix:"):
        return message
    low = message.lower()
    closed = any(
        s in low for s in ("socket closed", "connection reset", "end of file", "eof occurred", "unexpected eof")
    )
    if tls is None:
        if closed:
            return (
                f"{message} (a node that serves TLS closes plaintext connections: if {target} uses TLS, "
                "pass tls_ca_file= / --tls-ca-file, and a client certificate if it requires one)"
            )
        return message
    if (
        "wrong_version_number" in low
        or "wrong version number" in low
        or "packet length too long" in low
        or "record layer failure" in low
        or "http request" in low
    ):
        return f"{message} (the node at {target} does not serve TLS: drop the TLS options, or start the node with tls_cert_file and tls_key_file)"
    if (
        "alert unknown ca" in low or "alert bad certificate" in low or "alert_unknown_ca" in low
    ):  # the node's verdict on ours
        return (
            f"{message} (the node did not accept this client certificate: it must be signed by the CA in the "
            "node's tls_client_ca_file)"
        )
    if (
        "certificate verify failed" in low
        or "certificate_verify_failed" in low
        or "self signed" in low
        or "self-signed" in low
        or "unable to get local issuer" in low
    ):
        return f"{message} (the node's certificate is not signed by {tls.describe}: pass the CA that signed it as tls_ca_file=)"
    if "hostname" in low or "ip address mismatch" in low or "doesn't match" in low:
        if tls.server_name:
            return f"{message} (the node's certificate does not name {tls.server_name!r}, the tls_server_name given)"
        return f"{message} (the node's certificate does not name the host dialled in {target}: dial a name it lists, or pass tls_server_name=)"
    if "certificate required" in low or "peer did not return a certificate" in low or (closed and tls.cert is None):
        return (
            f"{message} (the node closed the TLS handshake: it requires a client certificate; "
            "pass tls_cert_file= and tls_key_file= signed by the CA in its tls_client_ca_file)"
        )
    if closed or "ssl" in low or "handshake" in low or "bad certificate" in low:
        return (
            f"{message} (the TLS handshake with {target} failed: the node may not accept this client certificate "
            "(it must be signed by the CA in the node's tls_client_ca_file), or check tls_ca_file=)"
        )
    return message


# -- command-line flags shared by every command that dials a node -----------------------------
def add_client_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("TLS (host:port targets of a node started with --tls-cert-file)")
    g.add_argument("--tls-ca-file", metavar="FILE", help="PEM CA certificate(s) that signed the node's certificate")
    g.add_argument(
        "--tls-cert-file", metavar="FILE", help="PEM client certificate, for nodes that require one (mutual TLS)"
    )
    g.add_argument("--tls-key-file", metavar="FILE", help="PEM private key of --tls-cert-file")
    g.add_argument(
        "--tls-server-name", metavar="NAME", help="name to verify in the node's certificate (default: the host dialled)"
    )
    g.add_argument(
        "--tls",
        action="store_true",
        default=False,
        help="use TLS with the system trust roots (implied by the flags above)",
    )


def client_kwargs(a: argparse.Namespace) -> dict[str, Any]:
    """The SDK keyword arguments (``KVClient(..., **client_kwargs(args))``) for the flags above."""
    return {
        "tls": bool(getattr(a, "tls", False)),
        "tls_ca_file": getattr(a, "tls_ca_file", None),
        "tls_cert_file": getattr(a, "tls_cert_file", None),
        "tls_key_file": getattr(a, "tls_key_file", None),
        "tls_server_name": getattr(a, "tls_server_name", None),
    }

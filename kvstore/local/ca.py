"""Throwaway TLS material for trying TLS: a private CA and the certificates it signs.

``kvstore up --tls`` makes one for its nodes, and ``kvstore certs --out DIR HOST...`` writes
one for compose, a test cluster or a Kubernetes Secret.  The files carry the names of a
Kubernetes TLS Secret: ``ca.crt`` (the CA that clients trust, and that signs client
certificates under mutual TLS), ``tls.crt`` / ``tls.key`` (the node's certificate, naming
every host given, and its key) and, on request, ``client.crt`` / ``client.key``.  So
``kubectl create secret generic kvstore-tls --from-file=DIR`` takes a directory as is.

Made with the ``cryptography`` package, which is an optional dependency (the ``tls``
extra: ``pip install 'kvstore[tls]'``): nothing else in kvstore needs it, since the node and
the SDK only read PEM files (``kvstore/tls.py``), and production certificates come from a
real CA (cert-manager, a corporate PKI).  Without it these functions raise an
``InvalidArgument`` that says what to install and how to do without.

P-256 keys; private keys are written mode 0600.  The CA's own private key is never
written: once this returns, the CA can sign nothing else, so a leaked run directory
exposes at most the certificates it holds.  Owns no state.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import ipaddress
import os
import socket
import sys
from pathlib import Path
from typing import Any

from kvstore.errors import InvalidArgument

CA_FILE, CERT_FILE, KEY_FILE = "ca.crt", "tls.crt", "tls.key"
CLIENT_CERT_FILE, CLIENT_KEY_FILE = "client.crt", "client.key"
INSTALL_HINT = "pip install 'kvstore[tls]' (or pip install cryptography)"


@dataclasses.dataclass(frozen=True)
class Certificates:
    """Paths (``str``, as the node's flags and the SDK take them) of one CA's PEM files."""

    ca: str
    cert: str
    key: str
    hosts: tuple[str, ...]
    client_cert: str | None = None
    client_key: str | None = None


def require_cryptography(purpose: str) -> Any:
    """The ``cryptography`` package, or an ``InvalidArgument`` naming ``purpose`` and the fix."""
    try:
        import cryptography.x509 as x509
    except ImportError:
        raise InvalidArgument(
            f"{purpose} makes a throwaway CA with the 'cryptography' package, which is not installed: {INSTALL_HINT}"
        ) from None
    return x509


def advertised_hosts(host: str) -> list[str]:
    """The names a node bound to ``host`` is dialled by: what it publishes (the host itself,
    or the machine's name for a wildcard address, as ``kvstore serve`` does) plus loopback."""
    h = host.strip().strip("[]")
    if h in ("", "0.0.0.0", "::"):
        names = [socket.getfqdn(), socket.gethostname(), "localhost", "127.0.0.1", "::1"]
    else:
        names = [h]
        try:
            if ipaddress.ip_address(h).is_loopback:
                names.append("localhost")
        except ValueError:
            if h == "localhost":
                names += ["127.0.0.1", "::1"]
    return list(dict.fromkeys(n for n in names if n))


def _general_name(x509: Any, name: str) -> Any:
    try:
        return x509.IPAddress(ipaddress.ip_address(name.strip("[]")))
    except ValueError:
        pass
    label = name.removeprefix("*.")
    if (
        not label
        or any(not part or len(part) > 63 for part in label.split("."))
        or not all(c.isalnum() or c in "-." for c in label)
        or not name.isascii()
    ):
        raise InvalidArgument(f"{name!r} is neither an IP address nor a DNS name a certificate can hold")
    return x509.DNSName(name)


def make(
    directory: str | os.PathLike[str],
    hosts: list[str] | tuple[str, ...],
    *,
    name: str = "kvstore",
    client: bool = False,
    days: int = 90,
    overwrite: bool = False,
) -> Certificates:
    """A fresh CA, a node certificate for ``hosts`` (DNS names, ``*.`` wildcards or IP
    addresses) and, with ``client``, a client certificate, written under ``directory``."""
    x509 = require_cryptography("making TLS certificates")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    if not hosts:
        raise InvalidArgument("a node certificate needs at least one host name or address (the ones clients dial)")
    if days < 1:
        raise InvalidArgument(f"certificates must be valid for at least one day, got {days}")
    sans = [_general_name(x509, h) for h in dict.fromkeys(hosts)]
    out = Path(directory)
    names = [CA_FILE, CERT_FILE, KEY_FILE] + ([CLIENT_CERT_FILE, CLIENT_KEY_FILE] if client else [])
    existing = [n for n in names if (out / n).exists()]
    if existing and not overwrite:
        raise InvalidArgument(f"{out} already holds {', '.join(existing)}: remove them, or choose another directory")

    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} throwaway CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    def leaf(cn: str, usage: Any, alt: list[Any]) -> tuple[bytes, bytes]:
        key = ec.generate_private_key(ec.SECP256R1())
        b = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        )
        if alt:
            b = b.add_extension(x509.SubjectAlternativeName(alt), critical=False)
        cert = b.sign(ca_key, hashes.SHA256())
        return (
            cert.public_bytes(serialization.Encoding.PEM),
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            ),
        )

    files = {CA_FILE: ca.public_bytes(serialization.Encoding.PEM)}
    files[CERT_FILE], files[KEY_FILE] = leaf(f"{name} node", ExtendedKeyUsageOID.SERVER_AUTH, sans)
    if client:
        files[CLIENT_CERT_FILE], files[CLIENT_KEY_FILE] = leaf(f"{name} client", ExtendedKeyUsageOID.CLIENT_AUTH, [])
    out.mkdir(parents=True, exist_ok=True)
    for fname, data in files.items():
        path = out / fname
        private = fname.endswith(".key")
        # a key is never readable by others, not even for an instant
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        if private:
            path.chmod(0o600)
    p = lambda f: str((out / f).absolute())  # noqa: E731
    return Certificates(
        ca=p(CA_FILE),
        cert=p(CERT_FILE),
        key=p(KEY_FILE),
        hosts=tuple(dict.fromkeys(hosts)),
        client_cert=p(CLIENT_CERT_FILE) if client else None,
        client_key=p(CLIENT_KEY_FILE) if client else None,
    )


# -- `kvstore certs` ------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Write a throwaway CA and a node certificate it signed, for trying TLS (compose, a test cluster, a "
        "Kubernetes Secret): ca.crt, tls.crt, tls.key (and client.crt, client.key with --client). "
        "Production certificates should come from a real CA. Needs the 'cryptography' package "
        "(pip install 'kvstore[tls]')."
    )
    p.add_argument(
        "hosts",
        nargs="+",
        metavar="HOST",
        help="every name or address clients dial the nodes by (DNS names, *.wildcards, IP addresses)",
    )
    p.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="directory for the PEM files (created; existing files are not overwritten)",
    )
    p.add_argument(
        "--client", action="store_true", help="also a client certificate (client.crt, client.key) for mutual TLS"
    )
    p.add_argument("--days", type=int, default=90, metavar="N", help="validity in days (default 90)")
    p.add_argument("--name", default="kvstore", help="common-name prefix of the certificates (default 'kvstore')")


def main(a: argparse.Namespace) -> int:
    c = make(a.out, a.hosts, name=a.name, client=a.client, days=a.days)
    out = Path(a.out)
    print(f"kvstore certs: a throwaway CA and a node certificate for {', '.join(c.hosts)}, valid {a.days} days")
    for label, path in (
        ("CA", c.ca),
        ("certificate", c.cert),
        ("key", c.key),
        ("client cert", c.client_cert),
        ("client key", c.client_key),
    ):
        if path:
            print(f"  {label:<12} {path}")
    print(
        f"  node         kvstore serve --tls-cert-file {c.cert} --tls-key-file {c.key}"
        + (f" --tls-client-ca-file {c.ca}" if a.client else "")
    )
    mutual = f", tls_cert_file={c.client_cert!r}, tls_key_file={c.client_key!r}" if a.client else ""
    print(f"  SDK          KVClient('{c.hosts[0]}:50151', tls_ca_file={c.ca!r}{mutual})")
    print(
        f"  Kubernetes   kubectl create secret generic kvstore-tls --from-file={out / CA_FILE} "
        f"--from-file={out / CERT_FILE} --from-file={out / KEY_FILE}"
    )
    print("  the CA's private key was not kept: it can sign nothing else", file=sys.stderr)
    return 0

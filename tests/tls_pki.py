"""Throwaway TLS material for tests: a CA, a server certificate and a client certificate.

Generated with the ``cryptography`` package (the ``test`` extra) into a directory the test
owns; P-256 keys (fast to make), valid from five minutes ago for one day.  Nothing here is
used by the product: the node and the SDK only ever read PEM files.
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclasses.dataclass(frozen=True)
class PKI:
    """Paths of one CA's PEM files (``str``, as the SDK and the flags take them)."""

    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def make_pki(
    directory: Path, name: str = "kvstore-test", *, server_names: tuple[str, ...] = ("localhost", "127.0.0.1")
) -> PKI:
    """A CA, a server certificate for ``server_names`` (DNS names or IP addresses) and a
    client certificate, all signed by the CA, written as PEM files under ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=1)
    ca_key = _key()
    ca_name = _name(f"{name} CA")
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
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

    def leaf(
        cn: str, usage: x509.ObjectIdentifier, sans: list[x509.GeneralName]
    ) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        key = _key()
        b = (
            x509.CertificateBuilder()
            .subject_name(_name(cn))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        )
        if sans:
            b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return b.sign(ca_key, hashes.SHA256()), key

    def general_name(n: str) -> x509.GeneralName:
        try:
            return x509.IPAddress(ipaddress.ip_address(n))
        except ValueError:
            return x509.DNSName(n)

    server, server_key = leaf(f"{name} node", ExtendedKeyUsageOID.SERVER_AUTH, [general_name(n) for n in server_names])
    client, client_key = leaf(f"{name} client", ExtendedKeyUsageOID.CLIENT_AUTH, [])

    def cert_pem(c: x509.Certificate) -> bytes:
        return c.public_bytes(serialization.Encoding.PEM)

    def key_pem(k: ec.EllipticCurvePrivateKey) -> bytes:
        return k.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    files = {
        "ca.pem": cert_pem(ca),
        "server.pem": cert_pem(server),
        "server.key": key_pem(server_key),
        "client.pem": cert_pem(client),
        "client.key": key_pem(client_key),
    }
    for fname, data in files.items():
        (directory / fname).write_bytes(data)
        (directory / fname).chmod(0o600)
    p = lambda f: str(directory / f)  # noqa: E731
    return PKI(
        ca=p("ca.pem"),
        server_cert=p("server.pem"),
        server_key=p("server.key"),
        client_cert=p("client.pem"),
        client_key=p("client.key"),
    )


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    """A CA with a server certificate (localhost, 127.0.0.1) and a client certificate."""
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def other(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    """A second CA and certificates it signed: trusted by nobody in the tests."""
    return make_pki(tmp_path_factory.mktemp("pki-other"), "intruder")

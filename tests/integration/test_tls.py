"""TLS on a real node's TCP listeners (gRPC and the data channel), with and without mutual TLS.

A throwaway CA signs the node's certificate (SAN 127.0.0.1 and localhost) and a client
certificate; a second CA signs look-alikes nobody trusts.  Covered: payload bytes round
trip over TLS gRPC + the TLS data channel (sync, async, cluster); the data port speaks
only TLS; clients that do not trust the node, plaintext clients against a TLS node and
TLS clients against a plaintext node fail fast with errors that say what to change;
bearer tokens are still required over TLS; the Unix socket stays plaintext; mutual TLS
refuses clients without a trusted certificate; the CLI's ``--tls-*`` flags; and start-up
refuses bad TLS settings with a clear message and a non-zero exit.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import ROOT, NodeProcess, clean_env, start_clean, stop_clean
from tls_pki import PKI, other, pki  # noqa: F401 - fixtures

from client import AsyncKVClient, KVClient, Timeouts, Unauthenticated, Unavailable
from client._transports import DataChannel
from kvstore.node.datachannel import OP_GET, REQUEST, REQUEST_MAGIC

TOKEN = "tls-s3cret"
# long deadlines: a client that hung instead of failing would take 20 s; failing takes well under FAST_S
PATIENT = Timeouts(rpc=20.0, data=20.0, connect=20.0)
FAST_S = 5.0


def start_node(tmp: Path, *args: str) -> NodeProcess:
    return start_clean(tmp / "node", "--dram", "64MiB", "--nvme", "0", *args)


stop_node = stop_clean


@pytest.fixture(scope="module")
def tls_node(tmp_path_factory: pytest.TempPathFactory, pki: PKI) -> Iterator[NodeProcess]:
    """TLS on TCP, bearer token required."""
    tmp = tmp_path_factory.mktemp("tlsnode")
    (tmp / "token").write_text(TOKEN)
    n = start_node(
        tmp, "--tls-cert-file", pki.server_cert, "--tls-key-file", pki.server_key, "--token-file", str(tmp / "token")
    )
    yield n
    stop_node(n)


@pytest.fixture(scope="module")
def mtls_node(tmp_path_factory: pytest.TempPathFactory, pki: PKI) -> Iterator[NodeProcess]:
    """TLS on TCP with client certificates required (signed by ``pki.ca``); no token."""
    n = start_node(
        tmp_path_factory.mktemp("mtlsnode"),
        "--tls-cert-file",
        pki.server_cert,
        "--tls-key-file",
        pki.server_key,
        "--tls-client-ca-file",
        pki.ca,
    )
    yield n
    stop_node(n)


@pytest.fixture(autouse=True)
def no_token_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSTORE_TOKEN", raising=False)
    monkeypatch.delenv("KVSTORE_TOKEN_FILE", raising=False)


def data_port(n: NodeProcess) -> tuple[str, int]:
    host, port = n.endpoints["data"].rsplit(":", 1)
    return host, int(port)


def payloads() -> list[bytes]:
    rng = np.random.default_rng(7)
    # small, odd-sized and multi-megabyte: many TLS records per block, none aligned
    return [rng.integers(0, 256, size=n, dtype=np.uint8).tobytes() for n in (1, 70_001, (3 << 20) + 17, 8 << 20)]


def round_trip(kv: KVClient) -> None:
    datas = payloads()
    keys = [os.urandom(16) for _ in datas]
    assert kv.put_many(keys, datas) == [True] * len(keys)
    assert kv.get_many(keys) == datas
    outs = [np.empty(len(d), np.uint8) for d in datas]
    assert kv.get_many_into(keys, outs) == [len(d) for d in datas]
    assert all(o.tobytes() == d for o, d in zip(outs, datas))
    big = np.frombuffer(datas[-1], np.uint8)
    k = os.urandom(16)
    assert kv.put(k, big) and kv.get(k) == datas[-1]
    out = np.zeros_like(big)
    assert kv.get_into(k, out) == big.nbytes and np.array_equal(out, big)
    assert kv.delete(keys + [k]) == len(keys) + 1


def assert_tls_data_channel(kv: KVClient) -> None:
    """The bytes above moved over the data channel, on TLS sockets (the pool keeps them)."""
    transport = kv._core.transport
    assert isinstance(transport, DataChannel) and transport.pool is not None and transport.pool._idle
    for s in transport.pool._idle:
        assert isinstance(s, ssl.SSLSocket) and s.version() in ("TLSv1.2", "TLSv1.3")


# -- TLS, one-way ---------------------------------------------------------------------------
def test_round_trip_over_tls(tls_node: NodeProcess, pki: PKI) -> None:
    assert tls_node.endpoints["tls"] == "on"
    assert "(TLS)" in "".join(tls_node.output)
    with KVClient(tls_node.tcp, token=TOKEN, tls_ca_file=pki.ca) as kv:
        round_trip(kv)
        assert_tls_data_channel(kv)
        assert kv.stats()["node_id"] == tls_node.node_id
    # the certificate names localhost too
    host_port = "localhost:" + tls_node.tcp.rsplit(":", 1)[1]
    with KVClient(host_port, token=TOKEN, tls_ca_file=pki.ca) as kv:
        k = os.urandom(16)
        assert kv.put(k, b"by name") and kv.get(k) == b"by name"


def test_async_round_trip_over_tls(tls_node: NodeProcess, pki: PKI) -> None:
    async def main() -> None:
        async with AsyncKVClient(tls_node.tcp, token=TOKEN, tls_ca_file=pki.ca) as kv:
            datas = payloads()
            keys = [os.urandom(16) for _ in datas]
            assert await kv.put_many(keys, datas) == [True] * len(keys)
            assert await kv.get_many(keys) == datas
            out = np.empty(len(datas[2]), np.uint8)
            assert await kv.get_into(keys[2], out) == len(datas[2]) and out.tobytes() == datas[2]

    asyncio.run(main())


def test_grpc_stream_fallback_over_tls(tls_node: NodeProcess, pki: PKI) -> None:
    with KVClient(tls_node.tcp, token=TOKEN, tls_ca_file=pki.ca, transport="grpc-stream") as kv:
        k, data = os.urandom(16), os.urandom(3 << 20)
        assert kv.put(k, data) and kv.get(k) == data


def test_bearer_token_still_required_over_tls(tls_node: NodeProcess, pki: PKI) -> None:
    for token in (None, "wrong"):
        with KVClient(tls_node.tcp, token=token, tls_ca_file=pki.ca) as kv:
            with pytest.raises(Unauthenticated, match="token"):
                kv.put(os.urandom(16), b"x")
            with pytest.raises(Unauthenticated):
                kv.get(os.urandom(16))


def test_unix_socket_stays_plaintext(tls_node: NodeProcess, pki: PKI) -> None:
    with KVClient(tls_node.unix, token=TOKEN) as kv:
        round_trip(kv)
    with KVClient(tls_node.unix, token=TOKEN, tls_ca_file=pki.ca) as kv:  # TLS settings do not apply to unix://
        k = os.urandom(16)
        assert kv.put(k, b"local") and kv.get(k) == b"local"


def test_data_port_speaks_only_tls(tls_node: NodeProcess, pki: PKI) -> None:
    host, port = data_port(tls_node)
    ctx = ssl.create_default_context(cafile=pki.ca)
    with socket.create_connection((host, port), timeout=FAST_S) as raw, ctx.wrap_socket(raw, server_hostname=host) as s:
        assert s.version() in ("TLSv1.2", "TLSv1.3")
        # an unknown transfer id inside TLS: closed at once, like in plaintext
        s.sendall(REQUEST.pack(REQUEST_MAGIC, OP_GET, os.urandom(16)))
        assert s.recv(8) == b""
    # a plaintext request frame is not a TLS ClientHello: the node closes without answering
    t0 = time.monotonic()
    with socket.create_connection((host, port), timeout=FAST_S) as s:
        s.sendall(REQUEST.pack(REQUEST_MAGIC, OP_GET, os.urandom(16)))
        try:
            got = s.recv(64)
        except ConnectionResetError:
            got = b""
    assert not got.startswith(b"KVDS") and time.monotonic() - t0 < FAST_S


def test_data_port_accepted_tls12_cbc_suites_regression(tls_node: NodeProcess, pki: PKI) -> None:
    """Under TLS 1.2 the data channel agreed to CBC suites (OpenSSL's default list); now only
    ECDHE with AES-GCM or ChaCha20-Poly1305, like gRPC's listener (checked here too)."""
    host, port = data_port(tls_node)
    grpc_host, grpc_port = tls_node.tcp.rsplit(":", 1)

    def tls12(suite: str, alpn: list[str] | None = None) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=pki.ca)
        ctx.maximum_version = ssl.TLSVersion.TLSv1_2
        ctx.set_ciphers(suite)
        if alpn:
            ctx.set_alpn_protocols(alpn)
        return ctx

    for h, p, alpn in ((host, port, None), (grpc_host, int(grpc_port), ["h2"])):
        with socket.create_connection((h, p), timeout=FAST_S) as raw:
            with pytest.raises((ssl.SSLError, ConnectionError)):
                tls12("ECDHE-ECDSA-AES128-SHA256", alpn).wrap_socket(raw, server_hostname=h)
        with (
            socket.create_connection((h, p), timeout=FAST_S) as raw,
            tls12("ECDHE-ECDSA-AES128-GCM-SHA256", alpn).wrap_socket(raw, server_hostname=h) as s,
        ):
            assert (s.version(), s.cipher()[0]) == ("TLSv1.2", "ECDHE-ECDSA-AES128-GCM-SHA256")
    # the data channel works over such a connection
    with (
        socket.create_connection((host, port), timeout=FAST_S) as raw,
        tls12("ECDHE-ECDSA-AES128-GCM-SHA256").wrap_socket(raw, server_hostname=host) as s,
    ):
        s.sendall(REQUEST.pack(REQUEST_MAGIC, OP_GET, os.urandom(16)))  # an unknown id: closed at once
        assert s.recv(8) == b""


def test_plaintext_client_against_tls_node_fails_fast(tls_node: NodeProcess) -> None:
    t0 = time.monotonic()
    with KVClient(tls_node.tcp, token=TOKEN, timeouts=PATIENT) as kv:
        with pytest.raises(Unavailable, match="tls_ca_file"):
            kv.get(os.urandom(16))
    assert time.monotonic() - t0 < FAST_S


@pytest.mark.parametrize("trust", ["system-roots", "other-ca"])
def test_client_that_does_not_trust_the_node_is_rejected(tls_node: NodeProcess, other: PKI, trust: str) -> None:
    kw: dict[str, Any] = {"tls": True} if trust == "system-roots" else {"tls_ca_file": other.ca}
    t0 = time.monotonic()
    with KVClient(tls_node.tcp, token=TOKEN, timeouts=PATIENT, **kw) as kv:
        with pytest.raises(Unavailable, match="CERTIFICATE_VERIFY_FAILED.*not signed by"):
            kv.put(os.urandom(16), b"x")
    assert time.monotonic() - t0 < FAST_S

    async def main() -> None:
        async with AsyncKVClient(tls_node.tcp, token=TOKEN, timeouts=PATIENT, **kw) as kv:
            with pytest.raises(Unavailable, match="not signed by"):
                await kv.get(os.urandom(16))

    asyncio.run(main())


def test_certificate_must_name_the_host(tls_node: NodeProcess, pki: PKI) -> None:
    with KVClient(
        tls_node.tcp, token=TOKEN, tls_ca_file=pki.ca, tls_server_name="elsewhere.example", timeouts=PATIENT
    ) as kv:
        with pytest.raises(Unavailable, match="elsewhere.example"):
            kv.stats()


def test_tls_client_against_plaintext_node_fails_fast(node: NodeProcess, pki: PKI) -> None:
    t0 = time.monotonic()
    with KVClient(node.tcp, tls_ca_file=pki.ca, timeouts=PATIENT) as kv:
        with pytest.raises(Unavailable, match="does not serve TLS"):
            kv.get(os.urandom(16))
    assert time.monotonic() - t0 < FAST_S
    assert node.endpoints["tls"] == "off"


def test_data_channel_mismatches_fail_fast(
    tls_node: NodeProcess, mtls_node: NodeProcess, node: NodeProcess, pki: PKI, other: PKI
) -> None:
    """The SDK's data-channel pool on its own (gRPC would have failed first): each mismatch is
    a prompt ``Unavailable`` that says what is wrong, never a hang."""
    from client._datachannel import DataChannelPool
    from kvstore.tls import ClientTLS

    cases = [
        (node, ClientTLS.from_options(ca_file=pki.ca), "during the TLS handshake"),
        (tls_node, None, "a node serving TLS also closes plaintext connections"),
        (tls_node, ClientTLS.from_options(ca_file=other.ca), "not signed by"),
        (mtls_node, ClientTLS.from_options(ca_file=pki.ca), "requires a client certificate"),
        (
            mtls_node,
            ClientTLS.from_options(ca_file=pki.ca, cert_file=other.client_cert, key_file=other.client_key),
            "(did|may) not accept this client certificate",
        ),  # TLS 1.3: the alert may lose the race with the close
    ]
    for n, tls, message in cases:
        host, port = data_port(n)
        pool = DataChannelPool(host, port, connect_timeout=20, io_timeout=20, tls=tls)
        t0 = time.monotonic()
        with pytest.raises(Unavailable, match=message):
            pool.get(os.urandom(16), [memoryview(bytearray(16))])
        assert time.monotonic() - t0 < FAST_S
        pool.close()


# -- mutual TLS -----------------------------------------------------------------------------
def test_mtls_client_with_certificate(mtls_node: NodeProcess, pki: PKI) -> None:
    assert mtls_node.endpoints["tls"] == "mutual"
    with KVClient(mtls_node.tcp, tls_ca_file=pki.ca, tls_cert_file=pki.client_cert, tls_key_file=pki.client_key) as kv:
        round_trip(kv)
        assert_tls_data_channel(kv)


@pytest.mark.parametrize("cert", ["none", "other-ca"])
def test_mtls_client_without_trusted_certificate_is_rejected(
    mtls_node: NodeProcess, pki: PKI, other: PKI, cert: str
) -> None:
    kw: dict[str, Any] = (
        {} if cert == "none" else {"tls_cert_file": other.client_cert, "tls_key_file": other.client_key}
    )
    t0 = time.monotonic()
    with KVClient(mtls_node.tcp, tls_ca_file=pki.ca, timeouts=PATIENT, **kw) as kv:
        with pytest.raises(Unavailable, match="client certificate"):
            kv.get(os.urandom(16))
    assert time.monotonic() - t0 < FAST_S


def test_mtls_data_port_requires_a_client_certificate(mtls_node: NodeProcess, pki: PKI) -> None:
    host, port = data_port(mtls_node)
    ctx = ssl.create_default_context(cafile=pki.ca)
    with socket.create_connection((host, port), timeout=FAST_S) as raw:
        with pytest.raises((ssl.SSLError, ConnectionError)):
            with ctx.wrap_socket(raw, server_hostname=host) as s:  # TLS 1.3: the refusal arrives at the first read
                s.sendall(REQUEST.pack(REQUEST_MAGIC, OP_GET, os.urandom(16)))
                if s.recv(8) == b"":
                    raise ConnectionError("closed")
    ctx.load_cert_chain(pki.client_cert, pki.client_key)
    with socket.create_connection((host, port), timeout=FAST_S) as raw, ctx.wrap_socket(raw, server_hostname=host) as s:
        s.sendall(REQUEST.pack(REQUEST_MAGIC, OP_GET, os.urandom(16)))  # accepted; then closed for the unknown id
        assert s.recv(8) == b""


# -- the CLI --------------------------------------------------------------------------------
def kvstore(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvstore", *args],
        env={**clean_env(), **(env or {})},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_health_cli_over_tls(tls_node: NodeProcess, mtls_node: NodeProcess, pki: PKI) -> None:
    r = kvstore("health", "--target", tls_node.tcp, "--tls-ca-file", pki.ca)
    assert r.returncode == 0 and r.stdout.startswith("SERVING"), r.stderr
    r = kvstore("health", "--target", tls_node.tcp, "--timeout", "20")
    assert r.returncode == 1 and "--tls-ca-file" in r.stderr and "Traceback" not in r.stderr
    r = kvstore("health", "--target", tls_node.unix)  # the Unix socket: plaintext
    assert r.returncode == 0, r.stderr
    r = kvstore("health", "--target", mtls_node.tcp, "--tls-ca-file", pki.ca, "--timeout", "20")
    assert r.returncode == 1 and "client certificate" in r.stderr
    r = kvstore(
        "health",
        "--target",
        mtls_node.tcp,
        "--tls-ca-file",
        pki.ca,
        "--tls-cert-file",
        pki.client_cert,
        "--tls-key-file",
        pki.client_key,
    )
    assert r.returncode == 0, r.stderr
    r = kvstore("health", "--target", tls_node.tcp, "--tls-ca-file", "/nonexistent/ca.pem")
    assert r.returncode == 1 and "cannot read tls_ca_file /nonexistent/ca.pem" in r.stderr


def test_stats_and_replay_cli_over_tls(tls_node: NodeProcess, pki: PKI) -> None:
    env = {"KVSTORE_TOKEN": TOKEN}
    r = kvstore("stats", "--target", tls_node.tcp, "--tls-ca-file", pki.ca, env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["node_id"] == tls_node.node_id
    r = kvstore("stats", "--target", tls_node.tcp, env=env)
    assert r.returncode == 2 and "tls_ca_file" in r.stderr and "Traceback" not in r.stderr
    trace = ROOT / "tests" / "data" / "mooncake_synthetic_trace.jsonl"
    r = kvstore(
        "replay",
        str(trace),
        "--target",
        tls_node.tcp,
        "--tls-ca-file",
        pki.ca,
        "--requests",
        "20",
        "--block-bytes",
        "64KiB",
        "--json",
        env=env,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["mode"] == "live" and out["requests"] == 20


# -- start-up refuses bad settings ---------------------------------------------------------
def serve_fails(tmp: Path, *args: str) -> str:
    t0 = time.monotonic()
    r = kvstore(
        "serve",
        "--data-dir",
        str(tmp / "d"),
        "--listen",
        "127.0.0.1:0",
        "--dram",
        "8MiB",
        "--nvme",
        "0",
        "--arena-path",
        f"/dev/shm/kvstore-test-tlsbad-{os.getpid()}-{tmp.name}.arena",
        *args,
    )
    assert r.returncode != 0, r.stdout
    assert "Traceback" not in r.stderr and "READY" not in r.stdout
    assert time.monotonic() - t0 < 30
    assert not Path(f"/dev/shm/kvstore-test-tlsbad-{os.getpid()}-{tmp.name}.arena").exists()
    return r.stderr


def test_serve_refuses_a_certificate_without_its_key(tmp_path: Path, pki: PKI) -> None:
    err = serve_fails(tmp_path, "--tls-cert-file", pki.server_cert)
    assert "tls_cert_file is set but tls_key_file is not" in err
    err = serve_fails(tmp_path, "--tls-key-file", pki.server_key)
    assert "tls_key_file is set but tls_cert_file is not" in err
    err = serve_fails(tmp_path, "--tls-client-ca-file", pki.ca)
    assert "tls_client_ca_file" in err and "needs tls_cert_file" in err


def test_serve_refuses_unreadable_or_invalid_tls_files(tmp_path: Path, pki: PKI, other: PKI) -> None:
    missing = str(tmp_path / "missing.pem")
    err = serve_fails(tmp_path, "--tls-cert-file", missing, "--tls-key-file", pki.server_key)
    assert f"cannot read tls_cert_file {missing}" in err
    err = serve_fails(tmp_path, "--tls-cert-file", pki.server_cert, "--tls-key-file", str(tmp_path))  # a directory
    assert f"cannot read tls_key_file {tmp_path}" in err
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    err = serve_fails(tmp_path, "--tls-cert-file", str(junk), "--tls-key-file", pki.server_key)
    assert f"tls_cert_file {junk} is not a PEM file" in err
    err = serve_fails(tmp_path, "--tls-cert-file", pki.server_cert, "--tls-key-file", other.server_key)  # not its key
    assert "are not a PEM certificate and its private key" in err
    err = serve_fails(
        tmp_path,
        "--tls-cert-file",
        pki.server_cert,
        "--tls-key-file",
        pki.server_key,
        "--tls-client-ca-file",
        pki.client_key,
    )  # a key where a CA belongs
    assert "tls_client_ca_file" in err and "no usable PEM CA certificate" in err
    # the same settings from the environment and a config file
    env_err = kvstore("serve", "--data-dir", str(tmp_path / "d"), env={"KVSTORE_TLS_CERT_FILE": pki.server_cert}).stderr
    assert "tls_key_file is not" in env_err
    cfg = tmp_path / "node.toml"
    cfg.write_text(f'[node]\ntls_cert_file = "{pki.server_cert}"\ntls_key_file = "{missing}"\n')
    err = serve_fails(tmp_path, "--config", str(cfg))
    assert f"cannot read tls_key_file {missing}" in err


# -- a cluster of TLS nodes -----------------------------------------------------------------
def test_cluster_client_over_tls(tmp_path: Path, pki: PKI) -> None:
    from cluster_fixtures import Cluster

    from kvstore.cluster.local_etcd import LocalEtcd, find_etcd

    if find_etcd() is None:
        pytest.skip("etcd is not installed (Debian: apt-get install etcd-server)")
    etcd = LocalEtcd(tmp_path / "etcd").start()
    cluster = Cluster(etcd, tmp_path)
    try:
        cluster.set("replication", 2)
        cluster.start("s1", "s2", extra=("--tls-cert-file", pki.server_cert, "--tls-key-file", pki.server_key))
        # prefer_local=False: dial the nodes' TCP listeners, not their Unix sockets on this machine
        kv = cluster.client(tls_ca_file=pki.ca, prefer_local=False, timeouts=Timeouts(rpc=5, data=10, connect=5))
        assert kv.wait_for_nodes(2, 10)
        datas = payloads()[:3]
        keys = [os.urandom(16) for _ in datas]
        assert kv.put_many(keys, datas) == [True] * len(keys)
        assert kv.get_many(keys) == datas
        assert kv.miss_counts()["node_down"] == 0
        with pytest.raises(Exception, match="cannot read tls_ca_file"):  # a bad file fails at construction
            cluster.client(tls_ca_file=str(tmp_path / "missing.pem"))
    finally:
        cluster.close()
        etcd.stop()


# -- the benchmark's TLS path ---------------------------------------------------------------
def test_bench_tls_path() -> None:
    r = kvstore("bench", "--quick", "--paths", "tcp,tls", "--redis-server", "", "--json", timeout=180)
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads(r.stdout)
    assert set(out["paths"]) == {"tcp", "tls"}
    assert out["paths"]["tls"]["4MiB"]["get_gbps"] > 0 and out["references"]["4MiB"]["tls_socket_gbps"] > 0
    # the reference is a fair one: the same protocol and cipher as the data channel
    assert out["tls"]["cipher"] == out["tls"]["socket_cipher"] and out["tls"]["cipher"].startswith("TLSv1.")
    for k in ("tls_get_vs_tls_socket", "tls_get_vs_tcp", "tls_put_vs_tls_socket", "tls_put_vs_tcp"):
        assert out["ratios"][k] > 0, k
    assert "TLS socket" in r.stderr and "the raw TLS socket" in r.stderr

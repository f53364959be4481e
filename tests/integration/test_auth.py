"""Bearer-token authentication on a real node started with ``--token-file``.

Every KVStore RPC (unary and streaming, Unix socket and TCP) needs the token; the SDK
takes it as ``token=``, ``token_file=`` or ``KVSTORE_TOKEN`` / ``KVSTORE_TOKEN_FILE``;
a missing or wrong token is ``Unauthenticated``.  gRPC health checks stay open for probes.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from conftest import ROOT, NodeProcess
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client import AsyncKVClient, KVClient, Unauthenticated
from kvstore.block import checksum
from protos.kvstore.v1 import kvstore_pb2 as pb
from protos.kvstore.v1 import kvstore_pb2_grpc as pb_grpc

TOKEN = "s3cret-token"
PATHS = ["shm", "tcp", "grpc-stream"]


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("auth") / "token"
    p.write_text(TOKEN + "\n")  # surrounding whitespace is not part of the token
    return p


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, token_file: Path) -> Iterator[NodeProcess]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    n = NodeProcess(
        tmp_path_factory.mktemp("authnode") / "node", "--dram", "32MiB", "--nvme", "0", "--token-file", str(token_file)
    )
    n.env = {**env, "PYTHONUNBUFFERED": "1"}
    n.start()
    yield n
    assert n.stop(timeout=30) == 0
    Path(f"/dev/shm/kvstore-test-{n.node_id}.arena").unlink(missing_ok=True)


@pytest.fixture(autouse=True)
def no_token_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSTORE_TOKEN", raising=False)
    monkeypatch.delenv("KVSTORE_TOKEN_FILE", raising=False)


def client(node: NodeProcess, path: str, **kw: object) -> KVClient:
    target = node.unix if path == "shm" else node.tcp
    return KVClient(target, transport="grpc-stream" if path == "grpc-stream" else "auto", **kw)  # type: ignore[arg-type]


def round_trip(kv: KVClient) -> None:
    k, data = os.urandom(16), os.urandom(70_000)
    assert kv.put(k, data)
    assert kv.get(k) == data
    assert kv.exists([k]) == [True]
    assert kv.stats()["tiers"]["dram"]["blocks"] >= 1


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("token", [None, "", "wrong", TOKEN + "x", "Bearer " + TOKEN])
def test_missing_or_wrong_token(node: NodeProcess, path: str, token: str | None) -> None:
    with client(node, path, token=token) as kv:
        for call in (
            lambda: kv.put(os.urandom(16), b"x"),
            lambda: kv.get(os.urandom(16)),
            kv.stats,
            lambda: kv.lookup([bytes(16)]),
        ):
            with pytest.raises(Unauthenticated, match="token"):
                call()


def test_async_client_without_token(node: NodeProcess) -> None:
    async def main() -> None:
        async with AsyncKVClient(node.tcp) as kv:
            with pytest.raises(Unauthenticated):
                await kv.get(os.urandom(16))
        async with AsyncKVClient(node.tcp, token=TOKEN) as kv:
            assert await kv.put(b"a" * 16, b"async") and await kv.get(b"a" * 16) == b"async"

    asyncio.run(main())


@pytest.mark.parametrize("path", PATHS)
def test_right_token_every_way(node: NodeProcess, token_file: Path, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with client(node, path, token=TOKEN) as kv:
        round_trip(kv)
    with client(node, path, token_file=str(token_file)) as kv:
        round_trip(kv)
    monkeypatch.setenv("KVSTORE_TOKEN", TOKEN)
    with client(node, path) as kv:
        round_trip(kv)
    with client(node, path, token="wrong") as kv:  # an explicit token wins over the environment
        with pytest.raises(Unauthenticated):
            kv.stats()
    monkeypatch.delenv("KVSTORE_TOKEN")
    monkeypatch.setenv("KVSTORE_TOKEN_FILE", str(token_file))
    with client(node, path) as kv:
        round_trip(kv)


def test_streams_and_raw_calls_need_the_token(node: NodeProcess) -> None:
    ch = grpc.insecure_channel(node.tcp)
    stub = pb_grpc.KVStoreStub(ch)
    k, payload = os.urandom(16), b"sneaky"
    info = pb.BlockInfo(key=k, payload_len=len(payload), payload_checksum=checksum(payload))
    bad = (("authorization", "Bearer nope"),)
    for md in ((), bad):
        for call in (
            lambda md=md: stub.PutStream(iter([pb.BlockChunk(block=info, data=payload)]), timeout=10, metadata=md),
            lambda md=md: list(stub.GetStream(pb.KeysRequest(keys=[k]), timeout=10, metadata=md)),
            lambda md=md: stub.Reserve(pb.ReserveRequest(blocks=[info]), timeout=10, metadata=md),
            lambda md=md: stub.StartPut(pb.ReserveRequest(blocks=[info]), timeout=10, metadata=md),
            lambda md=md: stub.Hello(pb.HelloRequest(), timeout=10, metadata=md),
        ):
            with pytest.raises(grpc.RpcError) as ei:
                call()
            assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert ("kvstore-error", "Unauthenticated") in [(m.key, m.value) for m in ei.value.trailing_metadata()]
    good = (("authorization", f"Bearer {TOKEN}"),)
    # nothing the refused calls sent was stored or reserved
    assert list(stub.Lookup(pb.KeysRequest(keys=[k]), timeout=10, metadata=good).tiers) == [pb.TIER_UNSPECIFIED]
    assert stub.Stats(pb.Empty(), timeout=10, metadata=good).reservations == 0
    ch.close()


@pytest.mark.parametrize("where", ["tcp", "unix"])
def test_health_check_needs_no_token(node: NodeProcess, where: str) -> None:
    with grpc.insecure_channel(node.tcp if where == "tcp" else node.unix) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for service in ("", "kvstore.v1.KVStore"):
            r = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert r.status == health_pb2.HealthCheckResponse.SERVING
        r = health.Check(health_pb2.HealthCheckRequest(), timeout=10, metadata=(("authorization", "Bearer wrong"),))
        assert r.status == health_pb2.HealthCheckResponse.SERVING


def test_stats_cli_with_and_without_token(node: NodeProcess) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    cmd = [sys.executable, "-m", "kvstore", "stats", "--target", node.tcp]
    r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "token" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run(cmd, env={**env, "KVSTORE_TOKEN": TOKEN}, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["node_id"] == node.node_id

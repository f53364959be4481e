"""Tenants on a real node: tokens map to tenants, tenants own the namespaces they write first.

One node (``[node] token_file`` = the admin, ``[tenants.alice] token_file``, ``[tenants.bob]
token``) serves every test here, each in namespaces of its own; the restart test runs its
own node with an NVMe tier.  Every SDK path is covered: a ``unix://`` target (shared
memory), a TCP target (data channel) and TCP with the gRPC streaming fallback.

What must hold: each tenant reads its own bytes back; another tenant's blocks are misses to
it for get, exists, lookup and match_prefix; its writes there are refused with
``PermissionDenied``; its deletes, pins and unpins there change nothing and report nothing;
a put of another tenant's key under its own namespace leaves that block alone; the admin
may do anything; a wrong token is ``Unauthenticated`` as without tenants.
"""

from __future__ import annotations

import asyncio
import os
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from conftest import NodeProcess
from prometheus_client.parser import text_string_to_metric_families

from client import AsyncKVClient, KVClient, Namespace, PermissionDenied, Unauthenticated, chunk_keys
from kvstore.block import BlockMeta
from kvstore.wire import meta_to_pb
from protos.kvstore.v1 import kvstore_pb2 as pb
from protos.kvstore.v1 import kvstore_pb2_grpc as pb_grpc

ADMIN, ALICE, BOB = "admin-secret", "alice-secret", "bob-secret"
PATHS = ["shm", "tcp", "grpc-stream"]
CHUNK = 4
BLOCK = 64 * 1024


def write_config(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "admin.token").write_text(ADMIN + "\n")
    (d / "alice.token").write_text(ALICE + "\n")
    cfg = d / "node.toml"
    cfg.write_text(
        f'[node]\ntoken_file = "{d / "admin.token"}"\n\n'
        f'[tenants.alice]\ntoken_file = "{d / "alice.token"}"\n\n'
        f'[tenants.bob]\ntoken = "{BOB}"\n'
    )
    return cfg


def start(d: Path, *args: str, data_dir: Path | None = None) -> NodeProcess:
    n = NodeProcess(data_dir or d / "node", "--config", str(write_config(d)), *args)
    n.env = {**{k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}, "PYTHONUNBUFFERED": "1"}
    return n.start()


def stop(n: NodeProcess) -> int:
    rc = n.stop(timeout=30)
    Path(n.arena_path).unlink(missing_ok=True)
    return rc


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    n = start(tmp_path_factory.mktemp("tenants"), "--dram", "64MiB", "--nvme", "0", "--metrics-port", "0")
    yield n
    assert stop(n) == 0


@pytest.fixture(autouse=True)
def no_token_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSTORE_TOKEN", raising=False)
    monkeypatch.delenv("KVSTORE_TOKEN_FILE", raising=False)


def client(node: NodeProcess, path: str, token: str | None) -> KVClient:
    target = node.unix if path == "shm" else node.tcp
    return KVClient(target, token=token, transport="grpc-stream" if path == "grpc-stream" else "auto")


def namespace(owner: str) -> Namespace:
    # the salt keeps every test in namespaces of its own on the shared node
    return Namespace("tiny-model", chunk_tokens=CHUNK, tenant_salt=f"{owner}-{uuid.uuid4().hex}")


def blocks(ns: Namespace, n: int, seed: int) -> tuple[list[bytes], list[np.ndarray]]:
    keys = chunk_keys(range(seed, seed + n * CHUNK), ns)
    return keys, [np.random.default_rng(seed + i).integers(0, 256, BLOCK, dtype=np.uint8) for i in range(n)]


def tenant_data(node: NodeProcess, path: str) -> tuple[Namespace, list[bytes], list[np.ndarray]]:
    """Alice's namespace, holding three blocks she put."""
    ns = namespace("alice")
    keys, datas = blocks(ns, 3, 1000)
    with client(node, path, ALICE) as kv:
        assert kv.put_many(keys, datas, namespace=ns) == [True] * 3
    return ns, keys, datas


def assert_alice_has(node: NodeProcess, path: str, keys: list[bytes], datas: list[np.ndarray]) -> None:
    with client(node, path, ALICE) as kv:
        assert kv.get_many(keys) == [d.tobytes() for d in datas]
        assert kv.match_prefix(keys) == len(keys)


# -- each tenant its own ---------------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
def test_each_tenant_reads_its_own_bytes(node: NodeProcess, path: str) -> None:
    na, nb = namespace("alice"), namespace("bob")
    ka, da = blocks(na, 3, 1)
    kb, db = blocks(nb, 3, 2)
    with client(node, path, ALICE) as alice, client(node, path, BOB) as bob:
        assert alice.put_many(ka, da, namespace=na) == [True] * 3
        assert bob.put_many(kb, db, namespace=nb) == [True] * 3
        assert alice.get_many(ka) == [d.tobytes() for d in da]
        assert bob.get_many(kb) == [d.tobytes() for d in db]
        out = np.empty(BLOCK, np.uint8)
        assert alice.get_into(ka[1], out) == BLOCK and np.array_equal(out, da[1])
        assert bob.get_into(kb[2], out) == BLOCK and np.array_equal(out, db[2])
        assert alice.exists(ka) == bob.exists(kb) == [True] * 3
        assert alice.lookup(ka) == bob.lookup(kb) == ["dram"] * 3
        assert alice.match_prefix(ka) == bob.match_prefix(kb) == 3
        assert alice.put(ka[0], da[0], namespace=na)  # a key already stored: deduplicated, as ever


# -- reads of another tenant's blocks are misses ---------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
def test_another_tenants_blocks_are_misses(node: NodeProcess, path: str) -> None:
    ns, keys, datas = tenant_data(node, path)
    nb = namespace("bob")
    own, own_data = blocks(nb, 1, 7)
    with client(node, path, BOB) as bob:
        assert bob.put_many(own, own_data, namespace=nb) == [True]
        assert bob.get(keys[0]) is None
        assert bob.get_into(keys[1], np.empty(BLOCK, np.uint8)) is None
        assert bob.get_many(keys) == [None] * 3
        assert bob.get_many([own[0], keys[0]]) == [own_data[0].tobytes(), None]
        assert bob.exists(keys) == [False] * 3
        assert bob.lookup(keys) == [None] * 3
        assert bob.match_prefix(keys) == 0
        assert bob.match_prefix([own[0], *keys]) == 1  # stops at the first block that is not its
        assert bob.match_prefix_tiers(keys) == (0, [])
    assert_alice_has(node, path, keys, datas)


def test_a_miss_looks_like_a_key_never_stored(node: NodeProcess) -> None:
    """Raw answers to bob for alice's key equal those for a key nobody stored."""
    ns, keys, _ = tenant_data(node, "shm")
    nobody = os.urandom(16)
    with grpc.insecure_channel(node.unix) as ch:
        stub = pb_grpc.KVStoreStub(ch)
        md = (("authorization", f"Bearer {BOB}"),)
        for method in ("Lookup", "MatchPrefix", "Acquire", "StartGet"):
            theirs = getattr(stub, method)(pb.KeysRequest(keys=[keys[0]]), timeout=10, metadata=md)
            none = getattr(stub, method)(pb.KeysRequest(keys=[nobody]), timeout=10, metadata=md)
            for r in (theirs, none):  # the key itself is echoed back: blank it out
                for lease in getattr(r, "leases", ()):
                    lease.block.key = b""
            assert theirs == none, method
        stream = list(stub.GetStream(pb.KeysRequest(keys=[keys[0]]), timeout=10, metadata=md))
        assert [c.status for c in stream] == [pb.KEY_STATUS_MISS] and not stream[0].data


# -- writes, deletes, pins and invalidations -------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
def test_another_tenant_cannot_change_blocks(node: NodeProcess, path: str) -> None:
    ns, keys, datas = tenant_data(node, path)
    nb = namespace("bob")
    with client(node, path, BOB) as bob:
        with pytest.raises(PermissionDenied, match="belongs to another tenant"):
            bob.put(keys[0], b"x" * BLOCK, namespace=ns)  # overwrite: refused
        with pytest.raises(PermissionDenied):
            bob.put(os.urandom(16), b"new", namespace=ns)  # a new key in her namespace: refused
        with pytest.raises(PermissionDenied, match="does not own"):
            bob.invalidate(ns)
        assert bob.delete(keys) == 0  # as if absent: a refusal would say they exist
        assert bob.pin(keys, 60) == 0
        assert bob.unpin(keys) == 0
        # her key, declared in his own namespace: accepted like any new key, and dropped
        assert bob.put(keys[1], b"y" * BLOCK, namespace=nb)
        assert bob.get(keys[1]) is None
    assert_alice_has(node, path, keys, datas)
    with client(node, path, ALICE) as alice:
        assert alice.pin(keys, 60) == 3 and alice.unpin(keys) == 3
        assert alice.delete(keys[2:]) == 1
        assert alice.invalidate(ns) == 2
        assert alice.exists(keys) == [False] * 3
        assert alice.put(keys[0], datas[0], namespace=ns)  # still hers after the invalidation


@pytest.mark.parametrize("path", ["shm", "tcp"])
def test_a_tenant_must_name_a_namespace(node: NodeProcess, path: str) -> None:
    with client(node, path, ALICE) as kv:
        with pytest.raises(PermissionDenied, match="with a namespace"):
            kv.put(os.urandom(16), b"nameless")


def test_reservations_and_leases_of_others_are_unknown(node: NodeProcess) -> None:
    """Ids are sequential: bob must not commit, abort or release what alice holds."""
    ns = namespace("alice")
    (k,) = chunk_keys(range(CHUNK), ns)
    payload = b"z" * 4096
    meta = BlockMeta.for_payload(k, payload, namespace=ns.fingerprint)
    alice_md, bob_md = (("authorization", f"Bearer {ALICE}"),), (("authorization", f"Bearer {BOB}"),)
    with grpc.insecure_channel(node.unix) as ch:
        stub = pb_grpc.KVStoreStub(ch)
        (r,) = stub.Reserve(pb.ReserveRequest(blocks=[meta_to_pb(meta)]), timeout=10, metadata=alice_md).reservations
        assert r.status == pb.KEY_STATUS_OK
        bob_commit = stub.Commit(
            pb.CommitRequest(reservation_ids=[r.reservation_id], payload_checksums=[1]), timeout=10, metadata=bob_md
        )
        assert list(bob_commit.statuses) == [pb.KEY_STATUS_EXPIRED]
        stub.Abort(pb.AbortRequest(reservation_ids=[r.reservation_id]), timeout=10, metadata=bob_md)
        ok = stub.Commit(
            pb.CommitRequest(reservation_ids=[r.reservation_id], payload_checksums=[meta.payload_checksum]),
            timeout=10,
            metadata=alice_md,
        )
        assert list(ok.statuses) == [pb.KEY_STATUS_OK]  # bob's calls left it alone
        (lease,) = stub.Acquire(pb.KeysRequest(keys=[k]), timeout=10, metadata=alice_md).leases
        assert lease.status == pb.KEY_STATUS_OK
        assert list(stub.Release(pb.ReleaseRequest(lease_ids=[lease.lease_id]), timeout=10, metadata=bob_md).valid) == [
            False
        ]
        assert list(
            stub.Release(pb.ReleaseRequest(lease_ids=[lease.lease_id]), timeout=10, metadata=alice_md).valid
        ) == [True]
        # refusals carry the typed error, as every other error does
        with pytest.raises(grpc.RpcError) as ei:
            stub.Reserve(pb.ReserveRequest(blocks=[meta_to_pb(meta)]), timeout=10, metadata=bob_md)
        assert ei.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert ("kvstore-error", "PermissionDenied") in [(m.key, m.value) for m in ei.value.trailing_metadata()]


# -- the admin --------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
def test_admin_may_do_anything(node: NodeProcess, path: str) -> None:
    ns, keys, datas = tenant_data(node, path)
    with client(node, path, ADMIN) as admin:
        assert admin.get_many(keys) == [d.tobytes() for d in datas]
        assert admin.lookup(keys) == ["dram"] * 3 and admin.match_prefix(keys) == 3
        assert admin.pin(keys, 60) == 3 and admin.unpin(keys) == 3
        assert admin.put(os.urandom(16), b"admin", namespace=ns)  # writes into her namespace
        assert admin.delete(keys[:1]) == 1
        assert admin.invalidate(ns) == 3
    with client(node, path, ALICE) as alice:
        assert alice.exists(keys) == [False] * 3
        assert alice.put(keys[0], datas[0], namespace=ns)  # the admin claimed nothing: still hers


def test_admin_blocks_are_shared_until_a_tenant_writes(node: NodeProcess) -> None:
    ns = namespace("shared")
    keys, datas = blocks(ns, 2, 50)
    with client(node, "shm", ADMIN) as admin:
        assert admin.put_many(keys, datas, namespace=ns) == [True, True]
    with client(node, "tcp", BOB) as bob, client(node, "tcp", ALICE) as alice:
        assert bob.get(keys[0]) == alice.get(keys[0]) == datas[0].tobytes()
        assert bob.delete(keys) == 0  # readable by all, changed only by its owner or the admin
        with pytest.raises(PermissionDenied):
            bob.invalidate(ns)
        assert alice.put(os.urandom(16), b"claim", namespace=ns)  # alice writes first: hers now
        assert bob.get(keys[0]) is None and alice.get(keys[0]) == datas[0].tobytes()


# -- authentication ----------------------------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("token", [None, "wrong", ALICE + "x", "Bearer " + BOB])
def test_wrong_token_is_unauthenticated(node: NodeProcess, path: str, token: str | None) -> None:
    with client(node, path, token) as kv:
        for call in (
            lambda: kv.put(os.urandom(16), b"x", namespace=b"N" * 8),
            lambda: kv.get(os.urandom(16)),
            kv.stats,
            lambda: kv.lookup([bytes(16)]),
        ):
            with pytest.raises(Unauthenticated, match="token"):
                call()


def test_async_client(node: NodeProcess) -> None:
    ns, keys, datas = tenant_data(node, "tcp")

    async def main() -> None:
        async with AsyncKVClient(node.tcp, token=BOB) as bob:
            assert await bob.get(keys[0]) is None
            assert await bob.match_prefix(keys) == 0
            with pytest.raises(PermissionDenied):
                await bob.put(os.urandom(16), b"x", namespace=ns)
        async with AsyncKVClient(node.unix, token=ALICE) as alice:
            assert await alice.get(keys[0]) == datas[0].tobytes()

    asyncio.run(main())


def test_metrics_count_tenants(node: NodeProcess) -> None:
    ns, keys, _ = tenant_data(node, "shm")
    with client(node, "shm", BOB) as bob:
        assert bob.get_many(keys) == [None] * 3
        with pytest.raises(PermissionDenied):
            bob.invalidate(ns)
    url = node.endpoints["metrics"]
    for token in (ALICE, BOB, ""):  # node-wide counters: the admin's only
        req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
        with pytest.raises(urllib.error.HTTPError) as ei:
            urllib.request.urlopen(req, timeout=10)
        assert ei.value.code == 401
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {ADMIN}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        text = r.read().decode()
    m = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    assert m[("kvstore_tenant_requests_total", (("tenant", "alice"),))] >= 1
    assert m[("kvstore_tenant_requests_total", (("tenant", "bob"),))] >= 2
    assert m[("kvstore_tenant_denied_total", (("kind", "hidden"), ("tenant", "bob")))] >= 3
    assert m[("kvstore_tenant_denied_total", (("kind", "refused"), ("tenant", "bob")))] >= 1
    assert not any(
        name.startswith("kvstore_tenant") and dict(labels).get("tenant") not in ("alice", "bob") for name, labels in m
    )


# -- ownership survives a restart ---------------------------------------------------------------


def test_ownership_survives_a_restart(tmp_path: Path) -> None:
    na, nb = namespace("alice"), namespace("bob")
    ka, da = blocks(na, 3, 10)
    kb, db = blocks(nb, 2, 20)
    data_dir = tmp_path / "node"
    n = start(tmp_path, "--dram", "32MiB", "--nvme", "64MiB", data_dir=data_dir)
    try:
        with client(n, "shm", ALICE) as alice, client(n, "tcp", BOB) as bob:
            assert alice.put_many(ka, da, namespace=na) == [True] * 3
            assert bob.put_many(kb, db, namespace=nb) == [True] * 2
    finally:
        assert stop(n) == 0  # SIGTERM: dirty blocks go to NVMe
    n = start(tmp_path, "--dram", "32MiB", "--nvme", "64MiB", data_dir=data_dir)
    try:
        with client(n, "tcp", BOB) as bob:
            assert bob.lookup(kb) == ["nvme"] * 2  # nothing in DRAM yet: these came back from disk
            assert bob.get_many(ka) == [None] * 3
        for path in ("shm", "tcp"):
            with client(n, path, ALICE) as alice, client(n, path, BOB) as bob:
                assert alice.get_many(ka) == [d.tobytes() for d in da]
                assert bob.get_many(kb) == [d.tobytes() for d in db]
                assert bob.get_many(ka) == [None] * 3 and bob.match_prefix(ka) == 0
                assert alice.exists(kb) == [False] * 2
                with pytest.raises(PermissionDenied):
                    bob.put(os.urandom(16), b"x", namespace=na)
                with pytest.raises(PermissionDenied):
                    alice.invalidate(nb)
                assert bob.delete(ka) == 0
        with client(n, "shm", ALICE) as alice:
            assert alice.put(os.urandom(16), b"more", namespace=na)
    finally:
        assert stop(n) == 0

"""Regressions from a security review of tenants and TLS: each test is named after its bug.

A tenant (bob) attacks another (alice) over TCP with raw gRPC calls and raw data-channel
sockets, as a client that ignores the SDK's rules would:

* ids a data-channel transfer or a ``GetStream`` holds were releasable (or abortable) by
  ``Release``/``Abort``: the transfer then kept sending from, or receiving into, extents that
  another block got next, so bob read alice's bytes or overwrote her block;
* ``Commit`` over TCP published, unchecked, whatever the arena held under a fresh reservation:
  the bytes of a block alice had deleted, which bob then read back;
* two ``authorization`` headers were resolved to the last one (a proxy may check the first);
* ``ReportHits`` refused another tenant's namespace and accepted a free one: an ownership
  probe without the claim a write makes;
* an empty admin ``token_file`` silently switched authentication off;
* a missing ``owners.lmdb`` beside kept NVMe blocks made them readable to every tenant without
  a word, and an unreadable one stopped the node with a raw lmdb traceback;
* NVMe segment files (every tenant's KV bytes), the NVMe index and the ownership table were
  created world-readable, and a world-readable TLS private key went unremarked.
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from conftest import NodeProcess, clean_env, stop_clean
from prometheus_client.parser import text_string_to_metric_families
from tls_pki import PKI, pki  # noqa: F401 - fixture

from client import KVClient, Namespace, chunk_keys
from kvstore.block import BlockMeta
from kvstore.node.datachannel import COUNT, OP_GET, OP_PUT, REPLY, REPLY_MAGIC, REQUEST, REQUEST_MAGIC, STATUS_OK
from kvstore.wire import meta_to_pb
from protos.kvstore.v1 import kvstore_pb2 as pb
from protos.kvstore.v1 import kvstore_pb2_grpc as pb_grpc

ADMIN, ALICE, BOB = "admin-secret", "alice-secret", "bob-secret"
BIG = 24 << 20  # bigger than the socket buffers: a transfer of it stalls while its client does not read
MD = {name: (("authorization", f"Bearer {tok}"),) for name, tok in (("alice", ALICE), ("bob", BOB))}


def config(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    cfg = d / "node.toml"
    cfg.write_text(
        f'[node]\ntoken = "{ADMIN}"\n\n[tenants.alice]\ntoken = "{ALICE}"\n\n[tenants.bob]\ntoken = "{BOB}"\n'
    )
    return cfg


def start(d: Path, *args: str, data_dir: Path | None = None) -> NodeProcess:
    n = NodeProcess(data_dir or d / "node", "--config", str(config(d)), *args)
    n.env = clean_env()
    return n.start()


stop = stop_clean


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    n = start(tmp_path_factory.mktemp("review"), "--dram", "64MiB", "--nvme", "0", "--metrics-port", "0")
    yield n
    stop(n)


@pytest.fixture(autouse=True)
def no_token_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSTORE_TOKEN", raising=False)
    monkeypatch.delenv("KVSTORE_TOKEN_FILE", raising=False)


def namespace(owner: str) -> Namespace:
    return Namespace("tiny-model", chunk_tokens=4, tenant_salt=f"{owner}-{uuid.uuid4().hex}")


def key(ns: Namespace, i: int = 0) -> bytes:
    return chunk_keys(range(4 * i, 4 * i + 4), ns)[0]


def stub(target: str) -> pb_grpc.KVStoreStub:
    return pb_grpc.KVStoreStub(grpc.insecure_channel(target))


def data_socket(n: NodeProcess) -> socket.socket:
    """A raw data-channel connection with a small receive buffer (so a GET stalls early)."""
    host, port = n.endpoints["data"].rsplit(":", 1)
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.settimeout(30)
    s.connect((host, int(port)))
    return s


def eventually(check: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def recv_exact(s: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, pos = memoryview(buf), 0
    while pos < n:
        got = s.recv_into(view[pos:])
        if not got:
            break
        pos += got
    return bytes(buf[:pos])


# -- held transfers ---------------------------------------------------------------------------


def test_held_get_lease_released_mid_transfer_leaked_another_tenants_bytes(node: NodeProcess) -> None:
    """bob starts a data-channel GET of his own big block, stalls it, releases its lease and
    deletes the block: alice's next block got those extents, and the transfer sent her bytes."""
    nb, na = namespace("bob"), namespace("alice")
    kb, ka = key(nb), key(na)
    mine, hers = np.full(BIG, ord("b"), np.uint8), np.full(BIG, ord("S"), np.uint8)
    with KVClient(node.tcp, token=BOB) as bob, KVClient(node.tcp, token=ALICE) as alice:
        assert bob.put(kb, mine, namespace=nb)
        s = stub(node.tcp)
        r = s.StartGet(pb.KeysRequest(keys=[kb]), timeout=10, metadata=MD["bob"])
        (lease,) = r.leases
        with data_socket(node) as conn:
            conn.sendall(REQUEST.pack(REQUEST_MAGIC, OP_GET, r.transfer_id))
            assert recv_exact(conn, REPLY.size) == REPLY.pack(REPLY_MAGIC, STATUS_OK)
            # the transfer holds the lease now: it is not the caller's to end
            assert list(
                s.Release(pb.ReleaseRequest(lease_ids=[lease.lease_id]), timeout=10, metadata=MD["bob"]).valid
            ) == [False]
            assert s.Delete(pb.KeysRequest(keys=[kb]), timeout=10, metadata=MD["bob"]).count == 1
            assert alice.put(ka, hers, namespace=na)
            got = recv_exact(conn, BIG)
        assert got == mine.tobytes()  # his own bytes, all of them, and nothing of hers
        assert alice.get(ka) == hers.tobytes()


def test_held_get_stream_lease_released_by_guessed_id(node: NodeProcess) -> None:
    """Lease ids are sequential: bob guessed the id of his own ``GetStream``'s lease and
    released it while the stream was stalled."""
    nb = namespace("bob")
    kb, small = key(nb, 0), key(nb, 1)
    mine = np.full(BIG, ord("b"), np.uint8)
    with KVClient(node.tcp, token=BOB) as bob:
        assert bob.put(kb, mine, namespace=nb) and bob.put(small, b"s" * 4096, namespace=nb)
        s = stub(node.tcp)
        (probe,) = s.Acquire(pb.KeysRequest(keys=[small]), timeout=10, metadata=MD["bob"]).leases
        assert list(s.Release(pb.ReleaseRequest(lease_ids=[probe.lease_id]), timeout=10, metadata=MD["bob"]).valid) == [
            True
        ]
        chunks = stub(node.tcp).GetStream(pb.KeysRequest(keys=[kb]), timeout=30, metadata=MD["bob"])
        first = next(chunks)
        assert first.status == pb.KEY_STATUS_OK
        guessed = probe.lease_id + 1  # the stream's lease: nothing else leased or reserved meanwhile
        assert list(s.Release(pb.ReleaseRequest(lease_ids=[guessed]), timeout=10, metadata=MD["bob"]).valid) == [False]
        got = first.data + b"".join(c.data for c in chunks)
        assert got == mine.tobytes()
        assert eventually(
            lambda: s.Stats(pb.Empty(), timeout=10, metadata=MD["bob"]).leases == 0
        )  # the stream gave it back


def test_held_put_reservation_aborted_by_guessed_id_overwrote_another_tenants_block(node: NodeProcess) -> None:
    """bob stalls a data-channel PUT, aborts its reservation (id guessed from a lease id just
    before it) and resumes sending: his bytes landed in the block alice stored there meanwhile,
    which her shared-memory reads return unchecked."""
    nb, na = namespace("bob"), namespace("alice")
    kb, small, ka = key(nb, 0), key(nb, 1), key(na)
    mine, hers = np.full(BIG, ord("b"), np.uint8), np.full(BIG, ord("S"), np.uint8)
    meta = BlockMeta.for_payload(kb, mine.tobytes(), namespace=nb.fingerprint)
    with KVClient(node.tcp, token=BOB) as bob, KVClient(node.unix, token=ALICE) as alice:
        assert bob.put(small, b"s" * 4096, namespace=nb)
        s = stub(node.tcp)
        (probe,) = s.Acquire(pb.KeysRequest(keys=[small]), timeout=10, metadata=MD["bob"]).leases
        s.Release(pb.ReleaseRequest(lease_ids=[probe.lease_id]), timeout=10, metadata=MD["bob"])
        r = s.StartPut(pb.ReserveRequest(blocks=[meta_to_pb(meta)]), timeout=10, metadata=MD["bob"])
        assert list(r.statuses) == [pb.KEY_STATUS_OK]
        guessed = probe.lease_id + 1
        payload = memoryview(mine.tobytes())
        with data_socket(node) as conn:
            conn.sendall(REQUEST.pack(REQUEST_MAGIC, OP_PUT, r.transfer_id) + payload[: 1 << 20])
            # the data channel holds the reservation once its connection presented the id
            assert eventually(
                lambda: s.Stats(pb.Empty(), timeout=10, metadata=MD["bob"]).counters["pending_transfers"] == 0
            )
            s.Abort(pb.AbortRequest(reservation_ids=[guessed]), timeout=10, metadata=MD["bob"])
            assert alice.put(ka, hers, namespace=na)
            conn.sendall(payload[1 << 20 :])
            reply = recv_exact(conn, REPLY.size + COUNT.size + 1)
        assert reply == REPLY.pack(REPLY_MAGIC, STATUS_OK) + COUNT.pack(1) + bytes([pb.KEY_STATUS_OK])  # his put stood
        assert alice.get(ka) == hers.tobytes()  # her block is hers, byte for byte
        assert bob.get(kb) == mine.tobytes()


# -- Commit over TCP --------------------------------------------------------------------------


def test_tcp_commit_published_stale_arena_bytes_of_another_tenant(node: NodeProcess) -> None:
    """Over TCP bob cannot write into the arena, but Reserve + Commit published whatever it
    held there: the bytes of blocks alice had just deleted, readable by bob at once."""
    na, nb = namespace("alice"), namespace("bob")
    ka = chunk_keys(range(40), na)
    secret = [np.full(64 << 10, ord("A") + i, np.uint8) for i in range(10)]
    with KVClient(node.tcp, token=ALICE) as alice:
        assert alice.put_many(ka, secret, namespace=na) == [True] * 10
        assert alice.delete(ka) == 10
    kb = chunk_keys(range(1000, 1040), nb)
    metas = [
        BlockMeta(
            key=k,
            parent=bytes(16),
            namespace=nb.fingerprint,
            token_count=4,
            dtype="uint8",
            shape=(64 << 10,),
            payload_len=64 << 10,
            payload_checksum=0,
        )
        for k in kb
    ]
    s = stub(node.tcp)
    res = s.Reserve(
        pb.ReserveRequest(blocks=[meta_to_pb(m) for m in metas]), timeout=10, metadata=MD["bob"]
    ).reservations
    ids = [r.reservation_id for r in res if r.status == pb.KEY_STATUS_OK]
    with pytest.raises(grpc.RpcError) as ei:
        s.Commit(
            pb.CommitRequest(reservation_ids=ids, payload_checksums=[0] * len(ids)), timeout=10, metadata=MD["bob"]
        )
    assert ei.value.code() == grpc.StatusCode.PERMISSION_DENIED and "unix://" in (ei.value.details() or "")
    s.Abort(pb.AbortRequest(reservation_ids=ids), timeout=10, metadata=MD["bob"])
    with KVClient(node.tcp, token=BOB, verify=False) as bob:
        assert bob.get_many(kb) == [None] * 10
    # over the Unix socket, where the writer maps the arena and fills it, Commit is the write path
    with KVClient(node.unix, token=BOB) as bob:
        assert bob.put(kb[0], b"local" * 100, namespace=nb) and bob.get(kb[0]) == b"local" * 100


# -- authorization headers --------------------------------------------------------------------


def test_two_authorization_headers_resolved_to_the_last(node: NodeProcess) -> None:
    s = stub(node.tcp)
    for md in (
        (("authorization", f"Bearer {ALICE}"), ("authorization", f"Bearer {BOB}")),
        (("authorization", "junk"), ("authorization", f"Bearer {ALICE}")),
    ):
        with pytest.raises(grpc.RpcError) as ei:
            s.Stats(pb.Empty(), timeout=10, metadata=md)
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as ei:
            list(s.GetStream(pb.KeysRequest(keys=[os.urandom(16)]), timeout=10, metadata=md))
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert s.Stats(pb.Empty(), timeout=10, metadata=MD["alice"]).node_id == node.node_id  # one header: fine


# -- ReportHits ------------------------------------------------------------------------------------


def denied(n: NodeProcess, tenant: str, kind: str) -> float:
    req = urllib.request.Request(n.endpoints["metrics"], headers={"Authorization": f"Bearer {ADMIN}"})
    text = urllib.request.urlopen(req, timeout=10).read().decode()
    m = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    return m.get(("kvstore_tenant_denied_total", (("kind", kind), ("tenant", tenant))), 0.0)


def test_report_hits_refusal_told_that_another_tenant_owns_a_namespace(node: NodeProcess) -> None:
    """A write tells that too, but claims the namespace if nobody owns it; ReportHits answered
    ``PermissionDenied`` for a taken namespace and OK for a free one, with no side effect."""
    na = namespace("alice")
    with KVClient(node.tcp, token=ALICE) as alice:
        assert alice.put(key(na), b"hers", namespace=na)
    s = stub(node.tcp)
    before = denied(node, "bob", "skipped")
    for ns in (na, namespace("nobody")):  # hers, and one nobody owns: the same answer
        req = pb.ReportHitsRequest(op="get", tier=pb.TIER_HBM, blocks=1, tokens=4, namespace=ns.fingerprint)
        assert s.ReportHits(req, timeout=10, metadata=MD["bob"]) == pb.Empty()
    assert denied(node, "bob", "skipped") == before + 1  # hers was not counted


# -- start-up: fail closed, or say so -----------------------------------------------------------


@pytest.mark.parametrize("tenants", [False, True])
def test_empty_admin_token_file_switched_auth_off(tmp_path: Path, tenants: bool) -> None:
    (tmp_path / "admin.token").write_text("\n")
    args = ["--dram", "8MiB", "--nvme", "0", "--token-file", str(tmp_path / "admin.token")]
    if tenants:  # and opened /metrics, which the admin token guards
        (tmp_path / "alice.token").write_text(ALICE)
        args += ["--tenant", f"alice={tmp_path / 'alice.token'}", "--metrics-port", "0"]
    n = NodeProcess(tmp_path / "node", *args)
    n.env = clean_env()
    try:
        with pytest.raises(RuntimeError, match="is empty"):
            n.start()
        assert n.proc is not None and n.proc.wait() != 0
    finally:
        n.stop(timeout=30)  # a node that did start (the bug) must not outlive the test
        Path(n.arena_path).unlink(missing_ok=True)


def test_lost_owners_table_left_nvme_blocks_readable_without_a_word(tmp_path: Path) -> None:
    na = namespace("alice")
    data_dir = tmp_path / "node"
    n = start(tmp_path, "--dram", "16MiB", "--nvme", "32MiB", data_dir=data_dir)
    try:
        with KVClient(n.tcp, token=ALICE) as alice:
            assert alice.put(key(na), b"hers" * 1000, namespace=na)
    finally:
        stop(n)  # SIGTERM: the block goes to NVMe
    shutil.rmtree(data_dir / "owners.lmdb")
    n = start(tmp_path, "--dram", "16MiB", "--nvme", "32MiB", data_dir=data_dir)
    try:
        assert any("owners.lmdb is new but the NVMe tier holds 1 blocks" in line for line in n.output), "".join(
            n.output
        )
    finally:
        stop(n)
    n = start(tmp_path, "--dram", "16MiB", "--nvme", "32MiB", data_dir=data_dir)  # a table now exists: no warning
    try:
        assert not any("has no recorded owner" in line or "is new but" in line for line in n.output)
    finally:
        stop(n)


def test_unreadable_owners_table_stopped_the_node_with_a_traceback(tmp_path: Path) -> None:
    data_dir = tmp_path / "node"
    (data_dir / "owners.lmdb").mkdir(parents=True)
    (data_dir / "owners.lmdb" / "data.mdb").write_bytes(os.urandom(65536))
    n = NodeProcess(data_dir, "--config", str(config(tmp_path)), "--dram", "8MiB", "--nvme", "0")
    n.env = clean_env()
    with pytest.raises(RuntimeError) as ei:
        n.start()
    assert "cannot read the namespace ownership table" in str(ei.value) and "Traceback" not in str(ei.value)
    assert n.proc is not None and n.proc.wait() != 0


def test_nvme_segments_were_world_readable(tmp_path: Path) -> None:
    nb = namespace("bob")
    n = start(tmp_path, "--dram", "16MiB", "--nvme", "32MiB", "--write-through")
    try:
        with KVClient(n.tcp, token=BOB) as bob:
            assert bob.put(key(nb), b"private" * 1000, namespace=nb)
    finally:
        stop(n)
    segments = list((n.data_dir / "nvme").glob("seg-*.dat"))
    assert segments
    for seg in segments:
        assert stat.S_IMODE(seg.stat().st_mode) & 0o077 == 0, f"{seg} is mode {stat.S_IMODE(seg.stat().st_mode):04o}"


def test_index_and_ownership_tables_were_world_readable(tmp_path: Path) -> None:
    """``nvme/index.lmdb`` (every stored key and namespace) and ``owners.lmdb`` (which tenant
    owns which namespace) were created 0644 under the usual umask; now 0600, like the segments."""
    nb = namespace("bob")
    old = os.umask(0o022)  # the node inherits it: what a default shell gives
    try:
        n = start(tmp_path, "--dram", "16MiB", "--nvme", "32MiB", "--write-through")
    finally:
        os.umask(old)
    try:
        with KVClient(n.tcp, token=BOB) as bob:
            assert bob.put(key(nb), b"private" * 1000, namespace=nb)
    finally:
        stop(n)
    for table in (n.data_dir / "nvme" / "index.lmdb", n.data_dir / "owners.lmdb"):
        files = sorted(table.glob("*.mdb"))
        assert [f.name for f in files] == ["data.mdb", "lock.mdb"], table
        for f in files:
            assert stat.S_IMODE(f.stat().st_mode) == 0o600, f"{f} is mode {stat.S_IMODE(f.stat().st_mode):04o}"
        assert stat.S_IMODE(table.stat().st_mode) & 0o700 == 0o700  # still searchable by the node's user


def test_world_readable_tls_key_went_unremarked(tmp_path: Path, pki: PKI) -> None:
    key_file = tmp_path / "server.key"
    shutil.copy(pki.server_key, key_file)
    key_file.chmod(0o644)
    n = start(
        tmp_path, "--dram", "8MiB", "--nvme", "0", "--tls-cert-file", pki.server_cert, "--tls-key-file", str(key_file)
    )
    try:
        assert any("is readable by other users (mode 0644)" in line for line in n.output), "".join(n.output)
    finally:
        stop(n)
    key_file.chmod(0o600)
    n = start(
        tmp_path, "--dram", "8MiB", "--nvme", "0", "--tls-cert-file", pki.server_cert, "--tls-key-file", str(key_file)
    )
    try:
        assert not any("readable by other users" in line for line in n.output)
    finally:
        stop(n)

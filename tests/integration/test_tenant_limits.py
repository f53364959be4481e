"""Per-tenant limits on a real node: what eviction cannot reclaim is bounded per tenant.

One node serves every test here: ``alice`` without limits, ``bob`` with
``max_reserved_bytes = "256KiB"`` and ``max_pinned_bytes = "128KiB"`` (blocks are 64 KiB),
``max_pin_ttl_s = 2`` and ``reservation_ttl_s = 2``.  What must hold: bob's reserves and
pins over his limits are refused with ``CapacityExceeded`` (``RESOURCE_EXHAUSTED``) naming
the limit while alice keeps writing and pinning; commit, abort, reservation reclaim, unpin,
delete and pin expiry give his bytes back (``kvstore_tenant_held_bytes`` says so); no pin
outlives ``max_pin_ttl_s``, ``inf`` included; a bad limit stops the node with a clear error.
Each test leaves bob holding nothing.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from conftest import NodeProcess, wait_for
from prometheus_client.parser import text_string_to_metric_families

from client import CapacityExceeded, KVClient, Namespace, chunk_keys
from kvstore.block import BlockMeta
from kvstore.wire import meta_to_pb
from protos.kvstore.v1 import kvstore_pb2 as pb
from protos.kvstore.v1 import kvstore_pb2_grpc as pb_grpc

ADMIN, ALICE, BOB = "admin-secret", "alice-secret", "bob-secret"
CHUNK = 4
BLOCK = 64 * 1024
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    d = tmp_path_factory.mktemp("tenant-limits")
    cfg = d / "node.toml"
    cfg.write_text(
        f'[node]\ntoken = "{ADMIN}"\nmax_pin_ttl_s = 2\nreservation_ttl_s = 2\n\n'
        f'[tenants.alice]\ntoken = "{ALICE}"\n\n'
        f'[tenants.bob]\ntoken = "{BOB}"\nmax_reserved_bytes = "256KiB"\nmax_pinned_bytes = "128KiB"\n'
    )
    n = NodeProcess(d / "node", "--config", str(cfg), "--dram", "64MiB", "--nvme", "0", "--metrics-port", "0")
    n.env = {**{k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}, "PYTHONUNBUFFERED": "1"}
    n.start()
    yield n
    assert n.stop(timeout=30) == 0
    Path(n.arena_path).unlink(missing_ok=True)


@pytest.fixture(autouse=True)
def bob_holds_nothing_after(node: NodeProcess, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("KVSTORE_TOKEN", raising=False)
    monkeypatch.delenv("KVSTORE_TOKEN_FILE", raising=False)
    yield
    wait_for(lambda: held(node, "bob") == {"reserved": 0, "pinned": 0}, 10, "bob's holds to be given back")


def held(node: NodeProcess, tenant: str) -> dict[str, float]:
    req = urllib.request.Request(node.endpoints["metrics"], headers={"Authorization": f"Bearer {ADMIN}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        text = r.read().decode()
    out = {"reserved": -1.0, "pinned": -1.0}
    for fam in text_string_to_metric_families(text):
        if fam.name == "kvstore_tenant_held_bytes":
            for s in fam.samples:
                if s.labels["tenant"] == tenant:
                    out[s.labels["kind"]] = s.value
    return out


def namespace(owner: str) -> Namespace:
    return Namespace("tiny-model", chunk_tokens=CHUNK, tenant_salt=f"{owner}-{uuid.uuid4().hex}")


def blocks(ns: Namespace, n: int, seed: int) -> tuple[list[bytes], list[np.ndarray]]:
    keys = chunk_keys(range(seed, seed + n * CHUNK), ns)
    return keys, [np.random.default_rng(seed + i).integers(0, 256, BLOCK, dtype=np.uint8) for i in range(n)]


def infos(ns: Namespace, n: int, seed: int) -> list[pb.BlockInfo]:
    keys, datas = blocks(ns, n, seed)
    return [meta_to_pb(BlockMeta.for_payload(k, d, namespace=ns.fingerprint)) for k, d in zip(keys, datas)]


def stub(node: NodeProcess) -> tuple[grpc.Channel, pb_grpc.KVStoreStub]:
    ch = grpc.insecure_channel(node.unix)
    return ch, pb_grpc.KVStoreStub(ch)


BOB_MD = (("authorization", f"Bearer {BOB}"),)


def test_reserve_limit_refuses_bob_while_alice_writes(node: NodeProcess) -> None:
    nb, na = namespace("bob"), namespace("alice")
    ch, s = stub(node)
    with ch:
        r = s.Reserve(pb.ReserveRequest(blocks=infos(nb, 6, 100)), timeout=10, metadata=BOB_MD)
        st = [x.status for x in r.reservations]
        assert st == [pb.KEY_STATUS_OK] * 4 + [pb.KEY_STATUS_NO_SPACE] * 2  # 4 x 64 KiB fill his 256 KiB
        ids = [x.reservation_id for x in r.reservations if x.status == pb.KEY_STATUS_OK]
        assert held(node, "bob")["reserved"] == 4 * BLOCK
        with pytest.raises(grpc.RpcError) as ei:
            s.Reserve(pb.ReserveRequest(blocks=infos(nb, 1, 200)), timeout=10, metadata=BOB_MD)
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_reserved_bytes=262144" in ei.value.details() and "[tenants.bob]" in ei.value.details()
        # through the SDK: the same refusal, typed
        kb, db = blocks(nb, 1, 300)
        with KVClient(node.unix, token=BOB) as bob:
            with pytest.raises(CapacityExceeded, match="max_reserved_bytes"):
                bob.put(kb[0], db[0], namespace=nb)
        # alice is not held back by bob's unfinished writes, on any path
        ka, da = blocks(na, 8, 400)
        for target in (node.unix, node.tcp):
            with KVClient(target, token=ALICE) as alice:
                assert alice.put_many(ka, da, namespace=na) == [True] * 8
        # abort and commit give bob's bytes back
        s.Abort(pb.AbortRequest(reservation_ids=ids[:2]), timeout=10, metadata=BOB_MD)
        assert held(node, "bob")["reserved"] == 2 * BLOCK
        c = s.Commit(pb.CommitRequest(reservation_ids=ids[2:]), timeout=10, metadata=BOB_MD)
        assert list(c.statuses) == [pb.KEY_STATUS_OK] * 2
        assert held(node, "bob")["reserved"] == 0
        with KVClient(node.unix, token=BOB) as bob:
            assert bob.put(kb[0], db[0], namespace=nb)


def test_a_put_stream_over_the_limit_stores_what_fits(node: NodeProcess) -> None:
    """The gRPC streaming fallback commits a batch at its end: the blocks past bob's limit
    answer NO_SPACE (the SDK reports them not stored), the others are stored."""
    nb = namespace("bob")
    kb, db = blocks(nb, 6, 500)
    with KVClient(node.tcp, token=BOB, transport="grpc-stream") as bob:
        assert bob.put_many(kb, db, namespace=nb) == [True] * 4 + [False] * 2
        assert bob.exists(kb) == [True] * 4 + [False] * 2


def test_unfinished_writes_are_reclaimed_and_their_bytes_given_back(node: NodeProcess) -> None:
    nb = namespace("bob")
    ch, s = stub(node)
    with ch:
        r = s.Reserve(pb.ReserveRequest(blocks=infos(nb, 4, 600)), timeout=10, metadata=BOB_MD)
        assert [x.status for x in r.reservations] == [pb.KEY_STATUS_OK] * 4
        assert held(node, "bob")["reserved"] == 4 * BLOCK
        # reservation_ttl_s = 2: the reaper reclaims them, and bob may reserve again
        wait_for(lambda: held(node, "bob")["reserved"] == 0, 10, "bob's reservations to be reclaimed")
        c = s.Commit(
            pb.CommitRequest(reservation_ids=[x.reservation_id for x in r.reservations]), timeout=10, metadata=BOB_MD
        )
        assert list(c.statuses) == [pb.KEY_STATUS_EXPIRED] * 4


def test_pin_limit_refuses_bob_while_alice_pins(node: NodeProcess) -> None:
    nb, na = namespace("bob"), namespace("alice")
    kb, db = blocks(nb, 3, 700)
    ka, da = blocks(na, 3, 800)
    with KVClient(node.unix, token=BOB) as bob, KVClient(node.unix, token=ALICE) as alice:
        assert bob.put_many(kb, db, namespace=nb) == [True] * 3
        assert alice.put_many(ka, da, namespace=na) == [True] * 3
        assert bob.pin(kb[:2], 60) == 2
        assert held(node, "bob")["pinned"] == 2 * BLOCK
        with pytest.raises(CapacityExceeded, match=r"tenant 'bob' has 131072 bytes pinned and max_pinned_bytes=131072"):
            bob.pin(kb[2:], 60)
        assert bob.pin(kb[:2], 60) == 2  # his own pins again: no new charge
        assert alice.pin(ka, 60) == 3  # no limit of hers
        assert held(node, "bob")["pinned"] == 2 * BLOCK
        assert bob.unpin(kb[:1]) == 1
        assert held(node, "bob")["pinned"] == BLOCK
        assert bob.pin(kb[2:], 60) == 1
        assert bob.delete(kb) == 3  # deleting pinned blocks ends their pins
        assert held(node, "bob")["pinned"] == 0
        assert alice.unpin(ka) == 3


def test_pins_last_at_most_max_pin_ttl(node: NodeProcess) -> None:
    nb = namespace("bob")
    kb, db = blocks(nb, 2, 900)
    with KVClient(node.unix, token=BOB) as bob:
        assert bob.put_many(kb, db, namespace=nb) == [True] * 2
        assert bob.pin(kb, math.inf) == 2  # accepted, and cut to max_pin_ttl_s = 2
        assert held(node, "bob")["pinned"] == 2 * BLOCK
        wait_for(lambda: held(node, "bob")["pinned"] == 0, 10, "bob's pins to expire at max_pin_ttl_s")
    with KVClient(node.unix, token=ADMIN) as admin:
        assert admin.pin(kb, 1e9) == 2  # the admin's pins are capped too
        assert admin.stats()["pins"] >= 2
        wait_for(lambda: admin.stats()["pins"] == 0, 10, "the admin's pins to expire at max_pin_ttl_s")


@pytest.mark.parametrize(
    "bad, message",
    [
        ('max_pinned_bytes = "lots"', "tenants.bob.max_pinned_bytes: not a size: 'lots'"),
        ("max_reserved_bytes = -1", "tenants.bob.max_reserved_bytes: size must be non-negative"),
        ("max_pin_bytes = 1", "tenants.bob.max_pin_bytes: Extra inputs are not permitted"),
    ],
)
def test_a_bad_limit_stops_the_node_with_a_clear_error(tmp_path: Path, bad: str, message: str) -> None:
    cfg = tmp_path / "node.toml"
    cfg.write_text(f'[node]\ntoken = "{ADMIN}"\n\n[tenants.bob]\ntoken = "{BOB}"\n{bad}\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    p = subprocess.run(
        [sys.executable, "-m", "kvstore", "serve", "--config", str(cfg), "--data-dir", str(tmp_path / "d")],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=ROOT,
    )
    assert p.returncode != 0
    assert message in p.stdout + p.stderr

"""Tenants in a cluster: a namespace has one owner cluster-wide, agreed in etcd.

A real etcd and real ``kvstore serve`` processes (three nodes with the tenants alice and bob
and an admin token).  What must hold: the first tenant to write a namespace, through any
node, owns it on every node, including nodes it never wrote to, and two tenants racing for
a namespace through different nodes end with exactly one owner everywhere; with etcd down,
a tenant write to a namespace no node has claimed fails ``Unavailable`` (clear message)
while namespaces already known keep working; a restarted node keeps enforcing what it knew
(etcd down) and takes etcd's word over its cache (etcd up); ``kvstore cluster owners`` and
``kvstore cluster release`` show and hand back namespaces, and a namespace taken from a
tenant loses its blocks on every node.

The first tests drive ``kvstore.cluster.etcd``'s owner calls against etcd alone.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cluster_fixtures import Cluster, wait_until
from conftest import ROOT

from client import KVClient, Namespace, PermissionDenied, Timeouts, Unavailable, chunk_keys
from kvstore.cluster.etcd import ClusterStore, ClusterWatcher, EtcdSession, OwnersUpdate, claim_owners, list_owners
from kvstore.cluster.local_etcd import LocalEtcd, find_etcd
from kvstore.cluster.state import owner_key
from kvstore.errors import OwnershipUnavailable

pytestmark = pytest.mark.skipif(
    find_etcd() is None, reason="etcd is not installed (Debian: apt-get install etcd-server)"
)

ADMIN, ALICE, BOB = "admin-secret", "alice-secret", "bob-secret"
TOKENS = {"alice": ALICE, "bob": BOB}
CHUNK = 4
BLOCK = 16 * 1024
NODES = ("n1", "n2", "n3")


def namespace(label: str) -> Namespace:
    return Namespace("tiny-model", chunk_tokens=CHUNK, tenant_salt=f"{label}-{uuid.uuid4().hex}")


def blocks(ns: Namespace, n: int = 2, seed: int = 0) -> tuple[list[bytes], list[np.ndarray]]:
    keys = chunk_keys(range(seed, seed + n * CHUNK), ns)
    return keys, [np.random.default_rng(seed + i).integers(0, 256, BLOCK, dtype=np.uint8) for i in range(n)]


def kvctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvstore", *args], capture_output=True, text=True, cwd=ROOT, timeout=60
    )


# -- etcd alone: the owner records ---------------------------------------------------------------


@pytest.fixture(scope="module")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalEtcd]:
    server = LocalEtcd(tmp_path_factory.mktemp("etcd")).start()
    try:
        yield server
    finally:
        server.stop()


def test_claims_are_create_if_absent_and_races_have_one_winner(etcd_server: LocalEtcd) -> None:
    cluster = f"o{uuid.uuid4().hex[:8]}"

    async def main() -> None:
        a, b = EtcdSession(etcd_server.endpoint), EtcdSession(etcd_server.endpoint)
        try:
            fps = [os.urandom(8) for _ in range(30)]
            # every namespace raced by two tenants through two sessions (two nodes): both hear one owner
            res = await asyncio.gather(
                *(
                    asyncio.gather(
                        claim_owners(a, cluster, [fp], "alice", "n1"), claim_owners(b, cluster, [fp], "bob", "n2")
                    )
                    for fp in fps
                )
            )
            for fp, (ga, gb) in zip(fps, res):
                assert ga[fp].tenant == gb[fp].tenant in ("alice", "bob")
                assert ga[fp].revision == gb[fp].revision > 0
            owners, revision = await list_owners(a, cluster)
            assert {fp: r.tenant for fp, r in owners.items()} == {fp: ga[fp].tenant for fp, (ga, _) in zip(fps, res)}
            assert set(owners) == set(fps) and revision > 0
            # all or nothing: a batch holding bob's namespace claims none of alice's new ones
            bobs = os.urandom(8)
            assert (await claim_owners(b, cluster, [bobs], "bob"))[bobs].tenant == "bob"
            fresh = os.urandom(8)
            got = await claim_owners(a, cluster, [fresh, bobs], "alice")
            assert got[bobs].tenant == "bob" and fresh not in got
            assert fresh not in (await list_owners(a, cluster))[0]
            # a batch mixing alice's own namespaces and new ones: the new ones are claimed
            alices = [os.urandom(8) for _ in range(3)]
            await claim_owners(a, cluster, alices, "alice")
            got = await claim_owners(a, cluster, [*alices, fresh], "alice", "n1")
            assert {r.tenant for r in got.values()} == {"alice"} and set(got) == {*alices, fresh}
            assert got[fresh].node == "n1" and got[fresh].revision > revision
            # release and reassign (the CLI's calls)
            store = ClusterStore(etcd_server.endpoint, cluster)
            try:
                old = await store.release_owner(fresh)
                assert old is not None and old.tenant == "alice"
                assert await store.release_owner(fresh) is None
                assert (await store.release_owner(bobs, to="alice")).tenant == "bob"  # type: ignore[union-attr]
                owners2, _ = await store.owners()
                assert fresh not in owners2 and owners2[bobs].tenant == "alice"
            finally:
                await store.close()
        finally:
            await a.close()
            await b.close()

    asyncio.run(main())


def test_watcher_passes_owners_to_nodes_only(etcd_server: LocalEtcd) -> None:
    """A node's watcher (``on_owners``) gets every owner at each load and each change after;
    the snapshot (what clients see) carries none, and an owner change publishes no snapshot."""
    cluster = f"w{uuid.uuid4().hex[:8]}"

    async def main() -> None:
        s = EtcdSession(etcd_server.endpoint)
        fp1, fp2 = os.urandom(8), os.urandom(8)
        await claim_owners(s, cluster, [fp1], "alice")
        updates: list[OwnersUpdate] = []
        snaps: list[Any] = []
        w = ClusterWatcher(etcd_server.endpoint, cluster, snaps.append, on_owners=updates.append)
        task = asyncio.ensure_future(w.run())
        try:
            for _ in range(200):
                if updates:
                    break
                await asyncio.sleep(0.02)
            first = updates[0]
            assert first.full and set(first.records) == {fp1} and first.records[fp1].tenant == "alice"  # type: ignore[union-attr]
            assert first.etcd_cluster_id != 0 and len(snaps) == 1 and not hasattr(snaps[0], "owners")
            await claim_owners(s, cluster, [fp2], "bob")
            await s.run(lambda c: c.delete(owner_key(cluster, fp1)))
            for _ in range(200):
                if len(updates) >= 3:
                    break
                await asyncio.sleep(0.02)
            assert [(u.full, u.records) for u in updates[1:3]] == [
                (False, {fp2: updates[1].records[fp2]}),
                (False, {fp1: None}),
            ]
            assert updates[1].records[fp2].tenant == "bob" and len(snaps) == 1  # type: ignore[union-attr]
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await w.close()
            await s.close()

    asyncio.run(main())


# -- a cluster of nodes with tenants ---------------------------------------------------------------


def write_config(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "admin.token").write_text(ADMIN + "\n")
    cfg = d / "node.toml"
    cfg.write_text(
        f'[node]\ntoken_file = "{d / "admin.token"}"\n\n[tenants.alice]\ntoken = "{ALICE}"\n\n[tenants.bob]\ntoken = "{BOB}"\n'
    )
    return cfg


class TenantCluster(Cluster):
    def __init__(self, etcd: LocalEtcd, tmp: Path) -> None:
        super().__init__(etcd, tmp)
        self.config = write_config(tmp / "config")
        self._direct: list[KVClient] = []

    def start_nodes(self, *ids: str, synced: bool = True) -> None:
        """``synced``: etcd is up, so each node has reconciled its cache with etcd before READY."""
        procs = self.start(*ids, extra=("--config", str(self.config)))
        for p in procs:
            assert p.endpoints.get("owners_synced") is synced, p.endpoints

    def node(self, node_id: str, tenant: str, path: str = "tcp") -> KVClient:
        """A client of one node (not the cluster client: each node's own answer)."""
        n = self.nodes[node_id]
        c = KVClient(
            n.unix if path == "shm" else n.tcp,
            token=TOKENS.get(tenant, ADMIN),
            timeouts=Timeouts(rpc=10, data=10, connect=5),
        )
        self._direct.append(c)
        return c

    def owners(self) -> dict[str, Any]:
        r = kvctl("cluster", "owners", "--json", "--etcd", self.etcd.endpoint, "--cluster", self.name)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)["owners"]

    def close(self) -> None:
        for c in self._direct:
            c.close()
        super().close()


@pytest.fixture(scope="module")
def tc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TenantCluster]:
    tmp = tmp_path_factory.mktemp("tenant-cluster")
    server = LocalEtcd(tmp / "etcd").start()
    c = TenantCluster(server, tmp)
    try:
        c.start_nodes(*NODES)
        yield c
    finally:
        c.close()
        server.stop()


def put(c: KVClient, ns: Namespace, seed: int = 0, n: int = 2) -> tuple[list[bytes], list[np.ndarray]]:
    keys, datas = blocks(ns, n, seed)
    assert c.put_many(keys, datas, namespace=ns) == [True] * n
    return keys, datas


def test_a_squatter_owns_the_namespace_on_every_node(tc: TenantCluster) -> None:
    """bob claims alice's (guessable) namespace through n1 before alice writes anywhere:
    alice is refused on every node, and nowhere can she end up with a namespace half hers."""
    ns = namespace("squat")
    put(tc.node("n1", "bob"), ns, seed=1)
    for nid in NODES:
        with pytest.raises(PermissionDenied, match="belongs to another tenant"):
            tc.node(nid, "alice").put_many(*blocks(ns, 2, 2), namespace=ns)
    assert tc.owners()[ns.fingerprint.hex()]["tenant"] == "bob"
    assert tc.owners()[ns.fingerprint.hex()]["node"] == "n1"


def test_the_first_writer_owns_the_namespace_on_every_node(tc: TenantCluster) -> None:
    """alice writes first, through n2 only: bob is refused on n1 and n3 too (never written
    there), and her blocks are misses to him."""
    ns = namespace("first")
    keys, datas = put(tc.node("n2", "alice"), ns, seed=3)
    for nid in ("n1", "n3", "n2"):
        with pytest.raises(PermissionDenied):
            tc.node(nid, "bob").put(os.urandom(16), b"x" * 64, namespace=ns)
    assert tc.node("n2", "bob").get_many(keys) == [None, None]
    assert tc.node("n2", "alice").get_many(keys) == [d.tobytes() for d in datas]
    # and on the nodes that learnt of her claim from etcd, her writes go through
    put(tc.node("n3", "alice"), ns, seed=4)
    # the cluster client: each tenant through every owner of a block
    alice, bob = tc.client(token=ALICE, replication=3), tc.client(token=BOB, replication=3)
    assert alice.wait_for_nodes(3, 10) and bob.wait_for_nodes(3, 10)
    ks, ds = blocks(ns, 3, 5)
    assert alice.put_many(ks, ds, namespace=ns) == [True] * 3
    assert bob.get_many(ks) == [None] * 3 and alice.get_many(ks) == [d.tobytes() for d in ds]
    with pytest.raises(PermissionDenied):
        bob.put_many(*blocks(ns, 1, 6), namespace=ns)


def test_invalidation_keeps_the_namespace_with_its_owner(tc: TenantCluster) -> None:
    """A new epoch is a new fingerprint; bob writing it first still does not get it."""
    from kvstore.cluster.membership import Membership
    from kvstore.cluster.state import effective_fingerprint

    ns = namespace("epoch")
    alice = tc.client(token=ALICE, replication=3)
    assert alice.wait_for_nodes(3, 10)
    assert all(alice.put_many(*blocks(ns, 2, 50), namespace=ns))
    assert alice.invalidate(ns) >= 0 and alice.epoch(ns) == 1
    with Membership(tc.etcd.endpoint, tc.name) as view:
        assert view.wait_for(lambda s: s.epoch(ns.fingerprint) == 1, 10) is not None
    time.sleep(1.0)  # the nodes' watches deliver the bump as the view's did (milliseconds)
    new = effective_fingerprint(ns.fingerprint, 1)
    for nid in NODES:
        with pytest.raises(PermissionDenied):
            tc.node(nid, "bob").put(os.urandom(16), b"x" * 64, namespace=new)
    assert tc.owners()[new.hex()]["tenant"] == "alice"
    keys = alice.chunk_keys(range(8), ns)
    assert alice.put_many(keys, [b"k" * 64] * 2, namespace=ns) == [True, True]


def test_concurrent_first_writes_leave_one_owner_everywhere(tc: TenantCluster) -> None:
    """alice through n1 and bob through n2, at the same moment, for each of several namespaces."""
    spaces = [namespace(f"race{i}") for i in range(6)]
    results: dict[tuple[int, str], object] = {}
    clients = {"alice": tc.node("n1", "alice"), "bob": tc.node("n2", "bob")}
    for c in clients.values():
        c.stats()  # connected before the race starts
    barrier = threading.Barrier(2)

    def race(tenant: str) -> None:
        barrier.wait()
        for i, ns in enumerate(spaces):
            try:
                results[i, tenant] = clients[tenant].put_many(*blocks(ns, 2, 10 + i), namespace=ns)
            except PermissionDenied as e:
                results[i, tenant] = e

    threads = [threading.Thread(target=race, args=(t,)) for t in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    owners = tc.owners()
    for i, ns in enumerate(spaces):
        won = [t for t in clients if results[i, t] == [True, True]]
        lost = [t for t in clients if isinstance(results[i, t], PermissionDenied)]
        assert len(won) == 1 and len(lost) == 1, results
        assert owners[ns.fingerprint.hex()]["tenant"] == won[0]
        for nid in NODES:  # every node agrees
            with pytest.raises(PermissionDenied):
                tc.node(nid, lost[0]).put(os.urandom(16), b"x", namespace=ns)
            assert tc.node(nid, won[0]).put(os.urandom(16), b"y" * 64, namespace=ns)


def test_owners_and_release_cli(tc: TenantCluster) -> None:
    ns, other = namespace("cli"), namespace("cli-other")
    keys, datas = put(tc.node("n1", "bob"), ns, seed=20)  # bob squats
    put(tc.node("n2", "alice"), other, seed=21)
    common = ("--etcd", tc.etcd.endpoint, "--cluster", tc.name)
    r = kvctl("cluster", "owners", *common)
    assert r.returncode == 0 and ns.fingerprint.hex() in r.stdout and "bob" in r.stdout, r.stderr
    assert tc.owners()[other.fingerprint.hex()]["tenant"] == "alice"
    # hand it back: every node forgets bob's claim and drops his blocks
    r = kvctl("cluster", "release", ns.fingerprint.hex(), *common)
    assert r.returncode == 0 and "released (was tenant 'bob')" in r.stdout, r.stderr
    assert ns.fingerprint.hex() not in tc.owners()
    wait_until(lambda: tc.node("n1", "admin").exists(keys) == [False, False], 10, "n1 to drop bob's blocks")
    ka, _ = blocks(ns, 2, 22)
    wait_until(lambda: _put_ok(tc.node("n3", "alice"), ns, 22), 10, "n3 to forget bob's claim")
    for nid in NODES:
        wait_until(lambda nid=nid: _refused(tc.node(nid, "bob"), ns), 10, f"{nid} to enforce alice's claim")
    assert tc.owners()[ns.fingerprint.hex()]["tenant"] == "alice"
    # reassign: given to bob, her blocks go
    r = kvctl("cluster", "release", ns.fingerprint.hex(), "--to", "bob", *common)
    assert r.returncode == 0 and "given to tenant 'bob' (was tenant 'alice')" in r.stdout, r.stderr
    wait_until(lambda: tc.node("n3", "admin").exists(ka) == [False, False], 10, "n3 to drop alice's blocks")
    wait_until(lambda: _refused(tc.node("n3", "alice"), ns), 10, "n3 to enforce the reassignment")
    wait_until(lambda: _put_ok(tc.node("n1", "bob"), ns), 10, "n1 to enforce the reassignment")
    # mistakes
    r = kvctl("cluster", "release", os.urandom(8).hex(), *common)
    assert r.returncode == 2 and "has no owner" in r.stderr
    r = kvctl("cluster", "release", "llama-3-8b", *common)
    assert r.returncode == 2 and "16 hex digits" in r.stderr
    r = kvctl("cluster", "release", ns.fingerprint.hex(), "--to", "no/such", *common)
    assert r.returncode == 2 and "not a tenant name" in r.stderr


def _refused(c: KVClient, ns: Namespace) -> bool:
    try:
        c.put(os.urandom(16), b"probe", namespace=ns)
    except PermissionDenied:
        return True
    return False


def test_etcd_down_fails_closed_for_new_namespaces_only(tc: TenantCluster) -> None:
    known = namespace("known")
    put(tc.node("n1", "alice"), known, seed=30)
    for nid in NODES:  # every node has it cached (from the watch, or from the claim's answer)
        wait_until(lambda nid=nid: _refused(tc.node(nid, "bob"), known), 10, f"{nid} to know alice's claim")
    tc.etcd.stop()
    try:
        fresh = namespace("fresh")
        for nid in ("n1", "n2"):
            with pytest.raises(OwnershipUnavailable, match="etcd .* is unreachable") as ei:
                tc.node(nid, "bob").put_many(*blocks(fresh, 1, 31), namespace=fresh)
            assert fresh.fingerprint.hex() in str(ei.value) and "retry when etcd is back" in str(ei.value)
            assert isinstance(ei.value, Unavailable) and "[UNAVAILABLE]" in str(ei.value)
        for nid in NODES:  # known namespaces keep working, and stay enforced
            put(tc.node(nid, "alice"), known, seed=32)
            assert _refused(tc.node(nid, "bob"), known)
        assert tc.node("n2", "admin").put(os.urandom(16), b"admin", namespace=fresh)  # the admin claims nothing
    finally:
        tc.etcd.start()
    wait_until(lambda: _put_ok(tc.node("n1", "bob"), fresh), 30, "bob's claim once etcd is back")
    assert tc.owners()[fresh.fingerprint.hex()]["tenant"] == "bob"


def _put_ok(c: KVClient, ns: Namespace, seed: int | None = None) -> bool:
    """A put succeeds (False while the node refuses it: it has not seen etcd's change yet)."""
    try:
        if seed is None:
            return c.put(os.urandom(16), b"probe", namespace=ns)
        return c.put_many(*blocks(ns, 2, seed), namespace=ns) == [True, True]
    except (Unavailable, PermissionDenied):
        return False


def test_a_restarted_node_enforces_its_cache_then_etcd(tc: TenantCluster) -> None:
    """n3 restarts while etcd is down: it enforces what it knew.  Then, while n3 is away with
    etcd up, alice's namespace is released and bob claims it: n3 comes back, etcd wins over its
    cache, and alice's blocks it kept on NVMe are dropped."""
    ns = namespace("restart")
    keys, datas = put(tc.node("n3", "alice"), ns, seed=40)
    assert tc.nodes["n3"].stop() == 0
    tc.etcd.stop()
    try:
        tc.start_nodes("n3", synced=False)
        assert _refused(tc.node("n3", "bob"), ns)
        assert tc.node("n3", "bob").get_many(keys) == [None, None]
        assert tc.node("n3", "alice").get_many(keys) == [d.tobytes() for d in datas]
        put(tc.node("n3", "alice"), ns, seed=41)
    finally:
        tc.etcd.start()
    assert tc.nodes["n3"].stop() == 0
    common = ("--etcd", tc.etcd.endpoint, "--cluster", tc.name)
    assert kvctl("cluster", "release", ns.fingerprint.hex(), *common).returncode == 0
    # n1 refuses bob until its watch (back from the outage) shows the release
    wait_until(lambda: _put_ok(tc.node("n1", "bob"), ns, 42), 15, "n1 to see the release")
    tc.start_nodes("n3")
    assert _refused(tc.node("n3", "alice"), ns)  # etcd's word, from the start
    assert tc.node("n3", "admin").exists(keys) == [False, False] or wait_until(
        lambda: tc.node("n3", "admin").exists(keys) == [False, False], 10, "n3 to drop alice's blocks"
    )
    assert "etcd wins" in "".join(tc.nodes["n3"].output)

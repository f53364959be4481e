"""Namespace ownership in cluster mode, without etcd: :class:`kvstore.node.tenants.Ownership` as a
durable cache of an owner authority (a fake standing in for ``OwnerRegistry``), and the
node-side follower that keeps it in step with etcd's ``owners/`` records.

What must hold: a namespace the cache does not know is claimed through the authority and
whatever it answers is enforced and durable; an unreachable authority refuses writes to
unknown namespaces (``Unavailable`` naming etcd) while known ones keep working; etcd wins
every conflict (watch events, full loads at start-up), a release or reassignment drops the
namespace's blocks; the cache survives a restart with the etcd it agreed with.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from kvstore.cluster.etcd import OwnersUpdate
from kvstore.cluster.owners import OwnersFollower
from kvstore.cluster.state import OwnerRecord
from kvstore.errors import OwnershipUnavailable, PermissionDenied, Unavailable
from kvstore.node.tenants import Caller, Ownership

NS_A, NS_B, NS_C = b"A" * 8, b"B" * 8, b"C" * 8
ALICE, BOB = Caller("alice"), Caller("bob")


class FakeEtcd:
    """Create-if-absent, all or nothing per batch, like ``kvstore.cluster.etcd.claim_owners``."""

    where = "etcd at fake:2379"

    def __init__(self) -> None:
        self.owners: dict[bytes, tuple[str, int]] = {}
        self.revision = 100
        self.down = False
        self.calls: Counter[str] = Counter()
        self.delay = 0.0

    async def claim(self, namespaces: list[bytes], tenant: str) -> dict[bytes, tuple[str, int]]:
        self.calls[tenant] += 1
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.down:
            raise Unavailable("claiming a namespace: etcd at fake:2379 is unreachable (ConnectionRefusedError)")
        taken = {ns: self.owners[ns] for ns in namespaces if ns in self.owners}
        if any(t != tenant for t, _ in taken.values()):
            return taken
        self.revision += 1
        for ns in namespaces:
            self.owners.setdefault(ns, (tenant, self.revision))
        return {ns: self.owners[ns] for ns in namespaces}

    async def close(self) -> None:
        pass


def clustered(tmp_path: Path, etcd: FakeEtcd) -> Ownership:
    return Ownership(tmp_path / "owners.lmdb", authority=etcd)


def test_unknown_namespace_is_claimed_through_etcd_and_cached_durably(tmp_path: Path) -> None:
    etcd = FakeEtcd()

    async def main() -> None:
        o = clustered(tmp_path, etcd)
        await o.claim(ALICE, {NS_A})
        assert o.owner(NS_A) == "alice" and etcd.owners[NS_A][0] == "alice"
        await o.claim(ALICE, {NS_A})  # known now: no second round trip
        assert etcd.calls["alice"] == 1
        # bob claimed NS_B through another node: this node learns it from the claim's answer
        etcd.owners[NS_B] = ("bob", 7)
        with pytest.raises(PermissionDenied, match="belongs to another tenant"):
            await o.claim(ALICE, {NS_B})
        assert o.owner(NS_B) == "bob"
        with pytest.raises(PermissionDenied):
            await o.claim(ALICE, {NS_B})
        assert etcd.calls["alice"] == 2  # the second refusal came from the cache
        # all or nothing: a batch with bob's namespace claims none of the others
        with pytest.raises(PermissionDenied):
            await o.claim(ALICE, {NS_B, NS_C})
        assert NS_C not in etcd.owners and o.owner(NS_C) is None
        o.close()

    asyncio.run(main())
    reopened = Ownership(tmp_path / "owners.lmdb")  # durable: a restart while etcd is down still knows
    assert reopened.table() == {NS_A: "alice", NS_B: "bob"}
    reopened.close()


def test_etcd_unreachable_refuses_unknown_namespaces_only(tmp_path: Path) -> None:
    etcd = FakeEtcd()

    async def main() -> None:
        o = clustered(tmp_path, etcd)
        await o.claim(ALICE, {NS_A})
        etcd.down = True
        with pytest.raises(OwnershipUnavailable) as ei:  # an Unavailable: the node is up, etcd is not
            await o.claim(BOB, {NS_B})
        msg = str(ei.value)
        assert NS_B.hex() in msg and "etcd at fake:2379 is unreachable" in msg and "retry when etcd is back" in msg
        assert o.owner(NS_B) is None  # never a local claim another node could contradict
        await o.claim(ALICE, {NS_A})  # known: no etcd needed
        with pytest.raises(PermissionDenied):
            await o.claim(BOB, {NS_A})  # and still enforced
        etcd.down = False
        await o.claim(BOB, {NS_B})
        assert o.owner(NS_B) == "bob"
        o.close()

    asyncio.run(main())


def test_concurrent_claims_on_one_node_make_one_round_trip(tmp_path: Path) -> None:
    etcd = FakeEtcd()
    etcd.delay = 0.05

    async def main() -> None:
        o = clustered(tmp_path, etcd)
        got = await asyncio.gather(
            o.claim(ALICE, {NS_A}), o.claim(BOB, {NS_A}), o.claim(ALICE, {NS_A}), return_exceptions=True
        )
        assert got[0] is None and got[2] is None and isinstance(got[1], PermissionDenied)
        assert sum(etcd.calls.values()) == 1 and o.owner(NS_A) == "alice"
        o.close()

    asyncio.run(main())


def test_watch_events_newer_wins_and_losing_a_namespace_is_reported(tmp_path: Path) -> None:
    etcd = FakeEtcd()
    lost: list[set[bytes]] = []

    async def main() -> None:
        o = clustered(tmp_path, etcd)
        o.on_lost = lost.append
        await o.claim(ALICE, {NS_A})
        rev = etcd.owners[NS_A][1]
        assert o.apply({NS_A: ("alice", rev)}) is None and not lost  # the watch repeats the claim
        await o.apply({NS_B: ("bob", 200)})  # a claim through another node
        assert o.owner(NS_B) == "bob" and not lost
        await o.apply({NS_B: (None, 210)})  # released
        assert o.owner(NS_B) is None and lost == [{NS_B}]
        assert o.apply({NS_B: ("bob", 200)}) is None and o.owner(NS_B) is None  # an older event: ignored
        await o.apply({NS_A: ("bob", rev + 1)})  # reassigned by an operator
        assert o.owner(NS_A) == "bob" and lost[-1] == {NS_A}
        await o.claim(BOB, {NS_A})
        with pytest.raises(PermissionDenied):
            await o.claim(ALICE, {NS_A})
        o.close()

    asyncio.run(main())
    reopened = Ownership(tmp_path / "owners.lmdb")
    assert reopened.table() == {NS_A: "bob"}
    reopened.close()


def test_full_load_etcd_wins_and_releases_while_away_are_forgotten(tmp_path: Path) -> None:
    etcd = FakeEtcd()
    lost: list[set[bytes]] = []

    async def main() -> None:
        o = clustered(tmp_path, etcd)
        o.on_lost = lost.append
        await o.claim(ALICE, {NS_A})
        await o.claim(ALICE, {NS_B})
        unconfirmed, task = o.sync({NS_A: ("alice", 101), NS_B: ("alice", 102)}, 150, "c@1")
        await task
        assert unconfirmed == {} and o.synced_with == "c@1"
        o.close()

    asyncio.run(main())
    # the node was away: NS_A was released, NS_B given to bob, NS_C claimed by bob
    o2 = Ownership(tmp_path / "owners.lmdb", authority=etcd)
    assert o2.synced_with == "c@1" and o2.table() == {NS_A: "alice", NS_B: "alice"}

    async def restart() -> None:
        o2.on_lost = lost.append
        unconfirmed, task = o2.sync({NS_B: ("bob", 300), NS_C: ("bob", 301)}, 310, "c@1")
        await task
        assert unconfirmed == {}
        assert o2.table() == {NS_B: "bob", NS_C: "bob"}
        assert set().union(*lost) == {NS_A, NS_B}  # both were taken from alice: their blocks go
        with pytest.raises(PermissionDenied):
            await o2.claim(ALICE, {NS_B})
        o2.close()

    asyncio.run(restart())
    o3 = Ownership(tmp_path / "owners.lmdb")
    assert o3.table() == {NS_B: "bob", NS_C: "bob"}
    o3.close()


def test_first_load_keeps_and_returns_namespaces_etcd_never_knew(tmp_path: Path) -> None:
    """Tenants used on a single node, which then joins a cluster: its claims are offered to
    etcd, not forgotten; a different etcd (a new cluster id) is a first load again."""

    async def single() -> None:
        o = Ownership(tmp_path / "owners.lmdb")
        await o.claim(ALICE, {NS_A})
        await o.claim(BOB, {NS_B})
        o.close()

    asyncio.run(single())
    etcd = FakeEtcd()

    async def join() -> None:
        o = clustered(tmp_path, etcd)
        unconfirmed, _ = o.sync({NS_B: ("alice", 120)}, 150, "c@1")  # alice claimed NS_B first, elsewhere
        assert unconfirmed == {NS_A: "alice"} and o.owner(NS_A) == "alice"  # still enforced meanwhile
        assert o.owner(NS_B) == "alice" and o.synced_with is None
        # a claim newer than the load is kept (it happened while the load was on its way)
        await o.claim(BOB, {NS_C})
        unconfirmed, task = o.sync({NS_B: ("alice", 120)}, etcd.owners[NS_C][1] - 1, "c@1")
        assert o.owner(NS_C) == "bob" and NS_C not in unconfirmed
        await o.confirmed("c@1")
        assert o.synced_with == "c@1"
        # a new etcd (data lost): what the node knows is offered again, not dropped
        unconfirmed, _ = o.sync({}, 5, "c@2")
        assert set(unconfirmed) == {NS_A, NS_B, NS_C} and len(o) == 3
        o.close()

    asyncio.run(join())


class FakeManager:
    def __init__(self) -> None:
        self.invalidated: list[bytes] = []
        self.counters: Counter[str] = Counter()

    async def drop_namespaces(self, namespaces: set[bytes], *, why: str | None = None) -> int:
        """TierManager.drop_namespaces as the follower sees it: 3 blocks per namespace."""
        self.invalidated.extend(sorted(namespaces))
        if why == "owner_change":
            self.counters["owner_change_dropped_blocks"] += 3 * len(namespaces)
        return 3 * len(namespaces)


def test_follower_confirms_cache_only_owners_and_drops_lost_namespaces(tmp_path: Path) -> None:
    async def main() -> None:
        single = Ownership(tmp_path / "owners.lmdb")
        await single.claim(ALICE, {NS_A})
        await single.claim(ALICE, {NS_B})
        single.close()
        etcd = FakeEtcd()
        etcd.owners[NS_B] = ("bob", 50)  # bob got NS_B in the cluster first
        o = clustered(tmp_path, etcd)
        manager = FakeManager()
        f = OwnersFollower(o, etcd, "c", manager)  # type: ignore[arg-type]
        f.on_owners(OwnersUpdate({NS_B: OwnerRecord(NS_B, "bob", revision=50)}, True, 60, 0xABC))
        assert f.synced.is_set() and o.owner(NS_B) == "bob"
        for _ in range(100):
            if o.synced_with is not None:
                break
            await asyncio.sleep(0.01)
        assert o.synced_with == "c@abc" and etcd.owners[NS_A][0] == "alice" and o.owner(NS_A) == "alice"
        for _ in range(100):
            if manager.invalidated:
                break
            await asyncio.sleep(0.01)
        assert manager.invalidated == [NS_B] and manager.counters["owner_change_dropped_blocks"] == 3
        # a release seen by the watch drops the namespace's blocks too
        f.on_owners(OwnersUpdate({NS_A: None}, False, 400))
        for _ in range(100):
            if len(manager.invalidated) == 2:
                break
            await asyncio.sleep(0.01)
        assert manager.invalidated == [NS_B, NS_A] and o.owner(NS_A) is None
        await f.stop()
        o.close()

    asyncio.run(main())


def test_owner_record_json_round_trip() -> None:
    r = OwnerRecord(NS_A, "alice", "n1", 12.5, revision=9)
    assert OwnerRecord.from_json(NS_A, r.to_json(), 9) == r
    for bad in (b"{}", b'{"tenant": ""}', b"[]", b"nope"):
        with pytest.raises(ValueError):
            OwnerRecord.from_json(NS_A, bad)


def test_follower_waits_for_nothing_when_etcd_agrees(tmp_path: Path) -> None:
    async def main() -> None:
        etcd = FakeEtcd()
        o = clustered(tmp_path, etcd)
        f = OwnersFollower(o, etcd, "c", FakeManager())  # type: ignore[arg-type]
        f.on_owners(OwnersUpdate({}, True, 10, 1))
        assert f.synced.is_set() and f._push is None
        await f.stop()
        await asyncio.sleep(0)
        o.close()
        reopened: Any = Ownership(tmp_path / "owners.lmdb")
        assert reopened.synced_with == "c@1"
        reopened.close()

    asyncio.run(main())


def test_a_later_epoch_is_claimed_for_the_earlier_epochs_owner(tmp_path: Path) -> None:
    """An invalidation (epoch bump) gives the namespace a new fingerprint; whoever writes it
    first, it goes to the tenant that owned the earlier epoch."""
    etcd = FakeEtcd()
    NS_A1 = b"a" * 8  # NS_A at epoch 1

    async def main() -> None:
        o = clustered(tmp_path, etcd)
        o.heir = lambda ns: o.owner(NS_A) if ns == NS_A1 else None
        await o.claim(ALICE, {NS_A})
        with pytest.raises(PermissionDenied):
            await o.claim(BOB, {NS_A1, NS_B})  # all or nothing: NS_B is not claimed either
        assert etcd.owners[NS_A1][0] == "alice" and NS_B not in etcd.owners
        await o.claim(ALICE, {NS_A1})
        await o.claim(BOB, {NS_B})
        o.close()

    asyncio.run(main())

"""Real network partitions: each node runs in its own network namespace (tests/netns.py)
and a partition silently drops its packets, which a killed process (refused
connections) or a stopped one (accepted, never answered) does not reproduce.

etcd, the test and its clients stay in the root namespace; the fixtures that place each
node in its own namespace are in tests/netns_cluster.py.

The invariants (architecture §9): a partitioned node's lease expires and clients route around
it; blocks with a surviving replica stay readable; a node cut off from etcd keeps serving
and re-registers when etcd is back; a peer that does not answer is a miss at its
deadline, never a hang or an exception.  Timings are printed, and asserted only against
generous bounds (a deadline plus a margin), never tightly.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
from cluster_fixtures import FAST, LEASE_TTL, wait_until
from conftest import NodeProcess
from netns import Network, probe
from netns_cluster import NetCluster, cluster, etcd, net  # noqa: F401 - fixtures

from client import KVClient, Timeouts, connect_async
from kvstore.errors import KVStoreError

# network namespaces, and deadlines measured across partitions: scripts/test.sh runs it on its own
pytestmark = pytest.mark.solo

T = TypeVar("T")
SIZE = 2048
BOUND = FAST["rpc"] + FAST["data"] + 2.0  # one call: the deadlines it may wait on, plus a margin
DROP_BOUND = LEASE_TTL + 4.0  # a cut node leaves the membership within its lease TTL, plus a margin
REJOIN_BOUND = 15.0  # a healed node registers again within this
HEALED_BOUND = 10.0  # clients reach a healed node again within this


# -- helpers ---------------------------------------------------------------------------------
def blocks(n: int, seed: int) -> tuple[list[bytes], list[bytes]]:
    rng = np.random.default_rng(seed)
    keys = [rng.bytes(16) for _ in range(n)]
    return keys, [rng.integers(0, 255, SIZE, dtype=np.uint8).tobytes() for _ in range(n)]


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    t = time.monotonic()
    v = fn()
    return v, time.monotonic() - t


def port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def reads_back(kv: KVClient, keys: list[bytes], data: list[bytes]) -> bool:
    """Whether a single-node client reads ``keys`` back (its errors, e.g. a deadline, are False)."""
    try:
        return kv.get_many(keys) == data
    except KVStoreError:
        return False


def check_advertised(cluster: NetCluster, kv: Any) -> None:
    """Each node advertises its namespace address (not 0.0.0.0, not its hostname)."""
    for nid, info in kv.snapshot().nodes.items():
        ip = cluster.net.hosts[nid].ip
        assert info.grpc.rsplit(":", 1)[0] == ip and info.data.rsplit(":", 1)[0] == ip, info
        assert cluster.nodes[nid].tcp == info.grpc


def start(cluster: NetCluster, *ids: str) -> Any:
    cluster.set("replication", 2)
    cluster.start(*ids)
    kv = cluster.client()
    assert kv.wait_for_nodes(len(ids), 10)
    check_advertised(cluster, kv)
    return kv


# -- scenarios -------------------------------------------------------------------------------
def test_partitioned_node_is_routed_around_dropped_and_rejoins_after_heal(cluster: NetCluster) -> None:
    """A node cut off from everything (clients and etcd) at R = 2."""
    kv = start(cluster, "p1", "p2", "p3")
    writer = cluster.client()  # its own back-off list: its first write meets the partition too
    keys, data = blocks(60, seed=10)
    assert all(kv.put_many(keys, data))
    assert writer.get_many(keys[:5]) == data[:5]  # it has connections to every node
    victim = "p2"
    owned = [i for i, k in enumerate(keys) if victim in kv.owners(k)]
    first = [i for i in owned if kv.owners(keys[i])[0] == victim]  # reads that go to it first
    assert first
    node = cluster.nodes[victim]
    cluster.net.cut(victim)
    t_cut = time.monotonic()
    assert probe(cluster.net.hosts[victim].ip, port(node.tcp)) == "timeout"  # dropped, not refused

    reads: list[float] = []
    writes: list[float] = []
    written: list[tuple[list[bytes], list[bytes]]] = []
    dropped_at = None
    while dropped_at is None or time.monotonic() - t_cut < dropped_at + 1.0:
        assert time.monotonic() - t_cut < DROP_BOUND + 5, "the partitioned node never left the membership"
        got, dt = timed(lambda: kv.get_many(keys))  # never raises
        reads.append(dt)
        assert got == data, f"wrong data {time.monotonic() - t_cut:.2f} s after the cut"
        assert dt < BOUND, (dt, reads)
        more = blocks(5, seed=100 + len(writes))
        stored, dt = timed(lambda more=more: writer.put_many(*more))
        writes.append(dt)
        assert stored == [True] * 5 and dt < BOUND, (stored, dt)
        written.append(more)
        if dropped_at is None and victim not in kv.nodes():
            dropped_at = time.monotonic() - t_cut
    assert dropped_at <= DROP_BOUND, dropped_at
    assert node.proc is not None and node.proc.poll() is None  # cut off, not dead
    assert sum(kv.miss_counts().values()) == 0  # every owner that failed was covered by the replica
    assert all(len(kv.owners(k)) == 2 and victim not in kv.owners(k) for k in keys)

    cluster.net.heal(victim)
    t_heal = time.monotonic()
    wait_until(lambda: sorted(kv.nodes()) == ["p1", "p2", "p3"], REJOIN_BOUND, f"{victim} to register again")
    rejoined = time.monotonic() - t_heal
    assert any("registering again" in line for line in node.output), "".join(node.output)
    check_advertised(cluster, kv)
    # its blocks are still there, readable through it: directly (a connection that lost packets
    # may take a few seconds to be replaced: see the regression test below), and routed to it
    direct = cluster.direct(victim)
    wait_until(
        lambda: reads_back(direct, [keys[i] for i in owned], [data[i] for i in owned]),
        HEALED_BOUND,
        f"reads through {victim}",
    )
    readable = time.monotonic() - t_heal
    fresh = cluster.client()
    locs = fresh.lookup_locations([keys[i] for i in first])
    assert all(loc is not None and loc[0] == victim for loc in locs), locs
    assert fresh.get_many(keys) == data
    # so is everything written during the partition, by every client
    for k, d in written:
        assert kv.get_many(k) == d and fresh.get_many(k) == d
    print(
        f"\npartition of 1/3 nodes, R=2: first read {reads[0] * 1000:.0f} ms, then median "
        f"{sorted(reads)[len(reads) // 2] * 1000:.1f} ms ({len(reads)} reads of {len(keys)} keys); first write "
        f"{writes[0] * 1000:.0f} ms; dropped from membership {dropped_at:.2f} s after the cut (lease {LEASE_TTL} s); "
        f"registered again {rejoined:.2f} s and read through {readable:.2f} s after the heal"
    )


def test_node_cut_off_from_etcd_keeps_serving_and_reregisters(cluster: NetCluster) -> None:
    """Only node ↔ etcd is cut: clients still reach the node."""
    kv = start(cluster, "e1", "e2", "e3")
    keys, data = blocks(40, seed=20)
    assert all(kv.put_many(keys, data))
    victim = "e3"
    node = cluster.nodes[victim]
    direct = cluster.direct(victim)
    mine = [i for i, k in enumerate(keys) if victim in kv.owners(k)]
    assert mine
    cluster.net.cut(victim, clients=False, etcd=True)
    t_cut = time.monotonic()
    wait_until(lambda: victim not in kv.nodes(), DROP_BOUND, f"{victim}'s lease to expire")
    dropped_at = time.monotonic() - t_cut
    assert any("etcd unreachable" in line and "keeps serving" in line for line in node.output), "".join(node.output)
    # well past its lease, it serves reads and writes to whoever reaches it
    served = 0
    while time.monotonic() - t_cut < 2 * LEASE_TTL + 1:
        assert direct.get_many([keys[i] for i in mine]) == [data[i] for i in mine]
        k, d = blocks(4, seed=200 + served)
        assert direct.put_many(k, d) == [True] * 4 and direct.get_many(k) == d
        assert kv.get_many(keys) == data  # the cluster routes around it: the other replicas
        served += 1
    assert node.proc is not None and node.proc.poll() is None

    cluster.net.heal(victim)
    t_heal = time.monotonic()
    wait_until(lambda: sorted(kv.nodes()) == ["e1", "e2", "e3"], REJOIN_BOUND, f"{victim} to register again")
    rejoined = time.monotonic() - t_heal
    assert any("registering again" in line for line in node.output), "".join(node.output)
    fresh = cluster.client()
    first = [i for i in mine if fresh.owners(keys[i])[0] == victim]
    locs = fresh.lookup_locations([keys[i] for i in first])
    assert all(loc is not None and loc[0] == victim for loc in locs), locs
    assert fresh.get_many(keys) == data and kv.get_many(keys) == data
    print(
        f"\nnode cut from etcd: left the membership {dropped_at:.2f} s after the cut, served {served} rounds of "
        f"direct reads and writes meanwhile; registered again {rejoined:.2f} s after the heal"
    )


def test_client_side_partition_reads_end_at_deadline_and_fall_back(cluster: NetCluster) -> None:
    """Only clients ↔ node is cut: the node stays registered, clients cannot reach it."""
    kv = start(cluster, "c1", "c2", "c3")
    r1 = cluster.client(replication=1)  # one copy per key: its reads have no replica to fall back on
    keys, data = blocks(40, seed=30)
    assert all(kv.put_many(keys, data))
    only, only_data = blocks(40, seed=31)
    assert all(r1.put_many(only, only_data))
    victim = "c1"
    on_victim = [i for i, k in enumerate(only) if r1.owners(k) == [victim]]
    assert on_victim and any(kv.owners(k)[0] == victim for k in keys)
    cluster.net.cut(victim, clients=True, etcd=False)
    assert probe(cluster.net.hosts[victim].ip, port(cluster.nodes[victim].tcp)) == "timeout"

    got, first = timed(lambda: kv.get_many(keys))
    assert got == data and first < BOUND, first  # the owner's call ends at its deadline; the replica answers
    assert victim in kv.suspects
    got, second = timed(lambda: kv.get_many(keys))
    assert got == data and second < FAST["rpc"], second  # routed around: no second wait
    # a key whose only copy is unreachable: a miss, not an exception, batched or single
    got, miss_batch = timed(lambda: r1.get_many([only[i] for i in on_victim]))
    assert got == [None] * len(on_victim) and miss_batch < BOUND, miss_batch
    assert r1.get(only[on_victim[0]]) is None and r1.match_prefix([only[on_victim[0]]]) == 0
    assert sum(r1.miss_counts().values()) >= len(on_victim)
    # a client that never reached the node: its first connection hangs (SYN dropped) until the deadline
    fresh = cluster.client()
    got, fresh_first = timed(lambda: fresh.get_many(keys))
    assert got == data and fresh_first < BOUND, fresh_first

    async def async_read() -> tuple[list[bytes | None], list[bytes | None]]:
        async with connect_async(cluster.target, timeouts=Timeouts(**FAST), prefer_local=False) as akv:
            return await akv.get_many(keys), await akv.get_many([only[i] for i in on_victim])

    (agot, amiss), async_first = timed(lambda: asyncio.run(async_read()))
    assert agot == data and amiss == [None] * len(on_victim) and async_first < 2 * BOUND, async_first
    # writes land on the reachable owners; the node stays a member throughout (its etcd link is fine)
    more, more_data = blocks(10, seed=32)
    assert kv.put_many(more, more_data) == [True] * 10 and kv.get_many(more) == more_data
    time.sleep(LEASE_TTL * 1.5)
    assert victim in kv.nodes() and victim in fresh.nodes()

    cluster.net.heal(victim)
    direct = cluster.direct(victim)
    wait_until(
        lambda: reads_back(direct, [only[i] for i in on_victim], [only_data[i] for i in on_victim]),
        HEALED_BOUND,
        f"reads through {victim}",
    )
    healed = cluster.client(replication=1)
    assert healed.get_many([only[i] for i in on_victim]) == [only_data[i] for i in on_victim]
    print(
        f"\nclient-side partition: first read {first * 1000:.0f} ms (rpc deadline {FAST['rpc']} s), then "
        f"{second * 1000:.0f} ms; {len(on_victim)} single-copy keys missed in {miss_batch * 1000:.0f} ms; a new client's "
        f"first read {fresh_first * 1000:.0f} ms; an async client's two reads {async_first * 1000:.0f} ms"
    )


def test_regression_client_connection_stuck_for_as_long_again_after_a_partition_heals(
    net: Network, tmp_path: Path
) -> None:
    """Bug: after a partition healed, a client kept its gRPC connection to the node, whose
    unacknowledged packets TCP retransmits with exponential back-off (0.2, 0.6, 1.4, ...,
    12.6, 25.4 s after the first loss).  Every call, from every client in the process (gRPC
    shares the connection), ended at its deadline until the next retransmission: about
    10 s after a 15 s partition, minutes after a long one.  Now the SDK's channels set
    TCP_USER_TIMEOUT (through a keepalive time), so the connection is replaced."""
    host = net.add_host("solo")
    node = NodeProcess(
        tmp_path / "solo",
        "--dram",
        "64MiB",
        "--nvme",
        "0",
        prefix=host.exec_prefix,
        listen="0.0.0.0:0",
        env={"KVSTORE_ADVERTISE_HOST": host.ip},
    ).start()
    try:
        assert node.tcp.startswith(host.ip + ":")
        kv = KVClient(node.tcp, timeouts=Timeouts(**FAST))
        key, payload = blocks(1, seed=40)
        assert kv.put_many(key, payload) == [True]
        net.cut("solo")
        t_cut = time.monotonic()
        with pytest.raises(KVStoreError):  # a call in flight: its packets are lost, not refused
            kv.get_many(key)
        time.sleep(max(0.0, 15.0 - (time.monotonic() - t_cut)))  # just past TCP's retransmission at 12.6 s
        net.heal("solo")
        t_heal = time.monotonic()
        wait_until(lambda: reads_back(kv, key, payload), 5.0, "the old client to reach the healed node")
        print(f"\nafter a 15 s partition: the client read again {time.monotonic() - t_heal:.2f} s after the heal")
        kv.close()
    finally:
        node.stop(timeout=30)
        Path(node.arena_path).unlink(missing_ok=True)


def test_regression_healed_node_skipped_until_its_backoff_ends_after_it_registers_again(cluster: NetCluster) -> None:
    """Bug: a client that had put a partitioned node on its suspect list (suspect_s = 30 s
    here) kept skipping it after the partition healed and the node registered again: reads
    went to the other replica, and writes to its keys reached one owner of two, for up to
    suspect_s.  Now a new registration (the record is back, under a new lease) clears the
    node from every client's suspect list; the same client reads from it and writes to it
    as soon as its view shows the registration."""
    cluster.set("replication", 2)
    cluster.start("h1", "h2", "h3")
    kv = cluster.client(suspect_s=30.0)
    assert kv.wait_for_nodes(3, 10)
    keys, data = blocks(60, seed=50)
    assert all(kv.put_many(keys, data))
    victim = "h2"
    first = [keys[i] for i, k in enumerate(keys) if kv.owners(k)[0] == victim]
    assert first
    direct = cluster.direct(victim)
    assert direct.stats()["counters"].get("puts", 0) > 0

    cluster.net.cut(victim)
    t_cut = time.monotonic()
    assert kv.get_many(keys) == data  # the owner's call ends at its deadline; the replica answers
    assert victim in kv.suspects and kv.suspects[victim] > 25
    wait_until(lambda: victim not in kv.nodes(), DROP_BOUND, f"{victim}'s lease to expire")
    dropped_at = time.monotonic() - t_cut

    cluster.net.heal(victim)
    t_heal = time.monotonic()
    wait_until(lambda: victim in kv.nodes(), REJOIN_BOUND, f"{victim} to register again")
    rejoined = time.monotonic() - t_heal
    assert victim not in kv.suspects, kv.suspects  # cleared with the registration, 25+ s early
    # reads: its keys are looked up and served there again (its blocks survived the partition);
    # the bound is a hang guard below suspect_s (30 s), which the bug would have waited out:
    # HEALED_BOUND (10 s) was once exceeded on a loaded 2-core CI runner
    seen: list[Any] = []  # what the lookups answered, for the message of a failure

    def through_victim() -> bool:
        locs = kv.lookup_locations(first)
        seen[:] = [round(time.monotonic() - t_heal, 2), sorted({str(loc) for loc in locs}), dict(kv.suspects)]
        return all(loc is not None and loc[0] == victim for loc in locs)

    try:
        wait_until(through_victim, 2 * HEALED_BOUND, f"the client to read through {victim} again")
    except AssertionError as e:  # failed twice on a loaded CI runner (1.3-2.6 s alone): say what it saw
        raise AssertionError(
            f"{e}; last lookup {seen[0] if seen else '-'} s after the heal answered {seen[1:] or '-'} "
            f"(locations; suspects); registered again {rejoined:.2f} s after the heal; "
            f"{victim}'s counters {direct.stats()['counters']}"
        ) from e
    routed = time.monotonic() - t_heal
    hits = direct.stats()["counters"].get("get_hits_dram", 0)
    assert kv.get_many(first) == [data[keys.index(k)] for k in first]
    assert direct.stats()["counters"].get("get_hits_dram", 0) - hits == len(first)
    # writes: every block reaches both of its owners, the healed node among them
    short = kv.under_replicated()
    more, more_data = blocks(40, seed=51)
    mine = [i for i, k in enumerate(more) if victim in kv.owners(k)]
    assert mine and kv.put_many(more, more_data) == [True] * len(more)
    assert kv.under_replicated() == short
    assert direct.get_many([more[i] for i in mine]) == [more_data[i] for i in mine]
    assert victim not in kv.suspects
    print(
        f"\nhealed node with suspect_s = 30 s: dropped {dropped_at:.2f} s after the cut, registered again "
        f"{rejoined:.2f} s and routed to by the same client {routed:.2f} s after the heal"
    )

"""Cluster failures with real processes: a node killed with kill -9, a node restarted,
etcd stopped (and returning, with and without its data), and a node that hangs.

The invariant throughout: a cache that cannot answer returns a miss, never an error
and never a hang, and with R = 2 no read of a stored block misses while one copy lives.
"""

from __future__ import annotations

import os
import time

import numpy as np
from cluster_fixtures import FAST, LEASE_TTL, Cluster, cluster, etcd, wait_until  # noqa: F401 - fixtures

from client import KVClient

SIZE = 2048


def blocks(n: int, seed: int = 0) -> tuple[list[bytes], list[bytes]]:
    rng = np.random.default_rng(seed)
    keys = [os.urandom(16) for _ in range(n)]
    return keys, [rng.integers(0, 255, SIZE, dtype=np.uint8).tobytes() for _ in range(n)]


def test_kill9_with_r2_reads_keep_succeeding_through_lease_expiry(cluster: Cluster) -> None:
    cluster.set("replication", 2)
    cluster.start("k1", "k2", "k3")
    kv = cluster.client()
    keys, data = blocks(60)
    assert all(kv.put_many(keys, data))
    victim = "k2"
    owned = [i for i, k in enumerate(keys) if victim in kv.owners(k)]
    assert owned
    cluster.nodes[victim].kill9()
    t_kill = time.monotonic()
    latencies: list[float] = []
    expired_at = None
    # read everything, over and over, while the dead node's lease runs out and after
    while time.monotonic() - t_kill < LEASE_TTL + 3:
        t = time.monotonic()
        got = kv.get_many(keys)  # never raises
        latencies.append(time.monotonic() - t)
        assert got == data, f"a miss {time.monotonic() - t_kill:.2f} s after the kill"
        if expired_at is None and victim not in kv.nodes():
            expired_at = time.monotonic() - t_kill
    assert expired_at is not None and expired_at <= LEASE_TTL + 2.5, expired_at
    # the dead node costs at most one fast failure (connection refused), then it is routed around
    assert latencies[0] < FAST["rpc"] + 1 and max(latencies[1:]) < 1.0, latencies[:5]
    print(
        f"\nkill -9: first read {latencies[0] * 1000:.0f} ms, then median "
        f"{sorted(latencies)[len(latencies) // 2] * 1000:.1f} ms; lease expired after {expired_at:.2f} s"
    )
    # after the expiry, new writes land on two live nodes again
    more, more_data = blocks(20, seed=1)
    assert all(kv.put_many(more, more_data))
    assert all(len(kv.owners(k)) == 2 and victim not in kv.owners(k) for k in more)
    assert kv.get_many(more) == more_data


def test_restarted_node_rejoins_and_serves_its_nvme_blocks(cluster: Cluster) -> None:
    cluster.start("r1", "r2", extra=("--write-through",))  # replication 1: one copy, on NVMe at once
    kv = cluster.client()
    keys, data = blocks(40, seed=2)
    assert all(kv.put_many(keys, data))
    mine = [i for i, k in enumerate(keys) if kv.owners(k) == ["r1"]]
    assert mine
    with KVClient(cluster.nodes["r1"].tcp) as node:  # write-through persists in the background
        wait_until(lambda: node.stats()["tiers"]["nvme"]["blocks"] == len(mine), 30, "r1 to persist its blocks")
    old_pid = cluster.nodes["r1"].proc.pid
    cluster.nodes["r1"].kill9()
    wait_until(lambda: "r1" not in kv.nodes(), LEASE_TTL + 5, "r1's lease to expire")
    assert kv.get_many([keys[i] for i in mine]) == [None] * len(mine)  # its only copies are down: misses
    (r1,) = cluster.start("r1", extra=("--write-through",))  # same node id, same data directory
    assert r1.proc.pid != old_pid
    wait_until(
        lambda: kv.snapshot().nodes.get("r1") and kv.snapshot().nodes["r1"].pid == r1.proc.pid, 10, "r1 to rejoin"
    )
    # served from the restarted node's NVMe tier
    locs = kv.lookup_locations([keys[i] for i in mine])
    assert all(loc is not None and loc[0] == "r1" and loc[1] == "nvme" for loc in locs), locs
    assert kv.get_many(keys) == data


def test_etcd_down_puts_and_gets_keep_working_and_nodes_reregister(cluster: Cluster) -> None:
    cluster.set("replication", 2)
    cluster.start("d1", "d2", "d3")
    kv = cluster.client()
    keys, data = blocks(30, seed=3)
    assert all(kv.put_many(keys, data))
    cluster.etcd.stop()
    wait_until(lambda: not kv.snapshot().connected, 10, "the client to notice etcd is gone")
    t = time.monotonic()
    n = 0
    while time.monotonic() - t < LEASE_TTL * 2:  # well past every node's lease TTL
        k, d = blocks(5, seed=100 + n)
        assert kv.put_many(k, d) == [True] * 5
        assert kv.get_many(k) == d and kv.get_many(keys) == data
        n += 1
    assert sorted(kv.nodes()) == ["d1", "d2", "d3"]  # the last membership seen
    assert kv.snapshot().config.replication == 2
    # etcd returns with its data: the view reconnects, every node is (still or again) registered
    cluster.etcd.start()
    wait_until(lambda: kv.snapshot().connected and len(kv.snapshot().nodes) == 3, 15, "the view to reconnect")
    time.sleep(LEASE_TTL * 1.5)  # leases are being kept alive again, not merely restored by etcd
    assert len(kv.snapshot().nodes) == 3
    # etcd returns *without* its data: nodes register again; meanwhile clients route on the last nodes
    cluster.etcd.stop()
    cluster.etcd.start(wipe=True)
    assert kv.get_many(keys) == data
    wait_until(lambda: kv.snapshot().connected and len(kv.snapshot().nodes) == 3, 15, "the nodes to re-register")
    for node in cluster.nodes.values():
        assert node.proc.poll() is None
        assert any("registering again" in line for line in node.output), "".join(node.output)
    assert kv.get_many(keys[:5]) == data[:5]


def test_hung_node_calls_end_at_their_deadline_as_misses(cluster: Cluster) -> None:
    cluster.set("replication", 2)
    # a long membership lease: the hung node stays registered (as if cut off from clients
    # but not from etcd), so only the deadline and the suspect list protect the client
    cluster.start("g1", "g2", "g3", extra=("--membership-ttl", "60"))
    kv = cluster.client(suspect_s=30.0)
    r1 = cluster.client(replication=1, suspect_s=30.0)  # this client keeps one copy per key
    keys, data = blocks(40, seed=4)
    assert all(kv.put_many(keys, data))
    only, only_data = blocks(40, seed=5)
    assert all(r1.put_many(only, only_data))
    hung = "g1"
    on_hung = [i for i, k in enumerate(only) if r1.owners(k) == [hung]]
    assert on_hung
    cluster.sigstop(hung)  # the process stops answering; its sockets still accept
    deadline = FAST["rpc"] + FAST["data"] + 1.0
    try:
        t = time.monotonic()
        assert kv.get_many(keys) == data  # the other replica answers every key
        first = time.monotonic() - t
        assert first < deadline, first
        assert hung in kv.suspects
        t = time.monotonic()
        assert kv.get_many(keys) == data
        assert kv.match_prefix(keys) == len(keys)
        second = time.monotonic() - t
        assert second < 0.9 * FAST["rpc"]  # routed around: no second wait
        # a key whose only copy is on the hung node: a miss at the deadline, not an error
        t = time.monotonic()
        got = r1.get_many([only[i] for i in on_hung])
        assert got == [None] * len(on_hung) and time.monotonic() - t < deadline
        t = time.monotonic()
        assert r1.match_prefix([only[i] for i in on_hung]) == 0 and time.monotonic() - t < 0.9 * FAST["rpc"]
        # writes still land on the live owner
        more, more_data = blocks(10, seed=6)
        assert kv.put_many(more, more_data) == [True] * 10
        assert kv.get_many(more) == more_data
        assert hung in kv.nodes()  # still a member: it was routed around, not removed
        print(
            f"\nhung node: first read of 40 keys {first * 1000:.0f} ms (deadline {FAST['rpc']} s); "
            f"then a read and a match_prefix routed around it in {second * 1000:.0f} ms"
        )
    finally:
        cluster.sigcont(hung)
    # once it answers again it serves: a client without the back-off reads its blocks
    fresh = cluster.client()
    assert fresh.get_many([only[i] for i in on_hung]) == [only_data[i] for i in on_hung]


def _first_owned(kv: KVClient, keys: list[bytes], node: str) -> list[int]:
    return [i for i, k in enumerate(keys) if kv.owners(k)[0] == node]


def test_regression_node_back_from_sigstop_skipped_until_backoff_ends(cluster: Cluster) -> None:
    """Bug: a node that hung past its lease, then resumed and registered again, stayed on a
    client's suspect list for the rest of suspect_s (30 s here): reads skipped it and writes
    to its keys reached one owner of two.  A new registration now clears it."""
    cluster.set("replication", 2)
    cluster.start("s1", "s2", "s3")
    kv = cluster.client(suspect_s=30.0)
    keys, data = blocks(60, seed=7)
    assert all(kv.put_many(keys, data))
    victim = "s2"
    first = _first_owned(kv, keys, victim)
    assert first
    cluster.sigstop(victim)
    assert kv.get_many(keys) == data  # its calls end at the deadline; the replica answers
    assert victim in kv.suspects
    wait_until(lambda: victim not in kv.nodes(), LEASE_TTL + 5, f"{victim}'s lease to expire")
    cluster.sigcont(victim)
    t = time.monotonic()
    wait_until(lambda: victim in kv.nodes(), 10, f"{victim} to register again")
    rejoined = time.monotonic() - t
    assert victim not in kv.suspects, kv.suspects
    # the same client reads its blocks there (they stayed in its DRAM) and writes to it
    locs = kv.lookup_locations([keys[i] for i in first])
    assert all(loc is not None and loc[0] == victim for loc in locs), locs
    assert kv.get_many(keys) == data
    more, more_data = blocks(30, seed=8)
    mine = [i for i, k in enumerate(more) if victim in kv.owners(k)]
    assert mine and kv.put_many(more, more_data) == [True] * len(more)
    with KVClient(cluster.nodes[victim].tcp) as direct:
        assert direct.get_many([more[i] for i in mine]) == [more_data[i] for i in mine]
    assert victim not in kv.suspects
    print(
        f"\nSIGSTOP past the lease: registered again {rejoined:.2f} s after SIGCONT, routed to at once (suspect_s 30 s)"
    )


def test_regression_node_restarted_under_its_id_skipped_until_backoff_ends(cluster: Cluster) -> None:
    """A node killed and restarted before its (long) lease ran out: its record never leaves
    the membership but is rewritten under a new lease, with a new address.  The client that
    had suspected the dead process routes to the new one at once, reads and writes."""
    cluster.set("replication", 2)
    cluster.start("n1", "n2", "n3", extra=("--membership-ttl", "60"))
    kv = cluster.client(suspect_s=30.0)
    keys, data = blocks(60, seed=9)
    assert all(kv.put_many(keys, data))
    victim = "n3"
    old = kv.snapshot().nodes[victim]
    cluster.nodes[victim].kill9()
    assert kv.get_many(keys) == data  # refused: the replica answers
    assert victim in kv.suspects
    # still registered: writes skip it (no other node stands in) and the client counts the copies
    during, during_data = blocks(20, seed=11)
    assert kv.put_many(during, during_data) == [True] * len(during)
    assert kv.under_replicated() == {"suspect": sum(victim in kv.owners(k) for k in during), "failed": 0}
    short = kv.under_replicated()
    (node,) = cluster.start(victim, extra=("--membership-ttl", "60"))  # same id, same data directory, a new port
    t = time.monotonic()
    wait_until(lambda: kv.snapshot().nodes[victim].pid == node.proc.pid, 10, f"{victim} to register again")
    rejoined = time.monotonic() - t
    assert victim in kv.nodes() and kv.snapshot().nodes[victim].grpc != old.grpc
    assert victim not in kv.suspects, kv.suspects
    more, more_data = blocks(40, seed=10)
    mine = [i for i, k in enumerate(more) if victim in kv.owners(k)]
    first = _first_owned(kv, more, victim)
    assert first and kv.put_many(more, more_data) == [True] * len(more)
    assert kv.under_replicated() == short  # every copy written
    with KVClient(node.tcp) as direct:
        assert direct.get_many([more[i] for i in mine]) == [more_data[i] for i in mine]
    locs = kv.lookup_locations([more[i] for i in first])
    assert all(loc is not None and loc[0] == victim for loc in locs), locs
    assert kv.get_many(keys) == data  # its old blocks (DRAM, lost) come from the replica
    print(
        f"\nkill -9 and restart inside the lease: the view showed the new registration {rejoined:.2f} s after "
        f"the restart; routed to at once (suspect_s 30 s)"
    )

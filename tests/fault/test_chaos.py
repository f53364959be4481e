"""Bounded chaos (issue 13, Also): a real 3-node cluster at R = 2 with a real etcd, under
mixed load from several client threads through the cluster SDK, while a seeded driver
kills and restarts nodes, stops etcd, partitions nodes, fills a node's disk and corrupts
segment records (tests/chaos_driver.py).  The checker (tests/chaos_checker.py) holds every
hit against the one payload its key may have.

After the chaos every fault is undone, then every node is killed with SIGKILL and
restarted (new arenas: only what is on disk survives), and every block acknowledged
durable is looked for on every node directly.  The figures are printed on one line.

The invariants: no read ever returns wrong bytes (a miss is fine); no acknowledged
write-through block is lost (the checker says which acknowledgements promise that);
nothing raises anything but a typed ``KVStoreError``; nothing hangs (every call has a
deadline, every fault step a bound, and the whole test a timeout).

``CHAOS_SEED`` picks another fault schedule (the default is fixed, so CI plays
the same one every time); ``CHAOS_SECONDS`` the length of the chaos.  Needs root
(namespaces, a tmpfs) and etcd; CI runs the fault suite as root.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from chaos_checker import Ledger, Workload, load
from chaos_driver import Driver, schedule
from cluster_fixtures import wait_until
from netns_cluster import NetCluster, cluster, etcd, net  # noqa: F401 - fixtures
from small_disk import small_tmpfs

from kvstore.errors import KVStoreError

pytestmark = pytest.mark.solo  # random faults under load, timed against deadlines: scripts/test.sh runs it on its own

SEED = int(os.environ.get("CHAOS_SEED", "13"))
SECONDS = float(os.environ.get("CHAOS_SECONDS", "75"))
NODES = ("x1", "x2", "x3")
DISK_NODE = "x3"  # its data directory is a small tmpfs: the one whose disk fills
NVME_MIB = 128
NODE_ARGS = ("--write-through", "--dram", "16MiB", "--nvme", f"{NVME_MIB}MiB")
CLIENTS = 3
READ_BATCH = 16


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    """DISK_NODE's data directory: a tmpfs with room for its NVMe tier, lmdb and a little more."""
    with small_tmpfs(tmp_path / DISK_NODE, NVME_MIB + 16) as mnt:
        yield mnt


def held_by(kv: object, keys: list[bytes], ledger: Ledger, where: str) -> set[bytes]:
    """The keys a single-node client reads back (checked by the ledger), in small batches;
    a batch that fails is asked once more."""
    held: set[bytes] = set()
    for i in range(0, len(keys), READ_BATCH):
        part = keys[i : i + READ_BATCH]
        for attempt in range(2):
            try:
                got = kv.get_many(part)  # type: ignore[attr-defined]
                break
            except KVStoreError:
                if attempt:
                    raise
        ledger.check(where, part, got)
        held.update(k for k, g in zip(part, got) if g is not None)
    return held


def chaos(cluster: NetCluster, ledger: Ledger, driver: Driver, clients: list[Any]) -> float:
    """The load threads run while the driver plays the seed's schedule; then every fault is
    undone and the load stops.  Returns the seconds it took."""
    stop = threading.Event()
    threads = [
        threading.Thread(target=load, args=(kv, ledger, SEED * 100 + i, stop), daemon=True, name=f"chaos-load-{i}")
        for i, kv in enumerate(clients)
    ]
    ledger.workload.begin(0.9 * SECONDS)
    for t in threads:
        t.start()
    t0 = time.monotonic()
    try:
        driver.run(schedule(SEED, SECONDS, NODES, DISK_NODE), deadline=t0 + SECONDS)
    finally:
        driver.repair()
        stop.set()
        for t in threads:
            t.join(30)
    assert not any(t.is_alive() for t in threads), "a load thread did not stop within 30 s: a call hangs"
    return time.monotonic() - t0


def restart_from_disk(cluster: NetCluster, kv: Any) -> None:
    """Kill -9 every node and start them all again: only what is on disk survives."""
    for node in NODES:
        cluster.nodes[node].kill9()
    cluster.start(*NODES, extra=NODE_ARGS)
    wait_until(
        lambda: all((info := kv.snapshot().nodes.get(n)) and info.pid == cluster.nodes[n].proc.pid for n in NODES),
        15,
        "every restarted node to register",
    )


@pytest.mark.timeout(180)
def test_chaos_cluster_never_serves_wrong_bytes_nor_loses_acknowledged_blocks(
    disk: Path, cluster: NetCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    t_start = time.monotonic()
    workload = Workload(300, 8, salt=b"chaos/%d" % SEED)
    # with room to spare (rewrites of damaged records, fragmentation): nothing is evicted from NVMe
    assert 1.5 * workload.nvme_bytes() < NVME_MIB << 20, workload.nvme_bytes()
    ledger = Ledger(workload)
    cluster.set("replication", 2)
    cluster.start(*NODES, extra=NODE_ARGS)
    clients = [cluster.client() for _ in range(CLIENTS)]
    assert clients[0].wait_for_nodes(len(NODES), 15)
    driver = Driver(cluster, ledger, seed=SEED, node_args=NODE_ARGS, disk_dir=disk)
    chaos_s = chaos(cluster, ledger, driver, clients)
    c = Counter(ledger.c)  # the figures of the chaos itself

    restart_from_disk(cluster, clients[0])
    durable = ledger.durable_keys()
    found: set[bytes] = set()
    for node in NODES:
        found |= held_by(cluster.direct(node), durable, ledger, f"after restart, on {node}")
    lost = sorted(k.hex() for k in set(durable) - found)
    acked = sorted(ledger.acks)
    routed = held_by(cluster.client(), acked, ledger, "after restart, through the cluster")

    faults = " ".join(f"{k}={v}" for k, v in sorted(driver.injected.items()))
    errors = " ".join(f"{k[len('errors_') :]}={v}" for k, v in sorted(c.items()) if k.startswith("errors_"))
    with capsys.disabled():  # the figures belong in every CI log, not only a failure's
        print(
            f"\nchaos seed={SEED}: {chaos_s:.0f}s of chaos, {time.monotonic() - t_start:.0f}s in all; ops={c['ops']} "
            f"(put={c['ops_put']} get={c['ops_get']} get_into={c['ops_get_into']} match={c['ops_match']}); faults: {faults}; "
            f"blocks acked={c['blocks_acked']} refused={c['blocks_refused']}; reads={c['reads']} hits={c['hits']} "
            f"misses={c['misses']} (of acked blocks {c['misses_of_acked']}); wrong_bytes={len(ledger.wrong)}; "
            f"acknowledged-durable lost={len(lost)} of {len(durable)} ({len(acked)} keys acked; after restarting every "
            f"node the cluster SDK read {len(routed)}); max_op_ms={c['max_op_ms']}; typed errors: {errors or 'none'}"
        )
    print("driver: " + "; ".join(driver.log))
    assert not ledger.wrong, f"{len(ledger.wrong)} reads returned wrong bytes: {ledger.wrong[:5]}"
    assert not ledger.errors, f"{len(ledger.errors)} calls raised untyped exceptions: {ledger.errors[:2]}"
    assert not driver.errors, f"fault steps failed: {driver.errors[:2]}"
    assert not lost, f"{len(lost)} of {len(durable)} acknowledged-durable blocks lost: {lost[:5]}"
    assert c["ops"] > 100 and all(driver.injected[k] for k in ("kill", "etcd", "partition", "disk_full", "corrupt"))

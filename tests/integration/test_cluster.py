"""Cluster mode against a real etcd and real node processes: membership, the cluster
CLI, placement with replicas, cluster-wide lookups, namespace epochs and hand-off reads.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from cluster_fixtures import LEASE_TTL, Cluster, cluster, etcd, wait_until  # noqa: F401 - fixtures
from conftest import ROOT

from client import KVClient, Namespace, Unavailable, connect, connect_async
from kvstore.cluster.membership import Membership
from kvstore.cluster.placement import BoundedTable
from kvstore.cluster.state import effective_fingerprint


def payloads(n: int, size: int = 4096, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 255, size, dtype=np.uint8) for _ in range(n)]


def kvctl(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([sys.executable, "-m", "kvstore", *args], capture_output=True, text=True, cwd=ROOT, timeout=60)
    if check:
        assert r.returncode == 0, r.stderr + r.stdout
    return r


def test_nodes_register_under_a_lease_and_deregister_on_shutdown(cluster: Cluster) -> None:
    a, b = cluster.start("na", "nb", extra=("--zone", "z1"))
    assert (
        a.endpoints["registered"] and a.endpoints["cluster"] == cluster.name and a.endpoints["lease_ttl_s"] == LEASE_TTL
    )
    with Membership(cluster.etcd.endpoint, cluster.name) as view:
        snap = view.wait_for(lambda s: len(s.nodes) == 2, 10)
        assert snap is not None and snap.connected
        rec = snap.nodes["na"]
        assert rec.grpc == a.tcp and rec.unix == a.unix and rec.data == a.endpoints["data"]
        assert (rec.zone, rec.dram_bytes, rec.nvme_bytes, rec.pid) == ("z1", 64 << 20, 128 << 20, a.proc.pid)
        assert rec.version and rec.host and rec.started_at > 0
        # the lease is kept alive: still there after several TTLs
        time.sleep(LEASE_TTL * 2)
        assert set(view.snapshot().nodes) == {"na", "nb"}
        # a clean shutdown deregisters at once (no wait for the lease)
        t = time.monotonic()
        assert b.stop() == 0
        assert view.wait_for(lambda s: set(s.nodes) == {"na"}, 5) is not None
        assert time.monotonic() - t < LEASE_TTL + 5


def test_duplicate_node_id_is_refused(cluster: Cluster) -> None:
    (a,) = cluster.start("dup")
    from conftest import NodeProcess

    arena = cluster.arena("dup-elsewhere")
    other = NodeProcess(cluster.tmp / "dup-elsewhere", *cluster.node_args("--arena-path", arena), node_id="dup")
    try:
        with pytest.raises(RuntimeError, match="already registered"):
            other.start(timeout=60)
    finally:
        other.stop()
        assert not os.path.exists(arena)  # the failed start cleaned up
    with Membership(cluster.etcd.endpoint, cluster.name) as view:
        assert view.snapshot().nodes["dup"].pid == a.proc.pid


def test_cluster_cli_set_show_invalidate(cluster: Cluster, capsys: pytest.CaptureFixture[str]) -> None:
    from kvstore.cli import main

    cluster.start("n1")
    common = ("--etcd", cluster.etcd.endpoint, "--cluster", cluster.name)

    def run(*args: str) -> tuple[int, str, str]:
        rc = main(["cluster", *args, *common])
        out = capsys.readouterr()
        return rc, out.out, out.err

    # the entry point itself, once, as a user runs it
    assert "replication = 2" in kvctl("cluster", "set", "replication", "2", *common).stdout
    rc, out, _ = run("show", "--json")
    shown = json.loads(out)
    assert rc == 0 and shown["config"]["replication"] == 2 and list(shown["nodes"]) == ["n1"]
    assert shown["nodes"]["n1"]["grpc"] == cluster.nodes["n1"].tcp
    assert "n1" in run("show")[1]
    rc, _, err = run("set", "replication", "0")
    assert rc == 2 and "replication must be >= 1" in err
    rc, _, err = run("set", "replicas", "2")
    assert rc == 2 and "unknown cluster setting 'replicas'" in err
    fp = Namespace("llama-3-8b").fingerprint
    assert f"namespace {fp.hex()}: epoch 1" in run("invalidate", "llama-3-8b")[1]
    assert f"namespace {fp.hex()}: epoch 2" in run("invalidate", fp.hex())[1]
    rec = json.loads(run("show", "--json")[1])["namespaces"][fp.hex()]
    assert rec["epoch"] == 2 and rec["effective_fingerprint"] == effective_fingerprint(fp, 2).hex()
    assert rec["namespace"]["model_id"] == "llama-3-8b"
    assert run("unset", "replication")[0] == 0
    assert json.loads(run("show", "--json")[1])["config"]["replication"] == 1
    rc = main(["cluster", "show", "--etcd", "127.0.0.1:1", "--cluster", "x", "--timeout", "1"])
    assert rc == 2 and "unreachable" in capsys.readouterr().err


def test_writes_go_to_all_r_owners_and_reads_find_them(cluster: Cluster) -> None:
    cluster.set("replication", 2)
    cluster.start("n1", "n2", "n3")
    kv = cluster.client()
    assert type(kv).__name__ == "ClusterClient" and kv.wait_for_nodes(3, 10)
    ns = Namespace("m-r2")
    keys = kv.chunk_keys(np.arange(256 * 30), ns)
    assert keys == __import__("client").chunk_keys(np.arange(256 * 30), ns)  # epoch 0: the plain keys
    data = payloads(len(keys))
    assert kv.put_many(keys, data, namespace=ns) == [True] * len(keys)
    # each block lives on exactly its two owners (the default placement, bounded-v1)
    ring = BoundedTable(["n1", "n2", "n3"])
    per_node = {n: KVClient(p.tcp) for n, p in cluster.nodes.items()}
    try:
        present = {n: c.exists(keys) for n, c in per_node.items()}
        for i, k in enumerate(keys):
            assert {n for n in per_node if present[n][i]} == set(ring.owners(k, 2)) == set(kv.owners(k))
    finally:
        for c in per_node.values():
            c.close()
    # reads, batched and single, into buffers and as bytes
    assert [bytes(g) for g in kv.get_many(keys)] == [d.tobytes() for d in data]
    outs = [np.empty(4096, np.uint8) for _ in keys]
    assert kv.get_many_into(keys, outs) == [4096] * len(keys)
    assert all((o == d).all() for o, d in zip(outs, data))
    assert kv.get(keys[3]) == data[3].tobytes()
    # cluster-wide prefix matching with locations; a gap ends the prefix
    n, locs = kv.match_prefix_locations(keys)
    assert n == len(keys) and all(node in ring.owners(k, 2) and tier == "dram" for k, (node, tier) in zip(keys, locs))
    assert kv.delete([keys[10]]) == 2
    assert kv.match_prefix(keys) == 10 and kv.exists(keys[9:12]) == [True, False, True]
    assert kv.get(keys[10]) is None
    assert kv.pin(keys[:2], 60) == 4 and kv.unpin(keys[:2]) == 4
    st = kv.stats()
    assert set(st["nodes"]) == {"n1", "n2", "n3"} and st["replication"] == 2
    assert sum(s["tiers"]["dram"]["blocks"] for s in st["nodes"].values()) == 2 * (len(keys) - 1)


def test_warm_connects_to_every_node_before_the_first_call(cluster: Cluster) -> None:
    """``ClusterClient.warm()`` connects to every member side by side (each node's Hello
    answered), so no later call pays for a connection; a node that does not answer counts
    0 and is no error (its first call tries again).  ``KVClient.warm()`` does the same for
    its one node."""
    cluster.start("w1", "w2", "w3")
    kv = cluster.client(warm=False)
    assert kv.wait_for_nodes(3, 10)
    assert kv._clients == {}  # no call yet: no node's client made
    assert kv.warm() == 3
    assert set(kv._clients) == {"w1", "w2", "w3"} and all(c._core.hello for _, c in kv._clients.values())
    cluster.sigstop("w3")
    try:
        other = cluster.client()
        assert other.wait_for_nodes(3, 10) and other.warm() == 2  # w3 frozen: not reached, not raised
    finally:
        cluster.sigcont("w3")
    one = KVClient(cluster.nodes["w1"].tcp)
    try:
        assert one._core.hello is None and one.warm() == 1 and one._core.hello is not None
    finally:
        one.close()
    kv.close()
    with pytest.raises(Unavailable, match="closed"):
        kv.warm()


def test_async_cluster_client(cluster: Cluster) -> None:
    cluster.set("replication", 2)
    cluster.start("a1", "a2")

    async def main() -> None:
        from client import Timeouts

        async with connect_async(cluster.target, timeouts=Timeouts(rpc=2, data=5, connect=1)) as kv:
            assert type(kv).__name__ == "AsyncClusterClient"
            ns = Namespace("m-async")
            keys = kv.chunk_keys(np.arange(256 * 8), ns)
            data = payloads(len(keys), seed=1)
            assert await kv.put_many(keys, data, namespace=ns) == [True] * len(keys)
            assert [bytes(g) for g in await kv.get_many(keys)] == [d.tobytes() for d in data]
            assert await kv.match_prefix(keys) == len(keys)
            assert (await kv.lookup_locations(keys[:1]))[0][1] == "dram"
            assert await kv.invalidate(ns) >= 0
            assert await kv.match_prefix(kv.chunk_keys(np.arange(256 * 8), ns)) == 0

    asyncio.run(main())


def test_invalidate_bumps_the_epoch_and_no_node_serves_old_blocks(cluster: Cluster) -> None:
    cluster.set("replication", 2)
    cluster.start("e1", "e2", "e3")
    kv = cluster.client()
    ns, other = Namespace("m-epoch"), Namespace("m-kept")
    tokens = np.arange(256 * 12)
    old = kv.chunk_keys(tokens, ns)
    kept = kv.chunk_keys(tokens, other)
    assert all(kv.put_many(old, payloads(len(old)), namespace=ns))
    assert all(kv.put_many(kept, payloads(len(kept)), namespace=other))
    # e3 is down while the namespace is invalidated; its blocks stay on its NVMe
    assert cluster.nodes["e3"].stop() == 0
    kv.invalidate(ns)
    assert kv.epoch(ns) == 1
    new = kv.chunk_keys(tokens, ns)
    assert not set(new) & set(old)
    assert kv.effective_namespace(ns) == effective_fingerprint(ns.fingerprint, 1)
    # every live node dropped the old blocks (by the direct call or its watch), kept the other namespace's
    for nid in ("e1", "e2"):
        with KVClient(cluster.nodes[nid].tcp) as node:
            wait_until(lambda node=node: not any(node.exists(old)), 10, f"{nid} to drop the old epoch")
    assert kv.match_prefix(old) == 0 and kv.match_prefix(kept) == len(kept)
    # the node that was down drops them when it comes back (they were on its NVMe)
    (e3,) = cluster.start("e3")
    with KVClient(e3.tcp) as node:
        wait_until(lambda: not any(node.exists(old)), 10, "e3 to drop the old epoch at start-up")
        assert node.stats()["counters"].get("epoch_reclaimed_blocks", 0) > 0
        assert any(node.exists(kept))
    # the new epoch works like any namespace; a fresh client sees the epoch from etcd
    assert all(kv.put_many(new, payloads(len(new), seed=2), namespace=ns))
    kv2 = cluster.client()
    assert kv2.epoch(ns) == 1 and kv2.chunk_keys(tokens, ns) == new and kv2.match_prefix(new) == len(new)


def test_handoff_read_copies_a_block_from_its_previous_owner(cluster: Cluster) -> None:
    cluster.start("h1", "h2")  # replication 1: each block has one owner
    kv = cluster.client()
    keys = [os.urandom(16) for _ in range(60)]
    data = payloads(len(keys), size=1024, seed=3)
    assert all(kv.put_many(keys, data))
    (h3,) = cluster.start("h3")
    assert kv.wait_for_nodes(3, 10)
    before = BoundedTable(["h1", "h2"])
    moved = [i for i, k in enumerate(keys) if kv.owners(k) != before.owners(k, 1)]
    to_h3 = [i for i in moved if kv.owners(keys[i]) == ["h3"]]
    assert to_h3, "placement moves about 1/3 of the keys to the new node"
    # (bounded-v1 may also move a few between h1 and h2: the bounded overflow; hand-off covers them too)
    with KVClient(h3.tcp) as new_owner:
        assert not any(new_owner.exists([keys[i] for i in to_h3]))
        # the new owner misses; the previous owner answers; the block is copied over
        assert kv.match_prefix([keys[i] for i in moved]) == len(moved)
        got = kv.get_many([keys[i] for i in moved])
        assert got == [data[i].tobytes() for i in moved]
        assert kv.handoffs == len(moved)
        assert all(new_owner.exists([keys[i] for i in to_h3]))
    # a client that never saw the old membership still reads everything (from the new owner now)
    assert cluster.client().get_many(keys) == [d.tobytes() for d in data]


def test_serve_lease_flags(cluster: Cluster) -> None:
    (n,) = cluster.start("f1", extra=("--read-lease-ttl", "7"))
    assert n.endpoints["lease_ttl_s"] == LEASE_TTL
    with KVClient(n.unix) as kv:
        kv._run(kv._core.ensure_hello())
        assert kv._core.hello.lease_ttl_s == 7


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_kvstore_up_end_to_end(tmp_path, stop_signal: int) -> None:
    from kvstore.cluster.local_etcd import find_etcd

    if find_etcd() is None:
        pytest.skip("etcd is not installed")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvstore",
            "up",
            "--nodes",
            "3",
            "--replication",
            "2",
            "--data-dir",
            str(tmp_path / "up"),
            "--dram",
            "64MiB",
            "--nvme",
            "128MiB",
            "--cluster",
            "uptest",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
    )
    info = None
    out: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            out.append(line)
            if line.startswith("READY "):
                info = json.loads(line[len("READY ") :])
                break
        assert info is not None, "".join(out)
        text = "".join(out)
        assert info["target"] in text and info["target"].endswith("/uptest") and info["replication"] == 2
        assert len(info["nodes"]) == 3 and all(n["grpc"] in text for n in info["nodes"])
        with connect(info["target"]) as kv:
            assert kv.wait_for_nodes(3, 10) and kv.snapshot().config.replication == 2
            keys = [os.urandom(16) for _ in range(20)]
            assert all(kv.put_many(keys, payloads(20, size=512)))
            assert kv.match_prefix(keys) == 20
            assert sum(len(o) for o in map(kv.owners, keys)) == 40
        proc.send_signal(stop_signal)
        rest = proc.communicate(timeout=90)[0]
        assert proc.returncode == 0, rest
        assert "stopped" in rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    pids = [n["pid"] for n in info["nodes"]] + [info["etcd_pid"]]
    for pid in pids:  # every child is gone (and reaped by `up`)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert (tmp_path / "up" / "n0" / "node.log").exists()  # --data-dir is kept


def test_kvstore_up_without_etcd_says_so(tmp_path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "kvstore", "up", "--etcd-bin", str(tmp_path / "no-etcd")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        env={**os.environ, "PATH": str(tmp_path)},
    )
    assert r.returncode == 2
    assert "etcd is not installed" in r.stderr and "etcd-server" in r.stderr

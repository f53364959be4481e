"""Load: 16 concurrent clients mixing put, get and match-prefix against a node whose DRAM
holds about a quarter of the working set, so eviction (demotion to NVMe) and promotion
run the whole time.

Clients: 8 threads sharing one ``KVClient`` on the Unix socket (shared memory), one
thread with its own ``KVClient`` and one with an ``AsyncKVClient`` (also shared memory),
five processes over TCP (data channel) and one over TCP with the gRPC-stream fallback.
Every block is derived from its key (``tests/fault/_client_worker.py``), so every hit
is checked byte for byte by whoever got it.

Passes when: no client saw an exception (a miss or a refused put is a result, not an
error); no returned block differed from its payload; the node's private memory stayed
bounded and did not keep growing; afterwards no reservation or lease is left; the
node demoted and promoted blocks (eviction really ran).

Duration: ``KVSTORE_LOAD_SECONDS`` (default 30).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from client import AsyncKVClient, KVClient, Timeouts

pytestmark = pytest.mark.solo  # many client processes at once: scripts/test.sh runs it on its own

WORKER_PATH = Path(__file__).resolve().parents[1] / "fault" / "_client_worker.py"
_spec = importlib.util.spec_from_file_location("_client_worker", WORKER_PATH)
assert _spec and _spec.loader
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)

SECONDS = float(os.environ.get("KVSTORE_LOAD_SECONDS", "30"))
MIB = 1 << 20
DRAM = 64 * MIB
N_CHAINS, CHAIN_LEN = 48, 6  # ~235 MiB of blocks: 3.7x the DRAM tier
SHARED_THREADS = 8
TCP_PROCESSES = [("data-channel", 5), ("grpc-stream", 1)]
USS_LIMIT = 400 * MIB  # the node's private memory (the arena is shared memory, not counted)
USS_GROWTH_LIMIT = 64 * MIB  # from the 1/3 mark to the end


def _private_bytes(proc: psutil.Process) -> int:
    return proc.memory_full_info().uss


class MemorySampler(threading.Thread):
    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.proc = psutil.Process(pid)
        self.samples: list[tuple[float, int, int]] = []  # (t, uss, rss)
        self.stop = threading.Event()

    def run(self) -> None:
        t0 = time.monotonic()
        while not self.stop.is_set():
            try:
                self.samples.append((time.monotonic() - t0, _private_bytes(self.proc), self.proc.memory_info().rss))
            except psutil.Error:
                return
            self.stop.wait(0.5)

    def at(self, frac: float) -> int:
        """Largest private size over the samples up to ``frac`` of the run."""
        end = self.samples[-1][0] * frac
        return max(uss for t, uss, _ in self.samples if t <= end)


def _wait_idle(kv: KVClient, timeout: float = 10.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        s = kv.stats()
        if (s["reservations"], s["leases"], s["counters"].get("pending_transfers", 0)) == (
            0,
            0,
            0,
        ) or time.monotonic() > deadline:
            return s
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.timeout(int(SECONDS * 3) + 180)
def test_load_mixed_clients_under_eviction(node_factory: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # the node rejects unknown KVSTORE_* variables: keep the test's own knob out of its environment
    monkeypatch.delenv("KVSTORE_LOAD_SECONDS", raising=False)
    node = node_factory("--dram", "64MiB", "--nvme", "512MiB")
    wl = worker.Workload(N_CHAINS, CHAIN_LEN)
    assert wl.working_set_bytes() > 3 * DRAM

    procs: list[subprocess.Popen[str]] = []
    seed = 100
    for transport, count in TCP_PROCESSES:
        for _ in range(count):
            p = subprocess.Popen(
                [
                    sys.executable,
                    str(WORKER_PATH),
                    "load",
                    node.tcp,
                    str(SECONDS),
                    str(seed),
                    transport,
                    str(N_CHAINS),
                    str(CHAIN_LEN),
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            procs.append(p)
            seed += 1

    results: list[worker.LoadStats] = []
    lock = threading.Lock()
    timeouts = Timeouts(rpc=30, data=60)

    def sync_worker(kv: KVClient, s: int) -> None:
        st = worker.run_load(kv, wl, SECONDS, s)
        with lock:
            results.append(st)

    def own_client_worker(s: int) -> None:
        with KVClient(node.unix, timeouts=timeouts) as kv:
            sync_worker(kv, s)

    def async_worker(s: int) -> None:
        loop = asyncio.new_event_loop()
        try:

            async def make() -> AsyncKVClient:
                return AsyncKVClient(node.unix, timeouts=timeouts)

            kv = loop.run_until_complete(make())
            try:
                st = worker.run_load(kv, wl, SECONDS, s, call=loop.run_until_complete)
            finally:
                loop.run_until_complete(kv.close())
            with lock:
                results.append(st)
        finally:
            loop.close()

    sampler = MemorySampler(node.endpoints["pid"])
    shared = KVClient(node.unix, timeouts=timeouts)
    threads = [threading.Thread(target=sync_worker, args=(shared, seed + i)) for i in range(SHARED_THREADS)]
    threads.append(threading.Thread(target=own_client_worker, args=(seed + 50,)))
    threads.append(threading.Thread(target=async_worker, args=(seed + 51,)))
    assert len(threads) + len(procs) == 16
    t0 = time.monotonic()
    sampler.start()
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(SECONDS + 120)
            assert not t.is_alive(), "a load thread hung"
        outputs = []
        for p in procs:
            out, _ = p.communicate(timeout=SECONDS + 120)
            outputs.append(out)
    finally:
        sampler.stop.set()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    elapsed = time.monotonic() - t0
    sampler.join(5)

    for p, out in zip(procs, outputs):
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        assert p.returncode == 0 and lines, f"load process failed (rc={p.returncode}):\n{out[-4000:]}"
        st = worker.LoadStats()
        st.merge(json.loads(lines[-1][len("RESULT ") :]))
        results.append(st)
    assert len(results) == 16

    total = worker.LoadStats()
    for st in results:
        total.merge(st.as_dict())
    c = total.c
    try:
        s = _wait_idle(shared)
    finally:
        shared.close()
    n = s["counters"]
    uss_third, uss_end = sampler.at(1 / 3), sampler.at(1.0)
    summary = {
        "seconds": round(elapsed, 1),
        "ops": c["ops"],
        "ops_per_s": round(c["ops"] / elapsed),
        "put_MBps": round(c["bytes_put"] / elapsed / 1e6),
        "get_MBps": round(c["bytes_got"] / elapsed / 1e6),
        "hits": c["hits"],
        "misses": c["misses"],
        "misses_after_stored": c["misses_after_stored"],
        "puts_refused": c["puts_refused"],
        "blocks_put": c["blocks_put"],
        "max_op_ms": max(st.c["max_op_ms"] for st in results),
        "node_uss_MiB": [round(uss_third / MIB), round(uss_end / MIB)],
        "node_rss_max_MiB": round(max(r for _, _, r in sampler.samples) / MIB),
        "demotions": n.get("demotions", 0),
        "promotions": n.get("promotions", 0),
        "dram_evictions": n.get("dram_evictions", 0),
        "nvme_evictions": n.get("nvme_evictions", 0),
        "get_no_space": n.get("get_no_space", 0),
        "reserve_no_space": n.get("reserve_no_space", 0),
    }
    print("\nLOAD " + json.dumps(summary))

    assert not total.errors, f"{len(total.errors)} client errors, first:\n{total.errors[0]}"
    assert not total.bad, f"blocks that did not match their payload: {total.bad}"
    assert c["hits"] > 0 and c["blocks_put"] > 0 and c["ops_match"] > 0
    assert (s["reservations"], s["leases"]) == (0, 0), s
    assert n.get("pending_transfers", 0) == 0
    assert n.get("demotions", 0) > 0 and n.get("promotions", 0) > 0 and n.get("dram_evictions", 0) > 0, n
    assert (
        n.get("corrupt_demotions", 0) == 0 and n.get("corrupt_puts", 0) == 0 and n.get("nvme_corrupt_blocks", 0) == 0
    ), n
    if not any(n.get(k, 0) for k in ("nvme_evictions", "nvme_write_failures", "nvme_rejected", "get_no_space")):
        # NVMe holds the whole working set and nothing is deleted: a block once stored stays readable
        assert c["misses_after_stored"] == 0, summary
    assert s["tiers"]["dram"]["used_bytes"] <= DRAM
    assert uss_end < USS_LIMIT, summary
    assert uss_end - uss_third < USS_GROWTH_LIMIT, summary

"""Regression: the conductor's ``pool_errors`` on a loaded machine (a slow pool answer taken for a failure).

The conductor used its decision budget (``pool_timeout_s``, 50 ms) as the cluster client's
gRPC, connect and etcd deadlines too, and cancelled a lookup past it with ``wait_for``: on
a 2-core machine with engines busy-waiting, an answer later than 50 ms counted as a pool
error, took the pool out for 2 s, or made the cluster client route around a healthy node
(see :mod:`kvstore.conductor.service`).  Now a lookup past the budget is *late*: the
decision goes on without the pool, counted in ``pool_late``, the lookup ends in the
background within the client's own deadlines, and nothing is concluded about the pool.

Real components: a private etcd, two ``kvstore serve`` nodes, the conductor's own
:meth:`~kvstore.conductor.service.Conductor.pool_match`, and busy-loop processes for the
load.  No assertion depends on how long anything takes: a budget of a microsecond is one
no lookup can meet (an answer needs the loop to turn at least twice), whatever the machine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from cluster_fixtures import Cluster, cluster, etcd  # noqa: F401 - fixtures

from client import Namespace
from kvstore.cluster.local_etcd import LocalEtcd
from kvstore.conductor.engines import EngineState
from kvstore.conductor.policy import PoolMatch
from kvstore.conductor.service import Conductor, ConductorConfig

pytestmark = pytest.mark.solo  # it loads the cores on purpose: scripts/test.sh runs it on its own

CHUNK = 256
NS = Namespace("pool-errors", chunk_tokens=CHUNK)
STORED = 6  # leading chunks of each prompt put into the pool
PROMPTS = 8


def prompt(i: int) -> list[int]:
    return [(1000 * i + j) % 30000 for j in range(CHUNK * 8)]


def engines() -> list[EngineState]:
    """Two engines keyed by NS (as registered engines are), for the lookups' namespace."""
    return [
        EngineState(name, f"http://{name}.invalid", fingerprint=NS.fingerprint, chunk_tokens=CHUNK) for name in "ab"
    ]


@pytest.fixture
def pool(cluster: Cluster) -> Cluster:  # the fixture
    """Two nodes holding the first STORED chunks of each of PROMPTS prompts."""
    cluster.start("n1", "n2")
    kv = cluster.client()
    for i in range(PROMPTS):
        keys = kv.chunk_keys(prompt(i), NS)[:STORED]
        for j, k in enumerate(keys):
            parent = keys[j - 1] if j else None
            assert kv.put(k, np.full(4096, j, np.uint8), namespace=NS, parent=parent, token_count=CHUNK)
    return cluster


@pytest.fixture
def busy() -> Iterator[None]:
    """Two busy loops, as two vLLM engines busy-wait beside the conductor on a 2-core machine."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


async def until(pred: Callable[[], Any], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.02)


async def started(target: str, budget_s: float) -> Conductor:
    c = Conductor(ConductorConfig(etcd=target, pool_timeout_s=budget_s))
    await c.start()
    await until(lambda: c._pool is not None, 30, "the conductor's pool client")
    return c


def credited(got: dict[tuple[bytes, int], PoolMatch]) -> int:
    """Chunks the pool was credited with in one lookup's answer."""
    (match,) = got.values()
    return len(match.where)


def test_a_lookup_past_the_budget_is_late_not_a_pool_error(pool: Cluster) -> None:
    async def go() -> None:
        c = await started(pool.target, 1e-6)  # no lookup can answer within a microsecond
        try:
            answers = await asyncio.gather(*(c.pool_match(prompt(i), engines()) for i in range(PROMPTS)))
            assert answers == [{}] * PROMPTS  # each decision went on without the pool ...
            assert (c.pool_late, c.pool_errors) == (PROMPTS, 0)  # ... counted as late, not as errors
            assert c.pool_down_until == 0  # and the pool was not taken out
            # the late lookups were not cancelled: they end, and nothing was concluded about the nodes
            await until(lambda: not c._pool_inflight, 30, "the late lookups to end")
            assert c._pool.miss_counts() == {"node_down": 0, "deadline": 0}
            assert c._pool.suspects == {}

            c.cfg = dataclasses.replace(c.cfg, pool_timeout_s=30.0)  # a budget the pool can meet
            got = await c.pool_match(prompt(0), engines())
            assert credited(got) == STORED
            assert (c.pool_late, c.pool_errors) == (PROMPTS, 0)
            assert c.routing()["pool_late"] == PROMPTS and c.routing()["pool_errors"] == 0
        finally:
            await c.close()

    asyncio.run(go())


def test_under_cpu_load_lookups_are_answered_or_late_never_errors(pool: Cluster, busy: None) -> None:
    """The serving budget (50 ms) with the cores busy: every decision gets the pool's whole
    answer or none (late), and no healthy node is taken for down."""
    n = 120

    async def go() -> None:
        c = await started(pool.target, ConductorConfig().pool_timeout_s)
        try:
            answers = []
            for i in range(n):  # about 20 requests a second, several lookups in flight at once
                answers.append(asyncio.ensure_future(c.pool_match(prompt(i % PROMPTS), engines())))
                await asyncio.sleep(0.05)
            got = await asyncio.gather(*answers)
            answered = [a for a in got if a]
            assert all(credited(a) == STORED for a in answered)
            assert len(answered) + c.pool_late == n
            assert c.pool_errors == 0, c.routing()
            await until(lambda: not c._pool_inflight, 30, "the late lookups to end")
            assert c._pool.miss_counts() == {"node_down": 0, "deadline": 0}
            assert c._pool.suspects == {}
        finally:
            await c.close()

    asyncio.run(go())


def test_the_conductor_starts_without_etcd_and_finds_the_pool_when_it_answers(etcd: LocalEtcd) -> None:
    """The pool client is made off the loop: with etcd out, ``start`` neither blocks nor fails,
    requests are routed without the pool, and the pool is found once etcd answers."""
    etcd.stop()

    async def go() -> None:
        c = Conductor(ConductorConfig(etcd=f"etcd://{etcd.endpoint}/nopool"))
        await c.start()  # used to wait up to 10 s on the loop, then raise Unavailable
        try:
            assert await c.pool_match(prompt(0), engines()) == {}
            assert (c.pool_late, c.pool_errors) == (0, 0)
            await asyncio.to_thread(etcd.start)
            await until(lambda: c._pool is not None, 30, "the pool client once etcd answers")
        finally:
            await c.close()

    asyncio.run(go())

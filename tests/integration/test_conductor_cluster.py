"""``kvstore conductor --etcd`` over a real cluster: a private etcd, a real kvstore node, and
stand-in engines (tests/stand_in_engine.py) registered in etcd the way the vLLM connector
registers a real engine (:class:`~kvstore.cluster.engines.EngineRegistrar`).

What only the cluster gives the conductor: engines found (and lost) through their
registrations; the pool's chunks credited per engine by node and tier; routing that goes
on by load alone when the node or etcd is out; a conductor that rebuilds its view from
etcd after a restart; and several conductors over one fleet, each seeing the load the
others put on it through the engines' ``/metrics``.  The conductor over static engines
(bad input, faults, rejection) is tests/integration/test_conductor_front.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cluster_fixtures import Cluster, cluster, etcd  # noqa: F401 - fixtures
from conftest import wait_for
from test_conductor_front import Proc, _get, engine, post, seen, state, wait_http

from client import KVClient, Namespace, chunk_keys
from kvstore.cluster.engines import EngineRegistrar
from kvstore.cluster.local_etcd import free_port
from kvstore.cluster.state import EngineRecord

CHUNK = 256
NS = Namespace("stand-in", chunk_tokens=CHUNK)  # the namespace the stand-ins "key" their KV by
BLOCK = 4096  # bytes per stored chunk: the conductor asks where chunks are, never reads them


def eid(e: Proc) -> str:
    """The engine id a stand-in registers under (and the conductor names it by)."""
    return e.url.removeprefix("http://")


class Rig:
    """The processes and registrations of one test, stopped at teardown: conductors first,
    then registrations (revoked), then engines; the cluster fixture stops node and etcd."""

    def __init__(self, cluster: Cluster, tmp: Path) -> None:
        self.cluster, self.tmp = cluster, tmp
        self.conductors: list[Proc] = []
        self.engines: list[Proc] = []
        self.registrars: list[EngineRegistrar] = []

    def engine(self, name: str, *extra: str) -> Proc:
        e = engine(self.tmp, name, *extra)
        self.engines.append(e)
        return e

    def register(self, e: Proc, node: str = "") -> EngineRegistrar:
        rec = EngineRecord(
            engine_id=eid(e),
            url=e.url,
            role="both",
            fingerprint=NS.fingerprint.hex(),
            chunk_tokens=CHUNK,
            block_size=16,
            models=("stand-in",),
            node=node,
            host="test",
            pid=os.getpid(),
        )
        reg = EngineRegistrar(self.cluster.target, rec, ttl_s=2).start()
        self.registrars.append(reg)
        return reg

    def conductor(self, name: str = "conductor", *extra: str, port: int = 0) -> Proc:
        """``kvstore conductor --etcd`` (no ``--engine``), answering HTTP (its engines may come later)."""
        port = port or free_port("127.0.0.1")
        args = [sys.executable, "-m", "kvstore", "conductor", "--port", str(port), "--probe-s", "0.2"]
        # a generous pool budget: the default (50 ms) is for serving, not for a loaded test machine
        args += ["--etcd", self.cluster.target, "--pool-timeout-ms", "2000", *extra]
        c = Proc(args, f"http://127.0.0.1:{port}", self.tmp / f"{name}.log").start()
        self.conductors.append(c)
        wait_http(c.url + "/conductor/state")
        return c

    def close(self) -> None:
        for c in reversed(self.conductors):
            c.stop()
        for r in self.registrars:
            r.close()
        for e in self.engines:
            e.stop()


@pytest.fixture
def rig(cluster: Cluster, tmp_path: Path) -> Iterator[Rig]:  # the fixture
    r = Rig(cluster, tmp_path)
    try:
        yield r
    finally:
        r.close()


def live(c: Proc) -> set[str]:
    """The engines the conductor routes to now (registered and answering its probes)."""
    return {e["engine_id"] for e in state(c)["engines"] if e["alive"]}


def wait_live(c: Proc, want: set[str], timeout: float = 5.0) -> None:
    wait_for(lambda: live(c) == want, timeout, f"the conductor to route over exactly {sorted(want)}: {state(c)}")


def prompt(n: int, first: int = 1000) -> list[int]:
    return [(first + i) % 30000 for i in range(n)]


def complete(c: Proc, tokens: list[int]) -> tuple[str, str]:
    """One request of ``tokens`` through ``c``: (engine, route header); it must be answered 200."""
    status, body, headers = post(c.url + "/v1/completions", {"model": "stand-in", "prompt": tokens, "max_tokens": 4})
    assert status == 200, (status, body)
    return headers["x-kvstore-engine"], headers["x-kvstore-route"]


def pool_part(route: str) -> str:
    """``pool=N(dram=..,nvme=..,remote=..)`` of the chosen engine, from ``x-kvstore-route``."""
    m = re.search(r"pool=\d+\(dram=\d+,nvme=\d+,remote=\d+\)", route)
    assert m, route
    return m.group(0)


def metric(c: Proc, name: str) -> float:
    _, text, _ = _get(c.url + "/metrics")
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def store_chunks(node_target: str, tokens: list[int], n: int) -> None:
    """Put the KV of the first ``n`` chunks of ``tokens`` (in the engines' namespace) into a node."""
    keys = chunk_keys(tokens, NS)
    assert len(keys) >= n
    with KVClient(node_target) as kv:
        for i, k in enumerate(keys[:n]):
            parent = keys[i - 1] if i else None
            assert kv.put(k, np.full(BLOCK, i, np.uint8), namespace=NS, parent=parent, token_count=CHUNK)


def test_engines_are_found_through_etcd_and_a_revoked_one_leaves(rig: Rig) -> None:
    a, b = rig.engine("a"), rig.engine("b")
    reg_a = rig.register(a)
    rig.register(b)
    c = rig.conductor()
    wait_live(c, {eid(a), eid(b)})
    assert {e["source"] for e in state(c)["engines"]} == {"etcd"}
    went = [complete(c, prompt(64, seed))[0] for seed in range(6)]
    assert set(went) == {eid(a), eid(b)}, went  # idle twins: exact ties spread over both
    assert seen(a)["requests"] > 0 and seen(b)["requests"] > 0

    assert reg_a.close() is True  # the engine deregisters (its lease revoked): it must leave at once
    wait_for(lambda: {e["engine_id"] for e in state(c)["engines"]} == {eid(b)}, 5, "engine a to leave the state")
    before = seen(a)["requests"]
    went = [complete(c, prompt(64, seed))[0] for seed in range(6)]
    assert set(went) == {eid(b)}, went
    assert seen(a)["requests"] == before, "a deregistered engine got requests"


def test_the_pools_chunks_are_credited_by_node_and_tier(rig: Rig) -> None:
    """Two chunks of a prompt in the node's DRAM: the engine on that node loads them from
    DRAM (and wins), an engine on no node would pull them over the network."""
    (node,) = rig.cluster.start("n1")
    a, b = rig.engine("a"), rig.engine("b")
    reg_a = rig.register(a, node=node.unix)
    rig.register(b)  # on no node: every pool chunk is remote to it
    tokens = prompt(600)
    store_chunks(node.unix, tokens, 2)
    c = rig.conductor()
    wait_live(c, {eid(a), eid(b)})
    nodes = {e["engine_id"]: e["node_id"] for e in state(c)["engines"]}
    assert nodes == {eid(a): "n1", eid(b): ""}, nodes

    went, route = complete(c, tokens)
    assert (went, pool_part(route)) == (eid(a), "pool=512(dram=512,nvme=0,remote=0)"), route
    assert "compute=88" in route, route
    went, route = complete(c, tokens[:512])  # vLLM computes the last token: credit stops one short
    assert (went, pool_part(route)) == (eid(a), "pool=511(dram=511,nvme=0,remote=0)"), route
    _, route = complete(c, prompt(600, first=5000))  # a prompt the pool does not hold
    assert pool_part(route) == "pool=0(dram=0,nvme=0,remote=0)", route
    assert metric(c, 'kvstore_conductor_hit_tokens_total{source="pool_dram"}') == 512 + 511

    reg_a.close()
    wait_live(c, {eid(b)})
    went, route = complete(c, tokens)
    assert (went, pool_part(route)) == (eid(b), "pool=512(dram=0,nvme=0,remote=512)"), route


def test_with_the_node_or_etcd_out_requests_are_routed_by_load(rig: Rig) -> None:
    """A stopped or killed node makes pool lookups come back empty (counted as pool errors;
    the cluster client routes around the node for a while), a killed etcd leaves the
    engines known so far: every request is still answered, by load alone."""
    (node,) = rig.cluster.start("n1")
    a, b = rig.engine("a"), rig.engine("b")
    rig.register(a, node=node.unix)
    rig.register(b, node=node.unix)
    tokens = prompt(600)
    store_chunks(node.unix, tokens, 2)
    c = rig.conductor()
    wait_live(c, {eid(a), eid(b)})
    assert pool_part(complete(c, tokens)[1]) == "pool=512(dram=512,nvme=0,remote=0)"
    assert metric(c, "kvstore_conductor_pool_errors_total") == 0

    rig.cluster.sigstop("n1")
    try:
        for _ in range(4):
            _, route = complete(c, tokens)
            assert pool_part(route) == "pool=0(dram=0,nvme=0,remote=0)", route
        assert metric(c, "kvstore_conductor_pool_errors_total") > 0
        assert state(c)["routing"]["pool_errors"] > 0
    finally:
        rig.cluster.sigcont("n1")
    # the node answers again: its chunks are credited again once the client stops routing around it
    wait_for(lambda: pool_part(complete(c, tokens)[1]).startswith("pool=512"), 10, "the pool to be credited again")

    node.kill9()
    for _ in range(4):
        _, route = complete(c, tokens)
        assert pool_part(route) == "pool=0(dram=0,nvme=0,remote=0)", route

    rig.cluster.etcd.stop(sig=signal.SIGKILL)
    time.sleep(1.5)  # past a few registry polls: the engines known must stay
    went = {complete(c, prompt(64, seed))[0] for seed in range(6)}
    assert went == {eid(a), eid(b)}, went
    assert live(c) == {eid(a), eid(b)}
    rig.cluster.etcd.start()  # back, so that the registrations revoke quickly at teardown


def test_a_restarted_conductor_rebuilds_its_view_from_etcd(rig: Rig) -> None:
    a, b = rig.engine("a"), rig.engine("b")
    rig.register(a)
    rig.register(b)
    first = rig.conductor("first")
    wait_live(first, {eid(a), eid(b)})
    complete(first, prompt(64))
    port = int(first.url.rsplit(":", 1)[1])
    first.kill()  # no goodbye: all it knew is gone
    again = rig.conductor("again", port=port)
    wait_live(again, {eid(a), eid(b)})
    st = state(again)
    assert {e["source"] for e in st["engines"]} == {"etcd"} and sum(st["routing"]["decisions_per_engine"].values()) == 0
    went = {complete(again, prompt(64, seed))[0] for seed in range(4)}
    assert went == {eid(a), eid(b)}, went


def test_two_conductors_serve_side_by_side_and_see_each_others_load(rig: Rig) -> None:
    """A stream held open on one engine through conductor 1 shows in conductor 2's view
    (scraped from the engine's ``/metrics``), and conductor 2 sends its next request to
    the other engine."""
    a, b = rig.engine("a", "--token-ms", "100"), rig.engine("b", "--token-ms", "100")
    rig.register(a)
    rig.register(b)
    one, two = rig.conductor("one"), rig.conductor("two")
    wait_live(one, {eid(a), eid(b)})
    wait_live(two, {eid(a), eid(b)})
    body = json.dumps({"model": "stand-in", "prompt": prompt(64), "max_tokens": 200, "stream": True}).encode()
    req = urllib.request.Request(one.url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as held:
        busy = held.headers["x-kvstore-engine"]
        assert held.readline().startswith(b"data:")  # the stream is open on the engine
        idle = ({eid(a), eid(b)} - {busy}).pop()

        def scraped() -> dict[str, Any]:
            return {e["engine_id"]: e["scraped"]["running"] for e in state(two)["engines"]}

        wait_for(lambda: scraped() == {busy: 1, idle: 0}, 5, f"conductor two to see {busy} running one request")
        mine = {e["engine_id"]: e["prefilling"] + e["decoding"] for e in state(two)["engines"]}
        assert mine == {busy: 0, idle: 0}, mine  # the load is not its own: it came from the engine
        assert complete(two, prompt(64, 10))[0] == idle  # the engine says it is busy: two sends elsewhere
        wait_for(lambda: scraped() == {busy: 1, idle: 0}, 5, f"{idle} to be idle again")
        assert complete(one, prompt(64, 11))[0] == idle
    # the held stream is closed: the engine aborts it, and both views see it idle again
    wait_for(lambda: scraped() == {busy: 0, idle: 0}, 5, "the engines to be idle again")

"""vLLM engines registered in a real etcd (``engines/<engine_id>`` on a lease), read back the
way a request scheduler reads them (``Membership(...).snapshot().engines``): a registration
appears and a deregistration removes it at once; an engine process killed with SIGKILL
drops out when its lease expires; a record deleted under a live engine comes back; an
etcd that is down at start-up neither stalls nor fails the registrar; a second engine
claiming a live engine's id is refused."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import pytest
from cluster_fixtures import etcd  # noqa: F401 - fixture
from conftest import ROOT, wait_for

from kvstore.cluster.engines import EngineRegistrar
from kvstore.cluster.etcd import EtcdSession
from kvstore.cluster.local_etcd import LocalEtcd
from kvstore.cluster.membership import Membership
from kvstore.cluster.state import EngineRecord, engine_key

TTL = 2  # seconds: etcd's minimum is about 1.5


def record(engine_id: str = "10.0.0.5:8000", **kw: object) -> EngineRecord:
    base = EngineRecord(
        engine_id=engine_id,
        url=f"http://{engine_id}",
        role="both",
        fingerprint="0123456789abcdef",
        chunk_tokens=256,
        block_size=16,
        models=("m",),
        host="test",
        pid=os.getpid(),
    )
    return dataclasses.replace(base, **kw)  # type: ignore[arg-type]


@pytest.fixture
def name() -> str:
    return f"e{uuid.uuid4().hex[:8]}"


@pytest.fixture
def view(etcd: LocalEtcd, name: str) -> Iterator[Membership]:  # the fixture
    with Membership(etcd.endpoint, name) as m:
        yield m


def target(etcd: LocalEtcd, name: str) -> str:
    return f"etcd://{etcd.endpoint}/{name}"


def test_a_registration_appears_in_the_view_and_deregistering_removes_it(
    etcd: LocalEtcd,
    name: str,
    view: Membership,
) -> None:
    with EngineRegistrar(target(etcd, name), record(), ttl_s=TTL) as reg:
        snap = view.wait_for(lambda s: "10.0.0.5:8000" in s.engines, 10)
        assert snap is not None and snap.nodes == {}
        got = snap.engines["10.0.0.5:8000"]
        assert got == dataclasses.replace(record(), started_at=got.started_at) and got.started_at > 0
        time.sleep(TTL * 2)  # kept alive over several TTLs
        assert "10.0.0.5:8000" in view.snapshot().engines and reg.registration.registrations == 1
        t = time.monotonic()
        assert reg.close() is True
    assert view.wait_for(lambda s: not s.engines, TTL / 2) is not None, "deregistering revokes at once"
    assert time.monotonic() - t < TTL


CHILD = """
import sys, time
from kvstore.cluster.engines import EngineRegistrar
from kvstore.cluster.state import EngineRecord
rec = EngineRecord(engine_id="killed:8000", url="http://killed:8000", role="decode",
                   fingerprint="00000000000000ff", chunk_tokens=256, block_size=16)
reg = EngineRegistrar(sys.argv[1], rec, ttl_s=float(sys.argv[2])).start()
while not reg.registered:
    time.sleep(0.05)
print("registered", flush=True)
time.sleep(3600)
"""


def test_a_killed_engine_drops_out_when_its_lease_expires(
    etcd: LocalEtcd,
    name: str,
    view: Membership,
) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, target(etcd, name), str(TTL)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "registered"
        snap = view.wait_for(lambda s: "killed:8000" in s.engines, 10)
        assert snap is not None and snap.engines["killed:8000"].role == "decode"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        t = time.monotonic()
        assert view.wait_for(lambda s: not s.engines, TTL + 5) is not None, "the lease expired with the engine"
        assert time.monotonic() - t <= TTL + 5
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_a_deleted_record_is_registered_again(etcd: LocalEtcd, name: str, view: Membership) -> None:
    with EngineRegistrar(target(etcd, name), record(), ttl_s=TTL) as reg:
        assert view.wait_for(lambda s: "10.0.0.5:8000" in s.engines, 10) is not None
        first = reg.lease_id

        async def delete() -> None:
            session = EtcdSession(etcd.endpoint)
            try:
                await session.run(lambda c: c.delete(engine_key(name, "10.0.0.5:8000")), "deleting")
            finally:
                await session.close()

        asyncio.run(delete())
        assert view.wait_for(lambda s: not s.engines, 5) is not None
        snap = view.wait_for(lambda s: "10.0.0.5:8000" in s.engines, TTL + 5)
        assert snap is not None, "the keep-alive notices the record is gone and registers again"
        wait_for(lambda: reg.registration.registrations == 2, 5, "the second registration")
        assert reg.lease_id not in (None, first)


def test_etcd_down_at_start_neither_stalls_nor_fails_the_registrar(etcd: LocalEtcd, name: str) -> None:
    etcd.stop()
    t = time.monotonic()
    reg = EngineRegistrar(target(etcd, name), record(), ttl_s=TTL).start()
    try:
        assert time.monotonic() - t < 1.0, "start() returns at once"
        time.sleep(1.0)
        assert not reg.registered
        etcd.start()
        wait_for(lambda: reg.registered, 20, "registration once etcd answers")
        with Membership(etcd.endpoint, name) as view:
            assert view.wait_for(lambda s: "10.0.0.5:8000" in s.engines, 10) is not None
    finally:
        reg.close()


def test_a_second_engine_with_a_live_engines_id_is_refused(
    etcd: LocalEtcd,
    name: str,
    view: Membership,
) -> None:
    with EngineRegistrar(target(etcd, name), record(), ttl_s=TTL):
        assert view.wait_for(lambda s: "10.0.0.5:8000" in s.engines, 10) is not None
        other = record(url="http://10.0.0.6:8000")  # the same id, another engine
        with EngineRegistrar(target(etcd, name), other, ttl_s=TTL) as second:
            time.sleep(TTL)
            assert not second.registered
            assert view.snapshot().engines["10.0.0.5:8000"].url == "http://10.0.0.5:8000"

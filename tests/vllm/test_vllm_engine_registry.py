"""A real vLLM engine with the connector's ``advertise_url`` registers itself in etcd (the
cluster of its ``lookup_target``), as a request scheduler reads it: the role its
``kv_role`` says, the fingerprint its requests are keyed by (the one its own
``kv_transfer_params`` name), its chunk and block sizes, the endpoints of its KV events;
and it leaves the registry when it exits (the connector's ``shutdown`` revokes the lease:
no wait for the lease to expire).  The conductor's KV-events subscriber follows the same
engine through the endpoints its record advertises, and credits it exactly.

One small engine of its own (not the shared rig's): it starts in a minute or two here."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

URL = "http://127.0.0.1:18123"  # what clients would reach (the offline engine serves no HTTP)
ENGINE_ID = "127.0.0.1:18123"
LAYERS, HIDDEN, MAX = 2, 256, 1024
KV_PER_TOKEN = LAYERS * 2 * (HIDDEN // 64 // 2) * 64 * 4  # K and V, fp32, 2 KV heads of 64


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from kvstore.children import private_node
    from kvstore.cluster.membership import Membership
    from kvstore.cluster.state import parse_target
    from kvstore.demo.engine import EngineProcess, make_model
    from kvstore.demo.vllm import local_cluster

    d = tmp_path_factory.mktemp("registry")
    with contextlib.ExitStack() as stack:
        cluster_target, member = local_cluster(stack, d)
        if not cluster_target:
            pytest.skip("etcd is not installed: scripts/setup.sh installs it")
        model = make_model(d / "model", layers=LAYERS, hidden=HIDDEN, max_tokens=MAX)
        node = private_node(d / "node", *member, dram="64MiB", nvme="0")
        stack.callback(node.close)
        extra = {"target": node.target, "lookup_target": cluster_target, "advertise_url": URL, "deadline_s": 2.0}
        pub, replay = free_port(), free_port()
        engine = EngineProcess(
            model,
            max_tokens=MAX,
            kv_bytes=64 << 20,  # 256 pages: not 128, the page size (a KV shape the connector could not read)
            connector={"role": "kv_producer", "extra": extra},
            log_path=d / "engine.log",
            kv_events={
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://*:{pub}",  # vLLM binds tcp://*:PORT; the record says where to reach it
                "replay_endpoint": f"tcp://*:{replay}",
            },
        )
        stack.callback(engine.close)
        endpoints, cluster = parse_target(cluster_target)
        view = stack.enter_context(Membership(endpoints, cluster))
        engine.wait_ready(timeout=600)
        yield {"engine": engine, "view": view, "model": model, "events": (pub, replay)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, 31000, n).tolist()


def wait_for(pred: Any, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def reset(engine: Any) -> None:
    """Drop the engine's prefix cache; vLLM refuses while a finished request's blocks wait
    for its save to commit: asked again until they are free (bounded)."""
    deadline = time.monotonic() + 60
    while not engine.reset_prefix_cache():
        assert time.monotonic() < deadline, "vLLM refused to drop its prefix cache for 60 s (blocks still held)"
        time.sleep(0.1)


def test_a_real_engine_is_credited_with_its_prompts_full_blocks(fleet: dict[str, Any]) -> None:
    """The conductor's subscriber, on the endpoints the engine's record advertises, credits
    the engine with exactly its prompts' full blocks, and with none after a reset (runs
    before the registry test below, which stops the engine)."""
    from kvstore.conductor.cacheindex import FleetCacheIndex
    from kvstore.conductor.subscriber import KVEventSubscriber

    engine, view = fleet["engine"], fleet["view"]
    snap = view.wait_for(lambda s: ENGINE_ID in s.engines, 30)
    assert snap is not None, f"the engine never registered{engine.log_tail()}"
    rec = snap.engines[ENGINE_ID]
    pub, replay = fleet["events"]
    assert (rec.kv_events, rec.kv_events_replay) == (f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")
    bs = engine.block_size
    ix = FleetCacheIndex()
    sub = KVEventSubscriber("e0", rec.kv_events, ix, replay=rec.kv_events_replay, block_size=bs)
    try:
        p = prompt(42, 600)
        r = engine.generate(p, max_tokens=1)
        assert r["tokens"]
        full = 600 // bs * bs
        wait_for(lambda: ix.match(p)["e0"] == full, f"the prompt's {600 // bs} full blocks credited")
        shared = p[:320] + prompt(43, 280)
        assert ix.match(shared)["e0"] == 320 // bs * bs
        assert ix.match(prompt(44, 600))["e0"] == 0
        reset(engine)
        # vLLM publishes a step's events after the step: the reset goes out with the next one
        q = prompt(45, 100)
        engine.generate(q, max_tokens=1)
        wait_for(lambda: ix.match(q)["e0"] == 100 // bs * bs, "the next request credited")
        # the clear may go out a step after q's blocks (the engine core resets between steps)
        wait_for(lambda: ix.match(p)["e0"] == 0, "the reset's clear applied")
        assert sub.connected and sub.errors == 0 and sub.resyncs == 0
        c = ix.counts("e0")
        assert c["stored"] >= 600 // bs and c["cleared"] >= 1
        # the connector's own events (the prompt's chunks it saved, medium CPU) are not the
        # engine's prefix cache: counted apart, never credited
        assert c["foreign"] == 600 // rec.chunk_tokens, c
    finally:
        sub.close()


def test_a_vllm_engine_registers_and_leaves_with_its_process(fleet: dict[str, Any]) -> None:
    from kvstore.keys import Namespace

    engine, view, model = fleet["engine"], fleet["view"], fleet["model"]
    snap = view.wait_for(lambda s: ENGINE_ID in s.engines, 30)
    assert snap is not None, f"the engine never registered{engine.log_tail()}"
    rec = snap.engines[ENGINE_ID]
    assert (rec.url, rec.role, rec.models, rec.tp_size) == (URL, "prefill", (str(Path(model)),), 1)
    assert rec.block_size == engine.block_size and rec.chunk_tokens == -(-256 // engine.block_size) * engine.block_size
    assert rec.bytes_per_token == KV_PER_TOKEN and rec.kv_events.startswith("tcp://127.0.0.1:")
    assert rec.host == socket.gethostname() and rec.pid > 0 and rec.started_at > 0 and rec.node.startswith("unix://")

    # the fingerprint is the one the connector keys the engine's plain requests by
    out = engine.generate(list(range(1, 301)), max_tokens=2)
    kv = (out.get("kv_transfer_params") or {}).get("kvstore") or {}
    assert kv, f"no kv_transfer_params: {out}"
    assert Namespace.from_dict(kv["namespace"]).fingerprint.hex() == rec.fingerprint
    assert kv["chunk_tokens"] == rec.chunk_tokens

    # the engine exits: the connector's shutdown revokes the lease (10 s) at once
    engine.close()
    t = time.monotonic()
    gone = view.wait_for(lambda s: ENGINE_ID not in s.engines, 30)
    assert gone is not None, "the engine's record outlived it"
    assert time.monotonic() - t < 5, "the record went only with its lease: the connector's shutdown did not revoke it"


def test_kv_events_endpoints_from_vllms_config() -> None:
    """vLLM's own ``KVEventsConfig``: its wildcard bind endpoints as another machine reaches
    them, offset by the data-parallel rank as vLLM's publisher offsets them (no engine)."""
    from types import SimpleNamespace

    from vllm.config import KVEventsConfig

    from gpu_agent.vllm.registry import kv_events_endpoints

    def cfg(rank: int = 0, **kw: Any) -> Any:
        return SimpleNamespace(
            kv_events_config=KVEventsConfig(**kw), parallel_config=SimpleNamespace(data_parallel_index=rank)
        )

    on = {"enable_kv_cache_events": True, "publisher": "zmq"}
    assert kv_events_endpoints(cfg(), "10.0.0.5") == ("", "")  # events off
    assert kv_events_endpoints(cfg(**on), "10.0.0.5") == ("tcp://10.0.0.5:5557", "")
    both = {**on, "endpoint": "tcp://*:6000", "replay_endpoint": "tcp://0.0.0.0:6001"}
    assert kv_events_endpoints(cfg(**both), "10.0.0.5") == ("tcp://10.0.0.5:6000", "tcp://10.0.0.5:6001")
    assert kv_events_endpoints(cfg(2, **both), "10.0.0.5") == ("tcp://10.0.0.5:6002", "tcp://10.0.0.5:6003")
    assert kv_events_endpoints(cfg(enable_kv_cache_events=True, publisher="null"), "10.0.0.5") == ("", "")

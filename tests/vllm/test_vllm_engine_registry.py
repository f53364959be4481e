"""A real vLLM engine with the connector's ``advertise_url`` registers itself in etcd (the
cluster of its ``lookup_target``), as a request scheduler reads it: the role its
``kv_role`` says, the fingerprint its requests are keyed by (the one its own
``kv_transfer_params`` name), its chunk and block sizes; and it leaves the registry when it
exits (the connector's ``shutdown`` revokes the lease: no wait for the lease to expire).

One small engine of its own (not the shared rig's): it starts in a minute or two here."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

URL = "http://127.0.0.1:18123"  # what clients would reach (the offline engine serves no HTTP)
ENGINE_ID = "127.0.0.1:18123"
LAYERS, HIDDEN, MAX = 2, 256, 1024
KV_PER_TOKEN = LAYERS * 2 * (HIDDEN // 64 // 2) * 64 * 4  # K and V, fp32, 2 KV heads of 64


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from gpu_agent.vllm.demo import local_cluster
    from gpu_agent.vllm.engine import EngineProcess, make_model
    from kvstore.children import private_node
    from kvstore.cluster.membership import Membership
    from kvstore.cluster.state import parse_target

    d = tmp_path_factory.mktemp("registry")
    with contextlib.ExitStack() as stack:
        cluster_target, member = local_cluster(stack, d)
        if not cluster_target:
            pytest.skip("etcd is not installed: scripts/setup.sh installs it")
        model = make_model(d / "model", layers=LAYERS, hidden=HIDDEN, max_tokens=MAX)
        node = private_node(d / "node", *member, dram="64MiB", nvme="0")
        stack.callback(node.close)
        extra = {"target": node.target, "lookup_target": cluster_target, "advertise_url": URL, "deadline_s": 2.0}
        engine = EngineProcess(
            model,
            max_tokens=MAX,
            kv_bytes=64 << 20,  # 256 pages: not 128, the page size (a KV shape the connector could not read)
            connector={"role": "kv_producer", "extra": extra},
            log_path=d / "engine.log",
        )
        stack.callback(engine.close)
        endpoints, cluster = parse_target(cluster_target)
        view = stack.enter_context(Membership(endpoints, cluster))
        engine.wait_ready(timeout=600)
        yield {"engine": engine, "view": view, "model": model}


def test_a_vllm_engine_registers_and_leaves_with_its_process(fleet: dict[str, Any]) -> None:
    from kvstore.keys import Namespace

    engine, view, model = fleet["engine"], fleet["view"], fleet["model"]
    snap = view.wait_for(lambda s: ENGINE_ID in s.engines, 30)
    assert snap is not None, f"the engine never registered{engine.log_tail()}"
    rec = snap.engines[ENGINE_ID]
    assert (rec.url, rec.role, rec.models, rec.tp_size) == (URL, "prefill", (str(Path(model)),), 1)
    assert rec.block_size == engine.block_size and rec.chunk_tokens == -(-256 // engine.block_size) * engine.block_size
    assert rec.bytes_per_token == KV_PER_TOKEN and rec.kv_events == "" and rec.kv_events_replay == ""
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

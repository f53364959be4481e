"""kvstore as vLLM's KV connector, end to end: real vLLM engine processes on the CPU, a
real node, prefill (``kv_producer``) and decode (``kv_consumer``) in separate processes.

Greedy tokens and their logprobs must equal the prefill engine's own (it computed the
whole prompt: the recompute reference), whether the decode engine loaded the KV, found
corrupt KV (the connector's checksum check turns it into recompute), found nothing (a
different ``cache_salt``), or lost its node (recompute within the deadline, no hang).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import Any

import numpy as np
import pytest

from client import KVClient
from gpu_agent.vllm.demo import local_cluster
from gpu_agent.vllm.engine import EngineProcess, make_lora, make_model
from gpu_agent.vllm.settings import RETRY_S
from kvstore.children import private_node
from kvstore.keys import Namespace, chunk_keys

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

MAX = 2048
N = 1000  # prompt tokens: 3 chunks of 256 loadable (the last token is always computed)


def prompt(seed: int, n: int = N) -> list[int]:
    return np.random.default_rng(seed).integers(1, 31000, n).tolist()


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Any:
    d = tmp_path_factory.mktemp("vllm")
    model = make_model(d / "model", layers=2, hidden=256, max_tokens=MAX)
    # both nodes are members of one cluster (a real etcd): the remote decode engine looks chunks
    # up and pulls them through a cluster client, as `kvstore demo vllm` does
    stack = contextlib.ExitStack()
    cluster_target, member = local_cluster(stack, d)
    assert cluster_target, "etcd is not installed: scripts/setup.sh installs it"
    node = private_node(d / "node", *member, dram="256MiB", nvme="256MiB")
    other = private_node(d / "other", *member, dram="256MiB", nvme="256MiB")  # the remote engine's own node
    extra = {"target": node.target, "deadline_s": 2.0}
    remote_extra = {"target": other.target, "lookup_target": cluster_target, "deadline_s": 2.0}
    prefill = EngineProcess(
        model,
        max_tokens=MAX,
        kv_bytes=64 << 20,
        connector={"role": "kv_producer", "extra": extra},
        log_path=d / "prefill.log",
        lora=True,
    )
    decode = EngineProcess(
        model,
        max_tokens=MAX,
        kv_bytes=64 << 20,
        connector={"role": "kv_consumer", "extra": extra},
        log_path=d / "decode.log",
        lora=True,
    )
    remote = EngineProcess(
        model,
        max_tokens=MAX,
        kv_bytes=64 << 20,
        connector={"role": "kv_consumer", "extra": remote_extra},
        log_path=d / "remote.log",
    )
    for e in (prefill, decode, remote):
        e.wait_ready()
    client = KVClient(node.target)
    other_client = KVClient(other.target)
    lora = {"name": "adapter-a", "id": 1, "path": str(make_lora(d / "lora-a", model))}
    yield {
        "lora": lora,
        "node": node,
        "prefill": prefill,
        "decode": decode,
        "remote": remote,
        "client": client,
        "other": other_client,
        "dir": d,
    }
    client.close()
    other_client.close()
    for e in (prefill, decode, remote):
        e.close()
    node.close()
    other.close()
    stack.close()


def hits(client: KVClient) -> int:
    return int(client.stats()["counters"].get("match_prefix_hits", 0))


def stored_keys(r: dict[str, Any], tokens: list[int]) -> list[bytes]:
    info = r["kv_transfer_params"]["kvstore"]
    ns = Namespace.from_dict(info["namespace"])
    return chunk_keys(tokens[: (len(tokens) // ns.chunk_tokens) * ns.chunk_tokens], ns)


def wait_stored(client: KVClient, keys: list[bytes], timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while client.match_prefix(keys) < len(keys):
        assert time.monotonic() < end, "the prefill engine's save never landed"
        time.sleep(0.05)


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["tokens"] == b["tokens"] and np.allclose(a["logprobs"], b["logprobs"], atol=1e-4, rtol=0)


def test_decode_loads_prefill_kv_and_generates_the_same_tokens(setup: Any) -> None:
    toks = prompt(1)
    ref = setup["prefill"].generate(toks, max_tokens=8)
    keys = stored_keys(ref, toks)
    assert len(keys) == 3
    wait_stored(setup["client"], keys)
    before = hits(setup["client"])
    got = setup["decode"].generate(toks, max_tokens=8)
    assert hits(setup["client"]) - before == 3  # the decode engine found the 3 chunks (768 tokens)
    assert same(got, ref), (got, ref)


def test_a_decode_engine_on_another_node_pulls_the_kv_over_tcp(setup: Any) -> None:
    toks = prompt(6)
    ref = setup["prefill"].generate(toks, max_tokens=8)
    keys = stored_keys(ref, toks)
    wait_stored(setup["client"], keys)
    assert setup["other"].match_prefix(keys) == 0
    got = setup["remote"].generate(toks, max_tokens=8)
    assert same(got, ref), (got, ref)
    assert setup["other"].match_prefix(keys) == 3  # fetched from the producer's node, then loaded from its own
    assert (got["kv_transfer_params"] or {}).get("kvstore", {}).get("hit_chunks") == 3


def test_a_session_id_in_kv_transfer_params_reaches_the_store(setup: Any) -> None:
    toks = prompt(10)
    ref = setup["prefill"].generate(toks, max_tokens=4, session_id="chat-1")
    wait_stored(setup["client"], stored_keys(ref, toks))
    got = setup["decode"].generate(toks, max_tokens=4, session_id="chat-2")
    assert same(got, ref)
    assert setup["client"].close_session("chat-1")  # the producer's saves opened it
    assert setup["client"].close_session("chat-2")  # the consumer's lookup and load did
    assert not setup["client"].close_session("chat-3")


def test_a_different_cache_salt_never_hits(setup: Any) -> None:
    toks = prompt(2)
    ref = setup["prefill"].generate(toks, max_tokens=4, cache_salt="tenant-a")
    wait_stored(setup["client"], stored_keys(ref, toks))
    before = hits(setup["client"])
    got = setup["decode"].generate(toks, max_tokens=4, cache_salt="tenant-b")
    assert hits(setup["client"]) == before  # nothing under tenant-b's keys
    assert same(got, ref)
    got = setup["decode"].generate(toks, max_tokens=4, cache_salt="tenant-a")
    assert hits(setup["client"]) - before == 3 and same(got, ref)


def test_kv_of_a_lora_adapter_never_serves_the_base_model(setup: Any) -> None:
    toks = prompt(7)
    lora = setup["lora"]
    ref_lora = setup["prefill"].generate(toks, max_tokens=4, lora=lora)
    wait_stored(setup["client"], stored_keys(ref_lora, toks))
    assert ref_lora["kv_transfer_params"]["kvstore"]["namespace"]["lora_id"] == "adapter-a"
    before = hits(setup["client"])
    base = setup["decode"].generate(toks, max_tokens=4)  # no adapter: nothing under its keys
    assert hits(setup["client"]) == before
    assert base["tokens"] != ref_lora["tokens"]  # the adapter changes the output: sharing KV would show
    got = setup["decode"].generate(toks, max_tokens=4, lora=lora)
    assert hits(setup["client"]) - before == 3 and same(got, ref_lora)


def test_corrupt_kv_in_the_store_is_recomputed_never_loaded(setup: Any) -> None:
    toks = prompt(3)
    ref = setup["prefill"].generate(toks, max_tokens=8)
    keys = stored_keys(ref, toks)
    wait_stored(setup["client"], keys)
    client = setup["client"]
    arena = np.frombuffer(client.arena_buffer(), dtype=np.uint8)
    base = arena.ctypes.data
    rng = np.random.default_rng(0)
    with client.acquire(keys) as held:  # overwrite the stored bytes in place, under the same keys
        for views in held.views:
            for v in views:
                off = np.frombuffer(v, dtype=np.uint8).ctypes.data - base
                arena[off : off + v.nbytes] = rng.integers(0, 256, v.nbytes, dtype=np.uint8)
    got = setup["decode"].generate(toks, max_tokens=8)
    assert same(got, ref), "corrupt KV reached the engine"
    log = (setup["dir"] / "decode.log").read_text()
    assert "payload checksum mismatch" in log


def test_a_stopped_node_turns_into_recompute_within_the_deadline(setup: Any) -> None:
    toks = prompt(4)
    ref = setup["prefill"].generate(toks, max_tokens=4)
    wait_stored(setup["client"], stored_keys(ref, toks))
    node = setup["node"]
    os.kill(node.proc.pid, signal.SIGSTOP)  # a node that answers nothing
    try:
        t0 = time.monotonic()
        got = setup["decode"].generate(toks, max_tokens=4, timeout=120)
        assert time.monotonic() - t0 < 60
        assert same(got, ref)
    finally:
        os.kill(node.proc.pid, signal.SIGCONT)


def test_a_killed_node_turns_into_recompute_and_a_restarted_one_serves_again(setup: Any) -> None:
    toks = prompt(5)
    ref = setup["prefill"].generate(toks, max_tokens=4)
    wait_stored(setup["client"], stored_keys(ref, toks))
    node = setup["node"]
    node.proc.kill()
    node.proc.wait()
    t0 = time.monotonic()
    got = setup["decode"].generate(toks, max_tokens=4, timeout=120)
    assert time.monotonic() - t0 < 60
    assert same(got, ref)
    node.start()  # a new process and arena on the same socket: the engines re-attach
    toks = prompt(8)
    end = time.monotonic() + 60
    while True:
        ref = setup["prefill"].generate(toks, max_tokens=4)
        if (ref["kv_transfer_params"] or {}).get("kvstore", {}).get("saved"):
            break
        assert time.monotonic() < end, "the prefill engine never saved to the restarted node"
        toks = prompt(int(time.monotonic()))
    with KVClient(node.target) as client:
        wait_stored(client, stored_keys(ref, toks))
        time.sleep(RETRY_S + 1)  # the decode engine's lookups failed a moment ago: it tries again after RETRY_S
        before = hits(client)
        got = setup["decode"].generate(toks, max_tokens=4)
        assert hits(client) - before == 3 and same(got, ref)


def test_a_node_that_dies_in_the_middle_of_a_load_turns_into_recompute(setup: Any) -> None:
    """The scheduler finds the chunks; the node then dies answering the worker's Acquire
    (failure point ``node.acquire``): the engine recomputes, equal tokens, no hang."""
    toks = prompt(9)
    node = setup["node"]
    ref = setup["prefill"].generate(toks, max_tokens=4)
    with KVClient(node.target) as client:
        wait_stored(client, stored_keys(ref, toks))
    node.stop()  # graceful: the chunks come back from NVMe
    node.env["KVSTORE_FAILPOINTS"] = "node.acquire=kill"
    node.start()
    t0 = time.monotonic()
    got = setup["decode"].generate(toks, max_tokens=4, timeout=120)
    assert time.monotonic() - t0 < 60
    assert node.proc.wait(timeout=30) == -signal.SIGKILL  # it died at the Acquire of this load
    assert same(got, ref)

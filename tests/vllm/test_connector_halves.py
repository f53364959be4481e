"""The connector's two halves against a real node, with vLLM's own ``Request`` objects and no
engine: what the scheduler promises and loads, what a worker reports finished.

The end-to-end tests (``test_connector_e2e.py``) prove the tokens; these pin the rules
each defect broke, fast: the load range after a local prefix-cache hit, every rank's shard
before a chunk counts, the handoff wait, requests that cannot be keyed, a save that cannot
start, and the counters vLLM exports.
"""

from __future__ import annotations

import sys
import threading
import time
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.vllm

CHUNK = 256


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from kvstore.children import private_node

    with private_node(tmp_path_factory.mktemp("halves") / "node", "--metrics-port", "0", dram="64MiB", nvme="0") as n:
        yield n


def spec(tp: int = 1) -> Any:
    from gpu_agent.vllm.spec import EngineSpec

    return EngineSpec("m", "main", "float32", 2, 2, 64, 16, "kvstore-vllm/2:cpu:test:cache_dtype=auto", tp_size=tp)


def scheduler(node: Any, *, tp: int = 1, **extra: Any) -> Any:
    from gpu_agent.vllm.scheduler import SchedulerSide
    from gpu_agent.vllm.settings import ConnectorSettings

    # lookups="rpc": these tests pin what the store's answers make of a request (the view's
    # answers, the default, have tests of their own: test_connector_view.py); the scheduler
    # waits for each lookup's answer here (up to deadline_s): "not yet" while a lookup runs
    # has tests of its own
    extra = {"lookups": "rpc", "lookup_wait_ms": 2000.0, "save_policy": "always", **extra}
    settings = ConnectorSettings.from_extra({"target": node.target, "salt": str(time.monotonic_ns()), **extra})
    return SchedulerSide(spec(tp), settings, CHUNK, produce=True, consume=True)


def request(tokens: list[int], rid: str = "r", params: dict[str, Any] | None = None, **kw: Any) -> Any:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    sp = SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": params} if params else None)
    return Request(rid, tokens, sp, None, **kw)


def prompt(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(1, 31000, n).tolist()


def store(node: Any, side: Any, req: Any, chunks: int, *, ranks: list[tuple[int, int]] | None = None) -> None:
    """Put the first ``chunks`` chunks of ``req``'s tokens under each rank's keys."""
    from client import KVClient
    from gpu_agent.vllm.spec import rank_namespace, request_namespace
    from kvstore.keys import chunk_keys

    ns = request_namespace(side.spec, side.settings, CHUNK, req)
    with KVClient(node.target) as c:
        for t, p in ranks or [(0, 0)]:
            rns = rank_namespace(ns, t, p)
            keys = chunk_keys(list(req.all_token_ids), rns)[:chunks]
            assert all(c.put_many(keys, [b"x" * 64] * len(keys), namespace=rns))


class Blocks:
    """What ``update_state_after_alloc`` is handed: the request's block ids (one group)."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids,)


def test_after_a_partial_local_hit_the_load_starts_where_vllms_own_cache_ends(node: Any) -> None:
    side = scheduler(node)
    req = request(prompt(1000))
    store(node, side, req, 3)
    # vLLM's prefix cache holds 512 tokens; it has not set num_computed_tokens yet
    hit, is_async = side.get_num_new_matched_tokens(req, 512)
    assert (hit, is_async) == (768 - 512, False)
    assert req.num_computed_tokens == 0
    side.update_state_after_alloc(req, Blocks(list(range(100, 163))), hit)
    load = side._loads[req.request_id]
    assert (load.first_token, load.num_tokens) == (512, 768)
    assert len(load.tokens) == 768 and load.tokens == list(req.all_token_ids[:768])


def test_a_chunk_counts_only_when_every_tensor_parallel_rank_holds_its_shard(node: Any) -> None:
    side = scheduler(node, tp=2)
    req = request(prompt(1000, seed=1))
    store(node, side, req, 3, ranks=[(0, 0)])
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)  # rank 1's shards are missing
    store(node, side, req, 2, ranks=[(1, 0)])
    again = request(prompt(1000, seed=1), rid="again")  # a new request: `req`'s answer is kept for it
    assert side.get_num_new_matched_tokens(again, 0) == (512, False)  # both ranks hold two chunks


def test_a_whole_stored_prompt_loads_all_but_its_last_token(node: Any) -> None:
    from client import KVClient
    from gpu_agent.vllm.spec import request_namespace
    from kvstore.keys import tail_key

    side = scheduler(node)
    req = request(prompt(1000, seed=2))
    store(node, side, req, 3)
    assert side.get_num_new_matched_tokens(req, 0) == (768, False)  # the trailing 232 tokens are not stored yet
    ns = request_namespace(side.spec, side.settings, CHUNK, req)
    tail = tail_key(list(req.all_token_ids), ns)
    assert tail is not None
    with KVClient(node.target) as c:
        assert c.put(tail, b"x" * 64, namespace=ns)
    assert side.get_num_new_matched_tokens(request(prompt(1000, seed=2), rid="again"), 0) == (999, False)
    exact = request(prompt(1024, seed=3), rid="exact")  # ends on a chunk boundary: no tail
    store(node, side, exact, 4)
    assert side.get_num_new_matched_tokens(exact, 0) == (1023, False)


def test_a_decode_engine_waits_for_exactly_the_chunks_its_prefill_engine_saved(node: Any) -> None:
    side = scheduler(node, deadline_s=5.0)
    toks = prompt(1000, seed=4)
    probe = request(toks)
    from gpu_agent.vllm.spec import request_namespace

    ns = request_namespace(side.spec, side.settings, CHUNK, probe)
    params = {"kvstore": {"namespace": ns.to_dict(), "saved_chunks": 3, "saved_tokens": 768}}
    req = request(toks, params=params)
    store(node, side, req, 1)
    assert side.get_num_new_matched_tokens(req, 0) == (None, False)  # one of three committed: ask again next step
    store(node, side, req, 3)
    time.sleep(0.02)
    assert side.get_num_new_matched_tokens(req, 0) == (768, False)
    assert side.counters["handoff_waits"] >= 1 and side.counters["handoff_timeouts"] == 0


def gated(node: Any, *, recompute_us: float, load_us: float, **extra: Any) -> Any:
    """A scheduler whose gate measured recompute and loads from its node (µs a token)."""
    side = scheduler(node, deadline_s=5.0, **extra)
    for _ in range(3):
        side.gate.observe(
            {
                "prefill_step_us": recompute_us * 1000,
                "prefill_step_tokens": 1000,
                "load_local_us": load_us * 1000,
                "load_local_tokens": 1000,
            }
        )
    return side


def test_the_load_gate_stops_a_slow_hit_but_never_a_producers_handoff(node: Any) -> None:
    """Loads measured slower than recompute: a plain request recomputes (the tokens are
    counted as gated), a decode request handed off by its prefill engine still loads them."""
    from gpu_agent.vllm.spec import request_namespace

    side = gated(node, recompute_us=1, load_us=100)
    toks = prompt(1000, seed=40)
    plain = request(toks, rid="plain")
    store(node, side, plain, 3)
    assert side.get_num_new_matched_tokens(plain, 0) == (0, False)
    assert side.counters["gated_tokens"] == 768
    ns = request_namespace(side.spec, side.settings, CHUNK, plain)
    params = {"kvstore": {"namespace": ns.to_dict(), "saved_chunks": 3, "saved_tokens": 768}}
    handed = request(toks, rid="handed", params=params)
    assert side.get_num_new_matched_tokens(handed, 0) == (768, False)
    assert side.counters["gated_tokens"] == 768


def test_a_background_load_that_only_its_own_request_waits_for_pays_at_a_busy_engines_batch(node: Any) -> None:
    """Loads (here all in the background: ``async_loads="always"``) measured 3 times slower
    than recompute: an idle engine's request recomputes; once a step ran 5 requests, the
    same hit loads, since its recompute would lengthen the step all six wait for while the
    background load holds up its own request only."""
    side = gated(node, recompute_us=10, load_us=30, async_loads="always")
    toks = prompt(1000, seed=41)
    idle = request(toks, rid="idle")
    store(node, side, idle, 3)
    assert side.get_num_new_matched_tokens(idle, 0) == (0, False) and side.counters["gated_tokens"] == 768
    empty = types.SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[])
    step = types.SimpleNamespace(
        preempted_req_ids=set(),
        total_num_scheduled_tokens=5,
        scheduled_new_reqs=[],
        scheduled_cached_reqs=empty,
        num_scheduled_tokens={f"running-{i}": 1 for i in range(5)},
    )
    side.build_connector_meta(step)
    busy = request(toks, rid="busy")
    assert side.get_num_new_matched_tokens(busy, 0) == (768, True)  # loaded, in the background
    assert side.counters["gated_tokens"] == 768
    side.shutdown()


def test_the_handoff_wait_ends_at_the_deadline_and_bad_params_never_wait(node: Any) -> None:
    side = scheduler(node, deadline_s=0.3)
    toks = prompt(1000, seed=5)
    from gpu_agent.vllm.spec import request_namespace

    ns = request_namespace(side.spec, side.settings, CHUNK, request(toks))
    req = request(toks, params={"kvstore": {"namespace": ns.to_dict(), "saved_chunks": 3}})
    store(node, side, req, 1)
    t0 = time.monotonic()
    while (got := side.get_num_new_matched_tokens(req, 0))[0] is None:
        assert time.monotonic() - t0 < 5, "the wait outlived its deadline"
        time.sleep(0.01)
    assert got == (256, False) and time.monotonic() - t0 >= 0.3
    assert side.counters["handoff_timeouts"] == 1
    for bad in ({"kvstore": "x"}, {"kvstore": {"namespace": {"nope": 1}, "saved_chunks": 3}}, {"kvstore": {}}):
        r = request(toks, rid=f"bad-{len(str(bad))}", params=bad)
        assert side.get_num_new_matched_tokens(r, 0) == (256, False)
    other = dict(ns.to_dict(), model_id="another-model")
    r = request(toks, rid="other", params={"kvstore": {"namespace": other, "saved_chunks": 3}})
    assert side.get_num_new_matched_tokens(r, 0) == (256, False)  # another model's chunks are never ours to wait for


def test_requests_the_tokens_do_not_describe_are_neither_loaded_nor_saved(node: Any) -> None:
    import torch

    side = scheduler(node)
    toks = prompt(600, seed=6)
    req = request(toks, rid="embeds", prompt_embeds=torch.zeros(600, 8))
    store(node, side, request(toks), 2)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    assert side.counters["unkeyable_requests"] == 1


def test_a_save_that_cannot_start_still_reports_its_request_finished() -> None:
    from gpu_agent.vllm.metadata import KVStoreMeta, SaveSpec
    from gpu_agent.vllm.settings import ConnectorSettings
    from gpu_agent.vllm.worker import WorkerSide

    w = WorkerSide(None, None, ConnectorSettings(target="unix:///nonexistent/kvstore.sock", deadline_s=0.5), CHUNK)  # type: ignore[arg-type]
    w._make_agent = lambda client: (_ for _ in ()).throw(OSError("no node"))
    ns = spec().namespace(CHUNK)
    meta = KVStoreMeta(saves=[SaveSpec("held", prompt(512), list(range(32)), 0, ns)])
    w.wait_for_save(meta)  # the node is down: nothing saved
    assert w.get_finished(set()) == (None, None)  # vLLM has not finished it yet
    assert w.get_finished({"held"}) == ({"held"}, None)  # reported, so vLLM frees its blocks
    assert w.get_finished(set()) == (None, None)  # once


def test_a_background_load_that_cannot_start_is_reported_finished_with_its_blocks_failed() -> None:
    """An ``async_load`` the node cannot serve still ends: ``get_finished`` reports it received
    (vLLM would otherwise wait for it forever) and every block it promised failed, in the
    same step, so vLLM recomputes them."""
    from gpu_agent.vllm.metadata import KVStoreMeta, LoadSpec
    from gpu_agent.vllm.settings import ConnectorSettings
    from gpu_agent.vllm.worker import WorkerSide

    w = WorkerSide(None, None, ConnectorSettings(target="unix:///nonexistent/kvstore.sock", deadline_s=0.5), CHUNK)  # type: ignore[arg-type]
    w.spec = spec()
    w._make_agent = lambda client: (_ for _ in ()).throw(OSError("no node"))
    ns = spec().namespace(CHUNK)
    w.start_load_kv(KVStoreMeta(loads=[LoadSpec("waiting", prompt(512), list(range(40)), 0, 511, ns, async_load=True)]))
    assert w.get_finished(set()) == (None, {"waiting"})
    assert w.get_block_ids_with_load_errors() == set(range(32))  # tokens [0, 511): 32 pages of 16
    assert w.get_finished(set()) == (None, None)  # once


def test_an_engine_idle_while_its_node_restarted_attaches_again_at_its_next_step(tmp_path: Any) -> None:
    """A store call failed while the node was down (a background save, say) and the engine
    then idled: its next step drops that agent and attaches afresh at once when ``retry_s``
    has passed since the failure, rather than serving without the store for ``retry_s`` more
    (CI found a decode engine recomputing a handoff the restarted node held)."""
    import torch

    from gpu_agent.agent import GPUAgent
    from gpu_agent.vllm.settings import ConnectorSettings
    from gpu_agent.vllm.worker import WorkerSide
    from kvstore.children import private_node

    with private_node(tmp_path / "node", dram="64MiB", nvme="0") as n:
        settings = ConnectorSettings(target=n.target, deadline_s=0.5, retry_s=1.0)
        w = WorkerSide(None, None, settings, CHUNK)  # type: ignore[arg-type]
        layout, ns = spec().layout(), spec().namespace(CHUNK)
        w._make_agent = lambda client: GPUAgent(client, layout, ns, device=torch.device("cpu"))
        assert w._connect()
        first = w.agent
        n.proc.kill()
        n.proc.wait()
        assert first.lookup(prompt(512), namespace=ns) == 0  # fails open: a miss, counted as a store error
        failed_at = first.last_store_error_at
        assert first.stats()["counters"]["store_errors"] == 1 and failed_at <= time.monotonic()
        n.start()
        time.sleep(max(0.0, failed_at + settings.retry_s - time.monotonic()) + 0.1)
        w._check_agent()  # the engine's first step since: the failed agent goes...
        assert w.agent is None
        assert w._connect() and w.agent is not None and w.agent is not first  # ...and a new one is attached now
        assert (
            w.agent.lookup(prompt(512), namespace=ns) == 0 and w.agent.stats()["counters"].get("store_errors", 0) == 0
        )
        w.shutdown()


def test_async_loads_auto_sends_nvme_hits_to_the_background_and_keeps_dram_hits_in_the_step(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    from client import KVClient
    from gpu_agent.vllm.spec import request_namespace
    from kvstore.children import private_node
    from kvstore.keys import chunk_keys

    with private_node(tmp_path_factory.mktemp("async") / "node", dram="64MiB", nvme="256MiB") as n:
        toks = prompt(800, seed=8)
        side = scheduler(n)
        req = request(toks, rid="dram")
        store(n, side, req, 3)
        assert side.get_num_new_matched_tokens(req, 0) == (768, False)  # DRAM: loaded in the step that computes it
        keys = chunk_keys(toks, request_namespace(side.spec, side.settings, CHUNK, req))[:3]
        with KVClient(n.target) as c:
            filler = [bytes([i]) * 16 for i in range(1, 20)]
            c.put_many(filler, [b"f" * (4 << 20)] * len(filler))  # 76 MiB through 64 MiB of DRAM
            assert "nvme" in c.lookup(keys)
        assert side.get_num_new_matched_tokens(request(toks, rid="nvme"), 0) == (768, True)
        assert side.counters["async_loads"] == 1
        never = scheduler(n, async_loads="never", salt=side.settings.salt)
        assert never.get_num_new_matched_tokens(request(toks, rid="never"), 0) == (768, False)
        always = scheduler(n, async_loads="always", salt=side.settings.salt)
        assert always.get_num_new_matched_tokens(request(toks, rid="always"), 0) == (768, True)
        side.shutdown()
        never.shutdown()
        always.shutdown()


def test_counters_reach_vllms_stats_and_prometheus() -> None:
    import prometheus_client
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

    from gpu_agent.vllm.connector import KVStoreConnector
    from gpu_agent.vllm.stats import STAT_KEYS, KVStoreStats

    a = KVStoreConnector.build_kv_connector_stats({"loads": 2, "load_tokens": 512, "hit_tokens": 512, "lookups": 3})
    b = KVStoreStats({"local_hit_tokens": 256, "lookups": 1, "lookup_us": 4000})
    assert isinstance(a, KVStoreStats) and set(a.data) == set(STAT_KEYS)
    total = a.aggregate(b).reduce()
    assert total["hit tokens"] == 512 and total["local hit tokens"] == 256 and total["avg lookup ms"] == 1.0
    registry = prometheus_client.CollectorRegistry()

    class Counter(prometheus_client.Counter):
        def __init__(self, *args: Any, **kw: Any) -> None:
            super().__init__(*args, registry=registry, **kw)

    prom = KVStoreConnector.build_prom_metrics(
        types.SimpleNamespace(kv_transfer_config=None),  # type: ignore[arg-type]  # all vLLM's base reads of it
        {
            prometheus_client.Gauge: prometheus_client.Gauge,
            prometheus_client.Counter: Counter,
            prometheus_client.Histogram: prometheus_client.Histogram,
        },
        ["engine"],
        {0: ["0"]},
    )
    assert isinstance(prom, KVConnectorPromMetrics)
    prom.observe(a.data, 0)
    assert registry.get_sample_value("vllm:kvstore_hit_tokens_total", {"engine": "0"}) == 512
    assert registry.get_sample_value("vllm:kvstore_local_hit_tokens_total", {"engine": "0"}) == 256


def test_the_nodes_own_evictions_and_demotions_reach_kv_events(tmp_path: Any) -> None:
    """Chunks reported stored are checked against the store: a demotion to NVMe (the node
    restarted: DRAM is written back) is a move from CPU to STORAGE; a chunk any rank lost
    is removed."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    from client import KVClient
    from gpu_agent.vllm.events import StoredChunks, stored_event
    from kvstore.children import private_node
    from kvstore.keys import chunk_keys

    toks = prompt(3 * CHUNK, seed=8)
    ns0 = spec(tp=2).namespace(CHUNK)
    from gpu_agent.vllm.spec import rank_namespace

    chains = [chunk_keys(toks, rank_namespace(ns0, t, 0)) for t in (0, 1)]
    with private_node(tmp_path / "node", dram="64MiB", nvme="64MiB") as node:
        with KVClient(node.target) as c:
            for t, chain in enumerate(chains):
                assert all(c.put_many(chain, [b"x" * 64] * 3, namespace=rank_namespace(ns0, t, 0)))
        tracked = StoredChunks(resync_s=0.01)
        tracked.saving(chains, 0, 3)
        ev = stored_event(chains[0], 0, toks, CHUNK, "")
        assert ev is not None and ev.parent_block_hash is None
        tracked.stored(ev)
        assert len(tracked) == 3
        with KVClient(node.target) as c:
            assert tracked.resync(c.lookup, 0.0) == []  # nothing changed
        node.stop()  # graceful: DRAM blocks are demoted to NVMe
        node.start()
        with KVClient(node.target) as c:
            moved = tracked.resync(c.lookup, 1.0)
            assert [type(e) for e in moved] == [BlockRemoved, BlockStored] * 3
            assert all(e.medium == ("CPU" if isinstance(e, BlockRemoved) else "STORAGE") for e in moved)
            assert [e.parent_block_hash for e in moved if isinstance(e, BlockStored)] == [None, *chains[0][:2]]
            c.delete([chains[1][2]])  # rank 1's shard of the last chunk is gone: the chunk is unusable
            gone = tracked.resync(c.lookup, 2.0)
        assert gone == [BlockRemoved(block_hashes=[chains[0][2]], medium="STORAGE")]
        assert len(tracked) == 2


def test_a_local_prefix_cache_hit_never_stops_the_next_requests_lookups(tmp_path: Any) -> None:
    """With cluster-wide lookups (``lookup_target`` etcd://), reporting vLLM's own
    prefix-cache hits went to the cluster client, which has no node to count them; the
    failure took the store away from every request for RETRY_S (found by ``kvstore bench
    serving``: decode engines recomputed 40-60 % of prompts the store held).  The hits now
    go to the engine's own node and a reporting failure never stops lookups."""
    import contextlib

    from kvstore.children import private_node
    from kvstore.demo.vllm import local_cluster

    with contextlib.ExitStack() as stack:
        cluster, member = local_cluster(stack, tmp_path)
        assert cluster, "etcd is not installed: scripts/setup.sh installs it"
        n = stack.enter_context(private_node(tmp_path / "n", *member, dram="64MiB", nvme="0"))
        side = scheduler(n, lookup_target=cluster)
        first = request(prompt(1000, seed=7), "first")
        store(n, side, first, 3)
        hit, _ = side.get_num_new_matched_tokens(first, CHUNK)  # vLLM's own cache holds the first chunk
        assert hit == 3 * CHUNK - CHUNK
        side.update_state_after_alloc(first, Blocks(list(range(63))), hit)  # reports the local hit
        second = request(prompt(1000, seed=8), "second")
        store(n, side, second, 2)
        assert side.get_num_new_matched_tokens(second, 0) == (2 * CHUNK, False)
        assert side.counters["lookups"] == 2 and side.counters["lookup_errors"] == 0
        side.link.flush()
        assert side.link.reporting  # reported to the node, no failure
        side.shutdown()


def test_a_lookup_runs_off_the_scheduler_thread_and_vllm_hears_not_yet_until_it_answers(node: Any) -> None:
    """With no wait allowed (``lookup_wait_ms`` and ``lookup_idle_wait_ms`` 0) the first ask of a request is "not yet"
    (vLLM's ``None``) while its lookup runs on the store link's thread; a later ask takes
    the answer, and asks after that reuse it: one lookup per request, however often vLLM
    asks while the request waits."""
    side = scheduler(node, lookup_wait_ms=0.0, lookup_idle_wait_ms=0.0)
    req = request(prompt(1000, seed=11), rid="patient", params={"session_id": "conv-patient"})  # hinted: waited for
    store(node, side, req, 2)
    assert side.get_num_new_matched_tokens(req, 0) == (None, False)
    t0 = time.monotonic()
    while (got := side.get_num_new_matched_tokens(req, 0))[0] is None:
        assert time.monotonic() - t0 < 5, "the lookup was never answered"
        time.sleep(0.005)
    assert got == (512, False)
    assert side.get_num_new_matched_tokens(req, 0) == (512, False)
    assert side.counters["lookups"] == 1 and side.counters["lookups_cached"] >= 1
    assert side.counters["lookup_pending"] >= 1
    side.shutdown()


def _busy(side: Any, step_s: float = 0.02) -> None:
    """Make the scheduler's engine look busy: passes that scheduled tokens, ``step_s`` apart,
    the last just now; and prefill measured at 1 ms per token."""
    for _ in range(3):
        side.gate.observe({"prefill_step_us": 1_000_000, "prefill_step_tokens": 1000})
    for _ in range(4):
        side.budget.step(time.monotonic(), 500)
        time.sleep(step_s)
    side.budget.step(time.monotonic(), 500)


def _answered(side: Any, req: Any) -> Any:
    """Ask as vLLM does until the answer is not "not yet" (the engine kept busy)."""
    t0 = time.monotonic()
    while True:
        _busy(side, 0.002)
        got = side.get_num_new_matched_tokens(req, 0)
        if got[0] is not None:
            return got
        assert time.monotonic() - t0 < 5, "the lookup was never answered"


def _probe_round(side: Any, node: Any, seed: int, *, stored: int = 0) -> Any:
    """``probe_every`` never-seen, unhinted requests arrive while the link's thread is held:
    each is answered 0 at once (a busy engine, a class that never hits); one of them, the
    probe, is looked up (pending, given up), the others are not looked up at all.  Returns
    the probe's pending lookup, its request allocated (its answer taken as it lands)."""
    n = side.odds.probe_every
    reqs = [request(prompt(700, seed=seed + i), rid=f"p{seed + i}") for i in range(n)]
    for req in reqs:
        if stored:
            store(node, side, req, stored)
    lookups, skipped, given_up = (side.counters[k] for k in ("lookups", "lookups_skipped", "lookup_given_up"))
    held = threading.Event()
    side.link._pool.submit(held.wait, 10)  # the link's thread is busy: a lookup stays pending
    for req in reqs:
        side.on_new_request(req)
        _busy(side, 0.002)
        assert side.get_num_new_matched_tokens(req, 0) == (0, False)  # not "not yet": computed now
        assert side.get_num_new_matched_tokens(req, 0) == (0, False)  # and asked once, however often vLLM asks
    assert side.counters["lookups"] == lookups + 1 and side.counters["lookups_skipped"] == skipped + n - 1
    assert side.counters["lookup_given_up"] == given_up + 1
    (probe,) = [req for req in reqs if side._reqs[req.request_id].pending is not None]
    pending = side._reqs[probe.request_id].pending
    for req in reqs:
        side.update_state_after_alloc(req, Blocks(list(range(44))), 0)
    held.set()
    pending.result(timeout=10)
    return pending


def test_a_busy_engine_computes_a_request_whose_class_never_hits_rather_than_wait_a_step(node: Any) -> None:
    """``lookup_odds``: once the lookups of never-seen, unhinted prompts have missed often
    enough, a busy engine answers such a request's ask 0 at once (computed now, not a step
    later) and does not look it up at all, but for one probe in ``probe_every``, whose
    lookup still lands and counts.  A hinted request is still waited for, and when the
    probes start hitting the scheduler looks prompts of the class up and waits again."""
    side = scheduler(node, lookup_wait_ms=0.0, lookup_idle_wait_ms=0.0, save_policy="auto")
    for i in range(side.odds.min_samples):  # not measured yet: asked, waited for within the pass only
        miss = request(prompt(700, seed=100 + i), rid=f"miss{i}")
        side.on_new_request(miss)
        pending = side._reqs[miss.request_id].pending
        assert pending is not None and side.get_num_new_matched_tokens(miss, 0) == (0, False)
        side.update_state_after_alloc(miss, Blocks(list(range(44))), 0)
        pending.result(timeout=10)
        side._take_given_up()
    assert side.odds.expected_tokens("new") == 0.0 and side.counters["lookup_pending"] == 0
    assert side.counters["lookups"] == side.odds.min_samples
    assert side.odds.lookup_s > 0 and side.odds.lookup_cpu_s > 0  # latency, and the price of asking: CPU
    samples = side.odds._classes["new"].samples
    _probe_round(side, node, 200)
    side._take_given_up()
    assert side.odds._classes["new"].samples == samples + 1  # the probe's miss counted when it landed
    session = request(prompt(700, seed=301), rid="turn", params={"session_id": "conv-odds"})
    store(node, side, session, 2)
    assert _answered(side, session) == (2 * CHUNK, False)  # hinted: looked up and waited for
    _probe_round(side, node, 400, stored=2)  # the class still looks hopeless, but its probe finds 2 chunks
    side._take_given_up()  # the probe's hit counts when it lands
    assert side.odds.worth_waiting("new", 1e-3, 0.02)  # hits came back: waited for again
    late = request(prompt(700, seed=500), rid="late")
    store(node, side, late, 2)
    side.on_new_request(late)
    assert _answered(side, late) == (2 * CHUNK, False)
    side.shutdown()


def test_a_preempted_request_saves_again_what_its_cancelled_saves_held(node: Any) -> None:
    """vLLM preempts a request whose saves were issued (the worker cancels those still
    copying): the scheduler's saved count goes back to 0, so the chunks are saved again as
    the request is recomputed and its handoff never claims a chunk that was not committed."""
    side = scheduler(node)
    req = request(prompt(3 * CHUNK + 10, seed=61), rid="pre")
    side.on_new_request(req)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    side.update_state_after_alloc(req, Blocks([]), 0)
    r = side._reqs["pre"]
    r.saved_chunks, r.tail_saved = 3, True  # its saves were issued
    empty = types.SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[])
    out = types.SimpleNamespace(
        preempted_req_ids={"pre"},
        total_num_scheduled_tokens=0,
        scheduled_new_reqs=[],
        scheduled_cached_reqs=empty,
        num_scheduled_tokens={},
    )
    meta = side.build_connector_meta(out)
    assert meta.preempted == {"pre"} and r.saved_chunks == 0 and not r.tail_saved
    side.shutdown()


def test_a_queued_requests_miss_is_kept_and_its_hit_asked_again(node: Any) -> None:
    """A request that waited in vLLM's queue past ``ANSWER_TTL_S`` is answered at once from
    its arrival's miss (a second lookup would cost it a step and miss again); a hit that old
    is looked up again (its chunks may be gone)."""
    from gpu_agent.vllm import scheduler as sched

    side = scheduler(node)
    miss = request(prompt(1000, seed=17), rid="queued-miss")
    side.on_new_request(miss)
    side._reqs["queued-miss"].pending.result(timeout=10)
    assert side.get_num_new_matched_tokens(miss, 0) == (0, False)
    side._reqs["queued-miss"].answer_at -= 2 * sched.ANSWER_TTL_S  # it waited in the queue
    assert side.get_num_new_matched_tokens(miss, 0) == (0, False)
    assert side.counters["lookups"] == 1
    hit = request(prompt(1000, seed=18), rid="queued-hit")
    store(node, side, hit, 2)
    assert side.get_num_new_matched_tokens(hit, 0) == (512, False)
    side._reqs["queued-hit"].answer_at -= 2 * sched.ANSWER_TTL_S
    assert side.get_num_new_matched_tokens(hit, 0) == (512, False)
    assert side.counters["lookups"] == 3
    side.shutdown()


def test_a_lookup_started_at_arrival_answers_the_ask_after_vllms_own_cache_hit(node: Any) -> None:
    """``on_new_request`` starts the lookup from chunk 0; vLLM then asks from where its own
    prefix cache ends (chunk 1 here) and the arrival's answer covers it: no second lookup."""
    side = scheduler(node)
    req = request(prompt(1000, seed=12), rid="early")
    store(node, side, req, 3)
    side.on_new_request(req)
    assert side.get_num_new_matched_tokens(req, CHUNK) == (2 * CHUNK, False)
    assert side.counters["lookups"] == 1
    side.shutdown()


def test_a_lookup_that_never_answers_is_a_miss_after_the_deadline() -> None:
    """A store that accepts the connection and never answers (a hung node): the request
    hears "not yet" until ``deadline_s``, then recomputes; the scheduler never blocks.  A
    never-seen, unhinted prompt is not held for it at all (``lookup_odds``: the pass's budget)."""
    import socket
    import tempfile

    from gpu_agent.vllm.scheduler import SchedulerSide
    from gpu_agent.vllm.settings import ConnectorSettings

    with tempfile.TemporaryDirectory() as d, socket.socket(socket.AF_UNIX) as hung:
        path = f"{d}/hung.sock"
        hung.bind(path)
        hung.listen(8)  # accepted by the kernel, never served
        settings = ConnectorSettings.from_extra(
            {"target": f"unix://{path}", "deadline_s": 0.5, "lookup_wait_ms": 1.0, "lookups": "rpc"}
        )
        side = SchedulerSide(spec(), settings, CHUNK, produce=True, consume=True)
        new = request(prompt(600, seed=12), rid="new")
        assert side.get_num_new_matched_tokens(new, 0) == (0, False) and side.counters["lookup_given_up"] == 1
        req = request(prompt(600, seed=13), rid="hung", params={"session_id": "conv-hung"})  # hinted: waited for
        t0 = time.monotonic()
        asks = 0
        while (got := side.get_num_new_matched_tokens(req, 0))[0] is None:
            asks += 1
            assert time.monotonic() - t0 < 5, "the ask outlived the deadline"
            time.sleep(0.01)
        assert got == (0, False) and asks >= 1
        assert side.counters["lookup_timeouts"] + side.counters["lookup_errors"] >= 1
        side.shutdown()


def _saves_after_prefill(side: Any, req: Any) -> list[Any]:
    """What the scheduler saves once ``req``'s prompt ran (its block table room for two more chunks)."""
    from gpu_agent.vllm.metadata import KVStoreMeta

    r = side._reqs[req.request_id]
    r.block_ids = list(range(-(-(req.num_tokens + 2 * CHUNK) // 16)))
    meta = KVStoreMeta()
    side._maybe_save(meta, req.request_id, r, req.num_tokens)
    return meta.saves


def test_auto_stores_a_prefix_from_its_second_sighting_and_a_sessions_turn_whole(node: Any) -> None:
    """``save_policy`` auto: a prompt seen once is not stored (nobody may read it again); its
    second request stores it (the third loads it); a request of a session (its next turn
    extends it) stores its prompt and its decode chunks at once.  ``always`` stores all."""
    side = scheduler(node, save_policy="auto")
    toks = prompt(3 * CHUNK + 40, seed=14)
    first = request(toks, rid="one")
    assert side.get_num_new_matched_tokens(first, 0) == (0, False)
    assert _saves_after_prefill(side, first) == []
    from kvstore.dashboard.scrape import fetch

    before = fetch(node.endpoints["metrics"]).counters.get("skipped_saves", 0)
    side.request_finished(first)
    assert side.counters["skipped_save_chunks"] == 3
    side.link.flush()  # the node counts them too (its metrics, the dashboard)
    assert fetch(node.endpoints["metrics"]).counters.get("skipped_saves", 0) == before + 3
    second = request(toks, rid="two")
    assert side.get_num_new_matched_tokens(second, 0) == (0, False)
    saves = _saves_after_prefill(side, second)
    assert [(s.skip_chunks, len(s.tokens), s.tail) for s in saves] == [
        (0, len(toks), True)
    ]  # an exact repeat: tail too
    session = request(prompt(2 * CHUNK + 10, seed=15), rid="turn1", params={"session_id": "conv"})
    assert side.get_num_new_matched_tokens(session, 0) == (0, False)
    prefill = _saves_after_prefill(side, session)
    assert [len(s.tokens) for s in prefill] == [2 * CHUNK]  # the prompt's full chunks, not its tail
    r = side._reqs["turn1"]
    from gpu_agent.vllm.metadata import KVStoreMeta

    for t in range(CHUNK):
        session.append_output_token_ids(7 + t)
    meta = KVStoreMeta()
    side._maybe_save(meta, "turn1", r, session.num_tokens)  # decoding filled a third chunk
    assert [(s.skip_chunks, len(s.tokens)) for s in meta.saves] == [(2, 3 * CHUNK)]
    always = scheduler(node, save_policy="always", salt=side.settings.salt + "-always")
    once = request(prompt(2 * CHUNK + 5, seed=16), rid="once")
    assert always.get_num_new_matched_tokens(once, 0) == (0, False)
    assert [s.tail for s in _saves_after_prefill(always, once)] == [True]
    side.shutdown()
    always.shutdown()


def test_the_default_policy_stores_a_first_seen_prompt_and_stops_where_nothing_is_read_back(
    node: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``save_policy`` evidence (the default): with no evidence yet a prompt seen once is
    stored whole (the next engine that serves it hits); once the engine's own node reports
    that what this namespace stored is never read back, a new prompt is not stored, at
    the measured recompute and save costs, and a session id does not change that."""
    from client import KVClient
    from gpu_agent.vllm import scheduler as scheduler_module
    from gpu_agent.vllm.settings import ConnectorSettings
    from gpu_agent.vllm.spec import rank_namespace, request_namespace
    from gpu_agent.vllm.stats import KVStoreStats
    from kvstore.keys import chunk_keys, parent_keys

    monkeypatch.setattr(scheduler_module, "READ_BACK_EVERY_S", 0.0)  # poll at every request, not every second
    default = ConnectorSettings().save_policy
    assert default == "evidence"
    side = scheduler(node, save_policy=default)
    toks = prompt(3 * CHUNK + 40, seed=21)
    first = request(toks, rid="first")
    assert side.get_num_new_matched_tokens(first, 0) == (0, False)
    assert [(s.skip_chunks, len(s.tokens), s.tail) for s in _saves_after_prefill(side, first)] == [(0, len(toks), True)]
    side.request_finished(first)
    rns = rank_namespace(request_namespace(side.spec, side.settings, CHUNK, first), 0, 0)  # what the node counts
    assert side._read_back is not None
    assert [
        r for r in side._read_back.result(timeout=30) if r["namespace"] == rns.fingerprint.hex()
    ] == []  # no evidence

    # the engine measured its costs: recompute 0.1 ms a token (25.6 ms a chunk), a save 5 ms a chunk
    stats = {"prefill_step_us": 25_600, "prefill_step_tokens": CHUNK, "save_us": 5_000, "save_chunks": 1}
    for _ in range(3):
        side.update_connector_output(
            types.SimpleNamespace(kv_connector_stats=KVStoreStats(data=dict(stats)), kv_cache_events=None)
        )
    # 40 prompts of this namespace stored as the workers store them (chains with parents), none read back
    with KVClient(node.target) as c:
        for i in range(40):
            keys = chunk_keys(prompt(4 * CHUNK, seed=100 + i), rns)
            assert all(c.put_many(keys, [b"x" * 64] * 4, namespace=rns, parents=parent_keys(keys)))
    side._poll_read_back()  # takes the empty answer in, asks again
    rows = [r for r in side._read_back.result(timeout=30) if r["namespace"] == rns.fingerprint.hex()]
    assert {(r["bucket"], r["stored_blocks"], r["read_back_blocks"]) for r in rows} == {
        (0, 40, 0),
        (1, 40, 0),
        (2, 80, 0),
    }

    later = request(prompt(3 * CHUNK + 40, seed=22), rid="later", params={"session_id": "conv"})
    assert side.get_num_new_matched_tokens(later, 0) == (0, False)  # its sighting takes the node's counters in
    # the namespace's 160 blocks, none read: 3 / 164 with the prior; bucket 0's 40 pooled with it
    assert side.evidence.share(rns.fingerprint, 0) == pytest.approx(4 * (3 / 164) / 44)
    assert _saves_after_prefill(side, later) == []  # not stored, though it has a session id
    side.request_finished(later)
    assert side.counters["skipped_save_chunks"] >= 3
    side.shutdown()


def test_the_benchmarks_null_connector_implements_every_hook_and_never_loads() -> None:
    """``kvstore bench serving --configs null-connector``'s reference: a complete v1 connector
    (vLLM instantiates it) that answers every request "nothing to load" at once."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata

    from kvstore.bench.serving.null_connector import NullConnector

    assert issubclass(NullConnector, KVConnectorBase_V1) and not NullConnector.__abstractmethods__
    c = NullConnector.__new__(NullConnector)  # its hooks read no state: vLLM's config is not needed
    assert c.get_num_new_matched_tokens(types.SimpleNamespace(request_id="r"), 0) == (0, False)
    assert isinstance(c.build_connector_meta(types.SimpleNamespace()), KVConnectorMetadata)
    assert c.update_state_after_alloc(None, None, 0) is None and c.wait_for_save() is None


def test_the_cluster_client_for_pulls_is_made_at_start_not_by_the_first_remote_hit(tmp_path: Any) -> None:
    """With ``lookup_target`` etcd://, the worker makes its cluster client (and imports the
    pull path) on a thread of its own when it registers: made by the first chunk pulled from
    another node, it cost that request 0.3-0.4 s of TTFT (``kvstore bench serving``'s one
    remote hit on the shared trace: 381 ms for an 86-token prompt, 32 ms in ``baseline``).
    Pulls use that client; a cluster not reachable at start is tried again by the first
    pull; a closed worker makes none."""
    import contextlib

    from client import ClusterClient
    from gpu_agent.vllm.settings import ConnectorSettings
    from gpu_agent.vllm.worker import WorkerSide
    from kvstore.children import private_node
    from kvstore.cluster.local_etcd import free_port
    from kvstore.demo.vllm import local_cluster

    with contextlib.ExitStack() as stack:
        cluster, member = local_cluster(stack, tmp_path)
        assert cluster, "etcd is not installed: scripts/setup.sh installs it"
        n = stack.enter_context(private_node(tmp_path / "n", *member, dram="64MiB", nvme="0"))
        w = WorkerSide(None, None, ConnectorSettings(target=n.target, lookup_target=cluster), CHUNK)  # type: ignore[arg-type]
        warm = w.warm()
        assert warm is not None
        warm.join(timeout=30)
        made = w._remote
        assert isinstance(made, ClusterClient) and w._remote_client() is made  # made once, used by pulls
        assert set(made._clients) == set(made.nodes()) and len(made.nodes()) == 1  # and connected to the node
        assert "gpu_agent.pull" in sys.modules
        w.shutdown()
        assert w._remote is None and w._remote_client() is None  # closed: nothing made afterwards

        dead = f"etcd://127.0.0.1:{free_port()}/nobody"
        late = WorkerSide(None, None, ConnectorSettings(target=n.target, lookup_target=dead, deadline_s=0.5), CHUNK)  # type: ignore[arg-type]
        warm = late.warm()
        assert warm is not None
        warm.join(timeout=30)
        assert not warm.is_alive() and late._remote is None  # logged, not raised: the first pull tries again
        late.shutdown()
    assert WorkerSide(None, None, ConnectorSettings(target=n.target), CHUNK).warm() is None  # type: ignore[arg-type]


def test_the_save_ledger_reports_a_request_once_when_saved_and_finished() -> None:
    """The worker's one record of saves: a request is reported by ``get_finished`` once
    every save of it ended and vLLM finished it, in either order; a save that never
    started counts as ended; without ``defer_free`` nothing is reported."""
    from gpu_agent.vllm.worker import SaveLedger

    class Handle:
        def __init__(self) -> None:
            self.ended = False

        def done(self) -> bool:
            return self.ended

    ledger, ended = SaveLedger(), []
    a1, a2, b = Handle(), Handle(), Handle()
    ledger.add("a", a1, "spec-a1")  # type: ignore[arg-type]
    ledger.add("a", a2, "spec-a2")  # type: ignore[arg-type]
    ledger.add("b", b, "spec-b")  # type: ignore[arg-type]
    ledger.add("c", None, "spec-c")  # type: ignore[arg-type]  # could not start
    note = lambda rid, h, spec: ended.append((rid, spec))  # noqa: E731
    assert ledger.settle({"a"}, note) == set()  # a still copies; c ended but vLLM has not finished it
    assert ended == [("c", "spec-c")] and len(ledger.handles()) == 3
    a1.ended = True
    assert ledger.settle(set(), note) == set()  # a2 still copies
    a2.ended = b.ended = True
    assert ledger.settle({"c"}, note) == {"a", "c"}  # a was finished earlier, c now; b not yet
    assert sorted(ended) == [("a", "spec-a1"), ("a", "spec-a2"), ("b", "spec-b"), ("c", "spec-c")]
    assert ledger.settle({"b", "x"}, note) == {"b"}  # once each; x never saved here
    assert ledger.settle({"a", "b", "c"}, note) == set() and ledger.handles() == []
    ledger.add("d", None, "spec-d")  # type: ignore[arg-type]
    ledger.settle(set(), note)
    ledger.forget_reported()  # defer_free off: vLLM freed d's blocks itself
    assert ledger.settle({"d"}, note) == set()


def test_the_save_ledger_holds_a_request_saving_again_after_its_saves_ended() -> None:
    """A request whose saves all ended, then saves again (vLLM preempted it, its cancelled
    saves are issued anew when it resumes) and finishes while that save copies, is reported
    only once the new save ended: reported earlier, vLLM would free and reuse its pages under
    the copy, and the store would commit another request's KV under this prompt's keys
    (failed a clean-clone CI: test_preempted_requests_resume_with_the_right_kv)."""
    from gpu_agent.vllm.worker import SaveLedger

    class Handle:
        def __init__(self) -> None:
            self.ended = False

        def done(self) -> bool:
            return self.ended

    ledger, first, again = SaveLedger(), Handle(), Handle()
    note = lambda rid, h, spec: None  # noqa: E731
    ledger.add("a", first, "spec-1")  # type: ignore[arg-type]
    first.ended = True
    assert ledger.settle(set(), note) == set()  # saved, not finished
    ledger.add("a", again, "spec-2")  # type: ignore[arg-type]  # resumed: saving again
    assert ledger.settle({"a"}, note) == set()  # finished while the second save copies
    assert ledger.handles() == [again]
    again.ended = True
    assert ledger.settle(set(), note) == {"a"}
    assert ledger.settle({"a"}, note) == set()

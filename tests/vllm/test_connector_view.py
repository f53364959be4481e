"""The scheduler half's lookups from the pool's view (``lookups="view"``, the default).

Real nodes, real ``WatchHoldings`` streams, vLLM's own ``Request``: a miss is answered 0 at
the first ask with no store call, a hit is planned at the first ask once the view holds it,
every rank's shard counts, NVMe hits go to the background, a decode engine waits only for
its producer's handoff, and a dead node is a miss (a load error at worst), never a wait.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from test_connector_halves import CHUNK, Blocks, prompt, request, spec, store

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from kvstore.children import private_node

    with private_node(tmp_path_factory.mktemp("view") / "node", dram="64MiB", nvme="256MiB") as n:
        yield n


def viewing(node: Any, **extra: Any) -> Any:
    """A scheduler half answering from the view of ``node``, its first snapshot taken."""
    from gpu_agent.vllm.scheduler import SchedulerSide
    from gpu_agent.vllm.settings import ConnectorSettings

    tp = int(extra.pop("tp", 1))
    extra = {"save_policy": "always", **extra}
    settings = ConnectorSettings.from_extra({"target": node.target, "salt": str(time.monotonic_ns()), **extra})
    side = SchedulerSide(spec(tp), settings, CHUNK, produce=True, consume=True)
    assert side.view is not None and side.view.view.wait_synced(30), "the view never took its first snapshot"
    return side


def seen(side: Any, req: Any, chunks: int, *, tier: str | None = None, rank: tuple[int, int] = (0, 0)) -> None:
    """Wait (bounded) until the side's view holds ``chunks`` leading chunks of ``req`` (the
    view lags the node by milliseconds: a test asks once it has caught up)."""
    from gpu_agent.vllm.spec import rank_namespace, request_namespace
    from kvstore.keys import chunk_keys

    ns = rank_namespace(request_namespace(side.spec, side.settings, CHUNK, req), *rank)
    keys = chunk_keys(list(req.all_token_ids), ns)[:chunks]
    deadline = time.monotonic() + 30
    while True:
        m = side.view.view.match(keys)
        if m.hits == chunks and (tier is None or all(h.tier.name.lower() == tier for h in m.holders)):
            return
        assert time.monotonic() < deadline, f"the view never showed {chunks} chunks ({m})"
        time.sleep(0.01)


def test_a_miss_is_answered_at_the_first_ask_with_no_store_call(node: Any) -> None:
    side = viewing(node)
    for i in range(40):
        req = request(prompt(700 + i, seed=1000 + i), rid=f"new{i}")
        side.on_new_request(req)
        assert side.get_num_new_matched_tokens(req, 0) == (0, False)  # never None: no request waits for the store
    c = side.counters
    assert c["view_lookups"] == 40 and c["lookups"] == 0 and c["lookup_pending"] == 0, c
    side.shutdown()


def test_a_stored_prefix_is_planned_at_the_first_ask(node: Any) -> None:
    from client import KVClient
    from gpu_agent.vllm.spec import request_namespace
    from kvstore.keys import tail_key

    side = viewing(node)
    req = request(prompt(1000, seed=2))
    store(node, side, req, 3)
    seen(side, req, 3)
    assert side.get_num_new_matched_tokens(req, 512) == (768 - 512, False)  # after vLLM's own 512 tokens
    side.update_state_after_alloc(req, Blocks(list(range(100, 163))), 256)
    load = side._loads[req.request_id]
    assert (load.first_token, load.num_tokens) == (512, 768)
    whole = request(prompt(1000, seed=2), rid="whole")
    ns = request_namespace(side.spec, side.settings, CHUNK, whole)
    tail = tail_key(list(whole.all_token_ids), ns)
    assert tail is not None
    with KVClient(node.target) as c:
        assert c.put(tail, b"x" * 64, namespace=ns)
    deadline = time.monotonic() + 30
    while (got := side.get_num_new_matched_tokens(request(prompt(1000, seed=2), rid=f"w{time.monotonic_ns()}"), 0)) != (
        999,
        False,
    ):
        assert got[0] is not None and time.monotonic() < deadline, got  # the tail shows within the view's lag
        time.sleep(0.01)
    assert side.counters["lookups"] == 0 and side.counters["lookup_pending"] == 0
    side.shutdown()


def test_a_chunk_counts_only_when_every_tensor_parallel_rank_holds_its_shard(node: Any) -> None:
    side = viewing(node, tp=2)
    req = request(prompt(1000, seed=3))
    store(node, side, req, 3, ranks=[(0, 0)])
    seen(side, req, 3)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)  # rank 1's shards are missing
    store(node, side, req, 2, ranks=[(1, 0)])
    seen(side, req, 2, rank=(1, 0))
    assert side.get_num_new_matched_tokens(request(prompt(1000, seed=3), rid="again"), 0) == (512, False)
    side.shutdown()


def test_a_decode_engine_waits_only_for_its_producers_handoff(node: Any) -> None:
    """The one "not yet" left: a request carrying its producer's handoff waits until the
    node has committed what the producer saved; while the view does not show the handoff
    whole it asks the node itself (the view may lag a node that just restarted); once the
    view shows it, a handoff is planned from the view with no store call, as is the same
    prompt without a handoff."""
    from gpu_agent.vllm.spec import request_namespace

    side = viewing(node, deadline_s=10.0)
    toks = prompt(1000, seed=4)
    ns = request_namespace(side.spec, side.settings, CHUNK, request(toks))
    req = request(toks, params={"kvstore": {"namespace": ns.to_dict(), "saved_chunks": 3, "saved_tokens": 768}})
    store(node, side, req, 1)
    seen(side, req, 1)
    assert side.get_num_new_matched_tokens(req, 0) == (None, False)  # one of three committed: ask again next step
    store(node, side, req, 3)
    deadline = time.monotonic() + 10
    while (got := side.get_num_new_matched_tokens(req, 0))[0] is None:
        assert time.monotonic() < deadline, "the handoff never showed in the view"
        time.sleep(0.01)
    assert got == (768, False)
    c = side.counters
    assert c["handoff_waits"] + c["lookup_pending"] >= 1 and c["handoff_timeouts"] == 0  # it waited
    assert c["lookups"] >= 1  # the view showed one chunk: the node was asked
    seen(side, req, 3)
    lookups, waits = side.counters["lookups"], side.counters["handoff_waits"]
    params = {"kvstore": {"namespace": ns.to_dict(), "saved_chunks": 3, "saved_tokens": 768}}
    again = request(toks, rid="again", params=params)  # the view shows the handoff whole
    assert side.get_num_new_matched_tokens(again, 0) == (768, False)
    plain = request(toks, rid="plain")  # the same prompt without a handoff: from the view
    assert side.get_num_new_matched_tokens(plain, 0) == (768, False)
    assert (side.counters["lookups"], side.counters["handoff_waits"]) == (lookups, waits)
    side.update_state_after_alloc(again, Blocks(list(range(64))), 768)
    assert side._loads["again"].from_view
    side.shutdown()


def test_nvme_hits_load_in_the_background_and_dram_hits_in_the_step(node: Any) -> None:
    from client import KVClient
    from gpu_agent.vllm.spec import request_namespace
    from kvstore.keys import chunk_keys

    side = viewing(node)
    toks = prompt(800, seed=8)
    req = request(toks, rid="dram")
    store(node, side, req, 3)
    seen(side, req, 3, tier="dram")
    assert side.get_num_new_matched_tokens(req, 0) == (768, False)
    keys = chunk_keys(toks, request_namespace(side.spec, side.settings, CHUNK, req))[:3]
    with KVClient(node.target) as c:
        filler = [bytes([i]) * 16 for i in range(1, 20)]
        c.put_many(filler, [b"f" * (4 << 20)] * len(filler))  # 76 MiB through 64 MiB of DRAM
        assert "nvme" in c.lookup(keys)
    deadline = time.monotonic() + 30
    while (got := side.get_num_new_matched_tokens(request(toks, rid=f"nvme{time.monotonic_ns()}"), 0)) != (768, True):
        assert got[0] is not None and time.monotonic() < deadline, got  # the demotion shows within the lag
        time.sleep(0.01)
    assert side.counters["async_loads"] >= 1
    side.shutdown()


def test_a_load_the_view_planned_that_finds_chunks_gone_is_a_stale_hit_recomputed(node: Any) -> None:
    """The view said three chunks; two were deleted before the load: the worker loads the
    one left, fails the pages of the other two (vLLM recomputes them) and counts a stale
    hit; the scheduler exports the view's lag samples with its stats."""
    import torch

    from client import KVClient
    from gpu_agent.agent import GPUAgent
    from gpu_agent.buffers import EngineBuffers
    from gpu_agent.vllm.metadata import KVStoreMeta
    from gpu_agent.vllm.spec import request_namespace
    from gpu_agent.vllm.worker import WorkerSide
    from kvstore.keys import chunk_keys

    side = viewing(node)
    toks = prompt(1000, seed=12)
    req = request(toks, rid="stale")
    ns = request_namespace(side.spec, side.settings, CHUNK, req)
    layout = side.spec.layout()
    keys = chunk_keys(toks, ns)[:3]
    blocks = [torch.randn(layout.block_bytes(CHUNK) // 4).numpy().tobytes() for _ in keys]
    with KVClient(node.target) as c:
        assert all(c.put_many(keys, blocks, namespace=ns))
    seen(side, req, 3)
    assert side.get_num_new_matched_tokens(req, 0) == (768, False)
    pages = 64  # 1,000 tokens need 63 pages of 16
    side.update_state_after_alloc(req, Blocks(list(range(pages))), 768)
    load = side._loads[req.request_id]
    assert load.from_view and (load.first_token, load.num_tokens) == (0, 768)
    with KVClient(node.target) as c:
        assert c.delete(keys[1:]) == 2  # evicted, say, after the view said held

    w = WorkerSide(None, None, side.settings, CHUNK)  # type: ignore[arg-type]
    w.spec = side.spec
    # vLLM's CPU layout, one tensor per layer: [pages, KV heads, page tokens, 2 x head dim]
    kv = [torch.zeros(pages, layout.num_kv_heads, layout.page_size, 2 * layout.head_dim) for _ in range(2)]
    w.buffers = EngineBuffers.from_tensors(kv, pages)
    w._make_agent = lambda client: GPUAgent(client, layout, ns, device=torch.device("cpu"))
    w.start_load_kv(KVStoreMeta(loads=[load]))
    w._finish_loads()
    assert w.counters["view_stale_hits"] == 1 and w.counters["load_tokens"] == 256
    assert w.get_block_ids_with_load_errors() == set(range(16, 48))  # chunks 1 and 2: pages 16-47, recomputed
    assert w.counters["load_local_n"] == 0  # counted at the step's end (none here): no sample yet
    w.shutdown()
    stats = side.get_kv_connector_stats()
    assert stats is not None and stats.data.get("view_lag_s"), "the view's lag samples were not exported"
    side.shutdown()


def test_a_request_whose_load_failed_is_never_planned_a_load_again(node: Any) -> None:
    """The view lists chunks whose load then fails (a node killed, its entries not yet
    dropped): vLLM recomputes the failed blocks and asks the connector again; the request
    computes the rest itself rather than be planned the same failing load at every
    reschedule (found by ``--fault kill:node0@20``: one request failed its load 9,747 times
    in a second, the engine stepping in a loop); other requests still load."""
    from vllm.v1.outputs import KVConnectorOutput

    side = viewing(node)
    toks = prompt(1000, seed=13)
    req = request(toks, rid="fails")
    store(node, side, req, 3)
    seen(side, req, 3)
    assert side.get_num_new_matched_tokens(req, 0) == (768, False)
    side.update_state_after_alloc(req, Blocks(list(range(200, 264))), 768)
    side.update_connector_output(KVConnectorOutput(invalid_block_ids={216}))  # chunk 1's first page
    assert side.counters["loads_failed"] == 1
    assert side.get_num_new_matched_tokens(req, 256) == (0, False)  # rescheduled: computes the rest itself
    other = request(toks, rid="other")
    assert side.get_num_new_matched_tokens(other, 0) == (768, False)  # its own load is planned as before
    side.update_state_after_alloc(other, Blocks(list(range(300, 364))), 768)
    side.update_connector_output(KVConnectorOutput(failed_recving={"other"}))  # a background load failed
    assert side.get_num_new_matched_tokens(other, 0) == (0, False) and side.counters["loads_failed"] == 2
    side.shutdown()


def test_a_dead_node_is_a_miss_never_a_wait(tmp_path: Any) -> None:
    """The node dies: every ask is still answered at once (a stale hit costs a load error
    that vLLM recomputes), and once the view drops the node, a miss."""
    from kvstore.children import private_node

    with private_node(tmp_path / "node", dram="64MiB", nvme="0") as n:
        side = viewing(n)
        req = request(prompt(800, seed=9))
        store(n, side, req, 3)
        seen(side, req, 3)
        assert side.get_num_new_matched_tokens(req, 0) == (768, False)
        n.proc.kill()
        n.proc.wait()
        deadline = time.monotonic() + side.view.view.node_deadline_s + 30
        while True:
            got = side.get_num_new_matched_tokens(request(prompt(800, seed=9), rid=f"d{time.monotonic_ns()}"), 0)
            assert got[0] is not None, "a request was told to wait for a dead node"
            if got == (0, False):
                break
            assert time.monotonic() < deadline, "the view kept a dead node's chunks"
            time.sleep(0.05)
        assert side.counters["lookups"] == 0
        side.shutdown()


def test_a_token_the_nodes_refuse_to_show_their_holdings_falls_back_to_asking_the_store(tmp_path: Any) -> None:
    """Watching needs the admin token (keys would tell a tenant what others stored): a
    connector holding a tenant's token is refused the stream, notices, and looks up by
    asking the store instead, rather than missing every hit in silence."""
    from gpu_agent.vllm.scheduler import SchedulerSide
    from gpu_agent.vllm.settings import ConnectorSettings
    from kvstore.children import private_node

    tok = tmp_path / "a.token"
    tok.write_text("tenant-a-secret")
    env = {"KVSTORE_TOKEN": "admin-secret", "KVSTORE_TENANTS": f"a={tok}"}
    with private_node(tmp_path / "node", dram="64MiB", nvme="0", env=env) as n:
        settings = ConnectorSettings.from_extra({"target": n.target, "token": "tenant-a-secret"})
        side = SchedulerSide(spec(), settings, CHUNK, produce=True, consume=True)
        assert side.view is not None
        deadline = time.monotonic() + 30
        while side._viewing():
            assert time.monotonic() < deadline, "the refusal was never noticed"
            time.sleep(0.05)
        assert side.view.refused and side.view.view.stats().refused >= 1
        req = request(prompt(600, seed=11), rid="tenant")
        side.on_new_request(req)
        side.get_num_new_matched_tokens(req, 0)
        assert side.counters["lookups"] == 1 and side.counters["view_lookups"] == 0  # the store was asked
        side.shutdown()


def test_a_queued_requests_chunks_on_another_node_are_pulled_to_its_own_while_it_waits(tmp_path: Any) -> None:
    """Prefetch (``prefetch``, on by default): a request that arrives behind a waiting one,
    whose chunks the view shows on another node, has them pulled into the engine's own node
    before vLLM asks; vLLM then hears a local hit loaded in the step (not a background
    pull).  A request with nothing waiting ahead is not prefetched (its load pulls), and
    ``prefetch: false`` makes no prefetcher."""
    import contextlib

    from client import KVClient
    from gpu_agent.vllm.spec import request_namespace
    from kvstore.children import private_node
    from kvstore.demo.vllm import local_cluster
    from kvstore.keys import chunk_keys

    with contextlib.ExitStack() as stack:
        cluster, member = local_cluster(stack, tmp_path)
        assert cluster, "etcd is not installed: scripts/setup.sh installs it"
        a = stack.enter_context(private_node(tmp_path / "a", *member, dram="64MiB", nvme="0"))
        b = stack.enter_context(private_node(tmp_path / "b", *member, dram="64MiB", nvme="0"))

        def side_on_a(**extra: Any) -> Any:
            side = viewing(a, lookup_target=cluster, **extra)
            deadline = time.monotonic() + 30
            while not (len(side.view.view.nodes()) == 2 and side.view.view.wait_synced(1)):
                assert time.monotonic() < deadline, "the view never followed both nodes"
                time.sleep(0.05)
            return side

        assert side_on_a(prefetch=False).prefetcher is None
        side = side_on_a()
        toks = prompt(800, seed=22)
        req = request(toks, rid="queued")
        keys = chunk_keys(toks, request_namespace(side.spec, side.settings, CHUNK, req))[:3]
        store(b, side, req, 3)
        seen(side, req, 3)
        with KVClient(a.target) as ka:
            assert ka.lookup(keys) == [None] * 3  # on b only
            alone = request(toks, rid="alone")
            side.on_new_request(alone)  # nothing waits ahead of it: no prefetch
            assert side.prefetcher.snapshot()["prefetches"] == 0
            side.on_new_request(req)  # behind "alone", which waits (not allocated yet)
            deadline = time.monotonic() + 30
            while ka.lookup(keys) != ["dram"] * 3:
                assert time.monotonic() < deadline, "the queued request's chunks never reached its engine's node"
                time.sleep(0.01)
        c = side.prefetcher.snapshot()
        assert (c["prefetches"], c["prefetch_blocks"], c["prefetch_errors"]) == (1, 3, 0)
        deadline = time.monotonic() + 30
        while (got := side.get_num_new_matched_tokens(request(toks, rid=f"later{time.monotonic_ns()}"), 0)) != (
            768,
            False,
        ):
            assert got[0] is not None and time.monotonic() < deadline, got  # the own copies show within the lag
            time.sleep(0.01)
        stats = side.get_kv_connector_stats()
        assert stats is not None and stats.data["prefetch_blocks"] == 3
        side.shutdown()

"""``kvstore sim`` runs the connector's default ``save_policy`` ``evidence`` for real: each
simulated node keeps the node's own read-back accounting, each connector an
``admission.Evidence`` polled from its node's rows and planning as the scheduler does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from test_sim_fleet import CHUNK, _without_wall, pool_run, profile, workload, write_trace

from gpu_agent.vllm import admission
from gpu_agent.vllm.settings import ConnectorSettings
from kvstore.block import BlockMeta
from kvstore.keys import NO_PARENT, ChunkKey
from kvstore.node.readback import ReadBack
from kvstore.sim.cli import run_config
from kvstore.sim.fleet import run_fleet
from kvstore.sim.pool import NAMESPACE, Pool, PoolHooks
from kvstore.traces.format import Trace
from kvstore.traces.generate import GenParams, generate_events
from kvstore.traces.simulator import TraceClock, run_replay

# one profile for every workload here: a chunk's recompute (about 6 ms) is some 15 times its
# save (one DRAM transfer, about 0.4 ms a chunk), so a position pays once about 7 % of it is read
EVIDENCE = {"prefill_ms_per_token": 0.2}


def unique_trace(path: Path, n: int = 400) -> Path:
    """``n`` one-off prompts of 6 trace blocks (96 tokens, 3 chunks), one every 150 ms."""
    return write_trace(path, [(i * 150, [i * 10 + j for j in range(6)], 32) for i in range(n)])


def conversations(path: Path) -> Path:
    """Multi-turn conversations over 3 system prompts (``kvstore replay --generate`` style),
    a turn every 2 s of think time: most prompts extend an earlier one."""
    reqs, closes = generate_events(
        GenParams(requests=200, seed=7, system_prompts=3, think_s=2.0, rate=4.0, one_shot=0.05, branch=0.0)
    )
    Trace(reqs, closes=closes).write(path)
    return path


def stored(out: dict[str, Any]) -> int:
    return int(out["store_blocks"]["stored_bytes"])


def test_unique_prompts_converge_to_storing_little(tmp_path: Path) -> None:
    wl = workload(unique_trace(tmp_path / "t.jsonl"))
    p = profile(**EVIDENCE)
    always = pool_run(wl, p, save_policy="always")
    evidence = pool_run(wl, p)  # the default
    assert _without_wall(evidence) == _without_wall(pool_run(wl, p, save_policy="evidence"))  # deterministic
    chunk_bytes = 32 * p.kv_bytes_per_token
    assert stored(always) == always["connector"]["saved_chunks"] * chunk_bytes == 400 * 3 * chunk_bytes
    # nothing is read back: the evidence says so, and the connectors store little once it does
    assert evidence["store_blocks"]["read_back_bytes"] == always["store_blocks"]["read_back_bytes"] == 0
    assert 0 < stored(evidence) < stored(always) // 5  # the prior stores at first; then little
    c = evidence["connector"]
    assert c["saved_chunks"] + c["skipped_save_chunks"] == 400 * 3 and c["skipped_save_chunks"] > 4 * c["saved_chunks"]
    # the same serving: nothing was ever read, so storing less costs no hits
    assert evidence["prompt_tokens"] == always["prompt_tokens"] and evidence["prompt_tokens"]["store"] == 0
    # converged: of the last 160 requests' 480 chunks, under a tenth are stored (the explorer's)
    first = pool_run(workload(unique_trace(tmp_path / "first.jsonl", 240)), p)
    assert 0 < stored(evidence) - stored(first) < 48 * chunk_bytes


def test_the_evidence_is_the_nodes_read_back_polled_each_second_of_virtual_time(tmp_path: Path) -> None:
    wl = workload(unique_trace(tmp_path / "t.jsonl", 240))
    p = profile(**EVIDENCE)
    hooks = PoolHooks(
        p, 2, node_dram=1 << 20, clock=(clock := TraceClock()), settings=ConnectorSettings.from_extra(CHUNK)
    )
    run = run_fleet(wl, p, engines=2, hooks=hooks, clock=clock)
    for c in hooks.connectors:
        # a request every 300 ms per engine over 36 s: a poll at the first that finds a second
        # gone since the last, every 1.2 s (not one per request, nor one per second idle)
        assert c.evidence.updates == 30 and run.virtual_s > 35.85
        assert c.evidence.namespace_share(NAMESPACE) < 0.1  # 0.75 before any evidence
        assert c.evidence.save.per_token() is not None  # the saves' cost, observed
        # the rows it read are its node's own, shaped as KVClient.stats()["read_back"]
        rows = hooks.pool.read_back_rows(c.node)
        assert rows and {r["namespace"] for r in rows} == {NAMESPACE.hex()}
        # (a node of 32 chunks: what left is not followed, and stays counted)
        assert sum(r["stored_blocks"] for r in rows) > len(hooks.pool.nodes[c.node].readback) > 0
        assert all(r["read_back_blocks"] == 0 for r in rows)
    hooks.close()


def test_conversations_are_stored_and_served_from_the_store(tmp_path: Path) -> None:
    wl = workload(conversations(tmp_path / "conv.jsonl"))
    p = profile(num_gpu_blocks=80, **EVIDENCE)  # an engine's cache holds a few conversations
    always = pool_run(wl, p, save_policy="always")
    evidence = pool_run(wl, p)
    assert evidence["completed"] == 200 and evidence["errors"] == 0
    c = evidence["connector"]
    # nearly everything: what it declines is the turns' trailing partial chunks, keyed by their
    # prompt's exact tokens, which the next turn (a longer prompt) never reads (serving below
    # is as with `always`)
    assert c["saved_chunks"] >= 0.8 * always["connector"]["saved_chunks"]
    assert c["skipped_save_chunks"] <= 0.15 * (c["saved_chunks"] + c["skipped_save_chunks"])
    assert stored(evidence) >= 0.8 * stored(always)
    sb = evidence["store_blocks"]
    assert 0.1 * sb["stored_bytes"] < sb["read_back_bytes"] <= sb["stored_bytes"]
    pt = evidence["prompt_tokens"]
    assert pt["store"] >= 0.95 * always["prompt_tokens"]["store"] and pt["store"] > 0.1 * pt["total"]
    base = run_config("baseline", wl, p, engines=2, seed=0, node_dram=0, node_nvme=0, slo_ttft_ms=2000, slo_tbt_ms=200)
    assert pt["recomputed"] <= base["prompt_tokens"]["recomputed"] - pt["store"] // 2  # not recomputed


def test_the_simulated_nodes_read_back_rows_are_the_nodes_own_accounting() -> None:
    """The same stores, reads and evictions fed to a real ``ReadBack`` by hand give the same rows."""
    clock = TraceClock()
    pool = Pool(2, dram_chunks=8, chunk_tokens=32, chunk_bytes=32_000, clock=clock)
    ref = [ReadBack(), ReadBack()]
    held: list[dict[ChunkKey, None]] = [{}, {}]

    def key(chain: int, pos: int) -> ChunkKey:
        return ChunkKey(bytes([chain, pos]) * 8)

    def meta(chain: int, pos: int) -> BlockMeta:
        parent = key(chain, pos - 1) if pos else NO_PARENT
        return BlockMeta(NAMESPACE, key(chain, pos), parent, 32, "uint8", (1,), 1, 0)

    def sync() -> None:  # what left a node since: its eviction policy's choice
        for j in (0, 1):
            for k in [k for k in held[j] if pool.nodes[j].where(k) is None]:
                del held[j][k]
                ref[j].left(k)

    async def save(node: int, chain: int, n: int) -> None:
        keys = [key(chain, i) for i in range(n)]
        parents = [key(chain, i - 1) if i else None for i in range(n)]
        await pool.save(node, keys, parents, None)
        sync()
        for i in range(n):
            if key(chain, i) not in held[node]:
                held[node][key(chain, i)] = None
                ref[node].stored(meta(chain, i))

    async def load(node: int, chain: int, n: int, where: int) -> None:
        keys = [key(chain, i) for i in range(n)]
        parents = [key(chain, i - 1) if i else None for i in range(n)]
        await pool.load(node, keys, parents, [where] * n, None)
        ref[where].read(meta(chain, i) for i in range(n) if key(chain, i) in held[where])
        sync()
        if where != node:  # pulled: put into the own node
            for i in range(n):
                if key(chain, i) in held[where] and key(chain, i) not in held[node]:
                    held[node][key(chain, i)] = None
                    ref[node].stored(meta(chain, i))

    async def script() -> None:
        await save(0, 1, 4)  # positions 0-3
        await load(0, 1, 2, 0)  # two read back
        await load(0, 1, 3, 0)  # one more: a second read is not counted again
        await save(0, 1, 4)  # stored already: not counted again
        await load(1, 1, 3, 0)  # pulled by node 1: read on node 0, stored on node 1
        await save(0, 2, 6)  # 10 chunks on an 8-chunk node: some leave
        await save(0, 3, 3)
        await save(0, 1, 4)  # what left and comes again is stored again
        await load(0, 3, 3, 0)
        await save(1, 4, 3)  # node 1: a chain whose first chunk it holds already
        clock.now = 1.0

    run_replay(script())
    assert any(len(h) < 14 for h in held) and pool.nodes[0].counters["dram_evictions"] > 0
    for j in (0, 1):
        got = pool.read_back_rows(j)
        want = [
            {"namespace": r.namespace.hex(), **{f: getattr(r, f) for f in ("bucket", "stored_blocks", "stored_bytes", "read_back_blocks", "read_back_bytes")}}
            for r in ref[j].rows()
        ]  # fmt: skip
        assert got == want and got
        admission.Evidence().update(got)  # the rows Evidence.update takes
    assert pool.summary()["store_blocks"]["stored_bytes"] == 32_000 * sum(
        r["stored_blocks"] for j in (0, 1) for r in pool.read_back_rows(j)
    )
    pool.close()

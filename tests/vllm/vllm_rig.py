"""The vLLM suite's engines, nodes and checks.  Import the fixtures by name
(``from vllm_rig import healthy_node, rig``).

Engine processes are what the suite pays for (each takes a minute or more to start on a
small CPU machine), so one module-scoped :class:`Rig` starts them all at once, in
parallel, and every test uses them with fresh prompts.  vLLM's defaults hold unless a
test is about the setting: prefix caching on everywhere, a whole prompt per step.

* ``ref``: no connector (the recompute reference every result is compared with);
* ``prefill``: ``kv_both`` on ``node``, the producer of a prefill/decode pair and the
  first engine of a conversation;
* ``decode``: ``kv_consumer`` on ``node``;
* ``remote``: ``kv_consumer`` on ``other``, another member of the cluster: it finds
  chunks cluster-wide and pulls them into its own node;
* ``small``: ``kv_both`` on ``node`` with chunked prefill (``SMALL_STEP`` tokens a step)
  and a KV cache of one ``MAX``-token request, so concurrent requests are preempted
  (and a request of ``MAX`` tokens runs only when every block has come back);
* ``tp2``: ``kv_both`` on ``node`` with two tensor-parallel ranks (each stores its own
  shard: a chunk is two blocks on the node), in a rig of its own with ``ref`` only
  (``tp2_rig``; its module runs after the others' engines are shut down).

Every check that KV came from the store counts the node's block reads
(``get_hits_dram + get_hits_nvme``): an engine that recomputed everything reads none.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

MAX = 2048  # max_model_len of every engine
N = 1000  # the usual prompt: 3 whole chunks of 256 and a partial one of 232 tokens
CHUNK = 256  # the connector's default chunk
SMALL_STEP = 128  # max_num_batched_tokens of the chunked-prefill engine
LAYERS, HIDDEN = 2, 256
KV_PER_TOKEN = LAYERS * 2 * (HIDDEN // 64 // 2) * 64 * 4  # K and V, fp32, 2 KV heads of 64
ATOL = 1e-4
RETRY = 1.0
"""The rig's engines' ``retry_s`` (the default is 5 s): after a test failed their store
calls (a node stopped, killed or frozen), they try the store again this soon, and the next
test waits ``RETRY + 1`` s for it rather than 6."""
NICE = 5
"""How much nicer than the nodes the rig's engines run: vLLM's workers spin on their message
queues while a request runs (the ``tp2`` engine's two ranks and its core: three spinners on
two cores), and a node starved behind them left a lookup unanswered for 15 s."""


def prompt(seed: int, n: int = N) -> list[int]:
    return np.random.default_rng(seed).integers(1, 31000, n).tolist()


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Equal greedy tokens and logprobs within ``ATOL``."""
    return (
        a["tokens"] == b["tokens"]
        and len(a["logprobs"]) == len(b["logprobs"])
        and bool(np.allclose(a["logprobs"], b["logprobs"], atol=ATOL, rtol=0))
    )


def diff(a: dict[str, Any], b: dict[str, Any]) -> str:
    """Where two results part (for an assertion message)."""
    first = next((i for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y), None)
    n = min(len(a["logprobs"]), len(b["logprobs"]))
    worst = float(np.max(np.abs(np.subtract(a["logprobs"][:n], b["logprobs"][:n])))) if n else 0.0
    return (
        f"tokens differ first at {first} ({len(a['tokens'])} vs {len(b['tokens'])} tokens), "
        f"max |logprob diff| {worst:.2e}; got {a['tokens']}, want {b['tokens']}"
    )


def info(r: dict[str, Any]) -> dict[str, Any]:
    """The connector's ``kv_transfer_params["kvstore"]`` of a result ({} when it gave none)."""
    got: dict[str, Any] = (r.get("kv_transfer_params") or {}).get("kvstore") or {}
    return got


def expect(produced: dict[str, Any], tokens: list[int], *, local: int = 0, ranks: int = 1) -> tuple[int, int]:
    """What a consumer of ``tokens`` loads from what ``produced`` (the producer's result,
    its prompt under ``"prompt"``) saved, its own prefix cache holding ``local`` tokens:
    (blocks the node hands out, tokens the store supplies).  The producer's prompt itself
    is stored whole (its trailing partial chunk under its exact tokens); of other tokens
    the whole chunks the producer saved (``saved_chunks``: its answer's too) that they
    share.  vLLM computes the last prompt token itself; a chunk is a block per
    tensor-parallel rank."""
    n = len(tokens)
    if produced.get("prompt") == tokens:
        end = n
    else:
        end = min(int(info(produced).get("saved_chunks", 0)), n // CHUNK) * CHUNK
    end = min(end, n - 1)
    if end <= local:
        return 0, 0
    return (-(-end // CHUNK) - local // CHUNK) * ranks, end - local


def made(result: dict[str, Any], tokens: list[int]) -> dict[str, Any]:
    """``result`` with the prompt it was made of (for :func:`expect`)."""
    return {**result, "prompt": list(tokens)}


def reads(client: Any) -> int:
    """Blocks the node has handed out (DRAM and NVMe hits of Acquire/Get)."""
    c = client.stats()["counters"]
    return int(c.get("get_hits_dram", 0)) + int(c.get("get_hits_nvme", 0))


def found(client: Any) -> int:
    """Chunks ``match_prefix`` found on the node."""
    return int(client.stats()["counters"].get("match_prefix_hits", 0))


class Rig:
    """The nodes, the engines (see the module docstring) and clients of both nodes.
    ``tp2``: the reference engine and the ``tp2`` engine only (:func:`tp2_rig`); else every
    other engine."""

    def __init__(self, d: Path, stack: contextlib.ExitStack, *, tp2: bool = False) -> None:
        from client import KVClient
        from kvstore.children import private_node
        from kvstore.demo.engine import EngineProcess, make_lora, make_model
        from kvstore.demo.vllm import local_cluster

        self.dir = d
        self.model = make_model(d / "model", layers=LAYERS, hidden=HIDDEN, max_tokens=MAX)
        self.lora = {"name": "adapter-a", "id": 1, "path": str(make_lora(d / "lora-a", self.model))}
        # both nodes are members of one cluster (a real etcd): the remote engine looks chunks
        # up and pulls them through a cluster client, as `kvstore demo vllm` does
        cluster_target, member = local_cluster(stack, d)
        assert cluster_target, "etcd is not installed: scripts/setup.sh installs it"
        self.node = private_node(d / "node", *member, dram="256MiB", nvme="256MiB", log_path=d / "node.log")
        stack.callback(self.node.close)
        self.other_node = private_node(d / "other", *member, dram="256MiB", nvme="256MiB", log_path=d / "other.log")
        stack.callback(self.other_node.close)
        # these engines pin the data path: every prompt they compute is stored (save_policy
        # always), so one request is enough to test a load; what `auto` stores is tested in
        # test_connector_halves.py and measured by `kvstore bench serving`
        extra = {"target": self.node.target, "deadline_s": 2.0, "save_policy": "always", "retry_s": RETRY}
        remote_extra = {
            "target": self.other_node.target,
            "lookup_target": cluster_target,
            "deadline_s": 2.0,
            "retry_s": RETRY,
        }

        def engine(name: str, **kw: Any) -> EngineProcess:
            kw.setdefault("max_tokens", MAX)
            kw.setdefault("kv_bytes", 64 << 20)
            kw.setdefault("nice", NICE)
            e = EngineProcess(self.model, log_path=d / f"{name}.log", **kw)
            stack.callback(e.close)
            return e

        self.ref = engine("ref", lora=not tp2)
        if tp2:
            self._tp2(engine, extra)
            engines: tuple[Any, ...] = (self.ref, self.tp2)
        else:
            self.prefill = engine("prefill", connector={"role": "kv_both", "extra": extra}, lora=True)
            self.decode = engine("decode", connector={"role": "kv_consumer", "extra": extra}, lora=True)
            self.remote = engine("remote", connector={"role": "kv_consumer", "extra": remote_extra})
            self.small = engine(
                "small",
                connector={"role": "kv_both", "extra": extra},
                max_batched_tokens=SMALL_STEP,
                kv_bytes=(MAX + 128) * KV_PER_TOKEN,  # and vLLM's null block (128 tokens on the CPU)
            )
            engines = (self.ref, self.prefill, self.decode, self.remote, self.small)
        stack.callback(lambda: [e.quit() for e in engines])  # runs first: they shut down together
        t0 = time.perf_counter()
        for e in engines:
            e.wait_ready(timeout=900)
        self.started_s = time.perf_counter() - t0
        from stalls import Stalls, find, tree

        self.stalls = Stalls(
            {
                "pytest": [os.getpid()],  # the sampler's own process: runnable but not run, or paused
                "node": [self.node.proc.pid],
                "other": [self.other_node.proc.pid],
                "etcd": find(str(d / "etcd")),
                "engines": [p for e in engines for p in tree(e.proc.pid)],
            }
        )
        stack.callback(self.stalls.close)
        self.client = KVClient(self.node.target)
        stack.callback(self.client.close)
        self.other = KVClient(self.other_node.target)
        stack.callback(self.other.close)
        self._refs: dict[tuple[Any, ...], dict[str, Any]] = {}

    def _tp2(self, engine: Any, extra: dict[str, Any]) -> None:
        # two ranks busy-polling on two cores starve the node and each rank's saver thread:
        # a save's Reserve can take longer than 2 s there (a lost save, a recompute, but
        # this engine's tests are about each rank's shard, not the deadline), and nicer than
        # the rest: its three spinners, not the node, should wait for a core.  Its deadline
        # outlasts a pause of the whole machine: a clean-clone CI run caught one with the
        # rig's sampler (stalls.py): no sample for 17 s, the spinners on the CPUs charged 28 s
        # of CPU in those 17 s, the node and etcd asleep and not waiting for a CPU (0.35 s
        # of run-queue wait), no I/O or memory pressure; 15 s of deadline lost the save.  It
        # runs in a module of its own, with the reference engine only: beside the five other
        # engines (about a hundred of their threads runnable) it stalled for 17 s to 2 min
        self.tp2 = engine(
            "tp2", connector={"role": "kv_both", "extra": {**extra, "deadline_s": 60.0}}, tp=2, nice=2 * NICE
        )

    def want(self, tokens: list[int], max_tokens: int, **kw: Any) -> dict[str, Any]:
        """The reference engine's result (computed once per prompt and settings)."""
        key = (tuple(tokens), max_tokens, tuple(sorted((k, str(v)) for k, v in kw.items())))
        if key not in self._refs:
            self._refs[key] = self.ref.generate(tokens, max_tokens=max_tokens, **kw)
        return self._refs[key]


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    with contextlib.ExitStack() as stack:
        r = Rig(tmp_path_factory.mktemp("vllm"), stack)
        print(f"\nvLLM engines up in {r.started_s:.0f} s", flush=True)
        yield r


@pytest.fixture(scope="module")
def tp2_rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    """The rig with the reference and the ``tp2`` engines only (the five others shut down)."""
    with contextlib.ExitStack() as stack:
        r = Rig(tmp_path_factory.mktemp("vllm-tp2"), stack, tp2=True)
        print(f"\nvLLM engines up in {r.started_s:.0f} s", flush=True)
        yield r


@pytest.fixture
def healthy_node(rig: Rig) -> Iterator[Any]:
    """The node, back up without failpoints after the test (which may stop, kill or
    freeze it), the engines' links to a restarted node renewed, and ``RETRY`` later:
    an engine whose store calls failed tries again only then."""
    node = rig.node
    yield node
    with contextlib.suppress(ProcessLookupError):
        os.kill(node.proc.pid, signal.SIGCONT)  # a frozen node answers again
    if node.env.pop("KVSTORE_FAILPOINTS", None) is not None and node.proc.poll() is None:
        node.stop()
    restarted = node.proc.poll() is not None
    if restarted:
        node.start()
        # an engine that idled while the node was down still holds its link to the old
        # process: its first store call after the restart fails (a save lost, a handoff
        # recomputed) and it attaches afresh RETRY later.  One throwaway request each
        # makes that first call here, not in the next test.
        for i, engine in enumerate((rig.prefill, rig.decode, rig.small)):
            toks = np.random.default_rng(9000 + i).integers(1, 31000, 300).tolist()
            engine.generate(toks, max_tokens=1, timeout=120)
    time.sleep(RETRY + 1)

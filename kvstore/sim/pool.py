"""The ``pool`` configuration of ``kvstore sim``: kvstore nodes beside the engines, and each
engine's connector deciding what to look up, load and save as the real one does.

**Nodes** (:class:`Pool`): one per engine, node *i* engine *i*'s (``kvstore bench serving``
runs one per engine), or ``--nodes M`` shared by the engines (engine *e* on node
``e * M // N``: consecutive engines on one machine, as its GPUs are), each a real :class:`~kvstore.node.manager.TierManager` built by the replay simulator's
own wiring (:func:`kvstore.traces.simulator.build_manager`): DRAM over a byteless arena of
``--node-dram`` / chunk bytes one-unit blocks, with ``--node-nvme`` a byteless NVMe tier
(DRAM evictions demote into it, hits there are promoted), the node's default eviction
policy and its session hints on the fleet's virtual clock.  Every eviction, promotion and
session hint is the node's own code; only the bytes are missing.

**Chunks**: the connector's default chunk, ``ConnectorSettings().chunk_for(block_size)``
(the smallest multiple of the engine's block size of at least 256 tokens: 16 blocks of
``h100-llama3-8b``, 2 of ``local``), ``kv_bytes_per_token × chunk tokens`` bytes.  A chunk's
key is the chained hash of its last engine block (16 bytes, like a :data:`ChunkKey`, and
like one it names the whole prefix).  Only a prompt's full chunks are keyed.

**Lookups** (:meth:`Connector.lookup_external`, the engine's ``lookup_external``): from the
chunk holding the first block after the engine's local hit (the connector asks from
``num_computed_tokens // chunk``), each key on the engine's own node (``dram``, ``nvme``),
else on another node that stored it (``network``: the first in the order they stored it;
the connector's cluster-wide ``match_prefix``; the real cluster asks each key's owners,
this model finds a copy on any node, which is what the benchmark's ``pool`` is for), up
to the first key found nowhere.  The load gate (:class:`gpu_agent.vllm.gate.LoadGate`,
fed the simulated step and load times) cuts the run at the first chunk whose kind
(``local``/``nvme``/``remote``) does not pay.  The hit is the blocks from the local hit to
the run's end (at most the prompt's last token less one: vLLM computes it), per tier;
``async_loads`` (``auto``: when a chunk is on NVMe or another node) says whether it loads
while the engine steps on.  Chunks are sighted (:class:`gpu_agent.vllm.admission.Sightings`)
when the request arrives, as the connector does, and its save plan made then.

**Save policy** (``save_policy``, the connector's; default ``evidence``, as the
connector's).  ``evidence`` runs for real: each connector holds a
:class:`gpu_agent.vllm.admission.Evidence` and plans with :meth:`~gpu_agent.vllm.admission.Evidence.plan`
as the scheduler's ``_sight`` does (the namespace fingerprint :data:`NAMESPACE`, the
prompt's full chunks, ``recompute_s`` the load gate's measured recompute rate × chunk
tokens, ``retain`` false: the benchmark sends no ``kv_transfer_params["retain"]`` and a
session id is no retention hint here, ``producer_only`` for a prefill engine).  Its
evidence is its own node's read-back counters: every simulated node is a real
:class:`~kvstore.node.manager.TierManager`, which keeps the node's
:class:`~kvstore.node.readback.ReadBack` itself (a commit's new block is ``stored``, an
``acquire``'s hits are ``read``, a block that leaves is ``left``), so the rows are the
node's own; :func:`read_back_rows` shapes them as ``KVClient.stats()["read_back"]`` does.
The connector polls them when a request arrives and
:data:`gpu_agent.vllm.storelink.READ_BACK_EVERY_S` of virtual time has passed since its
last poll, as the scheduler does (its poll is answered at once here, where the real one
is taken in at a later sighting).  The save cost it weighs (:meth:`Evidence.observe`,
``save_us`` over ``save_chunks``, per step as the workers report them) is what a save
costs in the simulation: one per request and step, as the workers save, its chunks'
bytes over the profile's DRAM link, one transfer's latency and ``connector_save_ms``
(:meth:`~kvstore.sim.profile.EngineProfile.save_s`:
the same copy and commit a handoff waits for).  The other policies plan with :func:`gpu_agent.vllm.admission.plan`
(``auto``: a request with a session id stores everything, others the chunks seen at
least twice).  ``skipped_save_chunks`` counts, as the connector does, the full prompt
chunks a limited plan left unsaved when its request finished.

**Loads** (``step_started``, at the step that starts them): leases on the nodes holding the
chunks (``acquire``: the policy hears of the read, an NVMe hit is promoted), chunks of other
nodes put into the own node (``reserve`` + ``commit``, as :mod:`gpu_agent.pull` does),
then released.  A chunk gone by then (another engine's save evicted it since the lookup)
counts in ``load_misses``; the engine model has already taken it as loaded.

**Saves** (``step_ended``): the engine's ``BlockStored`` events say how many leading blocks of
each request its prefix cache holds (with its local hit); the full chunks among them, from
``saved_chunks`` to the plan's limit, are reserved and committed into the own node in put
batches (``EXISTS``: stored already).  ``saved_chunks`` is the connector's: the chunks found
stored when the local hit is under one chunk, 0 otherwise and after a preemption.

**Prefill/decode** (``pd``, ``conductor-pd``; the connector's roles, :data:`ROLES`): a
prefill engine's connector is a producer only (``kv_producer``): it never looks up
(:meth:`PoolHooks.lookup_for` is None), plans to save everything (``producer_only``) and
saves the prompt's chunks as above and, when the prompt is computed, its trailing partial
chunk (:func:`tail_key`).  When its request (``max_tokens`` 1) finishes, what it saved is
its :class:`Handoff` (the ``kv_transfer_params["kvstore"]`` of its answer), and the decode
engine gets the request once its last step's saves are copied and committed
(:meth:`~kvstore.sim.profile.EngineProfile.save_s`).  A decode engine's connector is a consumer only
(``kv_consumer``): it sights and saves nothing; its lookup of a handed-off request skips
the load gate and loads every chunk found (own node: DRAM; another node: network), then,
with the whole prompt saved and found, the partial chunk and the blocks up to the prompt's
last token less one (:class:`~kvstore.sim.engine.ExternalHit`'s ``tail_tokens``), so the
decode engine computes one prompt token.  Fewer found than saved (evicted since) counts in
``handoff_short``; the live connector would first wait up to ``deadline_s``.

**The prompt's trailing partial chunk** (:func:`tail_key`; the connector keys it by the
prompt's exact tokens): every producing connector saves it with the prompt's last full
chunks when the plan admits it (``tail``; a sighting policy counts its sightings as the
connector does), and a lookup that found every full chunk of a prompt with no output yet
asks for it as one more chunk of the run (the load gate weighs it as one): found, the hit
reaches the prompt's last token less one, and the request never saves it again.

**Prefetch** (``prefetch``, the connector's, on with ``lookups="view"``; :mod:`gpu_agent.vllm.prefetcher`):
a request that arrives while others wait on its engine (arrived, not scheduled) has its
full chunks that other nodes hold pulled into the own node, one prefetch after the other
(the prefetcher's one thread; at most ``MAX_QUEUED`` pending, more are skipped), each
landing the network's load time of its chunks later (``Hooks.arrived`` says when; then
:meth:`Connector.prefetched` leases them and puts them into the own node, as a load's pull
does).  A lookup after it lands finds them on the own node (DRAM: the local load); one
before it pulls them itself.

Left out: a prompt shorter than one engine block (the engine model offers no block to
look up, where vLLM asks the connector anyway), decode chunks (``save_decode``), the
lookup's own latency and its wait budget (answers are immediate), lookup odds
(``patience``).

The mapping of a run of chunks to the engine's hit (:func:`hit_blocks`,
:func:`external_hit`) and of ``BlockStored`` events to a request's cached blocks
(:func:`stored_upto`) are shared with the mock engines' link to real nodes
(:mod:`kvstore.sim.live_pool`).

State: a :class:`Pool` and its :class:`Connector`\\ s belong to one fleet run, on its event
loop's thread.  Invariants: a request's ``saved`` chunks never exceed its ``registered``
blocks' full chunks (nor the plan's limit); ``_holders[key]`` lists every node that committed
``key`` and may list some that evicted it since (checked on use, dropped then).
"""

from __future__ import annotations

import collections
import dataclasses
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import xxhash

from gpu_agent.vllm import admission
from gpu_agent.vllm.gate import PREFILL_STEP_TOKENS, LoadGate, background_kinds
from gpu_agent.vllm.prefetcher import MAX_QUEUED
from gpu_agent.vllm.settings import ConnectorSettings
from gpu_agent.vllm.storelink import READ_BACK_EVERY_S
from kvstore.bench.serving.workload import Work
from kvstore.block import BlockMeta
from kvstore.errors import InvalidArgument
from kvstore.keys import NO_PARENT, ChunkKey
from kvstore.node.manager import Status, TierManager
from kvstore.node.sessions import Sessions
from kvstore.sim.engine import BlockHash, BlockStored, ExternalHit, LookupExternal, StepResult
from kvstore.sim.profile import TIERS, EngineProfile, Tier
from kvstore.traces.simulator import DEFAULT_SESSION_TTL, TraceClock, build_manager, put_batch
from tiers.base import TierKind
from tiers.policy import DEFAULT_POLICY

NAMESPACE = xxhash.xxh64_digest(b"kvstore.sim")
"""The 8-byte namespace fingerprint of every simulated block (one model, one tenant)."""

_KIND = {"dram": "local", "nvme": "nvme", "network": "remote"}  # tier -> the load gate's kind
_TAIL = struct.Struct("<QQ")
ROLES = ("both", "prefill", "decode")
"""A connector's role: ``kv_both``, ``kv_producer`` (saves, never loads), ``kv_consumer``
(loads, never saves)."""


def read_back_rows(node: TierManager) -> list[dict[str, Any]]:
    """A node's read-back counters (:meth:`kvstore.node.readback.ReadBack.rows`) as
    ``KVClient.stats()["read_back"]`` gives them (the namespace fingerprint in hex): what
    :meth:`gpu_agent.vllm.admission.Evidence.update` takes."""
    return [
        {
            "namespace": r.namespace.hex(),
            "bucket": r.bucket,
            "stored_blocks": r.stored_blocks,
            "stored_bytes": r.stored_bytes,
            "read_back_blocks": r.read_back_blocks,
            "read_back_bytes": r.read_back_bytes,
        }
        for r in node.readback.rows()
    ]


def chunk_tokens(profile: EngineProfile, settings: ConnectorSettings | None = None) -> int:
    """Tokens per chunk: the connector's (``chunk_tokens``, default the smallest multiple of the
    block size of at least 256)."""
    return (settings or ConnectorSettings()).chunk_for(profile.block_size)


def chunks_of(nbytes: int, chunk_bytes: int, flag: str) -> int:
    """Whole chunks in ``nbytes`` (0 stays 0); a size too small for one chunk is an error."""
    if nbytes < 0:
        raise InvalidArgument(f"{flag} must not be negative, got {nbytes}")
    n = nbytes // chunk_bytes
    if nbytes and not n:
        raise InvalidArgument(f"{flag} of {nbytes} bytes holds no chunk of {chunk_bytes} bytes: give at least that")
    return n


def chunk_keys(hashes: Sequence[BlockHash], blocks_per_chunk: int) -> list[ChunkKey]:
    """A prompt's full chunks' keys: each chunk's last engine block's chained hash."""
    return [ChunkKey(h) for h in hashes[blocks_per_chunk - 1 :: blocks_per_chunk]]


def hit_blocks(tiers: Sequence[Tier], first: int, local: int, end: int, blocks_per_chunk: int) -> dict[Tier, int]:
    """The engine blocks ``[local, end)`` a run of chunks supplies, per tier: ``tiers[i]`` is
    the tier of chunk ``first + i`` (chunk ``c`` covers blocks ``[c·k, (c+1)·k)``); the local
    hit may end inside the run's first chunk and ``end`` inside its last."""
    per: dict[Tier, int] = {"dram": 0, "nvme": 0, "network": 0}
    k = blocks_per_chunk
    for c, tier in enumerate(tiers, start=first):
        lo, hi = max(c * k, local), min((c + 1) * k, end)
        if hi > lo:
            per[tier] += hi - lo
    return per


def external_hit(
    per: Mapping[Tier, int], async_loads: str, *, tail_tokens: int = 0, tail_tier: Tier = "dram"
) -> ExternalHit:
    """The engine's :class:`ExternalHit` of ``per`` blocks by tier (and ``tail_tokens`` after
    them), loading asynchronously as the connector's ``async_loads`` says: ``auto`` when a
    tier used is not the own node's DRAM, ``always``, or never (a hit of nothing leaves it
    to the engine)."""
    used = [t for t, b in per.items() if b] + ([tail_tier] if tail_tokens else [])
    is_async = async_loads == "always" or (async_loads == "auto" and any(t != "dram" for t in used))
    return ExternalHit(
        per["dram"],
        per["nvme"],
        per["network"],
        async_load=is_async if used else None,
        tail_tokens=tail_tokens,
        tail_tier=tail_tier,
    )


def stored_upto(ev: BlockStored, hashes: Sequence[BlockHash], registered: int) -> int:
    """A request's leading blocks in the engine's prefix cache after ``ev`` (a ``BlockStored``
    of its blocks), ``registered`` before it: the event continues from its parent block,
    which is usually block ``registered - 1`` (else it is found in ``hashes``)."""
    start = registered
    if (ev.parent_block_hash is None) != (start == 0) or (start and hashes[start - 1] != ev.parent_block_hash):
        start = 0 if ev.parent_block_hash is None else hashes.index(ev.parent_block_hash) + 1
    return start + len(ev.block_hashes)


def tail_key(work: Work, hashes: Sequence[BlockHash], chunk_tokens: int) -> ChunkKey | None:
    """The key of a prompt's trailing partial chunk (None: the prompt ends on a chunk
    boundary): like the connector's, it names the exact tokens, here by the prompt's last
    full engine block, its length and its last trace block."""
    n = len(work.tokens)
    if n % chunk_tokens == 0:
        return None
    last = hashes[-1] if hashes else b""
    return ChunkKey(xxhash.xxh3_128_digest(b"kvstore.sim.tail" + last + _TAIL.pack(n, work.hash_ids[-1])))


class Pool:
    """The nodes, one per engine (see the module docstring)."""

    def __init__(
        self,
        nodes: int,
        *,
        dram_chunks: int,
        nvme_chunks: int = 0,
        chunk_tokens: int,
        chunk_bytes: int,
        clock: TraceClock,
        policy: str = DEFAULT_POLICY,
        session_ttl: float = DEFAULT_SESSION_TTL,
    ) -> None:
        if dram_chunks <= 0:
            raise InvalidArgument(f"the pool needs DRAM on its nodes (--node-dram): got {dram_chunks} chunks")
        self.chunk_tokens = chunk_tokens
        self.chunk_bytes = chunk_bytes  # a chunk's KV bytes (the byteless nodes store one unit per chunk)
        self.clock = clock
        self.dram_chunks, self.nvme_chunks = dram_chunks, nvme_chunks
        self.sessions = [Sessions(idle_ttl=session_ttl, clock=clock) for _ in range(nodes)]
        self.nodes: list[TierManager] = [
            build_manager(dram_chunks, policy, nvme_blocks=nvme_chunks, sessions=s) for s in self.sessions
        ]
        self.batch = put_batch(dram_chunks)
        self._holders: dict[ChunkKey, dict[int, None]] = {}
        self.counters: collections.Counter[str] = collections.Counter()

    def close(self) -> None:
        for m in self.nodes:
            m.close()

    def locate(self, node: int, keys: Sequence[ChunkKey]) -> list[tuple[Tier, int]]:
        """The leading run of ``keys`` found anywhere: (tier, node) per key, the own ``node`` first."""
        own = self.nodes[node]
        out: list[tuple[Tier, int]] = []
        for k in keys:
            t = own.where(k)
            if t is not None:
                out.append(("dram" if t == TierKind.DRAM else "nvme", node))
                continue
            other = self._holder(k, node)
            if other is None:
                break
            out.append(("network", other))
        return out

    def match_prefix_locations(self, keys: Sequence[ChunkKey]) -> list[tuple[int, str]]:
        """The cluster's ``match_prefix_locations``: (node, tier name) of each leading key any
        node holds, the first node that stored it (of those that still hold it)."""
        out: list[tuple[int, str]] = []
        for k in keys:
            node = self._holder(k, -1)
            if node is None:
                break
            out.append((node, "nvme" if self.nodes[node].where(k) == TierKind.NVME else "dram"))
        return out

    def _holder(self, key: ChunkKey, but: int) -> int | None:
        holders = self._holders.get(key)
        if not holders:
            return None
        found, gone = None, []
        for j in holders:
            if j == but:
                continue
            if self.nodes[j].where(key) is not None:
                found = j
                break
            gone.append(j)
        for j in gone:
            del holders[j]
        return found

    async def load(
        self,
        node: int,
        keys: Sequence[ChunkKey],
        parents: Sequence[ChunkKey | None],
        where: Sequence[int],
        session: str | None,
        what: str = "load",
    ) -> int:
        """Lease ``keys`` on the nodes ``where`` says, put those of other nodes into the own
        node (with their ``parents``), release; the keys that were gone (misses, counted in
        ``<what>_misses``: a ``load`` or a ``prefetch``)."""
        by_node: dict[int, list[int]] = {}
        for i, j in enumerate(where):
            by_node.setdefault(j, []).append(i)
        misses = 0
        leases: list[tuple[int, list[int]]] = []
        pulled: list[int] = []
        for j, idx in by_node.items():
            self.sessions[j].expire()
            got = await self.nodes[j].acquire([keys[i] for i in idx], session=session)
            ok = []
            for i, x in zip(idx, got):
                if x.status == Status.OK:
                    ok.append(x.lease_id)
                    if j != node:
                        pulled.append(i)
                    else:
                        self.counters["nvme_reads" if x.tier == TierKind.NVME else "dram_reads"] += 1
                else:
                    misses += 1
            leases.append((j, ok))
        if pulled:
            self.counters["remote_pulls"] += len(pulled)
            await self.save(node, [keys[i] for i in pulled], [parents[i] for i in pulled], session)
        for j, ids in leases:
            self.nodes[j].release(ids)
        self.counters[f"{what}_misses"] += misses
        return misses

    async def save(
        self, node: int, keys: Sequence[ChunkKey], parents: Sequence[ChunkKey | None], session: str | None
    ) -> int:
        """Reserve and commit ``keys`` (with their parents; None: the prompt's first chunk) into
        ``node``, in put batches; the chunks committed (not those stored already or refused)."""
        m = self.nodes[node]
        committed = 0
        self.sessions[node].expire()
        for lo in range(0, len(keys), self.batch):
            metas = [
                BlockMeta(NAMESPACE, k, p or NO_PARENT, self.chunk_tokens, "uint8", (1,), 1, 0)
                for k, p in zip(keys[lo : lo + self.batch], parents[lo : lo + self.batch])
            ]
            reserved = await m.reserve(metas, session=session)
            ids = []
            for meta, r in zip(metas, reserved):
                if r.status == Status.OK:
                    ids.append(r.reservation_id)
                    self._holders.setdefault(meta.key, {})[node] = None
                else:
                    self.counters["save_exists" if r.status == Status.EXISTS else "save_refused"] += 1
            if ids:
                done = await m.commit(ids)
                ok = sum(1 for s in done if s == Status.OK)
                self.counters["saved_chunks"] += ok
                committed += ok
        return committed

    def close_session(self, session_id: str) -> None:
        for m in self.nodes:
            m.close_session(session_id)

    def read_back_rows(self, node: int) -> list[dict[str, Any]]:
        """Node ``node``'s read-back counters, as ``KVClient.stats()["read_back"]`` (:func:`read_back_rows`)."""
        return read_back_rows(self.nodes[node])

    def summary(self) -> dict[str, Any]:
        c = self.counters
        totals: collections.Counter[str] = collections.Counter()
        for m in self.nodes:
            totals.update(m.readback.totals())
        return {
            "store_blocks": {
                "dram_reads": c["dram_reads"],
                "nvme_reads": c["nvme_reads"],
                "remote_pulls": c["remote_pulls"],
                # the nodes' read-back accounting (kvstore/node/readback.py), in the chunks' KV
                # bytes: a block stored on a node, and of those read back at least once
                "stored_bytes": totals["stored_blocks"] * self.chunk_bytes,
                "read_back_bytes": totals["read_back_blocks"] * self.chunk_bytes,
            },
            "nodes": {
                "chunk_tokens": self.chunk_tokens,
                "dram_chunks": self.dram_chunks,
                "nvme_chunks": self.nvme_chunks,
                "dram_evictions": sum(m.counters["dram_evictions"] for m in self.nodes),
                "stored_chunks": sum(len(m.dram) for m in self.nodes),
            },
        }


@dataclasses.dataclass(slots=True, eq=False)
class _Req:
    """The connector's view of one request (see the module docstring)."""

    prompt_tokens: int
    hashes: tuple[BlockHash, ...]
    keys: list[ChunkKey]  # its full prompt chunks' keys
    session: str | None
    plan: admission.SavePlan
    outputs: int = 0
    registered: int = 0  # leading blocks in the engine's prefix cache (its hit, then BlockStored)
    saved: int = 0  # leading chunks stored or found stored (the connector's saved_chunks)
    answer: _Answer | None = None  # the last lookup's, for the load that follows
    loaded: bool = False  # the nodes were asked for that load already (an async one, at its start)
    tail: ChunkKey | None = None  # the prompt's partial chunk's key (None: the prompt ends on a chunk boundary)
    tail_saved: bool = False
    handoff: Handoff | None = None  # a consumer's: what its producer saved
    admitted: bool = False  # the engine scheduled it (its loads started): it waits no more


@dataclasses.dataclass(frozen=True, slots=True)
class Handoff:
    """What a producer's ``kv_transfer_params["kvstore"]`` tells the consumer: the leading
    chunks it saved, and whether the prompt's partial chunk too (then the whole prompt)."""

    saved_chunks: int
    whole: bool  # the whole prompt (its partial chunk too, if it has one)
    save_s: float  # its last save's copy and commit: the consumer's wait


@dataclasses.dataclass(frozen=True, slots=True)
class _Answer:
    first: int  # chunk the lookup started at
    found: int  # chunks found from there, before the gate
    keys: tuple[ChunkKey, ...]  # the chunks the hit loads
    parents: tuple[ChunkKey | None, ...]  # theirs (None: the prompt's first chunk)
    nodes: tuple[int, ...]  # where each is
    hit: ExternalHit


class Connector:
    """One engine's connector, scheduler half (see the module docstring): sightings, save
    plans, the load gate and each request's counts."""

    def __init__(
        self,
        engine: int,
        pool: Pool,
        profile: EngineProfile,
        settings: ConnectorSettings,
        *,
        node: int | None = None,
        role: str = "both",
    ) -> None:
        if role not in ROLES:
            raise InvalidArgument(f"unknown connector role {role!r} (known: {', '.join(ROLES)})")
        self.engine, self.pool, self.profile, self.settings = engine, pool, profile, settings
        self.node = engine if node is None else node  # the node it loads and saves through
        self.role = role
        self.produce, self.consume = role != "decode", role != "prefill"
        self.handed: dict[str, Handoff] = {}  # a producer's finished requests, until handed off
        self.expect: dict[str, Handoff] = {}  # a consumer's requests to come, from their producer
        self.bs = profile.block_size
        self.k = pool.chunk_tokens // self.bs  # engine blocks per chunk
        self.sightings = admission.Sightings()
        self.gate = LoadGate(settings.load_gate)
        self._batch = 0  # requests the engine's last step ran
        self.evidence = admission.Evidence()  # save_policy evidence: its node's read-back counters
        self._read_back_at = 0.0  # the next poll of them is due then (virtual seconds)
        self.reqs: dict[str, _Req] = {}
        self.counters: collections.Counter[str] = collections.Counter()
        # prefetch (gpu_agent.vllm.prefetcher): with view lookups, a queued request's chunks on
        # other nodes are pulled into the own node, one pull after the other (its one thread)
        self.prefetching = settings.prefetch and settings.lookups == "view" and self.consume
        self._prefetches: dict[str, tuple[list[ChunkKey], list[ChunkKey | None], list[int], str | None]] = {}
        self._prefetch_free_s = 0.0  # the prefetch thread is busy until then (virtual seconds)

    def arrived(self, req_id: str, work: Work, hashes: tuple[BlockHash, ...]) -> float | None:
        keys = chunk_keys(hashes, self.k)
        tail = tail_key(work, hashes, self.pool.chunk_tokens)
        plan = admission.NOTHING  # a consumer saves nothing
        if self.produce:  # (the connector sights only where it saves: the chunks, then the tail)
            counts = self.sightings.sight(keys + ([tail] if tail is not None else []))
            if self.settings.save_policy == "evidence":  # as the scheduler's _sight plans
                self._poll_read_back()
                per_token = self.gate.recompute.per_token(self.gate.min_samples)
                plan = self.evidence.plan(
                    NAMESPACE,  # the fingerprint its node counts
                    chunks=len(keys),
                    recompute_s=None if per_token is None else per_token * self.pool.chunk_tokens,
                    retain=False,  # the benchmark sends no retain; a session id is no retention hint here
                    producer_only=self.role == "prefill",
                    save_decode=self.settings.save_decode,
                )
            else:
                plan = admission.plan(
                    self.settings.save_policy,
                    counts=counts[: len(keys)],
                    tail_count=counts[-1] if tail is not None else None,
                    hint=work.session_id is not None,
                    producer_only=self.role == "prefill",
                    save_decode=self.settings.save_decode,
                )
        r = self.reqs[req_id] = _Req(len(work.tokens), hashes, keys, work.session_id, plan, tail=tail)
        if self.role == "decode":
            r.handoff = self.expect.pop(req_id, None)
            self.counters["handoffs"] += r.handoff is not None
        return self._prefetch(req_id, r)

    def _prefetch(self, req_id: str, r: _Req) -> float | None:
        """The scheduler's ``_prefetch``: a request arriving behind waiting ones has the full
        chunks the pool holds on other nodes pulled into the own node (at most
        :data:`~gpu_agent.vllm.prefetcher.MAX_QUEUED` pending, one after the other, each
        taking the network's load time of its chunks); the seconds until it lands (None:
        none).  The prompt's partial chunk is left to the load."""
        if not self.prefetching or not any(not x.admitted for x in self.reqs.values() if x is not r):
            return None
        where = self.pool.locate(self.node, r.keys)
        remote = [i for i, (tier, _) in enumerate(where) if tier == "network"]
        if not remote:
            return None
        if len(self._prefetches) >= MAX_QUEUED:
            self.counters["prefetch_skipped"] += 1
            return None
        self._prefetches[req_id] = (
            [r.keys[i] for i in remote],
            [r.keys[i - 1] if i else None for i in remote],
            [where[i][1] for i in remote],
            r.session,
        )
        now = self.pool.clock.now
        pull_s = self.profile.load_s("network", len(remote) * self.pool.chunk_bytes)
        self._prefetch_free_s = max(now, self._prefetch_free_s) + pull_s
        self.counters["prefetches"] += 1
        return self._prefetch_free_s - now

    async def prefetched(self, req_id: str) -> None:
        """A prefetch landed: its chunks are put into the own node (as a load's pull puts them)."""
        keys, parents, nodes, session = self._prefetches.pop(req_id)
        misses = await self.pool.load(self.node, keys, parents, nodes, session, what="prefetch")
        self.counters["prefetch_chunks"] += len(keys) - misses

    def _poll_read_back(self) -> None:
        """The scheduler's ``_poll_read_back`` on the fleet's clock: its node's read-back rows
        into the evidence every ``READ_BACK_EVERY_S`` (answered at once: no RPC here)."""
        now = self.pool.clock.now
        if now >= self._read_back_at:
            self._read_back_at = now + READ_BACK_EVERY_S
            self.evidence.update(self.pool.read_back_rows(self.node))

    def save_s(self, chunks: int) -> float:
        """What saving ``chunks`` chunks costs in the simulation (:meth:`EngineProfile.save_s`)."""
        return self.profile.save_s(chunks * self.pool.chunk_tokens * self.profile.kv_bytes_per_token)

    def lookup_external(self, req_id: str, candidates: Sequence[BlockHash]) -> ExternalHit:
        r = self.reqs[req_id]
        # the engine offers hashes[local : max_hit]; max_hit leaves the last token to compute
        max_hit = len(r.hashes) - (1 if r.prompt_tokens % self.bs == 0 and r.outputs == 0 else 0)
        local = max_hit - len(candidates)
        if not candidates or local < 0 or r.hashes[local] != candidates[0]:
            raise InvalidArgument(f"lookup_external for {req_id!r}: the hashes offered are not its own")
        first = local // self.k
        where = self.pool.locate(self.node, r.keys[first:])
        self.counters["lookups"] += 1
        if r.handoff is not None:  # a producer's handoff loads whatever is there: no gate
            return self._handoff_hit(r, first, local, max_hit, where)
        # every full chunk found: the prompt's partial chunk may follow (keyed by the prompt's
        # exact tokens, so only before any output), as one more chunk of the run
        tail = r.tail if self._tail_may_follow(r, first, where) else None
        got = self.pool.locate(self.node, [tail]) if tail is not None else []
        if got:
            r.tail_saved = True  # the whole prompt is stored, its tail too: never saved again
        run = [*where, *got]
        n = self._gate([_KIND[t] for t, _ in run]) if run else 0
        if n < len(run):
            self.counters["gated_chunks"] += len(run) - n
        if n <= len(where):
            end = min((first + n) * self.k, max_hit)
            per = hit_blocks([t for t, _ in where[:n]], first, local, end, self.k)
            return self._answer(r, first, len(where), where[:n], per, 0, "dram")
        assert tail is not None
        tier, node = got[0]
        return self._with_tail(r, first, local, max_hit, where, tier, (tail, node))

    def _tail_may_follow(self, r: _Req, first: int, where: Sequence[tuple[Tier, int]]) -> bool:
        """Whether a lookup asks for the prompt's partial chunk: it has one, the run found
        every full chunk, and the request has no output yet (its tokens are the prompt)."""
        return r.tail is not None and r.outputs == 0 and first + len(where) == len(r.keys)

    def _with_tail(
        self,
        r: _Req,
        first: int,
        local: int,
        max_hit: int,
        where: Sequence[tuple[Tier, int]],
        tier: Tier,
        tail: tuple[ChunkKey, int],
    ) -> ExternalHit:
        """The hit of every full chunk found and the prompt's partial chunk (on ``tier``):
        the blocks to ``max_hit``, and the tokens of the last one up to the prompt's last
        token less one (vLLM computes that one), as the connector loads them."""
        per = hit_blocks([t for t, _ in where], first, local, max_hit, self.k)
        per[tier] += max(0, max_hit - max(len(r.keys) * self.k, local))
        tail_tokens = 0
        if local + sum(per.values()) == max_hit:
            tail_tokens = max(0, r.prompt_tokens - 1 - max_hit * self.bs)
        return self._answer(r, first, len(where), where, per, tail_tokens, tier, tail)

    def _answer(
        self,
        r: _Req,
        first: int,
        found: int,
        where: Sequence[tuple[Tier, int]],
        per: dict[Tier, int],
        tail_tokens: int,
        tail_tier: Tier,
        tail: tuple[ChunkKey, int] | None = None,
    ) -> ExternalHit:
        """The hit of ``per`` blocks by tier (and ``tail_tokens`` after them), loading the
        chunks from ``first`` that ``where`` locates (and ``tail``: the partial chunk's key
        and node), kept for the load."""
        hit = external_hit(per, self.settings.async_loads, tail_tokens=tail_tokens, tail_tier=tail_tier)
        if not hit.empty:
            n = len(where)
            keys = r.keys[first : first + n]
            parents = [r.keys[c - 1] if c else None for c in range(first, first + n)]
            nodes = [j for _, j in where]
            if tail is not None:
                keys, parents, nodes = [*keys, tail[0]], [*parents, r.keys[-1] if r.keys else None], [*nodes, tail[1]]
            r.answer = _Answer(first, found, tuple(keys), tuple(parents), tuple(nodes), hit)
        else:
            r.answer = _Answer(first, found, (), (), (), hit)
        return hit

    def _handoff_hit(self, r: _Req, first: int, local: int, max_hit: int, where: list[tuple[Tier, int]]) -> ExternalHit:
        """A consumer's lookup of what its producer saved: every chunk found, then (when the
        producer saved the whole prompt and all of its full chunks are found) the partial
        chunk, and the tokens up to the prompt's last less one, as the connector loads them
        (token by token, not whole blocks).  Less found than the producer saved counts in
        ``handoff_short`` (the live connector would wait up to ``deadline_s`` first)."""
        h = r.handoff
        assert h is not None
        found = first + len(where)
        want = r.prompt_tokens if h.whole else h.saved_chunks * self.pool.chunk_tokens
        per = hit_blocks([t for t, _ in where], first, local, max_hit, self.k)
        last: Tier = where[-1][0] if where else "dram"
        tail: tuple[ChunkKey, int] | None = None
        whole = found == len(r.keys)  # every full chunk: the blocks up to the prompt's end may follow
        if whole and r.tail is not None:
            got = self.pool.locate(self.node, [r.tail]) if h.whole else []
            if got:
                last, node = got[0]
                tail = (r.tail, node)
                per[last] += max(0, max_hit - max(len(r.keys) * self.k, local))
            whole = bool(got)
        found_tokens = r.prompt_tokens if whole else found * self.pool.chunk_tokens
        if found_tokens < want:
            self.counters["handoff_short"] += 1
        tail_tokens = 0
        blocks: int = sum(per.values())
        if whole and blocks and local + blocks == max_hit:
            # vLLM computes the last token: the prompt's own, or past it (a resumed request's
            # last token is an output, which is not in the pool)
            end = r.prompt_tokens - (0 if r.outputs else 1)
            tail_tokens = max(0, end - max_hit * self.bs)
        return self._answer(r, first, len(where), where, per, tail_tokens, last, tail)

    def _gate(self, kinds: list[str]) -> int:
        """Leading chunks worth loading at the engine's batch (the last step's requests and
        this one), as the connector's scheduler half weighs them."""
        return self.gate.leading(
            kinds, self.k * self.bs, batch=self._batch + 1, background=background_kinds(self.settings.async_loads)
        )

    # -- the fleet's calls ------------------------------------------------------------------
    async def step_started(self, res: StepResult) -> None:
        self._batch = len(res.scheduled)
        for rid in res.preempted:
            r = self.reqs[rid]
            r.registered = r.saved = 0
            r.answer, r.loaded = None, False
        for a in res.loads_started:
            r = self.reqs[a.req_id]
            r.admitted = True
            await self._load(r, a.external_tokens)
        for a in res.admitted:
            r = self.reqs[a.req_id]
            r.admitted = True
            if not r.loaded:
                await self._load(r, a.external_tokens)
            r.registered = (a.cached_tokens - a.external_tokens) // self.bs
            r.answer, r.loaded = None, False

    async def _load(self, r: _Req, external_tokens: int) -> None:
        """The nodes' side of the hit the engine took: its last lookup's answer, unless the
        engine took none (no lookup: its local hit left nothing to ask for)."""
        ans = r.answer
        r.loaded = True
        if ans is None or ans.hit.tokens(self.bs) != external_tokens:
            return
        if ans.first == 0:  # stored already: never saved again
            r.saved = max(r.saved, ans.found)
        if not ans.keys:
            return
        self.counters["loads"] += 1
        self.counters["async_loads"] += bool(ans.hit.async_load)
        await self.pool.load(self.node, ans.keys, ans.parents, ans.nodes, r.session)
        data: dict[str, float] = {}
        for tier in TIERS:
            tokens = getattr(ans.hit, tier) * self.bs + (ans.hit.tail_tokens if tier == ans.hit.tail_tier else 0)
            if tokens:
                kind = _KIND[tier]
                data[f"load_{kind}_us"] = self.profile.load_s(tier, tokens * self.profile.kv_bytes_per_token) * 1e6
                data[f"load_{kind}_tokens"] = tokens
                data[f"load_{kind}_n"] = 1
        self.gate.observe(data)

    async def step_ended(self, res: StepResult) -> None:
        if res.prefill_tokens >= PREFILL_STEP_TOKENS:
            self.gate.observe(
                {"prefill_step_us": (res.step_time_s - res.load_s) * 1e6, "prefill_step_tokens": res.num_tokens}
            )
        touched: dict[str, _Req] = {}
        for ev in res.kv_events:
            if not isinstance(ev, BlockStored):
                continue
            r = self.reqs.get(ev.req_id)
            if r is None:
                continue
            r.registered = stored_upto(ev, r.hashes, r.registered)
            touched[ev.req_id] = r
        written: collections.Counter[str] = collections.Counter()  # chunks this step committed, by request
        for rid, r in touched.items() if self.produce else ():
            limit = min(r.registered // self.k, r.plan.prompt_chunks, len(r.keys))
            if limit > r.saved:
                lo = r.saved
                written[rid] += await self.pool.save(
                    self.node, r.keys[lo:limit], [r.keys[c - 1] if c else None for c in range(lo, limit)], r.session
                )
                r.saved = limit
        for o in res.outputs:
            r = self.reqs[o.req_id]
            if self.produce and o.first_token:
                await self._save_tail(o.req_id, r, written)
            if not o.finished:
                r.outputs = o.output_tokens
                continue
            del self.reqs[o.req_id]
            if self.produce and r.plan.limited:  # the connector's skipped_save_chunks
                self.counters["skipped_save_chunks"] += max(0, r.prompt_tokens // self.pool.chunk_tokens - r.saved)
            if self.role == "prefill":  # its answer's kv_transfer_params
                whole = r.saved == len(r.keys) and (r.tail is None or r.tail_saved)
                self.handed[o.req_id] = Handoff(r.saved, whole, self.save_s(written[o.req_id]))
        if written:  # the workers' save timings of this step, one save per request: what a store must beat
            save_s = sum(self.save_s(n) for n in written.values() if n)
            self.evidence.observe({"save_us": save_s * 1e6, "save_chunks": sum(written.values())})

    async def _save_tail(self, req_id: str, r: _Req, written: collections.Counter[str]) -> None:
        """A producer's request computed its whole prompt: its partial chunk is saved once every
        full chunk is (the connector keys it by its exact tokens)."""
        if r.tail is None or r.tail_saved or not r.plan.tail or r.saved < len(r.keys):
            return
        r.tail_saved = True
        written[req_id] += await self.pool.save(self.node, [r.tail], [r.keys[-1] if r.keys else None], r.session)


def node_of(engines: int, nodes: int | None = None) -> list[int]:
    """Each engine's node: its own (``nodes`` None), else ``e * nodes // engines``."""
    if nodes is None:
        return list(range(engines))
    if isinstance(nodes, bool) or not 1 <= nodes <= engines:
        raise InvalidArgument(f"--nodes must be between 1 and --engines ({engines}), got {nodes}")
    return [e * nodes // engines for e in range(engines)]


class PoolHooks:
    """The ``pool`` configuration's :class:`kvstore.sim.fleet.Hooks`: a :class:`Pool` of one
    node per engine (or ``nodes`` shared, see :func:`node_of`) and a :class:`Connector` per
    engine, each of its engine's role (``roles``, default every one ``both``; ``pd``: the
    fleet's :func:`kvstore.sim.fleet.roles`)."""

    def __init__(
        self,
        profile: EngineProfile,
        engines: int,
        *,
        nodes: int | None = None,
        node_dram: int,
        node_nvme: int = 0,
        clock: TraceClock,
        settings: ConnectorSettings | None = None,
        policy: str = DEFAULT_POLICY,
        roles: Sequence[str] | None = None,
    ) -> None:
        self.settings = settings or ConnectorSettings()
        roles = list(roles) if roles is not None else ["both"] * engines
        if len(roles) != engines:
            raise InvalidArgument(f"{len(roles)} roles for {engines} engines")
        chunk = chunk_tokens(profile, self.settings)
        chunk_bytes = chunk * profile.kv_bytes_per_token
        self.node_of = node_of(engines, nodes)
        self.pool = Pool(
            max(self.node_of) + 1,
            dram_chunks=chunks_of(node_dram, chunk_bytes, "--node-dram"),
            nvme_chunks=chunks_of(node_nvme, chunk_bytes, "--node-nvme"),
            chunk_tokens=chunk,
            chunk_bytes=chunk_bytes,
            clock=clock,
            policy=policy,
        )
        self.connectors = [
            Connector(i, self.pool, profile, self.settings, node=self.node_of[i], role=roles[i]) for i in range(engines)
        ]

    def lookup_for(self, engine: int) -> LookupExternal | None:
        c = self.connectors[engine]
        return c.lookup_external if c.consume else None

    def handoff(self, prefill: int, decode: int, req_id: str) -> float:
        """The producer's :class:`Handoff` goes to the consumer (its ``kv_transfer_params``);
        the consumer gets the request once the producer's last save is committed."""
        h = self.connectors[prefill].handed.pop(req_id)
        self.connectors[decode].expect[req_id] = h
        return h.save_s

    def arrived(self, engine: int, req_id: str, work: Work, hashes: tuple[BlockHash, ...]) -> float | None:
        return self.connectors[engine].arrived(req_id, work, hashes)

    async def prefetched(self, engine: int, req_id: str) -> None:
        await self.connectors[engine].prefetched(req_id)

    async def step_started(self, engine: int, result: StepResult) -> None:
        await self.connectors[engine].step_started(result)

    async def step_ended(self, engine: int, result: StepResult) -> None:
        await self.connectors[engine].step_ended(result)

    def close_session(self, session_id: str) -> None:
        self.pool.close_session(session_id)

    def close(self) -> None:
        self.pool.close()

    def summary(self) -> dict[str, Any]:
        out = self.pool.summary()
        total: collections.Counter[str] = collections.Counter()
        for c in self.connectors:
            total.update(c.counters)
        out["connector"] = {
            **{k: total[k] for k in ("lookups", "loads", "async_loads", "gated_chunks")},
            **({k: total[k] for k in ("handoffs", "handoff_short")} if total["handoffs"] else {}),
            **{k: self.pool.counters[k] for k in ("saved_chunks", "save_exists", "save_refused", "load_misses")},
            "skipped_save_chunks": total["skipped_save_chunks"],
            **{k: total[k] for k in ("prefetches", "prefetch_chunks", "prefetch_skipped")},
            "prefetch_misses": self.pool.counters["prefetch_misses"],
        }
        return out

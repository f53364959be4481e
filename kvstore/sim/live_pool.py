"""A mock engine's link to a real kvstore node: the ``pool`` configuration of ``kvstore sim
serve`` (``--kv-node``), moving scaled-down KV through real nodes in real time.

The engine model (:class:`~kvstore.sim.engine.EngineModel`) decides what a request hits
and how long its steps take, from its profile; this link makes the pool behind those
decisions real: the nodes, their eviction and tiers, the pool's view (``WatchHoldings``)
and the SDK's calls all run as they do for vLLM engines, on bytes scaled down by
``--kv-scale`` so that dozens of engines' KV fits one small machine.

* **Chunks** are keyed as the kvstore connector keys them: :func:`kvstore.keys.chunk_keys`
  over the prompt's token ids, in a :class:`~kvstore.keys.Namespace` of the served model,
  the chunk size and the scale (:func:`namespace`; engines of another scale never share a
  chunk).  The chunk is the connector's default, ``ConnectorSettings().chunk_for(block
  size)`` (:func:`kvstore.sim.pool.chunk_tokens`), so chunk ``c`` covers engine blocks
  ``[c·k, (c+1)·k)``.  Only full chunks are keyed.  A chunk's bytes are
  ``kv_bytes_per_token × chunk tokens ÷ kv_scale`` (at least :data:`MIN_CHUNK_BYTES`), a
  deterministic :func:`payload` of its key, so every load checks what it got.
* **Lookups** (:meth:`PoolLink.lookup_external`, the model's ``lookup_external`` hook, on
  the engine's loop): the request's chunks from the one holding the first block after the
  local hit, matched in-process against a :class:`client.PoolView` (``--kv-view``: the
  cluster's ``etcd://`` membership, or node targets; default the own node); each chunk
  held on the own node is a ``dram`` or ``nvme`` hit, one held elsewhere ``network``.  The
  blocks and the :class:`~kvstore.sim.engine.ExternalHit` come from the virtual-time
  simulator's own mapping (:func:`kvstore.sim.pool.hit_blocks`,
  :func:`kvstore.sim.pool.external_hit`, with the connector's ``async_loads`` ``auto``).
  No load gate and no lookup latency: the answer is immediate.
* **Loads** (:meth:`PoolLink.step_started`): when the model starts a request's load (an
  asynchronous one) or admits it with a hit, the hit's chunks held on other nodes are
  pulled into the own node (read through the cluster client, or the holder's own client,
  and put), then all of them are read from the own node and compared with their payload.
  The first chunk missing or wrong ends the load: the rest of the hit is a miss
  (``load_errors``, in engine blocks; ``view_stale_hits``, one per such load).  The step
  time stays the profile's; the transfer runs beside it on the link's threads, so the
  nodes, their eviction and the view are exercised, not the engine's timing.
* **Saves** (:meth:`PoolLink.step_ended`): the step's ``BlockStored`` events say how many
  leading blocks of each request the engine's prefix cache holds
  (:func:`kvstore.sim.pool.stored_upto`); every full chunk among them not yet saved (nor
  found by the lookup, nor inside the engine's own local hit) is put into the own node: the
  connector's save policy ``always``, not its default ``evidence``.
* **Faults**: every call has the client's deadlines (``--kv-deadline``).  A call to the own
  node that fails marks it down for :data:`DOWN_S`: meanwhile lookups answer nothing, loads
  are misses and saves are dropped (``saves_dropped``).  A node that dies leaves the view
  after its ``node_deadline_s``; until then its chunks are misses at load time.  Work
  beyond :data:`MAX_PENDING` queued calls is dropped the same way.  Nothing a node does
  fails a request or stops the engine.

Counters (:data:`COUNTERS`) are the connector's names and meanings where it has them,
exported as ``vllm:kvstore_<name>_total`` (:meth:`PoolLink.collector`): what
``kvstore bench serving`` reads (``load_tokens`` for ``prompt_tokens.store``,
``pulled_blocks`` for ``store_blocks.remote_pulls``).

State: the loop thread (the engine's) alone owns the per-request records (``_reqs``) and
calls every public method but :meth:`PoolLink.close`; the link's worker threads own
nothing but their calls' results, and write only the counters (under ``_lock``), the
pending count (under ``_lock``) and ``_down_until`` (one float).  The view, the clients
and the executor belong to the link; :meth:`PoolLink.close` stops them (bounded).
Invariants: a request's ``saved`` chunks never exceed its full chunks; a load reads only
the chunks of the hit the model took (its answer's ``hit`` has the model's token count);
the counters only grow.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from client import ClientOptions, KVClient, PoolView, Timeouts
from gpu_agent.vllm.settings import ConnectorSettings
from kvstore.errors import InvalidArgument
from kvstore.keys import NO_PARENT, ChunkKey, Namespace, chunk_keys
from kvstore.sim.engine import BlockHash, BlockStored, ExternalHit, StepResult
from kvstore.sim.pool import chunk_tokens, external_hit, hit_blocks, stored_upto
from kvstore.sim.profile import EngineProfile, Tier
from kvstore.vocabulary import TierKind

log = logging.getLogger("kvstore.sim.pool")

MIN_CHUNK_BYTES = 64
"""The least bytes a scaled chunk has (a payload still names its key)."""
DOWN_S = 1.0
"""How long the own node counts as down after a failed call (then it is tried again)."""
MAX_PENDING = 256
"""Loads and saves queued or running at most; beyond, loads miss and saves are dropped."""
DEFAULT_DEADLINE_S = 2.0

COUNTERS: dict[str, str] = {
    "view_lookups": "Scheduler asks answered from the pool's in-process view.",
    "hit_tokens": "Prompt tokens the pool's view promised (the model's external hits).",
    "async_loads": "Hits the engine loaded in the background (WAITING_FOR_REMOTE_KVS).",
    "loads": "Loads from kvstore started.",
    "load_tokens": "Tokens whose scaled-down KV was read from the own node and checked.",
    "load_errors": "Engine blocks of a hit that did not load (a chunk gone, wrong or unreachable).",
    "view_stale_hits": "Loads that found fewer chunks than the view promised.",
    "load_mismatches": "Chunks read whose bytes were not their key's payload.",
    "pulled_blocks": "Chunks fetched from other kvstore nodes into the own one.",
    "saves": "Saves into kvstore (one per request and step).",
    "save_chunks": "Chunks put into the own node (stored, or stored already).",
    "save_refused": "Chunks the own node had no room for.",
    "saves_dropped": "Chunks not saved: the own node was down or the link too far behind.",
    "lookups_node_down": "Lookups answered nothing because the own node was down.",
    "node_errors": "Calls to the own node that failed (it was marked down for a while).",
}


def chunk_bytes(profile: EngineProfile, chunk: int, kv_scale: int) -> int:
    """A chunk's scaled-down bytes: the profile's KV bytes per token × ``chunk`` tokens ÷
    ``kv_scale``, at least :data:`MIN_CHUNK_BYTES`."""
    if isinstance(kv_scale, bool) or kv_scale < 1:
        raise InvalidArgument(f"--kv-scale must be a whole number of at least 1, got {kv_scale}")
    return max(MIN_CHUNK_BYTES, profile.kv_bytes_per_token * chunk // kv_scale)


def namespace(model: str, chunk: int, kv_scale: int) -> Namespace:
    """The namespace a mock engine keys its chunks in (model, chunk size and scale)."""
    return Namespace(model_id=f"kvstore-sim/{model}", model_revision=f"kv-scale-{kv_scale}", chunk_tokens=chunk)


def payload(key: bytes, nbytes: int) -> bytes:
    """The deterministic bytes of the chunk ``key``: the key repeated, cut to ``nbytes``."""
    return (bytes(key) * (nbytes // len(key) + 1))[:nbytes]


@dataclasses.dataclass(frozen=True, slots=True)
class LinkSettings:
    """``node``: the engine's own node (``unix://...`` or ``host:port``); ``view``: what the
    pool's view follows (an ``etcd://HOST:PORT/CLUSTER`` target, or node targets; empty:
    the own node); ``kv_scale``: bytes are divided by it; ``deadline_s``: each call's
    deadline; ``async_loads``: the connector's setting (``auto``, ``always``, ``never``)."""

    node: str
    view: str | tuple[str, ...] = ()
    kv_scale: int = 1
    deadline_s: float = DEFAULT_DEADLINE_S
    async_loads: str = "auto"

    def __post_init__(self) -> None:
        if not self.node:
            raise InvalidArgument("the pool link needs the engine's own node (--kv-node)")
        if not self.deadline_s > 0:
            raise InvalidArgument(f"--kv-deadline must be positive, got {self.deadline_s}")
        if self.async_loads not in ("auto", "always", "never"):
            raise InvalidArgument(f"async_loads must be auto, always or never, got {self.async_loads!r}")

    @property
    def view_nodes(self) -> str | list[str]:
        if isinstance(self.view, str):
            return self.view
        return list(self.view) or [self.node]


@dataclasses.dataclass(frozen=True, slots=True)
class _Answer:
    """A lookup's hit, kept for the load that follows it."""

    first: int  # the first chunk of the hit
    local: int  # engine blocks of the local hit
    end: int  # the hit's end, in engine blocks
    keys: tuple[ChunkKey, ...]  # chunks first.. covering [local, end)
    parents: tuple[ChunkKey, ...]
    holders: tuple[str | None, ...]  # the node holding each (None: the own node)
    hit: ExternalHit


@dataclasses.dataclass(slots=True, eq=False)
class _Req:
    hashes: tuple[BlockHash, ...]
    keys: list[ChunkKey]  # its full chunks' keys
    registered: int = 0  # leading blocks in the engine's prefix cache
    saved: int = 0  # leading chunks saved, or known held (found, or inside its local hit)
    answer: _Answer | None = None


class PoolLink:
    """One mock engine's link to its kvstore node and the pool's view (module docstring)."""

    def __init__(self, profile: EngineProfile, model: str, settings: LinkSettings) -> None:
        self.profile = profile
        self.settings = settings
        self.bs = profile.block_size
        self.chunk_tokens = chunk_tokens(profile, ConnectorSettings())
        self.k = self.chunk_tokens // self.bs  # engine blocks per chunk
        self.chunk_bytes = chunk_bytes(profile, self.chunk_tokens, settings.kv_scale)
        self.namespace = namespace(model, self.chunk_tokens, settings.kv_scale)
        d = settings.deadline_s
        self._options = ClientOptions(timeouts=Timeouts(rpc=d, data=d, connect=d))
        self._cluster = isinstance(settings.view, str) and settings.view.startswith("etcd://")
        self.view = PoolView(settings.view_nodes, self._options, wait_s=0.0)
        self._own: str | None = None
        self._reqs: dict[str, _Req] = {}
        self._lock = threading.Lock()
        self._counts: collections.Counter[str] = collections.Counter()
        self._pending = 0
        self._down_until = 0.0
        self._clients: dict[str, Any] = {}  # target (or the cluster's) -> client; made on worker threads
        self._clients_lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvstore-sim-pool")
        self._closed = False

    # -- the engine's calls (its loop thread) ---------------------------------------------
    def arrived(self, req_id: str, tokens: Sequence[int], hashes: tuple[BlockHash, ...]) -> None:
        """A request entered the engine: its chunks are keyed now."""
        self._reqs[req_id] = _Req(hashes, chunk_keys(tokens, self.namespace))

    def forget(self, req_id: str) -> None:
        """The request finished or was aborted."""
        self._reqs.pop(req_id, None)

    def lookup_external(self, req_id: str, candidates: Sequence[BlockHash]) -> ExternalHit:
        """The model's hook: the leading chunks after the local hit the view says the pool
        holds, as engine blocks per tier (the module docstring)."""
        r = self._reqs.get(req_id)
        if r is None or not candidates:
            return ExternalHit()
        local = r.hashes.index(candidates[0])
        max_hit = local + len(candidates)
        r.answer = None
        first = local // self.k
        keys = r.keys[first:]
        if not keys:
            return ExternalHit()
        if self.down:
            self._count(lookups_node_down=1)
            return ExternalHit()
        m = self.view.match(keys)
        self._count(view_lookups=1)
        own = self._own_node()
        holders = [None if h.node == own else h.node for h in m.holders[: m.hits]]
        tiers: list[Tier] = [
            ("dram" if h.tier == TierKind.DRAM else "nvme") if who is None else "network"
            for h, who in zip(m.holders, holders)
        ]
        end = min((first + m.hits) * self.k, max_hit)
        hit = external_hit(hit_blocks(tiers, first, local, end, self.k), self.settings.async_loads)
        if hit.empty:
            return hit
        last = -(-end // self.k)  # the chunks first..last-1 cover the hit
        parents = [r.keys[c - 1] if c else NO_PARENT for c in range(first, last)]
        r.answer = _Answer(
            first, local, end, tuple(r.keys[first:last]), tuple(parents), tuple(holders[: last - first]), hit
        )
        return hit

    def step_started(self, res: StepResult) -> None:
        """A step began: preempted requests start over, and the loads it starts or admits run."""
        for rid in res.preempted:
            r = self._reqs.get(rid)
            if r is not None:
                r.registered, r.answer = 0, None
        for a in res.loads_started:
            self._load(a.req_id, a.external_tokens)
        for a in res.admitted:
            self._load(a.req_id, a.external_tokens)
            r = self._reqs.get(a.req_id)
            if r is None:
                continue
            local = (a.cached_tokens - a.external_tokens) // self.bs
            r.registered = local
            r.saved = max(r.saved, min(local // self.k, len(r.keys)))  # its own engine saved those

    def step_ended(self, res: StepResult) -> None:
        """A step's blocks are computed: the full chunks they complete are saved."""
        touched: dict[str, _Req] = {}
        for ev in res.kv_events:
            if isinstance(ev, BlockStored) and (r := self._reqs.get(ev.req_id)) is not None:
                r.registered = stored_upto(ev, r.hashes, r.registered)
                touched[ev.req_id] = r
        for r in touched.values():
            limit = min(r.registered // self.k, len(r.keys))
            if limit <= r.saved:
                continue
            lo, r.saved = r.saved, limit
            keys = r.keys[lo:limit]
            parents = [r.keys[c - 1] if c else NO_PARENT for c in range(lo, limit)]
            if not self._submit(self._save, keys, parents):
                self._count(saves_dropped=len(keys))

    # -- loads and saves (the link's threads) ---------------------------------------------
    def _load(self, req_id: str, external_tokens: int) -> None:
        r = self._reqs.get(req_id)
        ans = r.answer if r is not None else None
        if r is None or ans is None or ans.hit.tokens(self.bs) != external_tokens:
            return  # no hit, or not the one the model took (it asked again since)
        r.answer = None
        r.saved = max(r.saved, ans.first + len(ans.keys))  # held in the pool already
        self._count(hit_tokens=external_tokens, async_loads=int(bool(ans.hit.async_load)))
        if not self._submit(self._fetch, ans):
            self._missed(ans, 0)

    def _fetch(self, ans: _Answer) -> None:
        """Pull the hit's chunks held elsewhere into the own node, read them all from it and
        check them; count what loaded and what missed."""
        ok = 0
        try:
            remote = [i for i, h in enumerate(ans.holders) if h is not None]
            if remote:
                self._pull(ans, remote)
            got = self._client(self.settings.node).get_many(list(ans.keys))
        except Exception as e:  # a node's failure is a miss, never the engine's
            self._node_failed("a load", e)
        else:
            for key, data in zip(ans.keys, got):
                if data is None:
                    break
                if data != payload(key, self.chunk_bytes):
                    self._count(load_mismatches=1)
                    break
                ok += 1
        self._missed(ans, ok)

    def _missed(self, ans: _Answer, ok: int) -> None:
        """A load of ``ans`` whose first ``ok`` chunks arrived: the counters."""
        loaded_to = max(ans.local, min(ans.end, (ans.first + ok) * self.k))
        missed = ans.end - loaded_to
        self._count(
            loads=1,
            load_tokens=(loaded_to - ans.local) * self.bs,
            load_errors=missed,
            view_stale_hits=int(missed > 0),
        )

    def _pull(self, ans: _Answer, remote: list[int]) -> None:
        """The chunks ``remote`` (indexes into the hit) from their holders into the own node;
        a chunk that cannot be had stays missing (the load stops there)."""
        cluster = self.settings.view if isinstance(self.settings.view, str) and self._cluster else None
        by_source: dict[str, list[int]] = {}
        for i in remote:
            holder = ans.holders[i]
            assert holder is not None
            by_source.setdefault(cluster or holder, []).append(i)  # the cluster client finds any holder
        have: list[int] = []
        for source, idx in by_source.items():
            try:
                got = self._client(source).get_many([ans.keys[i] for i in idx])
            except Exception as e:  # another node's failure: those chunks miss
                log.debug("pulling %d chunks from %s failed: %s", len(idx), source, e)
                continue
            have += [i for i, d in zip(idx, got) if d is not None and d == payload(ans.keys[i], self.chunk_bytes)]
        if have:
            have.sort()
            ok = self._client(self.settings.node).put_many(
                [ans.keys[i] for i in have],
                [payload(ans.keys[i], self.chunk_bytes) for i in have],
                namespace=self.namespace,
                parents=[ans.parents[i] for i in have],
                token_counts=[self.chunk_tokens] * len(have),
            )
            self._count(pulled_blocks=sum(ok))

    def _save(self, keys: list[ChunkKey], parents: list[ChunkKey]) -> None:
        try:
            ok = self._client(self.settings.node).put_many(
                keys,
                [payload(k, self.chunk_bytes) for k in keys],
                namespace=self.namespace,
                parents=parents,
                token_counts=[self.chunk_tokens] * len(keys),
            )
        except Exception as e:  # a node's failure is a dropped save, never the engine's
            self._node_failed("a save", e)
            self._count(saves_dropped=len(keys))
            return
        self._count(saves=1, save_chunks=sum(ok), save_refused=len(ok) - sum(ok))

    def _submit(self, fn: Callable[..., None], *args: Any) -> bool:
        """Run ``fn`` on the link's threads; False (not run) when the own node is down, the
        link is closed or :data:`MAX_PENDING` calls wait already."""
        with self._lock:
            if self._closed or self.down or self._pending >= MAX_PENDING:
                return False
            self._pending += 1

        def run() -> None:
            try:
                fn(*args)
            except Exception:  # counted where it happened; never kills a thread
                log.exception("the pool link's %s failed", getattr(fn, "__name__", fn))

        def done(_: concurrent.futures.Future[None]) -> None:  # run, or cancelled by close()
            with self._lock:
                self._pending -= 1

        try:
            fut = self._pool.submit(run)
        except RuntimeError:  # shut down meanwhile
            with self._lock:
                self._pending -= 1
            return False
        fut.add_done_callback(done)
        return True

    def _client(self, target: str) -> Any:
        """The client of ``target`` (a node, or the cluster's ``etcd://``), made on first use."""
        with self._clients_lock:
            c = self._clients.get(target)
            if c is None:
                if target.startswith("etcd://"):
                    from client import connect

                    c = connect(target, self._options, wait_s=self.settings.deadline_s, max_workers=4)
                else:
                    c = KVClient(target, self._options)
                self._clients[target] = c
            return c

    def _node_failed(self, what: str, e: BaseException) -> None:
        if not self.down:
            log.warning("kvstore node %s failed %s (%s): misses for %.1f s", self.settings.node, what, e, DOWN_S)
        self._down_until = time.monotonic() + DOWN_S
        self._count(node_errors=1)

    # -- state ------------------------------------------------------------------------------
    @property
    def down(self) -> bool:
        """The own node failed a call less than :data:`DOWN_S` ago."""
        return time.monotonic() < self._down_until

    def _own_node(self) -> str | None:
        if self._own is None:
            self._own = self.view.node_for(self.settings.node)
        return self._own

    def _count(self, **n: int) -> None:
        with self._lock:
            self._counts.update(n)

    def counters(self) -> dict[str, int]:
        """Every counter of :data:`COUNTERS` now."""
        with self._lock:
            return {k: self._counts[k] for k in COUNTERS}

    def idle(self) -> bool:
        """No load or save queued or running."""
        with self._lock:
            return self._pending == 0

    def collector(self, labels: dict[str, str]) -> Any:
        """A Prometheus collector of the counters, as ``vllm:kvstore_<name>_total`` with ``labels``."""
        from prometheus_client.core import CounterMetricFamily
        from prometheus_client.registry import Collector

        link = self

        class _Collector(Collector):
            def collect(self) -> Iterator[CounterMetricFamily]:
                counts = link.counters()
                for name, doc in COUNTERS.items():
                    fam = CounterMetricFamily(f"vllm:kvstore_{name}", doc, labels=list(labels))
                    fam.add_metric(list(labels.values()), counts[name])
                    yield fam

        return _Collector()

    def close(self, timeout: float | None = None) -> None:
        """Stop: queued calls are dropped, running ones end within their deadlines (waited
        for up to ``timeout``, default twice the deadline), the view and clients close."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        wait = 2 * self.settings.deadline_s if timeout is None else timeout
        deadline = time.monotonic() + wait
        while not self.idle() and time.monotonic() < deadline:
            time.sleep(0.01)
        self.view.close()
        with self._clients_lock:
            clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            try:
                c.close()
            except Exception:  # closing what may be broken
                log.debug("closing a client failed", exc_info=True)

"""The connector's worker half: moves KV bytes through one GPU agent (worker process only).

Each worker learns the engine's page geometry from the registered tensors
(``gpu_agent.buffers``) and keys its own tensor/pipeline shard (its rank is in every key's
namespace).  Loads are queued in ``start_load_kv`` and waited on per layer; saves run in
``wait_for_save`` (when it returns, the pages may be reused: the agent's save fence).
A load the scheduler marked ``async_load`` (its request waits in vLLM's
``WAITING_FOR_REMOTE_KVS``; nothing reads its pages) runs on the loader thread — remote
pull, lease (the node promotes NVMe blocks), copy — while the engine keeps stepping, and is
reported by ``get_finished`` once it ended, its failed blocks in the same step.
A block that is gone, fails its checksum or whose lease lapsed is reported through
``get_block_ids_with_load_errors``, so vLLM recomputes it: wrong KV is never kept.

Saves never hold a step where the agent copies on the host (CPU engines): ``wait_for_save``
hands each save to the saver thread (``kvstore-save``: Reserve, copy and checksum, then
the agent's commit) and returns.  vLLM's contract needs the pages unchanged only until
they are copied: a finished request's pages are held (``request_finished`` → True) until
``get_finished`` reports its saves ended, and a preempted request's, which vLLM frees at
once, are protected by cancelling its saves in ``handle_preemptions`` before the step
that may rewrite them (:class:`~gpu_agent.agent.SaveGuard`: a copy not ended by then is
aborted, never committed).  At most ``MAX_QUEUED_SAVES`` wait for the saver; past that a
save is dropped (a future miss, counted), never a step held.  On CUDA the agent's save
only queues copies on its stream, so it is called on the step as before.

Every connector call of a step is timed (``gpu_agent.vllm.stats``: ``load_wait``,
``save_wait``, ``step_wait``), and so is the forward pass of steps that prefill, with
every load per kind of chunk: the scheduler's load gate compares the two.

State it owns: the agent (dropped after a store failure and attached afresh after
``retry_s``), the loads of the current step, and per request the saves in flight.
Invariant: every save the scheduler sent is recorded, started or not (a node that is down
is a save that did nothing), so a request the scheduler holds for its saves is reported
by ``get_finished`` exactly once, after its last save ended.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_events import KVCacheEvent

from gpu_agent.vllm.events import KVStoreEvents, stored_event
from gpu_agent.vllm.gate import PREFILL_STEP_TOKENS
from gpu_agent.vllm.metadata import KVStoreMeta, LoadSpec, SaveSpec
from gpu_agent.vllm.settings import ConnectorSettings
from gpu_agent.vllm.spec import EngineSpec, engine_spec, rank_namespace, worker_ranks
from gpu_agent.vllm.stats import WORKER_KEYS, WORKER_PHASES, KVStoreStats, Timings, delta
from kvstore.errors import Incompatible, InvalidArgument, KVStoreError
from kvstore.keys import Namespace, chunk_keys, tail_key

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger(__name__)

MAX_QUEUED_SAVES = 64
"""Saves waiting for the saver thread beyond which a new one is dropped (a future miss)."""


class _BackgroundSave:
    """A save handed to the saver thread: the agent's ``SaveHandle`` once it is issued."""

    def __init__(self, fut: concurrent.futures.Future[Any], guard: Any) -> None:
        self.fut, self.guard = fut, guard

    def done(self) -> bool:
        if not self.fut.done():
            return False
        h = self._handle()
        return h is None or h.done()

    def _handle(self) -> Any:
        try:
            return self.fut.result(0)
        except Exception:  # the save failed before it was issued: nothing to wait for
            return None

    def wait(self, timeout: float | None = None) -> Any:
        from gpu_agent.agent import SaveResult

        try:
            h = self.fut.result(timeout)  # a TimeoutError goes to the caller
        except concurrent.futures.TimeoutError:
            raise
        except Exception as e:  # reported as a failed save
            log.warning("kvstore background save failed (%s)", e)
            return SaveResult(failed=1)
        return h.wait(timeout) if h is not None else SaveResult(failed=1)


class SaveLedger:
    """Each request's saves, from the step that issues them to the ``get_finished`` that
    reports the request (vLLM frees its blocks then, ``defer_free``).

    A request here is *saving* (a save of it may still copy) or *saved* (every save ended,
    not yet reported), never both; apart from that, vLLM may have *finished* it (it passed
    ``get_finished``'s ``finished_req_ids``).  :meth:`settle` reports a request once, when it
    is saved and finished.  Owned by the worker's step thread (the saver thread only
    completes the handles it holds)."""

    def __init__(self) -> None:
        self._saving: dict[str, list[tuple[Any, SaveSpec]]] = {}  # request → (handle or None: not started, spec)
        self._saved: set[str] = set()
        self._finished: set[str] = set()

    def add(self, rid: str, handle: Any, spec: SaveSpec) -> None:
        """A save of ``rid`` issued this step (``handle`` None: it could not start).  A
        request whose earlier saves all ended is *saving* again (a preempted request resumed
        saves anew): never reported while this save may copy from its pages."""
        self._saved.discard(rid)
        self._saving.setdefault(rid, []).append((handle, spec))

    def saves(self, rid: str) -> list[tuple[Any, SaveSpec]]:
        """``rid``'s saves that may still copy."""
        return self._saving.get(rid, [])

    def handles(self) -> list[Any]:
        """Every save that may still copy (for shutdown)."""
        return [h for saves in self._saving.values() for h, _ in saves if h is not None]

    def settle(self, finished: set[str], ended: Callable[[str, Any, SaveSpec], None]) -> set[str]:
        """Note the requests vLLM finished; move those whose saves all ended to *saved*
        (``ended`` called for each of their saves); return, once each, those saved and finished."""
        self._finished |= finished & (set(self._saving) | self._saved)
        for rid in list(self._saving):
            saves = self._saving[rid]
            if any(h is not None and not h.done() for h, _ in saves):
                continue
            del self._saving[rid]
            self._saved.add(rid)
            for h, spec in saves:
                ended(rid, h, spec)
        out = self._saved & self._finished
        self._saved -= out
        self._finished -= out
        return out

    def forget_reported(self) -> None:
        """Without ``defer_free`` vLLM freed the blocks at once: nothing is ever reported."""
        self._saved.clear()
        self._finished.clear()


class WorkerSide:
    """Loads and saves through one GPU agent (see the module docstring)."""

    def __init__(
        self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, settings: ConnectorSettings, chunk: int
    ) -> None:
        self.vllm_config, self.kv_cache_config = vllm_config, kv_cache_config
        self.settings, self.chunk = settings, chunk
        self.spec: EngineSpec | None = None
        self.agent: Any = None
        self.buffers: Any = None
        self.layer_index: dict[str, int] = {}
        self._loads: list[tuple[LoadSpec, Any]] = []
        self._errors: set[int] = set()
        self.saves = SaveLedger()
        self._events: list[KVCacheEvent] = []
        self.counters: dict[str, int] = {k: 0 for k in WORKER_KEYS}
        self._remote: Any = None  # a client of lookup_target, for chunks only other nodes hold
        self._remote_lock = threading.Lock()  # guards _remote and _closed (the warm-up, pulls and close race)
        self._closed = False
        self._puller: concurrent.futures.ThreadPoolExecutor | None = None  # runs the pulls (bounded waits)
        self._make_agent: Any = None
        self._next_try = 0.0
        self._store_errors = 0  # the agent's store_errors counter when last checked
        self._reported: dict[str, int] = {}
        self._loader: concurrent.futures.ThreadPoolExecutor | None = None  # runs async loads
        self._async: dict[str, tuple[LoadSpec, concurrent.futures.Future[tuple[int, int, bool]]]] = {}
        self._async_failed: list[LoadSpec] = []  # could not start (no node): reported at the next get_finished
        self._ahead: dict[int, tuple[Any, Any]] = {}  # id(SaveSpec) → (agent, its reservations), asked before the step
        self._saver: concurrent.futures.ThreadPoolExecutor | None = None  # runs host-copied saves off the step
        self._queued = 0  # saves handed to the saver and not yet issued (its thread decrements)
        self._queued_lock = threading.Lock()
        self.timings = Timings(WORKER_PHASES)
        self._step_t0: float | None = None  # when this step's first connector call came
        self._step_in = 0.0  # seconds of this step spent in connector calls
        self._step_meta: KVStoreMeta | None = None
        self._load_s = 0.0  # seconds of this step spent issuing and waiting for its (step) loads
        self._step_loaded: dict[str, int] = {}  # tokens this step's loads brought, per kind of chunk
        self._step_load_n: dict[str, int] = {}  # this step's loads that brought tokens, per kind

    @property
    def _bs(self) -> int:
        assert self.spec is not None, "register_kv_caches comes first"
        return self.spec.block_size

    def _ns(self, ns: Namespace) -> Namespace:
        """The scheduler's namespace (rank 0) for this worker's own shard."""
        assert self.spec is not None
        return rank_namespace(ns, self.spec.tp_rank, self.spec.pp_rank)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from gpu_agent.agent import AgentConfig, GPUAgent
        from gpu_agent.buffers import EngineBuffers
        from gpu_agent.layout import PagedAdapter

        tp_rank, pp_rank = worker_ranks()
        self.spec = engine_spec(
            self.vllm_config, self.kv_cache_config, tp_rank=tp_rank, pp_rank=pp_rank, model_id=self.settings.model_id
        )
        names = [n for n in self.kv_cache_config.kv_cache_groups[0].layer_names if n in kv_caches]
        if len(names) != len(kv_caches):
            names = list(kv_caches)
        self.layer_index = {n: i for i, n in enumerate(names)}
        tensors = [kv_caches[n] for n in names]
        self.buffers = EngineBuffers.from_tensors(tensors, self.kv_cache_config.num_blocks)
        layout = self.spec.layout()
        ns = self.spec.namespace(self.chunk, salt=self.settings.salt)
        PagedAdapter(layout, self.chunk).check_geometry(self.buffers.geometry)
        cfg = AgentConfig(
            hbm_bytes=self.settings.hbm_bytes,
            verify_loads=self.settings.verify_loads,
            copy_threads=self.settings.copy_threads,
        )
        self._make_agent = lambda client: GPUAgent(client, layout, ns, device=tensors[0].device, config=cfg)
        self._connect()
        self.warm()
        log.info(
            "KVStoreConnector: rank tp=%d pp=%d, %d layers, page geometry %s, chunks of %d tokens, namespace %s",
            tp_rank,
            pp_rank,
            len(names),
            self.buffers.geometry,
            self.chunk,
            ns.fingerprint.hex(),
        )

    def _connect(self) -> bool:
        """Attach to the node; a node that is not up (yet) is not an engine failure: the
        engine serves without the cache and this is retried every ``retry_s``.  A target
        that can never work here (not a local ``unix://`` node) is a configuration error."""
        if self.agent is not None:
            return True
        now = time.monotonic()
        if now < self._next_try:
            return False
        self._next_try = now + self.settings.retry_s
        client = None
        try:
            client = self.settings.client()
            self.agent = self._make_agent(client)
            log.info("KVStoreConnector: attached to %s", self.settings.target)
            return True
        except InvalidArgument as e:
            raise Incompatible(
                f"KVStoreConnector loads and saves through the kvstore node on this machine "
                f"(kv_connector_extra_config.target={self.settings.target!r} must be its unix:// socket): {e}"
            ) from e
        except (KVStoreError, OSError) as e:
            if client is not None:
                client.close()
            log.warning(
                "KVStoreConnector: kvstore node at %s unreachable (%s); serving without the cache, retrying every %.0f s",
                self.settings.target,
                e,
                self.settings.retry_s,
            )
            return False

    # -- loads ----------------------------------------------------------------------------
    def _pull_bounded(self, spec: LoadSpec, ns: Namespace) -> None:
        """:meth:`_pull_remote`, waited on for at most ``deadline_s``: past it the load goes on
        with what this node has (the pull may still land, for later requests)."""
        if self._puller is None:
            self._puller = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvstore-pull")
        fut = self._puller.submit(self._pull_remote, self.agent, spec, ns)
        try:
            fut.result(timeout=self.settings.deadline_s)
        except concurrent.futures.TimeoutError:
            log.warning(
                "kvstore: fetching %s's chunks from %s took over %.1f s; loading what this node has",
                spec.req_id,
                self.settings.lookup_target,
                self.settings.deadline_s,
            )

    def _remote_client(self) -> Any:
        """The client of ``lookup_target``, made by whichever thread asks first (the warm-up,
        a pull); None once the worker is closed."""
        with self._remote_lock:
            if self._remote is None and not self._closed:
                self._remote = self.settings.client(self.settings.lookup_target)
            return self._remote

    def warm(self) -> threading.Thread | None:
        """Start :meth:`_warm_remote` on a thread of its own (None: no ``lookup_target``)."""
        if not self.settings.lookup_target:
            return None
        t = threading.Thread(target=self._warm_remote, name="kvstore-warm", daemon=True)
        t.start()
        return t

    def _warm_remote(self) -> None:
        """Make the ``lookup_target`` client, connect it to every node and import the pull
        path at start, off the engine's threads.  Done lazily, the first chunk pulled from
        another node paid for them (the cluster client's imports, its etcd connection and
        membership read, then the node's connection) in that request's time to first token:
        0.3-0.4 s on two cores, several times a short prompt's whole prefill.  A cluster not
        reachable yet is tried again by that pull."""
        try:
            import gpu_agent.pull  # noqa: F401 - imported for its cost, here rather than in a request

            remote = self._remote_client()
            if remote is not None:
                remote.warm()
        except Exception as e:  # the first pull makes the client (and reports) instead
            log.info(
                "KVStoreConnector: %s not reachable yet (%s); the first pull tries again",
                self.settings.lookup_target,
                e,
            )

    def _pull_remote(self, agent: Any, spec: LoadSpec, ns: Namespace) -> None:
        """Chunks the scheduler found through ``lookup_target`` that this machine's node lacks
        (``gpu_agent.pull``) into ``agent``'s node; a failure leaves them missing and the load
        stops before them (no agent: the node is down, nothing to pull into)."""
        from gpu_agent.pull import pull_missing

        if agent is None:
            return
        t0 = time.perf_counter()
        try:
            remote = self._remote_client()
            if remote is None:
                return  # closed
            chain = chunk_keys(spec.tokens, ns)
            tail = tail_key(spec.tokens, ns, chain) if spec.tail else None
            if tail is not None:
                chain.append(tail)
            self.counters["pulled_blocks"] += pull_missing(
                agent.client,
                remote,
                chain,
                spec.first_token // self.chunk,
                ns,
                self.chunk,
                tail_tokens=len(spec.tokens) % self.chunk if tail is not None else 0,
            )
        except Exception as e:  # the load goes on with what this node has (the rest recomputes)
            log.warning(
                "kvstore: fetching %s's chunks from %s failed (%s); loading what this node has",
                spec.req_id,
                self.settings.lookup_target,
                e,
                exc_info=not isinstance(e, KVStoreError),
            )
        finally:
            self.counters["pull_us"] += int((time.perf_counter() - t0) * 1e6)

    def start_load_kv(self, meta: KVStoreMeta) -> None:
        t0 = time.perf_counter()
        try:
            self._start_load(meta)
        finally:
            dt = time.perf_counter() - t0
            self._step_in += dt
            self._load_s += dt

    def _start_load(self, meta: KVStoreMeta) -> None:
        if not self._connect():
            for spec in meta.loads:  # no node: every promised block is recomputed
                if spec.async_load:
                    self._async_failed.append(spec)  # still reported finished, with its blocks failed
                else:
                    self._fail(spec, spec.first_token)
            return
        for spec in meta.loads:
            if spec.async_load:
                if self._loader is None:
                    self._loader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvstore-load")
                self._async[spec.req_id] = (spec, self._loader.submit(self._load_in_background, self.agent, spec))
                continue
            ns = self._ns(spec.namespace)
            if self.settings.lookup_target:
                self._pull_bounded(spec, ns)
            h, us = self._issue_load(self.agent, spec, ns)
            self.counters["load_us"] += us
            got = h.num_tokens if h is not None else 0
            if got < spec.num_tokens:
                self._fail(spec, got)
                self.counters["view_stale_hits"] += spec.from_view and h is not None
            self._loads.append((spec, h))
            self.counters["loads"] += 1
            loaded = max(0, min(got, spec.num_tokens) - spec.first_token)
            self.counters["load_tokens"] += loaded
            self._step_loaded[spec.kind] = self._step_loaded.get(spec.kind, 0) + loaded
            self._step_load_n[spec.kind] = self._step_load_n.get(spec.kind, 0) + (loaded > 0)
        self._check_agent()

    def _issue_load(self, agent: Any, spec: LoadSpec, ns: Namespace) -> tuple[Any, int]:
        """``agent.load`` for ``spec``: its handle (None: it failed) and the microseconds it took."""
        bs = self._bs
        first_page = spec.first_token // bs
        covered = -(-len(spec.tokens) // bs)
        pages = spec.block_ids[:covered]
        ids = [-1 if j < first_page else b for j, b in enumerate(pages)]
        if spec.tail and len(pages) == covered:  # the partial chunk's pages past its tokens
            ids += [-1] * (-(-len(spec.tokens) // self.chunk) * (self.chunk // bs) - covered)
        t0 = time.perf_counter()
        try:
            h = agent.load(
                spec.tokens,
                self.buffers,
                ids,
                namespace=ns,
                session_id=spec.session_id,
                first_chunk=spec.first_token // self.chunk,
                tail=spec.tail,
            )
        except Exception as e:  # never a failed step: the engine recomputes what did not load
            log.warning("kvstore load for %s failed (%s); recomputing", spec.req_id, e)
            h = None
        return h, int((time.perf_counter() - t0) * 1e6)

    def _load_in_background(self, agent: Any, spec: LoadSpec) -> tuple[int, int, bool]:
        """The loader thread: pull what only other nodes hold, then load; (tokens loaded from
        token 0, microseconds, whether the node had fewer chunks than planned).  Bounded by
        the clients' deadlines and ``wait_s``."""
        t0 = time.perf_counter()
        ns = self._ns(spec.namespace)
        if self.settings.lookup_target:
            self._pull_remote(agent, spec, ns)
        h, _ = self._issue_load(agent, spec, ns)
        got = 0
        short = h is not None and h.num_tokens < spec.num_tokens
        if h is not None:
            try:
                got = h.num_tokens if h.wait(timeout=self.settings.wait_s) else 0
            except Exception as e:  # the engine recomputes what did not load
                log.warning("kvstore load for %s did not finish (%s)", spec.req_id, e)
        return got, int((time.perf_counter() - t0) * 1e6), short

    def _finished_loads(self) -> set[str]:
        """Async loads that ended (their failed blocks recorded for this step's errors)."""
        out: set[str] = set()
        for spec in self._async_failed:
            self._fail(spec, spec.first_token)
            out.add(spec.req_id)
        self._async_failed = []
        for rid, (spec, fut) in list(self._async.items()):
            if not fut.done():
                continue
            del self._async[rid]
            try:
                got, us, short = fut.result()
            except Exception as e:  # a bug in the loader: recompute, never hang the request
                log.warning("kvstore background load for %s failed (%s); recomputing", rid, e)
                got, us, short = 0, 0, False
            if got < spec.num_tokens:
                self._fail(spec, got)
            self.counters["view_stale_hits"] += spec.from_view and short
            loaded = max(0, min(got, spec.num_tokens) - spec.first_token)
            self.counters["loads"] += 1
            self.counters["load_us"] += us
            self.counters["load_tokens"] += loaded
            self.counters["async_load_tokens"] += loaded
            if loaded > 0 and spec.kind in ("local", "nvme", "remote"):
                self.counters[f"load_{spec.kind}_us"] += us
                self.counters[f"load_{spec.kind}_tokens"] += loaded
                self.counters[f"load_{spec.kind}_n"] += 1
            out.add(rid)
        return out

    def _fail(self, spec: LoadSpec, from_token: int) -> None:
        """The pages of tokens ``[from_token, num_tokens)`` (never below ``first_token``) did not load."""
        bs = self._bs
        first = max(spec.first_token, from_token) // bs
        bad = spec.block_ids[first : -(-spec.num_tokens // bs)]
        self._errors.update(bad)
        self.counters["load_errors"] += len(bad)

    def wait_for_layer_load(self, layer_name: str) -> None:
        i = self.layer_index.get(layer_name)
        if i is None or not self._loads:
            return
        t0 = time.perf_counter()
        for _, h in self._loads:
            if h is not None:
                h.wait_layer(i)
        dt = time.perf_counter() - t0
        self._step_in += dt
        self._load_s += dt

    def _finish_loads(self) -> None:
        loads, self._loads = self._loads, []
        for spec, h in loads:
            if h is None:
                continue
            try:
                ok = h.wait(timeout=self.settings.wait_s)
            except Exception as e:
                log.warning("kvstore load for %s did not finish (%s)", spec.req_id, e)
                ok = False
            if not ok:
                self._fail(spec, spec.first_token)

    # -- the step -------------------------------------------------------------------------
    def bind_connector_metadata(self, meta: Any) -> None:
        """vLLM bound this step's metadata: the step starts (and, on CUDA, its saves' arena
        space is asked for while it computes)."""
        self._step_t0, self._step_in, self._load_s = time.perf_counter(), 0.0, 0.0
        self._step_meta = meta if isinstance(meta, KVStoreMeta) else None
        if self._step_meta is not None and self._step_meta.saves:
            t0 = time.perf_counter()
            self.reserve_ahead(self._step_meta)
            self._step_in += time.perf_counter() - t0

    def _end_step(self, meta: KVStoreMeta, save_s: float) -> None:
        """The step's timings: its connector calls and, if it prefilled, its forward pass."""
        now = time.perf_counter()
        if meta.saves:
            self.timings.add("save_wait", save_s)
        if meta.loads:
            self.timings.add("load_wait", self._load_s)
        total = sum(self._step_loaded.values())
        for kind, tokens in self._step_loaded.items():  # the step's load time, shared by tokens
            if tokens > 0 and kind in ("local", "nvme", "remote"):
                self.counters[f"load_{kind}_us"] += int(self._load_s * 1e6 * tokens / total)
                self.counters[f"load_{kind}_tokens"] += tokens
                self.counters[f"load_{kind}_n"] += self._step_load_n.get(kind, 0)
        self._step_loaded, self._step_load_n = {}, {}
        self.timings.add("step_wait", self._step_in)
        if self._step_t0 is not None and meta.prefill_tokens >= PREFILL_STEP_TOKENS and meta.step_tokens > 0:
            forward = max(0.0, now - self._step_t0 - self._step_in)
            self.counters["prefill_step_us"] += int(forward * 1e6)
            self.counters["prefill_step_tokens"] += meta.step_tokens
        self._step_t0, self._step_in, self._load_s, self._step_meta = None, 0.0, 0.0, None

    def handle_preemptions(self, meta: Any) -> None:
        """Before the step: vLLM freed the pages of the requests it preempted, and this step
        may rewrite them.  Their saves still copying are cancelled (never committed)."""
        if not isinstance(meta, KVStoreMeta) or not meta.preempted:
            return
        for rid in meta.preempted:
            for h, _ in self.saves.saves(rid):
                if isinstance(h, _BackgroundSave) and not h.done():
                    h.guard.cancel()
                    self.counters["saves_cancelled"] += 1

    # -- saves ----------------------------------------------------------------------------
    def reserve_ahead(self, meta: KVStoreMeta) -> None:
        """Before the step runs: ask the node for the arena space of its saves (on the agent's
        reserver thread), so ``wait_for_save`` copies at once.  Best effort: a save without
        its reservation reserves for itself.  Not where saves run off the step (host copies):
        the saver thread reserves as it goes."""
        if self.agent is None or self.spec is None or (self.agent.copies_on_host and self.settings.background_saves):
            return
        for s in meta.saves:
            try:
                self._ahead[id(s)] = self.agent, self.agent.reserve_ahead(s.tokens, s.block_ids, **self._save_kw(s))
            except Exception as e:  # the save reserves for itself then
                log.debug("kvstore: reserving ahead for %s failed (%s)", s.req_id, e)

    def _save_kw(self, s: SaveSpec) -> dict[str, Any]:
        """What ``GPUAgent.save`` and ``reserve_ahead`` take from a save spec besides tokens and pages."""
        return {
            "namespace": self._ns(s.namespace),
            "skip_chunks": s.skip_chunks,
            "session_id": s.session_id,
            "tail": s.tail,
        }

    def wait_for_save(self, meta: KVStoreMeta) -> None:
        t0 = time.perf_counter()
        save_s = 0.0
        try:
            self._finish_loads()
            t1 = time.perf_counter()
            self._load_s += t1 - t0
            if meta.saves:
                self._issue_saves(meta)
                save_s = time.perf_counter() - t1
        finally:
            self._step_in += time.perf_counter() - t0
            self._end_step(meta, save_s)

    def _issue_saves(self, meta: KVStoreMeta) -> None:
        connected = self._connect()
        background = connected and self.settings.background_saves and bool(self.agent.copies_on_host)
        for s in meta.saves:
            handle: Any = None
            owner, ahead = self._ahead.pop(id(s), (None, None))
            if ahead is not None and owner is not self.agent:  # reserved through an agent since retired
                ahead.abort()
                ahead = None
            if connected and background:
                handle = self._submit_save(self.agent, s)
                self.counters["saves"] += 1
            elif connected:
                t0 = time.perf_counter()
                try:
                    handle = self.agent.save(
                        s.tokens,
                        self.buffers,
                        s.block_ids,
                        ahead=ahead,
                        ahead_timeout=self.settings.wait_s,
                        **self._save_kw(s),
                    )
                except Exception as e:  # a save that cannot run is a future miss, never a failed step
                    log.warning("kvstore save for %s failed (%s)", s.req_id, e)
                self.counters["save_us"] += int((time.perf_counter() - t0) * 1e6)
                self.counters["save_chunks"] += self._save_chunks(s)
                self.counters["saves"] += 1
            elif ahead is not None:
                ahead.abort()
            self.saves.add(s.req_id, handle, s)  # recorded whatever happened to it
        for _, unused in self._ahead.values():  # for saves of another step's metadata: never used
            unused.abort()
        self._ahead.clear()
        if connected:
            self._check_agent()

    def _save_chunks(self, s: SaveSpec) -> int:
        """Chunks one save stores (its full chunks past ``skip_chunks``, its tail): the unit
        of the save cost the scheduler's admission weighs (``save_us`` / ``save_chunks``)."""
        return max(0, -(-len(s.tokens) // self.chunk if s.tail else len(s.tokens) // self.chunk) - s.skip_chunks)

    def _submit_save(self, agent: Any, s: SaveSpec) -> _BackgroundSave | None:
        """Hand a save to the saver thread (None: dropped, the saver is ``MAX_QUEUED_SAVES`` behind)."""
        from gpu_agent.agent import SaveGuard

        with self._queued_lock:
            if self._queued >= MAX_QUEUED_SAVES:
                self.counters["saves_dropped"] += 1
                return None
            self._queued += 1
        if self._saver is None:
            self._saver = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvstore-save")
        guard = SaveGuard()
        return _BackgroundSave(self._saver.submit(self._save_in_background, agent, s, guard), guard)

    def _save_in_background(self, agent: Any, s: SaveSpec, guard: Any) -> Any:
        """The saver thread: one save (Reserve, copy, checksum; the agent commits it)."""
        with self._queued_lock:
            self._queued -= 1
        if guard.cancelled:
            return None
        t0 = time.perf_counter()
        try:
            return agent.save(s.tokens, self.buffers, s.block_ids, guard=guard, **self._save_kw(s))
        except Exception as e:  # a save that cannot run is a future miss
            log.warning("kvstore save for %s failed (%s)", s.req_id, e)
            return None
        finally:
            dt = time.perf_counter() - t0
            with self._queued_lock:
                self.counters["save_us"] += int(dt * 1e6)
                self.counters["save_chunks"] += self._save_chunks(s)
                self.timings.add("background_save", dt)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests vLLM has finished whose saves all ended (each reported once), and
        requests whose background load ended."""
        recving = self._finished_loads() or None
        return self._finished_saves(finished_req_ids), recving

    def _finished_saves(self, finished_req_ids: set[str]) -> set[str] | None:
        out = self.saves.settle(finished_req_ids, self._emit_stored)
        if not self.settings.defer_free:
            self.saves.forget_reported()  # the scheduler freed these blocks at once: nothing to report
            return None
        return out or None

    def _emit_stored(self, rid: str, handle: Any, s: SaveSpec) -> None:
        if handle is None:
            return
        try:
            res = handle.wait(0)
        except Exception as e:
            log.warning("kvstore save for %s failed (%s)", rid, e)
            return
        if res.failed:
            return  # which chunks failed is not known: claim none
        keys = chunk_keys(s.tokens, s.namespace)  # rank 0's keys: the same event from every rank
        ev = stored_event(keys, s.skip_chunks, s.tokens, self.chunk, s.namespace.lora_id)
        if ev is not None:
            self._events.append(ev)

    # -- the agent's lifecycle --------------------------------------------------------------
    def _check_agent(self) -> None:
        """An agent whose store calls failed is dropped (after its transfers end) and
        attached afresh ``retry_s`` after its last failure (at once if that is past): a
        restarted node has a new arena and socket."""
        if self.agent is None:
            return
        errors = int(self.agent.stats()["counters"].get("store_errors", 0))
        if errors > self._store_errors:
            # RETRY_S from the failure, not from this check: an idle engine checks at its next
            # step, perhaps long after the node came back, and must not then serve without it
            retry_at = self.agent.last_store_error_at + self.settings.retry_s
            log.warning(
                "KVStoreConnector: the node at %s failed; re-attaching in %.0f s",
                self.settings.target,
                max(0.0, retry_at - time.monotonic()),
            )
            self._retire_agent()
            self._next_try = retry_at
        self._store_errors = errors if self.agent is not None else 0

    def _retire_agent(self) -> None:
        agent, self.agent = self.agent, None
        if agent is None:
            return
        for _, fut in list(self._async.values()):  # background loads through this agent end first
            with contextlib.suppress(Exception):
                fut.result(timeout=self.settings.wait_s + self.settings.deadline_s)
        for _, h in self._loads:
            if h is not None:
                try:
                    h.wait(timeout=self.settings.wait_s)
                except Exception:  # the load is already counted as failed
                    pass
        for handle in self.saves.handles():
            try:
                handle.wait(self.settings.wait_s)
            except Exception:  # a failed save is a future miss
                pass
        client = agent.client
        agent.close()
        client.close()

    # -- what vLLM collects -------------------------------------------------------------------
    def get_kv_connector_stats(self) -> KVStoreStats | None:
        """The counters and timings since the last call (None when nothing happened)."""
        with self._queued_lock:  # the saver thread adds its save_us
            return delta(self.counters, self._reported, WORKER_KEYS, self.timings)

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._errors = self._errors, set()
        return out

    def get_kv_connector_kv_cache_events(self) -> KVStoreEvents | None:
        if not self._events:
            return None
        ev = KVStoreEvents(1)
        ev.add_events(self._events)
        self._events = []
        return ev

    def shutdown(self) -> None:
        if self._saver is not None:
            self._saver.shutdown(wait=True)  # queued saves run (bounded by the clients' deadlines)
            self._saver = None
        for handle in self.saves.handles():
            try:
                handle.wait(self.settings.wait_s)
            except Exception:  # a failed save is a future miss
                pass
        if self._puller is not None:
            self._puller.shutdown(wait=True, cancel_futures=True)
            self._puller = None
        if self._loader is not None:
            self._loader.shutdown(wait=True)
            self._loader = None
        with self._remote_lock:
            self._closed = True
            remote, self._remote = self._remote, None
        if remote is not None:
            remote.close()
        self._retire_agent()

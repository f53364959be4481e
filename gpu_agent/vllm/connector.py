"""``KVStoreConnector``: kvstore as a vLLM (v1) KV connector.

    KVTransferConfig(kv_connector="KVStoreConnector", kv_connector_module_path="gpu_agent.vllm",
                     kv_role="kv_both", kv_connector_extra_config={"target": "unix:///…/kvstore.sock"})

vLLM makes one instance in the scheduler process and one in each worker:

* **Scheduler** (:class:`_SchedulerSide`): ``get_num_new_matched_tokens`` keys the
  prompt's chunks beyond vLLM's own prefix cache and asks the store how many lead
  (``match_prefix``; side-effect free, within ``deadline_s``, a store that cannot answer
  is a miss).  It tracks each request's block table and emits, per step, picklable
  :class:`KVStoreMeta`: a :class:`LoadSpec` for a request whose hit was allocated and a
  :class:`SaveSpec` when a request's prompt is complete (``kv_producer`` / ``kv_both``).
  It owns only bookkeeping, never KV bytes.
* **Worker** (:class:`_WorkerSide`): learns the engine's page geometry from the
  registered tensors (``gpu_agent.buffers``), and moves bytes through one
  :class:`~gpu_agent.agent.GPUAgent` over the node's shared-memory arena: loads are
  queued in ``start_load_kv`` and waited on per layer; saves run in ``wait_for_save``
  (when it returns, the pages may be reused: the agent's save fence).  A block that is
  gone, fails its checksum or whose lease lapsed is reported through
  ``get_block_ids_with_load_errors``, so vLLM recomputes it: wrong KV is never kept.

Invariants: the scheduler and the workers derive the same namespace from the same
config (``gpu_agent.vllm.settings``); a request whose blocks are held for a save
(``request_finished`` → True) is reported by ``get_finished`` exactly once.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
    KVEventAggregator,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from gpu_agent.vllm.settings import RETRY_S, ConnectorSettings, EngineSpec
from kvstore.errors import Incompatible, InvalidArgument, KVStoreError
from kvstore.keys import Namespace, chunk_keys, parent_keys

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

TIER_MEDIUM = {"dram": MEDIUM_CPU, "nvme": MEDIUM_STORAGE, "hbm": "GPU"}
TIER_SOURCE = {"dram": CacheHitSource.HOST, "nvme": CacheHitSource.DISK, "hbm": CacheHitSource.HOST}


# -- scheduler → worker metadata ---------------------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True)
class LoadSpec:
    """Load tokens ``[first_page * block_size, num_tokens)`` of ``tokens`` into ``block_ids``."""

    req_id: str
    tokens: list[int]
    block_ids: list[int]
    first_page: int
    num_tokens: int
    namespace: Namespace
    session_id: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class SaveSpec:
    """Store ``tokens``' full chunks from ``block_ids``, skipping the first ``skip_chunks`` (already stored)."""

    req_id: str
    tokens: list[int]
    block_ids: list[int]
    skip_chunks: int
    namespace: Namespace
    session_id: str | None = None


@dataclasses.dataclass
class KVStoreMeta(KVConnectorMetadata):
    loads: list[LoadSpec] = dataclasses.field(default_factory=list)
    saves: list[SaveSpec] = dataclasses.field(default_factory=list)


class KVStoreEvents(KVConnectorKVEvents):
    """Blocks stored and removed by the workers, with their medium, aggregated over workers."""

    def __init__(self, num_workers: int = 1) -> None:
        self._agg = KVEventAggregator(num_workers)

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._agg.add_events(events)

    def aggregate(self) -> KVStoreEvents:
        common = self._agg.get_common_events()
        self._agg.clear_events()
        self._agg.add_events(common)
        self._agg.reset_workers()
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._agg.increment_workers(count)

    def get_all_events(self) -> list[KVCacheEvent]:
        return self._agg.get_all_events()

    def get_number_of_workers(self) -> int:
        return self._agg.get_number_of_workers()

    def clear_events(self) -> None:
        self._agg.clear_events()
        self._agg.reset_workers()


STAT_KEYS = ("loads", "load_tokens", "load_errors", "saves", "load_us", "save_us", "pulled_blocks", "pull_us")


@dataclasses.dataclass
class KVStoreStats(KVConnectorStats):
    """The workers' counters over one interval (what vLLM logs and exports for the
    connector): loads, tokens loaded, blocks that failed to load, saves, blocks fetched
    from other nodes, and the host time each took."""

    def __post_init__(self) -> None:
        for k in STAT_KEYS:
            self.data.setdefault(k, 0)

    def reset(self) -> None:
        self.data = {k: 0 for k in STAT_KEYS}

    def aggregate(self, other: KVConnectorStats) -> KVStoreStats:
        for k in STAT_KEYS:
            self.data[k] = self.data.get(k, 0) + int(other.data.get(k, 0))
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        return {
            "loads": d["loads"],
            "tokens loaded": d["load_tokens"],
            "blocks failed to load": d["load_errors"],
            "saves": d["saves"],
            "blocks fetched from other nodes": d["pulled_blocks"],
            "avg load ms": round(d["load_us"] / d["loads"] / 1e3, 3) if d["loads"] else 0.0,
            "avg save ms": round(d["save_us"] / d["saves"] / 1e3, 3) if d["saves"] else 0.0,
        }

    def is_empty(self) -> bool:
        return not (self.data["loads"] or self.data["saves"] or self.data["load_errors"])


# -- the engine's spec --------------------------------------------------------------------
def engine_spec(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None, *, worker: bool, model_id: str = ""
) -> EngineSpec:
    """The KV facts both halves key by; an engine kvstore cannot serve fails here, naming the setting."""
    if kv_cache_config is None:
        raise Incompatible("KVStoreConnector needs vLLM's kv_cache_config (vLLM >= 0.32)")
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise Incompatible(
            f"the model has {len(groups)} KV cache groups (hybrid attention); KVStoreConnector serves one full-attention group"
        )
    spec = groups[0].kv_cache_spec
    heads, head = getattr(spec, "num_kv_heads", None), getattr(spec, "head_size", None)
    if (
        heads is None
        or head is None
        or getattr(spec, "sliding_window", None)
        or getattr(spec, "head_size_v", head) != head
    ):
        raise Incompatible(
            f"KV cache spec {type(spec).__name__} (MLA, sliding window or unequal K/V heads) is not one kvstore can describe"
        )
    from vllm.platforms import current_platform

    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    layout = kv_cache_config.kv_cache_layout or vllm_config.cache_config.kv_cache_layout or "default"
    tp_rank = pp_rank = 0
    if worker:
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        tp_rank, pp_rank = get_tensor_model_parallel_rank(), get_pp_group().rank_in_group
    return EngineSpec(
        model_id=model_id or str(mc.model),
        revision=str(mc.revision or "main"),
        kv_dtype=str(spec.dtype).removeprefix("torch."),
        num_layers=len(groups[0].layer_names),
        num_kv_heads=int(heads),
        head_dim=int(head),
        block_size=int(spec.block_size),
        page_layout=f"vllm:{current_platform.device_type}:{layout}",
        tp_rank=tp_rank,
        tp_size=int(pc.tensor_parallel_size),
        pp_rank=pp_rank,
        pp_size=int(pc.pipeline_parallel_size),
    )


def request_session(request: Any) -> str | None:
    """The session a request belongs to (``kv_transfer_params["session_id"]``), for the
    store's eviction hints: blocks only closed sessions used go first."""
    params = getattr(request, "kv_transfer_params", None) or {}
    sid = params.get("session_id") if isinstance(params, dict) else None
    return sid if isinstance(sid, str) and sid else None


def request_namespace(spec: EngineSpec, settings: ConnectorSettings, chunk: int, request: Any) -> Namespace:
    lora = getattr(request, "lora_request", None)
    return spec.namespace(
        chunk,
        lora=lora.lora_name if lora is not None else "",
        cache_salt=getattr(request, "cache_salt", None) or "",
        salt=settings.salt,
    )


# -- scheduler side -----------------------------------------------------------------------
@dataclasses.dataclass
class _Tracked:
    tokens: list[int]
    namespace: Namespace
    block_ids: list[int]
    session_id: str | None = None
    hit_chunks: int = 0  # chunks the store already holds (loaded or found): not saved again
    saved: bool = False


class _SchedulerSide:
    """Lookups and per-request bookkeeping (scheduler process only)."""

    def __init__(
        self, spec: EngineSpec, settings: ConnectorSettings, chunk: int, *, produce: bool, consume: bool
    ) -> None:
        self.spec, self.settings, self.chunk = spec, settings, chunk
        self.produce, self.consume = produce, consume
        self._client: Any = None
        self._lock = threading.Lock()
        self._hits: dict[str, tuple[int, list[str]]] = {}  # req → (tokens the store has beyond vLLM's, their tiers)
        self._loads: dict[str, LoadSpec] = {}
        self._tracked: dict[str, _Tracked] = {}
        self._deferred: set[str] = set()
        self._events: KVStoreEvents | None = None
        self._down_until = 0.0
        self.counters: dict[str, int] = {"lookups": 0, "lookup_errors": 0, "hit_tokens": 0, "lookup_us": 0}

    def client(self) -> Any:
        if self._client is None:
            self._client = self.settings.client(self.settings.lookup_target or None)
        return self._client

    def _drop_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # closing a broken client is best effort
                pass

    def matched(self, request: Request, num_computed: int) -> tuple[int, bool]:
        if not self.consume:
            return 0, False
        tokens = list(request.prompt_token_ids or [])
        # vLLM must compute at least the last prompt token; load whole chunks only
        usable = (len(tokens) - 1) // self.chunk
        first = num_computed // self.chunk
        if usable <= first:
            return 0, False
        ns = request_namespace(self.spec, self.settings, self.chunk, request)
        keys = chunk_keys(tokens[: usable * self.chunk], ns)[first:]
        if time.monotonic() < self._down_until:
            return 0, False  # the store failed a moment ago: no request waits on it for RETRY_S
        t0 = time.perf_counter()
        try:
            n, tiers = self.client().match_prefix_tiers(keys, session_id=request_session(request))
        except Exception as e:  # noqa: BLE001 - the engine must outlive any store failure: it recomputes
            self.counters["lookup_errors"] += 1
            if isinstance(e, KVStoreError):
                log.warning(
                    "kvstore lookup failed (%s): request %s recomputes; next try in %.0f s",
                    e,
                    request.request_id,
                    RETRY_S,
                )
            else:  # not the store's answer: a bug here or in the SDK; the engine goes on without the store
                log.exception(
                    "kvstore lookup raised: request %s recomputes; next try in %.0f s", request.request_id, RETRY_S
                )
            self._down_until = time.monotonic() + RETRY_S
            self._drop_client()  # a fresh channel then, not one parked in reconnect back-off
            return 0, False
        self.counters["lookups"] += 1
        self.counters["lookup_us"] += int((time.perf_counter() - t0) * 1e6)
        hit = max(0, (first + n) * self.chunk - num_computed)
        self._hits[request.request_id] = (hit, list(tiers[:n]))
        return hit, False

    def hit_sources(self, request: Request, num_external: int) -> dict[CacheHitSource, int]:
        if num_external <= 0:
            return {}
        _, tiers = self._hits.get(request.request_id, (0, []))
        out: dict[CacheHitSource, int] = {}
        left = num_external
        for t in reversed(tiers):  # the chunks loaded are the last ones found
            take = min(left, self.chunk)
            src = TIER_SOURCE.get(t, CacheHitSource.EXTERNAL_UNSPECIFIED)
            out[src] = out.get(src, 0) + take
            left -= take
            if left <= 0:
                break
        if left > 0:
            out[CacheHitSource.EXTERNAL_UNSPECIFIED] = out.get(CacheHitSource.EXTERNAL_UNSPECIFIED, 0) + left
        return out

    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external: int) -> None:
        rid = request.request_id
        ns = request_namespace(self.spec, self.settings, self.chunk, request)
        if rid not in self._tracked:
            self._tracked[rid] = _Tracked(
                list(request.prompt_token_ids or []), ns, [], session_id=request_session(request)
            )
        if num_external <= 0:
            return
        computed = request.num_computed_tokens
        end = computed + num_external
        self._tracked[rid].hit_chunks = end // self.chunk
        block_ids = list(blocks.get_block_ids()[0])
        self._loads[rid] = LoadSpec(
            rid,
            self._tracked[rid].tokens[:end],
            block_ids,
            computed // self.spec.block_size,
            end,
            ns,
            self._tracked[rid].session_id,
        )
        self._report_local_hits(ns, computed)

    def _report_local_hits(self, ns: Namespace, tokens: int) -> None:
        """vLLM's own prefix-cache hits never reach the store: report them (tier HBM)."""
        if tokens <= 0:
            return
        try:
            self.client().report_hits(max(1, tokens // self.chunk), tokens, tier="hbm", op="match_prefix", namespace=ns)
        except Exception:  # noqa: BLE001 - metrics only: never worth an engine
            log.debug("kvstore: reporting prefix-cache hits failed", exc_info=True)

    def build_meta(self, out: SchedulerOutput) -> KVStoreMeta:
        meta = KVStoreMeta()
        for req in out.scheduled_new_reqs:
            t = self._tracked.get(req.req_id)
            if t is None:
                continue
            t.block_ids = list(req.block_ids[0])
            load = self._loads.pop(req.req_id, None)
            if load is not None:
                meta.loads.append(dataclasses.replace(load, block_ids=t.block_ids))
            self._maybe_save(meta, req.req_id, req.num_computed_tokens + out.num_scheduled_tokens.get(req.req_id, 0))
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            t = self._tracked.get(rid)
            if t is None:
                continue
            new = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                t.block_ids = list(new[0]) if new is not None else []
                load = self._loads.pop(rid, None)
                if load is not None:
                    meta.loads.append(dataclasses.replace(load, block_ids=t.block_ids))
            elif new is not None:
                t.block_ids.extend(new[0])
            self._maybe_save(meta, rid, cached.num_computed_tokens[i] + out.num_scheduled_tokens.get(rid, 0))
        self._loads.clear()  # an allocation vLLM did not schedule is re-asked next time
        return meta

    def _maybe_save(self, meta: KVStoreMeta, rid: str, done_tokens: int) -> None:
        t = self._tracked[rid]
        if not self.produce or t.saved or done_tokens < len(t.tokens):
            return
        t.saved = True
        full = len(t.tokens) // self.chunk
        pages = full * self.chunk // self.spec.block_size
        if full > t.hit_chunks and len(t.block_ids) >= pages:
            meta.saves.append(
                SaveSpec(
                    rid, t.tokens[: full * self.chunk], t.block_ids[:pages], t.hit_chunks, t.namespace, t.session_id
                )
            )
            self._deferred.add(rid)

    def finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Hold the blocks of a request whose save runs; tell the caller where its KV went
        (``kv_transfer_params["kvstore"]``: the namespace and chunk size, for a router or a
        decode instance to key the same prefix)."""
        rid = request.request_id
        t = self._tracked.pop(rid, None)
        self._hits.pop(rid, None)
        self._loads.pop(rid, None)
        hold = rid in self._deferred and self.settings.defer_free
        self._deferred.discard(rid)
        params = None
        if t is not None:
            params = {
                "kvstore": {
                    "namespace": t.namespace.to_dict(),
                    "chunk_tokens": self.chunk,
                    "saved": t.saved,
                    "hit_chunks": t.hit_chunks,
                }
            }
        return hold, params

    def worker_output(self, out: KVConnectorOutput) -> None:
        ev = out.kv_cache_events
        if not isinstance(ev, KVStoreEvents):
            return
        if self._events is None:
            self._events = ev
        else:
            self._events.add_events(ev.get_all_events())
            self._events.increment_workers(ev.get_number_of_workers())

    def take_events(self) -> Iterable[KVCacheEvent]:
        if self._events is None:
            return []
        self._events.aggregate()
        events = self._events.get_all_events()
        self._events = None
        return events


# -- worker side --------------------------------------------------------------------------
class _WorkerSide:
    """Loads and saves through one GPU agent (worker process only)."""

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
        self._saving: dict[str, Any] = {}  # req → SaveHandle (or None: nothing to wait for)
        self._saved: set[str] = set()  # saves done, the request not yet reported finished by vLLM
        self._told: set[str] = set()  # requests vLLM finished that have (or had) a save here
        self._events: list[KVCacheEvent] = []
        self.counters: dict[str, int] = {
            "loads": 0,
            "load_tokens": 0,
            "load_errors": 0,
            "saves": 0,
            "load_us": 0,
            "save_us": 0,
            "pulled_blocks": 0,
            "pull_us": 0,
        }
        self._remote: Any = None  # a client of lookup_target, for chunks only other nodes hold
        self._make_agent: Any = None
        self._next_try = 0.0
        self._store_errors = 0  # the agent's store_errors counter when last checked
        self._reported = {k: 0 for k in STAT_KEYS}  # the counters the last take_stats reported

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from gpu_agent.agent import AgentConfig, GPUAgent
        from gpu_agent.buffers import EngineBuffers
        from gpu_agent.layout import PagedAdapter

        self.spec = engine_spec(self.vllm_config, self.kv_cache_config, worker=True, model_id=self.settings.model_id)
        names = [n for n in self.kv_cache_config.kv_cache_groups[0].layer_names if n in kv_caches]
        if len(names) != len(kv_caches):
            names = list(kv_caches)
        self.layer_index = {n: i for i, n in enumerate(names)}
        tensors = [kv_caches[n] for n in names]
        self.buffers = EngineBuffers.from_tensors(tensors, self.kv_cache_config.num_blocks)
        layout = self.spec.layout()
        ns = self.spec.namespace(self.chunk, salt=self.settings.salt)
        PagedAdapter(layout, self.chunk).check_geometry(self.buffers.geometry)
        cfg = AgentConfig(hbm_bytes=self.settings.hbm_bytes, verify_loads=self.settings.verify_loads)
        self._make_agent = lambda client: GPUAgent(client, layout, ns, device=tensors[0].device, config=cfg)
        self._connect()
        log.info(
            "KVStoreConnector: %d layers, page geometry %s, chunks of %d tokens, namespace %s",
            len(names),
            self.buffers.geometry,
            self.chunk,
            ns.fingerprint.hex(),
        )

    def _connect(self) -> bool:
        """Attach to the node; a node that is not up (yet) is not an engine failure: the
        engine serves without the cache and this is retried every ``RETRY_S``.  A target
        that can never work here (not a local ``unix://`` node) is a configuration error."""
        if self.agent is not None:
            return True
        now = time.monotonic()
        if now < self._next_try:
            return False
        self._next_try = now + RETRY_S
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
                RETRY_S,
            )
            return False

    def _pull_remote(self, spec: LoadSpec) -> None:
        """Chunks the scheduler found through ``lookup_target`` (another node, a cluster)
        that this machine's node lacks: fetched over TCP (checksums verified end to end by
        the SDK) and put into the local node, so the load that follows is zero-copy.  A
        chunk that cannot be fetched stays missing: the load stops before it and vLLM
        recomputes from there."""
        first = spec.first_page * self.spec.block_size // self.chunk  # type: ignore[union-attr]
        chain = chunk_keys(spec.tokens[: spec.num_tokens], spec.namespace)
        keys = chain[first:]
        if not keys:
            return
        t0 = time.perf_counter()
        try:
            local = self.agent.client.lookup(keys)
            missing = [i for i, t in enumerate(local) if t is None]
            if not missing:
                return
            if self._remote is None:
                self._remote = self.settings.client(self.settings.lookup_target)
            got = self._remote.get_many([keys[i] for i in missing])
            parents = parent_keys(chain)[first:]
            have = [(keys[i], parents[i], d) for i, d in zip(missing, got) if d is not None]
            if have:
                ok = self.agent.client.put_many(
                    [k for k, _, _ in have],
                    [d for _, _, d in have],
                    namespace=spec.namespace,
                    parents=[p for _, p, _ in have],
                    token_counts=[self.chunk] * len(have),
                )
                self.counters["pulled_blocks"] += sum(ok)
        except Exception as e:  # noqa: BLE001 - the load goes on with what this node has (the rest recomputes)
            log.warning(
                "kvstore: fetching %s's chunks from %s failed (%s); loading what this node has",
                spec.req_id,
                self.settings.lookup_target,
                e,
                exc_info=not isinstance(e, KVStoreError),
            )
        finally:
            self.counters["pull_us"] += int((time.perf_counter() - t0) * 1e6)

    def start_load(self, meta: KVStoreMeta) -> None:
        if not self._connect():
            for spec in meta.loads:  # no node: every promised block is recomputed
                self._fail(spec, spec.first_page * self.spec.block_size)  # type: ignore[union-attr]
            return
        for spec in meta.loads:
            bs = self.spec.block_size  # type: ignore[union-attr]
            if self.settings.lookup_target:
                self._pull_remote(spec)
            ids = [-1 if j < spec.first_page else b for j, b in enumerate(spec.block_ids[: -(-spec.num_tokens // bs)])]
            t0 = time.perf_counter()
            try:
                h = self.agent.load(
                    spec.tokens, self.buffers, ids, namespace=spec.namespace, session_id=spec.session_id
                )
            except Exception as e:  # never a failed step: the engine recomputes what did not load
                log.warning("kvstore load for %s failed (%s); recomputing", spec.req_id, e)
                h = None
            self.counters["load_us"] += int((time.perf_counter() - t0) * 1e6)
            got = h.num_tokens if h is not None else 0
            if got < spec.num_tokens:
                self._fail(spec, got)
            self._loads.append((spec, h))
            self.counters["loads"] += 1
            self.counters["load_tokens"] += max(0, got - spec.first_page * bs)
        self._check_agent()

    def _check_agent(self) -> None:
        """An agent whose store calls failed is dropped (after its transfers end) and
        attached afresh in RETRY_S: a restarted node has a new arena and socket."""
        if self.agent is None:
            return
        errors = int(self.agent.stats()["counters"].get("store_errors", 0))
        if errors > self._store_errors:
            log.warning(
                "KVStoreConnector: the node at %s failed; re-attaching in %.0f s", self.settings.target, RETRY_S
            )
            self._retire_agent()
            self._next_try = time.monotonic() + RETRY_S
        self._store_errors = errors if self.agent is not None else 0

    def _retire_agent(self) -> None:
        agent, self.agent = self.agent, None
        if agent is None:
            return
        for _, h in self._loads:
            if h is not None:
                try:
                    h.wait(timeout=self.settings.load_timeout_s)
                except Exception:  # the load is already counted as failed
                    pass
        for handle, _ in list(self._saving.values()):
            if handle is not None:
                try:
                    handle.wait(self.settings.load_timeout_s)
                except Exception:  # a failed save is a future miss
                    pass
        client = agent.client
        agent.close()
        client.close()

    def _fail(self, spec: LoadSpec, from_token: int) -> None:
        bs = self.spec.block_size  # type: ignore[union-attr]
        first = max(spec.first_page, from_token // bs)
        bad = spec.block_ids[first : -(-spec.num_tokens // bs)]
        self._errors.update(bad)
        self.counters["load_errors"] += len(bad)
        keys = chunk_keys(spec.tokens[: spec.num_tokens], spec.namespace)[from_token // self.chunk :]
        if keys:
            self._events.append(BlockRemoved(block_hashes=list(keys), medium=MEDIUM_CPU))

    def wait_layer(self, layer_name: str) -> None:
        i = self.layer_index.get(layer_name)
        if i is None:
            return
        for _, h in self._loads:
            if h is not None:
                h.wait_layer(i)

    def wait_for_save(self, meta: KVStoreMeta) -> None:
        loads, self._loads = self._loads, []
        for spec, h in loads:
            if h is None:
                continue
            try:
                ok = h.wait(timeout=self.settings.load_timeout_s)
            except Exception as e:
                log.warning("kvstore load for %s did not finish (%s)", spec.req_id, e)
                ok = False
            if not ok:
                self._fail(spec, spec.first_page * self.spec.block_size)  # type: ignore[union-attr]
        if meta.saves and not self._connect():
            return  # no node: nothing saved, later requests miss
        for s in meta.saves:
            t0 = time.perf_counter()
            try:
                handle = self.agent.save(
                    s.tokens,
                    self.buffers,
                    s.block_ids,
                    namespace=s.namespace,
                    skip_chunks=s.skip_chunks,
                    session_id=s.session_id,
                )
            except Exception as e:  # a save that cannot run is a future miss, never a failed step
                log.warning("kvstore save for %s failed (%s)", s.req_id, e)
                handle = None
            self.counters["save_us"] += int((time.perf_counter() - t0) * 1e6)
            self.counters["saves"] += 1
            self._saving[s.req_id] = (handle, s)
        if meta.saves:
            self._check_agent()

    def finished(self, finished_req_ids: set[str]) -> set[str] | None:
        """Requests vLLM has finished whose save is committed (each reported once)."""
        self._told |= finished_req_ids & (set(self._saving) | self._saved)
        for rid in list(self._saving):
            handle, s = self._saving[rid]
            if handle is not None and not handle.done():
                continue
            del self._saving[rid]
            self._saved.add(rid)
            if handle is None:
                continue
            try:
                res = handle.wait(0)
            except Exception as e:
                log.warning("kvstore save for %s failed (%s)", rid, e)
                continue
            if res.stored:
                keys = chunk_keys(s.tokens, s.namespace)[s.skip_chunks :]
                self._events.append(
                    BlockStored(
                        block_hashes=list(keys),
                        parent_block_hash=None,
                        token_ids=list(s.tokens[s.skip_chunks * self.chunk :]),
                        block_size=self.chunk,
                        lora_id=None,
                        medium=MEDIUM_CPU,
                        lora_name=s.namespace.lora_id or None,
                    )
                )
        out = self._saved & self._told
        self._saved -= out
        self._told -= out
        if not self.settings.defer_free:
            self._saved.clear()  # the scheduler freed these blocks at once: nothing to report
            return None
        return out or None

    def take_stats(self) -> KVStoreStats | None:
        """The counters since the last call (None when nothing happened)."""
        now = {k: int(self.counters.get(k, 0)) for k in STAT_KEYS}
        delta = KVStoreStats({k: now[k] - self._reported[k] for k in STAT_KEYS})
        self._reported = now
        return None if delta.is_empty() else delta

    def take_errors(self) -> set[int]:
        out, self._errors = self._errors, set()
        return out

    def take_events(self) -> KVStoreEvents | None:
        if not self._events:
            return None
        ev = KVStoreEvents(1)
        ev.add_events(self._events)
        self._events = []
        return ev

    def close(self) -> None:
        for handle, _ in self._saving.values():
            if handle is not None:
                try:
                    handle.wait(self.settings.load_timeout_s)
                except Exception:
                    pass
        if self._remote is not None:
            self._remote.close()
            self._remote = None
        self._retire_agent()


# -- the connector ------------------------------------------------------------------------
class KVStoreConnector(KVConnectorBase_V1):
    """kvstore for vLLM: see the module docstring."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)  # type: ignore[arg-type]
        tc = self._kv_transfer_config
        self.settings = ConnectorSettings.from_extra(tc.kv_connector_extra_config)
        block = int(vllm_config.cache_config.block_size)
        self.chunk = self.settings.chunk_for(block)
        self._scheduler: _SchedulerSide | None = None
        self._worker: _WorkerSide | None = None
        if getattr(tc, "kv_load_failure_policy", "recompute") != "recompute" and role == KVConnectorRole.SCHEDULER:
            log.warning(
                "kv_load_failure_policy=%r: a block kvstore cannot load (gone, corrupt, node down) fails the request; "
                "set kv_load_failure_policy='recompute' to recompute it instead",
                tc.kv_load_failure_policy,
            )
        if role == KVConnectorRole.SCHEDULER:
            spec = engine_spec(vllm_config, kv_cache_config, worker=False, model_id=self.settings.model_id)
            self._scheduler = _SchedulerSide(
                spec, self.settings, self.chunk, produce=bool(tc.is_kv_producer), consume=bool(tc.is_kv_consumer)
            )
        else:
            engine_spec(
                vllm_config, kv_cache_config, worker=False, model_id=self.settings.model_id
            )  # fail at start, not at register
            self._worker = _WorkerSide(vllm_config, kv_cache_config, self.settings, self.chunk)  # type: ignore[arg-type]

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a future miss

    # -- worker ----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if self._worker is not None and isinstance(meta, KVStoreMeta) and meta.loads:
            self._worker.start_load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is not None:
            self._worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return None  # whole prompts are saved in wait_for_save, once every layer is written

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if self._worker is not None and isinstance(meta, KVStoreMeta):
            self._worker.wait_for_save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        return self._worker.finished(finished_req_ids), None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_errors() if self._worker is not None else set()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self._worker.take_stats() if self._worker is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVStoreStats(dict(data or {}))

    def get_kv_connector_kv_cache_events(self) -> KVConnectorKVEvents | None:
        return self._worker.take_events() if self._worker is not None else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()

    # -- scheduler -------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.matched(request, num_computed_tokens)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        assert self._scheduler is not None
        return self._scheduler.hit_sources(request, num_external_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._scheduler is not None:
            self._scheduler.worker_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.finished(request)

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self._scheduler.take_events() if self._scheduler is not None else ()

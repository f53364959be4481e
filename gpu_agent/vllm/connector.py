"""``KVStoreConnector``: kvstore as a vLLM (v1) KV connector.

    KVTransferConfig(kv_connector="KVStoreConnector", kv_connector_module_path="gpu_agent.vllm",
                     kv_role="kv_both", kv_connector_extra_config={"target": "unix:///…/kvstore.sock"})

vLLM makes one instance in the scheduler process and one in each worker; this class
only routes vLLM's calls to the half it is, each hook to the half's method of the same
name (``get_num_new_matched_tokens``, ``start_load_kv``, ``get_finished``, ...):

* scheduler (:mod:`gpu_agent.vllm.scheduler`): lookups beyond vLLM's own prefix cache,
  per-request bookkeeping, and each step's :class:`~gpu_agent.vllm.metadata.KVStoreMeta`;
* worker (:mod:`gpu_agent.vllm.worker`): the loads and saves, through one GPU agent;
* what both share: the namespaces (:mod:`gpu_agent.vllm.spec`), the counters
  (:mod:`gpu_agent.vllm.stats`) and the KV events (:mod:`gpu_agent.vllm.events`);
* the engine's record in etcd (:mod:`gpu_agent.vllm.registry`, with ``advertise_url``): the
  scheduler half registers it at start and revokes it in ``shutdown``.

Invariants: the scheduler and the workers derive the same namespace from the same
config, each worker for its own rank; a request whose blocks are held for its saves
(``request_finished`` → True) is reported by ``get_finished`` exactly once.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from gpu_agent.vllm.metadata import KVStoreMeta
from gpu_agent.vllm.registry import start_registration
from gpu_agent.vllm.scheduler import SchedulerSide
from gpu_agent.vllm.settings import ConnectorSettings
from gpu_agent.vllm.spec import engine_spec
from gpu_agent.vllm.stats import KVStorePromMetrics, KVStoreStats
from gpu_agent.vllm.worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent, KVConnectorKVEvents
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvstore.cluster.engines import EngineRegistrar

log = logging.getLogger(__name__)


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
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._registrar: EngineRegistrar | None = None  # the engine's record in etcd (advertise_url)
        spec = engine_spec(vllm_config, kv_cache_config, model_id=self.settings.model_id)  # fails at start, not later
        if role == KVConnectorRole.SCHEDULER:
            if getattr(tc, "kv_load_failure_policy", "recompute") != "recompute":
                log.warning(
                    "kv_load_failure_policy=%r: a block kvstore cannot load (gone, corrupt, node down) fails the "
                    "request; set kv_load_failure_policy='recompute' to recompute it instead",
                    tc.kv_load_failure_policy,
                )
            kv_events = getattr(vllm_config, "kv_events_config", None)
            self._scheduler = SchedulerSide(
                spec,
                self.settings,
                self.chunk,
                produce=bool(tc.is_kv_producer),
                consume=bool(tc.is_kv_consumer),
                events=bool(getattr(kv_events, "enable_kv_cache_events", False)),
            )
            self._registrar = start_registration(vllm_config, spec, self.settings, self.chunk)
        else:
            self._worker = WorkerSide(vllm_config, kv_cache_config, self.settings, self.chunk)  # type: ignore[arg-type]

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a future miss

    # -- worker ----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.bind_connector_metadata(connector_metadata)  # timed from here; CUDA saves reserve ahead

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if self._worker is not None:
            self._worker.handle_preemptions(kv_connector_metadata)  # saves off the step: cancel before reuse

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if self._worker is not None and isinstance(meta, KVStoreMeta) and meta.loads:
            self._worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is not None:
            self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return None  # each step's completed chunks are saved in wait_for_save, once every layer is written

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if self._worker is not None and isinstance(meta, KVStoreMeta):
            self._worker.wait_for_save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        return self._worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors() if self._worker is not None else set()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._worker is not None:
            return self._worker.get_kv_connector_stats()
        return self._scheduler.get_kv_connector_stats() if self._scheduler is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVStoreStats(dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[Any], type[Any]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return KVStorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_kv_connector_kv_cache_events(self) -> KVConnectorKVEvents | None:
        return self._worker.get_kv_connector_kv_cache_events() if self._worker is not None else None

    def shutdown(self) -> None:
        registrar, self._registrar = self._registrar, None
        if registrar is not None:
            registrar.close()  # the engine leaves the registry first: no request is routed to it now
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    # -- scheduler -------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        assert self._scheduler is not None
        return self._scheduler.get_external_cache_hit_sources(request, num_external_tokens)

    def on_new_request(self, request: Request) -> None:
        if self._scheduler is not None:
            self._scheduler.on_new_request(request)  # its lookup starts now, off the scheduler thread

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._scheduler is not None:
            self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request)

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self._scheduler.take_events() if self._scheduler is not None else ()

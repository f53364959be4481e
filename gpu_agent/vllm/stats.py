"""The connector's counters as vLLM collects them: logged each interval and exported to
Prometheus as ``vllm:kvstore_*`` next to the engine's own metrics.

Workers report loads and saves; the scheduler reports its lookups (how many prompt tokens
the store supplied, how many vLLM's own prefix cache did).  Each side reports deltas
since its last report; vLLM sums them over workers and intervals (:meth:`aggregate`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig

WORKER_KEYS = (
    "loads",
    "load_tokens",
    "load_errors",
    "saves",
    "load_us",
    "save_us",
    "pulled_blocks",
    "pull_us",
    "async_load_tokens",
)
SCHEDULER_KEYS = (
    "lookups",
    "lookup_errors",
    "lookup_us",
    "hit_tokens",
    "local_hit_tokens",
    "handoff_waits",
    "handoff_timeouts",
    "unkeyable_requests",
    "async_loads",
)
STAT_KEYS = WORKER_KEYS + SCHEDULER_KEYS

PROM_HELP = {
    "loads": "Loads from kvstore into the engine's KV cache.",
    "load_tokens": "Tokens whose KV was loaded from kvstore (summed over workers).",
    "load_errors": "Engine blocks kvstore failed to load (recomputed).",
    "saves": "Saves from the engine's KV cache into kvstore.",
    "pulled_blocks": "Blocks fetched from other kvstore nodes into the local one.",
    "async_load_tokens": "Tokens loaded in the background while the engine kept stepping (summed over workers).",
    "async_loads": "Hits the scheduler sent to load in the background (vLLM's load_kv_async).",
    "lookups": "Prefix lookups the scheduler made in kvstore.",
    "lookup_errors": "Prefix lookups that failed (the request recomputed).",
    "hit_tokens": "Prompt tokens kvstore supplied (scheduler's count).",
    "local_hit_tokens": "Prompt tokens vLLM's own prefix cache supplied before kvstore was asked.",
    "handoff_waits": "Scheduler steps a request waited for its producer's chunks to be committed.",
    "handoff_timeouts": "Requests whose producer's chunks were not all committed within deadline_s.",
    "unkeyable_requests": "Requests neither loaded nor saved (multimodal inputs, prompt embeddings).",
}


@dataclasses.dataclass
class KVStoreStats(KVConnectorStats):
    """The counters over one interval, from every worker and the scheduler."""

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
            "lookups": d["lookups"],
            "lookup errors": d["lookup_errors"],
            "avg lookup ms": round(d["lookup_us"] / d["lookups"] / 1e3, 3) if d["lookups"] else 0.0,
            "hit tokens": d["hit_tokens"],
            "local hit tokens": d["local_hit_tokens"],
        }

    def is_empty(self) -> bool:
        return not any(self.data.get(k, 0) for k in STAT_KEYS)


def delta(counters: dict[str, int], reported: dict[str, int], keys: tuple[str, ...]) -> KVStoreStats | None:
    """The counters since ``reported`` (updated in place); None when nothing moved."""
    now = {k: int(counters.get(k, 0)) for k in keys}
    out = KVStoreStats({k: now[k] - reported.get(k, 0) for k in keys})
    reported.update(now)
    return None if out.is_empty() else out


class KVStorePromMetrics(KVConnectorPromMetrics):
    """``vllm:kvstore_<counter>_total``, one Prometheus counter per connector counter."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[Any], type[Any]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            k: self._counter_cls(name=f"vllm:kvstore_{k}", documentation=doc, labelnames=labelnames)
            for k, doc in PROM_HELP.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for k, counter in self._counters.items():
            v = int(transfer_stats_data.get(k, 0))
            if v > 0:
                counter.labels(*labels).inc(v)

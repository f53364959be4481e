"""The connector's counters as vLLM collects them: logged each interval and exported to
Prometheus as ``vllm:kvstore_*`` next to the engine's own metrics.

Workers report loads and saves; the scheduler reports its lookups (how many prompt tokens
the store supplied, how many vLLM's own prefix cache did).  Each side reports deltas
since its last report; vLLM sums them over workers and intervals (:meth:`aggregate`).

Where the connector's time goes (:data:`PHASES`): each side also keeps the durations it
measured since its last report (:class:`Timings`, drained into ``data["<phase>_s"]`` lists
that :meth:`KVStoreStats.aggregate` concatenates), exported as the Prometheus histograms
``vllm:kvstore_<phase>_seconds`` over :data:`BUCKETS`.  The scheduler's phases: ``lookup``
(one ``get_num_new_matched_tokens`` call), ``request_sched`` (a request's scheduler-thread
connector time, observed when it finishes) and ``sched_step`` (``build_connector_meta``);
the workers': ``load_wait`` (a step's wait for its loads), ``save_wait`` (``wait_for_save``)
and ``step_wait`` (every connector call of one forward pass, summed).  Off the engine's
threads: ``store_lookup`` (the store's answer to one lookup, on the scheduler half's store
link) and ``background_save`` (one save on the worker's saver thread).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np
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
    "save_chunks",
    "pulled_blocks",
    "pull_us",
    "async_load_tokens",
    "saves_cancelled",
    "saves_dropped",
    "prefill_step_us",
    "prefill_step_tokens",
    "load_local_us",
    "load_local_tokens",
    "load_local_n",
    "load_nvme_us",
    "load_nvme_tokens",
    "load_nvme_n",
    "load_remote_us",
    "load_remote_tokens",
    "load_remote_n",
    "view_stale_hits",
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
    "lookups_cached",
    "lookup_pending",
    "lookup_timeouts",
    "lookup_given_up",
    "lookups_skipped",
    "skipped_save_chunks",
    "gated_tokens",
    "view_lookups",
    "loads_failed",
    "prefetches",
    "prefetch_blocks",
    "prefetch_skipped",
    "prefetch_errors",
    "prefetch_us",
)
STAT_KEYS = WORKER_KEYS + SCHEDULER_KEYS

SCHEDULER_PHASES = ("lookup", "request_sched", "sched_step", "store_lookup", "view_lag")
WORKER_PHASES = ("load_wait", "save_wait", "step_wait", "background_save")
PHASES = SCHEDULER_PHASES + WORKER_PHASES
BUCKETS = tuple(
    round(m * 10.0**e, 6) for e in range(-5, 1) for m in (1, 1.5, 2, 3, 5, 7) if 5e-5 <= m * 10.0**e <= 7
) + (10.0,)
"""Histogram bounds in seconds, 50 µs to 10 s, six a decade (1, 1.5, 2, 3, 5, 7)."""
PHASE_HELP = {
    "lookup": "Seconds one get_num_new_matched_tokens call took on vLLM's scheduler thread.",
    "request_sched": "Seconds of vLLM's scheduler thread one request spent in the connector (at its end).",
    "sched_step": "Seconds build_connector_meta took on vLLM's scheduler thread, per step.",
    "load_wait": "Seconds one forward pass waited for the connector's loads.",
    "save_wait": "Seconds wait_for_save held one forward pass.",
    "step_wait": "Seconds one forward pass spent in connector calls, all of them.",
    "store_lookup": "Seconds the store took to answer one lookup (on the connector's own thread).",
    "view_lag": "Seconds from a change on a node to the pool's view applying it (lookups='view'), per update.",
    "background_save": "Seconds one save took on the saver thread (Reserve, copy, checksum), off the step.",
}


class Timings:
    """Durations measured since the last :meth:`take`, per phase (owned by one connector
    half; appended to from its own thread only)."""

    def __init__(self, phases: tuple[str, ...]) -> None:
        self.phases = phases
        self._samples: dict[str, list[float]] = {p: [] for p in phases}

    def add(self, phase: str, seconds: float) -> None:
        self._samples[phase].append(seconds)

    def take(self) -> dict[str, list[float]]:
        """``{"<phase>_s": [seconds, ...]}`` of the phases with samples; empties them."""
        out = {f"{p}_s": v for p, v in self._samples.items() if v}
        self._samples = {p: [] for p in self.phases}
        return out


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
    "lookups_cached": "Scheduler asks answered from the request's earlier lookup (no store call).",
    "lookup_pending": "Scheduler asks answered 'not yet' (the lookup runs on the connector's thread).",
    "lookup_timeouts": "Lookups not answered within deadline_s (the request recomputed).",
    "lookup_given_up": "Requests computed without waiting for their lookup (their class rarely hits: lookup_odds).",
    "lookups_skipped": "Requests not looked up: their class finds less than a lookup costs (lookup_odds; probes still ask).",
    "skipped_save_chunks": "Computed chunks save_policy did not store (not expected to be read again).",
    "gated_tokens": "Hit tokens recomputed because loading them was measured slower (the load gate).",
    "view_lookups": "Scheduler asks answered from the pool's in-process view (lookups='view': no store call).",
    "loads_failed": "Requests whose load failed (vLLM recomputed the rest; the request is not loaded again).",
    "view_stale_hits": "Loads planned from the pool's view that found fewer chunks than it promised (recomputed).",
    "saves_cancelled": "Saves dropped because vLLM preempted their request before its pages were copied.",
    "saves_dropped": "Saves dropped because the saver thread was too far behind (a future miss, never a held step).",
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
        for p in PHASES:
            more = other.data.get(f"{p}_s")
            if more:
                data: dict[str, Any] = self.data
                data[f"{p}_s"] = [*data.get(f"{p}_s", ()), *more]
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
            **{f"{p} p50 ms": round(float(np.median(d[f"{p}_s"])) * 1e3, 3) for p in PHASES if d.get(f"{p}_s")},
        }

    def is_empty(self) -> bool:
        return not any(self.data.get(k, 0) for k in STAT_KEYS) and not any(self.data.get(f"{p}_s") for p in PHASES)


def delta(
    counters: dict[str, int], reported: dict[str, int], keys: tuple[str, ...], timings: Timings | None = None
) -> KVStoreStats | None:
    """The counters since ``reported`` (updated in place) and the durations ``timings`` measured
    since the last call (drained); None when nothing moved."""
    now = {k: int(counters.get(k, 0)) for k in keys}
    data: dict[str, Any] = {k: now[k] - reported.get(k, 0) for k in keys}
    reported.update(now)
    if timings is not None:
        data.update(timings.take())
    out = KVStoreStats(data)
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
        self._histograms = {
            p: self._histogram_cls(
                name=f"vllm:kvstore_{p}_seconds", documentation=doc, buckets=list(BUCKETS), labelnames=labelnames
            )
            for p, doc in PHASE_HELP.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for k, counter in self._counters.items():
            v = int(transfer_stats_data.get(k, 0))
            if v > 0:
                counter.labels(*labels).inc(v)
        for p, hist in self._histograms.items():
            samples = transfer_stats_data.get(f"{p}_s")
            if samples:
                h = hist.labels(*labels)
                for v in samples:
                    h.observe(float(v))

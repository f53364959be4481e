"""The conductor's Prometheus metrics (``/metrics``), in a registry of its own.

Owned by the :class:`~kvstore.conductor.service.Conductor`; updated on its loop.  Gauges
that describe engines and views (live, queued prefill tokens, running decodes, view
staleness) are refreshed from the conductor's state when ``/metrics`` is scraped."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64)


class ConductorMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "kvstore_conductor_requests",
            "Requests sent to each engine (decode engine in prefill/decode mode)",
            ["engine"],
            registry=r,
        )
        self.outcomes = Counter(
            "kvstore_conductor_outcomes",
            "Requests by how they ended: served, engine_error, client_gone, rejected, bad_request",
            ["outcome"],
            registry=r,
        )
        self.rejected = Counter(
            "kvstore_conductor_rejected",
            "Requests refused early (429): the estimate missed the ttft or tbt target",
            ["slo"],
            registry=r,
        )
        self.hit_tokens = Counter(
            "kvstore_conductor_hit_tokens",
            "Prompt tokens of routed requests by predicted source: engine (its own cache), pool_dram, pool_nvme, pool_remote, compute",
            ["source"],
            registry=r,
        )
        self.ttft = Histogram(
            "kvstore_conductor_ttft_seconds",
            "Time to first token: predicted at decision, and measured",
            ["kind"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.decision_seconds = Histogram(
            "kvstore_conductor_decision_seconds",
            "Time to decide one request (keys, engine caches, estimates)",
            buckets=(25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 0.01, 0.05),
            registry=r,
        )
        self.refusal_seconds = Histogram(
            "kvstore_conductor_refusal_seconds",
            "From a refused request's arrival to its 429",
            buckets=(1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
            registry=r,
        )
        self.pool_errors = Counter(
            "kvstore_conductor_pool_errors", "Pool lookups that failed (routed without the pool)", registry=r
        )
        self.pool_late = Counter(
            "kvstore_conductor_pool_late",
            "Pool lookups not answered within the decision's budget (routed without the pool; not errors)",
            registry=r,
        )
        self.engine_up = Gauge("kvstore_conductor_engine_up", "1 if the engine answers", ["engine"], registry=r)
        self.queued = Gauge(
            "kvstore_conductor_engine_queued_tokens",
            "Prefill tokens queued on the engine (the estimate's)",
            ["engine"],
            registry=r,
        )
        self.running = Gauge("kvstore_conductor_engine_running", "Decodes the engine runs", ["engine"], registry=r)
        self.staleness = Gauge(
            "kvstore_conductor_view_staleness_seconds",
            "Seconds since the engine's last KV event (-1: it publishes none)",
            ["engine"],
            registry=r,
        )

"""The connector's stats as vLLM collects them: per-interval deltas from each worker,
summed over workers, reduced to what vLLM logs."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm


def test_worker_stats_are_deltas_summed_over_workers_and_reduced() -> None:
    from gpu_agent.vllm.connector import KVStoreConnector
    from gpu_agent.vllm.stats import STAT_KEYS, KVStoreStats

    a = KVStoreConnector.build_kv_connector_stats(
        {"loads": 2, "load_tokens": 512, "load_us": 3000, "saves": 1, "save_us": 500}
    )
    b = KVStoreStats({"loads": 1, "load_tokens": 256, "load_us": 1500, "load_errors": 2})
    assert isinstance(a, KVStoreStats) and set(a.data) == set(STAT_KEYS)
    total = a.aggregate(b).reduce()
    assert total["loads"] == 3 and total["tokens loaded"] == 768 and total["blocks failed to load"] == 2
    assert total["avg load ms"] == 1.5 and total["avg save ms"] == 0.5
    assert KVStoreStats().is_empty() and not b.is_empty()
    b.reset()
    assert b.is_empty()


def test_a_worker_reports_each_count_once() -> None:
    from gpu_agent.vllm.settings import ConnectorSettings
    from gpu_agent.vllm.worker import WorkerSide

    w = WorkerSide(None, None, ConnectorSettings(), 256)  # type: ignore[arg-type]
    assert w.get_kv_connector_stats() is None
    w.counters["loads"] += 1
    w.counters["load_tokens"] += 256
    got = w.get_kv_connector_stats()
    assert got is not None and got.data["loads"] == 1 and got.data["load_tokens"] == 256
    assert w.get_kv_connector_stats() is None  # nothing new since

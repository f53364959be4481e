"""The dashboard's parsing of ``/metrics`` and its cluster sums and deltas (no network)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest

from kvstore.dashboard.model import ClusterModel
from kvstore.dashboard.scrape import MAX_NAMESPACES, Scrape, metrics_url, parse, quantile
from kvstore.node.ledger import Ledger
from kvstore.node.metrics import families


def exposition(ledger: Ledger, counters: dict[str, int] | None = None) -> str:
    snap = snapshot(ledger, counters)

    class C:
        def collect(self):  # type: ignore[no-untyped-def]
            return families(snap, node_id="n1", version="9.9", started=1.0)

    reg = CollectorRegistry()
    reg.register(C())  # type: ignore[arg-type]
    return generate_latest(reg).decode()


def snapshot(ledger: Ledger, counters: dict[str, int] | None = None) -> dict[str, object]:
    return {
        "tiers": {"dram": {"capacity_bytes": 100, "used_bytes": 40, "blocks": 4}},
        "counters": counters or {},
        "reservations": 0,
        "leases": 1,
        "pins": 0,
        "ledger": ledger.snapshot(),
        "history": {"capacity": 16, "records": 0},
        "extra": {},
    }


def scrape_of(hits: int, misses: int, evictions: int = 0) -> Scrape:
    led = Ledger()
    from kvstore.block import BlockMeta

    m = BlockMeta.for_payload(bytes(16), b"x", namespace=b"ns-one..", token_count=10)
    for _ in range(hits):
        led.record("get", [("dram", m)])
    for _ in range(misses):
        led.record("get", [], [("evicted", 0)])
    return parse(exposition(led, {"dram_evictions": evictions}))


def test_parse_reads_the_families_the_page_uses() -> None:
    s = scrape_of(3, 2, evictions=5)
    assert s.ok and s.info == {"node_id": "n1", "version": "9.9"}
    assert s.counters["lookups/get"] == 5
    assert s.counters["hits/get/dram"] == 3 and s.counters["hit_tokens/get/dram"] == 30
    assert s.counters["misses/get/evicted"] == 2 and s.counters["misses/get/node_down"] == 0
    assert s.counters["evictions/dram"] == 5
    assert s.counters[f"ns/{b'ns-one..'.hex()}/get/hits"] == 3
    assert s.gauges["tier/dram/capacity"] == 100 and s.gauges["tier/dram/used"] == 40 and s.gauges["leases"] == 1


def test_parse_refuses_what_is_not_a_kvstore_node() -> None:
    with pytest.raises(ValueError):
        parse("# HELP up whatever\n# TYPE up gauge\nup 1\n")


def test_namespace_label_explosion_is_capped() -> None:
    lines = ['kvstore_node_info{node_id="x",version="1"} 1']
    lines += [f'kvstore_namespace_hit_blocks_total{{namespace="{i:016x}",op="get"}} 1' for i in range(5000)]
    s = parse("\n".join(lines) + "\n")
    ns = {k.split("/")[1] for k in s.counters if k.startswith("ns/")}
    assert len(ns) <= MAX_NAMESPACES + 1 and "other" in ns
    assert sum(v for k, v in s.counters.items() if k.startswith("ns/")) == 5000  # nothing lost, only folded


def test_deltas_survive_restarts_and_outages() -> None:
    m = ClusterModel()
    m.update({"a": ("u", scrape_of(10, 0), ""), "b": ("u", scrape_of(5, 5), "")}, now=100.0)
    m.update({"a": ("u", scrape_of(12, 1), ""), "b": ("u", Scrape(at=0, ok=False, error="unreachable"), "")}, now=101.0)
    m.update({"a": ("u", scrape_of(1, 0), ""), "b": ("u", scrape_of(6, 5), "")}, now=102.0)  # a restarted; b is back
    h = list(m.history)
    assert h[1]["d"]["lookups/get"] == 3  # a: +2 hits +1 miss; b was down
    assert (
        h[2]["d"]["lookups/get"] == 1
    )  # a restarted (1 lookup since), b's first scrape after its outage is a new baseline
    assert all(v >= 0 for p in h for v in p["d"].values())
    v = m.view()
    assert {n["name"]: n["status"] for n in v["nodes"]} == {"a": "up", "b": "up"}
    # as Prometheus' increase(): a's 10, +3, then its reset counts whole (+1); b's 10, +1 across its outage
    assert v["totals"]["lookups/get"] == (10 + 3 + 1) + (10 + 1)


def test_totals_never_go_backwards_when_nodes_die_restart_or_leave() -> None:
    """Regression (issue 16 #3): 6,729 → 4,624 blocks looked up when a node died."""
    m = ClusterModel()
    m.update({"a": ("u", scrape_of(1, 1), ""), "b": ("u", scrape_of(3, 1), "")}, now=100.0)
    seen = [m.view()["totals"]["lookups/get"]]
    m.update({"a": ("u", Scrape(at=0, ok=False, error="unreachable: refused"), "")}, now=101.0)  # a down, b left
    v = m.view()
    nodes = {n["name"]: n for n in v["nodes"]}
    assert nodes["a"]["status"] == "down" and "refused" in nodes["a"]["error"]
    assert nodes["b"]["status"] == "left"
    seen.append(v["totals"]["lookups/get"])
    assert v["replication"]["suspected"] == ["n1"] and v["replication"]["nodes"] == 1
    m.update({"a": ("u", scrape_of(0, 1), "")}, now=102.0)  # a restarted: 1 lookup since
    seen.append(m.view()["totals"]["lookups/get"])
    m.update({"a": ("u", scrape_of(0, 1), "")}, now=101.0 + 1000)
    v = m.view()
    assert [n["name"] for n in v["nodes"]] == ["a"]  # b forgotten after a while, its counts kept
    seen.append(v["totals"]["lookups/get"])
    assert seen == [6, 6, 7, 7]


def test_names_node_ids_and_replication_health() -> None:
    led = Ledger()
    led.name(b"ns-one..", "llama-3-8b")
    led.short_copies = 4
    led.skipped_saves = 9
    s = parse(exposition(led))
    assert s.names == {b"ns-one..".hex(): "llama-3-8b"} and s.counters["under_replicated"] == 4
    assert s.counters["skipped_saves"] == 9
    m = ClusterModel()
    m.update(
        {"127.0.0.1:9400": ("http://127.0.0.1:9400/metrics", s, "")},
        now=100.0,
        names={"ff" * 8: "from etcd"},
        replication=2,
    )
    v = m.view()
    assert v["names"] == {b"ns-one..".hex(): "llama-3-8b", "ff" * 8: "from etcd"}
    assert v["nodes"][0]["title"] == "n1"  # the node id, not its metrics address
    assert v["replication"] == {"factor": 2, "nodes": 1, "suspected": [], "under_replicated": 4}


def test_history_since_returns_only_new_points() -> None:
    m = ClusterModel()
    for t in range(5):
        m.update({"a": ("u", scrape_of(t, 0), "")}, now=100.0 + t)
    assert [p["seq"] for p in m.view(since=2)["history"]] == [3, 4]


def test_quantile_matches_prometheus_interpolation() -> None:
    bounds = [0.001, 0.01, 0.1, float("inf")]
    assert quantile(0.5, bounds, [0, 10, 10, 10]) == pytest.approx(0.0055)
    assert quantile(0.99, bounds, [0, 0, 0, 4]) == 0.1  # in the +Inf bucket: the last finite bound
    assert quantile(0.5, bounds, [0, 0, 0, 0]) is None


def test_metrics_url_forms() -> None:
    assert metrics_url("10.0.0.1:9400") == "http://10.0.0.1:9400/metrics"
    assert metrics_url("http://h:1") == "http://h:1/metrics"
    assert metrics_url("http://h:1/custom") == "http://h:1/custom"
    with pytest.raises(ValueError):
        metrics_url("nohost")


def test_parse_reads_the_per_agent_counters_a_node_exports() -> None:
    """The node's kvstore_agent_* families (NodeMetrics, as the service observes into them) come
    through as agent/<name>/<op>/<result> counters; a forged scrape with more agent labels
    than a node makes folds the rest into "other", losing no count."""
    from kvstore.node.metrics import NodeMetrics

    snap = exposition(Ledger())
    m = NodeMetrics("n1", "9.9", lambda: snapshot(Ledger()))
    sg = m.agent_label("sglang-hicache")
    m.observe_agent_blocks(sg, "read", 3, 1, 300)
    m.observe_agent_blocks(sg, "write", 2, 1, 200)
    m.observe_agent_blocks(m.agent_label(""), "lookup", 5, 0)
    m.observe_agent_call(sg, "Acquire", 0.25)
    s = parse(generate_latest(m.registry).decode())
    c = s.counters
    assert (c["agent/sglang-hicache/read/hit"], c["agent/sglang-hicache/read/miss"]) == (3, 1)
    assert (c["agent/sglang-hicache/write/stored"], c["agent/sglang-hicache/write/refused"]) == (2, 1)
    assert (c["agent/sglang-hicache/bytes/read"], c["agent/sglang-hicache/bytes/write"]) == (300, 200)
    assert (c["agent/sglang-hicache/calls/all"], c["agent/sglang-hicache/seconds/all"]) == (1, 0.25)
    assert c["agent/sdk/lookup/hit"] == 5
    forged = "\n".join(f'kvstore_agent_blocks_total{{agent="a{i}",op="read",result="hit"}} 1' for i in range(100))
    s = parse("# TYPE kvstore_agent_blocks counter\n" + forged + "\n" + snap)
    agents = {k.split("/")[1] for k in s.counters if k.startswith("agent/")}
    assert len(agents) <= 33 and "other" in agents
    assert sum(v for k, v in s.counters.items() if k.startswith("agent/")) == 100

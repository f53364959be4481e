"""Reading one node's ``/metrics`` into plain numbers (the dashboard's only input).

Pure except :func:`fetch` (one HTTP GET).  The dashboard reads exactly what Prometheus
reads, so the page and ``/metrics`` can never disagree.  Bounded against a misbehaving
endpoint: at most ``MAX_BODY`` bytes and ``MAX_SAMPLES`` samples per scrape, and at most
``MAX_NAMESPACES`` namespace label values per node.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time
import urllib.error
import urllib.request
from prometheus_client.parser import text_string_to_metric_families

MAX_BODY = 8 << 20
MAX_SAMPLES = 50_000
MAX_NAMESPACES = 64


def metrics_url(spec: str) -> str:
    """``HOST:PORT`` (or a full ``http://...`` URL) → the node's metrics URL."""
    spec = spec.strip()
    if spec.startswith(("http://", "https://")):
        return spec if spec.rstrip("/").count("/") > 2 else spec.rstrip("/") + "/metrics"
    host, sep, port = spec.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"a node's metrics endpoint is HOST:PORT or http://HOST:PORT/metrics, got {spec!r}")
    return f"http://{spec}/metrics"


@dataclasses.dataclass
class Scrape:
    """One node's numbers at one moment.  ``counters`` keys are ``family/label/label...`` paths."""

    at: float
    ok: bool
    error: str = ""
    scrape_ms: float = 0.0
    info: dict[str, str] = dataclasses.field(default_factory=dict)
    counters: dict[str, float] = dataclasses.field(default_factory=dict)
    gauges: dict[str, float] = dataclasses.field(default_factory=dict)
    # method -> (upper bounds, cumulative counts); the last bound is +Inf
    latency: dict[str, tuple[list[float], list[float]]] = dataclasses.field(default_factory=dict)


def fetch(url: str, *, token: str = "", timeout: float = 1.5) -> Scrape:
    """GET ``url`` and parse it; never raises (an unreachable node is a result)."""
    start = time.monotonic()
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - operator-given URL
            body = resp.read(MAX_BODY + 1)
        if len(body) > MAX_BODY:
            raise ValueError(f"metrics larger than {MAX_BODY >> 20} MiB")
        s = parse(body.decode("utf-8", "replace"))
    except urllib.error.HTTPError as e:
        hint = " (wrong or missing token: pass --token-file)" if e.code == 401 else ""
        s = Scrape(at=time.time(), ok=False, error=f"HTTP {e.code} {e.reason}{hint}")
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        s = Scrape(at=time.time(), ok=False, error=f"unreachable: {reason}")
    s.scrape_ms = (time.monotonic() - start) * 1000
    return s


def parse(text: str) -> Scrape:
    """Prometheus text → a :class:`Scrape` of the ``kvstore_*`` families the dashboard uses."""
    s = Scrape(at=time.time(), ok=True)
    c, g = s.counters, s.gauges
    buckets: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
    namespaces: set[str] = set()
    n = 0
    for fam in text_string_to_metric_families(text):
        if not fam.name.startswith("kvstore_"):
            continue
        for smp in fam.samples:
            n += 1
            if n > MAX_SAMPLES:
                raise ValueError(f"more than {MAX_SAMPLES} samples")
            name, lb, v = smp.name, smp.labels, float(smp.value)
            if not math.isfinite(v):
                continue
            if name == "kvstore_node_info":
                s.info = {"node_id": lb.get("node_id", ""), "version": lb.get("version", "")}
            elif name == "kvstore_start_time_seconds":
                g["start_time"] = v
            elif name == "kvstore_lookup_blocks_total":
                c[f"lookups/{lb['op']}"] = v
            elif name == "kvstore_lookup_requests_total":
                c[f"requests/{lb['op']}"] = v
            elif name == "kvstore_hit_blocks_total":
                c[f"hits/{lb['op']}/{lb['tier']}"] = v
            elif name == "kvstore_hit_tokens_total":
                c[f"hit_tokens/{lb['op']}/{lb['tier']}"] = v
            elif name == "kvstore_miss_blocks_total":
                c[f"misses/{lb['op']}/{lb['reason']}"] = v
            elif name in ("kvstore_namespace_hit_blocks_total", "kvstore_namespace_miss_blocks_total", "kvstore_namespace_hit_tokens_total"):
                ns = lb.get("namespace", "")
                if ns not in namespaces and len(namespaces) >= MAX_NAMESPACES:
                    ns = "other"
                namespaces.add(ns)
                kind = {"kvstore_namespace_hit_blocks_total": "hits", "kvstore_namespace_miss_blocks_total": "misses"}.get(name, "tokens")
                key = f"ns/{ns}/{lb['op']}/{kind}"
                c[key] = c.get(key, 0.0) + v
            elif name == "kvstore_evictions_total":
                c[f"evictions/{lb['tier']}"] = v
            elif name == "kvstore_promotions_total":
                c["promotions"] = v
            elif name == "kvstore_demotions_total":
                c["demotions"] = v
            elif name == "kvstore_bytes_total":
                c[f"bytes/{lb['path']}/{lb['direction']}"] = v
            elif name == "kvstore_corrupt_blocks_total":
                c[f"corrupt/{lb['stage']}"] = v
            elif name in ("kvstore_tier_capacity_bytes", "kvstore_tier_used_bytes", "kvstore_tier_blocks"):
                g[f"tier/{lb['tier']}/{name.removeprefix('kvstore_tier_').removesuffix('_bytes')}"] = v
            elif name in ("kvstore_leases", "kvstore_reservations", "kvstore_pins"):
                g[name.removeprefix("kvstore_")] = v
            elif name == "kvstore_rpc_duration_seconds_bucket":
                le = lb.get("le", "+Inf")
                buckets[lb["method"]].append((float("inf") if le == "+Inf" else float(le), v))
            elif name == "kvstore_rpc_duration_seconds_count":
                c[f"rpc/{lb['method']}"] = v
    if not s.info:
        raise ValueError("not a kvstore node (no kvstore_node_info)")
    for method, bs in buckets.items():
        bs.sort()
        s.latency[method] = ([b for b, _ in bs], [v for _, v in bs])
    return s


def quantile(q: float, bounds: list[float], counts: list[float]) -> float | None:
    """Prometheus' ``histogram_quantile`` over cumulative ``counts`` (linear within a bucket)."""
    if not counts or counts[-1] <= 0:
        return None
    rank = q * counts[-1]
    prev_b, prev_c = 0.0, 0.0
    for b, cnt in zip(bounds, counts):
        if cnt >= rank:
            if b == float("inf"):
                return prev_b
            if cnt == prev_c:
                return b
            return prev_b + (b - prev_b) * (rank - prev_c) / (cnt - prev_c)
        prev_b, prev_c = b, cnt
    return prev_b

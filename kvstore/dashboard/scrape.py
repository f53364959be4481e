"""Reading one node's ``/metrics`` into plain numbers (the dashboard's only input).

Pure except :func:`get` and :func:`fetch` (one HTTP or HTTPS GET; for ``https://`` endpoints with the
dashboard's :class:`~kvstore.tls.ClientTLS`: its CA, its client certificate under mutual TLS,
its ``server_name``).  The dashboard reads exactly what Prometheus reads, so the page and
``/metrics`` can never disagree.  Bounded against a misbehaving
endpoint: at most ``MAX_BODY`` bytes and ``MAX_SAMPLES`` samples per scrape, and at most
``MAX_NAMESPACES`` namespace label values per node.
"""

from __future__ import annotations

import collections
import dataclasses
import http.client
import math
import time
import urllib.error
import urllib.request
from typing import TYPE_CHECKING, Any

from prometheus_client.parser import text_string_to_metric_families

if TYPE_CHECKING:
    from kvstore.tls import ClientTLS

MAX_BODY = 8 << 20
MAX_SAMPLES = 50_000
MAX_NAMESPACES = 64
MAX_AGENTS = 32  # agent labels kept per scrape (a node exports at most 16 and "sdk" and "other")


def metrics_url(spec: str, scheme: str = "http") -> str:
    """``HOST:PORT`` (or a full ``http(s)://...`` URL, whose scheme wins) → the node's metrics URL."""
    spec = spec.strip()
    if spec.startswith(("http://", "https://")):
        return spec if spec.rstrip("/").count("/") > 2 else spec.rstrip("/") + "/metrics"
    host, sep, port = spec.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"a node's metrics endpoint is HOST:PORT or http(s)://HOST:PORT/metrics, got {spec!r}")
    return f"{scheme}://{spec}/metrics"


class _NodeHTTPS(http.client.HTTPSConnection):
    """HTTPS with a :class:`ClientTLS`: its context, and its ``server_name`` checked instead
    of the host dialled (nodes publish pod IPs that a shared certificate cannot list)."""

    def __init__(self, host: str, *, tls: ClientTLS, **kw: Any) -> None:
        kw.pop("check_hostname", None)
        super().__init__(host, **{**kw, "context": tls.context})
        self._tls = tls

    def connect(self) -> None:
        http.client.HTTPConnection.connect(self)  # TCP (and a proxy tunnel, if any)
        self.sock = self._tls.wrap(self.sock, getattr(self, "_tunnel_host", None) or self.host)  # http.client's


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, tls: ClientTLS) -> None:
        super().__init__(context=tls.context)
        self._tls = tls

    def https_open(self, req: urllib.request.Request) -> Any:
        return self.do_open(lambda host, **kw: _NodeHTTPS(host, tls=self._tls, **kw), req)


def _hint(url: str, error: str, tls: ClientTLS | None) -> str:
    """What to change when a scrape failed for a TLS reason (flags of ``kvstore dashboard``)."""
    low = error.lower()
    if url.startswith("http://"):
        if "serves https" in low:  # the node's own answer to plain HTTP
            return " (the node serves /metrics over HTTPS: give https:// endpoints, or any --tls-* flag)"
        if "remote end closed" in low or "connection reset" in low:
            return " (if the node serves /metrics over HTTPS: give https:// endpoints, or any --tls-* flag)"
        return ""
    if not url.startswith("https://"):
        return ""
    if "certificate_verify_failed" in low or "certificate verify failed" in low:
        if "hostname" in low or "ip address mismatch" in low:
            if tls is not None and tls.server_name:
                return f" (the node's certificate does not name {tls.server_name!r}, the --tls-server-name given)"
            return (
                " (the node's certificate does not name the host dialled: pass --tls-server-name with a name it lists)"
            )
        trusted = f"--tls-ca-file ({tls.describe} does not)" if tls is not None else "--tls-ca-file"
        return f" (the node's certificate is not trusted: pass the CA that signed it as {trusted})"
    fix = "pass --tls-cert-file and --tls-key-file, a client certificate signed by the CA in the node's tls_client_ca_file"
    if any(
        a in low for a in ("certificate required", "certificate_required", "alert bad certificate", "alert unknown ca")
    ):
        return f" (the node refused this client's certificate or its absence: {fix})"
    if any(a in low for a in ("reset", "closed", "eof")):
        if tls is None or tls.cert is None:
            return f" (if the node requires client certificates (mutual TLS): {fix})"
        return " (the node may not accept this client certificate: it must be signed by the CA in the node's tls_client_ca_file)"
    return ""


@dataclasses.dataclass
class Scrape:
    """One node's numbers at one moment.  ``counters`` keys are ``family/label/label...`` paths."""

    at: float
    ok: bool
    error: str = ""
    scrape_ms: float = 0.0
    info: dict[str, str] = dataclasses.field(default_factory=dict)
    counters: dict[str, float] = dataclasses.field(default_factory=dict)
    names: dict[str, str] = dataclasses.field(default_factory=dict)  # namespace fingerprint hex -> name
    gauges: dict[str, float] = dataclasses.field(default_factory=dict)
    # method -> (upper bounds, cumulative counts); the last bound is +Inf
    latency: dict[str, tuple[list[float], list[float]]] = dataclasses.field(default_factory=dict)


def get(url: str, *, token: str = "", timeout: float = 1.5, tls: ClientTLS | None = None) -> bytes:
    """One GET of at most ``MAX_BODY`` bytes (``https://`` with ``tls`` when given); raises
    what urllib raises, and ``ValueError`` for a larger body."""
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    open_url = urllib.request.build_opener(_HTTPSHandler(tls)).open if tls is not None else urllib.request.urlopen
    with open_url(req, timeout=timeout) as resp:  # operator-given URL
        body: bytes = resp.read(MAX_BODY + 1)
    if len(body) > MAX_BODY:
        raise ValueError(f"answer larger than {MAX_BODY >> 20} MiB")
    return body


def fetch(url: str, *, token: str = "", timeout: float = 1.5, tls: ClientTLS | None = None) -> Scrape:
    """GET ``url`` and parse it; never raises (an unreachable node is a result).

    ``https://`` URLs use ``tls`` when given (else the system's trust roots); ``http://``
    URLs ignore it."""
    start = time.monotonic()
    try:
        s = parse(get(url, token=token, timeout=timeout, tls=tls).decode("utf-8", "replace"))
    except urllib.error.HTTPError as e:
        detail = ""
        if e.code == 400:
            try:
                detail = e.read(512).decode("utf-8", "replace")
            except OSError:
                pass
        hint = " (wrong or missing token: pass --token-file)" if e.code == 401 else _hint(url, detail, tls)
        s = Scrape(at=time.time(), ok=False, error=f"HTTP {e.code} {e.reason}{hint}")
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as e:
        reason = str(getattr(e, "reason", e))
        s = Scrape(at=time.time(), ok=False, error=f"unreachable: {reason}{_hint(url, reason, tls)}")
    s.scrape_ms = (time.monotonic() - start) * 1000
    return s


def parse(text: str) -> Scrape:
    """Prometheus text → a :class:`Scrape` of the ``kvstore_*`` families the dashboard uses."""
    s = Scrape(at=time.time(), ok=True)
    c, g = s.counters, s.gauges
    buckets: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
    namespaces: set[str] = set()
    agents: set[str] = set()
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
            elif name in (
                "kvstore_namespace_hit_blocks_total",
                "kvstore_namespace_miss_blocks_total",
                "kvstore_namespace_hit_tokens_total",
            ):
                ns = lb.get("namespace", "")
                if ns not in namespaces and len(namespaces) >= MAX_NAMESPACES:
                    ns = "other"
                namespaces.add(ns)
                kind = {
                    "kvstore_namespace_hit_blocks_total": "hits",
                    "kvstore_namespace_miss_blocks_total": "misses",
                }.get(name, "tokens")
                key = f"ns/{ns}/{lb['op']}/{kind}"
                c[key] = c.get(key, 0.0) + v
            elif name == "kvstore_namespace_info":
                if len(s.names) < MAX_NAMESPACES:
                    s.names[lb.get("namespace", "")] = lb.get("name", "")
            elif name == "kvstore_under_replicated_copies_total":
                c["under_replicated"] = v
            elif name == "kvstore_skipped_save_chunks_total":
                c["skipped_saves"] = v
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
            elif name in (
                "kvstore_agent_blocks_total",
                "kvstore_agent_bytes_total",
                "kvstore_agent_calls_total",
                "kvstore_agent_call_seconds_total",
            ):
                agent = lb.get("agent", "")
                if agent not in agents and len(agents) >= MAX_AGENTS:
                    agent = "other"  # a node labels 16 at most; a forged scrape folds, never loses counts
                agents.add(agent)
                if name == "kvstore_agent_blocks_total":
                    key = f"agent/{agent}/{lb.get('op', '')}/{lb.get('result', '')}"
                elif name == "kvstore_agent_bytes_total":
                    key = f"agent/{agent}/bytes/{lb.get('direction', '')}"
                else:
                    key = f"agent/{agent}/{'calls' if name == 'kvstore_agent_calls_total' else 'seconds'}/all"
                c[key] = c.get(key, 0.0) + v
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

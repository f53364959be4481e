"""The dashboard's view of a cluster: the latest scrape of every node, summed, plus a
bounded history of per-interval deltas (what the page plots).

Owner: :class:`ClusterModel` is written by the dashboard's poller thread and read by its
HTTP threads; one lock (``_lock``) guards all of it, held only to swap or copy values.

Counters are treated as Prometheus treats them (``increase()``): per node, a value lower
than the last one is a counter reset (the node restarted) and counts whole, as the increase
since the restart.  Each node keeps a running total built from those increases, and the
page's totals sum every node's, down and departed nodes included (a departed node's total
moves into ``departed`` when it is forgotten): a node dying or restarting never takes
counts away, so totals never go backwards.  The plotted deltas are per node too, then
summed, so a node going down or coming back never shows as negative traffic.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Any

from kvstore.dashboard.scrape import Scrape, quantile

HISTORY = 600  # points kept (10 min at the default 1 s interval)
LATENCY_WINDOW_S = 30.0  # latency quantiles are over this trailing window
LEFT_KEPT_S = 300.0  # a node that left the membership stays listed (as "left") this long


@dataclasses.dataclass
class NodeState:
    name: str
    url: str | None
    status: str = "unknown"  # up | down | left | unknown
    error: str = ""
    scrape_ms: float = 0.0
    last: Scrape | None = None  # the last successful scrape
    last_seen: float = 0.0  # when it last answered (unix s)
    listed_at: float = 0.0  # when the source last listed it
    # counter -> increases seen since the dashboard first scraped it (the first scrape's value,
    # then every delta, a reset counting its new value whole): never decreases
    total: dict[str, float] = dataclasses.field(default_factory=dict)


def increase(prev: float | None, v: float) -> float:
    """How much a counter grew since ``prev`` (None: first seen, all of it), as Prometheus'
    ``increase()``: a lower value is a reset (a restarted node), which counts whole."""
    if prev is None or v < prev:
        return v
    return v - prev


class ClusterModel:
    def __init__(self, *, history: int = HISTORY) -> None:
        self._lock = threading.Lock()
        self.nodes: dict[str, NodeState] = {}
        self.history: collections.deque[dict[str, Any]] = collections.deque(maxlen=history)
        self._latency: collections.deque[tuple[float, dict[str, tuple[list[float], list[float]]]]] = collections.deque()
        self._seq = 0
        self.names: dict[str, str] = {}  # namespace fingerprint hex -> readable name
        self.source_status = ""
        self.polls = 0
        self.departed: collections.Counter[str] = collections.Counter()  # totals of nodes forgotten
        self.replication: int | None = None  # the cluster's replication factor, when the source knows it

    # -- written by the poller ------------------------------------------------------------
    def update(
        self,
        results: dict[str, tuple[str | None, Scrape | None, str]],
        *,
        now: float | None = None,
        names: dict[str, str] | None = None,
        source_status: str = "",
        replication: int | None = None,
    ) -> None:
        """Apply one poll: ``results[name] = (url, scrape or None, error when there is no url)``."""
        now = time.time() if now is None else now
        deltas: collections.defaultdict[str, float] = collections.defaultdict(float)
        with self._lock:
            for name, (url, scrape, err) in results.items():
                st = self.nodes.get(name)
                if st is None:
                    st = self.nodes[name] = NodeState(name, url)
                st.url, st.listed_at = url, now
                if scrape is None:
                    st.status, st.error = "unknown", err
                    continue
                st.scrape_ms = scrape.scrape_ms
                if not scrape.ok:
                    st.status, st.error = "down", scrape.error
                    continue
                plotted = st.status == "up"  # after an outage the first scrape is a new baseline for the plot
                for k, v in scrape.counters.items():
                    d = increase(st.last.counters.get(k) if st.last is not None else None, v)
                    st.total[k] = st.total.get(k, 0.0) + d
                    if d and plotted and st.last is not None:
                        deltas[k] += d
                st.status, st.error, st.last, st.last_seen = "up", "", scrape, now
            for name, st in list(self.nodes.items()):
                if name not in results:
                    if now - st.listed_at > LEFT_KEPT_S:
                        self.departed.update(st.total)
                        del self.nodes[name]
                    else:
                        st.status, st.error = "left", "no longer in the cluster membership"
            if self.polls:
                self._seq += 1
                prev_t = self.history[-1]["t"] if self.history else now
                self.history.append({"seq": self._seq, "t": now, "dt": max(now - prev_t, 1e-3), "d": dict(deltas)})
            else:  # the first poll has nothing to compare with: anchor the time axis
                self.history.append({"seq": 0, "t": now, "dt": 0.0, "d": {}})
            self.polls += 1
            lat = self._sum_latency()
            self._latency.append((now, lat))
            while len(self._latency) > 2 and now - self._latency[1][0] >= LATENCY_WINDOW_S:
                self._latency.popleft()
            if names is not None:
                self.names = dict(names)
            self.source_status = source_status
            self.replication = replication

    def _sum_latency(self) -> dict[str, tuple[list[float], list[float]]]:
        out: dict[str, tuple[list[float], list[float]]] = {}
        for st in self.nodes.values():
            if st.status != "up" or st.last is None:
                continue
            for method, (bounds, counts) in st.last.latency.items():
                if method not in out:
                    out[method] = (list(bounds), list(counts))
                elif out[method][0] == bounds:
                    out[method] = (bounds, [a + b for a, b in zip(out[method][1], counts)])
        return out

    # -- read by the HTTP threads ------------------------------------------------------------
    def view(self, since: int = -1) -> dict[str, Any]:
        """The page's JSON.  ``since``: only history points after that sequence number."""
        with self._lock:
            up = [st for st in self.nodes.values() if st.status == "up" and st.last is not None]
            totals: collections.Counter[str] = collections.Counter(self.departed)
            names: dict[str, str] = {}
            for st in self.nodes.values():
                totals.update(st.total)
                if st.last is not None:
                    names.update(st.last.names)
            names.update(self.names)  # etcd's (cluster-wide, with epochs) win over what nodes were told
            tiers: dict[str, dict[str, float]] = {}
            for st in up:
                assert st.last is not None
                for k, v in st.last.gauges.items():
                    if k.startswith("tier/"):
                        _, tier, what = k.split("/")
                        tiers.setdefault(tier, {"capacity": 0.0, "used": 0.0, "blocks": 0.0})[what] += v
            nodes = [self._node_json(st) for st in sorted(self.nodes.values(), key=lambda s: s.name)]
            history = [p for p in self.history if p["seq"] > since]
            latency = self._latency_json()
            return {
                "now": time.time(),
                "seq": self._seq,
                "source_status": self.source_status,
                "nodes": nodes,
                "totals": dict(totals),
                "tiers": tiers,
                "names": names,
                "replication": self._replication_json(),
                "latency": latency,
                "history": history,
            }

    def _replication_json(self) -> dict[str, Any]:
        """Replication health: the factor, nodes not answering (suspected), and block copies that
        cluster clients' puts could not write (under-replicated, as clients reported them)."""
        listed = [st for st in self.nodes.values() if st.status != "left"]
        suspected = sorted(
            st.last.info.get("node_id") or st.name if st.last is not None else st.name
            for st in listed
            if st.status != "up"
        )
        short = sum(st.total.get("under_replicated", 0.0) for st in self.nodes.values()) + self.departed.get(
            "under_replicated", 0.0
        )
        return {"factor": self.replication, "nodes": len(listed), "suspected": suspected, "under_replicated": short}

    @staticmethod
    def _node_json(st: NodeState) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": st.name,
            "url": st.url,
            "status": st.status,
            "error": st.error,
            "scrape_ms": round(st.scrape_ms, 2),
            "last_seen": st.last_seen,
        }
        s = st.last
        if s is not None:
            c = s.counters
            lookups = sum(v for k, v in c.items() if k.startswith("lookups/"))
            hits = sum(v for k, v in c.items() if k.startswith("hits/"))
            out.update(
                {
                    "title": s.info.get("node_id") or st.name,
                    "node_id": s.info.get("node_id", ""),
                    "version": s.info.get("version", ""),
                    "start_time": s.gauges.get("start_time", 0.0),
                    "lookups": lookups,
                    "hits": hits,
                    "leases": s.gauges.get("leases", 0.0),
                    "tiers": {k.split("/")[1]: {} for k in s.gauges if k.startswith("tier/")},
                }
            )
            for k, v in s.gauges.items():
                if k.startswith("tier/"):
                    _, tier, what = k.split("/")
                    out["tiers"][tier][what] = v
        return out

    def _latency_json(self) -> list[dict[str, Any]]:
        if not self._latency:
            return []
        t1, last = self._latency[-1]
        t0, first = self._latency[0]
        out: list[dict[str, Any]] = []
        for method, (bounds, counts) in last.items():
            base = first.get(method)
            window = counts
            if base is not None and base[0] == bounds and t1 > t0:
                window = [max(a - b, 0.0) for a, b in zip(counts, base[1])]
            n = window[-1] if window else 0.0
            out.append(
                {
                    "method": method,
                    "count": counts[-1] if counts else 0.0,
                    "rate": n / (t1 - t0) if t1 > t0 else 0.0,
                    "p50": quantile(0.5, bounds, window),
                    "p99": quantile(0.99, bounds, window),
                }
            )
        out.sort(key=lambda m: -m["count"])
        return out

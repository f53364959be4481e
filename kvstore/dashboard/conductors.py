"""The dashboard's view of the conductors' engines (``--conductor``): each conductor's
``/conductor/state`` read into plain values, and the engines of every conductor merged by
engine id (several conductors may run side by side over the same engines).

Pure except :func:`fetch_state` (one HTTP GET).  Owner: :class:`FleetModel` is written by
the dashboard's poller thread and read by its HTTP threads; one lock (``_lock``) guards
all of it, held only to swap or copy values.

Counts (requests routed, prompt tokens by source) are counters in each conductor, kept as
the nodes' are (Prometheus' ``increase()``): per conductor and engine, a value lower than
the last one is a restarted conductor and counts whole, and a conductor that stops
answering keeps what it counted, so no figure goes backwards.  Live figures (alive,
running, queued, the KV-event view) come only from the conductors that answer now: an
engine that only silent conductors list is shown as unknown, one that no conductor lists
any more as left, for ``LEFT_KEPT_S``, then forgotten.  Bounded against a misbehaving
endpoint: at most ``MAX_ENGINES`` engines per conductor.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import math
import threading
import time
import urllib.error
from typing import TYPE_CHECKING, Any

from kvstore.dashboard.model import LEFT_KEPT_S, increase
from kvstore.dashboard.scrape import get

if TYPE_CHECKING:
    from kvstore.tls import ClientTLS

STATE_PATH = "/conductor/state"
MAX_ENGINES = 1024
SOURCES = ("engine", "pool_dram", "pool_nvme", "pool_remote", "compute")
"""Where a routed prompt's tokens were expected to come from (the conductor's estimate):
the engine's own prefix cache, the pool's tiers, or computed."""


def conductor_url(spec: str) -> str:
    """``HOST:PORT`` or ``http(s)://HOST:PORT[/path]`` → the conductor's state URL."""
    spec = spec.strip()
    if spec.startswith(("http://", "https://")):
        return spec if spec.rstrip("/").count("/") > 2 else spec.rstrip("/") + STATE_PATH
    host, sep, port = spec.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(
            f"a conductor is HOST:PORT or http(s)://HOST:PORT (what `kvstore conductor` serves), got {spec!r}"
        )
    return f"http://{spec}{STATE_PATH}"


@dataclasses.dataclass(frozen=True)
class EngineReport:
    """One engine as one conductor reported it."""

    engine_id: str
    url: str = ""
    role: str = ""
    models: tuple[str, ...] = ()
    alive: bool = False
    source: str = ""  # static | etcd
    node_id: str = ""
    prefilling: int = 0  # this conductor's requests before their first token
    decoding: int = 0  # ... and after it
    waiting: int = 0  # the engine's own /metrics (every client's requests)
    running: int = 0
    decisions: int = 0  # requests this conductor routed here
    served: int = 0
    tokens: dict[str, float] = dataclasses.field(default_factory=dict)  # SOURCES -> prompt tokens
    last_error: str = ""
    view: dict[str, float] | None = None  # its KV-event subscriber: connected, events, resyncs, staleness_s
    # its recent first tokens, predicted against measured: n, predicted_p50_ms, measured_p50_ms, abs_err_median
    ttft: dict[str, float] | None = None


@dataclasses.dataclass
class ConductorScrape:
    """One conductor's state at one moment."""

    at: float
    ok: bool
    error: str = ""
    scrape_ms: float = 0.0
    engines: dict[str, EngineReport] = dataclasses.field(default_factory=dict)
    decision_us: tuple[float | None, float | None] = (None, None)  # p50, p99
    ttft_err_median: float | None = None  # |predicted - measured| / measured
    rejected: dict[str, float] = dataclasses.field(default_factory=dict)  # reason -> requests refused
    pool_errors: float = 0.0
    pd: bool = False


def _num(x: Any) -> float:
    return float(x) if isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) else 0.0


def _opt(x: Any) -> float | None:
    return float(x) if isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) else None


def _dict(x: Any) -> dict[str, Any]:
    return x if isinstance(x, dict) else {}


def parse_state(obj: Any) -> ConductorScrape:
    """A conductor's ``/conductor/state`` JSON → a :class:`ConductorScrape`.  Missing or
    malformed fields read as zero or unknown; what has no ``engines`` list is refused."""
    if not isinstance(obj, dict) or not isinstance(obj.get("engines"), list):
        raise ValueError("not a conductor's state (no engines list)")
    routing, views = _dict(obj.get("routing")), _dict(obj.get("views"))
    decisions = _dict(routing.get("decisions_per_engine"))
    ttfts = _dict(routing.get("ttft_per_engine"))
    s = ConductorScrape(at=time.time(), ok=True)
    for e in obj["engines"]:
        if not isinstance(e, dict) or not isinstance(e.get("engine_id"), str) or not e["engine_id"]:
            continue
        if len(s.engines) >= MAX_ENGINES:
            raise ValueError(f"more than {MAX_ENGINES} engines")
        eid = e["engine_id"]
        scraped, view, ttft = _dict(e.get("scraped")), views.get(eid), ttfts.get(eid)
        s.engines[eid] = EngineReport(
            engine_id=eid,
            url=str(e.get("url") or ""),
            role=str(e.get("role") or ""),
            models=tuple(str(m) for m in e.get("models") or () if isinstance(m, str)),
            alive=e.get("alive") is True,
            source=str(e.get("source") or ""),
            node_id=str(e.get("node_id") or ""),
            prefilling=int(_num(e.get("prefilling"))),
            decoding=int(_num(e.get("decoding"))),
            waiting=int(_num(scraped.get("waiting"))),
            running=int(_num(scraped.get("running"))),
            decisions=int(_num(decisions.get(eid))),
            served=int(_num(e.get("served"))),
            tokens={k: _num(v) for k, v in _dict(e.get("tokens")).items() if k in SOURCES},
            last_error=str(e.get("last_error") or ""),
            ttft=None
            if not isinstance(ttft, dict) or not _num(ttft.get("n"))
            else {
                "n": _num(ttft.get("n")),
                "predicted_p50_ms": _num(ttft.get("predicted_p50_ms")),
                "measured_p50_ms": _num(ttft.get("measured_p50_ms")),
                "abs_err_median": _num(ttft.get("abs_err_median")),
            },
            view=None
            if not isinstance(view, dict)
            else {
                "connected": float(view.get("connected") is True),
                "events": _num(view.get("events")),
                "resyncs": _num(view.get("resyncs")),
                "staleness_s": _num(view.get("staleness_s")) if _opt(view.get("staleness_s")) is not None else -1.0,
            },
        )
    us = _dict(routing.get("decision_us"))
    s.decision_us = (_opt(us.get("p50")), _opt(us.get("p99")))
    s.ttft_err_median = _opt(routing.get("predicted_ttft_abs_err_median"))
    s.rejected = {str(k): _num(v) for k, v in _dict(routing.get("rejected")).items()}
    s.pool_errors = _num(routing.get("pool_errors"))
    s.pd = obj.get("pd") is True
    return s


def fetch_state(url: str, *, timeout: float = 1.5, tls: ClientTLS | None = None) -> ConductorScrape:
    """GET a conductor's state; never raises (a conductor that does not answer is a result).
    No token is sent: the conductor has none, and the nodes' must not leak to it."""
    start = time.monotonic()
    try:
        s = parse_state(json.loads(get(url, timeout=timeout, tls=tls)))
    except urllib.error.HTTPError as e:
        s = ConductorScrape(at=time.time(), ok=False, error=f"HTTP {e.code} {e.reason}")
    except ValueError as e:  # JSON, or not a conductor's
        s = ConductorScrape(at=time.time(), ok=False, error=f"bad answer: {e}")
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
        s = ConductorScrape(at=time.time(), ok=False, error=f"unreachable: {getattr(e, 'reason', e)}")
    s.scrape_ms = (time.monotonic() - start) * 1000
    return s


@dataclasses.dataclass
class ConductorState:
    name: str
    url: str
    status: str = "unknown"  # up | down | unknown (not polled yet)
    error: str = ""
    scrape_ms: float = 0.0
    last: ConductorScrape | None = None  # the last successful scrape: the engines it lists now
    last_seen: float = 0.0
    # engine id -> counter ("decisions", "served", "tokens/<source>") -> its increases since first
    # seen (never decreases), and the last value read (the baseline, kept while it is not listed)
    total: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    baseline: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    listed_at: dict[str, float] = dataclasses.field(default_factory=dict)  # engine id -> when last listed
    forgotten: float = 0.0  # decisions of engines forgotten


def _counters(e: EngineReport) -> dict[str, float]:
    out = {"decisions": float(e.decisions), "served": float(e.served)}
    out.update({f"tokens/{k}": v for k, v in e.tokens.items()})
    return out


class FleetModel:
    """The conductors' latest states and every engine's counts (see the module docstring)."""

    def __init__(self, conductors: dict[str, str] | None = None) -> None:
        self._lock = threading.Lock()
        self.conductors: dict[str, ConductorState] = {
            name: ConductorState(name, url) for name, url in (conductors or {}).items()
        }

    # -- written by the poller ------------------------------------------------------------
    def update(self, results: dict[str, ConductorScrape], *, now: float | None = None) -> None:
        """Apply one poll: ``results[conductor name] = its scrape``."""
        now = time.time() if now is None else now
        with self._lock:
            for name, scrape in results.items():
                st = self.conductors.setdefault(name, ConductorState(name, ""))
                st.scrape_ms = scrape.scrape_ms
                if not scrape.ok:
                    st.status, st.error = "down", scrape.error
                    continue
                for eid, e in scrape.engines.items():
                    before, now_values = st.baseline.get(eid, {}), _counters(e)
                    tot = st.total.setdefault(eid, {})
                    for k, v in now_values.items():
                        tot[k] = tot.get(k, 0.0) + increase(before.get(k), v)
                    st.baseline[eid], st.listed_at[eid] = now_values, now
                for eid in list(st.total):
                    if eid not in scrape.engines and now - st.listed_at[eid] > LEFT_KEPT_S:
                        st.forgotten += st.total.pop(eid).get("decisions", 0.0)
                        del st.baseline[eid], st.listed_at[eid]
                st.status, st.error, st.last, st.last_seen = "up", "", scrape, now

    # -- read by the HTTP threads ------------------------------------------------------------
    def view(self) -> dict[str, Any]:
        """The page's ``engines`` and ``conductors``."""
        with self._lock:
            sts = sorted(self.conductors.values(), key=lambda c: c.name)
            return {"engines": self._engines(sts), "conductors": [self._conductor_json(c) for c in sts]}

    @staticmethod
    def _engines(sts: list[ConductorState]) -> list[dict[str, Any]]:
        ids = sorted({eid for c in sts for eid in c.total})
        out = []
        for eid in ids:
            # live reports: answering conductors that list the engine in their latest state
            listing = [c for c in sts if c.last is not None and eid in c.last.engines]
            live = [(c.name, c.last.engines[eid]) for c in listing if c.status == "up" and c.last is not None]
            known = [c.last.engines[eid] for c in listing if c.last is not None]
            totals = [c.total[eid] for c in sts if eid in c.total]
            tokens = {k: sum(t.get(f"tokens/{k}", 0.0) for t in totals) for k in SOURCES}
            n_tokens = sum(tokens.values())
            alive = [r.alive for _, r in live]
            if not live:  # listed only by conductors that do not answer now, or by none any more
                status = "unknown" if listing else "left"
            else:
                status = "up" if all(alive) else "down" if not any(alive) else "partial"
            views = [r.view for _, r in live if r.view is not None]
            ttfts = [r.ttft for _, r in live if r.ttft is not None]
            stale = [v["staleness_s"] for v in views if v["staleness_s"] >= 0]
            out.append(
                {
                    "engine_id": eid,
                    "url": next((r.url for r in known if r.url), ""),
                    "role": "/".join(sorted({r.role for r in known if r.role})),
                    "models": sorted({m for r in known for m in r.models}),
                    "node_id": next((r.node_id for r in known if r.node_id), ""),
                    "status": status,
                    "alive": None if not live else all(alive),
                    "errors": [f"{name}: {r.last_error}" for name, r in live if r.last_error and not r.alive],
                    "conductors": [c.name for c in sts if eid in c.total],
                    "routed": sum(t.get("decisions", 0.0) for t in totals),
                    "served": sum(t.get("served", 0.0) for t in totals),
                    # the engine's own counts cover every conductor's requests; ours add up
                    "running": max([r.running for _, r in live] + [sum(r.decoding for _, r in live)]) if live else None,
                    "queued": max([r.waiting for _, r in live] + [sum(r.prefilling for _, r in live)])
                    if live
                    else None,
                    "tokens": tokens,
                    "hit_ratio": None if not n_tokens else 1 - tokens["compute"] / n_tokens,
                    # the conductor that saw most of its first tokens: medians do not add up
                    "ttft": max(ttfts, key=lambda t: t["n"]) if ttfts else None,
                    "view": None
                    if not views
                    else {
                        "connected": all(v["connected"] for v in views),
                        "events": sum(v["events"] for v in views),
                        "resyncs": sum(v["resyncs"] for v in views),
                        "staleness_s": max(stale) if stale else None,  # the stalest view routes worst
                    },
                }
            )
        return out

    @staticmethod
    def _conductor_json(c: ConductorState) -> dict[str, Any]:
        s = c.last
        listed = list(s.engines.values()) if s is not None else []
        return {
            "name": c.name,
            "url": c.url,
            "status": c.status,
            "error": c.error,
            "scrape_ms": round(c.scrape_ms, 2),
            "last_seen": c.last_seen,
            "engines": len(listed),
            "alive": sum(1 for e in listed if e.alive),
            "routed": sum(t.get("decisions", 0.0) for t in c.total.values()) + c.forgotten,
            "decision_us": {"p50": s.decision_us[0], "p99": s.decision_us[1]} if s is not None else None,
            "ttft_err_median": s.ttft_err_median if s is not None else None,
            "rejected": dict(s.rejected) if s is not None else {},
            "pool_errors": s.pool_errors if s is not None else 0.0,
            "pd": s.pd if s is not None else False,
        }

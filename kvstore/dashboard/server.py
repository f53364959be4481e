"""``kvstore dashboard``: a live cache-hit page for one node or a whole cluster, and for the
engines of the conductors in front of them.

Threads: a poller scrapes every node's ``/metrics`` and every conductor's
``/conductor/state`` each ``interval`` (in parallel, each with a deadline) and feeds
:class:`~kvstore.dashboard.model.ClusterModel` and
:class:`~kvstore.dashboard.conductors.FleetModel`; an HTTP server
(stdlib, threaded) serves the page, its static assets (in the package: no CDN, works
offline) and ``GET /api/cluster``.  Read-only: anything but GET/HEAD is refused.  With a
token (the nodes' token, ``--token-file``) every request must carry it, as
``Authorization: Bearer <token>`` or as the password of HTTP Basic auth (what a browser
prompts for); the same token is sent to the nodes.

Node sources: a fixed list of metrics endpoints (``--nodes``), or a cluster's membership
in etcd (``--etcd``): each record's ``metrics`` URL when it has one (its scheme says whether
the node serves ``/metrics`` over HTTPS), else the node's gRPC host with ``--metrics-port``.
HTTPS endpoints are scraped with the dashboard's :class:`~kvstore.tls.ClientTLS` (``tls``).
Conductors (``conductors``): fixed ``HOST:PORT`` or URLs; never sent the nodes' token.
"""

from __future__ import annotations

import base64
import hmac
import json
import logging
import mimetypes
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler
from importlib import resources
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import parse_qs, urlsplit

from kvstore.dashboard.conductors import ConductorScrape, FleetModel, conductor_url, fetch_state
from kvstore.dashboard.model import ClusterModel
from kvstore.dashboard.scrape import Scrape, fetch, metrics_url
from kvstore.node.metrics import http_server

if TYPE_CHECKING:
    from kvstore.tls import ClientTLS

log = logging.getLogger("kvstore.dashboard")

STATIC = ("index.html", "app.js", "style.css", "favicon.svg")


class NodeSource(Protocol):
    description: str

    def targets(self) -> dict[str, tuple[str | None, str]]:
        """node name -> (metrics URL or None, why there is none)."""
        ...

    def names(self) -> dict[str, str] | None: ...

    def status(self) -> str: ...

    def close(self) -> None: ...


class StaticNodes:
    """``--nodes HOST:PORT,...``: the nodes' metrics endpoints (``scheme`` for bare HOST:PORT)."""

    def __init__(self, specs: list[str], *, scheme: str = "http") -> None:
        if not specs:
            raise ValueError("no nodes given")
        self._targets = {s.strip(): (metrics_url(s, scheme), "") for s in specs if s.strip()}
        self.description = f"{len(self._targets)} node{'s' if len(self._targets) != 1 else ''}"

    def targets(self) -> dict[str, tuple[str | None, str]]:
        return dict(self._targets)

    def names(self) -> dict[str, str] | None:
        return None

    def status(self) -> str:
        return ""

    def close(self) -> None:
        pass


class NoNodes(StaticNodes):
    """Only conductors (``--conductor`` without ``--nodes`` or ``--etcd``): no node to scrape."""

    def __init__(self) -> None:
        self._targets = {}
        self.description = ""


class EtcdNodes:
    """``--etcd``: the nodes registered in a cluster's membership (watched)."""

    def __init__(self, endpoints: str, cluster: str, *, metrics_port: int | None = None, scheme: str = "http") -> None:
        from kvstore.cluster.membership import Membership

        self.membership = Membership(endpoints, cluster).start(wait=0)
        self.metrics_port = metrics_port
        self.scheme = scheme  # of the --metrics-port fallback; a record's URL carries its own
        self.description = f"cluster {cluster!r} via etcd {endpoints}"

    def targets(self) -> dict[str, tuple[str | None, str]]:
        out: dict[str, tuple[str | None, str]] = {}
        for node_id, info in self.membership.snapshot().nodes.items():
            url = getattr(info, "metrics", "") or None
            if url is None and self.metrics_port is not None:
                host = info.grpc.rpartition(":")[0] or "127.0.0.1"
                url = f"{self.scheme}://{host}:{self.metrics_port}/metrics"
            out[node_id] = (
                metrics_url(url) if url else None,
                "" if url else "its membership record has no metrics endpoint; pass --metrics-port",
            )
        return out

    def names(self) -> dict[str, str] | None:
        out = {}
        for rec in self.membership.snapshot().namespaces.values():
            ns = rec.namespace or {}
            name = str(ns.get("model_id") or rec.fingerprint.hex())
            if ns.get("lora_id"):
                name += f"+{ns['lora_id']}"
            if int(ns.get("tp_size", 1) or 1) > 1:
                name += f" tp{ns.get('tp_rank', 0)}/{ns['tp_size']}"
            out[rec.effective.hex()] = name + (f" (epoch {rec.epoch})" if rec.epoch else "")
        return out

    def replication(self) -> int | None:
        snap = self.membership.snapshot()
        return snap.config.replication if snap.loaded else None

    def status(self) -> str:
        snap = self.membership.snapshot()
        if not snap.loaded:
            return f"etcd at {self.membership.endpoints} has not answered yet"
        if not snap.connected:
            return f"etcd at {self.membership.endpoints} is unreachable: showing the last membership seen"
        return ""

    def close(self) -> None:
        self.membership.close()


class Dashboard:
    """The poller and the HTTP server.  ``start`` then ``close``."""

    def __init__(
        self,
        source: NodeSource,
        *,
        host: str = "127.0.0.1",
        port: int = 8600,
        token: str = "",
        interval: float = 1.0,
        title: str = "",
        tls: ClientTLS | None = None,
        conductors: Sequence[str] = (),
    ) -> None:
        if not 0.1 <= interval <= 2.0:
            raise ValueError(f"interval must be between 0.1 and 2 s, got {interval}")
        self.source = source
        self.token = token
        self.tls = tls  # for https:// endpoints; None: the system's trust roots
        self.interval = interval
        # conductor (as given) -> its state URL; several may run side by side
        self.conductors = {c.strip(): conductor_url(c) for c in conductors if c.strip()}
        n = len(self.conductors)
        self.description = ", ".join(
            x for x in (source.description, f"{n} conductor{'s' if n != 1 else ''}" if n else "") if x
        )
        self.title = title or f"kvstore — {self.description}"
        self.model = ClusterModel()
        self.fleet = FleetModel(self.conductors)
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="kvstore-dashboard-scrape")
        self.httpd = http_server(host, port, self._handler())
        self.address: tuple[str, int] = self.httpd.server_address[:2]  # type: ignore[assignment]
        self._threads = [
            threading.Thread(target=self._poll_forever, name="kvstore-dashboard-poll", daemon=True),
            threading.Thread(
                target=self.httpd.serve_forever,
                kwargs={"poll_interval": 0.2},
                name="kvstore-dashboard-http",
                daemon=True,
            ),
        ]

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://{'[' + host + ']' if ':' in host else host}:{port}/"

    def start(self) -> Dashboard:
        self.poll_once()  # the first page load already has data
        for t in self._threads:
            t.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._threads[1].is_alive():
            self.httpd.shutdown()
        self.httpd.server_close()
        for t in self._threads:
            if t.is_alive():
                t.join(timeout=5)
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.source.close()

    # -- polling --------------------------------------------------------------------------------
    def poll_once(self) -> None:
        targets = self.source.targets()
        timeout = max(0.5, min(1.5, self.interval * 1.5))  # a hung node must not stall the page
        futures = {
            name: self._pool.submit(fetch, url, token=self.token, timeout=timeout, tls=self.tls)
            for name, (url, _) in targets.items()
            if url
        }
        asked = {
            name: self._pool.submit(fetch_state, url, timeout=timeout, tls=self.tls)
            for name, url in self.conductors.items()
        }
        results: dict[str, tuple[str | None, Scrape | None, str]] = {}
        for name, (url, why) in targets.items():
            fut = futures.get(name)
            results[name] = (url, fut.result() if fut is not None else None, why)
        replication = getattr(self.source, "replication", None)
        self.model.update(
            results,
            names=self.source.names(),
            source_status=self.source.status(),
            replication=replication() if replication is not None else None,
        )
        if asked:
            states: dict[str, ConductorScrape] = {name: fut.result() for name, fut in asked.items()}
            self.fleet.update(states)

    def _poll_forever(self) -> None:
        next_at = time.monotonic() + self.interval  # start() already polled once
        while not self._stop.wait(max(0.0, next_at - time.monotonic())):
            try:
                self.poll_once()
            except Exception:  # one bad poll must not end the dashboard
                log.exception("dashboard poll failed")
            next_at = max(next_at + self.interval, time.monotonic())  # after a slow poll: no burst to catch up

    def api(self, since: int) -> dict[str, Any]:
        v = self.model.view(since)
        v.update(self.fleet.view())
        v.update({"title": self.title, "source": self.source.description, "interval": self.interval})
        return v

    # -- HTTP ---------------------------------------------------------------------------------------
    def _handler(self) -> type[BaseHTTPRequestHandler]:
        dash = self
        expected = dash.token.encode()

        class Handler(BaseHTTPRequestHandler):
            server_version = "kvstore-dashboard"
            sys_version = ""

            def log_message(self, fmt: str, *args: Any) -> None:
                log.debug("dashboard %s: " + fmt, self.client_address[0], *args)

            def _send(self, code: int, body: bytes, ctype: str, extra: dict[str, str] | None = None) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.send_header("X-Content-Type-Options", "nosniff")
                self.send_header(
                    "Content-Security-Policy",
                    "default-src 'self'; img-src 'self' data:; style-src 'self' 'unsafe-inline'; script-src 'self'; connect-src 'self'",
                )
                for k, v in (extra or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _authorized(self) -> bool:
                if not expected:
                    return True
                got = self.headers.get("Authorization") or ""
                scheme, _, cred = got.partition(" ")
                if scheme.lower() == "bearer":
                    return hmac.compare_digest(cred.strip().encode(), expected)
                if scheme.lower() == "basic":
                    try:
                        password = base64.b64decode(cred.strip(), validate=True).partition(b":")[2]
                    except ValueError:
                        return False
                    return hmac.compare_digest(password, expected)
                return False

            def do_GET(self) -> None:
                if not self._authorized():
                    self._send(
                        401,
                        b"this dashboard needs the nodes' token (any user name, the token as password)\n",
                        "text/plain; charset=utf-8",
                        {"WWW-Authenticate": 'Basic realm="kvstore dashboard", charset="UTF-8"'},
                    )
                    return
                url = urlsplit(self.path)
                path = url.path
                if path == "/api/cluster":
                    try:
                        since = int(parse_qs(url.query).get("since", ["-1"])[0])
                    except ValueError:
                        since = -1
                    body = json.dumps(dash.api(since), separators=(",", ":"), allow_nan=False).encode()
                    self._send(200, body, "application/json")
                    return
                if path == "/healthz":
                    self._send(200, b"ok\n", "text/plain; charset=utf-8")
                    return
                name = "index.html" if path in ("/", "/index.html") else path.removeprefix("/static/")
                if name not in STATIC:
                    self._send(404, b"not found\n", "text/plain; charset=utf-8")
                    return
                body = resources.files("kvstore.dashboard").joinpath("static", name).read_bytes()
                if name == "index.html":
                    body = body.replace(b"{{TITLE}}", _html_escape(dash.title).encode())
                ctype = mimetypes.guess_type(name)[0] or "application/octet-stream"
                self._send(
                    200,
                    body,
                    ctype + ("; charset=utf-8" if ctype.startswith(("text/", "application/javascript")) else ""),
                )

            do_HEAD = do_GET

            def _read_only(self) -> None:
                self._send(405, b"read-only\n", "text/plain; charset=utf-8", {"Allow": "GET, HEAD"})

            do_POST = do_PUT = do_DELETE = do_PATCH = _read_only

        return Handler


def _html_escape(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")

"""Prometheus metrics of one node: a private registry and the ``/metrics`` HTTP endpoint.

Owner: :class:`kvstore.node.server.Node` builds one :class:`NodeMetrics` per node (never the
global default registry, so several nodes in one process do not collide).  Two kinds of
metrics live in it:

* **state read at scrape time** by :class:`_NodeCollector`: the tier manager's counters,
  tiers and cache-hit ledger (``kvstore/node/ledger.py``).  The collector never reads the
  manager from the HTTP thread: ``snapshot`` (given by the node) runs on the node's loop,
  the manager's owner, and hands back plain values.
* **latency histograms** observed by the gRPC service as calls finish (prometheus
  ``Histogram`` objects are thread-safe).

Every metric is prefixed ``kvstore_``; the names and labels below are a contract with
``deploy/grafana/kvstore.json`` and the dashboard (a test checks the Grafana side).

The endpoint (:class:`MetricsServer`) is read-only (GET and HEAD of ``/metrics``) and,
when the node has a token, answers only ``Authorization: Bearer <token>``.  On a node that
serves TLS it is HTTPS with the TCP listeners' context (``metrics_tls``; client certificates
required under mutual TLS), so the token never crosses the network in clear: each
connection's handshake runs on its own request thread, never on the accepting one, and a
plain-HTTP request is answered ``400`` (saying the port serves HTTPS) and never served.
"""

from __future__ import annotations

import hmac
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from kvstore import errors
from kvstore.node.ledger import OPS, OTHER, REASONS, TIERS
from kvstore.node.outcomes import Status
from kvstore.vocabulary import bucket_label
from kvstore.wire import check_agent

log = logging.getLogger("kvstore.node.metrics")

RPC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
MAX_AGENTS = 16
"""Distinct agent names a node labels its per-agent metrics with; later ones count as ``other``."""
SDK_AGENT = "sdk"
"""The agent label of calls that name none (plain SDK clients)."""
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

# bytes moved per path: (path, direction) -> manager counter.  "read" = out of the store
# (to a client, or NVMe -> DRAM), "write" = into it (from a client, or DRAM -> NVMe).
BYTE_COUNTERS = {
    ("local", "read"): "local_bytes_out",
    ("local", "write"): "local_bytes_in",
    ("tcp", "read"): "tcp_bytes_out",
    ("tcp", "write"): "tcp_bytes_in",
    ("grpc", "read"): "grpc_stream_bytes_out",
    ("grpc", "write"): "grpc_stream_bytes_in",
    ("nvme", "read"): "promoted_bytes",
    ("nvme", "write"): "demoted_bytes",
}
PUT_COUNTERS = {
    "stored": "puts",
    "deduplicated": "puts_deduplicated",
    "no_space": "reserve_no_space",
    "corrupt": "corrupt_puts",
}
CORRUPT_COUNTERS = {"put": "corrupt_puts", "nvme_read": "corrupt_blocks", "demotion": "corrupt_demotions"}


def manager_snapshot(manager: Any, extra: Mapping[str, int] | None = None) -> dict[str, Any]:
    """Plain values of everything the collector exports.  Call on the manager's loop."""
    s = manager.stats()
    s["ledger"] = manager.ledger.snapshot()
    s["history"] = {"capacity": manager.history.capacity, "records": manager.history.recorded}
    s["extra"] = dict(extra or {})
    return s


class NodeMetrics:
    """The registry of one node, and the instruments its service observes into."""

    def __init__(self, node_id: str, version: str, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.node_id = node_id
        self.version = version
        self.snapshot = snapshot
        self.started = time.time()
        self.registry = CollectorRegistry()
        self.rpc_seconds = Histogram(
            "kvstore_rpc_duration_seconds",
            "Server time of each gRPC call, by method.",
            ["method"],
            buckets=RPC_BUCKETS,
            registry=self.registry,
        )
        self.rpc_errors = Counter(
            "kvstore_rpc_errors",
            "gRPC calls that ended in an error status, by method and error type.",
            ["method", "error"],
            registry=self.registry,
        )
        self.transfer_seconds = Histogram(
            "kvstore_transfer_duration_seconds",
            "Data-channel transfers, from the client's connect to the last byte.",
            ["op"],
            buckets=TRANSFER_BUCKETS,
            registry=self.registry,
        )
        # tenants come from the config, so these labels are bounded; admin calls are not counted here
        self.tenant_requests = Counter(
            "kvstore_tenant_requests",
            "gRPC calls made with each tenant's token.",
            ["tenant"],
            registry=self.registry,
        )
        self.tenant_denied = Counter(
            "kvstore_tenant_denied",
            "What tenants were denied: refused = calls answered PERMISSION_DENIED, hidden = "
            "blocks of another tenant's namespace answered as absent, skipped = keys and ids of deletes, pins, commits, "
            "aborts and releases left alone because they were not the tenant's.",
            ["tenant", "kind"],
            registry=self.registry,
        )
        # per agent (ClientOptions.agent: the integration making the calls): labels bounded by agent_label
        self.agent_calls = Counter(
            "kvstore_agent_calls",
            "Data calls (lookups, reads, writes) by the agent that made them and method.",
            ["agent", "method"],
            registry=self.registry,
        )
        self.agent_call_seconds = Counter(
            "kvstore_agent_call_seconds",
            "Server seconds of those calls, summed (divide by kvstore_agent_calls_total for the mean).",
            ["agent", "method"],
            registry=self.registry,
        )
        self.agent_blocks = Counter(
            "kvstore_agent_blocks",
            "Blocks each agent asked for, by operation and result: lookup and read hit | miss, "
            "write stored | refused (no room, expired, already there counts stored).",
            ["agent", "op", "result"],
            registry=self.registry,
        )
        self.agent_bytes = Counter(
            "kvstore_agent_bytes",
            "Payload bytes each agent read (out of the store) and wrote (stored), any path.",
            ["agent", "direction"],
            registry=self.registry,
        )
        self._agents: dict[str, str] = {}
        self._agents_lock = threading.Lock()
        self.registry.register(_NodeCollector(self))

    def agent_label(self, agent: str | None) -> str:
        """The label value of a call's ``kvstore-agent`` metadata: ``sdk`` when absent, the name
        itself for the first :data:`MAX_AGENTS` valid names seen, ``other`` for later or invalid
        ones (a client cannot blow up the label cardinality)."""
        if not agent:
            return SDK_AGENT
        with self._agents_lock:
            label = self._agents.get(agent)
            if label is None:
                try:
                    check_agent(agent)
                    label = agent if len(self._agents) < MAX_AGENTS and agent not in (SDK_AGENT, OTHER) else OTHER
                except errors.InvalidArgument:
                    label = OTHER
                if len(self._agents) < 4 * MAX_AGENTS:  # remembers a few invalid names too, boundedly
                    self._agents[agent] = label
            return label

    def observe_agent_call(self, agent: str, method: str, seconds: float) -> None:
        self.agent_calls.labels(agent, method).inc()
        self.agent_call_seconds.labels(agent, method).inc(seconds)

    def observe_agent_blocks(self, agent: str, op: str, good: int, bad: int, nbytes: int = 0) -> None:
        """``good`` hits (stored, for writes) and ``bad`` misses (refused) of ``op`` (lookup,
        read or write), and the payload bytes moved."""
        ok, no = ("stored", "refused") if op == "write" else ("hit", "miss")
        if good:
            self.agent_blocks.labels(agent, op, ok).inc(good)
        if bad:
            self.agent_blocks.labels(agent, op, no).inc(bad)
        if nbytes:
            self.agent_bytes.labels(agent, "write" if op == "write" else "read").inc(nbytes)

    def observe_agent_writes(self, agent: str, statuses: Sequence[int], sizes: Sequence[int]) -> None:
        """A write's final per-block statuses (OK and EXISTS: stored; the rest refused) and the
        payload bytes of those stored now (``sizes`` per status, where known)."""
        stored = sum(st in (Status.OK, Status.EXISTS) for st in statuses)
        nbytes = sum(n for n, st in zip(sizes, statuses) if st == Status.OK)
        self.observe_agent_blocks(agent, "write", stored, len(statuses) - stored, nbytes)

    def observe_rpc(self, method: str, seconds: float, error: str | None = None) -> None:
        self.rpc_seconds.labels(method).observe(seconds)
        if error is not None:
            self.rpc_errors.labels(method, error).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _NodeCollector:
    def __init__(self, m: NodeMetrics) -> None:
        self.m = m

    def describe(self) -> list[Metric]:
        return []  # families depend on the scrape (namespaces); nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        yield from families(self.m.snapshot(), node_id=self.m.node_id, version=self.m.version, started=self.m.started)


def _counter(name: str, doc: str, labels: list[str]) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, labels=labels)


def families(snap: dict[str, Any], *, node_id: str, version: str, started: float) -> Iterator[Metric]:
    """The scrape-time metric families for one snapshot (pure: tested without a server)."""
    c = snap.get("counters", {})
    led = snap["ledger"]

    info = GaugeMetricFamily(
        "kvstore_node_info", "Constant 1, labelled with this node's id and version.", labels=["node_id", "version"]
    )
    info.add_metric([node_id, version], 1)
    yield info
    yield GaugeMetricFamily("kvstore_start_time_seconds", "Unix time this node started.", value=started)

    f = _counter(
        "kvstore_lookup_requests", "Lookup calls, by operation (get = acquire/stream/data-channel reads).", ["op"]
    )
    for op in OPS:
        f.add_metric([op], led["requests"].get(op, 0))
    yield f
    f = _counter("kvstore_lookup_blocks", "Blocks asked for by lookups, by operation (= hits + misses).", ["op"])
    for op in OPS:
        f.add_metric([op], led["lookups"].get(op, 0))
    yield f
    hb = _counter("kvstore_hit_blocks", "Blocks found, by operation and the tier that held them.", ["op", "tier"])
    ht = _counter("kvstore_hit_tokens", "Prompt tokens of the blocks found, by operation and tier.", ["op", "tier"])
    for op in OPS:
        for tier in TIERS:
            hb.add_metric([op, tier], led["hits"].get((op, tier), 0))
            ht.add_metric([op, tier], led["hit_tokens"].get((op, tier), 0))
    yield hb
    yield ht
    f = _counter(
        "kvstore_miss_blocks",
        "Blocks not found, by operation and reason (see kvstore/node/ledger.py; "
        "node_down and deadline as cluster clients reported them).",
        ["op", "reason"],
    )
    for op in OPS:
        for reason in REASONS:
            f.add_metric([op, reason], led["misses"].get((op, reason), 0))
    yield f
    info = GaugeMetricFamily(
        "kvstore_namespace_info",
        "A readable name of a namespace fingerprint, as the SDK that wrote it sent it (1 per named namespace).",
        labels=["namespace", "name"],
    )
    for ns, name in sorted(led.get("names", {}).items()):
        info.add_metric([ns, name], 1)
    yield info
    for ledger_key, name, doc in (
        (
            "short_copies",
            "kvstore_under_replicated_copies",
            "Block copies cluster clients' puts could not write (an owner "
            "suspect or failing), as they reported them to this node.",
        ),
        (
            "skipped_saves",
            "kvstore_skipped_save_chunks",
            "Chunks engines computed and their connector's save policy did not store (not "
            "expected to be read again), as they reported them to this node.",
        ),
    ):
        f = _counter(name, doc, [])
        f.add_metric([], led.get(ledger_key, 0))
        yield f
    for key, name, doc in (
        (
            "ns_hits",
            "kvstore_namespace_hit_blocks",
            "Blocks found, by namespace fingerprint (first 32 seen; then 'other').",
        ),
        ("ns_misses", "kvstore_namespace_miss_blocks", "Blocks not found, by namespace ('unknown': not attributable)."),
        ("ns_hit_tokens", "kvstore_namespace_hit_tokens", "Prompt tokens found, by namespace."),
    ):
        f = _counter(name, doc, ["namespace", "op"])
        for (ns, op), v in sorted(led[key].items()):
            f.add_metric([ns, op], v)
        yield f

    yield from read_back_families(snap.get("read_back", ()))

    cap = GaugeMetricFamily("kvstore_tier_capacity_bytes", "Capacity of each tier.", labels=["tier"])
    used = GaugeMetricFamily("kvstore_tier_used_bytes", "Bytes allocated in each tier.", labels=["tier"])
    blocks = GaugeMetricFamily("kvstore_tier_blocks", "Blocks stored in each tier.", labels=["tier"])
    for tier, t in snap.get("tiers", {}).items():
        cap.add_metric([tier], t["capacity_bytes"])
        used.add_metric([tier], t["used_bytes"])
        blocks.add_metric([tier], t["blocks"])
    yield cap
    yield used
    yield blocks

    f = _counter(
        "kvstore_evictions",
        "Blocks evicted, by tier (a DRAM eviction with an NVMe copy is a demotion, not a loss).",
        ["tier"],
    )
    f.add_metric(["dram"], c.get("dram_evictions", 0))
    f.add_metric(["nvme"], c.get("nvme_evictions", 0))
    yield f
    f = _counter("kvstore_promotions", "Blocks promoted from NVMe into DRAM.", [])
    f.add_metric([], c.get("promotions", 0))
    yield f
    f = _counter("kvstore_demotions", "Blocks demoted (written) from DRAM to NVMe.", [])
    f.add_metric([], c.get("demotions", 0))
    yield f
    f = _counter(
        "kvstore_bytes",
        "Payload bytes moved, by path (local = shared memory, tcp = data channel, "
        "grpc = streaming fallback, nvme = promotions/demotions) and direction (read = out of the store).",
        ["path", "direction"],
    )
    for (path, direction), counter in BYTE_COUNTERS.items():
        f.add_metric([path, direction], c.get(counter, 0))
    yield f
    f = _counter("kvstore_put_blocks", "Blocks offered for storage, by outcome.", ["outcome"])
    for outcome, counter in PUT_COUNTERS.items():
        f.add_metric([outcome], c.get(counter, 0))
    yield f
    f = _counter(
        "kvstore_corrupt_blocks", "Blocks whose payload failed its checksum and were dropped, by stage.", ["stage"]
    )
    for stage, counter in CORRUPT_COUNTERS.items():
        f.add_metric([stage], c.get(counter, 0))
    f.add_metric(["nvme_index"], snap.get("tiers", {}).get("nvme", {}).get("corrupt_blocks", 0))
    yield f
    recovery = snap.get("tiers", {}).get("nvme", {}).get("recovery", {})
    for name, doc, value in (
        (
            "kvstore_nvme_index_rebuilds",
            "1 if the NVMe index was damaged or lost at start-up and rebuilt from the segment files.",
            recovery.get("index_rebuilds", 0),
        ),
        (
            "kvstore_nvme_recovered_blocks",
            "Blocks found again (verified) in the segment files by that rebuild.",
            recovery.get("recovered_blocks", 0),
        ),
        (
            "kvstore_nvme_dropped_records",
            "Records that rebuild found but dropped: torn, damaged, or partly overwritten after a delete.",
            recovery.get("dropped_records", 0),
        ),
        (
            "kvstore_nvme_write_failures",
            "Blocks the NVMe tier refused (full disk or index, failing media): not demoted or not "
            "persisted by write-through; the put or get never fails for it.",
            c.get("nvme_write_failures", 0),
        ),
    ):
        f = _counter(name, doc, [])
        f.add_metric([], value)
        yield f

    for name, doc, value in (
        ("kvstore_leases", "Read leases held.", snap.get("leases", 0)),
        ("kvstore_reservations", "Unfinished writes (reservations).", snap.get("reservations", 0)),
        ("kvstore_pins", "Pinned blocks.", snap.get("pins", 0)),
        (
            "kvstore_pending_transfers",
            "Data-channel transfers negotiated but not started.",
            snap.get("extra", {}).get("pending_transfers", 0),
        ),
        (
            "kvstore_key_history_capacity",
            "Entries the miss-reason history can hold.",
            snap.get("history", {}).get("capacity", 0),
        ),
    ):
        yield GaugeMetricFamily(name, doc, value=value)
    # per tenant (labels bounded by the config); the admin's holds are not counted
    held = GaugeMetricFamily(
        "kvstore_tenant_held_bytes",
        "DRAM bytes (whole allocation units) each tenant holds beyond eviction's reach, by kind: "
        "reserved = its unfinished writes, pinned = its pins (see [tenants.NAME] max_reserved_bytes, "
        "max_pinned_bytes).",
        labels=["tenant", "kind"],
    )
    for tenant, h in snap.get("tenant_holds", {}).items():
        held.add_metric([tenant, "reserved"], h["reserved_bytes"])
        held.add_metric([tenant, "pinned"], h["pinned_bytes"])
    yield held
    occupied = GaugeMetricFamily(
        "kvstore_tenant_occupied_bytes",
        "Bytes each tenant's blocks occupy, by tier, as allocated "
        "(see [tenants.NAME] max_dram_bytes, max_nvme_bytes; reported where any tenant has one).",
        labels=["tenant", "tier"],
    )
    for tenant, o in snap.get("tenant_occupancy", {}).items():
        occupied.add_metric([tenant, "dram"], o["dram_bytes"])
        occupied.add_metric([tenant, "nvme"], o["nvme_bytes"])
    yield occupied
    f = _counter(
        "kvstore_limit_refusals",
        "Refusals because a tenant was at its limit: reserve = blocks over "
        "max_reserved_bytes (answered NO_SPACE or RESOURCE_EXHAUSTED), pin = Pin calls over max_pinned_bytes, "
        "dram_quota = blocks over max_dram_bytes that its own evictable blocks could not make room for.",
        ["kind"],
    )
    f.add_metric(["reserve"], c.get("reserve_tenant_limit", 0))
    f.add_metric(["pin"], c.get("pin_tenant_limit", 0))
    f.add_metric(["dram_quota"], c.get("reserve_tenant_quota", 0))
    yield f
    f = _counter(
        "kvstore_quota_evictions",
        "Blocks a tenant over its capacity quota evicted of its own (dram), or removed "
        "from NVMe to demote another of its own (nvme).",
        ["tier"],
    )
    f.add_metric(["dram"], c.get("quota_evictions_dram", 0))
    f.add_metric(["nvme"], c.get("quota_evictions_nvme", 0))
    yield f
    f = _counter("kvstore_pins_ttl_capped", "Pins whose TTL was cut to max_pin_ttl_s.", [])
    f.add_metric([], c.get("pins_ttl_capped", 0))
    yield f
    f = _counter(
        "kvstore_key_history_records",
        "Departures (evictions, invalidations, corruption) recorded in the miss-reason history.",
        [],
    )
    f.add_metric([], snap.get("history", {}).get("records", 0))
    yield f


# -- the HTTP endpoint ---------------------------------------------------------------------
TLS_HANDSHAKE_TIMEOUT_S = 10.0
TLS_RECORD_HANDSHAKE = 0x16  # the first byte of every TLS ClientHello


READ_BACK_NAMESPACE_LABELS = 32  # namespaces labelled by their fingerprint; later ones share "other"


def read_back_families(rows: Iterable[Any]) -> Iterator[Metric]:
    """``kvstore_stored_*`` and ``kvstore_read_back_*`` by namespace and position bucket
    (``kvstore/node/readback.py``): the first :data:`READ_BACK_NAMESPACE_LABELS` namespaces
    the node stored in get their fingerprint in hex as label, the rest are summed as ``other``."""
    names: dict[bytes, str] = {}
    sums: dict[tuple[str, str], list[int]] = {}
    for r in rows:
        if r.namespace not in names:
            names[r.namespace] = r.namespace.hex() if r.namespace and len(names) < READ_BACK_NAMESPACE_LABELS else OTHER
        key = (names[r.namespace], bucket_label(r.bucket))
        acc = sums.setdefault(key, [0, 0, 0, 0])
        for i, v in enumerate((r.stored_blocks, r.stored_bytes, r.read_back_blocks, r.read_back_bytes)):
            acc[i] += v
    labels = ["namespace", "position"]
    for i, (name, doc) in enumerate(
        (
            ("kvstore_stored_blocks", "Blocks stored since the node started, by namespace and prompt-position bucket."),
            ("kvstore_stored_bytes", "Payload bytes of those blocks."),
            (
                "kvstore_read_back_blocks",
                "Stored blocks read back (leased) at least once, counted at their first read, by namespace and "
                "prompt-position bucket: read_back / stored is the share of what is stored that pays.",
            ),
            ("kvstore_read_back_bytes", "Payload bytes of those blocks."),
        )
    ):
        f = _counter(name, doc, labels)
        for key, acc in sums.items():
            f.add_metric(list(key), acc[i])
        yield f


def http_server(
    host: str, port: int, handler: type[BaseHTTPRequestHandler], *, ssl_context: ssl.SSLContext | None = None
) -> ThreadingHTTPServer:
    """A threaded HTTP server on ``host`` (IPv4 or IPv6 literal, or a name); raises OSError.

    With ``ssl_context`` (a server context) every connection is HTTPS: the handshake runs
    on the connection's own thread, under ``TLS_HANDSHAKE_TIMEOUT_S``, so a slow or silent
    client never stalls the accept loop."""

    class Server(ThreadingHTTPServer):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        daemon_threads = True  # a stuck client never holds up shutdown

        def finish_request(self, request: Any, client_address: Any) -> None:
            if ssl_context is None:
                super().finish_request(request, client_address)
                return
            request.settimeout(TLS_HANDSHAKE_TIMEOUT_S)
            try:
                first = request.recv(1, socket.MSG_PEEK)
                if first and first[0] != TLS_RECORD_HANDSHAKE:
                    _refuse_plaintext(request)
                    return
                conn = ssl_context.wrap_socket(request, server_side=True)  # closes the socket if it fails
            except (OSError, ValueError) as e:  # ssl.SSLError is an OSError: untrusted, no certificate, reset
                log.debug("TLS handshake with %s failed: %s", client_address[0], e)
                return
            try:
                super().finish_request(conn, client_address)
            finally:  # the plain socket was detached into ``conn``: shutdown_request cannot close it
                try:
                    conn.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                conn.close()

    return Server((host, port), handler)


def _refuse_plaintext(sock: socket.socket) -> None:
    """Answer a plain-HTTP request on an HTTPS port with a 400 that says so (as nginx does).
    What already arrived of the request (a token included) is discarded unparsed."""
    body = b"this port serves HTTPS: scrape https:// (with the CA that signed the node's certificate)\n"
    try:
        sock.recv(65536)  # what already arrived: closing with unread bytes would reset the connection
        sock.sendall(
            b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\n"
            + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass


class MetricsServer:
    """``GET /metrics`` on a thread of its own; ``close`` stops it.  HTTPS with ``ssl_context``."""

    def __init__(
        self, host: str, port: int, metrics: NodeMetrics, *, token: str = "", ssl_context: ssl.SSLContext | None = None
    ) -> None:
        expected = f"Bearer {token}".encode() if token else None

        class Handler(BaseHTTPRequestHandler):
            server_version = "kvstore-metrics"
            sys_version = ""

            def log_message(self, fmt: str, *args: Any) -> None:  # quiet: scrapes every few seconds
                log.debug("metrics %s: " + fmt, self.client_address[0], *args)

            def _send(
                self,
                code: int,
                body: bytes,
                ctype: str = "text/plain; charset=utf-8",
                extra: dict[str, str] | None = None,
            ) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                for k, v in (extra or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path not in ("/metrics", "/"):
                    self._send(404, b"not found; metrics are at /metrics\n")
                    return
                if expected is not None:
                    got = (self.headers.get("Authorization") or "").encode()
                    if not hmac.compare_digest(got, expected):
                        self._send(
                            401,
                            b"missing or wrong bearer token\n",
                            extra={"WWW-Authenticate": 'Bearer realm="kvstore"'},
                        )
                        return
                if path == "/":
                    self._send(200, b"kvstore node metrics: see /metrics\n")
                    return
                try:
                    body = metrics.exposition()
                except Exception as e:  # the loop did not answer: say so rather than serve a partial scrape
                    log.warning("metrics scrape failed: %s", e)
                    self._send(503, f"metrics unavailable: {type(e).__name__}: {e}\n".encode())
                    return
                self._send(200, body, CONTENT_TYPE_LATEST)

            do_HEAD = do_GET

            def _read_only(self) -> None:
                self._send(405, b"read-only: GET /metrics\n", extra={"Allow": "GET, HEAD"})

            do_POST = do_PUT = do_DELETE = do_PATCH = _read_only

        self.tls = ssl_context is not None
        self.httpd = http_server(host, port, Handler, ssl_context=ssl_context)
        self.address: tuple[str, int] = self.httpd.server_address[:2]  # type: ignore[assignment]
        self._thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.2}, name="kvstore-metrics", daemon=True
        )

    def start(self) -> MetricsServer:
        self._thread.start()
        return self

    def close(self) -> None:
        if self._thread.is_alive():
            self.httpd.shutdown()
            self._thread.join(timeout=5)
        self.httpd.server_close()

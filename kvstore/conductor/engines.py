"""The conductor's engines: who they are, whether they answer, and how loaded they are.

Owned by the conductor's event loop: :class:`Engines` holds one :class:`EngineState` per
engine, from two sources, merged by URL:

* ``--engine URL[=ROLE]`` (static: kept for as long as the conductor runs);
* the engines the kvstore connector registers in etcd (``engines/<id>`` under a lease:
  see :class:`kvstore.cluster.state.EngineRecord`); one whose lease lapses drops out.
  A registration also says what a static entry cannot: the engine's namespace fingerprint
  and chunk size (for the pool's keys), its kvstore node, and its KV-events endpoint.

Load accounting (the queue part of the TTFT estimate) is the conductor's own: each request
it sends is *prefilling* until its first token, then *decoding* until it ends.  It is
checked against each engine's ``/metrics`` (``vllm:num_requests_waiting`` and
``..._running``), scraped every ``probe_s``: requests the engine runs that this conductor
did not send (another conductor, a direct client) count too, at the fleet's mean prompt.

Liveness: an engine that refuses a connection or fails its ``/health`` is marked dead at
once (no new request goes there; its KV view is dropped, since a restarted engine has an
empty cache) and probed every ``probe_s`` until it answers again.
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit

from kvstore.errors import InvalidArgument

log = logging.getLogger("kvstore.conductor")

ROLES = ("both", "prefill", "decode")


@dataclasses.dataclass(slots=True)
class Stream:
    """A decoding request's gaps between tokens, as the conductor relays them (the loop's;
    ``intervals`` is the request's own list, appended as tokens pass).

    Mooncake's TBT is the mean of the slowest tenth of a request's gaps (at least one), so a
    single stall can decide it: :meth:`headroom` is the longest stall the request can still
    take and meet ``slo_s`` (negative: it misses already)."""

    max_tokens: int  # what it asked for (16 when it did not say)
    intervals: list[float]
    started: float  # its first token
    _worst: list[float] = dataclasses.field(default_factory=list, init=False, repr=False)
    """The ``k`` longest of the intervals read so far, a min-heap (``k``: :meth:`_k`)."""
    _read: int = dataclasses.field(default=0, init=False, repr=False)
    """How many of ``intervals`` are in ``_worst``'s reckoning (the list only grows)."""
    _answer: tuple[float, float] = dataclasses.field(default=(-1.0, 0.0), init=False, repr=False)
    """(the target, the headroom) last answered for ``_read`` gaps: asked again before a new
    gap (decisions come faster than tokens), the answer is the same."""

    def _k(self) -> int:
        return max(1, -(-max(self.max_tokens - 1, 1) // 10))

    def headroom(self, slo_s: float) -> float:
        """Each call reads only the gaps appended since the last (the conductor asks it of
        every running decode at every decision: sorting every gap each time made a decision
        under overload cost tens of milliseconds)."""
        if len(self.intervals) == self._read and self._answer[0] == slo_s:
            return self._answer[1]
        k = self._k()
        for gap in self.intervals[self._read :]:
            if len(self._worst) < k:
                heapq.heappush(self._worst, gap)
            elif gap > self._worst[0]:
                heapq.heapreplace(self._worst, gap)
        self._read = len(self.intervals)
        total = sum(self._worst)
        if total > k * slo_s:
            h = -1.0
        else:  # less the k - 1 longest: all of them while fewer than k were seen, else all but the k-th
            h = k * slo_s - (total - self._worst[0] if len(self._worst) == k else total)
        self._answer = (slo_s, h)
        return h

    def remaining_s(self, now: float) -> float:
        """Seconds of decoding it likely has left, at its own pace so far."""
        done = len(self.intervals)
        pace = (now - self.started) / done if done else 0.05
        return max(0, self.max_tokens - 1 - done) * pace


@dataclasses.dataclass
class Inflight:
    """A request the conductor sent to an engine."""

    compute_tokens: int  # prompt tokens the engine computes (the estimate's)
    sent_at: float  # monotonic
    work_s: float = 0.0  # its own work, as estimated when it was sent (compute and loads)
    first_at: float | None = None
    late: bool = False  # past three quarters of its estimate (see EngineState.queued_s)

    @property
    def due(self) -> float:
        """When it turns late: its queue share is then a quarter of its work."""
        return self.sent_at + 0.75 * self.work_s


@dataclasses.dataclass
class EngineState:
    """One engine (see the module docstring).  Mutated on the conductor's loop only."""

    engine_id: str
    url: str
    role: str = "both"
    models: tuple[str, ...] = ()
    static: bool = False
    registered: bool = False  # seen in etcd (and not yet gone)
    fingerprint: bytes | None = None  # rank 0's base namespace (None: the pool's keys are unknown)
    chunk_tokens: int = 0
    block_size: int = 0
    node: str = ""  # the kvstore target it saves and loads through
    node_id: str = ""  # that node's id in the cluster ("" unknown)
    kv_events: str = ""
    kv_events_replay: str = ""
    bytes_per_token: int = 0
    alive: bool = True
    last_error: str = ""
    failures: int = 0
    slow_probes: int = 0  # probes in a row that timed out
    prefilling: dict[str, Inflight] = dataclasses.field(default_factory=dict)
    """Read-only outside this class: :meth:`sent`, :meth:`first_token` and :meth:`end` change
    it and keep the queue's sums (below) in step with it."""
    decoding: dict[str, Stream] = dataclasses.field(default_factory=dict)
    scraped_waiting: int = 0
    scraped_running: int = 0
    scraped_at: float = 0.0
    served: int = 0
    # prompt tokens of the requests routed here, by predicted source (engine, pool_dram,
    # pool_nvme, pool_remote, compute): the engine's hit ratio on the dashboard
    tokens: dict[str, int] = dataclasses.field(default_factory=dict)
    # The queue's sums, kept as requests come and go so that a decision costs no walk over
    # them (thousands under overload): prompt tokens to compute; of the requests not yet
    # late, how many and the sum of (work + sent_at - _base); of the late, a quarter of their
    # work; and a heap of (due, seq, rid) that turns requests late as the clock passes.
    _tokens: int = dataclasses.field(default=0, init=False, repr=False)
    _fresh_n: int = dataclasses.field(default=0, init=False, repr=False)
    _fresh_sum: float = dataclasses.field(default=0.0, init=False, repr=False)
    _late_sum: float = dataclasses.field(default=0.0, init=False, repr=False)
    _base: float = dataclasses.field(default=0.0, init=False, repr=False)
    _due: list[tuple[float, int, str]] = dataclasses.field(default_factory=list, init=False, repr=False)
    _seq: int = dataclasses.field(default=0, init=False, repr=False)

    def hit_ratio(self) -> float | None:
        total = sum(self.tokens.values())
        return None if not total else round(1 - self.tokens.get("compute", 0) / total, 4)

    def _others(self, now: float) -> int:
        """Requests the engine reports waiting beyond the ones this conductor sent."""
        return max(0, self.scraped_waiting - len(self.prefilling)) if now - self.scraped_at < 5 else 0

    def sent(self, rid: str, f: Inflight) -> None:
        """The conductor sent ``rid`` here: it is queued until its first token."""
        self.end(rid)
        if not self.prefilling:
            self._base = f.sent_at
        self.prefilling[rid] = f
        self._tokens += f.compute_tokens
        self._fresh_n += 1
        self._fresh_sum += f.work_s + f.sent_at - self._base
        self._seq += 1
        heapq.heappush(self._due, (f.due, self._seq, rid))

    def first_token(self, rid: str, stream: Stream) -> None:
        """``rid``'s first token came: it decodes now."""
        self.end(rid)
        self.decoding[rid] = stream

    def end(self, rid: str) -> None:
        """``rid`` left (its first token, its end, its failure): nothing of it stays queued."""
        self.decoding.pop(rid, None)
        f = self.prefilling.pop(rid, None)
        if f is None:
            return
        if not self.prefilling:  # exact again: no rounding carried from the requests gone
            self._tokens, self._fresh_n, self._fresh_sum, self._late_sum, self._due = 0, 0, 0.0, 0.0, []
            return
        self._tokens -= f.compute_tokens
        if f.late:
            self._late_sum -= 0.25 * f.work_s
        else:
            self._fresh_n -= 1
            self._fresh_sum -= f.work_s + f.sent_at - self._base

    def queued_tokens(self, now: float, mean_prompt: float) -> float:
        """Prompt tokens still to compute ahead of a new request (for ties and ``/metrics``):
        the requests sent here with no first token yet, plus the others the engine
        reports waiting, at the fleet's mean prompt."""
        return self._tokens + self._others(now) * mean_prompt

    def queued_s(self, now: float, mean_work_s: float) -> float:
        """Seconds of work queued ahead of a new request: each request sent here with no
        first token yet, its estimated work less the time since it was sent (at least a
        quarter of it: a request past three quarters of its estimate is late, not done),
        plus the others the engine reports waiting, at the fleet's mean work.  ``now`` never
        goes back (the conductor's monotonic clock); the cost is the requests turned late
        since the last call, not the queue's length."""
        while self._due and self._due[0][0] <= now:
            _, _, rid = heapq.heappop(self._due)
            f = self.prefilling.get(rid)
            if f is None or f.late or f.due > now:  # gone (or sent again since): nothing to move
                continue
            f.late = True
            self._fresh_n -= 1
            self._fresh_sum -= f.work_s + f.sent_at - self._base
            self._late_sum += 0.25 * f.work_s
        mine = self._fresh_sum - self._fresh_n * (now - self._base) + self._late_sum if self.prefilling else 0.0
        return max(0.0, mine) + self._others(now) * mean_work_s

    def running(self, now: float) -> int:
        fresh = now - self.scraped_at < 5
        return max(len(self.decoding), self.scraped_running if fresh else 0)

    def describe(self, now: float) -> dict[str, Any]:
        return {
            "engine_id": self.engine_id,
            "url": self.url,
            "role": self.role,
            "models": list(self.models),
            "alive": self.alive,
            "source": "static" if self.static else "etcd",
            "node": self.node,
            "node_id": self.node_id,
            "kv_events": self.kv_events,
            "prefilling": len(self.prefilling),
            "decoding": len(self.decoding),
            "scraped": {"waiting": self.scraped_waiting, "running": self.scraped_running},
            "served": self.served,
            "tokens": dict(self.tokens),
            "hit_ratio": self.hit_ratio(),
            "last_error": self.last_error,
        }


def parse_engine(spec: str) -> tuple[str, str]:
    """``URL[=ROLE]`` → (url, role); a clear error for anything else."""
    url, _, role = spec.partition("=")
    role = role or "both"
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or not parts.port:
        raise InvalidArgument(f"--engine {spec!r}: want http://HOST:PORT[=ROLE]")
    if role not in ROLES:
        raise InvalidArgument(f"--engine {spec!r}: role must be one of {', '.join(ROLES)}")
    return url.rstrip("/"), role


class Engines:
    """Every engine the conductor knows (see the module docstring)."""

    def __init__(self, static: Iterable[tuple[str, str]] = ()) -> None:
        self.by_id: dict[str, EngineState] = {}
        for url, role in static:
            eid = urlsplit(url).netloc
            self.by_id[eid] = EngineState(eid, url, role, static=True)

    def live(self, model: str | None = None) -> list[EngineState]:
        return [e for e in self.by_id.values() if e.alive and (model is None or not e.models or model in e.models)]

    def models(self) -> list[str]:
        return sorted({m for e in self.by_id.values() for m in e.models})

    def by_url(self, url: str) -> EngineState | None:
        url = url.rstrip("/")
        return next((e for e in self.by_id.values() if e.url == url), None)

    def apply_registry(self, records: Mapping[str, Any], nodes: Mapping[str, Any]) -> tuple[list[str], list[str]]:
        """Merge etcd's engine records (``EngineRecord`` by id) and node records (``NodeInfo``
        by id, to name each engine's node); returns (engines added, engines gone)."""
        added, gone = [], []
        target_to_node = {}
        for nid, n in nodes.items():
            for t in (getattr(n, "unix", ""), getattr(n, "grpc", "")):
                if t:
                    target_to_node[t] = nid
        seen = set()
        for rec in records.values():
            url = rec.url.rstrip("/")
            e = self.by_url(url)
            if e is None:
                # registered before its server listens: in once a probe finds it answering
                e = self.by_id[rec.engine_id] = EngineState(rec.engine_id, url, rec.role, alive=False)
                added.append(rec.engine_id)
            seen.add(e.engine_id)
            e.registered = True
            e.role = rec.role if not e.static else e.role
            e.models = tuple(rec.models)
            e.fingerprint = bytes.fromhex(rec.fingerprint) if rec.fingerprint else None
            e.chunk_tokens, e.block_size = int(rec.chunk_tokens), int(rec.block_size)
            e.node = rec.node
            e.node_id = target_to_node.get(rec.node, target_to_node.get(rec.node.removeprefix("unix://"), ""))
            e.kv_events, e.kv_events_replay = rec.kv_events, rec.kv_events_replay
            e.bytes_per_token = int(rec.bytes_per_token)
        for eid, e in list(self.by_id.items()):
            if e.registered and eid not in seen:
                e.registered = False
                if not e.static:
                    del self.by_id[eid]
                    gone.append(eid)
        return added, gone

    def mark_dead(self, e: EngineState, why: str) -> bool:
        """True if it was alive (the caller drops its KV view)."""
        was = e.alive
        e.alive, e.last_error = False, why
        e.failures += 1
        if was:
            log.warning("engine %s (%s) taken out: %s", e.engine_id, e.url, why)
        return was

    def mark_alive(self, e: EngineState) -> None:
        if not e.alive:
            log.info("engine %s (%s) answers again", e.engine_id, e.url)
        e.alive, e.last_error = True, ""


def scrape_counts(text: str) -> tuple[int, int]:
    """(waiting, running) from a vLLM engine's ``/metrics`` text (summed over its labels)."""
    waiting = running = 0.0
    for line in text.splitlines():
        if line.startswith("vllm:num_requests_waiting"):
            waiting += _value(line)
        elif line.startswith("vllm:num_requests_running"):
            running += _value(line)
    return int(waiting), int(running)


def _value(line: str) -> float:
    try:
        return float(line.rsplit(" ", 1)[1])
    except (IndexError, ValueError):
        return 0.0


def now() -> float:
    return time.monotonic()

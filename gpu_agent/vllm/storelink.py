"""The scheduler half's store calls, off vLLM's scheduler thread (scheduler process only).

vLLM's scheduler thread asks the connector about every waiting request on every step it
waits (``get_num_new_matched_tokens``); a store call made there holds the whole engine,
and a cluster-wide lookup is a fan-out of RPCs.  :class:`StoreLink` owns the scheduler
half's clients and makes every call on one thread of its own (``kvstore-lookup``):

* :meth:`lookup`: a prefix lookup, answered as a :class:`LookupAnswer` through a future
  (the scheduler waits for it within its pass's budget, ``gpu_agent.vllm.pacing``, then
  tells vLLM "not yet" and picks the answer up at a later ask);
* :meth:`report_hits`: vLLM's own prefix-cache hits, and :meth:`report_skipped` the
  chunks ``save_policy`` did not store, for the node's metrics, coalesced and sent at most
  once a second, fire and forget;
* :meth:`tiers`: where keys are now (the KV-event resync), through a future;
* :meth:`read_back`: the engine's own node's read-back counters (``Stats``: what share of
  what it stored was read back, per namespace and position bucket), through a future, for
  ``save_policy`` ``evidence`` (the scheduler polls every :data:`READ_BACK_EVERY_S`).

State it owns: the clients (``lookup_target``'s, the engine's own node's for locality and
for the hits it reports),
touched only on its thread; a failed call drops them (the next call dials afresh) and
comes back as the answer's ``error``, never as an exception on the scheduler thread.
Each call is bounded by the clients' deadlines (``deadline_s``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import threading
import time
from typing import Any

from gpu_agent.vllm.settings import ConnectorSettings
from gpu_agent.vllm.spec import rank_lookup_keys
from kvstore.keys import ChunkKey, Namespace

log = logging.getLogger(__name__)

REPORT_EVERY_S = 1.0
"""How often coalesced prefix-cache hits go to the node (metrics only)."""
READ_BACK_EVERY_S = 1.0
"""How often the scheduler asks its node what share of what it stored was read back."""


@dataclasses.dataclass(frozen=True, slots=True)
class LookupAnswer:
    """One prefix lookup: ``found`` leading chunks from the asked ``first`` on that every
    rank's shard holds (the trailing partial chunk counted last), rank 0's ``tiers`` and,
    per found chunk, whether the engine's own node holds it (``local``; all True when the
    lookup asked that node itself); ``seconds`` on the clock, ``cpu_seconds`` of the link
    thread's CPU.  ``error``: the call failed (nothing found)."""

    found: int = 0
    tiers: tuple[str, ...] = ()
    local: tuple[bool, ...] = ()
    seconds: float = 0.0
    error: Exception | None = None
    cpu_seconds: float = 0.0  # the link thread's CPU time for it (what asking cost)


class StoreLink:
    """The scheduler half's clients and the thread that uses them (see the module docstring)."""

    def __init__(self, settings: ConnectorSettings, ranks: list[tuple[int, int]]) -> None:
        self.settings, self.ranks = settings, ranks
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvstore-lookup")
        self._client: Any = None  # lookup_target's (or target's): the lookup thread's only
        self._local: Any = None  # the engine's own node: locality (lookups elsewhere), read-back counters
        self._reporter: Any = None  # the engine's own node, for the hits it reports
        self._lock = threading.Lock()  # guards the coalesced hits below (scheduler thread → lookup thread)
        self._hits: dict[bytes, tuple[Namespace, int, int]] = {}
        self._skipped: dict[bytes, tuple[Namespace, int]] = {}  # chunks not stored, by namespace
        self._report_at = 0.0
        self._report_down_until = 0.0
        self._closed = False

    # -- the scheduler thread's calls ----------------------------------------------------
    def lookup(
        self, tokens: list[int], ns: Namespace, first: int, session: str | None
    ) -> concurrent.futures.Future[LookupAnswer]:
        return self._pool.submit(self._lookup, tokens, ns, first, session)

    def tiers(self, keys: list[ChunkKey]) -> concurrent.futures.Future[list[str | None]]:
        return self._pool.submit(lambda: self._lookup_client().lookup(keys))

    def read_back(self) -> concurrent.futures.Future[list[dict[str, Any]]]:
        """The read-back rows (``KVClient.stats()["read_back"]``) of the engine's own node, or
        of every node of a cluster target (rows of one namespace and bucket add up)."""
        return self._pool.submit(self._read_back)

    def report_hits(self, ns: Namespace, tokens: int, chunk: int) -> None:
        """Count ``tokens`` of vLLM's own prefix-cache hits; sent within ``REPORT_EVERY_S``."""
        if tokens <= 0:
            return
        with self._lock:
            _, blocks, n = self._hits.get(ns.fingerprint, (ns, 0, 0))
            self._hits[ns.fingerprint] = (ns, blocks + max(1, tokens // chunk), n + tokens)
        self._report_soon()

    def report_skipped(self, ns: Namespace, chunks: int) -> None:
        """Count ``chunks`` computed and not stored (``save_policy``); sent within ``REPORT_EVERY_S``."""
        if chunks <= 0:
            return
        with self._lock:
            _, n = self._skipped.get(ns.fingerprint, (ns, 0))
            self._skipped[ns.fingerprint] = (ns, n + chunks)
        self._report_soon()

    def _report_soon(self) -> None:
        now = time.monotonic()
        if now >= self._report_at:
            self._report_at = now + REPORT_EVERY_S
            self._pool.submit(self._report)

    def flush(self) -> None:
        """Send the hits counted so far now (waits at most ``deadline_s``)."""
        with contextlib.suppress(Exception):
            self._pool.submit(self._report).result(timeout=self.settings.deadline_s)

    @property
    def reporting(self) -> bool:
        """Hits reach the engine's own node (no report failed lately)."""
        return self._reporter is not None and self._report_down_until == 0.0

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.flush()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._drop()

    # -- the lookup thread ------------------------------------------------------------------
    def _lookup_client(self) -> Any:
        if self._client is None:
            self._client = self.settings.client(self.settings.lookup_target or None)
        return self._client

    def _drop(self) -> None:
        for name in ("_client", "_local", "_reporter"):
            c = getattr(self, name)
            setattr(self, name, None)
            if c is not None:
                with contextlib.suppress(Exception):  # closing a broken client is best effort
                    c.close()

    def _lookup(self, tokens: list[int], ns: Namespace, first: int, session: str | None) -> LookupAnswer:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            n, tiers, keys0 = -1, [], []
            for t, p in self.ranks:
                keys = rank_lookup_keys(tokens, ns, t, p, first)
                got, where = self._lookup_client().match_prefix_tiers(keys, session_id=session)
                if n < 0:
                    tiers, keys0 = list(where), keys
                n = got if n < 0 else min(n, got)
                if n == 0:
                    break
            n = max(n, 0)
            local = self._locality(keys0[:n]) if n else []
            return LookupAnswer(
                n, tuple(tiers[:n]), tuple(local), time.perf_counter() - t0, cpu_seconds=time.thread_time() - c0
            )
        except Exception as e:  # handed to the scheduler thread as the answer
            self._drop()  # a fresh channel next time, not one parked in reconnect back-off
            return LookupAnswer(seconds=time.perf_counter() - t0, error=e)

    def _read_back(self) -> list[dict[str, Any]]:
        try:
            if self._local is None:
                self._local = self.settings.client(self.settings.target or None)
            s = self._local.stats()
        except Exception:
            local, self._local = self._local, None
            if local is not None:
                with contextlib.suppress(Exception):  # closing a broken client is best effort
                    local.close()
            raise
        if "nodes" in s:  # a cluster target: every node's rows
            return [r for n in s["nodes"].values() for r in n.get("read_back", ())]
        return list(s.get("read_back", ()))

    def _locality(self, keys: list[ChunkKey]) -> list[bool]:
        """Which of ``keys`` the engine's own node holds (loads need no pull): all of them
        when the lookup asked that node itself; unknown (a failed call) counts as remote."""
        if not self.settings.lookup_target:
            return [True] * len(keys)
        try:
            if self._local is None:
                self._local = self.settings.client(self.settings.target or None)
            return [t is not None for t in self._local.lookup(keys)]
        except Exception as e:  # unknown: treated as remote (pulled, in the background)
            log.debug("kvstore: asking the local node which chunks it holds failed (%s)", e)
            local, self._local = self._local, None
            if local is not None:
                with contextlib.suppress(Exception):
                    local.close()
            return [False] * len(keys)

    def _report(self) -> None:
        """vLLM's own prefix-cache hits never reach the store: report them (tier HBM) to the
        engine's own node.  Metrics only: a failure pauses reporting for ``retry_s``."""
        with self._lock:
            hits, self._hits = self._hits, {}
            skipped, self._skipped = self._skipped, {}
        now = time.monotonic()
        if not (hits or skipped) or now < self._report_down_until:
            return
        try:
            if self._reporter is None:
                self._reporter = self.settings.client(self.settings.target or None)
            if not hasattr(self._reporter, "report_hits"):  # a cluster target: no node of its own to count them
                self._report_down_until = float("inf")
                return
            for ns, blocks, tokens in hits.values():
                self._reporter.report_hits(blocks, tokens, tier="hbm", op="match_prefix", namespace=ns)
            for ns, chunks in skipped.values():
                self._reporter.report_skipped_saves(chunks, namespace=ns)
        except Exception as e:  # metrics only: never worth an engine, nor its lookups
            retry = self.settings.retry_s
            log.warning("kvstore: reporting prefix-cache hits failed (%s); not reporting for %.0f s", e, retry)
            self._report_down_until = now + retry
            reporter, self._reporter = self._reporter, None
            if reporter is not None:
                with contextlib.suppress(Exception):
                    reporter.close()

"""Pulls for requests that wait: other nodes' chunks into the engine's own node while the
request is queued (scheduler process only).

A request whose prefix the pool holds on another node loads it through a pull
(:mod:`gpu_agent.pull`: over TCP from the holder into this machine's node, then the
shared-memory load) once vLLM schedules it, so the pull is in its time to first token.  A
request that arrives behind others waits for its turn first, and the pull can run in that
wait: at arrival the scheduler half asks the pool's view where the prefix's chunks are and,
when some are on other nodes and requests are waiting ahead of it, hands the pull to
:class:`Prefetcher`.  When vLLM schedules the request its chunks are the engine's own
node's: the view shows them there, the load is the local one, and the worker's pull finds
them present and fetches nothing.  This is the pool's prefetch on the engine a request was
sent to (the conductor's choice, or round robin's), before the request lands on it.

State it owns: one thread (``kvstore-prefetch``), its two clients (the engine's own node,
``target``, and the cluster, ``lookup_target``), touched only on that thread, and at most
:data:`MAX_QUEUED` pulls queued or running (beyond that a request's prefetch is skipped: a
prefetch is advice, the load's own pull still runs).  Counters under a lock, read by the
scheduler thread.  A pull that fails leaves its chunks where they were (the load pulls
them, or computes); a failure drops the clients (the next pull dials afresh).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import time
from typing import Any

from gpu_agent.counters import LockedCounters
from gpu_agent.pull import pull_missing
from gpu_agent.vllm.settings import ConnectorSettings
from gpu_agent.vllm.spec import rank_namespace
from kvstore.keys import Namespace, chunk_keys, tail_key

log = logging.getLogger(__name__)

MAX_QUEUED = 4
"""Prefetches queued or running at once; more are skipped (counted in ``prefetch_skipped``)."""


@dataclasses.dataclass
class PrefetchCounters(LockedCounters):
    prefetches: int = 0  # pulls handed to the thread
    prefetch_blocks: int = 0  # blocks they put into the engine's own node
    prefetch_skipped: int = 0  # requests not prefetched: MAX_QUEUED pulls were pending
    prefetch_errors: int = 0  # pulls that failed (their chunks stay remote)
    prefetch_us: int = 0  # the thread's time pulling


PREFETCH_KEYS = tuple(f.name for f in dataclasses.fields(PrefetchCounters) if f.name != "lock")


class Prefetcher:
    """Pulls of queued requests' remote chunks (see the module docstring)."""

    def __init__(self, settings: ConnectorSettings, ranks: list[tuple[int, int]], chunk: int) -> None:
        if not settings.lookup_target:
            raise ValueError("a prefetcher pulls from lookup_target: none is set")
        self.settings, self.ranks, self.chunk = settings, ranks, chunk
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvstore-prefetch")
        self._local: Any = None  # the engine's own node (prefetch thread only)
        self._remote: Any = None  # lookup_target's client (prefetch thread only)
        self.counters = PrefetchCounters()
        self._pending = 0  # under counters.lock
        self._closed = False

    def submit(self, req_id: str, tokens: list[int], ns: Namespace, found: int) -> bool:
        """Pull the first ``found`` chunks of ``tokens`` (the trailing partial chunk counted
        last, as a lookup counts it) that the engine's own node lacks, for every rank's shard;
        False: skipped (closed, or :data:`MAX_QUEUED` pulls pending)."""
        with self.counters.lock:
            if self._closed or self._pending >= MAX_QUEUED:
                self.counters.prefetch_skipped += 1
                return False
            self._pending += 1
            self.counters.prefetches += 1
        try:
            self._pool.submit(self._pull, req_id, list(tokens), ns, found)
        except RuntimeError:  # shut down meanwhile
            with self.counters.lock:
                self._pending -= 1
            return False
        return True

    def snapshot(self) -> dict[str, float]:
        return self.counters.snapshot()

    def close(self) -> None:
        with self.counters.lock:
            self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._drop()

    # -- the prefetch thread ----------------------------------------------------------
    def _clients(self) -> tuple[Any, Any]:
        if self._local is None:
            self._local = self.settings.client(self.settings.target or None)
        if self._remote is None:
            self._remote = self.settings.client(self.settings.lookup_target)
        return self._local, self._remote

    def _drop(self) -> None:
        for name in ("_local", "_remote"):
            c = getattr(self, name)
            setattr(self, name, None)
            if c is not None:
                with contextlib.suppress(Exception):  # closing a broken client is best effort
                    c.close()

    def _pull(self, req_id: str, tokens: list[int], ns: Namespace, found: int) -> None:
        t0 = time.perf_counter()
        put = 0
        try:
            local, remote = self._clients()
            for t, p in self.ranks:
                rns = rank_namespace(ns, t, p)
                chain = chunk_keys(tokens, rns)
                tail_tokens = 0
                if found > len(chain):  # the trailing partial chunk was found too
                    tail = tail_key(tokens, rns, chain)
                    if tail is not None:
                        chain.append(tail)
                        tail_tokens = len(tokens) % self.chunk
                put += pull_missing(local, remote, chain[:found], 0, rns, self.chunk, tail_tokens=tail_tokens)
            with self.counters.lock:
                self.counters.prefetch_blocks += put
        except Exception as e:  # advice only: the load pulls what is still remote
            self._drop()
            with self.counters.lock:
                self.counters.prefetch_errors += 1
            log.info("kvstore: prefetching %s's chunks from %s failed (%s)", req_id, self.settings.lookup_target, e)
        finally:
            with self.counters.lock:
                self._pending -= 1
                self.counters.prefetch_us += int((time.perf_counter() - t0) * 1e6)

"""The connector's scheduler half: lookups and per-request bookkeeping (scheduler process only).

It owns no KV bytes.  For each request it keeps the live ``Request`` (vLLM appends the
generated tokens to it), the request's block table as vLLM hands it out step by step, and
three counts, each in tokens or leading chunks of the request's tokens:

* ``local_tokens``: what vLLM's own prefix cache supplied at the last lookup (vLLM passes
  it to ``get_num_new_matched_tokens``; it sets ``request.num_computed_tokens`` only
  *after* ``update_state_after_alloc``, so the count is kept here, not read back);
* the load: tokens ``[local_tokens, local_tokens + external)``, nothing below;
* ``saved_chunks``: leading chunks stored already or whose save was issued.  Each step
  the chunks the step completes (prompt chunks as chunked prefill computes them and,
  with ``save_decode``, chunks the decode fills) are saved from ``saved_chunks`` on.

Invariants: a chunk counts as stored only when every tensor/pipeline rank's shard is
(lookups ask for each rank's keys and take the shortest run); a request held for its
saves (``request_finished`` → True) is one every worker reports finished (the workers
record every save, started or not); a store that fails is not asked again for
``RETRY_S``, and no call here waits longer than ``deadline_s``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import KVCacheEvent
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from gpu_agent.vllm.events import KVStoreEvents, StoredChunks
from gpu_agent.vllm.metadata import KVStoreMeta, LoadSpec, SaveSpec
from gpu_agent.vllm.settings import RETRY_S, ConnectorSettings, EngineSpec
from gpu_agent.vllm.spec import all_ranks, rank_namespace, request_namespace, request_session, unkeyable
from gpu_agent.vllm.stats import SCHEDULER_KEYS, KVStoreStats, delta
from kvstore.errors import KVStoreError
from kvstore.keys import Namespace, chunk_keys, tail_key

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

TIER_SOURCE = {"dram": CacheHitSource.HOST, "nvme": CacheHitSource.DISK, "hbm": CacheHitSource.HOST}
HANDOFF_POLL_S = 0.01
"""How often a request waiting for its producer's chunks asks the store again."""


@dataclasses.dataclass
class _Req:
    request: Any  # vLLM's live Request: all_token_ids grows as it decodes
    namespace: Namespace  # rank 0's; workers key their own rank
    session_id: str | None
    skip: str | None  # why it is never loaded or saved (unkeyable), or None
    block_ids: list[int] = dataclasses.field(default_factory=list)
    local_tokens: int = 0
    external_tokens: int = 0
    found_chunks: int = 0  # leading full chunks the last lookup found (every rank's shard)
    tiers: list[str] = dataclasses.field(default_factory=list)
    saved_chunks: int = 0
    tail_saved: bool = False  # the prompt's trailing partial chunk (keyed by its exact tokens)
    saves: int = 0
    wait_until: float = 0.0  # the handoff's deadline (0: not waiting)
    next_ask: float = 0.0
    async_load: bool = False  # the last hit loads in the background (vLLM's load_kv_async)


class SchedulerSide:
    """Lookups and per-request bookkeeping (see the module docstring)."""

    def __init__(
        self,
        spec: EngineSpec,
        settings: ConnectorSettings,
        chunk: int,
        *,
        produce: bool,
        consume: bool,
        events: bool = False,
    ) -> None:
        self.spec, self.settings, self.chunk = spec, settings, chunk
        self.produce, self.consume = produce, consume
        self.ranks = all_ranks(spec)
        self._client: Any = None
        self._reqs: dict[str, _Req] = {}
        self._loads: dict[str, LoadSpec] = {}
        self._events: KVStoreEvents | None = None
        self.stored = StoredChunks(settings.events_resync_s if events and produce else 0.0)
        self._down_until = 0.0  # lookups resume then (a store call failed)
        self._reporter: Any = None  # the engine's own node, for the prefix-cache hits it reports
        self._local: Any = None  # the engine's own node, asked which chunks it holds (async_loads=auto)
        self._report_down_until = 0.0
        self.counters: dict[str, int] = {k: 0 for k in SCHEDULER_KEYS}
        self._reported: dict[str, int] = {}

    # -- the store ----------------------------------------------------------------------
    def client(self) -> Any:
        if self._client is None:
            self._client = self.settings.client(self.settings.lookup_target or None)
        return self._client

    def _drop_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # closing a broken client is best effort
                pass

    def _store_failed(self, e: Exception, what: str) -> None:
        self.counters["lookup_errors"] += 1
        if isinstance(e, KVStoreError):
            log.warning("kvstore %s failed (%s); serving without the store for %.0f s", what, e, RETRY_S)
        else:  # not the store's answer: a bug here or in the SDK; the engine goes on without the store
            log.exception("kvstore %s raised; serving without the store for %.0f s", what, RETRY_S)
        self._down_until = time.monotonic() + RETRY_S
        self._drop_client()  # a fresh channel then, not one parked in reconnect back-off

    def _lookup(self, tokens: list[int], ns: Namespace, first: int, session: str | None) -> tuple[int, list[str]]:
        """Leading chunks from ``first`` on (the trailing partial one last) that every rank's
        shard holds, and rank 0's tiers."""
        n, tiers = -1, []
        for t, p in self.ranks:
            rns = rank_namespace(ns, t, p)
            chain = chunk_keys(tokens, rns)
            keys = chain[first:]
            tail = tail_key(tokens, rns, chain)
            if tail is not None:
                keys.append(tail)
            got, where = self.client().match_prefix_tiers(keys, session_id=session)
            if n < 0:
                tiers = list(where)
            n = got if n < 0 else min(n, got)
            if n == 0:
                break
        return max(n, 0), tiers[: max(n, 0)]

    # -- vLLM's calls -------------------------------------------------------------------
    def _track(self, request: Request) -> _Req:
        r = self._reqs.get(request.request_id)
        if r is None:
            why = unkeyable(request)
            if why is not None:
                self.counters["unkeyable_requests"] += 1
                log.info("kvstore: request %s has %s: neither loaded nor saved", request.request_id, why)
            ns = request_namespace(self.spec, self.settings, self.chunk, request)
            r = self._reqs[request.request_id] = _Req(request, ns, request_session(request), why)
        return r

    def _handoff_tokens(self, request: Request, ns: Namespace, num_tokens: int) -> int:
        """Leading tokens a producer said it saved for this prompt (its ``kv_transfer_params``),
        when they are keyed as this engine keys them; 0 when there is nothing to wait for."""
        params = getattr(request, "kv_transfer_params", None)
        info = params.get("kvstore") if isinstance(params, dict) else None
        if not isinstance(info, dict):
            return 0
        try:
            if Namespace.from_dict(info["namespace"]).fingerprint != ns.fingerprint:
                return 0  # another model, rank layout or tenant: its chunks are not ours
            saved = int(info.get("saved_tokens", 0))
            if saved == num_tokens:
                return saved  # the whole prompt, its trailing partial chunk too
            return max(0, min(int(info.get("saved_chunks", 0)) * self.chunk, num_tokens // self.chunk * self.chunk))
        except (KeyError, TypeError, ValueError, KVStoreError):
            return 0  # malformed params are no reason to wait

    def matched(self, request: Request, num_computed: int) -> tuple[int | None, bool]:
        """Tokens beyond vLLM's ``num_computed`` the store supplies (None: ask again next step,
        a producer's chunks are still being committed)."""
        if not self.consume:
            return 0, False
        r = self._track(request)
        r.local_tokens = num_computed
        if r.skip is not None:
            return 0, False
        tokens = list(request.all_token_ids)
        full, partial = divmod(len(tokens), self.chunk)
        first = num_computed // self.chunk
        if (full <= first and not partial) or time.monotonic() < self._down_until:
            return 0, False
        want = self._handoff_tokens(request, r.namespace, len(tokens))
        now = time.monotonic()
        if r.wait_until and now < r.next_ask and now < r.wait_until:
            self.counters["handoff_waits"] += 1
            return None, False
        t0 = time.perf_counter()
        try:
            n, tiers = self._lookup(tokens, r.namespace, first, r.session_id)
        except Exception as e:  # noqa: BLE001 - the engine must outlive any store failure: it recomputes
            self._store_failed(e, f"lookup for request {request.request_id}")
            return 0, False
        self.counters["lookups"] += 1
        self.counters["lookup_us"] += int((time.perf_counter() - t0) * 1e6)
        found = first + n  # chunks, the tail counted as one
        found_tokens = len(tokens) if partial and found > full else found * self.chunk
        if want > found_tokens:
            now = time.monotonic()
            if not r.wait_until:
                r.wait_until = now + self.settings.deadline_s
            if now < r.wait_until:
                r.next_ask = now + HANDOFF_POLL_S
                self.counters["handoff_waits"] += 1
                return None, False
            if r.next_ask >= 0:
                self.counters["handoff_timeouts"] += 1
                log.warning(
                    "kvstore: request %s: its producer saved %d tokens, %d are committed after %.1f s; "
                    "recomputing the rest",
                    request.request_id,
                    want,
                    found_tokens,
                    self.settings.deadline_s,
                )
            r.next_ask = -1.0
        r.found_chunks, r.tiers = min(found, full), tiers
        if partial and found > full and len(tokens) == int(request.num_prompt_tokens):
            r.tail_saved = True  # the whole prompt is stored, its tail too: nothing to save again
        if first == 0:
            r.saved_chunks = max(r.saved_chunks, r.found_chunks)  # stored already: never saved again
        # vLLM computes at least the last token: a prompt stored whole loads all but that one
        end = min(found_tokens, request.num_tokens - 1)
        n = max(0, end - num_computed)
        r.async_load = n > 0 and self._load_async(tokens, r.namespace, first, found, tiers)
        if r.async_load:
            self.counters["async_loads"] += 1
        return n, r.async_load

    def _load_async(self, tokens: list[int], ns: Namespace, first: int, found: int, tiers: list[str]) -> bool:
        """Whether chunks ``[first, found)`` load in the background (``async_loads``): with
        ``auto``, when any is on NVMe, or not on this engine's own node (a remote pull)."""
        mode = self.settings.async_loads
        if mode != "auto":
            return mode == "always"
        if "nvme" in tiers:
            return True
        if not self.settings.lookup_target:
            return False  # the lookup asked this engine's own node: its tiers say it all
        try:
            if self._local is None:
                self._local = self.settings.client(self.settings.target or None)
            chain = chunk_keys(tokens, ns)
            tail = tail_key(tokens, ns, chain)
            keys = (chain + ([tail] if tail is not None else []))[first:found]
            return any(t != "dram" for t in self._local.lookup(keys))
        except Exception as e:  # noqa: BLE001 - unknown: the background load is right either way
            log.debug("kvstore: asking the local node which chunks it holds failed (%s)", e)
            self._drop_local()
            return True

    def _drop_local(self) -> None:
        client, self._local = self._local, None
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()

    def hit_sources(self, request: Request, num_external: int) -> dict[CacheHitSource, int]:
        r = self._reqs.get(request.request_id)
        if num_external <= 0 or r is None:
            return {}
        out: dict[CacheHitSource, int] = {}
        left = num_external
        for t in reversed(r.tiers):  # the chunks loaded are the last ones found
            take = min(left, self.chunk)
            src = TIER_SOURCE.get(t, CacheHitSource.EXTERNAL_UNSPECIFIED)
            out[src] = out.get(src, 0) + take
            left -= take
            if left <= 0:
                break
        if left > 0:
            out[CacheHitSource.EXTERNAL_UNSPECIFIED] = out.get(CacheHitSource.EXTERNAL_UNSPECIFIED, 0) + left
        return out

    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external: int) -> None:
        r = self._track(request)
        if num_external <= 0 or r.skip is not None:
            return
        start = r.local_tokens  # not request.num_computed_tokens: vLLM sets it after this call
        end = start + num_external
        whole = -(-end // self.chunk) * self.chunk
        tokens = list(request.all_token_ids[:whole])
        tail = len(tokens) % self.chunk != 0  # the load reaches into the trailing partial chunk
        self._loads[request.request_id] = LoadSpec(
            request.request_id,
            tokens,
            list(blocks.get_block_ids()[0]),  # with load_kv_async: every block of the request
            start,
            end,
            r.namespace,
            r.session_id,
            tail,
            async_load=r.async_load,
        )
        r.external_tokens = num_external
        self.counters["hit_tokens"] += num_external
        self.counters["local_hit_tokens"] += start
        self._report_local_hits(r.namespace, start)

    def _report_local_hits(self, ns: Namespace, tokens: int) -> None:
        """vLLM's own prefix-cache hits never reach the store: report them (tier HBM) to the
        engine's own node (``target``; the lookup client may be a cluster's, which has no
        node of its own to count them).  Metrics only: a failure pauses reporting for
        ``RETRY_S``, never lookups or loads."""
        now = time.monotonic()
        if tokens <= 0 or now < self._report_down_until:
            return
        try:
            if self._reporter is None:
                self._reporter = self.settings.client(self.settings.target or None)
                if not hasattr(self._reporter, "report_hits"):  # a cluster target: no node of its own
                    self._report_down_until = float("inf")
                    return
            self._reporter.report_hits(
                max(1, tokens // self.chunk), tokens, tier="hbm", op="match_prefix", namespace=ns
            )
        except Exception as e:  # noqa: BLE001 - metrics only: never worth an engine, nor its lookups
            log.warning("kvstore: reporting prefix-cache hits failed (%s); not reporting for %.0f s", e, RETRY_S)
            self._report_down_until = now + RETRY_S
            self._drop_reporter()

    def build_meta(self, out: SchedulerOutput) -> KVStoreMeta:
        meta = KVStoreMeta()
        for req in out.scheduled_new_reqs:
            r = self._reqs.get(req.req_id)
            if r is None:
                continue
            r.block_ids = list(req.block_ids[0])
            self._take_load(meta, req.req_id, r)
            self._maybe_save(meta, req.req_id, r, req.num_computed_tokens + out.num_scheduled_tokens.get(req.req_id, 0))
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            r = self._reqs.get(rid)
            if r is None:
                continue
            new = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:  # preempted and back: a new block table
                r.block_ids = list(new[0]) if new is not None else []
                self._take_load(meta, rid, r)
            elif new is not None:
                r.block_ids.extend(new[0])
            self._maybe_save(meta, rid, r, cached.num_computed_tokens[i] + out.num_scheduled_tokens.get(rid, 0))
        for rid, load in self._loads.items():  # waiting for their KV: not scheduled, loaded now
            if load.async_load and rid in self._reqs:
                self._reqs[rid].block_ids = list(load.block_ids)
                meta.loads.append(load)
        self._loads.clear()  # an allocation vLLM did not schedule is asked again next time
        return meta

    def _take_load(self, meta: KVStoreMeta, rid: str, r: _Req) -> None:
        load = self._loads.pop(rid, None)
        if load is not None:
            meta.loads.append(dataclasses.replace(load, block_ids=list(r.block_ids)))

    def _maybe_save(self, meta: KVStoreMeta, rid: str, r: _Req, done: int) -> None:
        """Save the full chunks this step completes (their KV is written once it ran), and
        when it completes the prompt, the prompt's trailing partial chunk (keyed by its
        exact tokens, so a repeated prompt of any length loads all but its last token)."""
        if not self.produce or r.skip is not None:
            return
        tokens = r.request.all_token_ids
        prompt = int(r.request.num_prompt_tokens)
        bs = self.spec.block_size
        if not r.tail_saved and done >= prompt and len(tokens) >= prompt:
            r.tail_saved = True
            full_p, partial = divmod(prompt, self.chunk)
            pages = -(-prompt // bs)
            if partial and r.saved_chunks <= full_p and len(r.block_ids) >= pages:
                # the tail's chunk spans whole pages: those past the prompt repeat its last page
                ids = r.block_ids[:pages]
                ids = ids + [ids[-1]] * ((full_p + 1) * (self.chunk // bs) - pages)
                meta.saves.append(
                    SaveSpec(rid, list(tokens[:prompt]), ids, r.saved_chunks, r.namespace, r.session_id, tail=True)
                )
                self._note_saving(r, tokens, r.saved_chunks, full_p)
                r.saved_chunks = full_p
                r.saves += 1
                return
        limit = done if self.settings.save_decode else min(done, int(r.request.num_prompt_tokens))
        full = min(limit, len(tokens)) // self.chunk  # only chunks whose every token is known
        pages = full * self.chunk // bs
        if full <= r.saved_chunks or len(r.block_ids) < pages:
            return
        meta.saves.append(
            SaveSpec(
                rid, list(tokens[: full * self.chunk]), r.block_ids[:pages], r.saved_chunks, r.namespace, r.session_id
            )
        )
        self._note_saving(r, tokens, r.saved_chunks, full)
        r.saved_chunks = full
        r.saves += 1

    def _note_saving(self, r: _Req, tokens: Any, lo: int, hi: int) -> None:
        """Chunks ``[lo, hi)`` are being saved: their keys on every rank, for :class:`StoredChunks`."""
        if self.stored.resync_s <= 0 or hi <= lo:
            return
        head = list(tokens[: hi * self.chunk])
        self.stored.saving([chunk_keys(head, rank_namespace(r.namespace, t, p)) for t, p in self.ranks], lo, hi)

    def finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Hold the blocks of a request whose saves run (every worker reports it once they are
        committed); tell the caller where its KV went (``kv_transfer_params["kvstore"]``: the
        namespace and chunk size to key the same prefix, and ``saved_chunks`` for a decode
        engine to wait for exactly those)."""
        rid = request.request_id
        r = self._reqs.pop(rid, None)
        self._loads.pop(rid, None)
        if r is None:
            return False, None
        hold = r.saves > 0 and self.settings.defer_free
        params = {
            "kvstore": {
                "namespace": r.namespace.to_dict(),
                "chunk_tokens": self.chunk,
                "saved": r.saves > 0,
                "saved_chunks": r.saved_chunks if self.produce else 0,
                "saved_tokens": (
                    0
                    if not self.produce
                    else int(request.num_prompt_tokens)
                    if r.tail_saved and r.saved_chunks == int(request.num_prompt_tokens) // self.chunk
                    else r.saved_chunks * self.chunk
                ),
                "hit_chunks": r.found_chunks,
                "local_tokens": r.local_tokens,
                "external_tokens": r.external_tokens,
            }
        }
        return hold, params

    def worker_output(self, out: KVConnectorOutput) -> None:
        ev = out.kv_cache_events
        if not isinstance(ev, KVStoreEvents):
            return
        if self._events is None:
            self._events = ev
        else:
            self._events.add_events(ev.get_all_events())
            self._events.increment_workers(ev.get_number_of_workers())

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The workers' events every worker reported, then what the store changed on its own."""
        events: list[KVCacheEvent] = []
        if self._events is not None:
            self._events.aggregate()
            events = list(self._events.get_all_events())
            self._events = None
            for ev in events:
                self.stored.stored(ev)
        now = time.monotonic()
        if self.stored.due(now) and now >= self._down_until:
            try:
                events.extend(self.stored.resync(self.client().lookup, now))
            except Exception as e:  # noqa: BLE001 - events are advice: the engine goes on
                self._store_failed(e, "event resync")
        return events

    def take_stats(self) -> KVStoreStats | None:
        return delta(self.counters, self._reported, SCHEDULER_KEYS)

    def _drop_reporter(self) -> None:
        reporter, self._reporter = self._reporter, None
        if reporter is not None:
            with contextlib.suppress(Exception):  # closing a broken client is best effort
                reporter.close()

    def close(self) -> None:
        self._drop_client()
        self._drop_reporter()
        self._drop_local()

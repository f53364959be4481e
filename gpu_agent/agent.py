"""``GPUAgent``: the engine-facing KV connector, and the wiring of its parts.

One per inference worker.  It owns a :class:`~gpu_agent.copy_engine.CopyEngine`
(streams, events, the arena registered as pinned memory), an
:class:`~gpu_agent.pool.HBMPool` and four single-thread executors: the *prefetcher*
(looks blocks up, leases them — which promotes NVMe blocks into the node's DRAM — and
copies them into the pool on its own stream), the *issuer* (queues a load's layers
after the first, so the engine's thread returns as soon as layer 0 is queued), the
*load completer* (waits on a load's last event, then releases its leases and pool
holds) and the *save completer* (waits on a save's event, then checksums and commits):
a lease release never waits behind a save's checksum.  The engine's thread never
blocks on the device: it gets handles whose events it waits on.

Calls (shaped after vLLM's KV connector):

* ``lookup(tokens) -> int``: tokens cached (full chunks, leading, any tier or HBM);
* ``prefetch(tokens)``: non-blocking; NVMe/remote → DRAM → HBM within the byte and
  time budgets of :class:`AgentConfig` (the plan is :func:`gpu_agent.prefetch.plan_prefetch`);
* ``load(tokens, kv_buffers, block_ids) -> LoadHandle``: the cached prefix into the
  engine's pages, layer by layer (``wait_layer(i)``); HBM-resident blocks are copied
  device to device, the others straight from the arena (DMA);
* ``save(tokens, kv_buffers, block_ids) -> SaveHandle``: the prompt's full chunks
  into the store (device → arena, then checksum and commit in the background).  When
  ``save`` returns, the caller's later work is ordered after the copies out of its
  pages (on CUDA its current stream waits on them; on CPU they are done), so the
  engine may reuse the pages at once.

Fails open: a store that cannot answer gives a miss (counted and logged), never an
exception on the engine's path; contract violations (wrong buffer shapes, dtypes,
devices) raise :class:`~kvstore.errors.InvalidArgument`.

The arena is registered as pinned memory once per process and mapping (shared by the
agents of one client) and the registration holds the mapping: closing the client
before the agent leaves the mapping to the agent, which unregisters it on close.  A
node restart gives the client a new mapping: the first transfer that sees it
registers it and retires the old one.  Host memory that is not registered is staged
through a pinned bounce buffer, never handed to DMA as if pinned.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import xxhash

from gpu_agent.buffers import EngineBuffers
from gpu_agent.copy_engine import (
    CopyEngine,
    DeferredEvent,
    DoneEvent,
    Event,
    Segmented,
    copy_range,
    host_tensor,
    normalize_device,
)
from gpu_agent.hostcopy import BlockJob, HostCopier
from gpu_agent.layout import KVCacheLayout, PagedAdapter
from gpu_agent.pinned import CudaRuntime
from gpu_agent.pool import HBMPool
from gpu_agent.prefetch import Bandwidths, plan_prefetch, usable_prefix
from gpu_agent.transfer import BatchedLoad, BatchedSave
from kvstore.block import BlockMeta, checksum
from kvstore.errors import DeadlineExceeded, InvalidArgument, KVStoreError
from kvstore.keys import ChunkKey, Namespace, chunk_keys, parent_keys, tail_key

log = logging.getLogger(__name__)

MiB = 1 << 20


@dataclasses.dataclass(frozen=True, slots=True)
class AgentConfig:
    """Knobs of one agent."""

    hbm_bytes: int = 1 << 30
    """Byte budget of the HBM block pool (whole blocks; the rest is unused)."""
    prefetch_bytes: int = 1 << 30
    """Most bytes one ``prefetch`` call brings into HBM."""
    prefetch_seconds: float = 1.0
    """Most estimated transfer time one ``prefetch`` call plans for."""
    bandwidths: Bandwidths = Bandwidths()
    """Per-hop bandwidths the prefetch planner estimates time with."""
    batch_blocks: int = 64
    """Blocks per reserve/commit or acquire round trip."""
    verify_loads: bool = True
    """Check each block's payload checksum before loading it from host memory: a block
    whose bytes do not match is a gap (the engine recomputes), never KV it trusts."""
    staging_bytes: int = 64 << 20
    """Device staging of a batched copy: per layer of a load, per group of blocks of a save."""
    batch_on_cpu: bool = False
    """Batch copies (staging plus one gather or scatter per layer) on CPU tensors too; CUDA
    always batches, the CPU copies page runs directly (fewer passes over memory)."""
    copy_threads: int = 0
    """CPU: threads that share one load's or save's blocks, the engine's own included
    (``gpu_agent.hostcopy``); 0: as many as torch's intra-op threads (the engine's cores), at most 4."""


@dataclasses.dataclass(frozen=True, slots=True)
class SaveResult:
    stored: int = 0  # blocks written by this call
    existed: int = 0  # blocks the store already had (nothing written)
    failed: int = 0  # blocks not stored (no room, an error): the engine recomputes them next time

    def __add__(self, o: SaveResult) -> SaveResult:
        return SaveResult(self.stored + o.stored, self.existed + o.existed, self.failed + o.failed)


@dataclasses.dataclass(frozen=True, slots=True)
class PrefetchResult:
    fetched: int = 0  # blocks copied into HBM by this call
    resident: int = 0  # blocks of the prefix already in HBM
    prefix: int = 0  # blocks of the prompt cached anywhere, without a gap
    limit: str = ""  # what stopped the plan short ("bytes", "time", "pool"), if anything


class ReservedAhead:
    """A save's reservations, requested ahead of it (:meth:`GPUAgent.reserve_ahead`)."""

    def __init__(self, keys: list[ChunkKey], fut: concurrent.futures.Future[list[tuple[int, Any]]]) -> None:
        self.keys = keys
        self._fut = fut
        self._taken = False

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the node answered (True), or ``timeout`` passed (False)."""
        try:
            self._fut.result(timeout)
        except concurrent.futures.TimeoutError:
            return False
        except BaseException:  # answered with an error: batches() says which
            pass
        return True

    def batches(self, timeout: float | None = None) -> list[tuple[int, Any]]:
        """(first index, ``ReservedBlocks`` or the error) per batch, once the node answered;
        past ``timeout`` one ``DeadlineExceeded`` (what the node reserves later is given back)."""
        try:
            out = self._fut.result(timeout)
        except concurrent.futures.TimeoutError:
            self._fut.add_done_callback(_abort_batches)
            self._taken = True
            return [(0, DeadlineExceeded(f"the node did not answer Reserve in {timeout} s"))]
        except KVStoreError as e:
            out = [(0, e)]
        self._taken = True
        return out

    def abort(self) -> None:
        """Give back what was reserved and not yet used (no-op for reservations committed)."""
        if self._taken and not self._fut.done():
            return
        self._taken = True
        self._fut.add_done_callback(_abort_batches)


def _abort_batches(fut: concurrent.futures.Future[list[tuple[int, Any]]]) -> None:
    try:
        batches = fut.result()
    except BaseException:  # nothing was reserved
        return
    for _, res in batches:
        if not isinstance(res, BaseException):
            try:
                res.abort()
            except BaseException:  # it lapses at the node's TTL anyway
                pass


class SaveGuard:
    """Lets the engine cancel a save whose pages it is about to rewrite (a preempted
    request's) while the save runs on another thread: each batch's copy is checked after it
    ends (:meth:`copied`); a batch whose check comes after :meth:`cancel` is aborted, never
    committed, so no block is stored from pages that may have changed under its copy."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cancelled = False

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def copied(self) -> bool:
        """After a batch's copy: True to commit it (the copy ended before any cancel)."""
        with self._lock:
            return not self._cancelled


class LoadHandle:
    """A load in flight.  ``num_tokens`` (known at once) is how many leading tokens it
    loads; ``wait_layer(i)`` orders the caller after layer i's copies (on CUDA the current
    stream waits, the host does not block), so layer i+1 loads while layer i computes."""

    def __init__(
        self, num_tokens: int, hbm_chunks: int, events: list[Event], done: concurrent.futures.Future[bool] | None
    ) -> None:
        self.num_tokens = num_tokens
        self.hbm_chunks = hbm_chunks
        self._events = events
        self._done = done

    @property
    def num_layers(self) -> int:
        return len(self._events)

    def wait_layer(self, layer: int) -> None:
        self._events[layer].wait()

    def done(self) -> bool:
        return all(e.query() for e in self._events) and (self._done is None or self._done.done())

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every layer is loaded and the leases are back; False if a lease
        expired under the copy or a copy failed (the loaded bytes are then not to be trusted)."""
        if self._done is not None:
            return self._done.result(timeout)  # the completer waited on every layer
        for e in self._events:
            e.synchronize()
        return True


class SaveHandle:
    """A save in flight: ``wait()`` returns the :class:`SaveResult` once blocks are committed."""

    def __init__(self, parts: list[concurrent.futures.Future[SaveResult]], base: SaveResult = SaveResult()) -> None:
        self._parts = parts
        self._base = base

    def done(self) -> bool:
        return all(p.done() for p in self._parts)

    def wait(self, timeout: float | None = None) -> SaveResult:
        out = self._base
        for p in self._parts:
            out = out + p.result(timeout)
        return out


def arena_buffer(client: Any) -> memoryview:
    """The node's arena as this process maps it (``KVClient.arena_buffer``)."""
    return client.arena_buffer()


class GPUAgent:
    """The KV connector of one inference worker.  Thread-safe; one per worker."""

    def __init__(
        self,
        client: Any,
        layout: KVCacheLayout,
        namespace: Namespace,
        *,
        device: str | torch.device | None = None,
        config: AgentConfig | None = None,
        cudart: CudaRuntime | None = None,
    ) -> None:
        """``cudart``: the CUDA runtime that registers the arena (default: the real one on
        CUDA, none on CPU); tests pass a fake one to check the registration bookkeeping."""
        layout.check_namespace(namespace)
        self.client = client
        self.layout = layout
        self.namespace = namespace
        self.config = config or AgentConfig()
        self.device = normalize_device(device)
        self.dtype = getattr(torch, layout.dtype)
        self.chunk_tokens = namespace.chunk_tokens
        self.adapter = PagedAdapter(layout, self.chunk_tokens)
        self.block_bytes = layout.block_bytes(self.chunk_tokens)
        self.layer_bytes = layout.layer_bytes(self.chunk_tokens)
        self._fingerprint = namespace.fingerprint
        self.engine = CopyEngine(self.device, cudart=cudart)
        self._batched = self.engine.is_cuda or self.config.batch_on_cpu
        # CPU (unbatched, no pinned-memory runtime): copies run inline on the caller's thread,
        # checksummed as they go (gpu_agent.hostcopy)
        self._host = (
            None
            if self._batched or self.engine.host.registry is not None
            else HostCopier(
                self.layer_bytes,
                layout.num_layers,
                threads=self.config.copy_threads or max(1, min(4, torch.get_num_threads())),
            )
        )
        arena = arena_buffer(client)  # also refuses a client that cannot map the arena
        if self.engine.host.registry is not None:
            self.engine.register_host(arena)
        del arena
        self.pool = HBMPool(self.config.hbm_bytes, self.block_bytes, self.device)
        self._prefetcher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-prefetch")
        self._issuer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-issue")
        self._load_completer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-load-done")
        self._save_completer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-save-done")
        self._reserver = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-reserve")
        self.counters: collections.Counter[str] = collections.Counter()
        self._counters_lock = threading.Lock()  # the engine's thread, the prefetcher and the completer all count
        self.last_store_error_at = float("-inf")  # time.monotonic() of the last store_errors count
        self._saves_lock = threading.Lock()
        self._pending_saves: list[Event] = []  # d2h copies of saves not yet known complete; loads queue after them
        self._closed = False

    def _count(self, name: str, n: int = 1) -> None:
        with self._counters_lock:
            self.counters[name] += n

    def _store_error(self) -> None:
        """A store call failed: counted (``store_errors``) and stamped (:attr:`last_store_error_at`)."""
        with self._counters_lock:
            self.counters["store_errors"] += 1
            self.last_store_error_at = time.monotonic()

    @property
    def copies_on_host(self) -> bool:
        """Saves and loads are copied by the calling thread (CPU engines), not on a stream:
        a save may then run off the engine's thread, with a :class:`SaveGuard`."""
        return self._host is not None

    @property
    def pinned(self) -> bool:
        """The client's current arena mapping is registered (copies from and to it are DMA)."""
        return self.engine.host.registered

    def _check_pinned(self, blocks: Sequence[Segmented]) -> None:
        """Every host byte of a transfer should lie in the registered arena.  If some do not,
        the client has mapped a new arena (a node restart): register it (the old mapping is
        retired once the copies queued from it are done).  What still is not registered is
        staged by the copy engine, and counted here."""
        host = self.engine.host
        if host.registry is None or not blocks:
            return
        if host.retired:
            host.reap()  # mappings retired after a restart: unregister those whose copies are done
        outside = [b for b in blocks if not all(self.engine.host_registered(p) for p in b.parts)]
        if not outside:
            return
        try:
            self.engine.register_host(arena_buffer(self.client))
        except (KVStoreError, ValueError) as e:
            log.warning("cannot map the node's arena again (%s)", e)
        left = sum(1 for b in outside if not all(self.engine.host_registered(p) for p in b.parts))
        if left:
            self._count("staged_blocks", left)

    # -- keys ----------------------------------------------------------------------------
    def keys(
        self, tokens: Sequence[int] | Any, namespace: Namespace | None = None, *, tail: bool = False
    ) -> list[ChunkKey]:
        """One key per full chunk of ``tokens`` (a list, numpy array or CPU tensor of ids),
        in ``namespace`` (default: the agent's; another must describe the same layout);
        ``tail``: and one for a trailing partial chunk (``kvstore.keys.tail_key``)."""
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.detach().cpu().reshape(-1).numpy()
        ns = self._ns(namespace)
        keys = chunk_keys(tokens, ns)
        if tail:
            t = tail_key(tokens, ns, keys)
            if t is not None:
                keys.append(t)
        return keys

    def _ns(self, namespace: Namespace | None) -> Namespace:
        if namespace is None or namespace is self.namespace:
            return self.namespace
        if namespace.chunk_tokens != self.chunk_tokens:
            raise InvalidArgument(
                f"namespace chunk_tokens={namespace.chunk_tokens}; this agent moves chunks of {self.chunk_tokens}"
            )
        self.layout.check_namespace(namespace)
        return namespace

    def _tiers(self, keys: list[ChunkKey]) -> list[str | None]:
        try:
            return self.client.lookup(keys)
        except KVStoreError as e:  # fail open: a store that cannot answer is a miss
            self._store_error()
            log.warning("kvstore lookup failed (%s); treating as a miss", e)
            return [None] * len(keys)

    def _meta_ok(self, meta: BlockMeta | None, fingerprint: bytes | None = None) -> bool:
        ok = (
            meta is not None
            and meta.namespace == (fingerprint or self._fingerprint)
            and meta.payload_len == self.block_bytes
        )
        if meta is not None and not ok:
            self._count("incompatible_blocks", 1)
        return ok

    # -- lookup ----------------------------------------------------------------------------
    def lookup(self, tokens: Sequence[int] | Any, *, namespace: Namespace | None = None) -> int:
        """Tokens of ``tokens``' leading full chunks that are cached (store or HBM pool)."""
        keys = self.keys(tokens, namespace)
        if not keys:
            return 0
        tiers = self._tiers(keys)
        with self.pool.lock:
            in_hbm = [self.pool.contains(k) for k in keys]
        n = usable_prefix(tiers, in_hbm)
        self._count("lookups", 1)
        self._count("lookup_hit_tokens", n * self.chunk_tokens)
        return n * self.chunk_tokens

    # -- prefetch --------------------------------------------------------------------------
    def prefetch(self, tokens: Sequence[int] | Any) -> concurrent.futures.Future[PrefetchResult]:
        """Start bringing ``tokens``' cached prefix into HBM; returns at once."""
        keys = self.keys(tokens)
        return self._prefetcher.submit(self._prefetch, keys)

    def _prefetch(self, keys: list[ChunkKey]) -> PrefetchResult:
        if not keys:
            return PrefetchResult()
        tiers = self._tiers(keys)
        with self.pool.lock:
            in_hbm = [self.pool.contains(k) for k in keys]
            plan = plan_prefetch(
                tiers,
                in_hbm,
                block_bytes=self.block_bytes,
                free_slots=self.pool.free_slots,
                entries=self.pool.entries(),
                keys=keys,
                byte_budget=self.config.prefetch_bytes,
                time_budget_s=self.config.prefetch_seconds,
                bandwidths=self.config.bandwidths,
            )
        if not plan.fetch:
            return PrefetchResult(0, plan.resident, plan.prefix, plan.limit)
        fetch = [keys[i] for i in plan.fetch]
        try:
            leased = self.client.acquire(fetch)  # promotes NVMe (or remote) blocks into the node's DRAM
        except KVStoreError as e:
            self._store_error()
            log.warning("kvstore acquire for prefetch failed (%s)", e)
            return PrefetchResult(0, plan.resident, plan.prefix, plan.limit)
        # Slots are reserved (invisible to loads), filled on the prefetch stream, and published
        # only once the copy completed and the lease proved valid; any failure gives them back.
        jobs: list[tuple[ChunkKey, int, int, Segmented]] = []  # key, depth, slot, source
        published = False
        try:
            with leased:
                with self.pool.lock:
                    mine = set(keys)
                    self.pool.evict([k for k in plan.evict if k not in mine])
                    protect = set(keys[: plan.prefix])
                    for i, k, meta, views in zip(plan.fetch, fetch, leased.metas, leased.views):
                        if views is None or not self._meta_ok(meta):
                            break  # a gap: the chunks after it are useless
                        if self.pool.contains(k):
                            continue  # a concurrent load or prefetch got there first
                        slot = self.pool.reserve(protect=protect)
                        if slot is None:
                            break
                        jobs.append((k, i, slot, Segmented([host_tensor(v) for v in views])))
                self._check_pinned([j[3] for j in jobs])
                nbytes = self.block_bytes

                def copy() -> None:
                    for _, _, slot, src in jobs:
                        dst = self.pool.slot_tensor(slot)
                        for rel, piece in src.pieces(0, nbytes):
                            self.engine.h2d(dst[rel : rel + piece.numel()], piece)

                ev = self.engine.submit("prefetch", copy) if jobs else DoneEvent()
                ev.synchronize()  # this worker waits on its own transfer, never on the device
            held = [k for k, v in zip(leased.keys, leased.views) if v is not None]  # valid[] follows the leases held
            valid = dict(zip(held, leased.valid))
            good = bad = 0
            with self.pool.lock:
                for k, i, slot, _ in jobs:
                    if valid.get(k, True):
                        self.pool.publish(k, slot, i)
                        good += 1
                    else:  # a lease expired under the copy: those bytes may have been reused
                        self.pool.unreserve([slot])
                        bad += 1
                published = True
        finally:
            if not published:
                with self.pool.lock:
                    self.pool.unreserve([j[2] for j in jobs])
        if bad:
            self._count("expired_leases", bad)
        self._count("prefetched_blocks", good)
        return PrefetchResult(good, plan.resident, plan.prefix, plan.limit)

    # -- load ------------------------------------------------------------------------------
    def _check_buffers(self, kv_buffers: Sequence[torch.Tensor] | EngineBuffers) -> EngineBuffers:
        """The engine's buffers as byte ranges: an :class:`EngineBuffers` (any layout the
        engine has; see ``gpu_agent.buffers``) or flash-layout tensors, one per layer."""
        lay = self.layout
        bufs = kv_buffers if isinstance(kv_buffers, EngineBuffers) else EngineBuffers.flash(list(kv_buffers), lay)
        if bufs.num_layers != lay.num_layers:
            raise InvalidArgument(f"kv_buffers has {bufs.num_layers} layers; the layout has {lay.num_layers}")
        if bufs.dtype != self.dtype or bufs.device != self.device:
            raise InvalidArgument(
                f"kv_buffers are {bufs.dtype} on {bufs.device}; the agent moves {self.dtype} on {self.device}"
            )
        self.adapter.check_geometry(bufs.geometry)
        bufs.check()
        return bufs

    def load(
        self,
        tokens: Sequence[int] | Any,
        kv_buffers: Sequence[torch.Tensor] | EngineBuffers,
        block_ids: Sequence[int],
        *,
        namespace: Namespace | None = None,
        session_id: str | None = None,
        first_chunk: int = 0,
        tail: bool = False,
    ) -> LoadHandle:
        """Load the cached chunks of ``tokens`` from chunk ``first_chunk`` on into the pages
        ``block_ids`` (as far as ``block_ids`` reach; a negative id leaves that page alone,
        for tokens the engine already holds).  Chunks below ``first_chunk`` (the engine's
        own prefix cache holds them) are neither acquired nor required to be stored.
        Returns at once with the copies queued, layer by layer; ``num_tokens`` of the
        handle counts from token 0 (``first_chunk`` chunks are taken as held).  ``tail``: a
        trailing partial chunk too (saved with ``save(tail=True)``), into the pages of a
        whole chunk (negative ids past the tokens); it counts as its own tokens."""
        dst = self._check_buffers(kv_buffers)
        ns = self._ns(namespace)
        if first_chunk < 0:
            raise InvalidArgument(f"first_chunk must be >= 0, got {first_chunk}")
        keys = self.keys(tokens, ns, tail=tail)[: len(block_ids) // self.adapter.pages_per_chunk][first_chunk:]
        skipped = first_chunk * self.chunk_tokens
        if not keys:
            return LoadHandle(skipped, 0, [DoneEvent()] * self.layout.num_layers, None)
        with self.pool.lock:
            in_hbm = [self.pool.contains(k) for k in keys]
        need = [k for k, h in zip(keys, in_hbm) if not h]
        leased = None
        if need:
            try:
                leased = self.client.acquire(need, session_id=session_id)
            except KVStoreError as e:
                self._store_error()
                log.warning("kvstore acquire for load failed (%s); loading only what HBM holds", e)
        host: dict[bytes, Segmented] = {}
        expect: dict[bytes, tuple[list[memoryview], int | None]] = {}  # inline path: checked while copied
        if leased is not None:
            for k, meta, views in zip(leased.keys, leased.metas, leased.views):
                if views is None or not self._meta_ok(meta, ns.fingerprint):
                    continue
                if self._host is not None:
                    expect[k] = (views, meta.payload_checksum if self.config.verify_loads else None)
                elif not self._payload_ok(meta, views):
                    continue
                host[k] = Segmented([host_tensor(v) for v in views])
        held: list[int] = []  # pool slots this load reads: not reused before its copies completed
        L = self.layout.num_layers
        try:
            self._check_pinned(list(host.values()))
            sources: list[torch.Tensor | Segmented] = []
            hbm = 0
            with self.pool.lock:
                for k in keys:
                    got = self.pool.hold(k)
                    if got is not None:
                        held.append(got[0])
                        sources.append(got[1])
                        hbm += 1
                    elif k in host:
                        sources.append(host[k])
                    else:
                        break  # a gap (evicted since lookup): load the prefix before it
            if sources and self._host is not None:
                sources = sources[: self._load_inline(dst, keys, sources, expect, block_ids, first_chunk)]
                events: list[Event] = [DoneEvent()] * L
            elif sources:
                layer = self._layer_copier(
                    dst,
                    sources,
                    [self.adapter.chunk_pages(block_ids, first_chunk + c) for c in range(len(sources))],
                )
                first = self.engine.submit(
                    "h2d", lambda: layer(0), after=self._saves_in_flight(), after_compute=True, uses=dst.sources[0:1]
                )
                rest: list[concurrent.futures.Future[Event]] = [concurrent.futures.Future() for _ in range(1, L)]
                if rest:
                    self._issuer.submit(self._issue_layers, layer, dst, rest)
                events = [first, *(DeferredEvent(f) for f in rest)]
            else:
                events = [DoneEvent()] * L
        except BaseException:
            if held:
                self.pool.release(held)
            if leased is not None:
                leased.release()
            raise
        if self._host is not None:  # copied already: holds and leases go back now, the release unanswered
            done = None
            if (leased is not None or held) and not self._finish_load(events, leased, held):
                sources = []  # a lease lapsed under the copy: nothing loaded is to be trusted
        else:
            done = (
                self._load_completer.submit(self._finish_load, events, leased, held)
                if leased is not None or held
                else None
            )
        n = min(len(sources) * self.chunk_tokens, len(tokens) - skipped)
        self._count("loads", 1)
        self._count("load_tokens", n)
        self._count("load_hbm_blocks", hbm)
        self._count("load_host_blocks", len(sources) - hbm)
        if hbm:  # the node cannot see pool hits: report them so its metrics show the HBM tier
            self._save_completer.submit(self._report_hbm_hits, hbm)
        return LoadHandle(skipped + n, hbm, events, done)

    def _load_inline(
        self,
        dst: EngineBuffers,
        keys: list[ChunkKey],
        sources: list[torch.Tensor | Segmented],
        expect: dict[bytes, tuple[list[memoryview], int | None]],
        block_ids: Sequence[int],
        first_chunk: int,
    ) -> int:
        """Copy ``sources`` into their pages on this thread (``gpu_agent.hostcopy``), each arena
        block checked against its committed checksum as it is copied; how many leading
        chunks loaded good (a block that failed was written, and the caller loads none from it on)."""
        assert self._host is not None
        jobs = []
        for c, (k, src) in enumerate(zip(keys, sources)):
            copies = self._host.plan(
                self.adapter.chunk_copies(self.adapter.chunk_pages(block_ids, first_chunk + c), dst.geometry)
            )
            if isinstance(src, Segmented):
                views, want = expect[k]
                jobs.append(BlockJob(src, views, copies, want))
            else:  # an HBM-pool slot (device memory the agent filled itself)
                jobs.append(BlockJob(Segmented([src]), (), copies, None))
        results = self._host.load(dst, jobs)
        for n, (k, r) in enumerate(zip(keys, results)):
            if r is True:
                continue
            if r is False:
                self._count("checksum_failures", 1)
                log.error(
                    "block %s: payload checksum mismatch in the store; not loaded (the engine recomputes it)", k.hex()
                )
            else:
                self._count("load_errors", 1)
                log.warning("copying block %s into the engine's pages failed (%s): the engine recomputes", k.hex(), r)
            return n
        return len(jobs)

    def _issue_layers(self, layer: Any, dst: EngineBuffers, futures: list[concurrent.futures.Future[Event]]) -> None:
        """Queue layers 1.. of a load (layer 0 is queued by ``load`` itself), in order, on the
        same stream: each is ordered after the compute that ``load`` waited for."""
        for i, fut in enumerate(futures, start=1):
            try:
                fut.set_result(self.engine.submit("h2d", functools.partial(layer, i), uses=dst.sources[i : i + 1]))
            except BaseException as e:
                log.warning("queueing layer %d of a load failed: %s", i, e)
                for f in futures[i - 1 :]:
                    f.set_exception(e)
                return

    def _report_hbm_hits(self, blocks: int) -> None:
        try:
            self.client.report_hits(blocks, blocks * self.chunk_tokens, tier="hbm", op="get", namespace=self.namespace)
        except KVStoreError:
            self._count("report_errors")  # metrics only: never fails a load

    def _payload_ok(self, meta: BlockMeta, views: list[memoryview]) -> bool:
        """The leased bytes match the checksum the block was committed with."""
        if not self.config.verify_loads:
            return True
        got = checksum(views[0]) if len(views) == 1 else _checksum_parts(views)
        if got != meta.payload_checksum:
            self._count("checksum_failures", 1)
            log.error(
                "block %s: payload checksum mismatch in the store; not loaded (the engine recomputes it)",
                meta.key.hex(),
            )
            return False
        return True

    def _layer_copier(self, dst: EngineBuffers, sources: list[torch.Tensor | Segmented], pages: list[list[int]]) -> Any:
        """A function copying one layer of every chunk into its pages (called on the stream)."""
        if self._batched:
            return BatchedLoad(
                self.engine, dst, dst.geometry, sources, pages, self.layer_bytes, self.config.staging_bytes
            ).layer
        plans = [self.adapter.chunk_copies(p, dst.geometry) for p in pages]

        def copy(layer: int) -> None:
            base = layer * self.layer_bytes
            flat, origin = dst.layers[layer]
            for src, copies in zip(sources, plans):
                for c in copies:
                    if isinstance(src, Segmented):
                        for rel, piece in src.pieces(base + c.block_offset, c.nbytes):
                            o = origin + c.buffer_offset + rel
                            self.engine.h2d(flat[o : o + piece.numel()], piece)
                    else:
                        copy_range(flat, origin + c.buffer_offset, src, base + c.block_offset, c.nbytes)

        return copy

    def _finish_load(self, events: list[Event], leased: Any, held: list[int]) -> bool:
        ok = True
        try:
            for e in events:  # in order: a later layer's event may not exist if queueing failed
                e.synchronize()
        except Exception as e:
            ok = False
            self._count("load_errors", 1)
            log.warning("a load's copies failed (%s): the engine recomputes", e)
        finally:
            if held:
                self.pool.release(held)
            valid = leased.release() if leased is not None else []
        if not all(valid):
            self._count("expired_leases", valid.count(False))
            log.error(
                "a read lease expired during a load: the loaded KV may be wrong; raise the node's --read-lease-ttl"
            )
            return False
        return ok

    # -- save ------------------------------------------------------------------------------
    def save(
        self,
        tokens: Sequence[int] | Any,
        kv_buffers: Sequence[torch.Tensor] | EngineBuffers,
        block_ids: Sequence[int],
        *,
        namespace: Namespace | None = None,
        skip_chunks: int = 0,
        session_id: str | None = None,
        tail: bool = False,
        ahead: ReservedAhead | None = None,
        ahead_timeout: float | None = None,
        guard: SaveGuard | None = None,
    ) -> SaveHandle:
        """Offload ``tokens``' full chunks (their KV in pages ``block_ids``) to the store.
        ``ahead``: the same save's :meth:`reserve_ahead` (its arena space reserved while the
        engine computed; the save then makes no Reserve call of its own), waited on for at
        most ``ahead_timeout`` seconds.  ``guard``: a save run off the engine's thread (host
        copies only) that the engine may cancel (:class:`SaveGuard`).

        Returns once the device-to-host copies are ordered before anything the caller
        queues next (see :meth:`_fence`): the engine may overwrite or free those pages
        right away.  Checksums and commits finish in the background (``SaveHandle.wait``);
        chunks the store already holds are skipped.  ``tail``: a trailing partial chunk too,
        keyed by its exact tokens; ``block_ids`` still covers whole chunks (the pages past
        the tokens are stored as they are and never loaded)."""
        try:
            src = self._check_buffers(kv_buffers)
            ns = self._ns(namespace)
            metas = self._save_metas(tokens, block_ids, ns, skip_chunks, tail)
        except BaseException:
            if ahead is not None:
                ahead.abort()
            raise
        if ahead is not None and ahead.keys != [m.key for m in metas]:
            ahead.abort()  # reserved for other blocks: not these
            ahead = None
        batches = ahead.batches(ahead_timeout) if ahead is not None else self._reserve_batches(metas, session_id)
        parts: list[concurrent.futures.Future[SaveResult]] = []
        base = SaveResult()
        for lo, res in batches:
            if guard is not None and guard.cancelled and not isinstance(res, BaseException):
                res.abort()
                base = base + SaveResult(failed=len(res.views))
                continue
            if isinstance(res, KVStoreError):
                self._store_error()
                log.warning("kvstore reserve failed (%s); %d blocks not saved", res, len(metas) - lo)
                base = base + SaveResult(failed=len(metas) - lo)
                break  # nothing reserved from here on; the batches before commit as usual
            jobs = []
            for j, views in enumerate(res.views):
                if views is not None:
                    pages = self.adapter.chunk_pages(block_ids, skip_chunks + lo + j)
                    jobs.append((views, Segmented([host_tensor(v) for v in views]), pages))
            existed = sum(res.existed)
            if not jobs:
                res.abort()
                base = base + SaveResult(existed=existed, failed=len(res.views) - existed)
                continue
            no_room = len(res.views) - existed - len(jobs)
            if self._host is not None:  # CPU: copied and checksummed here, committed in the background
                try:
                    sums = self._host.save(
                        src,
                        [
                            BlockJob(seg, views, self._host.plan(self.adapter.chunk_copies(pages, src.geometry)))
                            for views, seg, pages in jobs
                        ],
                    )
                except BaseException:
                    res.abort()
                    raise
                failed = next((e for e in sums if isinstance(e, Exception)), None)
                if failed is None and guard is not None and not guard.copied():
                    res.abort()  # its pages may have been rewritten under the copy
                    self._count("saves_cancelled", 1)
                    base = base + SaveResult(existed=existed, failed=len(jobs) + no_room)
                    continue
                if failed is not None:
                    res.abort()
                    self._count("save_errors", 1)
                    log.warning("saving %d blocks failed: %s", len(jobs), failed)
                    base = base + SaveResult(existed=existed, failed=len(jobs) + no_room)
                    continue
                parts.append(
                    self._save_completer.submit(
                        self._finish_save,
                        DoneEvent(),
                        res,
                        [],
                        existed,
                        no_room,
                        [],
                        sums,  # type: ignore[arg-type]
                    )
                )
                continue
            if guard is not None:
                res.abort()
                raise InvalidArgument("a cancellable save (guard) copies on the host; this agent copies on a stream")
            deferred: list[tuple[torch.Tensor, torch.Tensor]] = []  # staged blocks the save completer drains
            try:
                self._check_pinned([j[1] for j in jobs])
                ev = self.engine.submit(
                    "d2h", self._save_copier(src, jobs, deferred), after_compute=True, uses=src.sources
                )
            except BaseException:
                res.abort()
                raise
            self._fence(ev)
            parts.append(
                self._save_completer.submit(
                    self._finish_save, ev, res, [j[0] for j in jobs], existed, no_room, deferred
                )
            )
        self._count("saves", 1)
        return SaveHandle(parts, base)

    def _save_metas(
        self, tokens: Sequence[int] | Any, block_ids: Sequence[int], ns: Namespace, skip_chunks: int, tail: bool
    ) -> list[BlockMeta]:
        keys = self.keys(tokens, ns, tail=tail)[: len(block_ids) // self.adapter.pages_per_chunk]
        if any(int(b) < 0 for b in block_ids[: len(keys) * self.adapter.pages_per_chunk]):
            raise InvalidArgument("save needs every page of the chunks it stores (a negative page id)")
        parents = parent_keys(keys)
        shape = self.layout.block_shape(self.chunk_tokens)
        counts = [min(self.chunk_tokens, len(tokens) - i * self.chunk_tokens) for i in range(len(keys))]
        return [
            BlockMeta(ns.fingerprint, k, p, c, self.layout.dtype, shape, self.block_bytes, 0)
            for k, p, c in zip(keys, parents, counts)
        ][skip_chunks:]

    def _reserve_batches(self, metas: list[BlockMeta], session_id: str | None) -> Iterator[tuple[int, Any]]:
        """(first index, ``ReservedBlocks`` or the ``KVStoreError``) per batch of ``batch_blocks``;
        a failed batch ends it (the caller stops there)."""
        step = max(1, self.config.batch_blocks)
        for lo in range(0, len(metas), step):
            try:
                yield lo, self.client.reserve(metas[lo : lo + step], session_id=session_id)
            except KVStoreError as e:
                yield lo, e
                return

    def reserve_ahead(
        self,
        tokens: Sequence[int] | Any,
        block_ids: Sequence[int],
        *,
        namespace: Namespace | None = None,
        skip_chunks: int = 0,
        session_id: str | None = None,
        tail: bool = False,
    ) -> ReservedAhead:
        """Start the Reserve of a :meth:`save` to come (same arguments) on the agent's reserver
        thread and return at once: the engine computes while the node answers, and ``save(...,
        ahead=)`` finds the space waiting.  A reservation never used lapses at the node's
        reservation TTL; ``ReservedAhead.abort`` gives it back at once."""
        metas = self._save_metas(tokens, block_ids, self._ns(namespace), skip_chunks, tail)
        fut = self._reserver.submit(lambda: list(self._reserve_batches(metas, session_id)))
        self._count("reserved_ahead", 1)
        return ReservedAhead([m.key for m in metas], fut)

    def _save_copier(self, src: EngineBuffers, jobs: list[Any], deferred: list[Any]) -> Any:
        """A function copying the pages of whole chunks into their reserved extents (on the stream)."""
        if self._batched:
            job = BatchedSave(
                self.engine,
                src,
                src.geometry,
                [j[1] for j in jobs],
                [j[2] for j in jobs],
                self.layout.num_layers,
                self.layer_bytes,
                self.config.staging_bytes,
            )
            return lambda: deferred.extend(job.run())
        plans = [self.adapter.chunk_copies(j[2], src.geometry) for j in jobs]

        def copy() -> None:
            for layer in range(self.layout.num_layers):
                b = layer * self.layer_bytes
                flat, origin = src.layers[layer]
                for (_, dst, _), copies in zip(jobs, plans):
                    for c in copies:
                        copy_range(dst, b + c.block_offset, flat, origin + c.buffer_offset, c.nbytes)

        return copy

    def _fence(self, ev: Event) -> None:
        """The save contract: once ``save()`` returns, work the caller queues on its current
        stream runs after the save's device-to-host copies (on CUDA the current stream waits
        on the copy's event, the host does not block; on CPU the copy has completed), so the
        engine may reuse the saved pages at once.  The agent's own loads also queue after
        the copies (``_saves_in_flight``)."""
        try:
            ev.wait()
        except Exception:
            pass  # a failed copy: _finish_save aborts the reservation and counts it
        with self._saves_lock:
            self._pending_saves = [e for e in self._pending_saves if not e.query()]
            self._pending_saves.append(ev)

    def _saves_in_flight(self) -> list[Event]:
        with self._saves_lock:
            self._pending_saves = [e for e in self._pending_saves if not e.query()]
            return list(self._pending_saves)

    def _finish_save(
        self,
        ev: Event,
        res: Any,
        views: list[list[memoryview]],
        existed: int,
        no_room: int,
        deferred: list[tuple[torch.Tensor, torch.Tensor]],
        sums: list[int] | None = None,
    ) -> SaveResult:
        """Commit a save's blocks once its copies completed; ``sums``: their checksums, when
        computed during the copy (else here, a pass over ``views``)."""
        blocks = len(sums) if sums is not None else len(views)
        try:
            ev.synchronize()
            for dst, staged in deferred:  # extents outside the registered arena: through a bounce buffer
                self.engine.drain(dst, staged)
            deferred.clear()  # the device staging may go
            if sums is None:
                sums = [checksum(v[0]) if len(v) == 1 else _checksum_parts(v) for v in views]
            ok = res.commit(sums)
        except BaseException as e:
            res.abort()
            self._count("save_errors", 1)
            log.warning("saving %d blocks failed: %s", blocks, e)
            return SaveResult(existed=existed, failed=blocks + no_room)
        stored = sum(ok)
        self._count("saved_blocks", stored)
        return SaveResult(stored, existed, len(ok) - stored + no_room)

    # -- lifecycle -------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        with self.pool.lock:
            pool = self.pool.stats()
        with self._counters_lock:
            counters = dict(self.counters)
        return {"counters": counters, "pool": pool, "pinned_arena": self.pinned, **self.engine.stats()}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._reserver.shutdown(wait=True)
        self._prefetcher.shutdown(wait=True)
        self._issuer.shutdown(wait=True)  # before the completers: they wait on issued layers
        self._load_completer.shutdown(wait=True)
        self._save_completer.shutdown(wait=True)
        if self._host is not None:
            self._host.close()
        self.engine.close()
        self.pool.clear()

    def __enter__(self) -> GPUAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _checksum_parts(views: list[memoryview]) -> int:
    h = xxhash.xxh3_64()
    for v in views:
        h.update(v)
    return h.intdigest()

"""kvstore as an LMCache L2 store: :class:`KVStoreL2Adapter`.

LMCache's multi-process server (``lmcache server``, what vLLM's ``LMCacheMPConnector`` talks
to) keeps chunks in its local CPU memory (L1) and pushes them to, and prefetches them from,
*L2 adapters*.  This class is one, over kvstore's SDK, loaded by LMCache's own ``plugin``
adapter type with no LMCache patch::

    lmcache server ... --l2-adapter '{"type": "plugin", "module_path": "gpu_agent.lmcache",
        "class_name": "KVStoreL2Adapter",
        "adapter_params": {"target": "unix:///run/kvstore/kvstore.sock"}}'

LMCache's calls never wait: a store, a lookup-and-lock and a load are *submitted*, run on this
adapter's threads (``workers``), and their results are popped later; each kind signals its own
event fd (LMCache polls the three) when one finishes.  Stores and loads move each chunk's bytes
straight between LMCache's memory object and the node (shared memory on the node's machine:
no copy in between).  A lookup *locks* what it found by pinning it on the node for at most
``lock_ttl_s``; an unlock unpins it once this adapter's last lock of it is gone, and a pin
this adapter never unpins (it died) ends by itself.

Keys and namespaces are :mod:`gpu_agent.lmcache.settings`'s: a chunk's key folds in the model,
the kv rank, the object group, the cache salt and the chunk's dtype and shape, so any of them
differing misses.

Failure is a miss.  A node down, a deadline passed, a block of the wrong size: the keys a call
asked for read as missing (LMCache recomputes them), a store task reports failure; every
submitted task finishes and signals, nothing raises into LMCache's controller threads.

State: the client (thread-safe), the thread pool, the finished tasks and the lock counts (one
lock, :attr:`_lock`), and :class:`AdapterStats` (its own lock).  Capacity is the node's
business: the adapter reports none, so LMCache runs no eviction of its own over it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId
from lmcache.v1.platform import create_event_notifier

from gpu_agent.counters import LockedCounters, deadline_client, read_into
from gpu_agent.lmcache.settings import ChunkIdentity, L2Settings, chunk_key, chunk_namespace, layout_string
from kvstore.keys import ChunkKey, Namespace

if TYPE_CHECKING:
    from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
    from lmcache.v1.memory_management import MemoryObj

log = logging.getLogger("kvstore.lmcache")

AGENT = "lmcache-l2"
"""The node's metrics count this adapter's calls under this agent name."""

MAX_LAYOUTS = 64
"""Distinct layouts remembered per chunk identity (for :meth:`KVStoreL2Adapter.delete`,
which gets keys without their layout)."""

MAX_NAMESPACES = 65536
"""Namespaces (and identities) remembered, oldest dropped first: one per model, kv rank,
group, cache salt and layout, so per-user salts cannot grow the adapter without bound.  A key
whose namespace was dropped is recomputed when next used; its lock's pin ends at its TTL."""


@dataclasses.dataclass
class AdapterStats(LockedCounters):
    """What this adapter did since it started.  Guarded by :attr:`lock`."""

    store_tasks: int = 0
    stored: int = 0
    store_refused: int = 0
    store_bytes: int = 0
    lookups: int = 0
    found: int = 0
    load_chunks: int = 0
    loaded: int = 0
    load_bytes: int = 0
    wrong_size: int = 0
    errors: int = 0
    store_s: float = 0.0
    load_s: float = 0.0


def _params(config: Any) -> Mapping[str, Any]:
    """LMCache passes ``adapter_params`` as a dict (or, with a config class, an object)."""
    if isinstance(config, Mapping):
        return config
    return dict(getattr(config, "adapter_params", None) or vars(config))


class KVStoreL2Adapter(L2AdapterInterface):
    """LMCache ``L2AdapterInterface`` over kvstore (see the module docstring)."""

    def __init__(self, config: Any, l1_memory_desc: Any = None) -> None:
        super().__init__(max_capacity_bytes=0)
        self.settings = L2Settings.from_params(_params(config))
        self.client = deadline_client(
            self.settings.target, token_file=self.settings.token_file, deadline_s=self.settings.deadline_s, agent=AGENT
        )
        self.stats = AdapterStats()
        self._store_efd = create_event_notifier()
        self._lookup_efd = create_event_notifier()
        self._load_efd = create_event_notifier()
        self._pool = concurrent.futures.ThreadPoolExecutor(self.settings.workers, thread_name_prefix="kvstore-l2")
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._stores_done: dict[L2TaskId, L2StoreResult] = {}
        self._lookups_done: dict[L2TaskId, Bitmap] = {}
        self._loads_done: dict[L2TaskId, Bitmap] = {}
        self._locks: dict[ChunkKey, int] = {}
        self._layouts: dict[tuple[str, int, int, str], dict[str, None]] = defaultdict(dict)
        self._namespaces: dict[ChunkIdentity, Namespace] = {}
        self._warned: set[str] = set()
        self._healthy = True
        self._closed = False
        log.info("kvstore L2 adapter: target %s, %d worker(s)", self.settings.target, self.settings.workers)

    # -- event fds ---------------------------------------------------------------------------

    def get_store_event_fd(self) -> int:
        return int(self._store_efd.fileno())

    def get_lookup_and_lock_event_fd(self) -> int:
        return int(self._lookup_efd.fileno())

    def get_load_event_fd(self) -> int:
        return int(self._load_efd.fileno())

    # -- keys --------------------------------------------------------------------------------

    def _namespace(self, key: ObjectKey, layout: str) -> Namespace:
        """The namespace of ``key``'s chunk in ``layout`` (cached; its layout remembered for
        :meth:`delete` and :meth:`submit_unlock`, which get keys without one)."""
        ident = ChunkIdentity(key.model_name, int(key.kv_rank), int(key.object_group_id), key.cache_salt, layout)
        ns = self._namespaces.get(ident)
        if ns is None:
            ns = chunk_namespace(ident, salt=self.settings.salt)
            with self._lock:
                self._namespaces[ident] = ns
                while len(self._namespaces) > MAX_NAMESPACES:
                    del self._namespaces[next(iter(self._namespaces))]
                seen = self._layouts[(ident.model, ident.kv_rank, ident.group, ident.cache_salt)]
                seen[layout] = None
                while len(seen) > MAX_LAYOUTS:
                    del seen[next(iter(seen))]
                while len(self._layouts) > MAX_NAMESPACES:
                    del self._layouts[next(iter(self._layouts))]
        return ns

    def _key(self, key: ObjectKey, layout: str) -> ChunkKey:
        return chunk_key(self._namespace(key, layout).fingerprint, key.chunk_hash)

    def _known_keys(self, key: ObjectKey) -> list[ChunkKey]:
        """``key``'s kvstore key in every layout seen for its identity.  Under :attr:`_lock`."""
        seen = self._layouts.get((key.model_name, int(key.kv_rank), int(key.object_group_id), key.cache_salt), {})
        out = []
        for layout in seen:
            ident = ChunkIdentity(key.model_name, int(key.kv_rank), int(key.object_group_id), key.cache_salt, layout)
            ns = self._namespaces.get(ident)
            if ns is not None:
                out.append(chunk_key(ns.fingerprint, key.chunk_hash))
        return out

    @staticmethod
    def _object_layout(obj: MemoryObj) -> str:
        return layout_string(obj.get_dtypes(), [tuple(s) for s in obj.get_shapes()])

    @staticmethod
    def _desc_layout(desc: MemoryLayoutDesc | None) -> str | None:
        if desc is None:
            return None
        return layout_string(list(desc.dtypes), [tuple(s) for s in desc.shapes])

    # -- running tasks -----------------------------------------------------------------------

    def _submit(self, work: Callable[[], None]) -> None:
        """Run ``work`` on the pool; ``work`` records its own result and signals."""
        if self._closed:
            raise RuntimeError("the kvstore L2 adapter is closed")
        self._pool.submit(work)

    def _signal(self, efd: Any) -> None:
        if not self._closed:  # a task cut short by close() signals nobody: its fds are gone
            efd.notify()

    def _failed(self, what: str, n: int, exc: BaseException) -> None:
        with self.stats.lock:
            self.stats.errors += 1
        self._healthy = False
        log.warning("kvstore L2 adapter: %s of %d chunk(s) failed, counted as misses: %s", what, n, exc)

    def _warn_once(self, tag: str, message: str) -> None:
        if tag not in self._warned:
            self._warned.add(tag)
            log.warning("kvstore L2 adapter: %s", message)

    # -- store -------------------------------------------------------------------------------

    def submit_store_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        task = next(self._ids)
        self._submit(lambda: self._store(task, list(keys), list(objects)))
        return task

    def _store(self, task: L2TaskId, keys: list[ObjectKey], objects: list[MemoryObj]) -> None:
        ok, nbytes = False, 0
        stored_keys: list[ObjectKey] = []
        sizes: list[int] = []
        t0 = time.perf_counter()
        try:
            if len(keys) != len(objects):
                raise ValueError(f"{len(keys)} keys but {len(objects)} objects")
            layouts = [self._object_layout(obj) for obj in objects]
            groups: dict[Namespace, list[int]] = defaultdict(list)
            for i, (k, layout) in enumerate(zip(keys, layouts, strict=True)):
                groups[self._namespace(k, layout)].append(i)
            results = [False] * len(keys)
            for ns, idx in groups.items():
                bufs = [objects[i].byte_array for i in idx]
                got = self.client.put_many(
                    [chunk_key(ns.fingerprint, keys[i].chunk_hash) for i in idx],
                    bufs,
                    namespace=ns,
                    token_counts=[object_tokens(objects[i]) for i in idx],
                )
                for i, good, buf in zip(idx, got, bufs, strict=True):
                    results[i] = bool(good)
                    if good:
                        stored_keys.append(keys[i])
                        sizes.append(len(buf))
            nbytes = sum(sizes)
            ok = all(results)
            self._healthy = True
        except Exception as exc:  # never raise into LMCache's store controller
            self._failed("store", len(keys), exc)
        with self.stats.lock:
            s = self.stats
            s.store_tasks += 1
            s.stored += len(stored_keys)
            s.store_refused += len(keys) - len(stored_keys)
            s.store_bytes += nbytes
            s.store_s += time.perf_counter() - t0
        with self._lock:
            self._stores_done[task] = L2StoreResult(ok, nbytes)
        if stored_keys:
            self._notify_keys_stored(stored_keys, sizes)
        self._signal(self._store_efd)

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        with self._lock:
            done, self._stores_done = self._stores_done, {}
        return done

    # -- lookup and lock ---------------------------------------------------------------------

    def submit_lookup_and_lock_task(
        self, keys: list[ObjectKey], group_layout_descs: dict[int, MemoryLayoutDesc]
    ) -> L2TaskId:
        task = next(self._ids)
        self._submit(lambda: self._lookup(task, list(keys), dict(group_layout_descs or {})))
        return task

    def _lookup(self, task: L2TaskId, keys: list[ObjectKey], descs: dict[int, MemoryLayoutDesc]) -> None:
        bitmap = Bitmap(len(keys))
        found = 0
        try:
            layouts = {g: self._desc_layout(d) for g, d in descs.items()}
            asked: list[tuple[int, ChunkKey]] = []
            for i, k in enumerate(keys):
                layout = layouts.get(int(k.object_group_id))
                if layout is None:
                    self._warn_once(
                        f"nodesc{k.object_group_id}",
                        f"lookup of object group {k.object_group_id} without its memory layout: a miss",
                    )
                    continue
                asked.append((i, self._key(k, layout)))
            if asked:
                where = self.client.lookup([ck for _, ck in asked])
                hits = [(i, ck) for (i, ck), tier in zip(asked, where, strict=True) if tier is not None]
                if hits and self.settings.lock_ttl_s > 0:
                    self.client.pin([ck for _, ck in hits], self.settings.lock_ttl_s)
                    with self._lock:
                        for _, ck in hits:
                            self._locks[ck] = self._locks.get(ck, 0) + 1
                for i, _ in hits:
                    bitmap.set(i)
                found = len(hits)
            self._healthy = True
        except Exception as exc:
            self._failed("lookup", len(keys), exc)
            bitmap = Bitmap(len(keys))  # a lookup that failed half-way found nothing
        with self.stats.lock:
            self.stats.lookups += len(keys)
            self.stats.found += found
        with self._lock:
            self._lookups_done[task] = bitmap
        self._signal(self._lookup_efd)

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._lookups_done.pop(task_id, None)

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        """Drop one lock per key; a key's pin ends when its last lock here does (or at its
        TTL, whichever comes first: an unpin that fails is left to the TTL)."""
        if self.settings.lock_ttl_s <= 0 or not keys:
            return
        free: list[ChunkKey] = []
        with self._lock:
            for k in keys:
                for ck in self._known_keys(k):
                    n = self._locks.get(ck)
                    if n is None:
                        continue
                    if n <= 1:
                        del self._locks[ck]
                        free.append(ck)
                    else:
                        self._locks[ck] = n - 1
        if free and not self._closed:
            self._pool.submit(self._unpin, free)

    def _unpin(self, keys: list[ChunkKey]) -> None:
        try:
            self.client.unpin(keys)
        except Exception as exc:  # the pins end at their TTL
            log.info("kvstore L2 adapter: unpin of %d chunk(s) failed (their pins end by TTL): %s", len(keys), exc)

    # -- load --------------------------------------------------------------------------------

    def submit_load_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        task = next(self._ids)
        self._submit(lambda: self._load(task, list(keys), list(objects)))
        return task

    def _load(self, task: L2TaskId, keys: list[ObjectKey], objects: list[MemoryObj]) -> None:
        bitmap = Bitmap(len(keys))
        loaded: list[ObjectKey] = []
        nbytes = wrong = 0
        t0 = time.perf_counter()
        try:
            if len(keys) != len(objects):
                raise ValueError(f"{len(keys)} keys but {len(objects)} objects")
            bufs = [obj.byte_array for obj in objects]
            cks = [self._key(k, self._object_layout(obj)) for k, obj in zip(keys, objects, strict=True)]
            got = read_into(self.client, cks, bufs)
            for i, (n, buf) in enumerate(zip(got, bufs, strict=True)):
                if n is None:
                    continue
                if n != len(buf):
                    wrong += 1
                    continue
                bitmap.set(i)
                loaded.append(keys[i])
                nbytes += n
            if wrong:
                self._warn_once("size", f"{wrong} chunk(s) held a block of the wrong size: read as misses")
            self._healthy = True
        except Exception as exc:
            self._failed("load", len(keys), exc)
            bitmap, loaded, nbytes = Bitmap(len(keys)), [], 0
        with self.stats.lock:
            s = self.stats
            s.load_chunks += len(keys)
            s.loaded += len(loaded)
            s.load_bytes += nbytes
            s.wrong_size += wrong
            s.load_s += time.perf_counter() - t0
        if loaded:
            self._notify_keys_accessed(loaded)
        with self._lock:
            self._loads_done[task] = bitmap
        self._signal(self._load_efd)

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._loads_done.pop(task_id, None)

    # -- the rest of LMCache's interface ---------------------------------------------------

    def delete(self, keys: list[ObjectKey]) -> None:
        """Delete the chunks (every layout this adapter has seen each key's identity in)."""
        with self._lock:
            cks = [ck for k in keys for ck in self._known_keys(k)]
        if cks:
            try:
                self.client.delete(cks)
            except Exception as exc:
                self._failed("delete", len(keys), exc)

    def report_status(self) -> dict[str, Any]:
        return {
            "is_healthy": self._healthy and not self._closed,
            "type": "kvstore",
            "target": self.settings.target,
            "locked_chunks": len(self._locks),
            **self.stats.snapshot(),
        }

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)  # what runs ends within the deadline
        try:
            self.client.close()
        finally:
            self._store_efd.close()
            self._lookup_efd.close()
            self._load_efd.close()


def object_tokens(obj: MemoryObj) -> int:
    """The tokens an LMCache memory object holds (0 where it has no token dimension)."""
    try:
        return max(0, int(obj.get_num_tokens()))
    except Exception:  # a narrowed (compressed) object has no token dimension
        return 0


__all__: Sequence[str] = ("AGENT", "AdapterStats", "KVStoreL2Adapter", "object_tokens")

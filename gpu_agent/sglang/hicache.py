"""kvstore as SGLang HiCache's L3 storage: :class:`KVStoreHiCacheStorage`.

SGLang's hierarchical cache keeps KV in GPU memory, then in a host pool, then in an L3
*storage backend* that it prefetches pages from and backs pages up to.  This class is that
backend over kvstore's SDK, loaded by SGLang's own dynamic loader, with no SGLang patch::

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kvstore",
            "module_path": "gpu_agent.sglang", "class_name": "KVStoreHiCacheStorage",
            "interface_v1": 1, "kvstore_target": "unix:///run/kvstore/kvstore.sock"}'

``interface_v1`` makes SGLang call the zero-copy :meth:`batch_get_v1` / :meth:`batch_set_v1`
over its host pool (registered with :meth:`register_mem_pool_host`): a page whose bytes are
one contiguous run of the pool is read straight into it and written straight from it; any
other layout goes through one page-sized buffer.  Without it SGLang uses the generic
``get`` / ``set`` calls on flat page tensors, which work too.

Keys and namespaces are :mod:`gpu_agent.sglang.settings`'s: a page's key folds in the model,
the ranks, the KV dtype and the host pool's layout, so a different model or rank misses.

Failure is a miss.  A node down, a deadline passed, a block of the wrong size: the call's
pages read as missing (SGLang recomputes them) or unsaved, with a log line; no call returns
``None`` where SGLang expects a list (that would end its prefetch thread) or raises into
SGLang's storage threads.  What this backend cannot serve it refuses at attach time
(:meth:`register_mem_host_pool_v2`: hybrid models' extra pools), where SGLang reports it.

State: the client (thread-safe, shared by SGLang's prefetch and backup threads), the
namespace fixed when the host pool is registered, and :class:`BackendStats` (its own lock).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from gpu_agent.counters import LockedCounters, deadline_client, read_into
from gpu_agent.sglang.settings import HiCacheSettings, PageGeometry, page_key, page_namespace
from kvstore.errors import KVStoreError
from kvstore.keys import NO_PARENT, ChunkKey, Namespace

log = logging.getLogger(__name__)

AGENT = "sglang-hicache"
"""The backend's ``ClientOptions.agent``: the node counts its calls as this agent's."""

try:  # SGLang's own metrics record (its scheduler logs it when storage metrics are on)
    from sglang.srt.observability.metrics_collector import StorageMetrics
except ImportError:  # pragma: no cover - an SGLang without it gets None from get_stats
    StorageMetrics = None


@dataclasses.dataclass
class BackendStats(LockedCounters):
    """What this backend did, since it started: pages asked for, found, read and written,
    bytes moved and seconds spent, per direction.  Guarded by :attr:`lock`; the lists are
    SGLang's per-call metrics, drained by :meth:`KVStoreHiCacheStorage.get_stats`."""

    exists_pages: int = 0
    exists_hits: int = 0
    read_pages: int = 0
    read_hits: int = 0
    read_bytes: int = 0
    read_s: float = 0.0
    write_pages: int = 0
    written: int = 0
    write_bytes: int = 0
    write_s: float = 0.0
    errors: int = 0
    prefetch_pgs: list[int] = dataclasses.field(default_factory=list)
    backup_pgs: list[int] = dataclasses.field(default_factory=list)
    prefetch_bandwidth: list[float] = dataclasses.field(default_factory=list)  # GB/s, as SGLang's backends report it
    backup_bandwidth: list[float] = dataclasses.field(default_factory=list)


def _torch_dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class KVStoreHiCacheStorage(HiCacheStorage):
    """SGLang ``HiCacheStorage`` over kvstore (see the module docstring)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        self.settings = HiCacheSettings.from_extra_config(storage_config.extra_config)
        self.storage_config = storage_config
        self.model = self.settings.model or storage_config.model_name or ""
        self.is_writer = bool(storage_config.is_storage_writer)
        self.stats = BackendStats()
        self.namespace: Namespace | None = None
        self.geometry: PageGeometry | None = None
        self.mem_pool_host: Any = None
        self.client = deadline_client(
            self.settings.target, token_file=self.settings.token_file, deadline_s=self.settings.deadline_s, agent=AGENT
        )
        self._fingerprint = b""
        self._warned: set[str] = set()
        log.info(
            "kvstore HiCache storage: target %s, model %r, tp %d/%d%s",
            self.settings.target,
            self.model,
            storage_config.tp_rank,
            storage_config.tp_size,
            " (MLA: pages shared by every rank)" if storage_config.is_mla_model else "",
        )

    # -- attach ------------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """SGLang hands its host pool over once, right after construction: the namespace is
        fixed here, from the pool's dtype, layout and dimensions."""
        super().register_mem_pool_host(mem_pool_host)
        page = mem_pool_host.get_dummy_flat_data_page()
        mla = bool(self.storage_config.is_mla_model)
        geometry = PageGeometry(
            kv_dtype=_torch_dtype_name(mem_pool_host.dtype),
            layer_num=int(mem_pool_host.layer_num),
            head_num=1 if mla else int(mem_pool_host.head_num),
            head_dim=int(getattr(mem_pool_host, "kv_cache_dim", 0)) if mla else int(mem_pool_host.head_dim),
            page_size=int(mem_pool_host.page_size),
            layout=str(mem_pool_host.layout),
            is_mla=mla,
            page_bytes=page.numel() * page.element_size(),
        )
        c = self.storage_config
        ns = page_namespace(
            model=self.model,
            geometry=geometry,
            tp_rank=c.tp_rank,
            tp_size=c.tp_size,
            pp_rank=c.pp_rank,
            pp_size=c.pp_size,
            attn_cp_rank=c.attn_cp_rank,
            attn_cp_size=c.attn_cp_size,
            salt=self.settings.salt,
        )
        self.geometry, self.namespace, self.mem_pool_host = geometry, ns, mem_pool_host
        self._fingerprint = ns.fingerprint
        log.info(
            "kvstore HiCache storage: namespace %s (%s, %d-token pages of %d bytes, layout %s)",
            self._fingerprint.hex(),
            geometry.kv_dtype,
            geometry.page_size,
            geometry.page_bytes,
            geometry.layout,
        )

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Hybrid models (Mamba, SWA, DSA) bring extra pools through SGLang's v2 calls, which
        this backend does not serve yet: refused at attach, where SGLang reports it."""
        if str(host_pool_name) in ("kv", "PoolName.KV"):
            super().register_mem_host_pool_v2(host_pool, host_pool_name)
            return
        raise NotImplementedError(
            f"the kvstore HiCache backend stores KV pages only; pool {host_pool_name!s} "
            "(a hybrid model's) needs SGLang's v2 storage calls, which it does not serve yet"
        )

    # -- keys --------------------------------------------------------------------------------

    def _ready(self, what: str) -> bool:
        if self.namespace is None:
            self._warn_once("unregistered", f"{what} before SGLang registered its host pool: a miss")
            return False
        return True

    def _keys(self, keys: Sequence[str]) -> list[ChunkKey]:
        return [page_key(self._fingerprint, k) for k in keys]

    def _parents(self, keys: list[ChunkKey], extra_info: HiCacheStorageExtraInfo | None) -> list[bytes | None]:
        """Each page's parent in kvstore's prefix chain: the page before it (SGLang's keys come
        in prefix order; ``extra_info.prefix_keys`` names what came before the first)."""
        before = getattr(extra_info, "prefix_keys", None) or []
        first: bytes = page_key(self._fingerprint, before[-1]) if before else NO_PARENT
        return [first, *keys[:-1]] if keys else []

    def _warn_once(self, tag: str, message: str) -> None:
        if tag not in self._warned:
            self._warned.add(tag)
            log.warning("kvstore HiCache storage: %s", message)

    def _failed(self, what: str, n: int, exc: BaseException) -> None:
        with self.stats.lock:
            self.stats.errors += 1
        log.warning("kvstore HiCache storage: %s of %d page(s) failed, counted as misses: %s", what, n, exc)

    # -- existence ---------------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many of ``keys``, from the first, the store holds (SGLang prefetches that run)."""
        if not keys or not self._ready("exists"):
            return 0
        try:
            where = self.client.lookup(self._keys(keys))
        except (KVStoreError, OSError) as exc:
            self._failed("exists", len(keys), exc)
            return 0
        run = next((i for i, w in enumerate(where) if w is None), len(keys))
        with self.stats.lock:
            self.stats.exists_pages += len(keys)
            self.stats.exists_hits += run
        return run

    # -- the zero-copy interface (interface_v1) ----------------------------------------------

    def _page_index(self, host_indices: torch.Tensor, i: int) -> int:
        assert self.geometry is not None
        return int(host_indices[i * self.geometry.page_size].item())

    def _host_page(self, index: int) -> tuple[torch.Tensor, bool]:
        """The pool's flat page at ``index`` and whether it is the pool's own memory (a view
        of one contiguous run) rather than a copy."""
        page = self.mem_pool_host.get_data_page(index, flat=True)
        return page, bool(page._is_view() and page.is_contiguous())

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Read each page into the host pool at its index; one bool per key (a miss, an error
        or a block of the wrong size: False, and the pool's page is left as SGLang holds it
        unread)."""
        if not keys or not self._ready("batch_get_v1"):
            return [False] * len(keys)
        try:
            return self._get_v1(keys, host_indices)
        except Exception as exc:  # never raise into SGLang's prefetch thread
            self._failed("batch_get_v1", len(keys), exc)
            return [False] * len(keys)

    def _get_v1(self, keys: list[str], host_indices: torch.Tensor) -> list[bool]:
        g = self.geometry
        assert g is not None
        if host_indices.numel() != len(keys) * g.page_size:
            raise ValueError(f"{len(keys)} pages but {host_indices.numel()} host indices (page size {g.page_size})")
        indices = [self._page_index(host_indices, i) for i in range(len(keys))]
        outs: list[torch.Tensor] = []
        direct: list[bool] = []
        for idx in indices:
            page, own = self._host_page(idx)
            outs.append(page if own else self.mem_pool_host.get_dummy_flat_data_page())
            direct.append(own)
        t0 = time.perf_counter()
        got = read_into(self.client, self._keys(keys), outs)
        seconds = time.perf_counter() - t0
        ok = [n == g.page_bytes for n in got]
        for i, good in enumerate(ok):
            if good and not direct[i]:
                self.mem_pool_host.set_from_flat_data_page(indices[i], outs[i])
        bad = [k for k, n in zip(keys, got, strict=True) if n is not None and n != g.page_bytes]
        if bad:
            self._warn_once("size", f"page {bad[0]} holds a block of the wrong size: read as a miss")
        self._count_read(len(keys), sum(ok), seconds)
        return ok

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Write each page from the host pool; one bool per key.  A rank that is not its
        pages' writer (MLA's other ranks) stores nothing and reports success, as SGLang's own
        backends do: rank 0's copy serves every rank."""
        if not keys:
            return []
        if not self.is_writer:
            return [True] * len(keys)
        if not self._ready("batch_set_v1"):
            return [False] * len(keys)
        try:
            g = self.geometry
            assert g is not None
            if host_indices.numel() != len(keys) * g.page_size:
                raise ValueError(f"{len(keys)} pages but {host_indices.numel()} host indices (page size {g.page_size})")
            pages = [self._host_page(self._page_index(host_indices, i))[0] for i in range(len(keys))]
            return self._put(keys, pages, extra_info)
        except Exception as exc:  # never raise into SGLang's backup thread
            self._failed("batch_set_v1", len(keys), exc)
            return [False] * len(keys)

    # -- the generic interface (flat page tensors) ----------------------------------------

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location] if target_location is not None else None)[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """Read each page into its target tensor (SGLang's dummy flat pages), or a new one;
        None where a page is missing."""
        if not keys or not self._ready("batch_get"):
            return [None] * len(keys)
        try:
            g = self.geometry
            assert g is not None
            outs = list(target_locations) if target_locations else [None] * len(keys)
            outs = [t if t is not None else self.mem_pool_host.get_dummy_flat_data_page() for t in outs]
            t0 = time.perf_counter()
            got = read_into(self.client, self._keys(keys), outs)
            seconds = time.perf_counter() - t0
            result = [t if n == g.page_bytes else None for t, n in zip(outs, got, strict=True)]
            self._count_read(len(keys), sum(r is not None for r in result), seconds)
            return result
        except Exception as exc:
            self._failed("batch_get", len(keys), exc)
            return [None] * len(keys)

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        """Write flat page tensors; True if every one is stored."""
        if not keys or not self.is_writer:
            return True
        if not self._ready("batch_set") or values is None or len(values) != len(keys):
            return False
        try:
            return all(self._put(keys, list(values), None))
        except Exception as exc:
            self._failed("batch_set", len(keys), exc)
            return False

    def _put(
        self, keys: list[str], pages: list[torch.Tensor], extra_info: HiCacheStorageExtraInfo | None
    ) -> list[bool]:
        g = self.geometry
        assert g is not None
        sizes = {p.numel() * p.element_size() for p in pages}
        if sizes != {g.page_bytes}:
            raise ValueError(f"pages of {sorted(sizes)} bytes; this pool's are {g.page_bytes}")
        ks = self._keys(keys)
        t0 = time.perf_counter()
        stored = self.client.put_many(
            ks,
            [p if p.is_contiguous() else p.contiguous() for p in pages],
            namespace=self.namespace,
            parents=self._parents(ks, extra_info),
            token_counts=[g.page_size] * len(ks),
        )
        seconds = time.perf_counter() - t0
        with self.stats.lock:
            s = self.stats
            s.write_pages += len(keys)
            s.written += sum(stored)
            s.write_bytes += sum(stored) * g.page_bytes
            s.write_s += seconds
            s.backup_pgs.append(len(keys))
            s.backup_bandwidth.append(len(keys) * g.page_bytes / max(seconds, 1e-9) / 1e9)
        return list(stored)

    def _count_read(self, n: int, hits: int, seconds: float) -> None:
        g = self.geometry
        assert g is not None
        with self.stats.lock:
            s = self.stats
            s.read_pages += n
            s.read_hits += hits
            s.read_bytes += hits * g.page_bytes
            s.read_s += seconds
            s.prefetch_pgs.append(n)
            s.prefetch_bandwidth.append(hits * g.page_bytes / max(seconds, 1e-9) / 1e9)

    # -- the rest of SGLang's interface ------------------------------------------------------

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` since the last call (its scheduler logs them when
        ``--enable-cache-report``/storage metrics are on); this backend's totals are
        :attr:`stats`."""
        if StorageMetrics is None:
            return None
        m = StorageMetrics()
        with self.stats.lock:
            s = self.stats
            m.prefetch_pgs.extend(s.prefetch_pgs)
            m.backup_pgs.extend(s.backup_pgs)
            m.prefetch_bandwidth.extend(s.prefetch_bandwidth)
            m.backup_bandwidth.extend(s.backup_bandwidth)
            s.prefetch_pgs.clear()
            s.backup_pgs.clear()
            s.prefetch_bandwidth.clear()
            s.backup_bandwidth.clear()
        return m

    def clear(self) -> None:
        """SGLang's ``clear`` (its flush of the whole cache) does not delete the pool's blocks:
        other engines share them, and the node's eviction owns their lifetime."""
        log.info("kvstore HiCache storage: clear() keeps the pool's blocks (shared; the node evicts)")

    def close(self) -> None:
        self.client.close()

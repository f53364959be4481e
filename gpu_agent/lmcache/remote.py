"""kvstore as LMCache's remote storage (in-process mode): :class:`KVStoreRemoteConnector`.

LMCache inside a vLLM worker (``LMCacheConnectorV1``) keeps hot chunks in local CPU memory and
puts the rest in a *remote backend*.  This class is one, registered the way LMCache documents
remote-storage plug-ins (LMCache's configuration, e.g. its YAML file)::

    chunk_size: 256
    local_cpu: true
    max_local_cpu_size: 20
    remote_storage_plugins: ["kvstore"]
    extra_config:
      remote_storage_plugin.kvstore.module_path: gpu_agent.lmcache
      remote_storage_plugin.kvstore.class_name: KVStoreRemoteConnector
      remote_storage_plugin.kvstore.target: unix:///run/kvstore/kvstore.sock

LMCache dials a plug-in as ``plugin://kvstore``: its dynamic adapter accepts that URL for a
``RemoteConnector`` subclass and builds this class with its event loop, its local CPU backend
(the allocator every chunk read lands in) and its configuration.  kvstore's settings are the
``remote_storage_plugin.kvstore.*`` keys of ``extra_config``, named as the L2 adapter's
``adapter_params`` (:class:`~gpu_agent.lmcache.settings.L2Settings`; ``lock_ttl_s`` is unused
here, and ``workers`` sizes the thread pool the blocking SDK calls run on).

Keys.  A chunk's kvstore key is ``xxh3_128(fingerprint || mark || key.to_string())`` over
LMCache's own ``CacheEngineKey`` string (model, world size, worker, chunk hash, dtype, tags)
inside a namespace of the chunk's full shape, dtype and format and the salt.  A chunk's bytes
are LMCache's memory object as it hands it over; a partial chunk (LMCache's last, when it
saves those) is the same tensor with fewer tokens, so its length is its metadata: a read
allocates a full chunk, reads the block into it and cuts it to the tokens the block holds
(LMCache's ``reshape_partial_chunk``), and a block whose length is no whole number of tokens,
or more than a chunk, is a miss.

A bad setting stops LMCache from creating the backend, with kvstore's message in its log
(LMCache's ``IrrecoverableException``: it would otherwise retry a configuration error every ten
seconds and miss in between).  Failure is a miss: a node down or a deadline passed reads as "not there" (LMCache recomputes)
and a put that fails is logged and dropped; nothing raises into LMCache's event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import xxhash
from lmcache.v1.exceptions import IrrecoverableException
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from gpu_agent.counters import OVERSIZED, LockedCounters, deadline_client, read_into
from gpu_agent.lmcache.l2 import object_tokens
from gpu_agent.lmcache.settings import L2Settings, layout_string
from kvstore.errors import InvalidArgument
from kvstore.keys import ChunkKey, KVLayout, Namespace

if TYPE_CHECKING:
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.memory_management import MemoryObj

log = logging.getLogger("kvstore.lmcache")

AGENT = "lmcache-remote"
"""The node's metrics count this connector's calls under this agent name."""

PLUGIN = "kvstore"
"""The plug-in name this connector's settings are read under (``remote_storage_plugin.kvstore.*``)."""

KEY_MARK = b"kvstore/lmcache-remote/v1\x00"
"""Hashed between a namespace's fingerprint and LMCache's key string."""

_T = TypeVar("_T")


@dataclasses.dataclass
class RemoteStats(LockedCounters):
    """What this connector did since it started.  Guarded by :attr:`lock`."""

    lookups: int = 0
    found: int = 0
    puts: int = 0
    stored: int = 0
    put_bytes: int = 0
    gets: int = 0
    hits: int = 0
    get_bytes: int = 0
    wrong_size: int = 0
    errors: int = 0


def settings_from_extra_config(extra: Any, plugin: str = PLUGIN) -> L2Settings:
    """kvstore's settings from LMCache's ``extra_config`` (``remote_storage_plugin.<plugin>.*``
    keys; LMCache's own ``module_path`` and ``class_name`` are left to LMCache)."""
    prefix = f"remote_storage_plugin.{plugin}."
    ours = {
        k[len(prefix) :]: v
        for k, v in dict(extra or {}).items()
        if isinstance(k, str) and k.startswith(prefix) and k[len(prefix) :] not in ("module_path", "class_name")
    }
    return L2Settings.from_params(ours)


class KVStoreRemoteConnector(RemoteConnector):
    """LMCache ``RemoteConnector`` over kvstore (see the module docstring)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, local_cpu_backend: Any, config: Any) -> None:
        super().__init__(local_cpu_backend.config, local_cpu_backend.metadata)
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        try:
            self.settings = settings_from_extra_config(getattr(config, "extra_config", None))
        except InvalidArgument as exc:  # a configuration error: LMCache must not retry it every 10 s
            raise IrrecoverableException(f"the kvstore remote storage plug-in: {exc}") from exc
        self.client = deadline_client(
            self.settings.target, token_file=self.settings.token_file, deadline_s=self.settings.deadline_s, agent=AGENT
        )
        self._pool = concurrent.futures.ThreadPoolExecutor(self.settings.workers, thread_name_prefix="kvstore-lmc")
        self.stats = RemoteStats()
        self._namespace = Namespace(
            model_id=local_cpu_backend.metadata.model_name,
            kv_dtype=str(self.meta_dtypes[0]).removeprefix("torch."),
            layout=KVLayout(
                page_layout=f"lmcache-remote:{layout_string(self.meta_dtypes, [tuple(s) for s in self.meta_shapes])}"
                f":{self.meta_fmt.name}"
            ),
            chunk_tokens=int(local_cpu_backend.metadata.chunk_size),
            tenant_salt=self.settings.salt,
        )
        self._fingerprint = self._namespace.fingerprint
        log.info(
            "kvstore LMCache remote: target %s, namespace %s (%d-byte chunks)",
            self.settings.target,
            self._fingerprint.hex(),
            self.full_chunk_size_bytes,
        )

    # -- keys and calls ----------------------------------------------------------------------

    def key(self, key: CacheEngineKey) -> ChunkKey:
        return ChunkKey(xxhash.xxh3_128_digest(self._fingerprint + KEY_MARK + key.to_string().encode()))

    async def _call(self, fn: Callable[[], _T]) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    def _failed(self, what: str, n: int, exc: BaseException) -> None:
        with self.stats.lock:
            self.stats.errors += 1
        log.warning("kvstore LMCache remote: %s of %d chunk(s) failed, counted as misses: %s", what, n, exc)

    # -- existence ---------------------------------------------------------------------------

    def _found(self, keys: list[CacheEngineKey]) -> list[bool]:
        try:
            where = self.client.lookup([self.key(k) for k in keys])
            found = [t is not None for t in where]
        except Exception as exc:
            self._failed("lookup", len(keys), exc)
            found = [False] * len(keys)
        with self.stats.lock:
            self.stats.lookups += len(keys)
            self.stats.found += sum(found)
        return found

    @staticmethod
    def _leading(found: list[bool]) -> int:
        return found.index(False) if False in found else len(found)

    async def exists(self, key: CacheEngineKey) -> bool:
        return (await self._call(lambda: self._found([key])))[0]

    def exists_sync(self, key: CacheEngineKey) -> bool:
        return self._found([key])[0]

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: list[CacheEngineKey]) -> int:
        """How many of ``keys``, from the first, the store holds (one lookup call)."""
        return self._leading(self._found(list(keys))) if keys else 0

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(self, lookup_id: str, keys: list[CacheEngineKey], pin: bool = False) -> int:
        if not keys:
            return 0
        return self._leading(await self._call(lambda: self._found(list(keys))))

    # -- reads -------------------------------------------------------------------------------

    def _read(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        """Each chunk read into a memory object of LMCache's allocator (cut to the tokens its
        block holds), or None: a miss, an allocation refused, a block of the wrong size."""
        objs: list[Any] = []
        for _ in keys:
            obj = self.local_cpu_backend.allocate(self.meta_shapes, self.meta_dtypes, self.meta_fmt)
            objs.append(obj)
        out: list[MemoryObj | None] = [None] * len(keys)
        live = [i for i, o in enumerate(objs) if o is not None]
        try:
            got = read_into(self.client, [self.key(keys[i]) for i in live], [objs[i].byte_array for i in live])
        except Exception as exc:
            self._failed("get", len(keys), exc)
            got = [None] * len(live)
        wrong = nbytes = 0
        for i, n in zip(live, got, strict=True):
            obj = objs[i]
            if n is None:
                obj.ref_count_down()
                continue
            if n == OVERSIZED:
                wrong += 1
                obj.ref_count_down()
                continue
            try:
                out[i] = self.reshape_partial_chunk(obj, n)
                nbytes += n
            except ValueError:
                wrong += 1
                obj.ref_count_down()
        if wrong:
            log.warning("kvstore LMCache remote: %d chunk(s) held a block of the wrong size: read as misses", wrong)
        with self.stats.lock:
            s = self.stats
            s.gets += len(keys)
            s.hits += sum(o is not None for o in out)
            s.get_bytes += nbytes
            s.wrong_size += wrong
        return out

    async def get(self, key: CacheEngineKey) -> MemoryObj | None:
        return (await self._call(lambda: self._read([key])))[0]

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        return await self._call(lambda: self._read(list(keys)))

    def support_batched_get_non_blocking(self) -> bool:
        return True

    async def batched_get_non_blocking(self, lookup_id: str, keys: list[CacheEngineKey]) -> list[MemoryObj]:
        """The leading run of chunks read (LMCache's contract); what was read past a miss is
        handed back to the allocator."""
        objs = await self._call(lambda: self._read(list(keys)))
        run: list[MemoryObj] = []
        for obj in objs:
            if obj is None:
                break
            run.append(obj)
        for obj in objs[len(run) :]:
            if obj is not None:
                obj.ref_count_down()
        return run

    # -- writes ------------------------------------------------------------------------------

    def _write(self, keys: list[CacheEngineKey], objs: list[MemoryObj]) -> None:
        try:
            bufs = [o.byte_array for o in objs]
            stored = self.client.put_many(
                [self.key(k) for k in keys],
                bufs,
                namespace=self._namespace,
                token_counts=[object_tokens(o) for o in objs],
            )
            n = sum(bool(s) for s in stored)
            nbytes = sum(len(b) for b, s in zip(bufs, stored, strict=True) if s)
        except Exception as exc:
            self._failed("put", len(keys), exc)
            n = nbytes = 0
        with self.stats.lock:
            self.stats.puts += len(keys)
            self.stats.stored += n
            self.stats.put_bytes += nbytes

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        await self._call(lambda: self._write([key], [memory_obj]))

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: list[CacheEngineKey], memory_objs: list[MemoryObj]) -> None:
        await self._call(lambda: self._write(list(keys), list(memory_objs)))

    # -- the rest ----------------------------------------------------------------------------

    def remove_sync(self, key: CacheEngineKey) -> bool:
        try:
            return bool(self.client.delete([self.key(key)]))
        except Exception as exc:
            self._failed("remove", 1, exc)
            return False

    async def list(self) -> list[str]:
        """kvstore holds chunks by hashed key only (LMCache's key strings are not kept): an
        empty list; the node's ``kvstore stats`` and the dashboard count what it holds."""
        return []

    async def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.client.close()

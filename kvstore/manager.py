"""The tier manager: one event loop's view of every block on this node.

Owner: the node's asyncio loop.  Every method that touches the index, the DRAM tier,
reservations, leases or pins runs on that loop, so none of it needs a lock.  Disk I/O
(NVMe reads and writes, checksums over big payloads) runs in ``executor`` threads
and reports back by ``await``; the NVMe tier is thread-safe for exactly that.

What it adds on top of the tiers:

* **Two-phase writes.** ``reserve`` hands out arena extents under a reservation with a
  deadline; the writer copies in; ``commit`` makes the block visible, ``abort`` drops it.
  ``reap`` reclaims reservations whose deadline passed.  Keys are content addresses,
  so reserving a key that is already stored answers ``EXISTS`` and nothing is rewritten.
* **Leases.** ``acquire`` promotes NVMe hits into DRAM and returns extents under a lease;
  eviction skips leased blocks; ``delete`` of a leased block hides it at once and frees
  its space when the last lease goes.  ``release`` tells the reader whether its lease was
  still valid (an expired lease means the bytes it copied may have been reused).
* **Eviction.** DRAM victims come from the DRAM tier's policy (prefix-aware by
  default); dirty victims are demoted to NVMe (write-back) in one group commit, clean
  ones are dropped.  ``write_through`` persists every commit at once instead.
* **Pins** with a TTL keep blocks resident.
* **Tenants** (``kvstore/tenants.py``; the service decides who sees what): lookups,
  ``acquire`` and ``reserve``'s deduplication take a ``visible(namespace)`` predicate, and a
  block the caller may not see is absent to it; reservations and leases carry the tenant
  that made them.  Under one key there is only ever one namespace's block: a commit that
  would replace another namespace's block is dropped (and reported ``OK``, as if stored).
* **Cache-hit accounting** (``kvstore/misses.py``): every lookup key is counted as a hit
  (per tier, with its tokens) or a miss with its reason; ``history`` remembers, in
  bounded memory, why keys left (evicted, invalidated, corrupt).

Invariants: a block's DRAM allocation is freed only when no lease refers to it; a
reserved extent belongs to exactly one reservation until commit, abort or reap; tier
capacities are never exceeded (the allocators cannot over-allocate).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import enum
import itertools
import secrets
import logging
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvstore.block import BlockMeta, checksum
from kvstore.errors import CapacityExceeded, InvalidArgument
from kvstore.keys import ChunkKey
from kvstore.misses import CORRUPT, EVICTED, INVALIDATED, NEVER_STORED, TIER_LABEL, KeyHistory, Ledger
from tiers.allocator import Extent
from tiers.base import MissReason, TierKind
from tiers.dram import DRAMTier

log = logging.getLogger(__name__)

_EXPIRED_MEMORY = 65536  # how many expired lease ids we remember, to answer release() honestly

Visible = Callable[[bytes], bool]
"""Whether the caller may see (or change) blocks of a namespace fingerprint."""


class Status(enum.IntEnum):
    """Per-key outcome.  Values match the protobuf ``KeyStatus`` enum."""

    OK = 1
    MISS = 2
    EXISTS = 3
    CORRUPT = 4
    EXPIRED = 5
    NO_SPACE = 6


@dataclasses.dataclass(frozen=True, slots=True)
class Reserved:
    status: Status
    reservation_id: int = 0
    extents: tuple[Extent, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class Leased:
    key: ChunkKey
    status: Status
    lease_id: int = 0
    extents: tuple[Extent, ...] = ()
    meta: BlockMeta | None = None
    tier: TierKind | None = None  # where the block was found (NVME means it was promoted)


@dataclasses.dataclass(slots=True)
class _Reservation:
    meta: BlockMeta
    extents: list[Extent]
    deadline: float
    tenant: str | None = None  # who made it (None: the admin, or a node without tenants)


@dataclasses.dataclass(slots=True)
class _Lease:
    key: ChunkKey
    alloc: int  # first extent offset: identifies the allocation
    deadline: float
    tenant: str | None = None


class TierManager:
    def __init__(
        self,
        dram: DRAMTier,
        nvme: Any | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        write_through: bool = False,
        reservation_ttl: float = 30.0,
        lease_ttl: float = 30.0,
        executor: ThreadPoolExecutor | None = None,
        verify_demotions: bool = True,
    ) -> None:
        self.dram = dram
        self.nvme = nvme
        self.clock = clock
        self.write_through = write_through
        self.reservation_ttl = reservation_ttl
        self.lease_ttl = lease_ttl
        self.verify_demotions = verify_demotions
        self._executor = executor or ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvstore-io")
        self._own_executor = executor is None
        # ids start at a random point so a late Release/Abort meant for an earlier node
        # process on the same socket cannot hit another client's lease or reservation
        self._ids = itertools.count(secrets.randbits(48) + 1)
        self._reservations: dict[int, _Reservation] = {}
        self._leases: dict[int, _Lease] = {}
        self._expired: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._refs: collections.Counter[int] = collections.Counter()  # allocation -> live leases
        self._detached: dict[int, list[Extent]] = {}  # deleted while leased; freed on last release
        self._pins: dict[ChunkKey, float] = {}  # key -> pinned until (clock)
        self._busy: set[ChunkKey] = set()  # being demoted
        self._promoting: dict[ChunkKey, asyncio.Future[Status | None]] = {}
        self._persisting: collections.Counter[ChunkKey] = collections.Counter()  # being written to NVMe
        self._doomed: set[ChunkKey] = set()  # deleted while being written to NVMe: that copy goes when the write ends
        self._background: set[asyncio.Task[Any]] = set()
        self.counters: collections.Counter[str] = collections.Counter()
        # cache-hit accounting (kvstore/misses.py): why keys left, what lookups found
        self.history = KeyHistory()
        self.ledger = Ledger()
        self._departed: collections.deque[tuple[ChunkKey, str, bytes | None]] = collections.deque()  # from executor threads
        self._corrupt_demoted: set[ChunkKey] = set()  # from executor threads: dirty blocks that failed their checksum

    # -- helpers ------------------------------------------------------------------
    async def _io(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn`` in the executor.  A cancelled caller still waits for it to end before
        unwinding: the thread cannot be stopped, and it may be reading or writing arena
        extents that the caller frees (and another block gets) as it unwinds."""
        fut = asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            while not fut.done():
                try:
                    await asyncio.wait([fut])
                except asyncio.CancelledError:
                    pass
            if not fut.cancelled():
                fut.exception()  # the caller's cancellation is what propagates
            raise

    def _alloc_id(self, key: ChunkKey) -> int | None:
        ext = self.dram.extents(key)
        return ext[0].offset if ext else None

    def pinned(self, key: ChunkKey) -> bool:
        until = self._pins.get(key)
        return until is not None and until > self.clock()

    def can_evict(self, key: ChunkKey) -> bool:
        if key in self._busy or self.pinned(key):
            return False
        alloc = self._alloc_id(key)
        return alloc is None or self._refs[alloc] == 0

    def _on_nvme(self, key: ChunkKey) -> bool:
        return self.nvme is not None and key not in self._doomed and self.nvme.contains(key)

    def where(self, key: ChunkKey) -> TierKind | None:
        if self.dram.contains(key):
            return TierKind.DRAM
        if self._on_nvme(key):
            return TierKind.NVME
        return None

    def _locate(self, key: ChunkKey) -> tuple[TierKind | None, BlockMeta | None]:
        meta = self.dram.meta(key)
        if meta is not None:
            return TierKind.DRAM, meta
        if self.nvme is not None and key not in self._doomed:
            meta = self.nvme.meta(key)
            if meta is not None:
                return TierKind.NVME, meta
        return None, None

    def _find(self, key: ChunkKey, visible: Visible | None) -> tuple[TierKind | None, BlockMeta | None]:
        """``_locate``, where a block the caller may not see is not there."""
        t, meta = self._locate(key)
        if meta is not None and visible is not None and not visible(meta.namespace):
            return None, None
        return t, meta

    def namespace_of(self, key: ChunkKey) -> bytes | None:
        """The namespace the stored block under ``key`` declares; None if none is stored."""
        meta = self._locate(key)[1]
        return meta.namespace if meta is not None else None

    def reservation_tenant(self, rid: int) -> str | None:
        r = self._reservations.get(rid)
        return r.tenant if r is not None else None

    def lease_tenant(self, lid: int) -> str | None:
        lease = self._leases.get(lid)
        return lease.tenant if lease is not None else None

    # -- why keys left (kvstore/misses.py) ------------------------------------------------
    def _forget(self, key: ChunkKey, reason: str, meta: BlockMeta | None) -> None:
        """Remember that ``key`` left this node for ``reason`` (loop only)."""
        self._drain_departed()
        self.history.record(key, reason, self.ledger.tag(meta))

    def _drain_departed(self) -> None:
        while self._departed:
            key, reason, ns = self._departed.popleft()
            self.history.record(key, reason, self.ledger.namespaces.tag(ns) if ns is not None else 0)

    def _reason(self, key: ChunkKey) -> tuple[str, int]:
        """Why ``key`` is missing: ``(reason, namespace tag)``."""
        self._drain_departed()
        return self.history.lookup(key) or (NEVER_STORED, 0)

    # -- lookups --------------------------------------------------------------------
    def exists(self, keys: Sequence[ChunkKey], *, visible: Visible | None = None) -> list[TierKind | None]:
        out: list[TierKind | None] = []
        hits: list[tuple[str, BlockMeta]] = []
        misses: list[tuple[str, int]] = []
        for k in keys:
            t, meta = self._find(k, visible)
            out.append(t)
            if meta is not None:
                hits.append((TIER_LABEL[t], meta))  # type: ignore[index]
            else:
                misses.append(self._reason(k))
        self.ledger.record("exists", hits, misses)
        return out

    def match_prefix(self, keys: Sequence[ChunkKey], *, visible: Visible | None = None) -> tuple[int, list[TierKind]]:
        tiers: list[TierKind] = []
        hits: list[tuple[str, BlockMeta]] = []
        for k in keys:
            t, meta = self._find(k, visible)
            if t is None:
                break
            tiers.append(t)
            hits.append((TIER_LABEL[t], meta))  # type: ignore[arg-type]
        self.counters["match_prefix_calls"] += 1
        self.counters["match_prefix_keys"] += len(keys)
        self.counters["match_prefix_hits"] += len(tiers)
        # the keys after the first gap miss for the gap's reason (a chunk is useless without its ancestors)
        gap = (*self._reason(keys[len(tiers)]), len(keys) - len(tiers)) if len(tiers) < len(keys) else None
        self.ledger.record("match_prefix", hits, extra_misses=gap)
        return len(tiers), tiers

    # -- two-phase writes -----------------------------------------------------------
    async def reserve(self, metas: Sequence[BlockMeta], *, tenant: str | None = None,
                      visible: Visible | None = None) -> list[Reserved]:
        """Reserve space for each block, or answer ``EXISTS`` for a key already stored.  A key
        stored in a namespace the caller may not see (``visible``) gets space like a new one:
        its commit is dropped, so the answers never tell whether another tenant has it."""
        out: list[Reserved] = []
        deadline = self.clock() + self.reservation_ttl
        try:
            for meta in metas:
                if self._find(meta.key, visible)[1] is not None:
                    self.counters["puts_deduplicated"] += 1
                    out.append(Reserved(Status.EXISTS))
                    continue
                try:
                    extents = await self._allocate(meta.payload_len)
                except CapacityExceeded:
                    if self.dram.allocator.rounded(meta.payload_len) > self.dram.capacity_bytes:
                        raise
                    self.counters["reserve_no_space"] += 1
                    out.append(Reserved(Status.NO_SPACE))
                    continue
                rid = next(self._ids)
                self._reservations[rid] = _Reservation(meta, extents, deadline, tenant)
                out.append(Reserved(Status.OK, rid, tuple(extents)))
        except BaseException:
            self.abort([r.reservation_id for r in out if r.status == Status.OK])  # nobody will learn their ids
            raise
        return out

    async def commit(self, ids: Sequence[int], checksums: Sequence[int] | None = None, *, verify: bool = False) -> list[Status]:
        """Publish reserved blocks.  ``checksums`` (if given) replace the reserved metas' ones;
        ``verify`` recomputes them over the arena first (the data channel does; local writers
        are trusted and checked again on demotion)."""
        if checksums is not None and len(checksums) != len(ids):
            raise InvalidArgument(f"{len(ids)} reservation ids but {len(checksums)} checksums")
        out: list[Status] = []
        for i, rid in enumerate(ids):
            r = self._reservations.pop(rid, None)
            if r is None:
                out.append(Status.EXPIRED)
                continue
            meta = r.meta if checksums is None else dataclasses.replace(r.meta, payload_checksum=checksums[i])
            if verify:
                try:
                    actual = await self._io(self._checksum_extents, r.extents, meta.payload_len)
                except BaseException:
                    # popped above, so neither the reaper nor the caller would ever free it; the
                    # rest of the batch may be held (a data-channel transfer): they go too
                    self.dram.abort(r.extents)
                    self.abort(ids[i + 1 :])
                    raise
                if actual != meta.payload_checksum:
                    self.dram.abort(r.extents)
                    self.counters["corrupt_puts"] += 1
                    if not self.dram.contains(meta.key):
                        self._forget(meta.key, CORRUPT, meta)
                    out.append(Status.CORRUPT)
                    continue
            # checked after the checksum, so a put answers alike whether or not it was dropped here
            stored = self._locate(meta.key)[1]
            if stored is not None and stored.namespace != meta.namespace:
                # the key holds another namespace's block (a writer declared a namespace its key
                # was not derived from, or lost a race to one): that block stays, this one goes
                self.dram.abort(r.extents)
                self.counters["puts_shadowed"] += 1
                out.append(Status.OK)
                continue
            old = self._alloc_id(meta.key)
            if old is not None and self._refs[old]:
                self._detached[old] = self.dram.detach(meta.key) or []
            self.dram.commit(meta, r.extents)
            self.counters["puts"] += 1
            self.counters["put_bytes"] += meta.payload_len
            out.append(Status.OK)
            if self.write_through and self.nvme is not None:
                self._spawn(self._persist([meta.key]))
        return out

    def abort(self, ids: Sequence[int]) -> None:
        for rid in ids:
            r = self._reservations.pop(rid, None)
            if r is not None:
                self.dram.abort(r.extents)

    def reservation(self, rid: int) -> tuple[BlockMeta, list[Extent]] | None:
        r = self._reservations.get(rid)
        return (r.meta, r.extents) if r else None

    def hold(self, *, reservation_ids: Sequence[int] = (), lease_ids: Sequence[int] = ()) -> bool:
        """Exempt live reservations and leases from their deadlines: a transfer now moves
        their bytes and resolves them itself (commit/abort, release) when it ends.

        Without this the reaper could free an extent while a stalled transfer still
        writes into it or sends from it, after it went to another block.  False if any of
        them had already expired (the caller must then not touch their extents).
        """
        live = True
        for rid in reservation_ids:
            r = self._reservations.get(rid)
            if r is None:
                live = False
            else:
                r.deadline = math.inf
        for lid in lease_ids:
            lease = self._leases.get(lid)
            if lease is None:
                live = False
            else:
                lease.deadline = math.inf
        return live

    def held(self, some_id: int) -> bool:
        """Whether a transfer holds this reservation or lease (see ``hold``): its bytes are
        moving right now, so only that transfer may resolve it, never a Commit, Abort or
        Release call (which would free extents the transfer still reads or writes)."""
        r = self._reservations.get(some_id)
        if r is not None:
            return r.deadline == math.inf
        lease = self._leases.get(some_id)
        return lease is not None and lease.deadline == math.inf

    # -- leased reads ---------------------------------------------------------------
    async def acquire(self, keys: Sequence[ChunkKey], *, request: bool = True, tenant: str | None = None,
                      visible: Visible | None = None) -> list[Leased]:
        """Lease every key that is stored, promoting NVMe hits into DRAM.  A block the caller
        may not see (``visible``) is a miss, and is not promoted.

        Each key is accounted as a ``get`` hit or miss (``request``: also count one request).

        DRAM hits are leased first, so promotions for the same call cannot evict them;
        each promoted block is leased the moment it lands.  A key that cannot be brought
        into DRAM right now (everything else pinned or leased) answers ``NO_SPACE``: the
        SDK retries it after releasing what it already holds.
        """
        deadline = self.clock() + self.lease_ttl
        out: list[Leased | None] = [None] * len(keys)
        hidden: set[int] = set()
        if visible is not None:
            for i, k in enumerate(keys):
                meta = self._locate(k)[1]
                if meta is not None and not visible(meta.namespace):
                    hidden.add(i)
        for i, k in enumerate(keys):
            if self.dram.contains(k) and i not in hidden:
                out[i] = self._lease(k, TierKind.DRAM, deadline, tenant)
        todo = [i for i, x in enumerate(out) if x is None and i not in hidden and self._on_nvme(keys[i])]
        if todo:
            gate = asyncio.Semaphore(4)

            async def one(i: int) -> None:
                k = keys[i]
                async with gate:
                    if self.dram.contains(k):  # an earlier key of this call (a duplicate) brought it in
                        out[i] = self._leased_if_visible(k, TierKind.DRAM, deadline, tenant, visible)
                        return
                    try:
                        st = await self._promote(k)
                    except CapacityExceeded:
                        out[i] = Leased(k, Status.NO_SPACE)
                        self.counters["get_no_space"] += 1
                        return
                if st == Status.OK and self.dram.contains(k):
                    out[i] = self._leased_if_visible(k, TierKind.NVME, deadline, tenant, visible)
                elif st == Status.OK:  # promoted by a concurrent call, evicted again before we ran
                    out[i] = Leased(k, Status.NO_SPACE)
                else:  # corrupt, or deleted while it was being read
                    out[i] = Leased(k, st)
                    self.counters["get_misses_corrupt" if st == Status.CORRUPT else "get_misses"] += 1

            # every promotion runs to its end before a failure propagates, so none leases
            # a block after we gave back what this call holds
            try:
                done = await asyncio.gather(*(one(i) for i in todo), return_exceptions=True)
                failed = next((e for e in done if isinstance(e, BaseException)), None)
                if failed is not None:
                    raise failed
            except BaseException:
                self.release([x.lease_id for x in out if x is not None and x.status == Status.OK])
                raise
        result: list[Leased] = []
        hits: list[tuple[str, BlockMeta]] = []
        misses: list[tuple[str, int]] = []
        for i, x in enumerate(out):
            if x is None:
                x = Leased(keys[i], Status.MISS)
                self.counters["get_misses"] += 1
            result.append(x)
            if x.status == Status.OK:
                hits.append((TIER_LABEL[x.tier], x.meta))  # type: ignore[index,arg-type]
            elif x.status in (Status.MISS, Status.CORRUPT):
                misses.append(self._reason(x.key))  # NO_SPACE is neither: the SDK retries it
        self.ledger.record("get", hits, misses, request=request)
        return result

    def _leased_if_visible(self, key: ChunkKey, tier: TierKind, deadline: float, tenant: str | None,
                           visible: Visible | None) -> Leased | None:
        """After an await: the key may hold another namespace's block by now (deleted, then
        written again by someone else), which the caller must not get."""
        meta = self.dram.meta(key)
        if visible is not None and meta is not None and not visible(meta.namespace):
            return None  # a miss
        return self._lease(key, tier, deadline, tenant)

    def _lease(self, key: ChunkKey, tier: TierKind, deadline: float, tenant: str | None = None) -> Leased:
        ext = self.dram.extents(key)
        meta = self.dram.meta(key)
        assert ext is not None and meta is not None
        lid = next(self._ids)
        self._leases[lid] = _Lease(key, ext[0].offset, deadline, tenant)
        self._refs[ext[0].offset] += 1
        self.dram.touch(key)
        self.counters["get_hits_nvme" if tier == TierKind.NVME else "get_hits_dram"] += 1
        self.counters["get_bytes"] += meta.payload_len
        return Leased(key, Status.OK, lid, tuple(ext), meta, tier)

    def release(self, ids: Sequence[int]) -> list[bool]:
        out: list[bool] = []
        for lid in ids:
            lease = self._leases.pop(lid, None)
            if lease is None:
                out.append(False)
                continue
            self._drop_ref(lease.alloc)
            out.append(True)
        return out

    def _drop_ref(self, alloc: int) -> None:
        self._refs[alloc] -= 1
        if self._refs[alloc] <= 0:
            del self._refs[alloc]
            extents = self._detached.pop(alloc, None)
            if extents is not None:
                self.dram.free(extents)

    async def _promote(self, key: ChunkKey) -> Status:
        """Bring ``key`` from NVMe into DRAM (once, however many calls ask): ``OK`` if it is
        in DRAM now, ``CORRUPT``, or ``MISS`` (gone meanwhile)."""
        while (fut := self._promoting.get(key)) is not None:
            st = await asyncio.shield(fut)
            if st is not None:
                return st
        fut = asyncio.get_running_loop().create_future()
        self._promoting[key] = fut
        try:
            st = await self._promote_once(key)
        except asyncio.CancelledError:
            fut.set_result(None)  # the leader's call was cancelled, not the waiters': they try again
            raise
        except BaseException as e:
            fut.set_exception(e)
            fut.exception()  # mark retrieved: concurrent waiters get it via shield
            raise
        finally:
            del self._promoting[key]
        fut.set_result(st)
        return st

    async def _promote_once(self, key: ChunkKey) -> Status:
        assert self.nvme is not None
        meta = self.nvme.meta(key) if key not in self._doomed else None
        if meta is None:
            return Status.MISS
        extents = await self._allocate(meta.payload_len)
        try:
            res = await self._io(self._nvme_read_to_arena, key, extents)
        except BaseException:
            self.dram.abort(extents)
            raise
        # deleted while we read it (deletes leave NVMe at once): it must not come back
        gone = not self._on_nvme(key)
        if not res.hit or gone or self.dram.contains(key):
            self.dram.abort(extents)
            if res.miss == MissReason.CORRUPT:
                self.counters["corrupt_blocks"] += 1
                if self.where(key) is None:
                    self._forget(key, CORRUPT, meta)
                return Status.CORRUPT
            return Status.OK if self.dram.contains(key) else Status.MISS
        self.dram.commit(res.meta, extents)
        self.counters["promotions"] += 1
        self.counters["promoted_bytes"] += res.meta.payload_len
        return Status.OK

    def _nvme_read_to_arena(self, key: ChunkKey, extents: list[Extent]) -> Any:
        """Executor thread: read an NVMe block straight into its new arena extents."""
        assert self.nvme is not None
        meta = self.nvme.meta(key)
        n = meta.payload_len if meta else 0
        if len(extents) == 1:
            return self.nvme.read_into(key, self.dram.arena.buf[extents[0].offset : extents[0].offset + max(n, 1)])
        tmp = bytearray(n)
        res = self.nvme.read_into(key, tmp)
        if res.hit:
            self.dram.arena.write(extents, memoryview(tmp)[: res.meta.payload_len])
        return res

    def _checksum_extents(self, extents: Sequence[Extent], nbytes: int) -> int:
        views = self.dram.arena.views(extents, nbytes)
        if len(views) == 1:
            return checksum(views[0])
        import xxhash

        h = xxhash.xxh3_64()
        for v in views:
            h.update(v)
        return h.intdigest()

    # -- space ----------------------------------------------------------------------
    async def _allocate(self, nbytes: int) -> list[Extent]:
        extents = self.dram.reserve(nbytes)  # raises CapacityExceeded if it can never fit
        while extents is None:
            await self._evict_dram(nbytes)
            extents = self.dram.reserve(nbytes)
        return extents

    async def _evict_dram(self, nbytes: int) -> None:
        need = self.dram.allocator.rounded(nbytes) - self.dram.allocator.free_bytes
        batch: list[ChunkKey] = []
        freed = 0
        for key in self.dram.victims(self.can_evict):
            batch.append(key)
            ext = self.dram.extents(key) or []
            freed += sum(e.length for e in ext)
            if freed >= need:
                break
        if not batch:
            # another round is demoting, or write-through persists hold blocks for a moment:
            # let them finish, then retry (those blocks are not pinned or leased)
            if self._busy or self._background:
                await asyncio.sleep(0.001)
                return
            raise CapacityExceeded(
                f"DRAM tier is full of pinned, leased or reserved blocks ({self.dram.used_bytes} of "
                f"{self.dram.capacity_bytes} bytes); release leases, unpin, or raise --dram"
            )
        self._busy.update(batch)
        try:
            if self.nvme is not None:
                await self._persist(batch)
        finally:
            self._busy.difference_update(batch)
        for key in batch:
            if self.dram.contains(key) and self.can_evict(key):
                meta = self.dram.meta(key)
                self.dram.delete(key)
                self.counters["dram_evictions"] += 1
                if self.nvme is None or not self.nvme.contains(key):  # it left the node
                    self._forget(key, CORRUPT if key in self._corrupt_demoted else EVICTED, meta)
                self._corrupt_demoted.discard(key)

    async def _persist(self, keys: Sequence[ChunkKey]) -> None:
        """Write DRAM blocks that NVMe lacks to NVMe (one group commit)."""
        assert self.nvme is not None
        items: list[tuple[BlockMeta, memoryview]] = []
        for k in keys:
            meta = self.dram.meta(k)
            if meta is None or self.nvme.contains(k):
                continue
            if not self.nvme.admit(k, meta.payload_len):
                self.counters["nvme_rejected"] += 1
                continue
            ext = self.dram.extents(k) or []
            views = self.dram.arena.views(ext, meta.payload_len)
            items.append((meta, views[0] if len(views) == 1 else memoryview(b"".join(views))))
        if not items:
            return
        allocs = [self._alloc_id(m.key) for m, _ in items]
        for a in allocs:  # internal leases: the bytes must stay put while the executor reads them
            if a is not None:
                self._refs[a] += 1
        for m, _ in items:
            self._persisting[m.key] += 1
        try:
            written = await self._io(self._write_nvme, items)
        finally:
            for a in allocs:
                if a is not None:
                    self._drop_ref(a)
            for m, _ in items:
                k = m.key
                self._persisting[k] -= 1
                if k in self._doomed:  # deleted while we wrote it: the copy must not outlive the delete
                    self.nvme.delete(k)
                if self._persisting[k] <= 0:
                    del self._persisting[k]
                    self._doomed.discard(k)
        self.counters["demotions"] += written
        self.counters["demoted_bytes"] += sum(m.payload_len for m, _ in items[:written])

    def _write_nvme(self, items: list[tuple[BlockMeta, memoryview]]) -> int:
        """Executor thread: verify, make room on NVMe, group-commit.  Returns blocks written."""
        assert self.nvme is not None
        good = []
        for meta, view in items:
            if self.verify_demotions and checksum(view) != meta.payload_checksum:
                self.counters["corrupt_demotions"] += 1
                if len(self._corrupt_demoted) < 4096:
                    self._corrupt_demoted.add(meta.key)
                log.warning("not demoting %s: payload does not match its checksum", meta.key.hex())
                continue
            good.append((meta, view))
        protect = {m.key for m, _ in good}
        written = 0
        for i in range(0, len(good), 16):
            part = good[i : i + 16]
            if self._nvme_room(part, protect):
                try:
                    self.nvme.write_many(part)
                    written += len(part)
                    continue
                except (CapacityExceeded, OSError):
                    pass  # fragmented (or a failing disk): fall back to one block at a time
            for item in part:
                try:
                    if self._nvme_room([item], protect):
                        self.nvme.write_many([item])
                        written += 1
                        continue
                except (CapacityExceeded, OSError) as e:
                    # a cache fails open: the block is not demoted (counted), and the put or
                    # get that needed its DRAM space does not fail with the disk's error
                    log.warning("NVMe tier refused %s: %s", item[0].key.hex(), e)
                self.counters["nvme_write_failures"] += 1
        return written

    def _nvme_room(self, part: list[tuple[BlockMeta, memoryview]], protect: set[ChunkKey]) -> bool:
        """Evict NVMe victims until ``part`` should fit; False if nothing more can go."""
        assert self.nvme is not None
        from tiers.nvme import record_bytes

        need = sum(record_bytes(m.payload_len) for m, _ in part)
        biggest = max(m.payload_len for m, _ in part)
        while self.nvme.capacity_bytes - self.nvme.used_bytes < need or not self.nvme.fits(biggest):
            # never the block being promoted (it would vanish while we make room for it)
            victim = next(self.nvme.victims(lambda k: k not in protect and k not in self._promoting and not self.pinned(k)), None)
            if victim is None:
                return False
            vmeta = self.nvme.meta(victim)
            self.nvme.delete(victim)
            self.counters["nvme_evictions"] += 1
            if not self.dram.contains(victim):  # read racily from this thread: at worst a stale reason
                self._departed.append((victim, EVICTED, vmeta.namespace if vmeta is not None else None))
        return True

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- deletes, pins, invalidation --------------------------------------------------
    async def delete(self, keys: Sequence[ChunkKey], *, may: Visible | None = None) -> int:
        """Remove ``keys`` from every tier.  Each key goes from DRAM and NVMe in one step on
        the loop (an NVMe delete touches memory only), so no promotion can bring it back in
        between; a copy being written to NVMe right now goes when its write ends.  A key whose
        block's namespace fails ``may`` is left alone (checked at its turn: the loop yields
        between slices of a big batch)."""
        n = 0
        for j, k in enumerate(keys):
            if j and not j % 1024:
                await asyncio.sleep(0)  # a whole namespace: let other calls run in between
            hit = False
            _, meta = self._locate(k)
            if may is not None and meta is not None and not may(meta.namespace):
                continue
            alloc = self._alloc_id(k)
            if alloc is not None:
                if self._refs[alloc]:
                    self._detached[alloc] = self.dram.detach(k) or []
                else:
                    self.dram.delete(k)
                hit = True
            if self.nvme is not None:
                if self.nvme.delete(k) and k not in self._doomed:  # a doomed key was deleted already
                    hit = True
                if self._persisting[k]:
                    self._doomed.add(k)
            self._pins.pop(k, None)
            n += hit
            if hit:
                self._forget(k, INVALIDATED, meta)
        self.counters["deletes"] += n
        return n

    async def invalidate(self, namespace: bytes) -> int:
        keys = [k for k in self.dram.keys() if (m := self.dram.meta(k)) is not None and m.namespace == namespace]
        if self.nvme is not None:
            nv = await self._io(lambda: [k for k in self.nvme.keys() if (m := self.nvme.meta(k)) is not None and m.namespace == namespace])
            seen = set(keys)  # once: a set per key made this quadratic (minutes for a big namespace)
            keys.extend(k for k in nv if k not in seen)
        # checked again at each key's turn: while the NVMe scan ran (or between slices of the
        # delete) a key may have come to hold another namespace's block, which must stay
        n = await self.delete(keys, may=lambda ns: ns == namespace)
        self.counters["invalidated_blocks"] += n
        return n

    def pin(self, keys: Sequence[ChunkKey], ttl: float) -> int:
        if not ttl > 0:  # NaN too: it would never expire, yet never pin
            raise InvalidArgument(f"pin ttl must be positive, got {ttl}")
        until = self.clock() + ttl
        n = 0
        for k in keys:
            if self.where(k) is not None:
                self._pins[k] = max(until, self._pins.get(k, 0.0))
                n += 1
        return n

    def unpin(self, keys: Sequence[ChunkKey]) -> int:
        return sum(self._pins.pop(k, None) is not None for k in keys)

    # -- deadlines --------------------------------------------------------------------
    def reap(self, now: float | None = None) -> dict[str, int]:
        """Reclaim expired reservations and leases and forget expired pins."""
        now = self.clock() if now is None else now
        expired_r = [rid for rid, r in self._reservations.items() if r.deadline <= now]
        self.abort(expired_r)
        expired_l = [lid for lid, lease in self._leases.items() if lease.deadline <= now]
        for lid in expired_l:
            lease = self._leases.pop(lid)
            self._drop_ref(lease.alloc)
            self._expired[lid] = None
        while len(self._expired) > _EXPIRED_MEMORY:
            self._expired.popitem(last=False)
        for k in [k for k, until in self._pins.items() if until <= now]:
            del self._pins[k]
        self.counters["reservations_reclaimed"] += len(expired_r)
        self.counters["leases_expired"] += len(expired_l)
        return {"reservations": len(expired_r), "leases": len(expired_l)}

    async def run_reaper(self, interval: float = 1.0) -> None:
        while True:
            await asyncio.sleep(interval)
            self.reap()

    # -- lifecycle --------------------------------------------------------------------
    async def flush(self, deadline_s: float = 30.0) -> int:
        """Demote every dirty DRAM block to NVMe (graceful shutdown), within a time budget."""
        if self.nvme is None:
            return 0
        if self._background:
            await asyncio.wait(self._background, timeout=deadline_s)
        dirty = [k for k in self.dram.keys() if not self.nvme.contains(k)]
        before = self.counters["demotions"]
        try:
            await asyncio.wait_for(self._persist(dirty), timeout=deadline_s)
        except asyncio.TimeoutError:
            log.warning("flush did not finish within %.0f s", deadline_s)
        return self.counters["demotions"] - before

    def stats(self) -> dict[str, Any]:
        tiers = {
            "dram": {
                "capacity_bytes": self.dram.capacity_bytes,
                "used_bytes": self.dram.used_bytes,
                "blocks": len(self.dram),
            }
        }
        if self.nvme is not None:
            tiers["nvme"] = {
                "capacity_bytes": self.nvme.capacity_bytes,
                "used_bytes": self.nvme.used_bytes,
                "blocks": len(self.nvme),
                "corrupt_blocks": getattr(self.nvme, "corrupt_blocks", 0),
            }
        return {
            "tiers": tiers,
            "reservations": len(self._reservations),
            "leases": len(self._leases),
            "pins": len(self._pins),
            "counters": dict(self.counters),
        }

    def close(self) -> None:
        if self._own_executor:
            self._executor.shutdown(wait=True)
        if self.nvme is not None:
            self.nvme.close()
        self.dram.close()

"""The tier manager: one event loop's view of every block on this node, and its public API.

Owner: the node's asyncio loop.  Every method that touches the index, the DRAM tier,
reservations, leases or pins runs on that loop, so none of it needs a lock.  Disk I/O
(NVMe reads and writes, checksums over big payloads) runs in ``executor`` threads
and reports back by ``await``; the NVMe tier is thread-safe for exactly that.

This module is the facade: it decides what each call does and keeps the accounting.  The
state it delegates lives in two parts, each with its own invariants:

* ``kvstore/node/holds.py`` (``self.holds``): the reservation, lease and pin tables with their
  deadlines, and the reference counts that keep leased DRAM allocations in place;
* ``kvstore/node/movers.py`` (``self.movers``): moving blocks between tiers (DRAM space by
  eviction, demotion DRAM → NVMe, promotion NVMe → DRAM) and the blocks in flight.

The per-key answers (``Status``, ``Reserved``, ``Leased``) are in ``kvstore/node/outcomes.py``
and re-exported here.  What the manager adds on top of the tiers:

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
  ones are dropped.  ``write_through`` persists every commit before it answers instead.
* **Pins** with a TTL keep blocks resident; no pin outlives ``max_pin_ttl`` (a longer TTL,
  ``inf`` included, is cut to it, for every caller).
* **Tenant limits** (``tenant_limits``): reserved, leased and pinned blocks are what
  eviction cannot reclaim, so one tenant holding them could deny DRAM to all others.  A
  tenant's reservations may hold at most ``max_reserved_bytes`` (a block over it
  answers ``NO_SPACE``; a batch where that left nothing reserved raises ``CapacityExceeded``
  naming the limit) and its pins at most ``max_pinned_bytes`` (a pin over it is refused
  whole, ``CapacityExceeded``).  Both count DRAM as allocated, in whole units (a 0-byte
  block costs 64 KiB), never payload bytes.  The sums are kept in ``self.holds`` as holds
  come and go; leases are bounded by ``lease_ttl`` alone.  The admin (tenant None) has no
  such limits.
* **Capacity quotas** (``kvstore/node/quotas.py``): ``max_dram_bytes`` / ``max_nvme_bytes`` cap
  what a tenant's blocks occupy per tier; over its cap a tenant's own blocks are evicted
  first, and eviction for anyone takes blocks of tenants within their caps last.  A block
  belongs to the owner of its namespace (``owner_of``; by default, the tenant that reserved
  in that namespace first on this node).
* **Tenants** (``kvstore/node/tenants.py``; the service decides who sees what): lookups,
  ``acquire`` and ``reserve``'s deduplication take a ``visible(namespace)`` predicate, and a
  block the caller may not see is absent to it; reservations and leases carry the tenant
  that made them.  Under one key there is only ever one namespace's block: a commit that
  would replace another namespace's block is dropped (and reported ``OK``, as if stored).
* **Session hints** (``kvstore/node/sessions.py``, ``sessions``): lookups, reads and puts may name
  the caller's session; ``close_session`` marks the blocks only closed sessions used as
  the first victims of both tiers (their policies are wrapped in ``SessionHinted`` by
  whoever builds the tiers: ``server.py``, the simulator); ``reap`` closes idle sessions.
* **Cache-hit accounting** (``kvstore/node/ledger.py``): every lookup key is counted as a hit
  (per tier, with its tokens) or a miss with its reason; ``history`` remembers, in
  bounded memory, why keys left (evicted, invalidated, corrupt).  Executor threads report
  departures through ``_departed``, which the loop drains before it reads ``history``.
* **Read-back accounting** (``kvstore/node/readback.py``, ``readback``): blocks and bytes
  stored, and how many of them an ``acquire`` read back at least once, per namespace and
  prompt-position bucket (what the connector's admission by evidence learns from).

Invariants: a block's DRAM allocation is freed only when no lease refers to it; a
reserved extent belongs to exactly one reservation until commit, abort or reap; tier
capacities are never exceeded (the allocators cannot over-allocate).
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

from kvstore.block import BlockMeta, checksum
from kvstore.errors import CapacityExceeded, InvalidArgument
from kvstore.keys import ChunkKey
from kvstore.node.holds import Holds, TenantLimits, allocation
from kvstore.node.ledger import CORRUPT, INVALIDATED, NEVER_STORED, TIER_LABEL, KeyHistory, Ledger
from kvstore.node.movers import TierMovers
from kvstore.node.outcomes import Leased, Reserved, Status
from kvstore.node.quotas import Occupancy, OwnerOf, QuotaNVMe, TenantQuotas, caps_of
from kvstore.node.readback import ReadBack
from kvstore.node.sessions import Sessions
from kvstore.wire import with_checksum
from tiers.allocator import Extent
from tiers.base import LowerTier, TierKind
from tiers.dram import DRAMTier

__all__ = ["BytePath", "Direction", "Leased", "Reserved", "Status", "TierManager", "Visible"]

Visible = Callable[[bytes], bool]
"""Whether the caller may see (or change) blocks of a namespace fingerprint."""

BytePath = Literal["local", "tcp", "grpc_stream"]
"""How payload bytes move: the shared-memory arena, the TCP data channel, a gRPC stream."""
Direction = Literal["in", "out"]
DropReason = Literal["epoch", "owner_change"]
_DROP_COUNTER: dict[DropReason, str] = {
    "epoch": "epoch_reclaimed_blocks",
    "owner_change": "owner_change_dropped_blocks",
}


class TierManager:
    def __init__(
        self,
        dram: DRAMTier,
        nvme: LowerTier | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        write_through: bool = False,
        reservation_ttl: float = 30.0,
        lease_ttl: float = 30.0,
        executor: ThreadPoolExecutor | None = None,
        verify_demotions: bool = True,
        tenant_limits: Mapping[str, TenantLimits] | None = None,
        max_pin_ttl: float = 3600.0,
        owner_of: OwnerOf | None = None,
        sessions: Sessions | None = None,
        clean_ahead: float = 0.0,
    ) -> None:
        """``clean_ahead``: the share of DRAM at the eviction end kept free or also on NVMe
        by a background writer (``TierMovers.kick_cleaner``), so a put that needs room
        rarely waits on the disk; 0 (or no NVMe, or write-through) turns it off."""
        self.dram = dram
        self.sessions = sessions
        self.clock = clock
        self.write_through = write_through
        self.reservation_ttl = reservation_ttl
        self.lease_ttl = lease_ttl
        self.max_pin_ttl = max_pin_ttl
        self._executor = executor or ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvstore-io")
        self._own_executor = executor is None
        self.counters: collections.Counter[str] = collections.Counter()
        # cache-hit accounting (kvstore/node/ledger.py): why keys left, what lookups found
        self.history = KeyHistory()
        self.ledger = Ledger()
        self.readback = ReadBack()  # what share of what is stored is read back (kvstore/node/readback.py)
        self._departed: collections.deque[tuple[ChunkKey, str, bytes | None]] = (
            collections.deque()
        )  # from executor threads
        self.holds = Holds(clock, dram.free, tenant_limits)
        # namespace -> the tenant that first reserved in it (the service lets only its owner write
        # there): whose a block is, for the capacity quotas, when no ownership table is given
        self._writers: dict[bytes, str] = {}
        owner_of = owner_of or self._writers.get
        dram_caps, nvme_caps = (
            caps_of(self.holds.limits, "max_dram_bytes"),
            caps_of(self.holds.limits, "max_nvme_bytes"),
        )
        capped = bool(dram_caps or nvme_caps)  # occupancy is followed per tenant only where a quota needs it
        if nvme is not None and capped:
            nvme = QuotaNVMe(
                nvme,
                Occupancy(nvme_caps, owner_of),
                meta_of=dram.meta,
                evictable=lambda k: not self.holds.pinned(k),
                counters=self.counters,
                departed=self._departed,
            )
        self.nvme = nvme
        self.movers = TierMovers(
            dram,
            nvme,
            self.holds,
            executor=self._executor,
            counters=self.counters,
            forget=self._forget,
            departed=self._departed,
            verify_demotions=verify_demotions,
        )
        if nvme is not None and not write_through and clean_ahead > 0:
            self.movers.clean_ahead_bytes = int(dram.capacity_bytes * clean_ahead)
        self.quotas = (
            TenantQuotas(
                Occupancy(dram_caps, owner_of),
                dram,
                movers=self.movers,
                reserved=self.holds.reserved_bytes,
                counters=self.counters,
                forget=self._forget,
            )
            if capped
            else None
        )

    @property
    def verify_demotions(self) -> bool:
        """Whether dirty blocks are checksummed before they are demoted (a bad one is dropped)."""
        return self.movers.verify_demotions

    @verify_demotions.setter
    def verify_demotions(self, value: bool) -> None:
        self.movers.verify_demotions = value

    # -- where blocks are -----------------------------------------------------------
    def pinned(self, key: ChunkKey) -> bool:
        return self.holds.pinned(key)

    def can_evict(self, key: ChunkKey) -> bool:
        return self.movers.can_evict(key)

    def where(self, key: ChunkKey) -> TierKind | None:
        if self.dram.contains(key):
            return TierKind.DRAM
        if self.movers.on_nvme(key):
            return TierKind.NVME
        return None

    def _locate(self, key: ChunkKey) -> tuple[TierKind | None, BlockMeta | None]:
        meta = self.dram.meta(key)
        if meta is not None:
            return TierKind.DRAM, meta
        meta = self.movers.nvme_meta(key)
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
        return self.holds.reservation_tenant(rid)

    def lease_tenant(self, lid: int) -> str | None:
        return self.holds.lease_tenant(lid)

    # -- why keys left (kvstore/node/ledger.py) ------------------------------------------------
    def _forget(self, key: ChunkKey, reason: str, meta: BlockMeta | None) -> None:
        """Remember that ``key`` left this node for ``reason`` (loop only)."""
        self._drain_departed()
        self.history.record(key, reason, self.ledger.tag(meta))
        self.readback.left(key)

    def _drain_departed(self) -> None:
        while self._departed:
            key, reason, ns = self._departed.popleft()
            self.readback.left(key)
            self.history.record(key, reason, self.ledger.namespaces.tag(ns) if ns is not None else 0)

    def _reason(self, key: ChunkKey) -> tuple[str, int]:
        """Why ``key`` is missing: ``(reason, namespace tag)``."""
        self._drain_departed()
        return self.history.lookup(key) or (NEVER_STORED, 0)

    # -- lookups --------------------------------------------------------------------
    def _used(self, tenant: str | None, session: str | None, keys: Sequence[ChunkKey]) -> None:
        """Tell the session hints that ``keys`` (found, or being written) were used."""
        if self.sessions is not None and keys:
            self.sessions.touch(tenant, session, keys)

    def close_session(self, session: str, *, tenant: str | None = None) -> int | None:
        """The caller's ``session`` will send no more requests: blocks no open session used
        become the first eviction candidates.  Their number, or None for a session the caller
        has not open (unknown, closed already, or expired).  ``PermissionDenied`` if only
        another tenant has it open."""
        if self.sessions is None:
            return None
        n = self.sessions.close(tenant, session)
        if n is None:
            self.counters["sessions_close_unknown"] += 1
        return n

    def exists(
        self,
        keys: Sequence[ChunkKey],
        *,
        visible: Visible | None = None,
        tenant: str | None = None,
        session: str | None = None,
    ) -> list[TierKind | None]:
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
        self._used(tenant, session, [k for k, t in zip(keys, out) if t is not None])
        return out

    def match_prefix(
        self,
        keys: Sequence[ChunkKey],
        *,
        visible: Visible | None = None,
        tenant: str | None = None,
        session: str | None = None,
    ) -> tuple[int, list[TierKind]]:
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
        self._used(tenant, session, keys[: len(tiers)])
        return len(tiers), tiers

    # -- two-phase writes -----------------------------------------------------------
    async def reserve(
        self,
        metas: Sequence[BlockMeta],
        *,
        tenant: str | None = None,
        visible: Visible | None = None,
        refuse_over_limit: bool = True,
        session: str | None = None,
    ) -> list[Reserved]:
        """Reserve space for each block, or answer ``EXISTS`` for a key already stored.  A key
        stored in a namespace the caller may not see (``visible``) gets space like a new one:
        its commit is dropped, so the answers never tell whether another tenant has it.  With
        ``write_through``, ``EXISTS`` for a block not yet on NVMe answers once it is (as a
        commit does), so no acknowledged put depends on a copy in DRAM alone.

        A block that would take ``tenant``'s reserved bytes over its ``max_reserved_bytes``
        answers ``NO_SPACE``; if that left the batch without any reservation, the call raises
        ``CapacityExceeded`` naming the limit instead (``refuse_over_limit``: a put stream,
        which reserves block by block, takes the ``NO_SPACE`` answers)."""
        out: list[Reserved] = []
        deadline = self.clock() + self.reservation_ttl
        over_limit: tuple[str, BlockMeta] | None = None  # the first block refused by a limit, and which
        undurable: list[ChunkKey] = []  # stored in DRAM alone: with write-through, EXISTS waits until they are on disk
        stored = [self._find(m.key, visible)[1] is not None for m in metas]
        # one allocator update for the batch where no tenant limit or quota decides block by
        # block (else, or when DRAM must be freed first: per block, evicting as needed)
        ready: list[list[Extent]] | None = None
        if self.quotas is None and self.holds.reserve_room(tenant) is None:
            ready = self.dram.reserve_many([m.payload_len for m, s in zip(metas, stored) if not s])
        taken = 0
        try:
            for meta, is_stored in zip(metas, stored):
                if is_stored:
                    self.counters["puts_deduplicated"] += 1
                    if self.write_through and self.nvme is not None and not self.nvme.contains(meta.key):
                        undurable.append(meta.key)
                    out.append(Reserved(Status.EXISTS))
                    continue
                if tenant is not None:
                    self._writers.setdefault(meta.namespace, tenant)
                limit = (
                    None
                    if ready is not None  # no limit or quota applies (checked for the batch above)
                    else "max_reserved_bytes"
                    if not self._reserve_room(tenant, meta.payload_len)
                    else "max_dram_bytes"
                    if self.quotas is not None and not await self.quotas.make_room(tenant, meta.payload_len)
                    else None
                )
                if limit is not None:
                    over_limit = over_limit or (limit, meta)
                    self.counters[
                        "reserve_tenant_limit" if limit == "max_reserved_bytes" else "reserve_tenant_quota"
                    ] += 1
                    out.append(Reserved(Status.NO_SPACE))
                    continue
                try:
                    if ready is not None:
                        extents = ready[taken]
                        taken += 1
                    else:
                        extents = await self.movers.allocate(meta.payload_len)
                except CapacityExceeded:
                    if self.dram.allocator.rounded(meta.payload_len) > self.dram.capacity_bytes:
                        raise
                    self.counters["reserve_no_space"] += 1
                    out.append(Reserved(Status.NO_SPACE))
                    continue
                rid = self.holds.reserve(meta, extents, deadline, tenant)
                out.append(Reserved(Status.OK, rid, tuple(extents)))
            if undurable:  # an earlier write-through put the disk refused, or one still being written
                await self.movers.write_through(undurable)
        except BaseException:
            self.abort([r.reservation_id for r in out if r.status == Status.OK])  # nobody will learn their ids
            if ready is not None:
                for extents in ready[taken:]:
                    self.dram.abort(extents)
            raise
        if over_limit is not None and refuse_over_limit and not any(r.status == Status.OK for r in out):
            assert tenant is not None
            raise CapacityExceeded(self._over_limit(tenant, *over_limit))
        # before the commits: a block its session holds is never dead when it lands
        if self.sessions is not None and (session is not None or self.sessions.has_dead()):
            self._used(tenant, session, [m.key for m, r in zip(metas, out) if r.status in (Status.OK, Status.EXISTS)])
        return out

    def _over_limit(self, tenant: str, name: str, meta: BlockMeta) -> str:
        """Why ``tenant`` may not reserve ``meta``'s block, naming the limit (``name``)."""
        limit = getattr(self.holds.limits[tenant], name)
        size = self.dram.allocator.rounded(meta.payload_len)
        block = f"a block of {meta.payload_len} bytes (it takes {size} bytes of DRAM: space is allocated in {self.dram.allocator.unit}-byte units)"
        if size > limit:
            why = f"{block} is larger than tenant {tenant!r}'s {name}={limit}"
        elif name == "max_reserved_bytes":
            why = (
                f"tenant {tenant!r} has {self.holds.reserved_bytes[tenant]} bytes reserved in unfinished writes and "
                f"{name}={limit}; {block} does not fit: commit or abort earlier writes first"
            )
        else:
            assert self.quotas is not None
            why = (
                f"tenant {tenant!r}'s blocks and unfinished writes take {self.quotas.occupied(tenant)} bytes of DRAM and "
                f"{name}={limit}; {block} does not fit, and its own blocks that could make room are pinned, leased or reserved"
            )
        return f"{why} (the node's [tenants.{tenant}] {name} sets the limit)"

    def _reserve_room(self, tenant: str | None, nbytes: int) -> bool:
        """Whether ``tenant`` may reserve a block of ``nbytes`` more (whole DRAM units).  Cheap
        when it may; when not, overdue reservations (the reaper's next catch) are reclaimed
        first and it asks again."""
        room = self.holds.reserve_room(tenant)
        size = self.dram.allocator.rounded(nbytes)
        if room is None or size <= room:
            return True
        overdue = self.holds.overdue_reservations(self.clock())
        self.abort(overdue)
        self.counters["reservations_reclaimed"] += len(overdue)
        room = self.holds.reserve_room(tenant)
        return room is None or size <= room

    async def commit(
        self, ids: Sequence[int], checksums: Sequence[int] | None = None, *, verify: bool = False
    ) -> list[Status]:
        """Publish reserved blocks.  ``checksums`` (if given) replace the reserved metas' ones;
        ``verify`` recomputes them over the arena first (the data channel does; local writers
        are trusted and checked again on demotion)."""
        if checksums is not None and len(checksums) != len(ids):
            raise InvalidArgument(f"{len(ids)} reservation ids but {len(checksums)} checksums")
        out: list[Status] = []
        durable: list[ChunkKey] = []
        puts = put_bytes = 0
        self._drain_departed()  # a key that left and comes again is stored again
        for i, rid in enumerate(ids):
            r = self.holds.take_reservation(rid)
            if r is None:
                out.append(Status.EXPIRED)
                continue
            meta = r.meta if checksums is None else with_checksum(r.meta, checksums[i])
            if verify:
                try:
                    actual = await self.movers.io(self._checksum_extents, r.extents, meta.payload_len)
                except BaseException:
                    # popped above, so neither the reaper nor the caller would ever free it; the
                    # rest of the batch may be held (a data-channel transfer): they go too
                    self.dram.abort(r.extents)
                    self.abort(ids[i + 1 :])
                    self.counters["puts"] += puts
                    self.counters["put_bytes"] += put_bytes
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
            old = allocation(self.dram.extents(meta.key))
            if old is not None and self.holds.leased(old):
                self.holds.detach(old, self.dram.detach(meta.key) or [])
            if stored is None:
                self.readback.stored(meta)
            self.dram.commit(meta, r.extents, policy_soon=True)  # the policy hears of it after the reply
            puts += 1
            put_bytes += meta.payload_len
            out.append(Status.OK)
            if self.write_through and self.nvme is not None:
                durable.append(meta.key)
        self.counters["puts"] += puts
        self.counters["put_bytes"] += put_bytes
        if puts:
            self.movers.kick_cleaner()
        if durable:  # write-through answers once payload and index entry are on disk (group commit)
            await self.movers.write_through(durable)
        return out

    def abort(self, ids: Sequence[int]) -> None:
        for rid in ids:
            r = self.holds.take_reservation(rid)
            if r is not None:
                self.dram.abort(r.extents)

    def reservation(self, rid: int) -> tuple[BlockMeta, list[Extent]] | None:
        r = self.holds.reservations.get(rid)
        return (r.meta, r.extents) if r else None

    def hold(self, *, reservation_ids: Sequence[int] = (), lease_ids: Sequence[int] = ()) -> bool:
        """Exempt live reservations and leases from their deadlines: a transfer now moves
        their bytes and resolves them itself (commit/abort, release) when it ends.

        Without this the reaper could free an extent while a stalled transfer still
        writes into it or sends from it, after it went to another block.  False if any of
        them had already expired (the caller must then not touch their extents).
        """
        return self.holds.hold(reservation_ids=reservation_ids, lease_ids=lease_ids)

    def held(self, some_id: int) -> bool:
        """Whether a transfer holds this reservation or lease (see ``hold``): its bytes are
        moving right now, so only that transfer may resolve it, never a Commit, Abort or
        Release call (which would free extents the transfer still reads or writes)."""
        return self.holds.held(some_id)

    # -- leased reads ---------------------------------------------------------------
    async def acquire(
        self,
        keys: Sequence[ChunkKey],
        *,
        request: bool = True,
        tenant: str | None = None,
        visible: Visible | None = None,
        session: str | None = None,
    ) -> list[Leased]:
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
        # before promotions land in DRAM: a block this session reads is alive there
        if self.sessions is not None and (session is not None or self.sessions.has_dead()):
            self._used(
                tenant, session, [k for i, k in enumerate(keys) if i not in hidden and self.where(k) is not None]
            )
        # DRAM hits, leased in one pass (the counters once per call); the policy hears of the
        # reads after the reply goes out, or before it next picks victims (DRAMTier.touch_soon)
        entry, lease, nbytes = self.dram.entry, self.holds.lease, 0
        touched: list[ChunkKey] = []
        for i, k in enumerate(keys):
            b = entry(k)
            if b is not None and i not in hidden:
                meta, ext = b
                ext_t = tuple(ext)
                lid = lease(k, ext_t[0].offset, deadline, tenant, ext_t, meta.payload_len)
                touched.append(k)
                out[i] = Leased(k, Status.OK, lid, ext_t, meta, TierKind.DRAM)
                nbytes += meta.payload_len
        self.dram.touch_soon(touched)
        self.counters["get_hits_dram"] += len(touched)
        self.counters["get_bytes"] += nbytes
        todo = [i for i, x in enumerate(out) if x is None and i not in hidden and self.movers.on_nvme(keys[i])]
        if todo:
            gate = asyncio.Semaphore(4)

            async def one(i: int) -> None:
                k = keys[i]
                async with gate:
                    if self.dram.contains(k):  # an earlier key of this call (a duplicate) brought it in
                        out[i] = self._leased_if_visible(k, TierKind.DRAM, deadline, tenant, visible)
                        return
                    if self.quotas is not None and (meta := self.movers.nvme_meta(k)) is not None:
                        # the block's owner makes room under its max_dram_bytes; if it cannot, the
                        # read is served anyway, and that owner's blocks are the next to be evicted
                        await self.quotas.make_room(self.quotas.use.owner_of(meta.namespace), meta.payload_len)
                    try:
                        st = await self.movers.promote(k)
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
        self.readback.read(meta for _, meta in hits)
        return result

    def _leased_if_visible(
        self, key: ChunkKey, tier: TierKind, deadline: float, tenant: str | None, visible: Visible | None
    ) -> Leased | None:
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
        lid = self.holds.lease(key, ext[0].offset, deadline, tenant, tuple(ext), meta.payload_len)
        self.dram.touch(key)
        self.counters["get_hits_nvme" if tier == TierKind.NVME else "get_hits_dram"] += 1
        self.counters["get_bytes"] += meta.payload_len
        return Leased(key, Status.OK, lid, tuple(ext), meta, tier)

    def release(self, ids: Sequence[int]) -> list[bool]:
        return [self.holds.release(lid) for lid in ids]

    # -- the bytes of reservations and leases (kvstore/node/transfers.py, the gRPC streams) -----
    def reserved_views(self, rid: int) -> list[memoryview] | None:
        """Writable views of a live reservation's payload space, in order; None if it is no
        longer reserved (committed, aborted or reclaimed: its space may be another block's)."""
        r = self.holds.reservations.get(rid)
        return self.dram.arena.views(r.extents, r.meta.payload_len) if r is not None else None

    def write_reserved(self, rid: int, offset: int, data: memoryview) -> bool:
        """Copy ``data`` into reservation ``rid``'s payload space from byte ``offset`` on; False,
        and nothing written, if it is no longer reserved."""
        views = self.reserved_views(rid)
        if views is None:
            return False
        if data.nbytes:
            _write_at(views, offset, data)
        return True

    def leased_views(self, lid: int) -> list[memoryview] | None:
        """Views of a live lease's block payload, in order (read them only while the lease
        lives); None if the lease is gone (released or expired)."""
        lease = self.holds.leases.get(lid)
        return self.dram.arena.views(lease.extents, lease.nbytes) if lease is not None else None

    def watch_hits(self, fn: Callable[[list[tuple[str, BlockMeta]]], None] | None) -> None:
        """Have ``fn`` see every batch of hits the ledger records (``(tier, meta)`` pairs, on
        the event loop; it must be cheap): the cluster agent's read-heat counting.  One watcher;
        None removes it."""
        self.ledger.on_hits = fn

    def moved(self, path: BytePath, direction: Direction, nbytes: int) -> None:
        """Count payload bytes that left (``out``) or entered (``in``) the node by ``path``."""
        self.counters[f"{path}_bytes_{direction}"] += nbytes

    def abort_cut(self, ids: Sequence[int]) -> None:
        """Abort the reservations of a transfer that ended before all its bytes came."""
        self.abort(ids)
        self.counters["data_channel_aborted_puts"] += len(ids)

    def reported(
        self,
        op: str,
        *,
        tier: str = "",
        miss_reason: str = "",
        blocks: int = 0,
        tokens: int = 0,
        namespace: bytes | None = None,
        short_copies: int = 0,
        namespace_name: str = "",
        skipped_saves: int = 0,
    ) -> None:
        """What a client saw beyond this node's own lookups (``ReportHits``, checked by the
        service): hits in ``tier`` (HBM, a remote node), or misses for ``miss_reason``; block
        copies it could not write; a readable name for ``namespace``; chunks a connector's
        save policy did not store."""
        if miss_reason:
            self.ledger.report_misses(op, miss_reason, blocks, namespace)
        elif blocks:
            self.ledger.report(op, tier, blocks, tokens, namespace)
        self.ledger.short_copies += short_copies
        self.ledger.skipped_saves += skipped_saves
        if namespace_name and namespace is not None:
            self.ledger.name(namespace, namespace_name)

    def _checksum_extents(self, extents: Sequence[Extent], nbytes: int) -> int:
        views = self.dram.arena.views(extents, nbytes)
        if len(views) == 1:
            return checksum(views[0])
        import xxhash

        h = xxhash.xxh3_64()
        for v in views:
            h.update(v)
        return h.intdigest()

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
            alloc = allocation(self.dram.extents(k))
            if alloc is not None:
                if self.holds.leased(alloc):
                    self.holds.detach(alloc, self.dram.detach(k) or [])
                else:
                    self.dram.delete(k)
                hit = True
            if self.nvme is not None and self.movers.delete_nvme(k):
                hit = True
            self.holds.unpin(k)
            n += hit
            if hit:
                self._forget(k, INVALIDATED, meta)
        self.counters["deletes"] += n
        return n

    async def invalidate(self, namespace: bytes) -> int:
        """Delete every block of ``namespace`` (counted in ``invalidated_blocks``); how many."""
        return await self.drop_namespaces({namespace})

    async def drop_namespaces(self, namespaces: Collection[bytes], *, why: DropReason | None = None) -> int:
        """Delete every block stored under one of ``namespaces`` (effective fingerprints); how many.

        Counted in ``invalidated_blocks``, and also by ``why``: ``epoch`` (a namespace's epoch
        was bumped: ``epoch_reclaimed_blocks``) or ``owner_change`` (the namespace changed tenant:
        ``owner_change_dropped_blocks``).  The cluster agent calls this; nothing outside the
        manager edits its counters."""
        wanted = frozenset(namespaces)
        if not wanted:
            return 0
        keys = [k for k in self.dram.keys() if (m := self.dram.meta(k)) is not None and m.namespace in wanted]
        if (nvme := self.nvme) is not None:
            nv = await self.movers.io(
                lambda: [k for k in nvme.keys() if (m := nvme.meta(k)) is not None and m.namespace in wanted]
            )
            seen = set(keys)  # once: a set per key made this quadratic (minutes for a big namespace)
            keys.extend(k for k in nv if k not in seen)
        # checked again at each key's turn: while the NVMe scan ran (or between slices of the
        # delete) a key may have come to hold another namespace's block, which must stay
        n = await self.delete(keys, may=lambda ns: ns in wanted) if keys else 0
        self.counters["invalidated_blocks"] += n
        if why is not None:
            self.counters[_DROP_COUNTER[why]] += n
        return n

    def pin(self, keys: Sequence[ChunkKey], ttl: float, *, tenant: str | None = None) -> int:
        """Pin the stored ``keys`` for ``ttl`` seconds (cut to ``max_pin_ttl``), charged to
        ``tenant``.  All or nothing against its ``max_pinned_bytes``: a batch whose new pins
        would take it over is refused whole (``CapacityExceeded``); pins it holds already
        cost nothing more, and get the new deadline if later."""
        if not ttl > 0:  # NaN too: it would never expire, yet never pin
            raise InvalidArgument(f"pin ttl must be positive, got {ttl}")
        if ttl > self.max_pin_ttl:
            self.counters["pins_ttl_capped"] += 1
            ttl = self.max_pin_ttl
        now = self.clock()
        stored = {k: meta for k in keys if (meta := self._locate(k)[1]) is not None}
        room = self.holds.pin_room(tenant)
        if room is not None:
            charge = sum(
                self.holds.pin_charge(k, tenant, self.dram.allocator.rounded(m.payload_len)) for k, m in stored.items()
            )
            if charge > room:
                self.holds.expire_pins(now)  # ended pins not reaped yet still count until this
                room = self.holds.pin_room(tenant)
                assert room is not None
                if charge > room:
                    limit = self.holds.limits[tenant].max_pinned_bytes  # type: ignore[index]
                    self.counters["pin_tenant_limit"] += 1
                    raise CapacityExceeded(
                        f"tenant {tenant!r} has {self.holds.pinned_bytes[tenant]} bytes pinned and max_pinned_bytes={limit}; "  # type: ignore[index]
                        f"pinning {len(stored)} more block(s) ({charge} bytes) would exceed it, so none was pinned: unpin "
                        f"some first (the node's [tenants.{tenant}] max_pinned_bytes sets the limit)"
                    )
        until = now + ttl
        for k, m in stored.items():
            self.holds.pin(k, until, tenant, self.dram.allocator.rounded(m.payload_len))
        return sum(1 for k in keys if k in stored)

    def unpin(self, keys: Sequence[ChunkKey]) -> int:
        return sum(self.holds.unpin(k) for k in keys)

    # -- deadlines --------------------------------------------------------------------
    def reap(self, now: float | None = None) -> dict[str, int]:
        """Reclaim expired reservations and leases and forget expired pins."""
        now = self.clock() if now is None else now
        expired_r = self.holds.overdue_reservations(now)
        self.abort(expired_r)
        expired_l = self.holds.expire(now)
        self.counters["reservations_reclaimed"] += len(expired_r)
        self.counters["leases_expired"] += expired_l
        if self.sessions is not None:
            self.sessions.expire(now)
        return {"reservations": len(expired_r), "leases": expired_l}

    async def run_reaper(self, interval: float = 1.0) -> None:
        while True:
            await asyncio.sleep(interval)
            self.reap()

    # -- lifecycle --------------------------------------------------------------------
    async def flush(self, deadline_s: float = 30.0) -> int:
        """Demote every dirty DRAM block to NVMe (graceful shutdown), within a time budget."""
        return await self.movers.flush(deadline_s)

    def stats(self) -> dict[str, Any]:
        self._drain_departed()
        tiers: dict[str, dict[str, Any]] = {
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
                "corrupt_blocks": self.nvme.corrupt_blocks,
                "recovery": self.nvme.recovery(),
            }
        return {
            "tiers": tiers,
            "reservations": len(self.holds.reservations),
            "leases": len(self.holds.leases),
            "pins": len(self.holds.pins),
            "sessions": self.sessions.stats() if self.sessions is not None else {},
            # per tenant: what its reservations and pins hold now (what eviction cannot reclaim)
            "tenant_holds": {
                t: {"reserved_bytes": self.holds.reserved_bytes[t], "pinned_bytes": self.holds.pinned_bytes[t]}
                for t in sorted(set(self.holds.limits) | set(self.holds.reserved_bytes) | set(self.holds.pinned_bytes))
            },
            # per tenant with a capacity quota configured anywhere: the bytes its blocks occupy per tier
            "tenant_occupancy": {
                t: {
                    "dram_bytes": self.quotas.use.used[t],
                    "nvme_bytes": self.nvme.use.used[t] if isinstance(self.nvme, QuotaNVMe) else 0,
                }
                for t in sorted(self.holds.limits)
            }
            if self.quotas is not None
            else {},
            "counters": {
                **self.counters,
                **(self.sessions.counters if self.sessions is not None else {}),
                **self.readback.totals(),
            },
            "read_back": self.readback.rows(),
        }

    def close(self) -> None:
        if self._own_executor:
            self._executor.shutdown(wait=True)
        if self.nvme is not None:
            self.nvme.close()
        self.dram.close()


def _write_at(views: list[memoryview], offset: int, data: memoryview) -> None:
    """Copy ``data`` into the concatenation of ``views`` starting at byte ``offset``."""
    pos = 0
    for v in views:
        if offset >= v.nbytes:
            offset -= v.nbytes
            continue
        n = min(v.nbytes - offset, data.nbytes - pos)
        v[offset : offset + n] = data[pos : pos + n]
        pos += n
        offset = 0
        if pos >= data.nbytes:
            return

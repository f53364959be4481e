"""Reservations, leases and pins: every claim on DRAM space or on a block, with its deadline.

Owner: the tier manager's event loop (``TierManager.holds``).  Plain data structures:
no I/O, no awaits, no locks.  Deadlines are absolute times on the manager's clock; the
manager decides when they have passed (``reap``), so a fake clock drives them in tests.
The movers (``kvstore/node/movers.py``) take internal references here while an executor
thread reads a block's bytes, and read ``pinned`` from that thread (a racy read of one
dict entry: at worst a pin that just ended still protects its block from NVMe eviction).

State:

* ``reservations``: id → the block being written, its arena extents, deadline, tenant;
* ``leases``: id → the leased key, its DRAM allocation, deadline, tenant;
* ``refs``: DRAM allocation (its first extent's offset, see :func:`allocation`) → live
  references: one per lease, plus one per demotion reading it;
* ``detached``: allocations whose block was deleted or replaced while referenced; their
  extents are freed (through ``free``) when the last reference goes;
* ``pins``: key → :class:`Pin` (pinned until, the tenant charged, the bytes charged);
* ``reserved_bytes``, ``pinned_bytes``: tenant → the DRAM bytes its live reservations
  and pins hold, in allocation units (a 0-byte block holds a whole unit: what is charged
  is what is allocated, never what was asked for; admin holds, tenant None, are not
  counted); ``limits`` say how far each tenant may go (``kvstore/node/manager.py`` checks them
  before it reserves or pins).

Invariants: ``refs[a]`` is the number of leases on ``a`` plus internal references, and
never zero or negative (the entry goes at zero); a detached allocation is freed exactly
once, when its last reference is dropped, never while one remains; an id names at most
one reservation or lease, ids never repeat within a process, and they start at a random
point so a late call meant for an earlier process hits nothing; a held reservation or
lease (``hold``: a transfer is moving its bytes) has an infinite deadline and expires
only at ``reap(now=inf)``, the shutdown sweep; ``reserved_bytes[t]`` is the sum of the
lengths of the extents of ``t``'s reservations and ``pinned_bytes[t]`` the sum of the ``nbytes``
its pins were charged (an entry goes at zero).  Every reservation and pin enters and leaves
through the methods here, so the sums move with them and nothing ever rescans.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import secrets
from collections.abc import Callable, Mapping, Sequence

from kvstore.block import BlockMeta
from kvstore.keys import ChunkKey
from tiers.allocator import Extent

_EXPIRED_MEMORY = 65536  # how many expired lease ids we remember, to answer release() honestly


def allocation(extents: Sequence[Extent] | None) -> int | None:
    """The id of a DRAM allocation: its first extent's offset (None for no block)."""
    return extents[0].offset if extents else None


@dataclasses.dataclass(slots=True)
class Reservation:
    meta: BlockMeta
    extents: list[Extent]
    deadline: float
    tenant: str | None = None  # who made it (None: the admin, or a node without tenants)


@dataclasses.dataclass(slots=True)
class Pin:
    until: float
    tenant: str | None  # charged with it: whoever last pinned the key (None: the admin, uncharged)
    nbytes: int  # what it was charged: the DRAM the block takes (whole units) when it was pinned


@dataclasses.dataclass(frozen=True, slots=True)
class TenantLimits:
    """How much one tenant may hold beyond eviction's reach, and how much its blocks may
    occupy per tier (``kvstore/node/quotas.py``); all in allocated bytes (None: only the node's size)."""

    max_reserved_bytes: int | None = None
    max_pinned_bytes: int | None = None
    max_dram_bytes: int | None = None
    max_nvme_bytes: int | None = None


@dataclasses.dataclass(slots=True)
class Lease:
    key: ChunkKey
    alloc: int  # first extent offset: identifies the allocation
    deadline: float
    tenant: str | None = None
    extents: tuple[Extent, ...] = ()  # the leased block's payload, in place while the lease lives
    nbytes: int = 0  # its payload length


class Holds:
    def __init__(
        self,
        clock: Callable[[], float],
        free: Callable[[list[Extent]], None],
        limits: Mapping[str, TenantLimits] | None = None,
    ) -> None:
        self.clock = clock
        self.limits: dict[str, TenantLimits] = dict(limits or {})
        self._free = free  # gives a detached allocation's extents back to the DRAM tier
        # ids start at a random point so a late Release/Abort meant for an earlier node
        # process on the same socket cannot hit another client's lease or reservation
        self._ids = itertools.count(secrets.randbits(48) + 1)
        self.reservations: dict[int, Reservation] = {}
        self.leases: dict[int, Lease] = {}
        self.expired: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.refs: collections.Counter[int] = collections.Counter()  # allocation -> live references
        self.detached: dict[int, list[Extent]] = {}  # deleted while referenced; freed on the last drop
        self.pins: dict[ChunkKey, Pin] = {}
        self.reserved_bytes: collections.Counter[str] = collections.Counter()  # tenant -> bytes of its reservations
        self.pinned_bytes: collections.Counter[str] = collections.Counter()  # tenant -> bytes charged for its pins

    # -- reservations -----------------------------------------------------------------
    def reserve(self, meta: BlockMeta, extents: list[Extent], deadline: float, tenant: str | None) -> int:
        rid = next(self._ids)
        self.reservations[rid] = Reservation(meta, extents, deadline, tenant)
        if tenant is not None:
            self.reserved_bytes[tenant] += _allocated(extents)
        return rid

    def take_reservation(self, rid: int) -> Reservation | None:
        """Remove and return a reservation (commit or abort); None if unknown or reclaimed."""
        r = self.reservations.pop(rid, None)
        if r is not None and r.tenant is not None:
            _uncharge(self.reserved_bytes, r.tenant, _allocated(r.extents))
        return r

    def reserve_room(self, tenant: str | None) -> int | None:
        """Bytes ``tenant`` may still reserve under ``max_reserved_bytes``; None: no limit."""
        lim = self.limits.get(tenant) if tenant is not None else None
        if lim is None or lim.max_reserved_bytes is None:
            return None
        return lim.max_reserved_bytes - self.reserved_bytes[tenant]  # type: ignore[index]

    def reservation_tenant(self, rid: int) -> str | None:
        r = self.reservations.get(rid)
        return r.tenant if r is not None else None

    def overdue_reservations(self, now: float) -> list[int]:
        return [rid for rid, r in self.reservations.items() if r.deadline <= now]

    # -- leases and references -----------------------------------------------------------
    def lease(
        self,
        key: ChunkKey,
        alloc: int,
        deadline: float,
        tenant: str | None,
        extents: tuple[Extent, ...] = (),
        nbytes: int = 0,
    ) -> int:
        lid = next(self._ids)
        self.leases[lid] = Lease(key, alloc, deadline, tenant, extents, nbytes)
        self.refs[alloc] += 1
        return lid

    def release(self, lid: int) -> bool:
        """End a lease; False if it is unknown (never given, released, or expired)."""
        lease = self.leases.pop(lid, None)
        if lease is None:
            return False
        self.drop_ref(lease.alloc)
        return True

    def lease_tenant(self, lid: int) -> str | None:
        lease = self.leases.get(lid)
        return lease.tenant if lease is not None else None

    def leased(self, alloc: int) -> bool:
        """Whether anything (a lease, a demotion) still refers to this allocation."""
        return self.refs[alloc] != 0

    def ref(self, alloc: int) -> None:
        """An internal reference: the allocation's bytes must stay put (a demotion reads them)."""
        self.refs[alloc] += 1

    def drop_ref(self, alloc: int) -> None:
        self.refs[alloc] -= 1
        if self.refs[alloc] <= 0:
            del self.refs[alloc]
            extents = self.detached.pop(alloc, None)
            if extents is not None:
                self._free(extents)

    def detach(self, alloc: int, extents: list[Extent]) -> None:
        """The block of a referenced allocation left the index: free it on the last drop."""
        self.detached[alloc] = extents

    # -- transfers ----------------------------------------------------------------------
    def hold(self, *, reservation_ids: Sequence[int] = (), lease_ids: Sequence[int] = ()) -> bool:
        """Exempt live reservations and leases from their deadlines (see ``TierManager.hold``);
        False if any of them is gone already."""
        live = True
        for table, ids in ((self.reservations, reservation_ids), (self.leases, lease_ids)):
            for i in ids:
                entry = table.get(i)
                if entry is None:
                    live = False
                else:
                    entry.deadline = math.inf
        return live

    def held(self, some_id: int) -> bool:
        r = self.reservations.get(some_id)
        if r is not None:
            return r.deadline == math.inf
        lease = self.leases.get(some_id)
        return lease is not None and lease.deadline == math.inf

    # -- pins -------------------------------------------------------------------------
    def pinned(self, key: ChunkKey) -> bool:
        p = self.pins.get(key)
        return p is not None and p.until > self.clock()

    def pin_room(self, tenant: str | None) -> int | None:
        """Bytes ``tenant`` may still pin under ``max_pinned_bytes``; None: no limit."""
        lim = self.limits.get(tenant) if tenant is not None else None
        if lim is None or lim.max_pinned_bytes is None:
            return None
        return lim.max_pinned_bytes - self.pinned_bytes[tenant]  # type: ignore[index]

    def pin_charge(self, key: ChunkKey, tenant: str | None, nbytes: int) -> int:
        """What pinning ``key`` would add to ``tenant``'s pinned bytes (0: its pin already)."""
        p = self.pins.get(key)
        if tenant is None or (p is not None and p.tenant == tenant and p.until > self.clock()):
            return 0
        return nbytes

    def pin(self, key: ChunkKey, until: float, tenant: str | None = None, nbytes: int = 0) -> None:
        """Pin ``key`` until ``until``, charged to ``tenant``; an existing later deadline
        stays.  A pin set again by another caller becomes that caller's (and so does its charge)."""
        p = self.pins.get(key)
        if p is not None and p.until <= self.clock():
            self.unpin(key)  # ended already, not yet reaped: this is a new pin
            p = None
        if p is not None and p.tenant == tenant:
            p.until = max(until, p.until)
            return
        if p is not None:
            until = max(until, p.until)
            self.unpin(key)
        self.pins[key] = Pin(until, tenant, nbytes)
        if tenant is not None:
            self.pinned_bytes[tenant] += nbytes

    def unpin(self, key: ChunkKey) -> bool:
        p = self.pins.pop(key, None)
        if p is None:
            return False
        if p.tenant is not None:
            _uncharge(self.pinned_bytes, p.tenant, p.nbytes)
        return True

    def expire_pins(self, now: float) -> int:
        """Drop the pins whose deadline passed (a scan: the reaper's, and a refused pin's)."""
        gone = [k for k, p in self.pins.items() if p.until <= now]
        for k in gone:
            self.unpin(k)
        return len(gone)

    # -- deadlines ----------------------------------------------------------------------
    def expire(self, now: float) -> int:
        """Drop the leases and pins whose deadline passed; returns how many leases went.
        (Overdue reservations are the manager's to abort: their extents go back to DRAM.)"""
        expired = [lid for lid, lease in self.leases.items() if lease.deadline <= now]
        for lid in expired:
            lease = self.leases.pop(lid)
            self.drop_ref(lease.alloc)
            self.expired[lid] = None
        while len(self.expired) > _EXPIRED_MEMORY:
            self.expired.popitem(last=False)
        self.expire_pins(now)
        return len(expired)


def _allocated(extents: Sequence[Extent]) -> int:
    return sum(e.length for e in extents)


def _uncharge(counts: collections.Counter[str], tenant: str, nbytes: int) -> None:
    counts[tenant] -= nbytes
    assert counts[tenant] >= 0, f"tenant {tenant!r} accounting went negative"
    if counts[tenant] == 0:
        del counts[tenant]

"""Per-tenant capacity quotas: the DRAM and NVMe bytes each tenant's blocks occupy, and who goes first.

``[tenants.NAME] max_dram_bytes`` and ``max_nvme_bytes`` cap what a tenant's blocks may
occupy in a tier, counted as the tier allocates (a 0- or 1-byte block takes a whole
64 KiB DRAM unit, an NVMe record its page-rounded size), never as payload bytes.  A block
belongs to the tenant that owns its namespace (``owner_of``); blocks of namespaces no
tenant owns belong to nobody (``None``), which has no cap.

Two rules keep one tenant from evicting another's working set:

* over its cap, a tenant makes room by evicting its own blocks: :meth:`TenantQuotas.make_room`
  runs before its reservation or promotion takes DRAM space, and :class:`QuotaNVMe` before
  one of its blocks is demoted to NVMe (it is not demoted if its own blocks cannot make room);
* eviction for anyone proposes first the blocks of owners without a cap or over theirs
  (:meth:`Occupancy.first`), and blocks of tenants within their caps only after those.

So where the caps, plus what uncapped owners keep, fit a tier, a tenant within its cap
never loses a block there to another's writes.  The caps are soft by what is in flight
at once: concurrent reservations of one tenant, or one demotion batch, may take it over
for a moment, after which its own blocks are the first to go.

Owner: the tier manager builds everything here.  The DRAM :class:`Occupancy` is told of
blocks by the DRAM tier (``DRAMTier.watch``) on the manager's loop; the NVMe one through
:class:`QuotaNVMe`, the NVMe tier as the movers see it, also from executor threads.  So an
``Occupancy`` takes its own lock around its tables; nothing else here is shared.

Invariants: ``used[t]`` is the sum of the bytes charged for the keys charged to ``t``, and
each key stored in the tier is charged exactly once, to the tenant that owned its
namespace when it was stored (a later change of owner does not move the charge).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from kvstore.block import BlockMeta
from kvstore.keys import ChunkKey
from kvstore.node.ledger import EVICTED
from tiers.base import MissReason, ReadResult, victims_first
from tiers.dram import DRAMTier
from tiers.nvme import record_bytes

OwnerOf = Callable[[bytes], "str | None"]
"""Namespace fingerprint → the tenant owning it (None: no tenant)."""


class Occupancy:
    """The bytes each owner's blocks occupy in one tier, against the owners' caps (a
    :class:`~tiers.base.TierWatch`)."""

    def __init__(self, caps: Mapping[str, int], owner_of: OwnerOf) -> None:
        self.caps = dict(caps)  # tenant -> most bytes its blocks may occupy
        self.owner_of = owner_of
        self.used: collections.Counter[str | None] = collections.Counter()
        self._charged: dict[ChunkKey, tuple[str | None, int]] = {}  # key -> (owner charged, bytes)
        self._total = 0
        self._lock = threading.Lock()

    def stored(self, meta: BlockMeta, nbytes: int) -> None:
        owner = self.owner_of(meta.namespace)
        with self._lock:
            self._drop(meta.key)
            self._charged[meta.key] = (owner, nbytes)
            self.used[owner] += nbytes
            self._total += nbytes

    def dropped(self, key: ChunkKey) -> None:
        with self._lock:
            self._drop(key)

    def _drop(self, key: ChunkKey) -> None:
        old = self._charged.pop(key, None)
        if old is not None:
            owner, nbytes = old
            self.used[owner] -= nbytes
            self._total -= nbytes
            if not self.used[owner]:
                del self.used[owner]

    def owner(self, key: ChunkKey) -> str | None:
        c = self._charged.get(key)
        return c[0] if c is not None else None

    def cap(self, tenant: str | None) -> int | None:
        return self.caps.get(tenant) if tenant is not None else None

    def first(self, key: ChunkKey) -> bool:
        """Whether eviction should take ``key`` before blocks of tenants within their caps."""
        owner = self.owner(key)
        cap = self.cap(owner)
        return cap is None or self.used[owner] > cap

    def any_first(self) -> bool:
        with self._lock:
            protected = sum(u for t, u in self.used.items() if (cap := self.cap(t)) is not None and u <= cap)
            return self._total > protected


def caps_of(limits: Mapping[str, Any], field: str) -> dict[str, int]:
    """tenant → its ``field`` (``max_dram_bytes``, ``max_nvme_bytes``) where it has one."""
    return {t: cap for t, lim in limits.items() if (cap := getattr(lim, field)) is not None}


class TenantQuotas:
    """``max_dram_bytes``: the DRAM occupancy, and making room under a tenant's cap by
    evicting its own blocks (demoted to NVMe first, as any eviction does)."""

    def __init__(
        self,
        use: Occupancy,
        dram: DRAMTier,
        *,
        movers: Any,
        reserved: Mapping[str, int],
        counters: collections.Counter[str],
        forget: Callable[[ChunkKey, str, BlockMeta | None], None],
    ) -> None:
        self.use = use
        self.dram = dram
        self.movers = movers  # kvstore.node.movers.TierMovers: can_evict, persist, on_nvme
        self.reserved = reserved  # tenant -> DRAM bytes of its reservations (Holds.reserved_bytes)
        self.counters = counters
        self._forget = forget
        self._evicting: set[ChunkKey] = set()  # chosen by a round of make_room still running
        dram.watch = use

    def occupied(self, tenant: str) -> int:
        """DRAM bytes the tenant's blocks and reservations take."""
        return self.use.used[tenant] + self.reserved.get(tenant, 0)

    async def make_room(self, tenant: str | None, nbytes: int) -> bool:
        """Evict ``tenant``'s own DRAM blocks until a block of ``nbytes`` fits under its
        ``max_dram_bytes`` (True), or answer False: its own blocks cannot make the room."""
        cap = self.use.cap(tenant)
        if cap is None:
            return True
        assert tenant is not None
        need = self.dram.allocator.rounded(nbytes)
        if need > cap:
            return False
        while (excess := self.occupied(tenant) + need - cap) > 0:
            batch = self._own_victims(tenant, excess)
            if not batch:
                return False
            self._evicting.update(batch)
            try:
                if self.movers.nvme is not None:
                    await self.movers.persist(batch)
            finally:
                self._evicting.difference_update(batch)
            for key in batch:
                if self.dram.contains(key) and self.movers.can_evict(key):
                    meta = self.dram.meta(key)
                    self.dram.delete(key)
                    self.counters["dram_evictions"] += 1
                    self.counters["quota_evictions_dram"] += 1
                    if not self.movers.on_nvme(key):
                        self._forget(key, EVICTED, meta)
        return True

    def _own_victims(self, tenant: str, nbytes: int) -> list[ChunkKey]:
        batch: list[ChunkKey] = []
        freed = 0
        ok = lambda k: k not in self._evicting and self.use.owner(k) == tenant and self.movers.can_evict(k)  # noqa: E731
        for key in self.dram.victims(ok, by_policy=True):
            batch.append(key)
            freed += sum(e.length for e in self.dram.extents(key) or [])
            if freed >= nbytes:
                break
        return batch


class QuotaNVMe:
    """The NVMe tier as the movers see it, with ``max_nvme_bytes`` applied: what each
    tenant's records occupy is kept in ``use``, a block over its owner's cap is admitted
    only once the owner's own records made room, and eviction proposes blocks of owners
    without a cap or over it first.  Everything else is the wrapped tier's."""

    def __init__(
        self,
        nvme: Any,
        use: Occupancy,
        *,
        meta_of: Callable[[ChunkKey], BlockMeta | None],
        evictable: Callable[[ChunkKey], bool],
        counters: collections.Counter[str],
        departed: collections.deque[tuple[ChunkKey, str, bytes | None]],
    ) -> None:
        self._nvme = nvme
        self.use = use
        self._meta_of = meta_of  # the DRAM copy's meta of a block about to be demoted
        self._evictable = evictable  # not pinned
        self._counters = counters
        self._departed = departed  # (key, reason, namespace) for the manager's miss history
        for key in nvme.keys():  # what the tier kept from before
            meta = nvme.meta(key)
            if meta is not None:
                use.stored(meta, record_bytes(meta.payload_len))

    def __len__(self) -> int:  # dunders bypass __getattr__: the tier's block count, as the manager's stats read it
        return len(self._nvme)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._nvme, name)

    def admit(self, key: ChunkKey, size: int) -> bool:
        if not self._nvme.admit(key, size):
            return False
        meta = self._meta_of(key)
        owner = self.use.owner_of(meta.namespace) if meta is not None else None
        cap = self.use.cap(owner)
        if cap is None:
            return True
        need = record_bytes(size)
        while self.use.used[owner] + need > cap:
            ok = lambda k: k != key and self.use.owner(k) == owner and self._evictable(k)  # noqa: E731
            victim = next(self._nvme.victims(ok), None)
            if victim is None:
                self._counters["quota_rejected_nvme"] += 1
                return False
            vmeta = self._nvme.meta(victim)
            if self.delete(victim):
                self._counters["nvme_evictions"] += 1
                self._counters["quota_evictions_nvme"] += 1
                self._departed.append((victim, EVICTED, vmeta.namespace if vmeta is not None else None))
        return True

    def victims(self, can_evict: Callable[[ChunkKey], bool] = lambda k: True) -> Iterator[ChunkKey]:
        if self.use.any_first():
            return victims_first(self._nvme.victims, can_evict, self.use.first)
        return self._nvme.victims(can_evict)

    def write(self, meta: BlockMeta, payload: object) -> None:
        self.write_many([(meta, payload)])

    def write_many(self, items: Sequence[tuple[BlockMeta, object]], *args: Any, **kw: Any) -> Any:
        try:
            return self._nvme.write_many(items, *args, **kw)
        finally:  # a failed group may have stored some of its blocks
            for meta, _ in items:
                if self._nvme.contains(meta.key):
                    self.use.stored(meta, record_bytes(meta.payload_len))

    def delete(self, key: ChunkKey) -> bool:
        hit = bool(self._nvme.delete(key))
        if hit:
            self.use.dropped(key)
        return hit

    def read_into(self, key: ChunkKey, out: object, *args: Any, **kw: Any) -> ReadResult:
        res: ReadResult = self._nvme.read_into(key, out, *args, **kw)
        if res.miss == MissReason.CORRUPT and not self._nvme.contains(key):  # the tier dropped it
            self.use.dropped(key)
        return res

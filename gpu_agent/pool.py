"""The HBM block pool: a byte budget of device memory cut into block-sized slots.

State: one device tensor (``capacity`` slots of ``block_bytes``), the map key → slot,
a logical LRU clock, per-slot read holds.  Owned by one :class:`~gpu_agent.agent.GPUAgent`,
shared by the engine's thread (``load``), the load issuer and completer and the prefetch
worker, so one lock (:attr:`HBMPool.lock`) guards all of it.

**Slot life**: a prefetch takes a slot with :meth:`reserve` (not visible to lookups),
fills it, and only once the copy completed and its lease was found valid makes it
visible with :meth:`publish` (or gives it back with :meth:`unreserve`): a published
slot always holds its block's bytes.  A load that reads a slot holds it (:meth:`hold`) until
its copies completed (:meth:`release`); a held slot that is evicted meanwhile leaves
the map at once but is reused only after the last hold is released, so a slot's reuse
is ordered after every read of it, whatever stream read it.

Eviction here only drops the HBM copy: the block stays in the node's DRAM (or NVMe)
tier.  Which entries to drop is :func:`gpu_agent.prefetch.plan_evictions`'s choice.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Collection, Sequence

import torch

from gpu_agent.prefetch import PoolEntry, plan_evictions


@dataclasses.dataclass(slots=True)
class _Slot:
    index: int
    depth: int
    last_use: int


class HBMPool:
    """Fixed slots of ``block_bytes`` in one tensor of at most ``budget_bytes`` on ``device``."""

    def __init__(self, budget_bytes: int, block_bytes: int, device: torch.device) -> None:
        if block_bytes <= 0:
            raise ValueError("block_bytes must be positive")
        self.block_bytes = block_bytes
        self.capacity = max(0, budget_bytes // block_bytes)
        self.device = device
        self.storage = torch.empty(self.capacity * block_bytes, dtype=torch.uint8, device=device)
        self.lock = threading.RLock()
        self._entries: dict[bytes, _Slot] = {}
        self._free = list(range(self.capacity - 1, -1, -1))
        self._holds: dict[int, int] = {}  # slot index -> loads still reading it
        self._draining: set[int] = set()  # evicted while held: free once the holds are released
        self._reserved: set[int] = set()  # being filled by a prefetch, not yet published
        self._clock = 0
        self.hits = 0
        self.inserts = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def tick(self) -> int:
        self._clock += 1
        return self._clock

    def slot_tensor(self, index: int) -> torch.Tensor:
        return self.storage[index * self.block_bytes : (index + 1) * self.block_bytes]

    def contains(self, key: bytes) -> bool:
        return key in self._entries

    def lookup(self, key: bytes) -> torch.Tensor | None:
        """The slot holding ``key`` (and mark it used), or None.  Call under :attr:`lock`."""
        s = self._entries.get(key)
        if s is None:
            return None
        s.last_use = self.tick()
        self.hits += 1
        return self.slot_tensor(s.index)

    def hold(self, key: bytes) -> tuple[int, torch.Tensor] | None:
        """Like :meth:`lookup`, and the slot is not reused until :meth:`release` (index, tensor)."""
        s = self._entries.get(key)
        if s is None:
            return None
        s.last_use = self.tick()
        self.hits += 1
        self._holds[s.index] = self._holds.get(s.index, 0) + 1
        return s.index, self.slot_tensor(s.index)

    def release(self, indices: Sequence[int]) -> None:
        """Drop one hold on each slot of ``indices`` (its reads have completed)."""
        with self.lock:
            for i in indices:
                n = self._holds.get(i, 0) - 1
                if n > 0:
                    self._holds[i] = n
                    continue
                self._holds.pop(i, None)
                if i in self._draining:
                    self._draining.discard(i)
                    self._free.append(i)

    def held(self) -> int:
        return sum(self._holds.values())

    def entries(self) -> list[PoolEntry]:
        return [PoolEntry(k, s.last_use, s.depth) for k, s in self._entries.items()]

    def evict(self, keys: Sequence[bytes]) -> int:
        """Drop ``keys``' HBM copies (the store still has them).  Call under :attr:`lock`."""
        n = 0
        for k in keys:
            s = self._entries.pop(k, None)
            if s is not None:
                if self._holds.get(s.index):
                    self._draining.add(s.index)  # a load still reads it
                else:
                    self._free.append(s.index)
                self.evictions += 1
                n += 1
        return n

    def reserve(self, *, protect: Collection[bytes] = ()) -> int | None:
        """A free slot's index (evicting the LRU entry outside ``protect`` if none is free),
        or None.  It stays invisible to lookups until :meth:`publish`.  Call under :attr:`lock`."""
        if not self._free:
            victims = plan_evictions(
                [e for e in self.entries() if not self._holds.get(self._entries[e.key].index)], 1, protect
            )
            if not victims:
                return None
            self.evict(victims)
            if not self._free:
                return None
        index = self._free.pop()
        self._reserved.add(index)
        return index

    def publish(self, key: bytes, index: int, depth: int) -> None:
        """Make reserved slot ``index`` (filled, its copy complete) hold ``key``.  Call under :attr:`lock`."""
        self._reserved.discard(index)
        old = self._entries.get(key)
        if old is not None:  # filled twice (a race of two prefetches): keep the first
            self._free.append(index)
            return
        self._entries[key] = _Slot(index, depth, self.tick())
        self.inserts += 1

    def unreserve(self, indices: Sequence[int]) -> None:
        """Give reserved slots back unfilled.  Call under :attr:`lock`."""
        for i in indices:
            if i in self._reserved:
                self._reserved.discard(i)
                self._free.append(i)

    def insert(self, key: bytes, depth: int, *, protect: Collection[bytes] = ()) -> torch.Tensor | None:
        """A published slot for ``key`` (evicting the LRU entry outside ``protect`` if full),
        or None if every slot is protected; for callers that fill it before anyone can look
        it up (they hold :attr:`lock` until the fill completed).  Prefetch uses :meth:`reserve`."""
        if key in self._entries:
            return self.lookup(key)
        index = self.reserve(protect=protect)
        if index is None:
            return None
        self.publish(key, index, depth)
        return self.slot_tensor(index)

    def clear(self) -> None:
        with self.lock:
            self.evict(list(self._entries))

    def stats(self) -> dict[str, int]:
        return {
            "capacity_blocks": self.capacity,
            "resident_blocks": len(self._entries),
            "block_bytes": self.block_bytes,
            "hits": self.hits,
            "inserts": self.inserts,
            "evictions": self.evictions,
            "held_slots": len(self._holds),
            "reserved_slots": len(self._reserved),
        }

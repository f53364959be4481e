"""The HBM block pool: a byte budget of device memory cut into block-sized slots.

State: one device tensor (``capacity`` slots of ``block_bytes``), the map key → slot,
a logical LRU clock.  Owned by one :class:`~gpu_agent.agent.GPUAgent`, shared by the
engine's thread (``load``) and the agent's prefetch worker, so one lock guards it.

**Lock rule**: whoever picks a slot (to read a resident block, or to reuse an evicted
one) keeps :attr:`HBMPool.lock` held until the copies touching that slot are
*submitted* to the h2d stream.  Every read and write of pool memory runs on that one
stream, so a slot's reuse is ordered after every earlier read of it without events.

Eviction here only drops the HBM copy: the block stays in the node's DRAM (or NVMe)
tier.  Which entries to drop is :func:`gpu_agent.planner.plan_evictions`'s choice.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Collection, Sequence

import torch

from gpu_agent.planner import PoolEntry, plan_evictions


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

    def entries(self) -> list[PoolEntry]:
        return [PoolEntry(k, s.last_use, s.depth) for k, s in self._entries.items()]

    def evict(self, keys: Sequence[bytes]) -> int:
        """Drop ``keys``' HBM copies (the store still has them).  Call under :attr:`lock`."""
        n = 0
        for k in keys:
            s = self._entries.pop(k, None)
            if s is not None:
                self._free.append(s.index)
                self.evictions += 1
                n += 1
        return n

    def insert(self, key: bytes, depth: int, *, protect: Collection[bytes] = ()) -> torch.Tensor | None:
        """A slot for ``key`` (evicting the LRU entry outside ``protect`` if full), or None if
        every slot is protected.  The caller fills it before releasing :attr:`lock`."""
        if key in self._entries:
            return self.lookup(key)
        if not self._free:
            victims = plan_evictions(self.entries(), 1, protect)
            if not victims:
                return None
            self.evict(victims)
        index = self._free.pop()
        self._entries[key] = _Slot(index, depth, self.tick())
        self.inserts += 1
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
        }

"""Eviction policies: small pure objects that order a tier's blocks for eviction.

Owner: the tier that holds the policy instance; not thread-safe.  A policy never
frees anything itself: it proposes victims and is told what happened through
``insert`` / ``access`` / ``remove``.  No wall clock is read here; ordering uses a
logical tick, so tests are deterministic.

Protocol for eviction rounds: iterate ``victims()``; for each proposed key the caller
either evicts it (and calls ``remove(key)`` before asking for the next) or skips it
(pinned, leased, in flight) — skipped keys keep their place.

Policies register themselves in :data:`POLICIES` (one explicit registry) so config
and ``kvstore replay`` name them.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Protocol

from kvstore.errors import InvalidArgument
from kvstore.keys import NO_PARENT, ChunkKey


class EvictionPolicy(Protocol):
    name: str

    def insert(self, key: ChunkKey, parent: ChunkKey, size: int) -> None: ...

    def access(self, key: ChunkKey) -> None: ...

    def remove(self, key: ChunkKey) -> None: ...

    def victims(self) -> Iterator[ChunkKey]: ...

    def admit(self, key: ChunkKey, size: int) -> bool:
        """Admission filter for the tier (True: store it).  Baselines admit everything."""
        ...

    def __len__(self) -> int: ...

    def __contains__(self, key: object) -> bool: ...


class LRUPolicy:
    """Least recently used first.  O(1) per operation (an ordered dict)."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[ChunkKey, None] = OrderedDict()

    def insert(self, key: ChunkKey, parent: ChunkKey, size: int) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def access(self, key: ChunkKey) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: ChunkKey) -> None:
        self._order.pop(key, None)

    def admit(self, key: ChunkKey, size: int) -> bool:
        return True

    def victims(self) -> Iterator[ChunkKey]:
        skipped: list[ChunkKey] = []
        try:
            while self._order:
                key = next(iter(self._order))
                yield key
                if key in self._order:  # the caller kept it: set it aside, restore its place after
                    del self._order[key]
                    skipped.append(key)
        finally:
            for key in reversed(skipped):
                self._order[key] = None
                self._order.move_to_end(key, last=False)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order


class PrefixAwareLRUPolicy:
    """LRU restricted to leaves of the resident prefix tree.

    A chunk is useless without its ancestors, so a block is only proposed once none of
    its children is resident: descendants always go before their ancestors.  Leaves are
    ordered by last access (a heap with lazy invalidation).
    """

    name = "prefix-lru"

    def __init__(self) -> None:
        self._tick = 0
        self._last: dict[ChunkKey, int] = {}
        self._parent: dict[ChunkKey, ChunkKey] = {}
        self._children: dict[ChunkKey, int] = {}
        self._heap: list[tuple[int, ChunkKey]] = []

    def _touch(self, key: ChunkKey) -> None:
        self._tick += 1
        self._last[key] = self._tick
        if self._children.get(key, 0) == 0:
            heapq.heappush(self._heap, (self._tick, key))
        if len(self._heap) > 2 * len(self._last) + 64:
            self._heap = [(t, k) for k, t in self._last.items() if self._children.get(k, 0) == 0]
            heapq.heapify(self._heap)

    def insert(self, key: ChunkKey, parent: ChunkKey, size: int) -> None:
        if key in self._last:
            self._touch(key)
            return
        self._parent[key] = parent
        if parent != NO_PARENT and parent in self._last:
            self._children[parent] = self._children.get(parent, 0) + 1
        self._touch(key)

    def access(self, key: ChunkKey) -> None:
        if key in self._last:
            self._touch(key)

    def remove(self, key: ChunkKey) -> None:
        if key not in self._last:
            return
        del self._last[key]
        self._children.pop(key, None)
        parent = self._parent.pop(key)
        if parent in self._last:
            left = self._children.get(parent, 0) - 1
            if left <= 0:
                self._children.pop(parent, None)
                heapq.heappush(self._heap, (self._last[parent], parent))
            else:
                self._children[parent] = left
        # orphans (children whose parent is gone) are leaves or ancestors of leaves already

    def admit(self, key: ChunkKey, size: int) -> bool:
        return True

    def _valid(self, tick: int, key: ChunkKey) -> bool:
        return self._last.get(key) == tick and self._children.get(key, 0) == 0

    def victims(self) -> Iterator[ChunkKey]:
        skipped: list[tuple[int, ChunkKey]] = []
        try:
            while self._heap:
                tick, key = heapq.heappop(self._heap)
                if not self._valid(tick, key):
                    continue
                yield key
                if key in self._last:
                    skipped.append((tick, key))
        finally:
            for item in skipped:
                heapq.heappush(self._heap, item)

    def __len__(self) -> int:
        return len(self._last)

    def __contains__(self, key: object) -> bool:
        return key in self._last


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    LRUPolicy.name: LRUPolicy,
    PrefixAwareLRUPolicy.name: PrefixAwareLRUPolicy,
}
DEFAULT_POLICY = PrefixAwareLRUPolicy.name


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise InvalidArgument(f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}") from None

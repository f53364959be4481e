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
from kvstore.sketch import FrequencySketch


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
        # keys skipped by a victims() round still running; still resident, put back when it ends
        self._aside: dict[ChunkKey, None] = {}

    def insert(self, key: ChunkKey, parent: ChunkKey, size: int) -> None:
        self._aside.pop(key, None)
        self._order[key] = None
        self._order.move_to_end(key)

    def access(self, key: ChunkKey) -> None:
        if key in self._order:
            self._order.move_to_end(key)
        elif key in self._aside:  # used while set aside: it is now the most recent, not restored in front
            del self._aside[key]
            self._order[key] = None

    def remove(self, key: ChunkKey) -> None:
        self._order.pop(key, None)
        self._aside.pop(key, None)  # a key removed mid-round must not come back when the round ends

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
                    self._aside[key] = None
                    skipped.append(key)
        finally:
            for key in reversed(skipped):
                if key in self._aside:  # not removed, re-inserted or accessed meanwhile
                    del self._aside[key]
                    self._order[key] = None
                    self._order.move_to_end(key, last=False)

    def __len__(self) -> int:
        return len(self._order) + len(self._aside)

    def __contains__(self, key: object) -> bool:
        return key in self._order or key in self._aside


class PrefixAwareLRUPolicy:
    """LRU restricted to leaves of the resident prefix tree.

    A chunk is useless without its ancestors, so a block is only proposed once none of
    its children is resident: descendants always go before their ancestors.  Leaves are
    ordered by last access (a heap with lazy invalidation).

    Child counts are kept per parent key whether or not the parent is resident, so a
    parent inserted after its children (out-of-order commits, a rebuild from an index
    in key order) or removed and re-inserted still waits for them.
    """

    name = "prefix-lru"

    def __init__(self) -> None:
        self._tick = 0
        self._last: dict[ChunkKey, int] = {}
        self._parent: dict[ChunkKey, ChunkKey] = {}
        self._children: dict[ChunkKey, int] = {}  # parent -> resident children (parent may be absent)
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
        if parent == key or (key in self._children and self._is_ancestor(key, parent)):
            parent = NO_PARENT  # a bogus parent that would close a cycle: nothing in it could ever go
        self._parent[key] = parent
        if parent != NO_PARENT:
            self._children[parent] = self._children.get(parent, 0) + 1
        self._touch(key)

    def _is_ancestor(self, key: ChunkKey, of: ChunkKey) -> bool:
        """Whether ``key`` is ``of`` or one of its recorded ancestors (only walked for out-of-order inserts)."""
        while of != NO_PARENT:
            if of == key:
                return True
            of = self._parent.get(of, NO_PARENT)
        return False

    def access(self, key: ChunkKey) -> None:
        if key in self._last:
            self._touch(key)

    def remove(self, key: ChunkKey) -> None:
        if key not in self._last:
            return
        del self._last[key]
        parent = self._parent.pop(key)
        if parent != NO_PARENT:
            left = self._children[parent] - 1
            if left:
                self._children[parent] = left
            else:
                del self._children[parent]
                if parent in self._last:  # the parent just became a leaf
                    heapq.heappush(self._heap, (self._last[parent], parent))
        # key's own child count stays: its resident children still hold it back if it is re-inserted

    def admit(self, key: ChunkKey, size: int) -> bool:
        return True

    def _valid(self, tick: int, key: ChunkKey) -> bool:
        return self._last.get(key) == tick and self._children.get(key, 0) == 0

    def victims(self) -> Iterator[ChunkKey]:
        offered: dict[ChunkKey, int] = {}  # this round's proposals: key -> tick
        try:
            while self._heap:
                tick, key = heapq.heappop(self._heap)
                if offered.get(key) == tick or not self._valid(tick, key):
                    continue  # stale, or a second heap entry of a key already offered this round
                offered[key] = tick  # recorded before yielding: the caller may stop right after a skip
                yield key
        finally:
            # put back every offered key still resident and unchanged (skipped, or pending when the
            # caller stopped); evicted or re-touched ones fail _valid and are not duplicated
            for key, tick in offered.items():
                if self._valid(tick, key):
                    heapq.heappush(self._heap, (tick, key))

    def __len__(self) -> int:
        return len(self._last)

    def __contains__(self, key: object) -> bool:
        return key in self._last


class _PrefixHeapPolicy:
    """Base of the prefix-aware priority policies: the lowest-priority *leaf* goes first.

    Same tree bookkeeping and round protocol as :class:`PrefixAwareLRUPolicy` (child
    counts per parent key whether or not the parent is resident; a heap with lazy
    invalidation; offered keys restored when a round ends), but the heap is ordered by
    ``(priority, tick)`` where subclasses compute the priority on every use.
    ``_evicted(key, priority)`` is called when the caller removes the key that the
    running round has just offered (an eviction, as opposed to a delete).
    """

    name = ""

    def __init__(self) -> None:
        self._tick = 0
        self._prio: dict[ChunkKey, tuple[int, int]] = {}  # resident key -> (priority, tick) of its valid entry
        self._parent: dict[ChunkKey, ChunkKey] = {}
        self._children: dict[ChunkKey, int] = {}
        self._heap: list[tuple[int, int, ChunkKey]] = []
        self._offering: ChunkKey | None = None  # the key a running round has just yielded

    # -- hooks ------------------------------------------------------------------------
    def _priority(self, key: ChunkKey, new: bool) -> int:
        raise NotImplementedError

    def _evicted(self, key: ChunkKey, priority: int) -> None:
        pass

    # -- bookkeeping --------------------------------------------------------------------
    def _touch(self, key: ChunkKey, new: bool) -> None:
        self._tick += 1
        entry = (self._priority(key, new), self._tick)
        self._prio[key] = entry
        if self._children.get(key, 0) == 0:
            heapq.heappush(self._heap, (entry[0], entry[1], key))
        if len(self._heap) > 2 * len(self._prio) + 64:
            self._heap = [(p, t, k) for k, (p, t) in self._prio.items() if self._children.get(k, 0) == 0]
            heapq.heapify(self._heap)

    def insert(self, key: ChunkKey, parent: ChunkKey, size: int) -> None:
        if key in self._prio:
            self._touch(key, False)
            return
        if parent == key or (key in self._children and self._is_ancestor(key, parent)):
            parent = NO_PARENT
        self._parent[key] = parent
        if parent != NO_PARENT:
            self._children[parent] = self._children.get(parent, 0) + 1
        self._touch(key, True)

    def _is_ancestor(self, key: ChunkKey, of: ChunkKey) -> bool:
        while of != NO_PARENT:
            if of == key:
                return True
            of = self._parent.get(of, NO_PARENT)
        return False

    def access(self, key: ChunkKey) -> None:
        if key in self._prio:
            self._touch(key, False)

    def remove(self, key: ChunkKey) -> None:
        entry = self._prio.pop(key, None)
        if entry is None:
            return
        if key == self._offering:
            self._offering = None
            self._evicted(key, entry[0])
        parent = self._parent.pop(key)
        if parent != NO_PARENT:
            left = self._children[parent] - 1
            if left:
                self._children[parent] = left
            else:
                del self._children[parent]
                pe = self._prio.get(parent)
                if pe is not None:
                    heapq.heappush(self._heap, (pe[0], pe[1], parent))

    def admit(self, key: ChunkKey, size: int) -> bool:
        return True

    def _valid(self, prio: int, tick: int, key: ChunkKey) -> bool:
        e = self._prio.get(key)
        return e is not None and e[1] == tick and e[0] == prio and self._children.get(key, 0) == 0

    def victims(self) -> Iterator[ChunkKey]:
        offered: dict[ChunkKey, tuple[int, int]] = {}
        try:
            while self._heap:
                prio, tick, key = heapq.heappop(self._heap)
                if offered.get(key) == (prio, tick) or not self._valid(prio, tick, key):
                    continue
                offered[key] = (prio, tick)
                self._offering = key
                yield key
                self._offering = None
        finally:
            self._offering = None
            for key, (prio, tick) in offered.items():
                if self._valid(prio, tick, key):
                    heapq.heappush(self._heap, (prio, tick, key))

    def __len__(self) -> int:
        return len(self._prio)

    def __contains__(self, key: object) -> bool:
        return key in self._prio


class PrefixLFUDAPolicy(_PrefixHeapPolicy):
    """Prefix-aware LFU with dynamic aging over a frequency sketch."""

    name = "prefix-lfuda"
    SAMPLE_FACTOR = 10

    def __init__(self) -> None:
        super().__init__()
        self._sketch = FrequencySketch(1 << 10, 10 << 10)
        self._age = 0
        self._peak = 0

    def _priority(self, key: ChunkKey, new: bool) -> int:
        n = len(self._prio) + (1 if new else 0)
        if n > self._peak:
            self._peak = n
            if 4 * n > self._sketch.width:
                self._sketch.resize(self._sketch.width * 4)
            self._sketch.sample = max(self._sketch.sample, self.SAMPLE_FACTOR * n)
        f = self._sketch.increment(key)
        return self._age + f

    def _evicted(self, key: ChunkKey, priority: int) -> None:
        if priority > self._age:
            self._age = priority


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    LRUPolicy.name: LRUPolicy,
    PrefixAwareLRUPolicy.name: PrefixAwareLRUPolicy,
    PrefixLFUDAPolicy.name: PrefixLFUDAPolicy,
}
DEFAULT_POLICY = PrefixAwareLRUPolicy.name


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise InvalidArgument(f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}") from None

"""Placement: which nodes own a chunk key.  Pure functions and immutable tables, no I/O.

Two schemes, named by the cluster setting ``placement`` (:data:`SCHEMES`); every client
and node that reads the same membership and the same setting computes the same owners,
with no metadata hop.

``rendezvous-v1`` (:class:`Ring`, the original scheme): the weight of node ``n`` for key
``k`` is ``xxh3_64(k, seed=xxh3_64(n as UTF-8))`` and the owners are the ``r`` highest
(ties, which need a 64-bit collision, go to the smaller node id).  O(nodes) per key.

``bounded-v1`` (:class:`BoundedTable`, the default): O(1) per key.  Once per membership
change a table of :data:`SLOTS` slots is built; a key's slot is
``xxh3_64(key[:4]) mod SLOTS`` and its owners are the slot's row.  The table is a
hashed ring with virtual nodes (``VNODES_PER_UNIT`` points per weight unit, so a node's
share of the ring follows its weight) read through *bounded loads*: per rank, node ``i``
takes at most ``floor(SLOTS * w_i / W * (1 + EPSILON))`` slots, so the busiest node
holds at most ``1 + EPSILON`` times its weighted share, whatever the ring's noise.

Building one rank (ranks 0 .. r-1 in turn; a slot's owners are distinct):

1. every slot's *first choice* is the first node clockwise from the slot's point that
   is not already one of its owners;
2. each node accepts its first-choice slots in the fixed slot priority order
   (:func:`_priority`) up to its cap;
3. the rejected slots, in priority order, walk on clockwise to the first node that is
   not already an owner and is under its cap (a full turn without one: the first node
   that is not already an owner).

Guarantees (tested as properties in ``tests/unit/test_placement.py``): owners are a pure
function of ``(scheme, {node: weight})``, independent of input order and process; a join
or leave moves little more than the minimal ``r/N`` of keys (nothing moves between
unaffected nodes except through the bounded overflow of step 3); per rank, no node holds
more than ``1 + EPSILON`` of its weighted share.

**Chunk locality.**  Only a key's first 4 bytes (its *placement tag*) choose its slot,
so keys sharing a tag share owners.  :func:`group_keys` gives every ``group`` consecutive
chunks of one prefix the tag of the group's first chunk (its key's first 4 bytes, a
hash of the whole prefix up to it): a request for ``K`` chunks then touches at most
``ceil(K / group)`` owners per rank.  ``group = 1`` is the identity.  Keys keep 96 bits
of their own chain hash (a collision needs two chunks of one group to agree on them).
"""

from __future__ import annotations

import array
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

import numpy as np
import xxhash

from kvstore.errors import InvalidArgument

RENDEZVOUS_V1 = "rendezvous-v1"
BOUNDED_V1 = "bounded-v1"
SCHEMES = (BOUNDED_V1, RENDEZVOUS_V1)
DEFAULT_SCHEME = BOUNDED_V1

SLOTS_BITS = 17
SLOTS = 1 << SLOTS_BITS  # fixed per scheme version: changing it moves every key
SLOT_MASK = SLOTS - 1
VNODES_PER_UNIT = (
    640  # ring points per DEFAULT_WEIGHT of weight (640: little overflow, so little moves between unaffected nodes)
)
EPSILON = 0.05  # the bound on a node's load above its weighted share, per rank
DEFAULT_WEIGHT = 100
MAX_WEIGHT = 10_000  # 100 x the default; a weight is an integer in [1, MAX_WEIGHT]
TAG_BYTES = 4

_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def node_seed(node_id: str) -> int:
    """The per-node hash seed (a pure function of the node id)."""
    return xxhash.xxh3_64_intdigest(node_id.encode())


def weight(node_id: str, key: bytes) -> int:
    """The rendezvous weight of ``node_id`` for ``key`` (``rendezvous-v1``)."""
    return xxhash.xxh3_64_intdigest(key, seed=node_seed(node_id))


def check_weight(w: object, what: str = "placement weight") -> int:
    """``w`` as a valid weight, or :class:`InvalidArgument` saying what is allowed."""
    if isinstance(w, bool) or not isinstance(w, int) or not 1 <= w <= MAX_WEIGHT:
        raise InvalidArgument(
            f"{what} must be an integer in [1, {MAX_WEIGHT}] ({DEFAULT_WEIGHT} = one node's share), got {w!r}"
        )
    return w


def slot_of(key: bytes) -> int:
    """The ``bounded-v1`` slot of ``key``: a hash of its placement tag (first 4 bytes)."""
    return xxhash.xxh3_64_intdigest(key[:TAG_BYTES]) & SLOT_MASK


def group_keys(keys: Sequence[bytes], group: int) -> list[bytes]:
    """Chunk keys of one prefix, **from its first chunk**, with every ``group`` consecutive
    keys sharing the placement tag of the group's first key (see the module doc).

    The keys must start at chunk 0 (the groups are aligned to the prefix); slice after."""
    if isinstance(group, bool) or not isinstance(group, int) or group < 1:
        raise InvalidArgument(f"chunk group must be an integer >= 1, got {group!r}")
    if group == 1:
        return [bytes(k) for k in keys]
    out: list[bytes] = []
    tag = b""
    for i, k in enumerate(keys):
        if i % group == 0:
            tag = bytes(k[:TAG_BYTES])
        out.append(tag + bytes(k[TAG_BYTES:]))
    return out


class Placement(Protocol):
    """What routing needs from a scheme: the members and each key's owners."""

    nodes: tuple[str, ...]

    def __len__(self) -> int: ...

    def owners(self, key: bytes, r: int) -> list[str]: ...


class Ring:
    """``rendezvous-v1``: precomputed seeds for one membership; ``ranked``/``owners`` per key.

    Immutable after construction, so one instance is shared by threads.  Weights are not
    supported (every node counts the same)."""

    __slots__ = ("nodes", "_seeds")

    def __init__(self, nodes: Iterable[str]) -> None:
        self.nodes: tuple[str, ...] = tuple(sorted(set(nodes)))
        self._seeds = [(node_seed(n), n) for n in self.nodes]

    def __len__(self) -> int:
        return len(self.nodes)

    def ranked(self, key: bytes) -> list[str]:
        """Every node, best owner first."""
        h = xxhash.xxh3_64_intdigest
        scored = sorted(((-h(key, seed=s), n) for s, n in self._seeds))
        return [n for _, n in scored]

    def owners(self, key: bytes, r: int) -> list[str]:
        """The top ``r`` nodes for ``key`` (fewer when the cluster is smaller)."""
        return self.ranked(key)[: max(0, r)]


def owners(key: bytes, nodes: Sequence[str], r: int) -> list[str]:
    """The top ``r`` of ``nodes`` for ``key`` by rendezvous hashing, best first."""
    return Ring(nodes).owners(key, r)


# -- bounded-v1 ---------------------------------------------------------------------------------
def _splitmix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 (wrapping arithmetic; a pinned pure function)."""
    with np.errstate(over="ignore"):
        x = (x + np.uint64(0x9E3779B97F4A7C15)) & _M64
        x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _M64
        x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _M64
        return x ^ (x >> np.uint64(31))


_PRIORITY: np.ndarray | None = None


def _priority() -> np.ndarray:
    """Slots in their fixed processing order (a pseudo-random permutation, the same everywhere)."""
    global _PRIORITY
    if _PRIORITY is None:
        _PRIORITY = np.argsort(_splitmix(np.arange(SLOTS, dtype=np.uint64)), kind="stable")
    return _PRIORITY


def _members(nodes: Mapping[str, int] | Iterable[str]) -> dict[str, int]:
    if isinstance(nodes, Mapping):
        return {str(n): check_weight(w, f"weight of node {n!r}") for n, w in nodes.items()}
    return {str(n): DEFAULT_WEIGHT for n in nodes}


class BoundedTable:
    """``bounded-v1``: the slot table of one membership (see the module doc).

    Built once per membership (ranks on first use, under a lock); immutable afterwards and
    shared by threads: a lookup is a hash of 4 bytes and one array index per rank.
    ``nodes`` is a mapping ``node id -> weight`` or an iterable of ids (each weight
    :data:`DEFAULT_WEIGHT`)."""

    def __init__(self, nodes: Mapping[str, int] | Iterable[str]) -> None:
        members = _members(nodes)
        self.nodes: tuple[str, ...] = tuple(sorted(members))
        self.weights: tuple[int, ...] = tuple(members[n] for n in self.nodes)
        self._ranks: list[array.array[int]] = []
        self._lock = threading.Lock()
        n = len(self.nodes)
        if n == 0:
            self._points = np.zeros(0, dtype=np.uint64)
            self._owner = np.zeros(0, dtype=np.int64)
            return
        counts = [max(1, w * VNODES_PER_UNIT // DEFAULT_WEIGHT) for w in self.weights]
        seeds = np.repeat(np.array([node_seed(x) for x in self.nodes], dtype=np.uint64), counts)
        idx = np.repeat(np.arange(n, dtype=np.int64), counts)
        v = np.concatenate([np.arange(c, dtype=np.uint64) for c in counts])
        with np.errstate(over="ignore"):
            pts = _splitmix((seeds ^ _splitmix(v)) & _M64)
        order = np.lexsort((idx, pts))  # by point, ties by node index
        self._points, self._owner = pts[order], idx[order]
        total = sum(self.weights)
        self._caps = np.array([int(SLOTS * w * (1 + EPSILON) // total) for w in self.weights], dtype=np.int64)
        positions = np.arange(SLOTS, dtype=np.uint64) << np.uint64(64 - SLOTS_BITS)
        self._start = np.searchsorted(self._points, positions, side="left").astype(np.int64)

    def __len__(self) -> int:
        return len(self.nodes)

    @property
    def members(self) -> dict[str, int]:
        return dict(zip(self.nodes, self.weights))

    def owners(self, key: bytes, r: int) -> list[str]:
        """The ``r`` owners of ``key``, best first (fewer when the cluster is smaller)."""
        ranks = self._ranks if len(self._ranks) >= r else self.ranks(r)
        s = xxhash.xxh3_64_intdigest(key[:TAG_BYTES]) & SLOT_MASK
        names = self.nodes
        return [names[col[s]] for col in ranks[: max(0, r)]]

    def owners_many(self, keys: Sequence[bytes], r: int) -> list[list[str]]:
        """:meth:`owners` of each key (one call for a batch)."""
        ranks = self.ranks(r)[: max(0, r)]
        h = xxhash.xxh3_64_intdigest
        names = self.nodes
        return [[names[col[s]] for col in ranks] for s in (h(k[:TAG_BYTES]) & SLOT_MASK for k in keys)]

    def slot_owners(self, rank: int) -> array.array[int]:
        """Node index (into ``nodes``) of every slot at ``rank`` (0: the first owner)."""
        return self.ranks(rank + 1)[rank]

    def ranks(self, r: int) -> list[array.array[int]]:
        """The first ``min(r, len(nodes))`` rank columns, built on first use."""
        r = min(max(0, r), len(self.nodes))
        if len(self._ranks) < r:
            with self._lock:
                while len(self._ranks) < r:
                    self._ranks.append(self._build_rank(len(self._ranks)))
        return self._ranks[:r]

    def _build_rank(self, k: int) -> array.array[int]:
        n, pts_n = len(self.nodes), len(self._points)
        owner, caps = self._owner, self._caps
        taken = [np.asarray(col, dtype=np.int64) for col in self._ranks]  # ranks 0 .. k-1
        # 1) first choice: the first point clockwise owned by a node not already an owner
        pos = self._start.copy()
        choice = owner[pos % pts_n]
        for _ in range(pts_n):
            clash = np.zeros(SLOTS, dtype=bool)
            for col in taken:
                clash |= choice == col
            if not clash.any():
                break
            pos[clash] += 1
            choice[clash] = owner[pos[clash] % pts_n]
        # 2) each node accepts its first choices in priority order, up to its cap
        prio = _priority()
        rank_of = np.empty(SLOTS, dtype=np.int64)
        rank_of[prio] = np.arange(SLOTS, dtype=np.int64)
        order = np.lexsort((rank_of, choice))
        sorted_choice = choice[order]
        group_start = np.searchsorted(sorted_choice, sorted_choice, side="left")
        within = np.arange(SLOTS, dtype=np.int64) - group_start
        accepted = np.zeros(SLOTS, dtype=bool)
        accepted[order] = within < caps[sorted_choice]
        result = np.where(accepted, choice, -1)
        load = np.bincount(result[accepted], minlength=n).tolist()
        # 3) the rest, in priority order, walk on to the first node under its cap
        rejected = [int(s) for s in prio if not accepted[s]]
        own = owner.tolist()
        cap = caps.tolist()
        cols = [col.tolist() for col in taken]
        res = result.tolist()
        posl = pos.tolist()
        for s in rejected:
            mine = {col[s] for col in cols}
            j, first = posl[s] + 1, -1
            for step in range(pts_n):
                cand = own[(j + step) % pts_n]
                if cand in mine:
                    continue
                if first < 0:
                    first = cand
                if load[cand] < cap[cand]:
                    first = cand
                    break
            res[s] = first
            load[first] += 1
        return array.array("I", res)


class _Cache:
    """The last few tables built, by (scheme, members): a membership change builds one table,
    and hand-off reads reuse the tables of the memberships before it.  Thread-safe."""

    def __init__(self, size: int = 8) -> None:
        self.size = size
        self._items: dict[tuple[str, tuple[tuple[str, int], ...]], Placement] = {}
        self._lock = threading.Lock()

    def get(self, scheme: str, members: Mapping[str, int]) -> Placement:
        key = (scheme, tuple(sorted(members.items())))
        with self._lock:
            hit = self._items.pop(key, None)
            if hit is not None:
                self._items[key] = hit  # most recent last
                return hit
        table = make(scheme, members)
        with self._lock:
            self._items[key] = table
            while len(self._items) > self.size:
                self._items.pop(next(iter(self._items)))
        return table


def make(scheme: str, members: Mapping[str, int]) -> Placement:
    """A new placement of ``scheme`` over ``members`` (node id -> weight)."""
    if scheme == BOUNDED_V1:
        return BoundedTable(members)
    if scheme == RENDEZVOUS_V1:
        _members(members)  # same validation
        return Ring(members)
    raise InvalidArgument(f"unknown placement scheme {scheme!r}; known: {', '.join(SCHEMES)}")


_CACHE = _Cache()


def placement(scheme: str, members: Mapping[str, int]) -> Placement:
    """The (cached) placement of ``scheme`` over ``members``: built once per membership."""
    return _CACHE.get(scheme, members)

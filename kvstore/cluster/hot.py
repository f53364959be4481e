"""Hot prefixes: extra copies of read-hot keys on more nodes, and the readers' spread over them.

A chunk read by every request (a system prompt, a shared document) would otherwise pin
its rank-0 owner's NIC.  Three parts, each small and deterministic:

* **Heat** (:class:`HeatCounter`, one per node, fed with the keys the node served: gets,
  lookups and prefix matches): a count-min sketch (:class:`tiers.sketch.FrequencySketch`)
  admits a key once it was seen ``ADMIT`` times recently; admitted keys are counted
  exactly per window in a dict of at most ``capacity`` keys.  Memory is bounded whatever
  the number of distinct keys.  Reads are sampled (1 in ``sample``) to keep the cost per
  read small; counts are scaled back.
* **Decision** (:func:`decide`, once per ``hot_window_s`` on each node, for the keys the
  node *owns*, rank < R): a key's total read rate is estimated from the node's share of
  it (readers spread a hot key uniformly over its ``R + k`` copies, so an owner sees
  ``1 / (R + k)`` of it; a key that is not hot yet is read from its rank-0 owner only).
  The per-copy target is a share (``COPY_SHARE``) of the node's own *cold* load (its
  reads less those it served as another key's extra and those of its keys that each
  carry 1/16 or more of them), which placement keeps close to every node's, floored at
  ``hot_reads_per_s``:
  a key gets ``ceil(rate / target) - R`` extra copies, at most ``hot_extras``.  Copies
  shrink only once the key would need a third fewer (hysteresis).  A node publishes its
  hot keys in ``hot/<node id>`` on its registration lease (rewritten only when the set
  changes): the record dies with the node.
* **Extras** (:func:`extras`): the ``k`` extra nodes of a key are a pure function of the
  placement and the key: the rank-0 owners of the slots ``slot + i * STRIDE`` (i = 1,
  2, ...) that are not already among its owners (then, for clusters too small for the
  walk, the remaining nodes in a rotation).  Every client and node computes the same
  ones; the first ``k`` of a longer list are the list for ``k``, so a key growing or
  shrinking its copies keeps most of them.

Readers (``client/_cluster.py``) pick one of a hot key's ``R + k`` copies at random
(live ones: a suspect node is skipped), then fall back to the owners in rank order.  A
copy that is missing on the extra chosen (not filled yet) is read from an owner and
written to that extra, with its exact metadata (the hand-off copy): extras fill on
first read.  Extra copies carry the block's checksum like any block; deletes go to every
live node and invalidation works by epoch on every node, so they reach extras too.  An
extra whose key leaves the hot set (the heat cooled, or the publishing owner's lease
expired) deletes its copy (:class:`ExtraCopies`, run by the node's cluster agent).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from kvstore.cluster.placement import SLOT_MASK, Placement, slot_of

STRIDE = 0x9E3779B1  # odd: i -> slot + i * STRIDE visits every slot
HOT_MAX_KEYS = 256  # keys one node publishes at most (the hottest)
MAX_EXTRAS = 1024  # the largest extra-copy count a record may ask for
ADMIT = 4  # sketch estimate at which a key is counted exactly
SHRINK_MARGIN = 1.5
BIG_SHARE = (
    1 / 16
)  # a key with this share of a node's reads is not part of its cold load  # copies shrink only when 1.5x the rate would still need fewer
COPY_SHARE = 0.25  # a hot key copy carries at most a quarter of a node's cold load


# -- heat -----------------------------------------------------------------------------------
class HeatCounter:
    """Reads per key on one node, bounded (see the module doc).  Not thread-safe: one loop feeds it."""

    def __init__(self, capacity: int = 1024, width: int = 1 << 15, sample: int = 1) -> None:
        if sample < 1:
            raise ValueError(f"sample must be >= 1, got {sample}")
        from tiers.sketch import FrequencySketch  # node side only: the SDK routes without it

        self.capacity = capacity
        self.sample = sample
        self.sketch = FrequencySketch(width, sample=4 * width)
        self.counts: dict[bytes, int] = {}
        self.total = 0  # sampled reads this window

    def add(self, key: bytes) -> None:
        self.total += 1
        c = self.counts.get(key)
        if c is not None:
            self.counts[key] = c + 1
        elif self.sketch.increment(key) >= ADMIT and len(self.counts) < self.capacity:
            self.counts[key] = 1

    def add_many(self, keys: Iterable[bytes]) -> None:
        """Count one read of each key (each with probability 1 / ``sample``)."""
        if self.sample == 1:
            for k in keys:
                self.add(k)
            return
        p, rnd = 1.0 / self.sample, random.random  # at random: a fixed stride aliases with a request's pattern
        for k in keys:
            if rnd() < p:
                self.add(k)

    def take(self) -> tuple[dict[bytes, int], int]:
        """This window's counts (scaled by ``sample``) and total; a new window starts."""
        s = self.sample
        counts, total = {k: c * s for k, c in self.counts.items()}, self.total * s
        self.counts, self.total = {}, 0
        return counts, total


def decide(
    counts: Mapping[bytes, int],
    total: int,
    window_s: float,
    *,
    r: int,
    current: Mapping[bytes, int],
    owns: Callable[[bytes], bool],
    floor: float,
    max_extras: int,
    limit: int = HOT_MAX_KEYS,
) -> dict[bytes, int]:
    """The hot keys a node publishes, key -> extra copies (see the module doc)."""
    if max_extras <= 0 or window_s <= 0 or not counts:
        return {}
    rates = {k: c / window_s for k, c in counts.items()}
    mine = {k: owns(k) for k in rates}
    node_rate = total / window_s
    # the node's cold load: its reads less those of keys it serves as another's extra copy and
    # those of its own keys that each carry a large share of it
    big = sum(v for k, v in rates.items() if not mine[k] or v >= node_rate * BIG_SHARE)
    per_copy = max(floor, (node_rate - big) * COPY_SHARE)
    out: dict[bytes, tuple[int, float]] = {}
    for key, rate in rates.items():
        prev = current.get(key, 0)
        est = rate * (r + prev) if prev else rate  # a hot key's reads are spread over all its copies
        if est < floor or not mine[key]:
            continue
        copies = math.ceil(est / per_copy)
        if copies <= 1:
            need = 0
        else:  # spread over every owner (a key that is not hot is read from its rank-0 owner only)
            need = min(max_extras, max(1, copies - r))
        if need < prev and math.ceil(est * SHRINK_MARGIN / per_copy) - r >= prev:
            need = prev
        if need > 0:
            out[key] = (need, est)
    top = sorted(out.items(), key=lambda kv: -kv[1][1])[:limit]
    return {k: need for k, (need, _) in top}


# -- extras ---------------------------------------------------------------------------------
def extras(table: Placement, key: bytes, r: int, k: int) -> list[str]:
    """The ``k`` extra nodes of ``key`` (beyond its ``r`` owners), deterministic; fewer when
    the cluster has fewer other nodes."""
    if k <= 0:
        return []
    owners = table.owners(key, r)
    names = table.nodes
    k = min(k, len(names) - len(owners))
    if k <= 0:
        return []
    seen, out = set(owners), []
    slot_owners = getattr(table, "slot_owners", None)
    if slot_owners is not None:
        col, s = slot_owners(0), slot_of(key)
        for i in range(1, 4 * k + 32):
            n = names[col[(s + i * STRIDE) & SLOT_MASK]]
            if n not in seen:
                seen.add(n)
                out.append(n)
                if len(out) == k:
                    return out
        start = s
    else:  # rendezvous-v1: the next nodes in the key's own ranking
        for n in table.ranked(key):  # type: ignore[attr-defined]
            if n not in seen:
                seen.add(n)
                out.append(n)
                if len(out) == k:
                    return out
        return out
    for j in range(len(names)):  # a walk that found too few (k close to the cluster's size)
        n = names[(start + j) % len(names)]
        if n not in seen:
            seen.add(n)
            out.append(n)
            if len(out) == k:
                break
    return out


# -- the record ----------------------------------------------------------------------------------
def to_json(hot: Mapping[bytes, int]) -> bytes:
    return json.dumps({"keys": {k.hex(): int(n) for k, n in sorted(hot.items())}}, sort_keys=True).encode()


def from_json(raw: bytes) -> dict[bytes, int]:
    """A ``hot/<node>`` record; ValueError if it does not parse (the watcher ignores it, logged)."""
    d = json.loads(raw)
    keys = d.get("keys") if isinstance(d, dict) else None
    if not isinstance(keys, dict):
        raise ValueError("a hot record is a JSON object with a 'keys' object")
    if len(keys) > HOT_MAX_KEYS:
        raise ValueError(f"a hot record lists at most {HOT_MAX_KEYS} keys, got {len(keys)}")
    out: dict[bytes, int] = {}
    for h, n in keys.items():
        key = bytes.fromhex(h)
        if len(key) != 16:
            raise ValueError(f"a hot key is 16 bytes, got {len(key)}")
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_EXTRAS:
            raise ValueError(f"extra copies must be an integer in [1, {MAX_EXTRAS}], got {n!r}")
        out[key] = n
    return out


class HotTable:
    """Every publisher's hot keys, merged (key -> the most copies any live publisher asks for).

    Updated one record at a time (a watch event), in time proportional to that record."""

    def __init__(self) -> None:
        self.by_node: dict[str, dict[bytes, int]] = {}
        self._pubs: dict[bytes, dict[str, int]] = {}
        self.merged: dict[bytes, int] = {}

    def set(self, node: str, keys: Mapping[bytes, int] | None) -> None:
        old = self.by_node.pop(node, {})
        if keys:
            self.by_node[node] = dict(keys)
        for key in set(old) | set(keys or ()):
            pubs = self._pubs.setdefault(key, {})
            if keys and key in keys:
                pubs[node] = keys[key]
            else:
                pubs.pop(node, None)
            if pubs:
                self.merged[key] = max(pubs.values())
            else:
                self._pubs.pop(key, None)
                self.merged.pop(key, None)


# -- an extra's copies ---------------------------------------------------------------------------
class ExtraCopies:
    """The keys one node holds as an extra copy, from the merged hot table: what to drop
    when a key leaves it (and this node is not one of the key's owners)."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.held: set[bytes] = set()
        self._memo: dict[bytes, tuple[tuple[int, int], Placement, bool]] = {}  # key -> ((k, r), table, mine)

    def update(self, table: Placement | None, hot: Mapping[bytes, int], r: int) -> list[bytes]:
        """The keys to delete here now (they left the hot set, or this node is no longer among
        their extras, and it does not own them)."""
        mine: set[bytes] = set()
        memo: dict[bytes, tuple[tuple[int, int], Placement, bool]] = {}
        if table is not None and len(table):
            for key, k in hot.items():
                got = self._memo.get(key)
                if got is None or got[0] != (k, r) or got[1] is not table:  # one walk per change
                    got = ((k, r), table, self.node_id in extras(table, key, r, k))
                memo[key] = got
                if got[2]:
                    mine.add(key)
        self._memo = memo
        gone = self.held - mine
        self.held = mine
        if not gone or table is None or not len(table):
            return []
        return [k for k in gone if self.node_id not in table.owners(k, r)]


def summary(hot: Mapping[bytes, int]) -> dict[str, Any]:
    return {"keys": len(hot), "extra_copies": sum(hot.values()), "max_extras": max(hot.values(), default=0)}

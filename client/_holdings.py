"""A compact index of one node's keys and the tiers holding them, for ``PoolView`` (architecture §3a).

Each key is kept as one ``uint64``: a 62-bit hash of the 16-byte chunk key
(:func:`key_hashes`: both halves folded into one, the low two bits cleared) with its tier
mask in the low two bits (bit 0 DRAM, bit 1 NVMe).  They sit in one sorted array, 8 bytes
a block, plus a dict of recent changes to keys the array lacks, merged into it once it
holds ``MERGE_AT`` keys.  A key dropped from the array keeps its slot with mask 0 until
the next merge.  A snapshot is sorted in place: building the index of N blocks takes
about 3 × 8 N bytes for a moment.

False positives: two different keys share a hash with probability 2^-62 per pair, so a
key the pool does not hold is reported held with probability about ``blocks / 2^62`` (at
10 million blocks, 2e-12 per lookup): it costs one ``Acquire`` that misses.  Such a pair
also shares its mask, so dropping one of the two reads as dropping both (a missed hit,
as rare).

Owner: :class:`NodeHoldings` is written by one thread only (its node's follower in
``client/_poolview.py``) and read by any thread; ``lock`` guards the array's contents and
the dict for both, and is held for at most ``_APPLY_SLICE`` changes at a time, so a lookup
never waits long.  A merge builds the new array outside the lock and swaps it in.

Invariants: ``_keys`` is sorted and holds each hash once; no hash is both in ``_keys`` and
in ``_recent``; ``blocks`` is the number of hashes with a non-zero mask.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvstore.errors import InvalidArgument
from kvstore.keys import KEY_BYTES

__all__ = ["DRAM_BIT", "DROPPED_SHIFT", "NVME_BIT", "NodeHoldings", "best_holders", "entries", "key_hashes"]

DRAM_BIT = 1
NVME_BIT = 2
TIERS = 3  # the mask bits of an entry
DROPPED_SHIFT = 4  # the high nibble of a ``changes`` byte: tiers that no longer hold the key
MERGE_AT = 1 << 16  # recent keys (about 7 MiB of dict) before they go into the array
_APPLY_SLICE = 256
_MIX = np.uint64(0x9E3779B97F4A7C15)  # odd: the high half is spread before it is folded in
_HASH = np.uint64(~TIERS & (2**64 - 1))
_TIERS64 = np.uint64(TIERS)

Hashes = npt.NDArray[np.uint64]
Masks = npt.NDArray[np.uint8]


def key_hashes(keys: bytes | Sequence[bytes]) -> Hashes:
    """The 62-bit hashes (low two bits zero) of chunk keys: 16-byte keys in a sequence, or
    packed in one bytes object (as a watch carries them).  ``InvalidArgument`` for a key of
    another length."""
    if isinstance(keys, (bytes, bytearray, memoryview)):
        buf = bytes(keys)
        if len(buf) % KEY_BYTES:
            raise InvalidArgument(f"packed keys take {KEY_BYTES} bytes each; got {len(buf)} bytes")
    else:
        buf = b"".join(keys)
        if len(buf) != KEY_BYTES * len(keys):
            bad = next(k for k in keys if not isinstance(k, bytes) or len(k) != KEY_BYTES)
            raise InvalidArgument(f"a chunk key is {KEY_BYTES} bytes, got {bad!r}")
    halves = np.frombuffer(buf, dtype="<u8").reshape(-1, 2)
    with np.errstate(over="ignore"):
        h = halves[:, 1] * _MIX
    h ^= halves[:, 0]
    h &= _HASH
    return h.astype(np.uint64, copy=False)


def entries(hashes: Hashes, masks: Masks) -> Hashes:
    """Index entries: each hash with its tier mask (``masks``' low two bits) in its low bits."""
    if len(hashes) != len(masks):
        raise InvalidArgument(f"{len(hashes)} hashes but {len(masks)} masks")
    return hashes | (masks & TIERS).astype(np.uint64)


class NodeHoldings:
    """What one node holds: hash → tier mask (see the module docstring)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._keys: Hashes = np.empty(0, np.uint64)
        self._recent: dict[int, int] = {}
        self.blocks = 0

    # -- the writer's side (one thread) ------------------------------------------------------
    def replace(self, snapshot: Hashes) -> None:
        """Hold exactly the ``snapshot`` entries (:func:`entries`; a hash may come more than
        once, its masks are OR-ed).  Sorts ``snapshot`` in place and may keep it."""
        v = snapshot
        v.sort()
        if len(v):
            h = v & _HASH
            starts = np.flatnonzero(np.concatenate(([True], h[1:] != h[:-1])))
            if len(starts) != len(v):  # a key in both tiers: one entry, masks OR-ed
                v = h[starts] | np.bitwise_or.reduceat(v & np.uint64(TIERS), starts)
            del h
            held = (v & np.uint64(TIERS)) != 0
            if not held.all():
                v = v[held]
        with self.lock:
            self._keys, self._recent = v, {}
            self.blocks = len(v)

    def clear(self) -> None:
        self.replace(np.empty(0, np.uint64))

    def apply(self, hashes: Hashes, changes: Masks) -> None:
        """Apply deltas in order: each ``changes`` byte sets the tiers in its low nibble and
        clears those in its high nibble (``DROPPED_SHIFT``)."""
        if len(hashes) != len(changes):
            raise InvalidArgument(f"{len(hashes)} hashes but {len(changes)} changes")
        keys = self._keys  # only this thread replaces it
        n = len(keys)
        if n:
            pos = np.minimum(np.searchsorted(keys, hashes), n - 1)
            found = ((keys[pos] & _HASH) == hashes).tolist()
            positions = pos.tolist()
        else:
            found, positions = [False] * len(hashes), [0] * len(hashes)
        held = (changes & TIERS).tolist()
        dropped = ((changes >> DROPPED_SHIFT) & TIERS).tolist()
        hs = hashes.tolist()
        for lo in range(0, len(hs), _APPLY_SLICE):
            with self.lock:
                recent, blocks = self._recent, self.blocks
                for i in range(lo, min(lo + _APPLY_SLICE, len(hs))):
                    h = hs[i]
                    old = int(keys[positions[i]]) & TIERS if found[i] else recent.get(h, 0)
                    new = (old | held[i]) & ~dropped[i]
                    if found[i]:
                        keys[positions[i]] = h | new
                    elif new:
                        recent[h] = new
                    elif old:
                        del recent[h]
                    blocks += (new != 0) - (old != 0)
                self.blocks = blocks
        if len(self._recent) >= MERGE_AT:
            self._merge()

    def _merge(self) -> None:
        """Move the recent keys into the array, dropping slots of keys no longer held."""
        base = self._keys[(self._keys & np.uint64(TIERS)) != 0]
        new = np.fromiter((h | m for h, m in self._recent.items()), np.uint64, len(self._recent))
        new.sort()
        keys = np.insert(base, np.searchsorted(base, new), new)
        with self.lock:
            self._keys, self._recent = keys, {}

    # -- readers (any thread) -----------------------------------------------------------------
    def lookup(self, hashes: Hashes) -> Masks:
        """The tier mask of each hash (0: not held)."""
        with self.lock:
            keys, recent = self._keys, self._recent
            if len(keys):
                pos = np.searchsorted(keys, hashes)
                np.minimum(pos, len(keys) - 1, out=pos)
                got = keys[pos]
                out = (got & _TIERS64).astype(np.uint8)
                out[(got & _HASH) != hashes] = 0
            else:
                out = np.zeros(len(hashes), np.uint8)
            if recent:
                for i, h in enumerate(hashes.tolist()):
                    m = recent.get(h)
                    if m:
                        out[i] = m
        return out

    def nbytes(self) -> int:
        """Memory the index takes: the array, and the dict of recent keys with its ints."""
        with self.lock:
            recent = self._recent
            return int(self._keys.nbytes) + (sys.getsizeof(recent) + 60 * len(recent) if recent else 0)


_SCORE = np.array([0, 2, 1, 2], np.uint8)  # by tier mask: 2 in DRAM, 1 on NVMe only, 0 nowhere


def best_holders(
    nodes: list[NodeHoldings] | tuple[NodeHoldings, ...], hashes: Hashes
) -> tuple[int, list[int], list[bool]]:
    """``(hits, node, in_dram)``: how many leading ``hashes`` some node holds, and for each
    of those the index of the node with the fastest copy (DRAM before NVMe; the first such
    node in ``nodes`` on a tie) and whether that copy is in DRAM."""
    if not nodes or not len(hashes):
        return 0, [], []
    score = _SCORE[np.stack([node.lookup(hashes) for node in nodes])]  # nodes × keys
    who = score.argmax(axis=0)  # the first node with the best score
    best = score[who, np.arange(len(hashes))]
    gaps = np.flatnonzero(best == 0)
    hits = int(gaps[0]) if len(gaps) else len(hashes)
    return hits, who[:hits].tolist(), (best[:hits] == 2).tolist()

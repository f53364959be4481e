"""A count-min sketch of recent key frequencies, with periodic halving (TinyLFU's estimator).

Owner: the eviction policy that holds it; not thread-safe.  Pure: no clock, no
process-random seed (rows are indexed by an xxh3 hash of the key), so a sequence of
calls always gives the same estimates.

Four rows of 4-bit-sized counters (kept in ``bytearray``\\ s, saturating at 15).  Every
``sample`` increments all counters are halved, so estimates follow the last ~``sample``
events and old popularity fades.  Memory is ``4 × width`` bytes whatever the number of
distinct keys, which is why the policies use it rather than a dict of every key seen:
it remembers blocks long after they were evicted.
"""

from __future__ import annotations

import xxhash

MAX_COUNT = 15
_HALVE = bytes(i >> 1 for i in range(256))
_ROWS = 4


class FrequencySketch:
    def __init__(self, width: int = 1 << 12, sample: int | None = None) -> None:
        if width <= 0 or width & (width - 1):
            raise ValueError(f"sketch width must be a power of two, got {width}")
        self.width = width
        self.sample = sample if sample is not None else 10 * width
        self._mask = width - 1
        self._rows = [bytearray(width) for _ in range(_ROWS)]
        self._events = 0
        self._last: tuple[bytes | None, tuple[int, int, int, int]] = (None, (0, 0, 0, 0))

    def _slots(self, key: bytes) -> tuple[int, int, int, int]:
        last, slots = self._last
        if key is last:  # a policy asks about the key it is inserting two or three times in a row
            return slots
        h = xxhash.xxh3_128_intdigest(key)
        m = self._mask
        slots = h & m, (h >> 32) & m, (h >> 64) & m, (h >> 96) & m
        self._last = (key, slots)
        return slots

    def estimate(self, key: bytes) -> int:
        a, b, c, d = self._slots(key)
        r = self._rows
        return min(r[0][a], r[1][b], r[2][c], r[3][d])

    def increment(self, key: bytes) -> int:
        """Count one event of ``key`` (conservative update) and return its new estimate."""
        slots = self._slots(key)
        r = self._rows
        cur = min(r[0][slots[0]], r[1][slots[1]], r[2][slots[2]], r[3][slots[3]])
        if cur < MAX_COUNT:
            cur += 1
            for row, s in zip(r, slots):
                if row[s] < cur:  # raise only the counters at the minimum: less overestimation
                    row[s] = cur
        self._events += 1
        if self._events >= self.sample:
            self.halve()
        return cur

    def halve(self) -> None:
        self._rows = [row.translate(_HALVE) for row in self._rows]
        self._events //= 2

    def resize(self, width: int) -> None:
        """A wider (or narrower) sketch; counts start again (only done while a tier fills up)."""
        self.__init__(width, 10 * width)  # type: ignore[misc]

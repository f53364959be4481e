"""Extent allocator over a linear space of fixed-size units (DRAM arena, NVMe segments).

Owner: the tier that constructed it; not thread-safe (the owning tier serialises calls).

Policy: best-fit over free extents, coalescing neighbours on free.  When no single
free extent is large enough but the total free space is, an allocation is served
as several extents (largest first), so mixed block sizes can never fragment the
space "to failure": an allocation fails only if the free *total* is short.
Callers that need one contiguous range (``contiguous=True``) get ``None`` instead
and decide whether to evict more.

Invariants: free extents never overlap or touch (touching ones are merged);
``free_units + allocated units == total_units``.
"""

from __future__ import annotations

from collections.abc import Sequence

from sortedcontainers import SortedDict, SortedList

from kvstore.errors import InvalidArgument
from kvstore.vocabulary import Extent as Extent  # re-exported: the tiers and the node import it from here


class ExtentAllocator:
    def __init__(self, total_bytes: int, unit: int = 64 * 1024) -> None:
        if unit <= 0 or unit & (unit - 1):
            raise InvalidArgument(f"allocator unit must be a power of two, got {unit}")
        if total_bytes < unit:
            raise InvalidArgument(f"allocator space of {total_bytes} bytes is smaller than one unit ({unit})")
        self.unit = unit
        self.total_units = total_bytes // unit
        self._by_start: SortedDict = SortedDict()  # start unit -> length in units
        self._by_size: SortedList = SortedList()  # (length, start)
        self._free_units = 0
        self._insert(0, self.total_units)

    # -- accounting ---------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self.total_units * self.unit

    @property
    def free_bytes(self) -> int:
        return self._free_units * self.unit

    @property
    def used_bytes(self) -> int:
        return self.capacity_bytes - self.free_bytes

    @property
    def largest_free_bytes(self) -> int:
        return self._by_size[-1][0] * self.unit if self._by_size else 0

    def units_for(self, nbytes: int) -> int:
        return max(1, -(-nbytes // self.unit))

    def rounded(self, nbytes: int) -> int:
        """Bytes an allocation of ``nbytes`` really takes."""
        return self.units_for(nbytes) * self.unit

    # -- operations ---------------------------------------------------------------
    def allocate(self, nbytes: int, *, contiguous: bool = False) -> list[Extent] | None:
        """Extents covering at least ``nbytes`` (rounded up to units), or ``None`` if short of space."""
        if nbytes < 0:
            raise InvalidArgument(f"cannot allocate {nbytes} bytes")
        need = self.units_for(nbytes)
        if need > self.total_units:
            raise InvalidArgument(f"{nbytes} bytes exceed the whole space ({self.capacity_bytes} bytes)")
        i = self._by_size.bisect_left((need, -1))
        if i < len(self._by_size):
            length, start = self._by_size[i]
            self._remove(start, length)
            if length > need:
                self._insert(start + need, length - need)
            return [Extent(start * self.unit, need * self.unit)]
        if contiguous or need > self._free_units:
            return None
        out: list[Extent] = []
        while need > 0:
            length, start = self._by_size[-1]
            take = min(length, need)
            self._remove(start, length)
            if length > take:
                self._insert(start + take, length - take)
            out.append(Extent(start * self.unit, take * self.unit))
            need -= take
        return out

    def allocate_many(self, sizes: Sequence[int]) -> list[list[Extent]] | None:
        """Extents for each of ``sizes`` (rounded up to units), from one allocation of their
        total carved in order: one sorted-container update per batch instead of one per
        block.  A block may get several extents where the space the batch got is in pieces.
        ``None`` (nothing allocated) if the free total is short."""
        units = [self.units_for(n) for n in sizes]
        total = sum(units)
        if not units:
            return []
        if total > self._free_units:
            return None
        got = self.allocate(total * self.unit)
        assert got is not None  # the free total suffices: allocate serves it in pieces if it must
        out: list[list[Extent]] = []
        pieces = iter(got)
        cur = next(pieces)
        pos, end = cur.offset, cur.end
        unit = self.unit
        for need in units:
            want = need * unit
            if end - pos >= want:  # the usual case: the block fits in the current piece
                out.append([Extent(pos, want)])
                pos += want
                continue
            mine: list[Extent] = []
            while want:
                if pos == end:
                    cur = next(pieces)
                    pos, end = cur.offset, cur.end
                take = min(want, end - pos)
                mine.append(Extent(pos, take))
                pos += take
                want -= take
            out.append(mine)
        return out

    def reserve_exact(self, extent: Extent) -> None:
        """Mark a specific range used (rebuilding state from a persisted index)."""
        s, n = extent.offset // self.unit, extent.length // self.unit
        if extent.offset % self.unit or extent.length % self.unit or n <= 0:
            raise InvalidArgument(f"extent {extent} is not unit-aligned")
        i = self._by_start.bisect_right(s) - 1
        if i < 0:
            raise InvalidArgument(f"extent {extent} is not free")
        fs, fl = self._by_start.peekitem(i)
        if s + n > fs + fl:
            raise InvalidArgument(f"extent {extent} is not free")
        self._remove(fs, fl)
        if s > fs:
            self._insert(fs, s - fs)
        if fs + fl > s + n:
            self._insert(s + n, fs + fl - (s + n))

    def reserve_many(self, used: Sequence[Sequence[int]]) -> None:
        """``reserve_exact`` of many ranges (``(offset, length, ...)``: further items are
        ignored), sorted by offset, in one pass (a restart reserves every stored block:
        O(n), not n sorted-container updates).  All or nothing: ``InvalidArgument`` if one
        is misaligned, overlaps another or is not free, and then nothing is reserved."""
        unit = self.unit
        free = list(self._by_start.items())  # (start, length) in units, sorted
        out: list[tuple[int, int]] = []
        fi = 0
        cur_s, cur_e = (free[0][0], free[0][0] + free[0][1]) if free else (0, 0)
        for u in used:
            off, length = u[0], u[1]
            s, n = off // unit, length // unit
            if off % unit or length % unit or n <= 0:
                raise InvalidArgument(f"extent {Extent(off, length)} is not unit-aligned")
            while fi < len(free) and s >= cur_e:  # past this free extent: keep what is left of it
                if cur_e > cur_s:
                    out.append((cur_s, cur_e - cur_s))
                fi += 1
                if fi < len(free):
                    cur_s, cur_e = free[fi][0], free[fi][0] + free[fi][1]
            if fi == len(free) or s < cur_s or s + n > cur_e:
                raise InvalidArgument(f"extent {Extent(off, length)} is not free")
            if s > cur_s:
                out.append((cur_s, s - cur_s))
            cur_s = s + n
        if fi < len(free):
            if cur_e > cur_s:
                out.append((cur_s, cur_e - cur_s))
            out.extend(free[fi + 1 :])
        self._by_start = SortedDict(out)
        self._by_size = SortedList((n, s) for s, n in out)
        self._free_units = sum(n for _, n in out)

    def free(self, extents: list[Extent]) -> None:
        for e in extents:
            s, n = e.offset // self.unit, e.length // self.unit
            # merge with the free neighbour on the left and on the right
            i = self._by_start.bisect_left(s)
            if i < len(self._by_start):
                ns, nl = self._by_start.peekitem(i)
                assert ns >= s + n, f"double free of {e}"
                if ns == s + n:
                    self._remove(ns, nl)
                    n += nl
            if i > 0:
                ps, pl = self._by_start.peekitem(i - 1)
                assert ps + pl <= s, f"double free of {e}"
                if ps + pl == s:
                    self._remove(ps, pl)
                    s, n = ps, pl + n
            self._insert(s, n)

    def _insert(self, start: int, length: int) -> None:
        self._by_start[start] = length
        self._by_size.add((length, start))
        self._free_units += length

    def _remove(self, start: int, length: int) -> None:
        del self._by_start[start]
        self._by_size.remove((length, start))
        self._free_units -= length

"""The extent allocator: accounting, best fit, coalescing, rebuild, and "never fragments to failure".

Randomised tests use seeded ``random.Random`` so every failure replays exactly.  A
shadow bitmap (one byte per unit) is the independent model the allocator is
checked against.
"""

from __future__ import annotations

import random
import statistics

import pytest

from kvstore.errors import InvalidArgument
from tiers.allocator import Extent, ExtentAllocator

KiB = 1024
MiB = 1024 * KiB


# -- helpers -------------------------------------------------------------------------


def free_runs(a: ExtentAllocator) -> list[tuple[int, int]]:
    """The allocator's free extents as (start unit, length in units), by start (reads private state)."""
    return list(a._by_start.items())


def check_invariants(a: ExtentAllocator, used: bytearray | None = None) -> None:
    """Free extents are sorted, non-empty, in range, never touching; both indexes agree; the
    accounting adds up; and (if given) the shadow bitmap marks exactly the complement as used."""
    runs = free_runs(a)
    assert sorted(a._by_size) == sorted((n, s) for s, n in runs)
    prev_end = -1
    for s, n in runs:
        assert n > 0 and s >= 0 and s + n <= a.total_units
        assert s > prev_end, f"free extents touch or overlap at unit {s}"
        prev_end = s + n
    free_units = sum(n for _, n in runs)
    assert a.free_bytes == free_units * a.unit
    assert a.used_bytes + a.free_bytes == a.capacity_bytes == a.total_units * a.unit
    assert a.largest_free_bytes == max((n for _, n in runs), default=0) * a.unit
    if used is not None:
        expect = bytearray(b"\x01") * a.total_units
        for s, n in runs:
            expect[s : s + n] = bytes(n)
        assert used == expect


class Shadow:
    """An allocator plus an independent bitmap model of which units are in use."""

    def __init__(self, a: ExtentAllocator) -> None:
        self.a = a
        self.used = bytearray(a.total_units)
        self.live: list[list[Extent]] = []

    def units(self, e: Extent) -> tuple[int, int]:
        assert e.offset % self.a.unit == 0 and e.length % self.a.unit == 0 and e.length > 0
        return e.offset // self.a.unit, e.length // self.a.unit

    def take(self, extents: list[Extent]) -> None:
        for e in extents:
            s, n = self.units(e)
            assert s + n <= self.a.total_units
            assert self.used.find(1, s, s + n) == -1, f"{e} overlaps an allocated range"
            self.used[s : s + n] = b"\x01" * n
        self.live.append(extents)

    def give(self, i: int) -> None:
        extents = self.live.pop(i)
        for e in extents:
            s, n = self.units(e)
            self.used[s : s + n] = bytes(n)
        self.a.free(extents)

    @property
    def used_units(self) -> int:
        return self.used.count(1)


# -- construction and sizes ------------------------------------------------------------


@pytest.mark.parametrize("unit", [0, -4, 3, 48, 4096 + 1])
def test_unit_must_be_a_power_of_two(unit: int) -> None:
    with pytest.raises(InvalidArgument, match="power of two"):
        ExtentAllocator(1 * MiB, unit)


def test_space_smaller_than_one_unit() -> None:
    with pytest.raises(InvalidArgument, match="smaller than one unit"):
        ExtentAllocator(4095, 4096)
    with pytest.raises(InvalidArgument):
        ExtentAllocator(0, 4096)
    assert ExtentAllocator(4096, 4096).capacity_bytes == 4096


def test_capacity_rounds_down_to_whole_units() -> None:
    a = ExtentAllocator(10 * 4096 + 4095, 4096)
    assert a.total_units == 10 and a.capacity_bytes == 40960
    assert a.free_bytes == a.largest_free_bytes == 40960 and a.used_bytes == 0
    check_invariants(a)


def test_default_unit_is_64_kib() -> None:
    assert ExtentAllocator(1 * MiB).unit == 64 * KiB


@pytest.mark.parametrize(
    ("nbytes", "units"), [(0, 1), (1, 1), (4095, 1), (4096, 1), (4097, 2), (8192, 2), (4 * MiB + 4 * KiB, 1025)]
)
def test_units_rounding(nbytes: int, units: int) -> None:
    a = ExtentAllocator(8 * MiB, 4096)
    assert a.units_for(nbytes) == units
    assert a.rounded(nbytes) == units * 4096
    (e,) = a.allocate(nbytes)
    assert e.length == units * 4096 and a.used_bytes == units * 4096


def test_bad_requests() -> None:
    a = ExtentAllocator(16 * 4096, 4096)
    with pytest.raises(InvalidArgument):
        a.allocate(-1)
    with pytest.raises(InvalidArgument, match="exceed the whole space"):
        a.allocate(16 * 4096 + 1)
    with pytest.raises(InvalidArgument):
        a.allocate(17 * 4096, contiguous=True)
    assert a.free_bytes == a.capacity_bytes  # failed calls change nothing
    (whole,) = a.allocate(16 * 4096)
    assert whole == Extent(0, 16 * 4096)
    assert a.allocate(1) is None and a.allocate(1, contiguous=True) is None


# -- basic operation -----------------------------------------------------------------


def test_alloc_free_coalesce() -> None:
    a = ExtentAllocator(4 * 4096, 4096)
    x, y, z = (a.allocate(4096) for _ in range(3))
    assert [x, y, z] == [[Extent(0, 4096)], [Extent(4096, 4096)], [Extent(8192, 4096)]]
    assert free_runs(a) == [(3, 1)]
    a.free(x)
    a.free(z)  # merges with the free tail on its right
    assert free_runs(a) == [(0, 1), (2, 2)]
    check_invariants(a)
    a.free(y)  # merges left and right: one run again
    assert free_runs(a) == [(0, 4)]
    assert a.free_bytes == a.largest_free_bytes == a.capacity_bytes
    check_invariants(a)


def test_extent_end() -> None:
    assert Extent(4096, 8192).end == 12288


def test_best_fit_picks_the_smallest_hole_that_fits() -> None:
    a = ExtentAllocator(32 * 4096, 4096)
    blocks = [a.allocate(n * 4096) for n in (3, 1, 2, 1, 5, 1)]  # holes of 3, 2, 5 units once freed
    for i in (0, 2, 4):
        a.free(blocks[i])
    assert free_runs(a) == [(0, 3), (4, 2), (7, 5), (13, 19)]
    assert a.allocate(2 * 4096) == [Extent(4 * 4096, 2 * 4096)]  # the 2-hole, not the first
    assert a.allocate(4 * 4096) == [Extent(7 * 4096, 4 * 4096)]  # the 5-hole, leaving 1
    assert a.allocate(1 * 4096) == [Extent(11 * 4096, 4096)]  # the 1 left over
    check_invariants(a)


def test_contiguous_returns_none_when_fragmented_but_the_total_would_do() -> None:
    a = ExtentAllocator(8 * 4096, 4096)
    blocks = [a.allocate(4096) for _ in range(8)]
    for i in (1, 3, 6):
        a.free(blocks[i])
    assert a.free_bytes == 3 * 4096 and a.largest_free_bytes == 4096
    before = free_runs(a)
    assert a.allocate(2 * 4096, contiguous=True) is None
    assert free_runs(a) == before  # a refused request changes nothing
    got = a.allocate(3 * 4096)
    assert got is not None and len(got) == 3
    assert sorted(e.offset // 4096 for e in got) == [1, 3, 6]
    assert a.free_bytes == 0
    a.free(got)
    assert a.free_bytes == 3 * 4096
    check_invariants(a)


def test_split_allocation_takes_largest_extents_first() -> None:
    a = ExtentAllocator(12 * 4096, 4096)
    blocks = [a.allocate(n * 4096) for n in (1, 1, 3, 1, 2, 1, 3)]
    for i in (0, 2, 4):
        a.free(blocks[i])
    assert free_runs(a) == [(0, 1), (2, 3), (6, 2)]
    got = a.allocate(5 * 4096)
    assert got == [Extent(2 * 4096, 3 * 4096), Extent(6 * 4096, 2 * 4096)]
    assert a.allocate(2 * 4096) is None  # 1 unit left, in one hole
    check_invariants(a)


def test_double_free_is_caught() -> None:
    a = ExtentAllocator(8 * 4096, 4096)
    x = a.allocate(2 * 4096)
    a.allocate(4096)
    a.free(x)
    with pytest.raises(AssertionError, match="double free"):
        a.free(x)
    with pytest.raises(AssertionError, match="double free"):
        a.free([Extent(4096, 4096)])  # inside a free run
    with pytest.raises(AssertionError, match="double free"):
        a.free([Extent(4096, 2 * 4096)])  # straddles the end of a free run


# -- reserve_exact (rebuild from a persisted index) -------------------------------------------------


def test_reserve_exact_rebuilds_the_same_state() -> None:
    rng = random.Random(11)
    a = ExtentAllocator(512 * 4096, 4096)
    sh = Shadow(a)
    for _ in range(300):
        if sh.live and rng.random() < 0.45:
            sh.give(rng.randrange(len(sh.live)))
        else:
            got = a.allocate(rng.randint(1, 12 * 4096))
            if got is not None:
                sh.take(got)
    persisted = [e for extents in sh.live for e in extents]
    rng.shuffle(persisted)  # the index comes back in its own order, not allocation order

    b = ExtentAllocator(512 * 4096, 4096)
    for e in persisted:
        b.reserve_exact(e)
    assert free_runs(b) == free_runs(a)
    assert b.free_bytes == a.free_bytes and b.largest_free_bytes == a.largest_free_bytes
    check_invariants(b, sh.used)
    # and the rebuilt allocator carries on: freeing everything leaves one run
    b.free(persisted)
    assert free_runs(b) == [(0, 512)]


def test_reserve_exact_errors() -> None:
    a = ExtentAllocator(16 * 4096, 4096)
    a.reserve_exact(Extent(4 * 4096, 4 * 4096))
    assert free_runs(a) == [(0, 4), (8, 8)]
    bad = [
        Extent(4 * 4096, 4096),  # already used
        Extent(3 * 4096, 2 * 4096),  # straddles into used
        Extent(7 * 4096, 2 * 4096),  # starts inside used
        Extent(100, 4096),  # unaligned offset
        Extent(0, 100),  # unaligned length
        Extent(0, 0),  # empty
        Extent(14 * 4096, 4 * 4096),  # past the end
        Extent(16 * 4096, 4096),  # wholly past the end
        Extent(-4096, 4096),
    ]
    for e in bad:
        with pytest.raises(InvalidArgument):
            a.reserve_exact(e)
    assert free_runs(a) == [(0, 4), (8, 8)]  # refused calls change nothing
    a.reserve_exact(Extent(0, 4 * 4096))
    a.reserve_exact(Extent(15 * 4096, 4096))
    assert free_runs(a) == [(8, 7)]
    check_invariants(a)


# -- randomised properties ----------------------------------------------------------------


@pytest.mark.parametrize("seed", range(12))
def test_random_sequences_never_overlap_and_account_exactly(seed: int) -> None:
    rng = random.Random(seed)
    unit = 64
    a = ExtentAllocator(200 * unit + rng.randrange(unit), unit)
    sh = Shadow(a)
    for _ in range(400):
        op = rng.random()
        if op < 0.35 and sh.live:
            sh.give(rng.randrange(len(sh.live)))
        elif op < 0.45:
            # reserve a random range: must succeed exactly when the model says it is free
            s, n = rng.randrange(a.total_units), rng.randint(1, 8)
            is_free = s + n <= a.total_units and sh.used.find(1, s, s + n) == -1
            e = Extent(s * unit, n * unit)
            if is_free:
                a.reserve_exact(e)
                sh.take([e])
            else:
                with pytest.raises(InvalidArgument):
                    a.reserve_exact(e)
        else:
            nbytes = rng.randint(0, 40 * unit)
            contiguous = rng.random() < 0.3
            need = a.units_for(nbytes)
            runs = free_runs(a)
            fitting = min(((n, s) for s, n in runs if n >= need), default=None)
            got = a.allocate(nbytes, contiguous=contiguous)
            if fitting is not None:  # best fit: the smallest run that fits, lowest start first
                assert got == [Extent(fitting[1] * unit, need * unit)]
            elif contiguous or need > sum(n for _, n in runs):
                assert got is None
            else:  # never fragments to failure: split over several runs
                assert got is not None and len(got) > 1
            if got is not None:
                assert sum(e.length for e in got) == need * unit
                sh.take(got)
        assert a.used_bytes == sh.used_units * unit
        check_invariants(a, sh.used)
    while sh.live:
        sh.give(len(sh.live) - 1)
    assert free_runs(a) == [(0, a.total_units)]


SIZES = {"256KiB": 256 * KiB, "1MiB": 1 * MiB, "4MiB": 4 * MiB, "4MiB+4KiB": 4 * MiB + 4 * KiB, "32MiB": 32 * MiB}


def churn(sizes: list[int], seed: int, steps: int) -> tuple[list[int], int]:
    """Fill a 256 MiB space (4 KiB units) to 90 % with blocks of ``sizes``, then free and allocate at
    random for ``steps`` steps.  Returns the extent count of every allocation made while churning,
    and how many requests were refused.  Asserts that a request fails only when the free total is short."""
    rng = random.Random(seed)
    a = ExtentAllocator(256 * MiB, 4 * KiB)
    sh = Shadow(a)
    target = 0.9 * a.capacity_bytes
    counts: list[int] = []
    refused = 0

    def one() -> bool:
        nonlocal refused
        nbytes = rng.choice(sizes)
        fits = a.free_bytes >= a.rounded(nbytes)
        got = a.allocate(nbytes)
        assert (got is not None) == fits, f"refused {nbytes} with {a.free_bytes} bytes free"
        if got is None:
            refused += 1
            return False
        sh.take(got)
        counts.append(len(got))
        return True

    while a.used_bytes < target and one():
        pass
    counts.clear()
    for step in range(steps):
        while a.used_bytes > target:
            sh.give(rng.randrange(len(sh.live)))
        if rng.random() < 0.5:
            sh.give(rng.randrange(len(sh.live)))
        one()
        if step % 500 == 0:
            check_invariants(a, sh.used)
    check_invariants(a, sh.used)
    return counts, refused


@pytest.mark.parametrize("seed", range(3))
def test_mixed_sizes_never_fragment_to_failure(seed: int) -> None:
    counts, refused = churn(list(SIZES.values()), seed, steps=5000)
    mean = statistics.mean(counts)
    print(
        f"mixed sizes, seed {seed}: {len(counts)} allocations, mean {mean:.3f} extents, "
        f"max {max(counts)}, single-extent {counts.count(1) / len(counts):.1%}, refused (short) {refused}"
    )
    assert len(counts) > 4000
    assert mean < 2.0
    assert counts.count(1) / len(counts) > 0.75


@pytest.mark.parametrize("name", sorted(SIZES))
def test_single_size_workloads_stay_contiguous(name: str) -> None:
    counts, _ = churn([SIZES[name]], seed=1, steps=2000)
    print(f"{name}: {len(counts)} allocations, mean {statistics.mean(counts):.3f} extents")
    assert statistics.mean(counts) < 2.0
    # one size: every hole is a multiple of the block, so every allocation is one extent
    assert max(counts) == 1


def test_reserve_many_is_reserve_exact_in_one_pass() -> None:
    """Issue 15 #3: a restart reserves every stored block at once; the result is the same
    as one ``reserve_exact`` each, and a range that is not free reserves nothing."""
    used = [(0, 4), (8, 4), (20, 8), (60, 4)]
    one, many = ExtentAllocator(64 * 4, unit=4), ExtentAllocator(64 * 4, unit=4)
    one.reserve_exact(Extent(100, 8))
    many.reserve_exact(Extent(100, 8))
    for off, n in used:
        one.reserve_exact(Extent(off, n))
    many.reserve_many(used)
    assert list(many._by_start.items()) == list(one._by_start.items()) and many.free_bytes == one.free_bytes
    assert list(many._by_size) == list(one._by_size)
    before = list(many._by_start.items())
    with pytest.raises(InvalidArgument):
        many.reserve_many([(32, 4), (100, 4)])  # the second is taken
    with pytest.raises(InvalidArgument):
        many.reserve_many([(33, 4)])  # misaligned
    assert list(many._by_start.items()) == before

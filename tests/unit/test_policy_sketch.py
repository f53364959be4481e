"""The count-min frequency sketch behind the reuse-aware policies: deterministic, saturating, ageing."""

from __future__ import annotations

import pytest

from tiers.sketch import MAX_COUNT, FrequencySketch


def k(i: int) -> bytes:
    return i.to_bytes(16, "big")


def test_counts_and_saturates() -> None:
    s = FrequencySketch(1 << 10, sample=10**9)
    assert s.estimate(k(1)) == 0
    assert [s.increment(k(1)) for _ in range(3)] == [1, 2, 3]
    assert s.estimate(k(1)) == 3 and s.estimate(k(2)) == 0
    for _ in range(40):
        s.increment(k(1))
    assert s.estimate(k(1)) == MAX_COUNT


def test_halves_every_sample_events() -> None:
    s = FrequencySketch(1 << 10, sample=100)
    for _ in range(8):
        s.increment(k(1))
    for i in range(92):  # the 100th event triggers the halving
        s.increment(k(1000 + i))
    assert s.estimate(k(1)) == 4
    assert s.estimate(k(1000)) == 0  # 1 >> 1


def test_deterministic_across_instances() -> None:
    a, b = FrequencySketch(1 << 8, sample=500), FrequencySketch(1 << 8, sample=500)
    seq = [k(i % 97) for i in range(2000)]
    assert [a.increment(x) for x in seq] == [b.increment(x) for x in seq]


def test_few_overestimates_when_not_crowded() -> None:
    s = FrequencySketch(1 << 12, sample=10**9)
    for i in range(500):
        s.increment(k(i))
    assert sum(s.estimate(k(i)) for i in range(500, 1500)) <= 5  # never-seen keys mostly read 0


def test_resize_starts_again() -> None:
    s = FrequencySketch(1 << 8)
    s.increment(k(1))
    s.resize(1 << 10)
    assert s.width == 1 << 10 and s.sample == 10 << 10 and s.estimate(k(1)) == 0


@pytest.mark.parametrize("width", [0, 3, 1000])
def test_width_must_be_a_power_of_two(width: int) -> None:
    with pytest.raises(ValueError, match="power of two"):
        FrequencySketch(width)

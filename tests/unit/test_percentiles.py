"""One rule for every p50 and p99 the project prints (``kvstore.vocabulary.percentiles``):
linear interpolation between the closest ranks, numpy's default, checked against numpy."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore.vocabulary import percentile, percentiles


@given(
    st.lists(st.floats(-1e9, 1e9, allow_nan=False), min_size=1, max_size=300),
    st.floats(0, 100, allow_nan=False),
)
def test_a_percentile_is_numpys_linear_one(values: list[float], q: float) -> None:
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-9, abs=1e-6)


def test_the_ends_the_median_and_the_order_of_input() -> None:
    xs = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert (percentile(xs, 0), percentile(xs, 50), percentile(xs, 100)) == (1.0, 3.0, 5.0)
    assert percentile([1.0, 2.0], 50) == 1.5 and percentile([7.0], 99) == 7.0


def test_keys_scale_digits_and_no_values() -> None:
    assert percentiles([0.001, 0.002, 0.003], (50, 99), scale=1e3, digits=2, suffix="_ms") == {
        "p50_ms": 2.0,
        "p99_ms": 2.98,
    }
    assert percentiles([1.0, 2.0], (50, 99.9)) == {"p50": 1.5, "p99.9": pytest.approx(1.999)}
    assert percentiles([], (50, 90)) == {"p50": None, "p90": None}
    assert percentiles(iter([3.0, 1.0, 2.0])) == {"p50": 2.0, "p99": pytest.approx(2.98)}


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)
    with pytest.raises(ValueError, match="between 0 and 100"):
        percentile([1.0], 101)

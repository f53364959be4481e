"""Named failure points: the spec grammar, pass/fail counts, and the errors each action raises."""

from __future__ import annotations

import errno
from collections.abc import Iterator

import lmdb
import pytest

from tiers import failpoints


@pytest.fixture(autouse=True)
def disarmed() -> Iterator[None]:
    failpoints.disarm()
    yield
    failpoints.disarm()


def test_after_and_times() -> None:
    failpoints.arm("nvme.sync=eio@2*1")
    failpoints.hit("nvme.sync")
    failpoints.hit("nvme.sync")
    with pytest.raises(OSError) as e:
        failpoints.hit("nvme.sync")
    assert e.value.errno == errno.EIO and "failpoint nvme.sync=eio" in str(e.value)
    failpoints.hit("nvme.sync")  # fired its one time: disarmed
    failpoints.hit("nvme.write")  # never armed


def test_short_does_part_of_the_work_then_fails() -> None:
    done: list[str] = []
    failpoints.arm("nvme.write=short")
    with pytest.raises(OSError):
        failpoints.hit("nvme.write", short=lambda: done.append("half"))
    assert done == ["half"]


def test_a_step_raises_what_its_library_would() -> None:
    failpoints.arm("nvme.index.commit=enospc")
    with pytest.raises(lmdb.DiskError):
        failpoints.hit("nvme.index.commit", errors={"enospc": lmdb.DiskError})


@pytest.mark.parametrize(
    "spec", ["nvme.nope=eio", "nvme.sync=explode", "nvme.sync", "nvme.sync=eio@x", "nvme.sync=eio*"]
)
def test_bad_specs_are_refused(spec: str) -> None:
    with pytest.raises(ValueError, match="bad failpoint"):
        failpoints.parse(spec)

"""Named failure points (etcd's gofail, in miniature): a fault test makes one chosen step fail.

Role: the code marks the steps where the outside world can fail it with
``failpoints.hit("nvme.sync")``; a point does nothing unless it is armed.  Fault tests arm
points in a real node through its environment, read once at import::

    KVSTORE_FAILPOINTS="nvme.sync=eio;nvme.index.commit=enospc@3*2"

Each item is ``NAME=ACTION[@AFTER][*TIMES]``: the point passes ``AFTER`` times (default 0),
then fails ``TIMES`` times (default: for ever).  Actions:

* ``eio``, ``enospc``, ``edquot``: raise the ``OSError`` a failing or full disk raises (or,
  where the caller names one for that action, the error its library raises instead);
* ``short``: a short write: the caller's ``short`` callback does part of the work, then EIO;
* ``kill``: SIGKILL this process right there (a crash at exactly that step).

The points and what they cover are listed in ``POINTS``; arming an unknown one is an error,
so a renamed point cannot silently turn a fault test into a no-op.

Where it lives: with the points it serves.  Most of them are the NVMe tier's (``nvme.*``, in
``tiers/nvme.py``, ``tiers/nvme_segments.py``, ``tiers/nvme_index.py``), so it sits in
``tiers/``, the lowest package that marks a point; the node (``node.acquire``, in
``kvstore/node/service.py``) imports it downwards.  It imports nothing of the project.

Owner: this module owns its state, the module-level tables ``_armed`` and ``fired``:
written by :func:`arm` / :func:`disarm` (at import, from ``KVSTORE_FAILPOINTS``, and by
tests) and consumed by :func:`hit` under ``_lock``, from any thread.  One table per process.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import signal
import threading
from collections.abc import Callable, Mapping

ENV = "KVSTORE_FAILPOINTS"

POINTS: dict[str, str] = {
    "nvme.preallocate": "reserving a segment's space on disk before its first record (posix_fallocate)",
    "nvme.write": "writing a record (header and payload) to its segment; 'short' writes half of it",
    "nvme.sync": "fdatasync of the segments a group commit wrote, before its index entries",
    "nvme.index.commit": "the lmdb transaction that adds index entries and removes deleted ones",
    "node.acquire": "answering an Acquire once its leases are granted ('kill': the node dies in the middle of a reader's load)",
}
_ERRNO = {"eio": errno.EIO, "enospc": errno.ENOSPC, "edquot": errno.EDQUOT}
ACTIONS = (*_ERRNO, "short", "kill")


@dataclasses.dataclass(slots=True)
class _Armed:
    action: str
    after: int = 0  # passes left before it fires
    times: int | None = None  # fires left; None: for ever


_lock = threading.Lock()
_armed: dict[str, _Armed] = {}
fired: dict[str, int] = {}
"""How many times each point fired in this process (tests read it)."""


def parse(spec: str) -> dict[str, _Armed]:
    """``NAME=ACTION[@AFTER][*TIMES];...`` → armed points.  Raises ``ValueError`` naming the bad item."""
    out: dict[str, _Armed] = {}
    for item in filter(None, (s.strip() for s in spec.replace(",", ";").split(";"))):
        name, sep, rest = item.partition("=")
        rest, star, times = rest.partition("*")
        action, at, after = rest.partition("@")
        if (
            not sep
            or name not in POINTS
            or action not in ACTIONS
            or (at and not after.isdigit())
            or (star and not (times.isdigit() and int(times) > 0))
        ):
            raise ValueError(
                f"bad failpoint {item!r}: expected NAME=ACTION[@AFTER][*TIMES] with NAME in "
                f"{sorted(POINTS)} and ACTION in {list(ACTIONS)}"
            )
        out[name] = _Armed(action, int(after or 0), int(times) if times else None)
    return out


def arm(spec: str) -> None:
    """Arm the points in ``spec`` (added to those already armed)."""
    points = parse(spec)
    with _lock:
        _armed.update(points)


def disarm(name: str | None = None) -> None:
    """Disarm one point, or all of them."""
    with _lock:
        if name is None:
            _armed.clear()
        else:
            _armed.pop(name, None)


def hit(
    name: str,
    *,
    short: Callable[[], None] | None = None,
    errors: Mapping[str, Callable[[str], BaseException]] | None = None,
) -> None:
    """Mark the step ``name``: nothing unless it is armed and due, else fail it as armed.

    ``short`` does part of the step's work for the ``short`` action (without it, ``short``
    fails like ``eio``); ``errors`` maps an action to the exception this step's library
    would raise for it (lmdb raises ``DiskError``, not ``OSError``, on a full disk)."""
    if not _armed:  # the common case: one dict check, no lock
        return
    assert name in POINTS, f"unknown failpoint {name}"
    with _lock:
        a = _armed.get(name)
        if a is None:
            return
        if a.after > 0:
            a.after -= 1
            return
        if a.times is not None:
            a.times -= 1
            if a.times <= 0:
                del _armed[name]
        fired[name] = fired.get(name, 0) + 1
    what = f"failpoint {name}={a.action}"
    if a.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if a.action == "short" and short is not None:
        short()
    if errors and a.action in errors:
        raise errors[a.action](what)
    code = _ERRNO.get(a.action, errno.EIO)
    raise OSError(code, f"{os.strerror(code)} ({what})")


if os.environ.get(ENV):
    arm(os.environ[ENV])

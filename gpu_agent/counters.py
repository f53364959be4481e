"""What kvstore's engine integrations (the SGLang backend, the LMCache adapters) share: counters
kept under one lock (:class:`LockedCounters`, a consistent :meth:`~LockedCounters.snapshot`)
and a batched read in which one oversized block is one miss (:func:`read_into`)."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import Any

from kvstore.errors import InvalidArgument


@dataclasses.dataclass
class LockedCounters:
    """A dataclass of numeric counters guarded by :attr:`lock` (subclasses add the fields);
    fields that are not numbers (per-call lists) are left out of snapshots."""

    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False, compare=False)

    def snapshot(self) -> dict[str, float]:
        """Every numeric field, read under the lock (one consistent moment)."""
        with self.lock:
            return {
                f.name: getattr(self, f.name)
                for f in dataclasses.fields(self)
                if f.name != "lock" and isinstance(getattr(self, f.name), int | float)
            }


OVERSIZED = -1
""":func:`read_into`'s count for a block larger than its buffer (never a valid length)."""


def read_into(client: Any, keys: Sequence[bytes], outs: Sequence[object]) -> list[int | None]:
    """``client.get_many_into(keys, outs)``, where a block too large for its buffer is that key's
    :data:`OVERSIZED` instead of the whole batch's error: the SDK refuses a batch holding one
    (``InvalidArgument``), and an engine integration reads a batch of chunks of which one bad
    block must not cost the others.  Other errors propagate."""
    try:
        got: list[int | None] = client.get_many_into(keys, outs)
        return got
    except InvalidArgument:
        pass
    out: list[int | None] = []
    for k, o in zip(keys, outs, strict=True):
        try:
            out.append(client.get_many_into([k], [o])[0])
        except InvalidArgument:
            out.append(OVERSIZED)
    return out


def deadline_client(target: str, *, token_file: str | None, deadline_s: float, agent: str) -> Any:
    """The SDK client an engine integration uses: every call (its RPCs, its data transfers,
    its connect) bounded by ``deadline_s``, its calls counted under ``agent`` on the node."""
    from client import Timeouts, connect

    d = deadline_s
    return connect(target, token_file=token_file, timeouts=Timeouts(rpc=d, data=d, connect=d), agent=agent)

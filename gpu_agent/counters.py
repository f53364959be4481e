"""Counters an engine integration keeps under one lock (the SGLang backend's, the LMCache
adapter's): :class:`LockedCounters` gives them a consistent :meth:`~LockedCounters.snapshot`."""

from __future__ import annotations

import dataclasses
import threading


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

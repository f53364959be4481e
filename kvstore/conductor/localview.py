"""What each engine's own prefix cache holds: one KV-events subscriber per engine that
publishes them, feeding one :class:`~kvstore.conductor.cacheindex.FleetCacheIndex`.

Owned by the :class:`~kvstore.conductor.service.Conductor` (its loop calls every method
here); the subscribers' threads write the index under the index's own lock.  Engines that
publish no KV events get no credit for their cache (never credit KV that may be gone);
an engine taken out or restarted is cleared, and a subscriber that misses events clears
its engine before it replays.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from kvstore.conductor.engines import EngineState


class LocalView:
    def __init__(self) -> None:
        self.index: Any = None  # a FleetCacheIndex once an engine publishes KV events (ZMQ is imported then)
        self.subs: dict[str, Any] = {}
        self._endpoints: dict[str, tuple[str, str, int]] = {}

    def follow(self, e: EngineState) -> None:
        """Subscribe to ``e``'s KV events (again, if its endpoint changed)."""
        if not e.kv_events or not e.block_size:
            return
        want = (e.kv_events, e.kv_events_replay, e.block_size)
        if self._endpoints.get(e.engine_id) == want:
            return
        self.drop(e.engine_id)
        from kvstore.conductor.cacheindex import FleetCacheIndex
        from kvstore.conductor.subscriber import KVEventSubscriber

        if self.index is None:
            self.index = FleetCacheIndex()

        self.index.add_engine(e.engine_id, e.block_size)
        self.subs[e.engine_id] = KVEventSubscriber(
            e.engine_id, e.kv_events, self.index, replay=e.kv_events_replay or None
        )
        self._endpoints[e.engine_id] = want

    def drop(self, engine_id: str) -> None:
        sub = self.subs.pop(engine_id, None)
        self._endpoints.pop(engine_id, None)
        if sub is not None:
            sub.close()
            self.index.remove_engine(engine_id)

    def clear(self, engine_id: str) -> None:
        if engine_id in self.subs:
            self.index.clear(engine_id)

    def match(self, tokens: Sequence[int], engine_ids: Sequence[str]) -> dict[str, int]:
        if not self.subs:
            return {}
        got = self.index.match(tokens)
        return {e: got.get(e, 0) for e in engine_ids if e in self.subs}

    def staleness(self, engine_id: str) -> float:
        sub = self.subs.get(engine_id)
        if sub is None or not sub.last_event_at:
            return -1.0
        return time.monotonic() - sub.last_event_at

    def describe(self) -> dict[str, Any]:
        return {
            eid: {
                "connected": bool(getattr(s, "connected", False)),
                "events": int(getattr(s, "events", 0)),
                "resyncs": int(getattr(s, "resyncs", 0)),
                "staleness_s": round(self.staleness(eid), 3),
            }
            for eid, s in self.subs.items()
        }

    def close(self) -> None:
        for eid in list(self.subs):
            self.drop(eid)

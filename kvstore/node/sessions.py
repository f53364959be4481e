"""Session hints: which blocks an open session may still read, and which only closed ones used.

An engine that knows a conversation (or an agent's task) has ended says so with
``close_session``; lookups and puts may carry the session id that made them.  A block any
open session used stays as valuable as the policy thinks it is; a block that only closed
sessions used is *dead*: eviction proposes it before everything else (DRAM demotes it
first, NVMe drops it first).  A block used without a session id, or by an open session
again, is alive (a hint may be wrong; a use never is).

Two parts:

* :class:`Sessions` (owner: the tier manager's event loop): the open sessions per tenant,
  the keys each used, how many open sessions hold each key, and the dead keys.  Sessions
  idle longer than ``idle_ttl`` are closed by :meth:`Sessions.expire` (the node's reaper).
  Memory is bounded: at most ``max_sessions`` open sessions and ``max_keys`` keys held by
  them plus dead keys; past either, the least recently active session is closed early
  (counted ``sessions_evicted``) and the oldest dead keys are forgotten (they become
  ordinary blocks again); one session tracks at most ``max_keys / 8`` keys (the rest are
  not its: another session's close may then make them dead while it still reads them).  Nothing here survives a restart: a hint lost is a block that is
  only as valuable as its policy thinks.
* :class:`SessionHinted` (owner: the tier holding it, as any policy): wraps a tier's
  eviction policy; its ``victims()`` yields the tier's dead blocks first, then the policy's
  own order, except that blocks two or more open sessions hold (a system prompt, a shared
  document) are deferred behind the others (at most ``MAX_DEFERRED`` per round, so a tier
  full of shared blocks costs a bounded scan).  The first time a close kills blocks, it
  calls the wrapped policy's ``hints_seen()`` if it has one (``prefix-reuse`` then weighs
  reuse as ``prefix-freq`` does: stale blocks no longer pile up behind the bonus).  The NVMe tier calls its policy from executor threads under the
  tier's lock, while :class:`Sessions` tells it of deaths on the loop, so its own table of
  dead residents has a lock (taken inside the tier's, never the other way round).

Tenants: a session is named by ``(tenant, session id)``, so two tenants' ids never meet.
Closing an id that only another tenant has open raises ``PermissionDenied``; the admin
(tenant ``None``) may close any tenant's session of that id.

Invariants: ``_holders[k]`` is the number of open sessions whose key set holds ``k`` (keys
with none are absent); a key is in ``_dead`` only if it has no holder; every
:class:`SessionHinted` resident key that is dead in :class:`Sessions` is in its ``_first``
(and nothing else is), up to the bound on dead keys.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from kvstore.errors import InvalidArgument, PermissionDenied
from kvstore.keys import ChunkKey
from kvstore.vocabulary import MAX_SESSION_ID as MAX_SESSION_ID  # shared with the SDK; re-exported
from kvstore.vocabulary import check_session_id as check_session_id
from tiers.policy import EvictionPolicy

SessionName = tuple["str | None", str]  # (tenant, session id)


@dataclasses.dataclass(slots=True)
class _Session:
    keys: dict[ChunkKey, None]  # in order of first use
    last: float  # last activity (the manager's clock)


class Sessions:
    def __init__(
        self,
        *,
        idle_ttl: float = 1800.0,
        max_sessions: int = 1 << 16,
        max_keys: int = 1 << 22,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not idle_ttl > 0 or max_sessions <= 0 or max_keys <= 0:
            raise InvalidArgument("session idle TTL, max sessions and max keys must be positive")
        self.idle_ttl = idle_ttl
        self.max_sessions = max_sessions
        self.max_keys = max_keys
        self.max_session_keys = max(1, max_keys // 8)  # a session's keys past this are not tracked
        self.clock = clock
        self._open: collections.OrderedDict[SessionName, _Session] = (
            collections.OrderedDict()
        )  # least recently active first
        self._tenants: dict[str, set[str | None]] = {}  # session id -> tenants that have it open
        self._holders: dict[ChunkKey, int] = {}
        self._dead: collections.OrderedDict[ChunkKey, None] = collections.OrderedDict()  # oldest death first
        self._keys = 0  # sum of the open sessions' key sets
        self._tiers: list[SessionHinted] = []
        self.counters: collections.Counter[str] = collections.Counter()

    # -- what the tiers ask ------------------------------------------------------------
    def watch(self, tier_policy: SessionHinted) -> None:
        self._tiers.append(tier_policy)

    def is_dead(self, key: ChunkKey) -> bool:
        return key in self._dead

    def has_dead(self) -> bool:
        return bool(self._dead)

    def shared(self, key: ChunkKey) -> bool:
        """Whether two or more open sessions hold ``key`` (read from executor threads too: one dict read)."""
        return self._holders.get(key, 0) >= 2

    def __len__(self) -> int:
        return len(self._open)

    # -- uses --------------------------------------------------------------------------
    def touch(self, tenant: str | None, session: str | None, keys: Iterable[ChunkKey]) -> None:
        """``keys`` were looked up, read or written by ``session`` (None: by no session)."""
        if session is None:
            if self._dead:
                self._revive([k for k in keys if k in self._dead])
            return
        name = (tenant, session)
        s = self._open.get(name)
        now = self.clock()
        if s is None:
            s = self._open[name] = _Session({}, now)
            self._tenants.setdefault(session, set()).add(tenant)
            self.counters["sessions_opened"] += 1
        else:
            s.last = now
            self._open.move_to_end(name)
        revived = []
        for k in keys:
            if k in s.keys:
                continue
            if len(s.keys) >= self.max_session_keys:
                self.counters["session_keys_untracked"] += 1
                continue
            s.keys[k] = None
            self._keys += 1
            self._holders[k] = self._holders.get(k, 0) + 1
            if k in self._dead:
                revived.append(k)
        if revived:
            self._revive(revived)
        self._bound(keep=name)

    def _revive(self, keys: list[ChunkKey]) -> None:
        for k in keys:
            self._dead.pop(k, None)
        self.counters["session_blocks_revived"] += len(keys)
        for t in self._tiers:
            t.revived(keys)

    # -- closes --------------------------------------------------------------------------
    def close(self, tenant: str | None, session: str) -> int | None:
        """Close ``session``: its blocks no open session holds become dead.  Returns how many
        did, or None if the caller has no such session open.  The admin closes every
        tenant's session of that id; a tenant naming only another's gets ``PermissionDenied``."""
        owners = self._tenants.get(session, set())
        if tenant is None:
            names = [(t, session) for t in owners]
        elif tenant in owners:
            names = [(tenant, session)]
        elif owners:
            raise PermissionDenied(
                f"session {session!r} is not one of tenant {tenant!r}'s: a tenant closes only its own sessions"
            )
        else:
            return None
        if not names:
            return None
        self.counters["sessions_closed"] += len(names)
        return sum(self._close(n) for n in names)

    def _close(self, name: SessionName) -> int:
        s = self._open.pop(name)
        owners = self._tenants[name[1]]
        owners.discard(name[0])
        if not owners:
            del self._tenants[name[1]]
        self._keys -= len(s.keys)
        died = []
        for k in reversed(s.keys):  # deepest blocks of a chain first: they go before their prefixes
            n = self._holders[k] - 1
            if n:
                self._holders[k] = n
            else:
                del self._holders[k]
                self._dead[k] = None
                died.append(k)
        self.counters["session_blocks_dead"] += len(died)
        for t in self._tiers:
            t.died(died)
        self._bound()
        return len(died)

    def expire(self, now: float | None = None) -> int:
        """Close sessions idle for ``idle_ttl`` or longer; returns how many."""
        now = self.clock() if now is None else now
        n = 0
        while self._open:
            name, s = next(iter(self._open.items()))
            if now - s.last < self.idle_ttl:
                break
            self._close(name)
            n += 1
        self.counters["sessions_expired"] += n
        return n

    def _bound(self, keep: SessionName | None = None) -> None:
        while self._open and (len(self._open) > self.max_sessions or self._keys + len(self._dead) > self.max_keys):
            name = next(iter(self._open))
            if name == keep:  # the session being used: the others go first, then its oldest dead keys
                break
            self.counters["sessions_evicted"] += 1
            self._close(name)
        if self._keys + len(self._dead) > self.max_keys and self._dead:
            drop = []
            while self._dead and self._keys + len(self._dead) > self.max_keys:
                drop.append(self._dead.popitem(last=False)[0])
            self.counters["session_dead_forgotten"] += len(drop)
            for t in self._tiers:
                t.revived(drop)

    def stats(self) -> dict[str, int]:
        return {"open_sessions": len(self._open), "session_keys": self._keys, "dead_blocks": len(self._dead)}


class SessionHinted:
    """An eviction policy whose victims start with the tier's dead blocks and leave blocks
    shared by open sessions for last (see the module)."""

    MAX_DEFERRED = 1024

    def __init__(self, inner: EvictionPolicy, sessions: Sessions) -> None:
        self.inner = inner
        self.name = f"{inner.name}+sessions"
        self._sessions = sessions
        self._first: collections.OrderedDict[ChunkKey, None] = (
            collections.OrderedDict()
        )  # dead residents, oldest death first
        self._aside: dict[ChunkKey, None] = {}  # dead residents skipped by a victims() round still running
        self._lock = threading.Lock()
        self._hints_seen = False
        sessions.watch(self)

    # -- told by Sessions (the loop) -----------------------------------------------------
    def died(self, keys: list[ChunkKey]) -> None:
        if keys and not self._hints_seen:  # the first death: the policy may weigh reuse differently now
            self._hints_seen = True
            seen = getattr(self.inner, "hints_seen", None)
            if seen is not None:
                seen()
        with self._lock:
            for k in keys:
                if k in self.inner and k not in self._aside:
                    self._first[k] = None

    def revived(self, keys: list[ChunkKey]) -> None:
        with self._lock:
            for k in keys:
                self._first.pop(k, None)
                self._aside.pop(k, None)

    # -- the policy protocol (the tier) --------------------------------------------------
    def insert(self, key: ChunkKey, parent: ChunkKey, size: int) -> None:
        self.inner.insert(key, parent, size)
        if self._sessions.is_dead(key):  # demoted to NVMe after its session closed, say
            with self._lock:
                self._first[key] = None

    def insert_many(self, items: Iterable[tuple[ChunkKey, ChunkKey, int]]) -> None:
        items = items if isinstance(items, list) else list(items)
        self.inner.insert_many(items)
        dead = [k for k, _, _ in items if self._sessions.is_dead(k)] if self._sessions.has_dead() else []
        if dead:
            with self._lock:
                for k in dead:
                    self._first[k] = None

    def access(self, key: ChunkKey) -> None:
        self.inner.access(key)

    def remove(self, key: ChunkKey) -> None:
        self.inner.remove(key)
        with self._lock:
            self._first.pop(key, None)
            self._aside.pop(key, None)

    def admit(self, key: ChunkKey, size: int) -> bool:
        return self.inner.admit(key, size)

    def victims(self) -> Iterator[ChunkKey]:
        offered: set[ChunkKey] = set()
        skipped: list[ChunkKey] = []
        try:
            while True:
                with self._lock:
                    if not self._first:
                        break
                    key = next(iter(self._first))
                offered.add(key)
                yield key
                with self._lock:
                    if key in self._first:  # the caller kept it (pinned, leased): set aside for this round
                        del self._first[key]
                        self._aside[key] = None
                        skipped.append(key)
            deferred: list[ChunkKey] = []
            shared = self._sessions.shared
            for key in self.inner.victims():
                if key in offered:
                    continue
                if len(deferred) < self.MAX_DEFERRED and shared(key):
                    deferred.append(key)
                    continue
                yield key
            for key in deferred:  # the inner round has ended: these kept their place, and are still resident
                if key in self.inner:
                    yield key
        finally:
            with self._lock:
                for key in reversed(skipped):
                    if key in self._aside:  # still resident and dead: back in front, in its old order
                        del self._aside[key]
                        self._first[key] = None
                        self._first.move_to_end(key, last=False)

    def dead_resident(self) -> int:
        return len(self._first) + len(self._aside)

    def __len__(self) -> int:
        return len(self.inner)

    def __contains__(self, key: object) -> bool:
        return key in self.inner

    def __getattr__(self, name: str) -> Any:  # the wrapped policy's own reports (bounds, tests)
        return getattr(self.inner, name)


def hinted(policy: EvictionPolicy, sessions: Sessions | None) -> EvictionPolicy:
    """``policy`` as a tier should hold it: wrapped when the node keeps session hints."""
    if sessions is None:
        return policy
    return SessionHinted(policy, sessions)  # type: ignore[return-value]  # an EvictionPolicy by delegation

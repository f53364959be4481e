"""The holdings watch: what this node holds, published as a snapshot then deltas (architecture §3a).

Clients that answer "who holds this prefix?" in-process (the SDK's ``PoolView``) follow
every node through ``WatchHoldings``, as etcd's watch does: a snapshot at a revision, then
every change to what each tier holds, each with the next revision.

:class:`HoldingsLog` is told of every change by the tiers themselves
(``tiers/base.py`` ``HoldingsHook``: the DRAM tier when it stores or drops a key, on the
loop; the NVMe tier when its index gains or loses one, under its lock, from the loop or an
executor thread), so puts, demotions, promotions, evictions on both tiers, deletes,
invalidations, corrupt records dropped and replaced blocks are all seen, in the order the
tiers made them.  A move between tiers is two deltas (held in NVMe; no longer in DRAM).

Owner: the log's state (revision, ring of recent deltas, waiting subscribers) is guarded
by ``_lock``, taken by tier hooks on any thread and by subscribers on the loop; it is held
only for a few assignments, and never while calling into a tier (the NVMe tier calls the
hook under its own lock: lock order NVMe ``_lock`` before ``HoldingsLog._lock``).

Invariants: revisions are consecutive from 1 in each incarnation (a random 16-byte id per
node process); the ring holds the deltas ``revision - history + 1 .. revision`` (fewer at
first); the data path only appends (O(1)) and never waits on a subscriber: a subscriber
reads the ring at its own pace, and one that fell more than ``history`` deltas behind gets a
fresh snapshot flagged ``resync`` instead.  A snapshot taken at revision R lists each key as
held at some moment at or after R; replaying every delta after R over it (each delta sets
or clears one tier's bit, it never toggles) ends at exactly what the tiers hold.
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from kvstore.block import BlockMeta
from kvstore.errors import InvalidArgument
from kvstore.keys import ChunkKey
from protos.kvstore.v1 import kvstore_pb2 as pb
from tiers.base import LowerTier, TierKind
from tiers.dram import DRAMTier

if TYPE_CHECKING:
    from tiers.nvme import NVMeTier

__all__ = ["DROPPED_SHIFT", "HELD_BIT", "HoldingsLog", "holdings_stream"]

HELD_BIT: dict[TierKind, int] = {TierKind.DRAM: 1, TierKind.NVME: 2}
"""A tier's bit in a ``changes`` byte (``HoldingsUpdate``); shifted by ``DROPPED_SHIFT``: no longer held there."""
DROPPED_SHIFT = 4
INCARNATION_BYTES = 16
DEFAULT_HISTORY = 1 << 16
SNAPSHOT_BATCH = 16384  # entries per snapshot message (about 400 KiB)
DELTA_BATCH = 4096  # most deltas per message
HEARTBEAT_MS = 1000
_NO_NAMESPACE = bytes(8)

_Delta = tuple[ChunkKey, int, bytes, int]  # key, changes byte, namespace, when (unix ns)


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class HoldingsLog:
    """The node's revisioned record of what its tiers hold: a bounded ring of recent deltas.

    ``attach`` hooks it into the tiers; ``holdings_stream`` serves one subscriber from it.
    """

    def __init__(self, history: int = DEFAULT_HISTORY) -> None:
        if history < 1:
            raise InvalidArgument(f"holdings history must be at least 1 delta, got {history}")
        self.incarnation = os.urandom(INCARNATION_BYTES)
        self.history = history
        self._lock = threading.Lock()
        self._revision = 0
        self._ring: list[_Delta | None] = [None] * history
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self.closed = False
        self.subscribers = 0  # streams open now (loop only)
        self.resyncs = 0  # snapshots sent to subscribers that had fallen behind or came back too late (loop only)

    def attach(self, dram: DRAMTier, nvme: NVMeTier | None) -> None:
        """Be told of every change to what ``dram`` and ``nvme`` (the NVMe tier itself, not a
        wrapper: it is the one that calls the hook) hold.  Before the node serves."""
        dram.holdings = functools.partial(self._changed, HELD_BIT[TierKind.DRAM])
        if nvme is not None:
            nvme.holdings = functools.partial(self._changed, HELD_BIT[TierKind.NVME])

    # -- the data path's side ---------------------------------------------------------------
    def _changed(self, bit: int, key: ChunkKey, meta: BlockMeta | None) -> None:
        """A tier started (``meta``) or stopped (None) holding ``key``.  Any thread; O(1)."""
        change, ns = (bit, meta.namespace) if meta is not None else (bit << DROPPED_SHIFT, _NO_NAMESPACE)
        now = time.time_ns()
        with self._lock:
            self._revision += 1
            self._ring[self._revision % self.history] = (key, change, ns, now)
            if not self._waiters:
                return
            waiters, self._waiters = self._waiters, []
        for loop, fut in waiters:
            try:
                loop.call_soon_threadsafe(_wake, fut)
            except RuntimeError:  # that loop is closed: its subscriber is gone
                pass

    # -- the subscribers' side --------------------------------------------------------------
    @property
    def revision(self) -> int:
        with self._lock:
            return self._revision

    def since(self, revision: int, limit: int = DELTA_BATCH) -> tuple[int, list[_Delta]] | None:
        """``(first revision, deltas)``: up to ``limit`` deltas after ``revision``, in order
        (none if it is the latest); None if the ring no longer has them all (or ``revision``
        is ahead of this log: another incarnation's)."""
        with self._lock:
            last = self._revision
            if revision > last or revision < last - self.history:
                return None
            end = min(last, revision + limit)
            return revision + 1, [self._ring[r % self.history] for r in range(revision + 1, end + 1)]  # type: ignore[misc]

    async def wait(self, revision: int, timeout: float) -> bool:
        """Wait until a delta after ``revision`` is logged (True) or ``timeout`` passes (False)."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._revision > revision or self.closed:
                return True
            fut: asyncio.Future[None] = loop.create_future()
            self._waiters.append((loop, fut))
        try:
            await asyncio.wait_for(asyncio.shield(fut), timeout)
            return True
        except TimeoutError:
            with self._lock:
                if (loop, fut) in self._waiters:
                    self._waiters.remove((loop, fut))
            return False

    def close(self) -> None:
        """End every stream (the node is stopping): each returns at its next turn."""
        with self._lock:
            self.closed = True
            waiters, self._waiters = self._waiters, []
        for loop, fut in waiters:
            try:
                loop.call_soon_threadsafe(_wake, fut)
            except RuntimeError:
                pass

    def stats(self) -> dict[str, int]:
        return {"watch_revision": self.revision, "watch_subscribers": self.subscribers, "watch_resyncs": self.resyncs}


def check_watch_request(request: pb.WatchHoldingsRequest) -> float:
    """The heartbeat interval (s) of a valid request; ``InvalidArgument`` otherwise."""
    if request.incarnation and len(request.incarnation) != INCARNATION_BYTES:
        raise InvalidArgument(
            f"incarnation must be empty or {INCARNATION_BYTES} bytes (from a HoldingsUpdate), got {len(request.incarnation)}"
        )
    ms = request.heartbeat_ms or HEARTBEAT_MS
    if not 10 <= ms <= 60_000:
        raise InvalidArgument(f"heartbeat_ms must be 0 (the default, {HEARTBEAT_MS}) or 10..60000, got {ms}")
    return ms / 1000


async def holdings_stream(
    log: HoldingsLog, dram: DRAMTier, nvme: LowerTier | None, request: pb.WatchHoldingsRequest
) -> AsyncGenerator[pb.HoldingsUpdate, None]:
    """One subscriber's stream (``WatchHoldings``; on the node's loop): a snapshot unless
    the request resumes where this incarnation still has every delta, then deltas and
    heartbeats until the log closes or the caller goes.  Each yield waits for gRPC's flow
    control, so a slow subscriber slows only itself; the ring moves on without it."""
    heartbeat = check_watch_request(request)
    inc = log.incarnation
    log.subscribers += 1
    try:
        if request.incarnation == inc and log.since(request.revision, 0) is not None:
            cursor = request.revision
        else:
            resync = bool(request.incarnation)  # it held something of this node: drop it
            log.resyncs += resync
            cursor = log.revision
            async for m in _snapshot(log, dram, nvme, resync):
                cursor = m.revision
                yield m
        while not log.closed:
            got = log.since(cursor)
            if got is None:  # fell more than the history behind while it read
                log.resyncs += 1
                async for m in _snapshot(log, dram, nvme, True):
                    cursor = m.revision
                    yield m
                continue
            first, deltas = got
            if deltas:
                cursor = first + len(deltas) - 1
                yield pb.HoldingsUpdate(
                    incarnation=inc,
                    kind=pb.HOLDINGS_KIND_DELTAS,
                    revision=cursor,
                    first_revision=first,
                    keys=b"".join(d[0] for d in deltas),
                    changes=bytes(d[1] for d in deltas),
                    namespaces=b"".join(d[2] for d in deltas),
                    changed_unix_ns=deltas[0][3],
                )
                continue
            if not await log.wait(cursor, heartbeat) and not log.closed:
                yield pb.HoldingsUpdate(
                    incarnation=inc, kind=pb.HOLDINGS_KIND_HEARTBEAT, revision=cursor, changed_unix_ns=time.time_ns()
                )
    finally:
        log.subscribers -= 1


async def _snapshot(
    log: HoldingsLog, dram: DRAMTier, nvme: LowerTier | None, resync: bool
) -> AsyncIterator[pb.HoldingsUpdate]:
    """Everything the tiers hold, at the revision read first (on the loop: no DRAM change
    comes between it and the DRAM listing; NVMe changes after it are in the deltas that
    follow).  A key held in both tiers comes once per tier; a key gone by the time its
    batch is sent is left out (its drop is a later delta)."""
    revision = log.revision
    parts: list[tuple[int, Sequence[ChunkKey], Any]] = [(HELD_BIT[TierKind.DRAM], dram.keys(), dram.meta)]
    if nvme is not None:
        parts.append((HELD_BIT[TierKind.NVME], nvme.keys(), nvme.meta))
    sent = False
    for bit, keys, meta_of in parts:
        for i in range(0, len(keys), SNAPSHOT_BATCH):
            held = [(k, m.namespace) for k in keys[i : i + SNAPSHOT_BATCH] if (m := meta_of(k)) is not None]
            last = bit == parts[-1][0] and i + SNAPSHOT_BATCH >= len(keys)
            yield _snapshot_message(log.incarnation, revision, resync, held, bit, last)
            sent = True
    if not sent or not parts[-1][1]:  # nothing at all, or the last tier was empty: say it is over
        yield _snapshot_message(log.incarnation, revision, resync, [], 0, True)


def _snapshot_message(
    inc: bytes, revision: int, resync: bool, held: list[tuple[ChunkKey, bytes]], bit: int, last: bool
) -> pb.HoldingsUpdate:
    return pb.HoldingsUpdate(
        incarnation=inc,
        kind=pb.HOLDINGS_KIND_SNAPSHOT,
        revision=revision,
        resync=resync,
        last=last,
        keys=b"".join(k for k, _ in held),
        changes=bytes([bit]) * len(held),
        namespaces=b"".join(ns for _, ns in held),
    )

"""Transfers: a batch of blocks whose bytes move outside gRPC, from its negotiation to its end.

Role: the one owner of data-channel transfers, between the gRPC servicer
(``kvstore/node/service.py``), which negotiates them (``StartGet``/``StartPut`` after its
checks), and the data channel (``kvstore/node/datachannel.py``), which moves their bytes.
A transfer id is 16 random bytes handed to the caller the servicer checked: the capability
for exactly the leased (GET) or reserved (PUT) blocks, once, until its deadline.

Lifecycle::

    start_get / start_put  (servicer)        -> pending, by id, until its deadline
    take                   (data channel)    -> held: the reaper no longer ends its leases or
                                                reservations; their arena views are resolved
    finish_get / finish_put (data channel)   -> leases released; reservations committed
                                                (checksums verified) or aborted
    expire                 (the node's reaper) -> pending ones past their deadline end

Owner: the node's event loop, like the tier manager it calls: every method here runs on it
(the data channel's threads call ``take``/``finish_*`` through ``run_coroutine_threadsafe``).
The arena views a taken transfer carries stay valid while it is held: a held lease or
reservation is ended only by ``finish_*``.

Invariants: an id names at most one transfer and is taken at most once; a transfer is
either pending, held (taken, not finished) or gone; a taken transfer is finished exactly
once, by the connection that took it; its bytes are counted only when all of them moved.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections.abc import Callable, Sequence

from kvstore.block import BlockMeta
from kvstore.framing import OP_GET, OP_PUT
from kvstore.node.manager import Leased, Reserved, Status, TierManager
from kvstore.node.metrics import NodeMetrics
from tiers.allocator import Extent

__all__ = ["OP_GET", "OP_PUT", "Transfer", "TransferTable", "Transfers"]


@dataclasses.dataclass(slots=True)
class Transfer:
    op: int
    deadline: float
    # GET: (lease_id, meta, extents); PUT: (reservation_id, meta, extents)
    items: list[tuple[int, BlockMeta, list[Extent]]]
    # once taken: per item, the arena views of its payload (read from for GET, written into for PUT)
    views: list[list[memoryview]] = dataclasses.field(default_factory=list)
    agent: str = ""  # the agent label of the call that started it (its writes are counted at the commit)

    @property
    def nbytes(self) -> int:
        return sum(meta.payload_len for _, meta, _ in self.items)


class TransferTable:
    """Pending transfers by id.  Owned by the event loop."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._pending: dict[bytes, Transfer] = {}
        self._by_lease: dict[int, bytes] = {}  # lease id -> the pending GET that would send it

    def add(self, transfer: Transfer) -> bytes:
        tid = secrets.token_bytes(16)
        self._pending[tid] = transfer
        if transfer.op == OP_GET:
            for lid, _, _ in transfer.items:
                self._by_lease[lid] = tid
        return tid

    def _pop(self, tid: bytes) -> Transfer:
        t = self._pending.pop(tid)
        if t.op == OP_GET:
            for lid, _, _ in t.items:
                self._by_lease.pop(lid, None)
        return t

    def take(self, tid: bytes, op: int) -> Transfer | None:
        t = self._pending.get(tid)
        if t is None or t.op != op:
            return None
        return self._pop(tid)

    def expire(self) -> list[Transfer]:
        now = self._clock()
        gone = [tid for tid, t in self._pending.items() if t.deadline <= now]
        return [self._pop(tid) for tid in gone]

    def released(self, lease_ids: Sequence[int]) -> list[Transfer]:
        """Forget the pending GETs whose every lease is among ``lease_ids`` (their caller gave
        the leases back instead of fetching: nothing is left for them to send); those dropped."""
        tids = {tid for lid in lease_ids if (tid := self._by_lease.pop(lid, None)) is not None}
        dropped = []
        for tid in tids:
            t = self._pending.get(tid)
            if t is not None and not any(lid in self._by_lease for lid, _, _ in t.items):
                dropped.append(self._pop(tid))
        return dropped

    def __len__(self) -> int:
        return len(self._pending)


class Transfers:
    """The node's data-channel transfers: pending ones by id, held ones by their start time."""

    def __init__(self, manager: TierManager, metrics: NodeMetrics | None = None) -> None:
        self.manager = manager
        self.metrics = metrics
        self._table = TransferTable(manager.clock)
        self._started: dict[int, float] = {}  # id(transfer) -> perf_counter at take

    @property
    def pending(self) -> int:
        """Negotiated, not yet taken by a connection."""
        return len(self._table)

    @property
    def active(self) -> int:
        """Taken by a connection, not yet finished."""
        return len(self._started)

    # -- negotiation (the servicer, after its checks) -------------------------------------
    def start_get(self, leased: Sequence[Leased]) -> bytes:
        """A GET of the blocks leased OK; its id (``b""``: nothing to move)."""
        items = [(x.lease_id, x.meta, list(x.extents)) for x in leased if x.status == Status.OK and x.meta is not None]
        if not items:
            return b""
        m = self.manager
        return self._table.add(Transfer(OP_GET, m.clock() + m.lease_ttl, items))

    def start_put(self, metas: Sequence[BlockMeta], reserved: Sequence[Reserved], *, agent: str = "") -> bytes:
        """A PUT of the blocks reserved OK; its id (``b""``: nothing to move).  ``agent``: whose
        writes the commit counts (``kvstore_agent_*``)."""
        items = [(r.reservation_id, meta, list(r.extents)) for meta, r in zip(metas, reserved) if r.status == Status.OK]
        if not items:
            return b""
        m = self.manager
        return self._table.add(Transfer(OP_PUT, m.clock() + m.reservation_ttl, items, agent=agent))

    # -- the data channel (on the loop, called from its connection threads) ---------------
    async def take(self, tid: bytes, op: int) -> Transfer | None:
        """The transfer ``tid`` names for ``op``, now held and with its views resolved; None for an
        unknown, replayed or expired id, or one whose leases or reservations ended meanwhile."""
        t = self._table.take(tid, op)
        if t is None:
            return None
        started = time.perf_counter()
        m = self.manager
        # The data channel now owns these until finish_get/finish_put: the reaper must not
        # free extents that a stalled transfer still sends from or receives into.
        ids = [i for i, _, _ in t.items]
        held = m.hold(lease_ids=ids) if op == OP_GET else m.hold(reservation_ids=ids)
        views = [m.leased_views(i) if op == OP_GET else m.reserved_views(i) for i in ids] if held else []
        if not held or any(v is None for v in views):
            # some expired (or were released) before the client came: refuse the whole transfer
            if op == OP_GET:
                m.release(ids)
            else:
                m.abort(ids)
            return None
        t.views = views  # type: ignore[assignment]  # none is None: checked above
        # recorded only now: a refused transfer never reaches finish_get/finish_put, which pop it
        self._started[id(t)] = started
        return t

    def _done(self, t: Transfer, op: str) -> None:
        start = self._started.pop(id(t), None)
        if start is not None and self.metrics is not None:
            self.metrics.transfer_seconds.labels(op).observe(time.perf_counter() - start)

    async def finish_get(self, t: Transfer, ok: bool) -> None:
        """Release the leases of a taken GET (``ok``: all its bytes were sent)."""
        self._done(t, "get")
        self.manager.release([lid for lid, _, _ in t.items])
        if ok:
            self.manager.moved("tcp", "out", t.nbytes)

    async def finish_put(self, t: Transfer, complete: bool) -> list[int]:
        """Commit a taken PUT whose bytes all came (checksums verified), else abort it; the
        per-block statuses for the reply."""
        self._done(t, "put")
        ids = [rid for rid, _, _ in t.items]
        if not complete:
            self.manager.abort_cut(ids)
            self._count_put(t, [int(Status.EXPIRED)] * len(ids))
            return [int(Status.EXPIRED)] * len(ids)
        statuses = await self.manager.commit(ids, verify=True)
        self.manager.moved("tcp", "in", t.nbytes)
        self._count_put(t, [int(s) for s in statuses])
        return [int(s) for s in statuses]

    def _count_put(self, t: Transfer, statuses: list[int]) -> None:
        if self.metrics is None:
            return
        self.metrics.observe_agent_writes(t.agent or "sdk", statuses, [meta.payload_len for _, meta, _ in t.items])

    def released(self, lease_ids: Sequence[int]) -> int:
        """The caller released ``lease_ids`` (``Release``): a pending GET left with none of its
        leases is dropped now rather than at its deadline; how many were."""
        return len(self._table.released(lease_ids))

    # -- deadlines (the node's reaper) -------------------------------------------------------
    def expire(self) -> None:
        """End pending transfers past their deadline: leases released, reservations aborted."""
        for t in self._table.expire():
            ids = [i for i, _, _ in t.items]
            if t.op == OP_GET:
                self.manager.release(ids)
            else:
                self.manager.abort(ids)

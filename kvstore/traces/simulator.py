"""Simulator mode of ``kvstore replay``: a trace through the node's own tier manager.

No copy of the eviction code: each replay builds a real :class:`~kvstore.node.manager.TierManager`
over a real :class:`~tiers.dram.DRAMTier` holding the named policy from
:data:`tiers.policy.POLICIES`, exactly as ``kvstore serve --nvme 0`` wires them
(``kvstore/node/server.py``).  The only stand-in is the arena: a :class:`BytelessArena` of
``capacity`` one-byte units, so a block takes one unit and no payload bytes exist.
The manager's coroutines never suspend without an NVMe tier, so a whole replay runs
inside one event loop (:func:`run_replay`: virtual time, so a replay never depends on the machine's load) at a few microseconds per block.

What one request does (live mode, ``kvstore/traces/live.py``, sends the same calls over
the SDK, so both modes give the same hit ratios on a node started with ``--nvme 0`` and
a DRAM tier of exactly ``capacity`` blocks):

1. ``match_prefix(keys)`` → ``n``: the request's prefix hits are its leading run of
   blocks present at lookup time (a block after a missing one is no use to the engine);
2. ``acquire`` + ``release`` of those ``n`` blocks: the engine loads the hit prefix,
   which is what tells the policy they were used (``match_prefix`` itself does not);
3. the engine computes the rest and saves *all* of it, as it would after prefill:
   ``reserve`` then ``commit`` of ``keys[n:]`` with their parents, in batches of
   :func:`put_batch` blocks.  Eviction happens inside ``reserve`` (the manager's own
   ``victims()`` rounds); a key already stored answers ``EXISTS`` and is not touched
   (the node deduplicates puts).

Every hash id is a block, the partial last one of a prompt included, as in the trace's own
figures (its 64 % unlimited-capacity hit ratio counts them).  A real engine stores only
full chunks (architecture §1); on Mooncake traces that differs by well under 1 % of blocks.

Admission: the node consults ``policy.admit`` only when demoting to NVMe, never for
DRAM, so neither does a DRAM-only replay; policies filter one-hit wonders through
their eviction order instead (a new block is the first victim unless it is reused).

Session hints (``sessions=True``): each request's ``session_id`` goes with its lookup,
read and put, and each ``close_session`` event of the trace calls the manager's
``close_session`` at its place in the file, through the node's own
:mod:`kvstore.node.sessions` (the tiers' policies wrapped as ``server.py`` wraps them).  The
manager's clock is the trace's: idle sessions expire ``session_ttl`` trace-seconds after
their last request.  Without it, session ids and close events are ignored.

Two tiers (``nvme_blocks``): the manager gets an NVMe tier of that many blocks, a
:class:`ByteslessNVMe` holding the same policy as the node's NVMe tier would, so DRAM
evictions demote (write-back) into it through the node's own movers and hits there are
promoted back; its I/O runs inline (:class:`InlineExecutor`).  A lookup's hits are
counted per tier (``tier_hits``) as the node found them.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from kvstore.block import BlockMeta
from kvstore.errors import InvalidArgument
from kvstore.keys import ChunkKey
from kvstore.node.manager import Status, TierManager
from kvstore.node.sessions import Sessions, hinted
from kvstore.traces.format import HitRatios, Request, Trace
from tiers.base import MissReason, ReadResult, TierKind, count_prefix
from tiers.dram import DRAMTier
from tiers.nvme_format import record_bytes
from tiers.policy import DEFAULT_POLICY, POLICIES, EvictionPolicy, make_policy

DEFAULT_SESSION_TTL = 1800.0
"""Seconds a replayed session may stay idle before it is closed (the node's default)."""

DEFAULT_PUT_BATCH = 16
"""Blocks per reserve/commit round trip (an engine saves a request's blocks in a few batches)."""


def put_batch(capacity_blocks: int, requested: int = DEFAULT_PUT_BATCH) -> int:
    """Blocks per put batch: the SDK splits a batch above a quarter of the arena, so cap it there."""
    return max(1, min(requested, capacity_blocks // 4))


class BytelessArena:
    """Stands in for :class:`tiers.arena.Arena` under a :class:`DRAMTier` that never moves bytes.

    The DRAM tier only reads ``size`` and calls ``close`` on the paths a replay uses;
    anything that would touch payload bytes is a bug here and says so.
    """

    def __init__(self, size: int) -> None:
        self.size = size

    def close(self) -> None:
        pass

    def __getattr__(self, name: str) -> object:
        raise AttributeError(f"the simulator's arena holds no bytes ({name!r} was asked for)")


class ScratchArena(BytelessArena):
    """The arena of a two-tier replay: one scratch byte per block, which demotions read and
    promotions write (the byteless NVMe tier ignores them)."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.buf = bytearray(size)

    def views(self, extents: Any, nbytes: int) -> list[memoryview]:
        return [memoryview(self.buf)[e.offset : e.offset + e.length] for e in extents]


class InlineExecutor(concurrent.futures.Executor):
    """Runs the movers' "disk I/O" at once on the loop's thread: the byteless NVMe tier has none."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        f: concurrent.futures.Future[Any] = concurrent.futures.Future()
        try:
            f.set_result(fn(*args, **kwargs))
        except BaseException as e:  # noqa: B036 - handed to the awaiting coroutine
            f.set_exception(e)
        return f


class ByteslessNVMe:
    """Stands in for :class:`tiers.nvme.NVMeTier` in a two-tier replay: the same index and
    policy protocol, room for ``capacity_blocks`` one-page records, no bytes."""

    kind = TierKind.NVME
    corrupt_blocks = 0  # no bytes, nothing to corrupt

    def __init__(self, capacity_blocks: int, policy: EvictionPolicy) -> None:
        self._record = record_bytes(1)
        self.capacity_bytes = capacity_blocks * self._record
        self.policy = policy
        self._meta: dict[ChunkKey, BlockMeta] = {}

    @property
    def used_bytes(self) -> int:
        return len(self._meta) * self._record

    def __len__(self) -> int:
        return len(self._meta)

    def keys(self) -> list[ChunkKey]:
        return list(self._meta)

    def contains(self, key: ChunkKey) -> bool:
        return key in self._meta

    def meta(self, key: ChunkKey) -> BlockMeta | None:
        return self._meta.get(key)

    def admit(self, key: ChunkKey, size: int) -> bool:
        return self.policy.admit(key, size)

    def fits(self, nbytes: int) -> bool:
        return self.capacity_bytes - self.used_bytes >= record_bytes(nbytes)

    def count_prefix(self, keys: Sequence[ChunkKey]) -> int:
        return count_prefix(self, keys)

    def recovery(self) -> dict[str, int]:
        return {}

    def write(self, meta: BlockMeta, payload: object) -> None:
        self.write_many([(meta, payload)])

    def write_many(self, items: Sequence[tuple[BlockMeta, object]], *args: Any, **kw: Any) -> None:
        for meta, _ in items:
            if meta.key in self._meta:
                self.policy.remove(meta.key)
            self._meta[meta.key] = meta
            self.policy.insert(meta.key, meta.parent, meta.payload_len)

    def read_into(self, key: ChunkKey, out: object, *args: Any, **kw: Any) -> ReadResult:
        meta = self._meta.get(key)
        if meta is None:
            return ReadResult(key, miss=MissReason.NOT_PRESENT)
        self.policy.access(key)
        return ReadResult(key, meta=meta, nbytes=meta.payload_len)

    def delete(self, key: ChunkKey) -> bool:
        if self._meta.pop(key, None) is None:
            return False
        self.policy.remove(key)
        return True

    def victims(self, can_evict: Callable[[ChunkKey], bool] = lambda k: True) -> Iterator[ChunkKey]:
        for key in self.policy.victims():
            if can_evict(key):
                yield key

    def close(self) -> None:
        self._meta.clear()


@dataclasses.dataclass(frozen=True, slots=True)
class SimResult(HitRatios):
    policy: str
    capacity_blocks: int
    requests: int
    blocks: int
    hit_blocks: int
    tokens: int
    hit_tokens: int
    evictions: int
    per_request_hits: tuple[int, ...]
    nvme_blocks: int = 0
    tier_hits: tuple[tuple[str, int], ...] = ()  # ("dram", blocks), ("nvme", blocks): where lookups found their hits
    sessions: bool = False  # whether session hints were honoured

    @property
    def tier_hit_ratios(self) -> dict[str, float]:
        return {t: n / self.blocks if self.blocks else 0.0 for t, n in self.tier_hits}


def check_policy(name: str) -> str:
    if name not in POLICIES:
        raise InvalidArgument(f"unknown policy {name!r} (--policy); choose one of {sorted(POLICIES)}")
    return name


def check_capacity(capacity_blocks: int) -> int:
    if isinstance(capacity_blocks, bool) or not isinstance(capacity_blocks, int) or capacity_blocks <= 0:
        raise InvalidArgument(f"--capacity must be a positive number of blocks, got {capacity_blocks!r}")
    return capacity_blocks


def build_manager(
    capacity_blocks: int, policy: str | EvictionPolicy, *, nvme_blocks: int = 0, sessions: Sessions | None = None
) -> TierManager:
    """The node's wiring (``server.py``) for a node of ``capacity_blocks`` DRAM blocks (and
    ``nvme_blocks`` NVMe blocks), with session hints if ``sessions`` is given.

    ``policy`` is a registered name, or an instance (the oracle bounds of :mod:`kvstore.traces.bounds`;
    DRAM only).
    """
    pol = make_policy(policy) if isinstance(policy, str) else policy
    if not nvme_blocks:
        dram = DRAMTier(BytelessArena(capacity_blocks), policy=hinted(pol, sessions), unit=1)  # type: ignore[arg-type]
        return TierManager(
            dram, None, sessions=sessions, clock=sessions.clock if sessions is not None else time.monotonic
        )
    if not isinstance(policy, str):
        raise InvalidArgument("a two-tier replay needs a policy name: each tier holds its own instance")
    dram = DRAMTier(ScratchArena(capacity_blocks), policy=hinted(pol, sessions), unit=1)  # type: ignore[arg-type]
    nvme = ByteslessNVMe(nvme_blocks, hinted(make_policy(policy), sessions))
    return TierManager(
        dram,
        nvme,
        executor=InlineExecutor(),  # type: ignore[arg-type]  # the manager only submits to it
        verify_demotions=False,
        sessions=sessions,
        clock=sessions.clock if sessions is not None else time.monotonic,
    )


class _VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock stands still while anything is ready to run and jumps to the
    next timer when nothing is.

    The manager waits on timers in one place a replay reaches (``asyncio.sleep(0.001)`` while
    another eviction round demotes the only candidates); on a real clock, how many other
    callbacks run before it wakes depends on the machine's load, and a two-tier replay's hit
    ratio with it.  On this clock every replay of a trace takes the same steps.
    """

    def __init__(self) -> None:
        super().__init__()
        self._virtual = 0.0

    def time(self) -> float:
        return self._virtual

    def _run_once(self) -> None:
        scheduled = self._scheduled  # type: ignore[attr-defined]
        if not self._ready and scheduled:  # type: ignore[attr-defined]
            self._virtual = max(self._virtual, scheduled[0].when())
        super()._run_once()  # type: ignore[misc]


def run_replay(coro: Any) -> Any:
    """``asyncio.run`` on a :class:`_VirtualTimeLoop`: deterministic whatever the machine's load."""
    with asyncio.Runner(loop_factory=_VirtualTimeLoop) as runner:
        return runner.run(coro)


class TraceClock:
    """The replay's clock: the timestamp of the event being replayed, in seconds."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def replay_requests(
    m: TierManager,
    trace: Trace,
    batch: int,
    on_request: Callable[[int, int], None] | None = None,
    before_request: Callable[[int], None] | None = None,
    tier_hits: collections.Counter[str] | None = None,
) -> list[int]:
    """Steps 1–3 of the module docstring for every request; returns the hit blocks of each.

    ``before_request(i)`` runs before request ``i`` is looked up (an oracle's clock);
    ``on_request(i, hits)`` after it is stored; ``tier_hits`` counts hit blocks by the tier
    the lookup found them in.  With ``m.sessions``, sessions and close events are honoured.
    """
    ns = trace.namespace.fingerprint
    hits: list[int] = []
    sessions = m.sessions
    clock = sessions.clock if sessions is not None else None
    for i, req in trace.events():
        if isinstance(clock, TraceClock):
            clock.now = req.timestamp / 1000
        if i < 0:  # a close_session event
            if sessions is not None:
                sessions.expire()
                assert req.session_id is not None  # the trace reader gives every close event its id
                m.close_session(req.session_id)
            continue
        assert isinstance(req, Request)
        keys = trace.keys[i]
        session = req.session_id if sessions is not None else None
        if sessions is not None:
            sessions.expire()
        if before_request is not None:
            before_request(i)
        n, tiers = m.match_prefix(keys, session=session)
        if tier_hits is not None:
            for t in tiers:
                tier_hits[t.name.lower()] += 1
        if n:
            leased = await m.acquire(keys[:n], session=session)
            m.release([x.lease_id for x in leased if x.status == Status.OK])
        parents = trace.parents(i)
        tokens = trace.block_token_counts(req)
        for start in range(n, len(keys), batch):
            end = min(start + batch, len(keys))
            metas = [BlockMeta(ns, keys[j], parents[j], tokens[j], "uint8", (1,), 1, 0) for j in range(start, end)]
            reserved = await m.reserve(metas, session=session)
            await m.commit([r.reservation_id for r in reserved if r.status == Status.OK])
        hits.append(n)
        if on_request is not None:
            on_request(i, n)
    return hits


def simulate(
    trace: Trace,
    capacity_blocks: int,
    policy: str | EvictionPolicy = DEFAULT_POLICY,
    *,
    batch: int = DEFAULT_PUT_BATCH,
    before_request: Callable[[int], None] | None = None,
    nvme_blocks: int = 0,
    sessions: bool = False,
    session_ttl: float = DEFAULT_SESSION_TTL,
) -> SimResult:
    """Replay ``trace`` through a tier manager of ``capacity_blocks`` DRAM blocks (and
    ``nvme_blocks`` NVMe blocks), honouring its session hints if ``sessions``.

    ``policy``: a name from :data:`POLICIES`, or a fresh policy instance (used once).
    """
    if isinstance(policy, str):
        check_policy(policy)
    check_capacity(capacity_blocks)
    if nvme_blocks:
        check_capacity(nvme_blocks)
    hints = Sessions(idle_ttl=session_ttl, clock=TraceClock()) if sessions else None
    m = build_manager(capacity_blocks, policy, nvme_blocks=nvme_blocks, sessions=hints)
    by_tier: collections.Counter[str] = collections.Counter()
    try:
        hits = run_replay(
            replay_requests(
                m, trace, put_batch(capacity_blocks, batch), before_request=before_request, tier_hits=by_tier
            )
        )
        evictions = m.counters["dram_evictions"]
    finally:
        m.close()
    return SimResult(
        policy=(policy if isinstance(policy, str) else policy.name) + ("+sessions" if sessions else ""),
        capacity_blocks=capacity_blocks,
        requests=len(trace),
        blocks=trace.total_blocks,
        hit_blocks=sum(hits),
        tokens=trace.total_tokens,
        hit_tokens=sum(trace.hit_tokens(r, n) for r, n in zip(trace.requests, hits)),
        evictions=evictions,
        per_request_hits=tuple(hits),
        nvme_blocks=nvme_blocks,
        tier_hits=tuple((t, by_tier[t]) for t in ("dram", "nvme")) if nvme_blocks else (("dram", sum(hits)),),
        sessions=sessions,
    )

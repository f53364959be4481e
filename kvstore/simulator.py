"""Simulator mode of ``kvstore replay``: a trace through the node's own tier manager.

No copy of the eviction code: each replay builds a real :class:`~kvstore.manager.TierManager`
over a real :class:`~tiers.dram.DRAMTier` holding the named policy from
:data:`kvstore.policy.POLICIES`, exactly as ``kvstore serve --nvme 0`` wires them
(``kvstore/server.py``).  The only stand-in is the arena: a :class:`BytelessArena` of
``capacity`` one-byte units, so a block takes one unit and no payload bytes exist.
The manager's coroutines never suspend without an NVMe tier, so a whole replay runs
inside one ``asyncio.run`` at a few microseconds per block.

What one request does (live mode, ``kvstore/livereplay.py``, sends the same calls over
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
full chunks (DESIGN §1); on Mooncake traces that differs by well under 1 % of blocks.

Admission: the node consults ``policy.admit`` only when demoting to NVMe, never for
DRAM, so neither does a DRAM-only replay; policies filter one-hit wonders through
their eviction order instead (a new block is the first victim unless it is reused).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

from kvstore.block import BlockMeta
from kvstore.errors import InvalidArgument
from kvstore.manager import Status, TierManager
from kvstore.policy import DEFAULT_POLICY, POLICIES, EvictionPolicy, make_policy
from kvstore.trace import HitRatios, Trace
from tiers.dram import DRAMTier

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


def check_policy(name: str) -> str:
    if name not in POLICIES:
        raise InvalidArgument(f"unknown policy {name!r} (--policy); choose one of {sorted(POLICIES)}")
    return name


def check_capacity(capacity_blocks: int) -> int:
    if isinstance(capacity_blocks, bool) or not isinstance(capacity_blocks, int) or capacity_blocks <= 0:
        raise InvalidArgument(f"--capacity must be a positive number of blocks, got {capacity_blocks!r}")
    return capacity_blocks


def build_manager(capacity_blocks: int, policy: str | EvictionPolicy) -> TierManager:
    """The node's wiring (``server.py``) for a DRAM-only node of ``capacity_blocks`` blocks.

    ``policy`` is a registered name, or an instance (the oracle bounds of :mod:`kvstore.bounds`).
    """
    pol = make_policy(policy) if isinstance(policy, str) else policy
    dram = DRAMTier(BytelessArena(capacity_blocks), policy=pol, unit=1)  # type: ignore[arg-type]
    return TierManager(dram, None)


async def replay_requests(m: TierManager, trace: Trace, batch: int, on_request: Callable[[int, int], None] | None = None,
                          before_request: Callable[[int], None] | None = None) -> list[int]:
    """Steps 1–3 of the module docstring for every request; returns the hit blocks of each.

    ``before_request(i)`` runs before request ``i`` is looked up (an oracle's clock);
    ``on_request(i, hits)`` after it is stored.
    """
    ns = trace.namespace.fingerprint
    hits: list[int] = []
    for i, (req, keys) in enumerate(zip(trace.requests, trace.keys)):
        if before_request is not None:
            before_request(i)
        n, _ = m.match_prefix(keys)
        if n:
            leased = await m.acquire(keys[:n])
            m.release([x.lease_id for x in leased if x.status == Status.OK])
        parents = trace.parents(i)
        tokens = trace.block_token_counts(req)
        for start in range(n, len(keys), batch):
            end = min(start + batch, len(keys))
            metas = [BlockMeta(ns, keys[j], parents[j], tokens[j], "uint8", (1,), 1, 0) for j in range(start, end)]
            reserved = await m.reserve(metas)
            await m.commit([r.reservation_id for r in reserved if r.status == Status.OK])
        hits.append(n)
        if on_request is not None:
            on_request(i, n)
    return hits


def simulate(trace: Trace, capacity_blocks: int, policy: str | EvictionPolicy = DEFAULT_POLICY, *, batch: int = DEFAULT_PUT_BATCH,
             before_request: Callable[[int], None] | None = None) -> SimResult:
    """Replay ``trace`` through a DRAM-only tier manager of ``capacity_blocks`` blocks.

    ``policy``: a name from :data:`POLICIES`, or a fresh policy instance (used once).
    """
    if isinstance(policy, str):
        check_policy(policy)
    check_capacity(capacity_blocks)
    m = build_manager(capacity_blocks, policy)
    try:
        hits = asyncio.run(replay_requests(m, trace, put_batch(capacity_blocks, batch), before_request=before_request))
        evictions = m.counters["dram_evictions"]
    finally:
        m.close()
    return SimResult(
        policy=policy if isinstance(policy, str) else policy.name,
        capacity_blocks=capacity_blocks,
        requests=len(trace),
        blocks=trace.total_blocks,
        hit_blocks=sum(hits),
        tokens=trace.total_tokens,
        hit_tokens=sum(trace.hit_tokens(r, n) for r, n in zip(trace.requests, hits)),
        evictions=evictions,
        per_request_hits=tuple(hits),
    )

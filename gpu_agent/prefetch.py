"""What to prefetch into HBM and what to evict from it: pure functions, no torch, no I/O.

The agent gathers the facts (which tier holds each chunk of a prompt, which chunks
are already in the HBM pool, the pool's entries) and asks these functions for a
decision; executing it is :mod:`gpu_agent.agent`'s job.  Tested on CPU with plain
values (``tests/unit/test_gpu_agent_prefetch.py``).

Rules:
* A chunk is useless without its ancestors, so prefetch walks a prompt's chunks in
  order and stops at the first one stored nowhere.
* Prefetch stays inside a byte budget and a time budget (estimated from per-tier
  bandwidths: an NVMe or remote chunk must first be promoted into DRAM, then every
  chunk crosses DRAM → HBM).  Chunks already in HBM cost nothing and are not fetched.
* Eviction is LRU over unprotected entries; among entries last used together (one
  prompt), descendants go before their ancestors (deepest chunk first).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence

GB = 1e9


@dataclasses.dataclass(frozen=True, slots=True)
class Bandwidths:
    """Bytes per second of each hop, for time estimates (defaults: architecture §14 and a PCIe 4 x16 link)."""

    dram_to_hbm: float = 20 * GB
    nvme_to_dram: float = 1.5 * GB
    remote_to_dram: float = 2.0 * GB

    def seconds(self, tier: str, nbytes: int) -> float:
        """Estimated time to bring ``nbytes`` from ``tier`` into HBM."""
        t = nbytes / self.dram_to_hbm
        if tier == "nvme":
            t += nbytes / self.nvme_to_dram
        elif tier == "remote":
            t += nbytes / self.remote_to_dram
        return t


@dataclasses.dataclass(frozen=True, slots=True)
class PoolEntry:
    """What eviction needs to know about one block in the HBM pool."""

    key: bytes
    last_use: int  # a logical clock: larger is more recent
    depth: int  # the chunk's index in its prompt (0 = first chunk)


@dataclasses.dataclass(frozen=True, slots=True)
class PrefetchPlan:
    fetch: tuple[int, ...]  # chunk indices to bring into HBM, in prompt order
    evict: tuple[bytes, ...]  # pool keys to drop first
    resident: int  # chunks of the usable prefix already in HBM
    prefix: int  # chunks of the prompt stored somewhere (HBM or the store) without a gap
    nbytes: int  # bytes the plan moves into HBM
    seconds: float  # its estimated time
    limit: str  # "" when every missing chunk of the prefix is planned, else "bytes", "time" or "pool"


def usable_prefix(tiers: Sequence[str | None], in_hbm: Sequence[bool]) -> int:
    """Leading chunks held somewhere: in HBM or in a store tier."""
    n = 0
    for tier, hbm in zip(tiers, in_hbm):
        if tier is None and not hbm:
            break
        n += 1
    return n


def plan_evictions(entries: Sequence[PoolEntry], need: int, protect: Collection[bytes] = ()) -> list[bytes]:
    """Up to ``need`` keys to evict: least recently used first, deepest first among equals;
    never a key in ``protect`` (the chunks of the request being served)."""
    if need <= 0:
        return []
    candidates = [e for e in entries if e.key not in protect]
    candidates.sort(key=lambda e: (e.last_use, -e.depth))
    return [e.key for e in candidates[:need]]


def plan_prefetch(
    tiers: Sequence[str | None],
    in_hbm: Sequence[bool],
    *,
    block_bytes: int,
    free_slots: int,
    entries: Sequence[PoolEntry],
    keys: Sequence[bytes],
    byte_budget: int,
    time_budget_s: float,
    bandwidths: Bandwidths = Bandwidths(),
) -> PrefetchPlan:
    """Choose which chunks of one prompt to bring into HBM now.

    ``tiers[i]``: the store tier holding chunk i (``"dram"``, ``"nvme"``, ``"remote"``) or
    None; ``in_hbm[i]``: chunk i is already in the pool; ``keys[i]``: its key (protected
    from eviction); ``entries``: the pool's current contents; ``free_slots``: empty slots.
    """
    if not (len(tiers) == len(in_hbm) == len(keys)):
        raise ValueError("tiers, in_hbm and keys must have one entry per chunk")
    prefix = usable_prefix(tiers, in_hbm)
    resident = sum(1 for i in range(prefix) if in_hbm[i])
    fetch: list[int] = []
    nbytes, seconds, limit = 0, 0.0, ""
    for i in range(prefix):
        if in_hbm[i]:
            continue
        tier = tiers[i] or "dram"
        cost = bandwidths.seconds(tier, block_bytes)
        if nbytes + block_bytes > byte_budget:
            limit = "bytes"
            break
        if seconds + cost > time_budget_s:
            limit = "time"
            break
        fetch.append(i)
        nbytes += block_bytes
        seconds += cost
    # room in the pool: free slots first, then evict entries outside this prompt
    protect = set(keys[:prefix])
    evict = plan_evictions(entries, len(fetch) - free_slots, protect)
    room = free_slots + len(evict)
    if room < len(fetch):
        fetch = fetch[:room]
        nbytes = len(fetch) * block_bytes
        seconds = sum(bandwidths.seconds(tiers[i] or "dram", block_bytes) for i in fetch)
        limit = "pool"
    return PrefetchPlan(tuple(fetch), tuple(evict), resident, prefix, nbytes, seconds, limit)

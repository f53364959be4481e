"""The offline optimum for a trace at a capacity: Belady's MIN with bypass.

Reference string: every block of every request, in order.  On a miss the block is stored
only if something resident will be used later than it, and then the resident block whose
next use is farthest away is evicted (a block never used again is never stored).

Why this is the optimum of the *prefix* hit ratio too: a block's parent is used
earlier in every request that uses the block, so a parent's next use always comes
before its child's.  MIN therefore evicts (or declines) children before parents, the
resident set stays closed under "parent of", and every block hit is a prefix hit.  MIN
with bypass maximises block hits for unit-size blocks, and prefix hits can never exceed
block hits, so its prefix hits are the most any policy can get.  ``tests/unit/
test_replay_optimal.py`` checks that against an exhaustive search on tiny traces.

O(B log B) for B block references: next uses from one backward pass, resident blocks
in a max-heap on next use with lazy deletion (a hit pushes the block's new next use;
older entries are skipped when they surface).
"""

from __future__ import annotations

import dataclasses
import heapq

from kvstore.traces.format import HitRatios, Trace

NEVER = 1 << 62


@dataclasses.dataclass(frozen=True, slots=True)
class OptimalResult(HitRatios):
    capacity_blocks: int
    blocks: int
    hit_blocks: int
    tokens: int
    hit_tokens: int
    per_request_hits: tuple[int, ...]

    policy = "optimal"


def next_uses(trace: Trace) -> list[int]:
    """For each position of the flattened reference string, the position of the same block's next use."""
    flat = [b for bs in trace.block_ids for b in bs]
    nxt = [NEVER] * len(flat)
    last: dict[int, int] = {}
    for i in range(len(flat) - 1, -1, -1):
        b = flat[i]
        nxt[i] = last.get(b, NEVER)
        last[b] = i
    return nxt


def optimal(trace: Trace, capacity_blocks: int) -> OptimalResult:
    """Belady's MIN with bypass over ``trace`` at ``capacity_blocks``; prefix hits per request."""
    if capacity_blocks <= 0:
        raise ValueError(f"capacity must be positive, got {capacity_blocks}")
    nxt = next_uses(trace)
    resident: dict[int, int] = {}  # block -> its next use (the valid heap entry)
    heap: list[tuple[int, int]] = []  # (-next use, block), stale entries included
    pos = 0
    per_request: list[int] = []
    for bs in trace.block_ids:
        run, in_run = 0, True
        for b in bs:
            nu = nxt[pos]
            pos += 1
            if b in resident:
                if in_run:
                    run += 1
                if nu == NEVER:
                    del resident[b]  # never used again: free its slot now (same as evicting it first)
                else:
                    resident[b] = nu
                    heapq.heappush(heap, (-nu, b))
                continue
            in_run = False
            if nu == NEVER:
                continue
            if len(resident) >= capacity_blocks:
                while True:  # the farthest valid entry
                    far, v = heap[0]
                    if resident.get(v) == -far:
                        break
                    heapq.heappop(heap)
                if -far < nu:
                    continue  # everything resident is used sooner than this block: bypass it
                heapq.heappop(heap)
                del resident[v]
            resident[b] = nu
            heapq.heappush(heap, (-nu, b))
            if len(heap) > 4 * capacity_blocks + 1024:
                heap = [(-n, k) for k, n in resident.items()]
                heapq.heapify(heap)
        per_request.append(run)
    return OptimalResult(
        capacity_blocks=capacity_blocks,
        blocks=trace.total_blocks,
        hit_blocks=sum(per_request),
        tokens=trace.total_tokens,
        hit_tokens=sum(trace.hit_tokens(r, n) for r, n in zip(trace.requests, per_request)),
        per_request_hits=tuple(per_request),
    )

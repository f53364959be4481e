"""What the connector saves: the save policy (``save_policy``), pure and clock-free.

Saving every computed chunk is the pool's cost with no reuse: a copy, a checksum and two
RPCs per chunk, for KV nobody reads again.  A chunk is worth storing when it will be read
again; the policies say how that is known:

* ``evidence`` (the default): learned from what the store reads back.  The engine's own
  node counts, per namespace and prompt-position bucket (``kvstore.vocabulary.position_bucket``), the blocks
  it stored and how many of them were read back at least once; :class:`Evidence` keeps a
  decayed ratio of those counts per (namespace, bucket) and stores a chunk at position
  bucket ``b`` when ``share(b) × recompute_s(chunk) > save_cost_s(chunk)``: ``share`` is
  read back / stored, pooled across the namespace's buckets (a bucket with little evidence
  of its own takes its namespace's share, which takes an optimistic Beta prior,
  :data:`PRIOR_READ`, :data:`PRIOR_UNREAD`), so a new namespace, with no evidence yet,
  stores, and one whose prompts are never read back stops storing at every position once
  a few dozen of its blocks say so, not a few dozen per position; ``recompute_s`` is the
  load gate's measured recompute time per token (none yet: store); ``save_cost_s`` the
  workers' measured save time per chunk (none yet: 0).  With no read-back the share falls
  and the engine stores almost nothing (one request in :data:`EXPLORE` declined is stored
  anyway, so a workload that turns to reuse is seen); on chats it stores almost
  everything.  Decode chunks follow the evidence of their own position's bucket; a session
  id is no retention hint here, ``kv_transfer_params["retain"]`` true is (everything is
  stored);
* ``always``: every chunk the engine computes (prompt, decode with ``save_decode``, the
  prompt's trailing partial chunk);
* ``second-sighting``: a chunk whose key this engine has looked up before (a count-min
  sketch of lookups, :class:`Sightings`): a system prompt is stored by its second request
  and read by the third; a one-off prompt is never stored; decode chunks are never stored
  (nobody has looked them up);
* ``hinted``: requests that carry a retention hint (``kv_transfer_params["session_id"]``,
  a conversation whose next turn extends this one, or ``kv_transfer_params["retain"]``
  true) store everything, decode KV included; others store nothing;
* ``auto``: ``hinted`` for requests with a hint, ``second-sighting`` for the rest.

An engine that only produces (``kv_producer``, prefill/decode) stores every chunk whatever
the policy: its consumer reads them next.  Chunks are stored as a leading run (a lookup
matches leading chunks only), so a chunk not admitted ends the run.

State: :class:`Sightings` and :class:`Evidence` belong to the scheduler half (its thread
only); the node's counters reach :meth:`Evidence.update` from the store link's poll.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from gpu_agent.vllm.gate import Rate
from gpu_agent.vllm.spec import request_session
from kvstore.keys import ChunkKey
from kvstore.vocabulary import BUCKETS, position_bucket
from tiers.sketch import FrequencySketch

SAVE_POLICIES = ("evidence", "auto", "always", "second-sighting", "hinted")
EVERYTHING = 1 << 62


@dataclasses.dataclass(frozen=True, slots=True)
class SavePlan:
    """What one request may store: its leading ``prompt_chunks`` full prompt chunks (chunk
    counts from 0), the prompt's trailing partial chunk (``tail``), decode chunks (``decode``)."""

    prompt_chunks: int = EVERYTHING
    tail: bool = True
    decode: bool = True

    @property
    def limited(self) -> bool:
        return self.prompt_chunks < EVERYTHING or not self.tail or not self.decode


NOTHING = SavePlan(0, False, False)


class Sightings:
    """How many times each chunk key was looked up lately (a count-min sketch with ageing:
    ``tiers.sketch.FrequencySketch``; a few hundred KiB, whatever the number of keys)."""

    def __init__(self, width: int = 1 << 16) -> None:
        self._sketch = FrequencySketch(width)

    def sight(self, keys: Sequence[ChunkKey]) -> list[int]:
        """Count one sighting of each key; each key's count, this one included."""
        return [self._sketch.increment(k) for k in keys]


def retained(request: Any) -> bool:
    """Whether a request asks for its KV to be kept (``kv_transfer_params["retain"]`` true)."""
    params = getattr(request, "kv_transfer_params", None)
    return isinstance(params, dict) and params.get("retain") is True


def hinted(request: Any) -> bool:
    """Whether a request says its KV will be read again (a session, or ``retain``): the
    hint of ``hinted`` and ``auto`` (``evidence`` takes only :func:`retained`)."""
    return request_session(request) is not None or retained(request)


def plan(
    policy: str,
    *,
    counts: Sequence[int],
    tail_count: int | None,
    hint: bool,
    producer_only: bool,
    save_decode: bool,
) -> SavePlan:
    """The :class:`SavePlan` of one request under a sighting or hint policy (``evidence``
    plans with :meth:`Evidence.plan`): ``counts`` are its full prompt chunks' sighting
    counts (:meth:`Sightings.sight`, this lookup included), ``tail_count`` its partial
    chunk's (None: the prompt ends on a chunk boundary)."""
    if policy == "evidence":
        raise ValueError("save_policy evidence plans with Evidence.plan, not plan()")
    if producer_only or policy == "always" or (hint and policy in ("hinted", "auto")):
        seen_tail = policy == "always" or producer_only or (tail_count or 0) >= 2
        return SavePlan(EVERYTHING, seen_tail, save_decode)
    if policy == "hinted":
        return NOTHING
    run = next((i for i, c in enumerate(counts) if c < 2), len(counts))
    return SavePlan(run, run == len(counts) and (tail_count or 0) >= 2, False)


PRIOR_READ = 3.0
"""The prior's read-back blocks: with :data:`PRIOR_UNREAD`, a share of 0.75 before evidence."""
PRIOR_UNREAD = 1.0
POOLING = PRIOR_READ + PRIOR_UNREAD
"""A bucket's prior weight, in blocks, on its namespace's share (see :meth:`Evidence.share`)."""
EXPLORE = 32
"""One request in this many that the evidence would not store is stored anyway."""
DECAY = 0.956
"""Weight of the evidence so far at each update (one poll of the node's counters, every
second: ``gpu_agent.vllm.storelink.READ_BACK_EVERY_S``): evidence halves in about 15 s."""


class Evidence:
    """What share of what is stored gets read back, per namespace fingerprint and position
    bucket, and the admission it implies (see the module docstring).

    :meth:`update` takes the node's cumulative counters (``KVClient.stats()["read_back"]``
    rows, namespaces as fingerprints in hex, summed over nodes by the caller or not: rows of one (namespace, bucket) add up)
    and adds their increase since the last update to exponentially decayed sums (a counter
    that went down was reset: a node restarted).  :meth:`observe` takes the workers' save
    timings (``save_us`` over ``save_chunks``).  Clock-free; the caller decides when to poll.
    """

    def __init__(self, *, explore: int = EXPLORE, decay: float = DECAY) -> None:
        if explore < 0 or not 0.0 <= decay < 1.0:
            raise ValueError(f"explore must be >= 0 and decay in [0, 1), got {explore}, {decay}")
        self.explore, self.decay = explore, decay
        self._last: dict[tuple[bytes, int], tuple[int, int]] = {}  # the counters at the last update
        self._sums: dict[tuple[bytes, int], tuple[float, float]] = {}  # decayed (stored, read back)
        self._ns_sums: dict[bytes, tuple[float, float]] = {}  # the same, a namespace's buckets summed
        self.save = Rate()  # seconds per chunk saved (Rate.per_token: per unit, here a chunk)
        self._declined = 0
        self.updates = 0

    def update(self, rows: Sequence[Mapping[str, Any]]) -> None:
        """One poll of the node's read-back counters."""
        now: dict[tuple[bytes, int], list[int]] = {}
        for r in rows:
            acc = now.setdefault((bytes.fromhex(str(r["namespace"])), int(r["bucket"])), [0, 0])
            acc[0] += int(r["stored_blocks"])
            acc[1] += int(r["read_back_blocks"])
        for key in set(self._sums) | set(now):
            stored, read = now.get(key, self._last.get(key, (0, 0)))
            ls, lr = self._last.get(key, (0, 0))
            ds = stored - ls if stored >= ls else stored
            dr = read - lr if read >= lr else read
            s, r_ = self._sums.get(key, (0.0, 0.0))
            self._sums[key] = (s * self.decay + ds, r_ * self.decay + dr)
            self._last[key] = (stored, read)
        totals: dict[bytes, tuple[float, float]] = {}
        for (ns, _), (s, r_) in self._sums.items():
            ts, tr = totals.get(ns, (0.0, 0.0))
            totals[ns] = (ts + s, tr + min(r_, s))
        self._ns_sums = totals
        self.updates += 1

    def observe(self, data: Mapping[str, Any]) -> None:
        """The workers' stats of one step (their counters' deltas): the save timings."""
        self.save.add(float(data.get("save_us", 0)) / 1e6, float(data.get("save_chunks", 0)))

    def namespace_share(self, namespace: bytes) -> float:
        """Expected share of the namespace's stored blocks that will be read back, all
        positions pooled, with the optimistic prior (0.75 with no evidence)."""
        stored, read = self._ns_sums.get(namespace, (0.0, 0.0))
        return (read + PRIOR_READ) / (stored + PRIOR_READ + PRIOR_UNREAD)

    def share(self, namespace: bytes, bucket: int) -> float:
        """Expected share of blocks stored at this (namespace, bucket) that will be read back:
        the bucket's own ratio, shrunk towards its namespace's share (:data:`POOLING` blocks'
        weight): positions with little evidence of their own follow their namespace's."""
        stored, read = self._sums.get((namespace, bucket), (0.0, 0.0))
        return (min(read, stored) + POOLING * self.namespace_share(namespace)) / (stored + POOLING)

    def admits(self, namespace: bytes, bucket: int, recompute_s: float | None) -> bool:
        """Whether a chunk at ``bucket`` is worth storing: its expected saving (share ×
        ``recompute_s``, the chunk's measured recompute time; None: unknown, stores) beats
        its measured save cost (none yet: 0)."""
        if recompute_s is None:
            return True
        cost = self.save.per_token() or 0.0
        return self.share(namespace, bucket) * recompute_s > cost

    def plan(
        self,
        namespace: bytes,
        *,
        chunks: int,
        recompute_s: float | None,
        retain: bool,
        producer_only: bool,
        save_decode: bool,
    ) -> SavePlan:
        """The :class:`SavePlan` of one request of ``chunks`` full prompt chunks in
        ``namespace`` (the fingerprint the node counts), each costing ``recompute_s`` to
        recompute.  Its trailing partial chunk and its first decode chunk sit at position
        ``chunks``: both are stored when the whole prompt is and that position's bucket is
        admitted."""
        if producer_only or retain:
            return SavePlan(EVERYTHING, True, save_decode)
        ok = [self.admits(namespace, b, recompute_s) for b in range(BUCKETS)]
        run = next((i for i in range(chunks) if not ok[position_bucket(i)]), chunks)
        end = ok[position_bucket(chunks)]  # the tail's position, and the first decode chunk's
        if run < chunks or not end:
            self._declined += 1
            if self.explore and self._declined % self.explore == 0:
                return SavePlan(EVERYTHING, True, save_decode)  # measure again: reuse may have come
        if run == chunks and end:
            return SavePlan(EVERYTHING, True, save_decode)
        return SavePlan(run, False, False)

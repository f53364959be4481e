"""Names the node, the SDK and the tools agree on, with no behaviour of their own.

* :class:`TierKind`: where a block lives (values match the protobuf ``Tier`` enum);
  :mod:`tiers.base` re-exports it for the tiers.
* :class:`Extent`: a byte range of an arena or a file; the allocators hand them out
  (:mod:`tiers.allocator`), the wire carries them (:mod:`kvstore.wire`), clients copy
  into and out of them (:mod:`kvstore.shm`).
* Miss reasons: the ``reason`` label values of ``kvstore_miss_blocks_total`` (the node's
  hit ledger, ``kvstore/node/ledger.py``, documents each) and the two a cluster client
  reports itself (``ReportHits``).  Part of the metrics contract: never rename.
* Session ids: what a ``session_id`` may be (:func:`check_session_id`), checked by the
  SDK before sending and by the node on receipt.
* Node counters: the names ``Stats`` may report (:data:`NODE_COUNTERS`); a node reports a
  counter once it has counted something, so a reader takes an absent known name as 0.
* Prompt-position buckets (:func:`position_bucket`): how the node's read-back counters
  (``kvstore/node/readback.py``) and the connector's admission by evidence
  (``gpu_agent/vllm/admission.py``) group a chunk's index in its chain.  A block's
  *position* is 0 for a prompt's first chunk (no parent); positions are grouped in powers
  of two, so a namespace's counters stay a handful of numbers whatever the prompt lengths:
  bucket 0 is position 0, bucket 1 position 1, bucket ``b`` (``1 <= b < LAST_BUCKET``)
  positions ``[2**(b-1), 2**b)``, :data:`LAST_BUCKET` every position from
  ``2**(LAST_BUCKET-1)`` on, and :data:`UNKNOWN_BUCKET` blocks whose position the node
  could not tell (their parent was not stored there, or left before they came).
* Percentiles (:func:`percentile`, :func:`percentiles`): the one rule every report, the
  conductor and the tools use for a p50 or a p99 (linear interpolation between the closest
  ranks, numpy's default), so one figure means one thing in every output.

Owns no state.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Iterable, Sequence

from kvstore.errors import InvalidArgument


class TierKind(enum.IntEnum):
    """Where a block lives, fastest first.  Values match the protobuf ``Tier`` enum."""

    HBM = 1
    DRAM = 2
    NVME = 3


@dataclasses.dataclass(frozen=True, slots=True)
class Extent:
    """A byte range ``[offset, offset + length)``; both are multiples of the allocator unit."""

    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


# -- miss reasons (label values of kvstore_miss_blocks_total) ----------------------------
NEVER_STORED = "never_stored"
EVICTED = "evicted"
INVALIDATED = "invalidated"
CORRUPT = "corrupt"
NODE_DOWN = "node_down"  # client side: the owner did not answer
DEADLINE = "deadline"  # client side: the owner answered after the call's deadline
REASONS = (NEVER_STORED, EVICTED, INVALIDATED, CORRUPT, NODE_DOWN, DEADLINE)
CLIENT_MISS_REASONS = (NODE_DOWN, DEADLINE)  # what cluster clients report (``ReportHits``)

# -- session ids ---------------------------------------------------------------------------
MAX_SESSION_ID = 256  # bytes (UTF-8)


def check_session_id(session: object) -> str | None:
    """A session id as callers pass it: None or "" (no session), else a printable string."""
    if session is None or session == "":
        return None
    if not isinstance(session, str):
        raise InvalidArgument(f"a session id is a string, got {type(session).__name__}")
    if len(session.encode()) > MAX_SESSION_ID or not session.isprintable():
        raise InvalidArgument(f"a session id is printable and at most {MAX_SESSION_ID} bytes, got {session!r:.80}")
    return session


# -- node counters (StatsResponse.counters) ---------------------------------------------------
NODE_COUNTERS = frozenset(
    {
        "active_transfers",
        "corrupt_blocks",
        "corrupt_demotions",
        "corrupt_puts",
        "data_channel_aborted_puts",
        "deletes",
        "demoted_bytes",
        "demotions",
        "dram_evictions",
        "epoch_reclaimed_blocks",
        "get_bytes",
        "get_hits_dram",
        "get_hits_nvme",
        "get_misses",
        "get_misses_corrupt",
        "get_no_space",
        "grpc_stream_bytes_in",
        "grpc_stream_bytes_out",
        "invalidated_blocks",
        "leases_expired",
        "local_bytes_in",
        "local_bytes_out",
        "loop_stalled_ms",
        "loop_stalls",
        "match_prefix_calls",
        "match_prefix_hits",
        "match_prefix_keys",
        "nvme_corrupt_blocks",
        "nvme_evictions",
        "owner_change_dropped_blocks",
        "nvme_rejected",
        "nvme_write_failures",
        "pending_transfers",
        "pin_tenant_limit",
        "pins_ttl_capped",
        "promoted_bytes",
        "promotions",
        "put_bytes",
        "puts",
        "read_back_blocks",
        "read_back_bytes",
        "puts_deduplicated",
        "puts_shadowed",
        "quota_evictions_dram",
        "quota_evictions_nvme",
        "quota_rejected_nvme",
        "reservations_reclaimed",
        "reserve_no_space",
        "reserve_stalled",
        "reserve_tenant_limit",
        "reserve_tenant_quota",
        "stored_blocks",
        "stored_bytes",
        "session_blocks_dead",
        "session_blocks_revived",
        "session_dead_forgotten",
        "session_keys_untracked",
        "sessions_close_unknown",
        "sessions_closed",
        "sessions_evicted",
        "sessions_expired",
        "sessions_opened",
        "tcp_bytes_in",
        "tcp_bytes_out",
    }
)


# -- prompt-position buckets (the read-back counters, admission by evidence) ------------------
LAST_BUCKET = 8  # positions >= 128
UNKNOWN_BUCKET = LAST_BUCKET + 1
BUCKETS = UNKNOWN_BUCKET + 1


def position_bucket(position: int) -> int:
    """The bucket of a chunk at ``position`` (0-based) in its chain."""
    if position < 0:
        raise ValueError(f"a chunk position is 0 or more, got {position}")
    return min(position.bit_length(), LAST_BUCKET)


def bucket_label(bucket: int) -> str:
    """The bucket's positions, as a label: ``"0"``, ``"1"``, ``"2-3"``, ..., ``"128+"``, ``"unknown"``."""
    if not 0 <= bucket < BUCKETS:
        raise ValueError(f"bucket must be in [0, {BUCKETS}), got {bucket}")
    if bucket == UNKNOWN_BUCKET:
        return "unknown"
    if bucket <= 1:
        return str(bucket)
    lo = 1 << (bucket - 1)
    return f"{lo}+" if bucket == LAST_BUCKET else f"{lo}-{2 * lo - 1}"


# -- percentiles (every report) ---------------------------------------------------------------
def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0 to 100) of ``values`` (at least one): linear interpolation
    between the closest ranks of the sorted values (numpy's ``percentile`` by default)."""
    if not 0 <= q <= 100:
        raise ValueError(f"a percentile is between 0 and 100, got {q}")
    s = sorted(values)
    if not s:
        raise ValueError("no values to take a percentile of")
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def percentiles(
    values: Iterable[float],
    qs: Sequence[float] = (50, 99),
    *,
    scale: float = 1.0,
    digits: int | None = None,
    suffix: str = "",
) -> dict[str, float | None]:
    """``{"p50": ..., "p99": ...}`` of ``values`` × ``scale`` (:func:`percentile`), keys
    ``f"p{q:g}{suffix}"``, rounded to ``digits``; each None when there are no values."""
    s = sorted(v * scale for v in values)
    out: dict[str, float | None] = {}
    for q in qs:
        v = percentile(s, q) if s else None
        out[f"p{q:g}{suffix}"] = v if v is None or digits is None else round(v, digits)
    return out

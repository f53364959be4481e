"""Prompt-position buckets: the shared vocabulary of the node's read-back counters and the
connector's admission by evidence.

A block's *position* is its chunk's index in its chain (0 for a prompt's first chunk: no
parent).  Positions are grouped in powers of two so that a namespace's counters stay a
handful of numbers whatever the prompt lengths: bucket 0 is position 0, bucket 1 position 1,
bucket ``b`` (``1 <= b < LAST_BUCKET``) positions ``[2**(b-1), 2**b)``, and
:data:`LAST_BUCKET` every position from ``2**(LAST_BUCKET-1)`` on.  :data:`UNKNOWN_BUCKET`
holds blocks whose position the node could not tell (their parent was not stored here, or
left before they came).

Pure functions; owns no state.
"""

from __future__ import annotations

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

"""What share of what this node stores is read back: counters per namespace and prompt position.

A block is *stored* when a commit publishes it (a key this node did not hold); it is *read
back* the first time an ``Acquire`` leases it afterwards (later reads of it are not counted
again).  Both are counted per (namespace fingerprint, position bucket) in blocks and payload
bytes, so a reader (the connector's admission by evidence, ``gpu_agent/vllm/admission.py``)
learns ``read_back / stored`` for its namespace at each prompt position.

The position of a block is its chunk's index in its chain: 0 for a block without a parent,
its parent's position + 1 when the parent is one of the blocks followed here, else unknown
(:data:`kvstore.vocabulary.UNKNOWN_BUCKET`: the parent was never stored here, or left first).
Positions are grouped by :func:`kvstore.vocabulary.position_bucket`.

Owner: the tier manager's event loop (``TierManager.readback``); nothing here is
thread-safe and nothing does I/O.

Memory is bounded: one int per followed block (its namespace slot, position and a "read
yet" bit), at most ``max_blocks`` of them (past that the longest-followed block is
forgotten first: a later first read of it is not counted); departed blocks are forgotten
(``left``).  Counters are kept for at most ``namespace_limit`` namespaces (the first seen);
later ones share one row, reported with an empty fingerprint.  Counters only grow; they
start at 0 with the process (blocks found on NVMe at start-up are not followed).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from kvstore.block import BlockMeta
from kvstore.keys import NO_PARENT, ChunkKey
from kvstore.vocabulary import BUCKETS, UNKNOWN_BUCKET, position_bucket

_READ = 1
_POS_SHIFT = 1
_POS_MASK = 0xFF  # positions are followed up to 254; 255 means unknown
_POS_UNKNOWN = 0xFF
_SLOT_SHIFT = 9
_FIELDS = 4  # stored_blocks, stored_bytes, read_back_blocks, read_back_bytes


@dataclasses.dataclass(frozen=True, slots=True)
class ReadBackRow:
    """The counters of one (namespace, position bucket); ``namespace`` is b"" for the
    namespaces past the limit."""

    namespace: bytes
    bucket: int
    stored_blocks: int
    stored_bytes: int
    read_back_blocks: int
    read_back_bytes: int


class ReadBack:
    """Stored and read-back blocks and bytes, per namespace and position bucket."""

    def __init__(self, *, namespace_limit: int = 256, max_blocks: int = 1 << 22) -> None:
        if namespace_limit < 0 or max_blocks < 1:
            raise ValueError(f"namespace_limit must be >= 0 and max_blocks >= 1, got {namespace_limit}, {max_blocks}")
        self.namespace_limit = namespace_limit
        self.max_blocks = max_blocks
        self._blocks: dict[ChunkKey, int] = {}  # key -> slot << 9 | position << 1 | read
        self._slots: dict[bytes, int] = {}  # fingerprint -> slot (0 is "other")
        self._names: list[bytes] = [b""]
        self._counts: list[list[int]] = [[0] * (BUCKETS * _FIELDS)]
        self.forgotten = 0  # followed blocks dropped for max_blocks

    def _slot(self, namespace: bytes) -> int:
        s = self._slots.get(namespace)
        if s is not None:
            return s
        if len(self._names) > self.namespace_limit:
            return 0
        s = self._slots[namespace] = len(self._names)
        self._names.append(namespace)
        self._counts.append([0] * (BUCKETS * _FIELDS))
        return s

    def stored(self, meta: BlockMeta) -> None:
        """A commit published ``meta``'s block.  A key followed already is not counted again."""
        if meta.key in self._blocks:
            return
        if meta.parent == NO_PARENT:
            pos = 0
        else:
            parent = self._blocks.get(meta.parent)
            ppos = _POS_UNKNOWN if parent is None else (parent >> _POS_SHIFT) & _POS_MASK
            pos = _POS_UNKNOWN if ppos == _POS_UNKNOWN else min(ppos + 1, _POS_UNKNOWN - 1)
        slot = self._slot(meta.namespace)
        if len(self._blocks) >= self.max_blocks:
            del self._blocks[next(iter(self._blocks))]
            self.forgotten += 1
        self._blocks[meta.key] = slot << _SLOT_SHIFT | pos << _POS_SHIFT
        row = self._counts[slot]
        b = _bucket(pos) * _FIELDS
        row[b] += 1
        row[b + 1] += meta.payload_len

    def read(self, metas: Iterable[BlockMeta]) -> None:
        """An ``Acquire`` leased these blocks: each one's first read since it was stored counts."""
        blocks = self._blocks
        for meta in metas:
            v = blocks.get(meta.key)
            if v is None or v & _READ:
                continue
            blocks[meta.key] = v | _READ
            row = self._counts[v >> _SLOT_SHIFT]
            b = _bucket((v >> _POS_SHIFT) & _POS_MASK) * _FIELDS
            row[b + 2] += 1
            row[b + 3] += meta.payload_len

    def left(self, key: ChunkKey) -> None:
        """``key`` is no longer on this node (its counts stay)."""
        self._blocks.pop(key, None)

    def __len__(self) -> int:
        """How many blocks are followed now."""
        return len(self._blocks)

    def rows(self) -> list[ReadBackRow]:
        """Every (namespace, bucket) that stored something, namespaces in the order first seen."""
        out: list[ReadBackRow] = []
        for slot, row in enumerate(self._counts):
            for b in range(BUCKETS):
                f = row[b * _FIELDS : (b + 1) * _FIELDS]
                if f[0]:
                    out.append(ReadBackRow(self._names[slot], b, f[0], f[1], f[2], f[3]))
        return out

    def totals(self) -> dict[str, int]:
        """The node's sums: ``stored_blocks``, ``stored_bytes``, ``read_back_blocks``, ``read_back_bytes``."""
        sums = [0] * _FIELDS
        for row in self._counts:
            for i, v in enumerate(row):
                sums[i % _FIELDS] += v
        return dict(zip(("stored_blocks", "stored_bytes", "read_back_blocks", "read_back_bytes"), sums, strict=True))


def _bucket(pos: int) -> int:
    return UNKNOWN_BUCKET if pos == _POS_UNKNOWN else position_bucket(pos)

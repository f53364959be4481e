"""What the tier manager answers per key: a status, and the handles of reservations and leases.

Plain frozen values, no state and no owner: the manager (``kvstore/node/manager.py``) and its
movers (``kvstore/node/movers.py``) make them, the service maps them onto protobuf.  They are
re-exported by ``kvstore.node.manager``, where callers import them from.

Invariants: ``Status`` values equal the protobuf ``KeyStatus`` numbers; a ``Reserved`` or
``Leased`` carries an id and extents only when its status is ``OK``.
"""

from __future__ import annotations

import dataclasses
import enum

from kvstore.block import BlockMeta
from kvstore.keys import ChunkKey
from tiers.allocator import Extent
from tiers.base import TierKind


class Status(enum.IntEnum):
    """Per-key outcome.  Values match the protobuf ``KeyStatus`` enum."""

    OK = 1
    MISS = 2
    EXISTS = 3
    CORRUPT = 4
    EXPIRED = 5
    NO_SPACE = 6


@dataclasses.dataclass(frozen=True, slots=True)
class Reserved:
    status: Status
    reservation_id: int = 0
    extents: tuple[Extent, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class Leased:
    key: ChunkKey
    status: Status
    lease_id: int = 0
    extents: tuple[Extent, ...] = ()
    meta: BlockMeta | None = None
    tier: TierKind | None = None  # where the block was found (NVME means it was promoted)

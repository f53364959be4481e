from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_HBM: _ClassVar[Tier]
    TIER_DRAM: _ClassVar[Tier]
    TIER_NVME: _ClassVar[Tier]

class KeyStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KEY_STATUS_UNSPECIFIED: _ClassVar[KeyStatus]
    KEY_STATUS_OK: _ClassVar[KeyStatus]
    KEY_STATUS_MISS: _ClassVar[KeyStatus]
    KEY_STATUS_EXISTS: _ClassVar[KeyStatus]
    KEY_STATUS_CORRUPT: _ClassVar[KeyStatus]
    KEY_STATUS_EXPIRED: _ClassVar[KeyStatus]
    KEY_STATUS_NO_SPACE: _ClassVar[KeyStatus]

class HoldingsKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HOLDINGS_KIND_UNSPECIFIED: _ClassVar[HoldingsKind]
    HOLDINGS_KIND_SNAPSHOT: _ClassVar[HoldingsKind]
    HOLDINGS_KIND_DELTAS: _ClassVar[HoldingsKind]
    HOLDINGS_KIND_HEARTBEAT: _ClassVar[HoldingsKind]
TIER_UNSPECIFIED: Tier
TIER_HBM: Tier
TIER_DRAM: Tier
TIER_NVME: Tier
KEY_STATUS_UNSPECIFIED: KeyStatus
KEY_STATUS_OK: KeyStatus
KEY_STATUS_MISS: KeyStatus
KEY_STATUS_EXISTS: KeyStatus
KEY_STATUS_CORRUPT: KeyStatus
KEY_STATUS_EXPIRED: KeyStatus
KEY_STATUS_NO_SPACE: KeyStatus
HOLDINGS_KIND_UNSPECIFIED: HoldingsKind
HOLDINGS_KIND_SNAPSHOT: HoldingsKind
HOLDINGS_KIND_DELTAS: HoldingsKind
HOLDINGS_KIND_HEARTBEAT: HoldingsKind

class BlockInfo(_message.Message):
    __slots__ = ("key", "parent", "namespace", "token_count", "dtype", "shape", "payload_len", "payload_checksum")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_LEN_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    parent: bytes
    namespace: bytes
    token_count: int
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    payload_len: int
    payload_checksum: int
    def __init__(self, key: _Optional[bytes] = ..., parent: _Optional[bytes] = ..., namespace: _Optional[bytes] = ..., token_count: _Optional[int] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., payload_len: _Optional[int] = ..., payload_checksum: _Optional[int] = ...) -> None: ...

class Extent(_message.Message):
    __slots__ = ("offset", "length")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    offset: int
    length: int
    def __init__(self, offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class HelloRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HelloResponse(_message.Message):
    __slots__ = ("node_id", "version", "arena_path", "arena_size", "data_port", "max_block_bytes", "max_batch", "lease_ttl_s", "reservation_ttl_s", "packed_version")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ARENA_PATH_FIELD_NUMBER: _ClassVar[int]
    ARENA_SIZE_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_TTL_S_FIELD_NUMBER: _ClassVar[int]
    PACKED_VERSION_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    version: str
    arena_path: str
    arena_size: int
    data_port: int
    max_block_bytes: int
    max_batch: int
    lease_ttl_s: float
    reservation_ttl_s: float
    packed_version: int
    def __init__(self, node_id: _Optional[str] = ..., version: _Optional[str] = ..., arena_path: _Optional[str] = ..., arena_size: _Optional[int] = ..., data_port: _Optional[int] = ..., max_block_bytes: _Optional[int] = ..., max_batch: _Optional[int] = ..., lease_ttl_s: _Optional[float] = ..., reservation_ttl_s: _Optional[float] = ..., packed_version: _Optional[int] = ...) -> None: ...

class PackedBlocks(_message.Message):
    __slots__ = ("keys", "parents", "namespace", "token_counts", "dtypes", "ndims", "shape", "payload_lens", "payload_checksums")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNTS_FIELD_NUMBER: _ClassVar[int]
    DTYPES_FIELD_NUMBER: _ClassVar[int]
    NDIMS_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_LENS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    keys: bytes
    parents: bytes
    namespace: bytes
    token_counts: bytes
    dtypes: bytes
    ndims: bytes
    shape: bytes
    payload_lens: bytes
    payload_checksums: bytes
    def __init__(self, keys: _Optional[bytes] = ..., parents: _Optional[bytes] = ..., namespace: _Optional[bytes] = ..., token_counts: _Optional[bytes] = ..., dtypes: _Optional[bytes] = ..., ndims: _Optional[bytes] = ..., shape: _Optional[bytes] = ..., payload_lens: _Optional[bytes] = ..., payload_checksums: _Optional[bytes] = ...) -> None: ...

class PackedReservations(_message.Message):
    __slots__ = ("statuses", "ids", "extent_counts", "extents")
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    EXTENT_COUNTS_FIELD_NUMBER: _ClassVar[int]
    EXTENTS_FIELD_NUMBER: _ClassVar[int]
    statuses: bytes
    ids: bytes
    extent_counts: bytes
    extents: bytes
    def __init__(self, statuses: _Optional[bytes] = ..., ids: _Optional[bytes] = ..., extent_counts: _Optional[bytes] = ..., extents: _Optional[bytes] = ...) -> None: ...

class PackedLeases(_message.Message):
    __slots__ = ("statuses", "ids", "extent_counts", "extents", "payload_lens", "payload_checksums", "tiers")
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    EXTENT_COUNTS_FIELD_NUMBER: _ClassVar[int]
    EXTENTS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_LENS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    statuses: bytes
    ids: bytes
    extent_counts: bytes
    extents: bytes
    payload_lens: bytes
    payload_checksums: bytes
    tiers: bytes
    def __init__(self, statuses: _Optional[bytes] = ..., ids: _Optional[bytes] = ..., extent_counts: _Optional[bytes] = ..., extents: _Optional[bytes] = ..., payload_lens: _Optional[bytes] = ..., payload_checksums: _Optional[bytes] = ..., tiers: _Optional[bytes] = ...) -> None: ...

class KeysRequest(_message.Message):
    __slots__ = ("keys", "session_id", "packed_keys")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PACKED_KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    session_id: str
    packed_keys: bytes
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., session_id: _Optional[str] = ..., packed_keys: _Optional[bytes] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("tiers",)
    TIERS_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    def __init__(self, tiers: _Optional[_Iterable[_Union[Tier, str]]] = ...) -> None: ...

class MatchPrefixResponse(_message.Message):
    __slots__ = ("matched", "tiers")
    MATCHED_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    matched: int
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    def __init__(self, matched: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[Tier, str]]] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("blocks", "session_id", "packed")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[BlockInfo]
    session_id: str
    packed: PackedBlocks
    def __init__(self, blocks: _Optional[_Iterable[_Union[BlockInfo, _Mapping]]] = ..., session_id: _Optional[str] = ..., packed: _Optional[_Union[PackedBlocks, _Mapping]] = ...) -> None: ...

class Reservation(_message.Message):
    __slots__ = ("status", "reservation_id", "extents")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    EXTENTS_FIELD_NUMBER: _ClassVar[int]
    status: KeyStatus
    reservation_id: int
    extents: _containers.RepeatedCompositeFieldContainer[Extent]
    def __init__(self, status: _Optional[_Union[KeyStatus, str]] = ..., reservation_id: _Optional[int] = ..., extents: _Optional[_Iterable[_Union[Extent, _Mapping]]] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("reservations", "ttl_s", "packed")
    RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    reservations: _containers.RepeatedCompositeFieldContainer[Reservation]
    ttl_s: float
    packed: PackedReservations
    def __init__(self, reservations: _Optional[_Iterable[_Union[Reservation, _Mapping]]] = ..., ttl_s: _Optional[float] = ..., packed: _Optional[_Union[PackedReservations, _Mapping]] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("reservation_ids", "payload_checksums")
    RESERVATION_IDS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    reservation_ids: _containers.RepeatedScalarFieldContainer[int]
    payload_checksums: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, reservation_ids: _Optional[_Iterable[int]] = ..., payload_checksums: _Optional[_Iterable[int]] = ...) -> None: ...

class StatusesResponse(_message.Message):
    __slots__ = ("statuses",)
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    statuses: _containers.RepeatedScalarFieldContainer[KeyStatus]
    def __init__(self, statuses: _Optional[_Iterable[_Union[KeyStatus, str]]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("reservation_ids",)
    RESERVATION_IDS_FIELD_NUMBER: _ClassVar[int]
    reservation_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, reservation_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Lease(_message.Message):
    __slots__ = ("status", "lease_id", "extents", "block", "tier")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    EXTENTS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    status: KeyStatus
    lease_id: int
    extents: _containers.RepeatedCompositeFieldContainer[Extent]
    block: BlockInfo
    tier: Tier
    def __init__(self, status: _Optional[_Union[KeyStatus, str]] = ..., lease_id: _Optional[int] = ..., extents: _Optional[_Iterable[_Union[Extent, _Mapping]]] = ..., block: _Optional[_Union[BlockInfo, _Mapping]] = ..., tier: _Optional[_Union[Tier, str]] = ...) -> None: ...

class AcquireResponse(_message.Message):
    __slots__ = ("leases", "ttl_s", "packed")
    LEASES_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    leases: _containers.RepeatedCompositeFieldContainer[Lease]
    ttl_s: float
    packed: PackedLeases
    def __init__(self, leases: _Optional[_Iterable[_Union[Lease, _Mapping]]] = ..., ttl_s: _Optional[float] = ..., packed: _Optional[_Union[PackedLeases, _Mapping]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_ids",)
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    lease_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, lease_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("valid",)
    VALID_FIELD_NUMBER: _ClassVar[int]
    valid: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, valid: _Optional[_Iterable[bool]] = ...) -> None: ...

class StartGetResponse(_message.Message):
    __slots__ = ("transfer_id", "leases", "ttl_s", "packed")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    transfer_id: bytes
    leases: _containers.RepeatedCompositeFieldContainer[Lease]
    ttl_s: float
    packed: PackedLeases
    def __init__(self, transfer_id: _Optional[bytes] = ..., leases: _Optional[_Iterable[_Union[Lease, _Mapping]]] = ..., ttl_s: _Optional[float] = ..., packed: _Optional[_Union[PackedLeases, _Mapping]] = ...) -> None: ...

class StartPutResponse(_message.Message):
    __slots__ = ("transfer_id", "statuses", "ttl_s")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    transfer_id: bytes
    statuses: _containers.RepeatedScalarFieldContainer[KeyStatus]
    ttl_s: float
    def __init__(self, transfer_id: _Optional[bytes] = ..., statuses: _Optional[_Iterable[_Union[KeyStatus, str]]] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class BlockChunk(_message.Message):
    __slots__ = ("block", "data", "status", "session_id")
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    block: BlockInfo
    data: bytes
    status: KeyStatus
    session_id: str
    def __init__(self, block: _Optional[_Union[BlockInfo, _Mapping]] = ..., data: _Optional[bytes] = ..., status: _Optional[_Union[KeyStatus, str]] = ..., session_id: _Optional[str] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("count",)
    COUNT_FIELD_NUMBER: _ClassVar[int]
    count: int
    def __init__(self, count: _Optional[int] = ...) -> None: ...

class InvalidateRequest(_message.Message):
    __slots__ = ("namespace",)
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    def __init__(self, namespace: _Optional[bytes] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("keys", "ttl_s")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    ttl_s: float
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("tier", "capacity_bytes", "used_bytes", "blocks")
    TIER_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    capacity_bytes: int
    used_bytes: int
    blocks: int
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., blocks: _Optional[int] = ...) -> None: ...

class ReadBackCounts(_message.Message):
    __slots__ = ("namespace", "bucket", "stored_blocks", "stored_bytes", "read_back_blocks", "read_back_bytes")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    STORED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    READ_BACK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    READ_BACK_BYTES_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    bucket: int
    stored_blocks: int
    stored_bytes: int
    read_back_blocks: int
    read_back_bytes: int
    def __init__(self, namespace: _Optional[bytes] = ..., bucket: _Optional[int] = ..., stored_blocks: _Optional[int] = ..., stored_bytes: _Optional[int] = ..., read_back_blocks: _Optional[int] = ..., read_back_bytes: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("node_id", "tiers", "counters", "reservations", "leases", "pins", "read_back")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    PINS_FIELD_NUMBER: _ClassVar[int]
    READ_BACK_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    counters: _containers.ScalarMap[str, int]
    reservations: int
    leases: int
    pins: int
    read_back: _containers.RepeatedCompositeFieldContainer[ReadBackCounts]
    def __init__(self, node_id: _Optional[str] = ..., tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., counters: _Optional[_Mapping[str, int]] = ..., reservations: _Optional[int] = ..., leases: _Optional[int] = ..., pins: _Optional[int] = ..., read_back: _Optional[_Iterable[_Union[ReadBackCounts, _Mapping]]] = ...) -> None: ...

class ReportHitsRequest(_message.Message):
    __slots__ = ("op", "tier", "blocks", "tokens", "namespace", "remote", "miss_reason", "short_copies", "namespace_name", "skipped_saves")
    OP_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    REMOTE_FIELD_NUMBER: _ClassVar[int]
    MISS_REASON_FIELD_NUMBER: _ClassVar[int]
    SHORT_COPIES_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_NAME_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_SAVES_FIELD_NUMBER: _ClassVar[int]
    op: str
    tier: Tier
    blocks: int
    tokens: int
    namespace: bytes
    remote: bool
    miss_reason: str
    short_copies: int
    namespace_name: str
    skipped_saves: int
    def __init__(self, op: _Optional[str] = ..., tier: _Optional[_Union[Tier, str]] = ..., blocks: _Optional[int] = ..., tokens: _Optional[int] = ..., namespace: _Optional[bytes] = ..., remote: _Optional[bool] = ..., miss_reason: _Optional[str] = ..., short_copies: _Optional[int] = ..., namespace_name: _Optional[str] = ..., skipped_saves: _Optional[int] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ("closed", "blocks")
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    closed: bool
    blocks: int
    def __init__(self, closed: _Optional[bool] = ..., blocks: _Optional[int] = ...) -> None: ...

class WatchHoldingsRequest(_message.Message):
    __slots__ = ("incarnation", "revision", "heartbeat_ms")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_MS_FIELD_NUMBER: _ClassVar[int]
    incarnation: bytes
    revision: int
    heartbeat_ms: int
    def __init__(self, incarnation: _Optional[bytes] = ..., revision: _Optional[int] = ..., heartbeat_ms: _Optional[int] = ...) -> None: ...

class HoldingsUpdate(_message.Message):
    __slots__ = ("incarnation", "kind", "revision", "resync", "last", "keys", "changes", "namespaces", "first_revision", "changed_unix_ns")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    RESYNC_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    FIRST_REVISION_FIELD_NUMBER: _ClassVar[int]
    CHANGED_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    incarnation: bytes
    kind: HoldingsKind
    revision: int
    resync: bool
    last: bool
    keys: bytes
    changes: bytes
    namespaces: bytes
    first_revision: int
    changed_unix_ns: int
    def __init__(self, incarnation: _Optional[bytes] = ..., kind: _Optional[_Union[HoldingsKind, str]] = ..., revision: _Optional[int] = ..., resync: _Optional[bool] = ..., last: _Optional[bool] = ..., keys: _Optional[bytes] = ..., changes: _Optional[bytes] = ..., namespaces: _Optional[bytes] = ..., first_revision: _Optional[int] = ..., changed_unix_ns: _Optional[int] = ...) -> None: ...

"""Conversions between kvstore's Python types and the v1 protobuf messages.

Shared by the node and the SDK so both sides agree on one mapping; also the one
place that maps typed errors to gRPC status codes and back.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import grpc

from kvstore import errors
from kvstore.block import BlockMeta
from kvstore.keys import ChunkKey
from kvstore.vocabulary import Extent, TierKind
from protos.kvstore.v1 import kvstore_pb2 as pb

ERROR_METADATA_KEY = "kvstore-error"
# request metadata of PutStream: at most this many blocks follow (the node refuses a count over max_batch up front)
BLOCKS_METADATA_KEY = "kvstore-blocks"

_CODES: list[tuple[type[errors.KVStoreError], grpc.StatusCode]] = [
    (errors.Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (errors.PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (errors.DataDirLocked, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.Incompatible, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.CapacityExceeded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.NotFound, grpc.StatusCode.NOT_FOUND),
    (errors.DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
    (errors.Unavailable, grpc.StatusCode.UNAVAILABLE),
    (errors.BlockFormatError, grpc.StatusCode.DATA_LOSS),
]
_BY_NAME: dict[str, type[errors.KVStoreError]] = {
    cls.__name__: cls for cls in vars(errors).values() if isinstance(cls, type) and issubclass(cls, errors.KVStoreError)
}
_BY_CODE: dict[grpc.StatusCode, type[errors.KVStoreError]] = {
    grpc.StatusCode.UNAUTHENTICATED: errors.Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: errors.PermissionDenied,
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgument,
    grpc.StatusCode.OUT_OF_RANGE: errors.InvalidArgument,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.CapacityExceeded,
    grpc.StatusCode.NOT_FOUND: errors.NotFound,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.DeadlineExceeded,
    grpc.StatusCode.UNAVAILABLE: errors.Unavailable,
    grpc.StatusCode.CANCELLED: errors.Unavailable,
    grpc.StatusCode.FAILED_PRECONDITION: errors.Incompatible,
    grpc.StatusCode.DATA_LOSS: errors.CorruptBlock,
}


def status_for(exc: errors.KVStoreError) -> grpc.StatusCode:
    for cls, code in _CODES:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


def error_from_rpc(e: grpc.RpcError) -> errors.KVStoreError:
    """The typed SDK exception for a failed call (the single gRPC → kvstore mapping)."""
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    details = (e.details() if hasattr(e, "details") else None) or str(code)
    name = None
    try:
        for md in e.trailing_metadata() or ():
            # (key, value): a namedtuple from a sync call, a plain tuple from grpc.aio
            if md[0] == ERROR_METADATA_KEY:  # type: ignore[index]
                name = md[1]  # type: ignore[index]
    except Exception:
        pass
    cls = _BY_NAME.get(name or "") or _BY_CODE.get(code, errors.KVStoreError)
    return cls(f"{details} [{code.name}]")


def meta_to_pb(m: BlockMeta) -> pb.BlockInfo:
    return pb.BlockInfo(
        key=m.key,
        parent=m.parent,
        namespace=m.namespace,
        token_count=m.token_count,
        dtype=m.dtype,
        shape=list(m.shape),
        payload_len=m.payload_len,
        payload_checksum=m.payload_checksum,
    )


def meta_from_pb(b: pb.BlockInfo) -> BlockMeta:
    """Raises ``InvalidArgument`` on malformed keys, sizes or dtypes."""
    return BlockMeta(
        namespace=bytes(b.namespace) or bytes(8),
        key=ChunkKey(bytes(b.key)),
        parent=ChunkKey(bytes(b.parent) or bytes(16)),
        token_count=b.token_count,
        dtype=b.dtype or "uint8",
        shape=tuple(b.shape) if b.shape else (b.payload_len,) if (b.dtype or "uint8") == "uint8" else (),
        payload_len=b.payload_len,
        payload_checksum=b.payload_checksum,
    )


def extents_to_pb(extents: Iterable[Extent]) -> list[pb.Extent]:
    return [pb.Extent(offset=e.offset, length=e.length) for e in extents]


def extents_from_pb(extents: Sequence[pb.Extent]) -> list[Extent]:
    return [Extent(e.offset, e.length) for e in extents]


def tier_to_pb(t: TierKind | None) -> int:
    return int(t) if t is not None else pb.TIER_UNSPECIFIED


def tier_from_pb(v: int) -> TierKind | None:
    """Raises ``Incompatible`` for a tier number this build does not know (a newer peer's)."""
    if not v:
        return None
    try:
        return TierKind(v)
    except ValueError:
        raise errors.Incompatible(
            f"unknown tier {v} in a reply: the peer speaks a newer protocol; upgrade this client"
        ) from None


TIER_NAMES = {pb.TIER_HBM: "hbm", pb.TIER_DRAM: "dram", pb.TIER_NVME: "nvme"}

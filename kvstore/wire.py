"""Conversions between kvstore's Python types and the v1 protobuf messages.

Shared by the node and the SDK so both sides agree on one mapping; also the one
place that maps typed errors to gRPC status codes and back.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence

import grpc
import numpy as np

from kvstore import errors
from kvstore.block import DTYPES, MAX_NDIM, BlockMeta
from kvstore.keys import KEY_BYTES, NO_PARENT, ChunkKey
from kvstore.vocabulary import Extent, TierKind
from protos.kvstore.v1 import kvstore_pb2 as pb

ERROR_METADATA_KEY = "kvstore-error"
# HelloResponse.packed_version of this build: Reserve and Acquire take and answer packed
# batches (one bytes field per column: protos/kvstore/v1/kvstore.proto, PackedBlocks)
PACKED_VERSION = 1
# request metadata of PutStream: at most this many blocks follow (the node refuses a count over max_batch up front)
BLOCKS_METADATA_KEY = "kvstore-blocks"
# request metadata of every call: which integration makes it (ClientOptions.agent), for the
# node's per-agent metrics; absent = a plain SDK client
AGENT_METADATA_KEY = "kvstore-agent"
AGENT_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")
AGENT_MAX = 48


def check_agent(agent: object) -> str:
    """``agent`` if it is a valid agent name (1-48 of ``[A-Za-z0-9._-]``, or "" for none), else
    :class:`~kvstore.errors.InvalidArgument`."""
    if not isinstance(agent, str) or len(agent) > AGENT_MAX or not set(agent) <= AGENT_CHARS:
        raise errors.InvalidArgument(
            f"agent must be at most {AGENT_MAX} of letters, digits, '.', '_' and '-' (e.g. 'sglang-hicache'); got {agent!r:.60}"
        )
    return agent


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
    except Exception:  # no readable trailing metadata: the status code alone names the error
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


# -- packed batches (HelloResponse.packed_version >= 1) ------------------------------------
# One bytes field per column instead of one message per block: building and parsing a
# BlockInfo, Lease or Reservation message per block cost more than copying a 64 KiB block.
_DTYPE_OF_CODE = {code: (name, size) for name, (code, size) in DTYPES.items()}
_new, _set = object.__new__, object.__setattr__


def u64s(values: Sequence[int]) -> bytes:
    """Little-endian u64 column."""
    return struct.pack(f"<{len(values)}Q", *values)


def u32s(values: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(values)}I", *values)


def from_u64s(data: bytes) -> list[int]:
    if len(data) % 8:
        raise errors.InvalidArgument(f"a packed u64 column of {len(data)} bytes (not a multiple of 8)")
    return np.frombuffer(data, "<u8").tolist()


def from_u32s(data: bytes) -> list[int]:
    if len(data) % 4:
        raise errors.InvalidArgument(f"a packed u32 column of {len(data)} bytes (not a multiple of 4)")
    return np.frombuffer(data, "<u4").tolist()


def keys_from_packed(data: bytes) -> list[ChunkKey]:
    """``KeysRequest.packed_keys`` as keys; ``InvalidArgument`` unless 16 bytes each."""
    if len(data) % KEY_BYTES:
        raise errors.InvalidArgument(f"packed keys of {len(data)} bytes: a chunk key is {KEY_BYTES} bytes")
    return [ChunkKey(data[i : i + KEY_BYTES]) for i in range(0, len(data), KEY_BYTES)]


def trusted_meta(
    namespace: bytes,
    key: bytes,
    parent: bytes,
    token_count: int,
    dtype: str,
    shape: tuple[int, ...],
    payload_len: int,
    payload_checksum: int,
) -> BlockMeta:
    """A :class:`BlockMeta` whose fields the caller has already checked against every rule
    of ``BlockMeta.__post_init__`` (fixed-width columns, checked in :func:`metas_from_packed`;
    or an existing meta with a u64 checksum): about a third of the cost of checking again."""
    m = _new(BlockMeta)
    _set(m, "namespace", namespace)
    _set(m, "key", key)
    _set(m, "parent", parent)
    _set(m, "token_count", token_count)
    _set(m, "dtype", dtype)
    _set(m, "shape", shape)
    _set(m, "payload_len", payload_len)
    _set(m, "payload_checksum", payload_checksum)
    return m


def with_checksum(m: BlockMeta, payload_checksum: int) -> BlockMeta:
    """``m`` with another checksum (a u64: a protobuf ``uint64`` field's value)."""
    if not 0 <= payload_checksum < 2**64:
        raise errors.InvalidArgument(f"payload_checksum {payload_checksum} is not an unsigned 64-bit value")
    return trusted_meta(m.namespace, m.key, m.parent, m.token_count, m.dtype, m.shape, m.payload_len, payload_checksum)


def metas_to_packed(metas: Sequence[BlockMeta]) -> pb.PackedBlocks | None:
    """The blocks of one batch as columns; None if they do not share one namespace (send
    them as ``BlockInfo`` messages then)."""
    if not metas:
        return pb.PackedBlocks()
    ns = metas[0].namespace
    if any(m.namespace != ns for m in metas):
        return None
    shape: list[int] = []
    for m in metas:
        shape.extend(m.shape)
    return pb.PackedBlocks(
        keys=b"".join([m.key for m in metas]),
        parents=b"".join([m.parent for m in metas]),
        namespace=ns,
        token_counts=u32s([m.token_count for m in metas]),
        dtypes=bytes([DTYPES[m.dtype][0] for m in metas]),
        ndims=bytes([len(m.shape) for m in metas]),
        shape=u64s(shape),
        payload_lens=u64s([m.payload_len for m in metas]),
        payload_checksums=u64s([m.payload_checksum for m in metas]) if any(m.payload_checksum for m in metas) else b"",
    )


def metas_from_packed(p: pb.PackedBlocks) -> list[BlockMeta]:
    """The blocks of a packed batch; ``InvalidArgument`` for columns that disagree in length,
    or a block ``BlockMeta`` would refuse (unknown dtype, too many dims, a shape that
    contradicts the payload length)."""
    keys = p.keys
    n = len(keys) // KEY_BYTES
    ns = p.namespace or bytes(8)
    if (
        len(keys) % KEY_BYTES
        or len(p.parents) != len(keys)
        or len(ns) != 8
        or len(p.token_counts) != 4 * n
        or len(p.dtypes) != n
        or len(p.ndims) != n
        or len(p.payload_lens) != 8 * n
        or len(p.payload_checksums) not in (0, 8 * n)
    ):
        raise errors.InvalidArgument("malformed packed blocks: their columns disagree in length")
    ndims = p.ndims
    shape = from_u64s(p.shape)
    if len(shape) != sum(ndims):
        raise errors.InvalidArgument("malformed packed blocks: the shape column does not match the ndims")
    tokens = from_u32s(p.token_counts)
    lens = from_u64s(p.payload_lens)
    sums = from_u64s(p.payload_checksums) if p.payload_checksums else [0] * n
    parents, dtypes = p.parents, p.dtypes
    out: list[BlockMeta] = []
    pos = 0
    for i in range(n):
        kind = _DTYPE_OF_CODE.get(dtypes[i])
        nd = ndims[i]
        if kind is None or nd > MAX_NDIM:
            raise errors.InvalidArgument(f"block {i}: unknown dtype code {dtypes[i]} or more than {MAX_NDIM} dims")
        name, itemsize = kind
        length = lens[i]
        if nd:
            dims = tuple(shape[pos : pos + nd])
            pos += nd
            expect = itemsize
            for d in dims:
                expect *= d
            if expect != length:
                raise errors.InvalidArgument(
                    f"block {i}: payload of {length} bytes contradicts shape {dims} of {name} ({expect} bytes)"
                )
        else:
            dims = (length,) if name == "uint8" else ()
        at = i * KEY_BYTES
        parent = parents[at : at + KEY_BYTES]
        out.append(
            trusted_meta(
                ns,
                ChunkKey(keys[at : at + KEY_BYTES]),
                ChunkKey(parent) if parent != NO_PARENT else NO_PARENT,
                tokens[i],
                name,
                dims,
                length,
                sums[i],
            )
        )
    return out

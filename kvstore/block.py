"""The self-describing block format: a fixed-size header, then the payload.

Layout (little-endian, ``HEADER_SIZE`` bytes, then ``payload_len`` bytes)::

    0   4s  magic            b"KVB1"
    4   H   format version   1
    6   H   flags            0 (reserved)
    8   8s  namespace fingerprint
    16  16s key
    32  16s parent key       (16 zero bytes for a prefix's first chunk)
    48  I   token count
    52  B   dtype code       (see DTYPES)
    53  B   ndim             (<= MAX_NDIM)
    54  2x  padding
    56  Q   payload length
    64  Q   payload checksum xxh3-64
    72  8Q  shape            (unused dims are 0)
    136 16x reserved
    152 Q   header checksum  xxh3-64 of bytes [0, 152)

Every decoder failure raises a typed :class:`~kvstore.errors.BlockFormatError`:
truncated, corrupt, wrong version, wrong namespace or key.  The payload checksum
travels with the block end to end (client → node → NVMe → node → client).
"""

from __future__ import annotations

import dataclasses
import math
import struct

import xxhash

from kvstore.errors import (
    CorruptBlock,
    InvalidArgument,
    NamespaceMismatch,
    TruncatedBlock,
    UnsupportedVersion,
)
from kvstore.keys import KEY_BYTES, NO_PARENT, ChunkKey, check_key

MAGIC = b"KVB1"
FORMAT_VERSION = 1
MAX_NDIM = 8
_BODY = struct.Struct("<4sHH8s16s16sIBB2xQQ8Q16x")
_CHECK = struct.Struct("<Q")
HEADER_SIZE = _BODY.size + _CHECK.size  # 160
assert HEADER_SIZE == 160

# dtype name -> (code, itemsize).  Codes are part of the on-disk format: never renumber.
DTYPES: dict[str, tuple[int, int]] = {
    "uint8": (1, 1),
    "int8": (2, 1),
    "float16": (3, 2),
    "bfloat16": (4, 2),
    "float32": (5, 4),
    "float8_e4m3fn": (6, 1),
    "float8_e5m2": (7, 1),
    "int32": (8, 4),
    "int64": (9, 8),
    "float64": (10, 8),
    "int16": (11, 2),
    "uint16": (12, 2),
    "uint32": (13, 4),
}
_DTYPE_BY_CODE = {code: name for name, (code, _) in DTYPES.items()}


def checksum(data: object) -> int:
    """xxh3-64 of a bytes-like object (no copy for contiguous buffers)."""
    return xxhash.xxh3_64_intdigest(data)  # type: ignore[arg-type]


@dataclasses.dataclass(frozen=True, slots=True)
class BlockMeta:
    """What the header says about a block.  Immutable; the index stores these."""

    namespace: bytes  # 8-byte fingerprint
    key: ChunkKey
    parent: ChunkKey
    token_count: int
    dtype: str
    shape: tuple[int, ...]
    payload_len: int
    payload_checksum: int

    def __post_init__(self) -> None:
        check_key(self.key)
        check_key(self.parent)
        if len(self.namespace) != 8:
            raise InvalidArgument("namespace fingerprint must be 8 bytes")
        if self.dtype not in DTYPES:
            raise InvalidArgument(f"unknown dtype {self.dtype!r}; known: {sorted(DTYPES)}")
        if len(self.shape) > MAX_NDIM or any(d < 0 for d in self.shape):
            raise InvalidArgument(f"shape {self.shape} must have at most {MAX_NDIM} non-negative dims")
        if self.payload_len < 0 or self.token_count < 0:
            raise InvalidArgument("payload_len and token_count must be non-negative")
        # the header stores these as u32 / u64: reject here what encode_header could not pack
        if self.token_count >= 2**32 or self.payload_len >= 2**64 or any(d >= 2**64 for d in self.shape):
            raise InvalidArgument("token_count must fit in 32 bits, payload_len and dims in 64 bits")
        if not 0 <= self.payload_checksum < 2**64:
            raise InvalidArgument(f"payload_checksum {self.payload_checksum} is not an unsigned 64-bit value")
        expect = math.prod(self.shape) * DTYPES[self.dtype][1] if self.shape else self.payload_len
        if expect != self.payload_len:
            raise InvalidArgument(
                f"payload of {self.payload_len} bytes contradicts shape {self.shape} of {self.dtype} ({expect} bytes)"
            )

    @classmethod
    def for_payload(
        cls,
        key: bytes,
        payload: object,
        *,
        namespace: bytes = bytes(8),
        parent: bytes = NO_PARENT,
        token_count: int = 0,
        dtype: str = "uint8",
        shape: tuple[int, ...] | None = None,
        payload_checksum: int | None = None,
    ) -> BlockMeta:
        """Describe ``payload`` (any contiguous buffer), computing its checksum unless given."""
        mv = memoryview(payload).cast("B")  # type: ignore[arg-type]
        n = mv.nbytes
        return cls(
            namespace=namespace,
            key=check_key(key),
            parent=check_key(parent),
            token_count=token_count,
            dtype=dtype,
            shape=tuple(shape) if shape is not None else (n // DTYPES[dtype][1],),
            payload_len=n,
            payload_checksum=checksum(mv) if payload_checksum is None else payload_checksum,
        )


def encode_header(meta: BlockMeta) -> bytes:
    shape = list(meta.shape) + [0] * (MAX_NDIM - len(meta.shape))
    body = _BODY.pack(
        MAGIC,
        FORMAT_VERSION,
        0,
        meta.namespace,
        meta.key,
        meta.parent,
        meta.token_count,
        DTYPES[meta.dtype][0],
        len(meta.shape),
        meta.payload_len,
        meta.payload_checksum,
        *shape,
    )
    return body + _CHECK.pack(checksum(body))


def decode_header(
    buf: object,
    *,
    expect_namespace: bytes | None = None,
    expect_key: bytes | None = None,
) -> BlockMeta:
    """Parse and verify a header.  Raises a :class:`BlockFormatError` subclass on any doubt."""
    mv = memoryview(buf).cast("B")  # type: ignore[arg-type]
    if mv.nbytes < HEADER_SIZE:
        raise TruncatedBlock(f"block header needs {HEADER_SIZE} bytes, got {mv.nbytes}")
    body = mv[: _BODY.size]
    if bytes(body[:4]) != MAGIC:
        raise CorruptBlock(f"bad magic {bytes(body[:4])!r}")
    (stored,) = _CHECK.unpack_from(mv, _BODY.size)
    if checksum(body) != stored:
        raise CorruptBlock("header checksum mismatch")
    fields = _BODY.unpack(body)
    (_, version, _flags, ns, key, parent, tokens, dcode, ndim, plen, pcs, *shape) = fields
    if version != FORMAT_VERSION:
        raise UnsupportedVersion(f"block format version {version}; this build reads {FORMAT_VERSION}")
    if dcode not in _DTYPE_BY_CODE or ndim > MAX_NDIM:
        raise CorruptBlock(f"bad dtype code {dcode} or ndim {ndim}")
    if expect_namespace is not None and ns != expect_namespace:
        raise NamespaceMismatch(f"block belongs to namespace {ns.hex()}, expected {expect_namespace.hex()}")
    if expect_key is not None and key != expect_key:
        raise NamespaceMismatch(f"block is for key {key.hex()}, expected {bytes(expect_key).hex()}")
    try:
        return BlockMeta(
            ns, ChunkKey(key), ChunkKey(parent), tokens, _DTYPE_BY_CODE[dcode], tuple(shape[:ndim]), plen, pcs
        )
    except InvalidArgument as e:  # a header that passed its checksum but is self-contradictory
        raise CorruptBlock(str(e)) from e


def verify_payload(meta: BlockMeta, payload: object) -> None:
    """Raise :class:`TruncatedBlock` or :class:`CorruptBlock` unless ``payload`` matches ``meta``."""
    mv = memoryview(payload).cast("B")  # type: ignore[arg-type]
    if mv.nbytes < meta.payload_len:
        raise TruncatedBlock(f"payload has {mv.nbytes} bytes, header says {meta.payload_len}")
    if checksum(mv[: meta.payload_len]) != meta.payload_checksum:
        raise CorruptBlock(f"payload checksum mismatch for key {bytes(meta.key).hex()}")


def encode_block(meta: BlockMeta, payload: object) -> bytes:
    """Header + payload as one bytes object (tests and the streaming fallback; the fast paths avoid it)."""
    return encode_header(meta) + bytes(memoryview(payload).cast("B"))  # type: ignore[arg-type]


def decode_block(
    buf: object, *, expect_namespace: bytes | None = None, expect_key: bytes | None = None
) -> tuple[BlockMeta, memoryview]:
    """Verify a whole block; return its meta and a view of the payload (no copy)."""
    mv = memoryview(buf).cast("B")  # type: ignore[arg-type]
    meta = decode_header(mv, expect_namespace=expect_namespace, expect_key=expect_key)
    payload = mv[HEADER_SIZE:]
    if payload.nbytes != meta.payload_len:
        if payload.nbytes < meta.payload_len:
            raise TruncatedBlock(f"payload has {payload.nbytes} bytes, header says {meta.payload_len}")
        raise CorruptBlock(f"{payload.nbytes - meta.payload_len} bytes follow the payload")
    verify_payload(meta, payload)
    return meta, payload


__all__ = [
    "BlockMeta",
    "DTYPES",
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "KEY_BYTES",
    "checksum",
    "decode_block",
    "decode_header",
    "encode_block",
    "encode_header",
    "verify_payload",
]

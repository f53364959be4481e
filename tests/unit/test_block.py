"""The self-describing block format: round trips, pinned header bytes, and every way to fail."""

from __future__ import annotations

import dataclasses
import struct
import zlib

import numpy as np
import pytest

from kvstore.block import (
    DTYPES,
    FORMAT_VERSION,
    HEADER_SIZE,
    MAGIC,
    MAX_NDIM,
    BlockMeta,
    checksum,
    decode_block,
    decode_header,
    encode_block,
    encode_header,
    verify_payload,
)
from kvstore.errors import (
    BlockFormatError,
    CorruptBlock,
    Incompatible,
    InvalidArgument,
    NamespaceMismatch,
    TruncatedBlock,
    UnsupportedVersion,
)
from kvstore.keys import NO_PARENT, ChunkKey

NS = bytes(range(8))
KEY = ChunkKey(bytes(range(16, 32)))
PARENT = ChunkKey(bytes(range(32, 48)))
GOLDEN_PAYLOAD = bytes(range(256))
GOLDEN_META = BlockMeta(
    namespace=NS,
    key=KEY,
    parent=PARENT,
    token_count=256,
    dtype="bfloat16",
    shape=(2, 2, 4, 8),
    payload_len=256,
    payload_checksum=checksum(GOLDEN_PAYLOAD),
)
GOLDEN_PAYLOAD_CHECKSUM = 0x9408A4433B952D71
GOLDEN_HEADER_HEX = (
    "4b564231010000000001020304050607101112131415161718191a1b1c1d1e1f"
    "202122232425262728292a2b2c2d2e2f00010000040400000001000000000000"
    "712d953b43a40894020000000000000002000000000000000400000000000000"
    "0800000000000000000000000000000000000000000000000000000000000000"
    "000000000000000000000000000000000000000000000000bcb6d7352255990a"
)

_BODY_SIZE = HEADER_SIZE - 8  # the header checksum covers bytes [0, 152)


def _reseal(header: bytes | bytearray) -> bytes:
    """Recompute the header checksum, to get an edited header past it."""
    body = bytes(header[:_BODY_SIZE])
    return body + struct.pack("<Q", checksum(body))


def _golden_block() -> bytes:
    return encode_block(GOLDEN_META, GOLDEN_PAYLOAD)


# -- format constants and golden bytes ------------------------------------------------


def test_header_layout_constants() -> None:
    assert HEADER_SIZE == 160
    assert MAGIC == b"KVB1"
    assert FORMAT_VERSION == 1
    # dtype codes are on-disk format: never renumber
    assert {n: c for n, (c, _) in DTYPES.items()} == {
        "uint8": 1, "int8": 2, "float16": 3, "bfloat16": 4, "float32": 5, "float8_e4m3fn": 6,
        "float8_e5m2": 7, "int32": 8, "int64": 9, "float64": 10, "int16": 11, "uint16": 12, "uint32": 13,
    }  # fmt: skip


def test_golden_header_bytes() -> None:
    assert checksum(GOLDEN_PAYLOAD) == GOLDEN_PAYLOAD_CHECKSUM
    header = encode_header(GOLDEN_META)
    assert len(header) == HEADER_SIZE
    assert header.hex() == GOLDEN_HEADER_HEX


def test_golden_header_decodes_to_the_meta() -> None:
    meta = decode_header(bytes.fromhex(GOLDEN_HEADER_HEX), expect_namespace=NS, expect_key=KEY)
    assert meta == GOLDEN_META
    assert meta.shape == (2, 2, 4, 8) and meta.dtype == "bfloat16" and meta.token_count == 256


def test_header_fields_sit_at_the_documented_offsets() -> None:
    h = encode_header(GOLDEN_META)
    assert h[0:4] == MAGIC
    assert struct.unpack_from("<HH", h, 4) == (FORMAT_VERSION, 0)
    assert h[8:16] == NS and h[16:32] == KEY and h[32:48] == PARENT
    assert struct.unpack_from("<IBB", h, 48) == (256, DTYPES["bfloat16"][0], 4)
    assert struct.unpack_from("<QQ", h, 56) == (256, GOLDEN_PAYLOAD_CHECKSUM)
    assert struct.unpack_from("<8Q", h, 72) == (2, 2, 4, 8, 0, 0, 0, 0)
    assert h[136:152] == bytes(16)
    assert struct.unpack_from("<Q", h, 152) == (checksum(h[:152]),)


# -- round trips ---------------------------------------------------------------------

ROUND_TRIPS = [
    ("uint8", np.uint8, (1,)),
    ("uint8", np.uint8, (0,)),
    ("int8", np.int8, (3, 5)),
    ("float16", np.float16, (32, 2, 8, 16)),
    ("bfloat16", np.uint16, (4, 2, 2, 16)),  # no numpy bfloat16: same bytes through a 2-byte view
    ("float32", np.float32, (7,)),
    ("float8_e4m3fn", np.uint8, (2, 3, 4)),
    ("float8_e5m2", np.uint8, (9,)),
    ("int32", np.int32, (1, 1, 1, 1, 1, 1, 1, 3)),  # MAX_NDIM dims
    ("int64", np.int64, (0,)),
    ("float64", np.float64, (5, 5)),
    ("int16", np.int16, (6,)),
    ("uint16", np.uint16, (2, 64)),
    ("uint32", np.uint32, (3, 3, 3)),
]


@pytest.mark.parametrize(("dtype", "np_dtype", "shape"), ROUND_TRIPS, ids=[f"{d}-{s}" for d, _, s in ROUND_TRIPS])
def test_round_trip(dtype: str, np_dtype: type, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(zlib.crc32(f"{dtype}{shape}".encode()))
    arr = rng.integers(0, 256, size=int(np.prod(shape)) * np.dtype(np_dtype).itemsize, dtype=np.uint8)
    arr = arr.view(np_dtype).reshape(shape)
    meta = BlockMeta.for_payload(KEY, arr, namespace=NS, parent=PARENT, token_count=17, dtype=dtype, shape=shape)
    assert meta.payload_len == arr.nbytes
    assert meta.payload_checksum == checksum(arr.tobytes())

    blob = encode_block(meta, arr)
    assert len(blob) == HEADER_SIZE + arr.nbytes
    got, payload = decode_block(blob, expect_namespace=NS, expect_key=KEY)
    assert got == meta
    assert isinstance(payload, memoryview)
    back = np.frombuffer(payload, dtype=np_dtype).reshape(got.shape)
    np.testing.assert_array_equal(back, arr)


def test_decode_block_returns_a_view_not_a_copy() -> None:
    buf = bytearray(_golden_block())
    _, payload = decode_block(buf)
    buf[HEADER_SIZE] ^= 0xFF
    assert payload[0] == GOLDEN_PAYLOAD[0] ^ 0xFF


def test_decode_from_other_buffer_types() -> None:
    blob = _golden_block()
    for buf in (bytearray(blob), memoryview(blob), np.frombuffer(blob, dtype=np.uint8)):
        meta, payload = decode_block(buf)
        assert meta == GOLDEN_META and bytes(payload) == GOLDEN_PAYLOAD


def test_for_payload_defaults() -> None:
    meta = BlockMeta.for_payload(KEY, b"abcd")
    assert meta.namespace == bytes(8) and meta.parent == NO_PARENT
    assert meta.dtype == "uint8" and meta.shape == (4,) and meta.payload_len == 4
    assert meta.payload_checksum == checksum(b"abcd")
    assert BlockMeta.for_payload(KEY, b"abcd", dtype="float16").shape == (2,)
    assert BlockMeta.for_payload(KEY, b"abcd", payload_checksum=5).payload_checksum == 5
    assert BlockMeta.for_payload(bytearray(KEY), b"").payload_len == 0


def test_empty_payload_with_a_multi_dim_shape() -> None:
    meta = BlockMeta.for_payload(KEY, b"", dtype="int64", shape=(2, 0, 3))
    got, payload = decode_block(encode_block(meta, b""))
    assert got.shape == (2, 0, 3) and payload.nbytes == 0


def test_meta_with_no_shape_is_unconstrained() -> None:
    meta = dataclasses.replace(GOLDEN_META, shape=())
    assert decode_header(encode_header(meta)) == meta


# -- header failures -----------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 4, HEADER_SIZE // 2, HEADER_SIZE - 1])
def test_truncated_header(n: int) -> None:
    with pytest.raises(TruncatedBlock):
        decode_header(_golden_block()[:n])
    with pytest.raises(TruncatedBlock):
        decode_block(_golden_block()[:n])


def test_every_flipped_header_bit_is_detected() -> None:
    header = encode_header(GOLDEN_META)
    for i in range(HEADER_SIZE):
        for bit in range(8):
            bad = bytearray(header)
            bad[i] ^= 1 << bit
            with pytest.raises(CorruptBlock):
                decode_header(bytes(bad), expect_namespace=NS, expect_key=KEY)
            with pytest.raises(CorruptBlock):
                decode_block(bytes(bad) + GOLDEN_PAYLOAD)


def test_bad_magic_even_with_a_valid_checksum() -> None:
    bad = bytearray(encode_header(GOLDEN_META))
    bad[0:4] = b"KVB2"
    with pytest.raises(CorruptBlock, match="magic"):
        decode_header(_reseal(bad))


@pytest.mark.parametrize("version", [0, 2, 0xFFFF])
def test_unsupported_version(version: int) -> None:
    bad = bytearray(encode_header(GOLDEN_META))
    struct.pack_into("<H", bad, 4, version)
    with pytest.raises(UnsupportedVersion) as ei:
        decode_header(_reseal(bad))
    assert isinstance(ei.value, Incompatible) and isinstance(ei.value, BlockFormatError)
    with pytest.raises(UnsupportedVersion):
        decode_block(_reseal(bad) + GOLDEN_PAYLOAD)


@pytest.mark.parametrize(
    ("offset", "fmt", "value"),
    [
        (52, "<B", 0),  # dtype code 0 is unassigned
        (52, "<B", 200),  # unknown dtype code
        (53, "<B", MAX_NDIM + 1),  # too many dims
        (53, "<B", 3),  # ndim 3 of (2, 2, 4, 8): the shape no longer matches the payload length
        (56, "<Q", 255),  # payload length contradicts the shape
        (72, "<Q", 3),  # a dim changed
    ],
    ids=["dtype-0", "dtype-200", "ndim-9", "ndim-3", "payload-len", "dim"],
)
def test_self_contradictory_header_with_valid_checksum_is_corrupt(offset: int, fmt: str, value: int) -> None:
    bad = bytearray(encode_header(GOLDEN_META))
    struct.pack_into(fmt, bad, offset, value)
    with pytest.raises(CorruptBlock):
        decode_header(_reseal(bad))


def test_namespace_and_key_mismatch() -> None:
    blob = _golden_block()
    other_ns = bytes(8)
    other_key = bytes(16)
    with pytest.raises(NamespaceMismatch) as ei:
        decode_header(blob, expect_namespace=other_ns)
    assert isinstance(ei.value, Incompatible)
    with pytest.raises(NamespaceMismatch):
        decode_header(blob, expect_key=other_key)
    with pytest.raises(NamespaceMismatch):
        decode_block(blob, expect_namespace=NS, expect_key=PARENT)
    # bytes-like expectations compare by value
    assert decode_header(blob, expect_namespace=bytearray(NS), expect_key=memoryview(KEY)) == GOLDEN_META


# -- payload failures ----------------------------------------------------------------


def test_payload_flip_is_corrupt() -> None:
    blob = _golden_block()
    for i in (0, 1, 100, len(GOLDEN_PAYLOAD) - 1):
        bad = bytearray(blob)
        bad[HEADER_SIZE + i] ^= 0x01
        with pytest.raises(CorruptBlock, match="payload checksum"):
            decode_block(bytes(bad))
        with pytest.raises(CorruptBlock):
            verify_payload(GOLDEN_META, bytes(bad[HEADER_SIZE:]))


def test_short_payload_is_truncated() -> None:
    blob = _golden_block()
    for cut in (1, 100, len(GOLDEN_PAYLOAD)):
        with pytest.raises(TruncatedBlock):
            decode_block(blob[:-cut])
        with pytest.raises(TruncatedBlock):
            verify_payload(GOLDEN_META, GOLDEN_PAYLOAD[:-cut])


def test_trailing_bytes_are_corrupt() -> None:
    with pytest.raises(CorruptBlock, match="follow the payload"):
        decode_block(_golden_block() + b"\x00")


def test_verify_payload_ignores_bytes_past_the_payload() -> None:
    """A payload read back from a unit-rounded extent carries slack after it."""
    verify_payload(GOLDEN_META, GOLDEN_PAYLOAD + bytes(4096))
    verify_payload(GOLDEN_META, np.frombuffer(GOLDEN_PAYLOAD, dtype=np.uint16))


# -- BlockMeta validation ------------------------------------------------------------


@pytest.mark.parametrize(
    "changes",
    [
        {"shape": (2, 2, 4, 7)},  # 224 bytes of bfloat16, not 256
        {"payload_len": 255},
        {"dtype": "float32"},  # 512 bytes for that shape
        {"dtype": "complex64"},
        {"dtype": "bf16"},
        {"shape": (1,) * (MAX_NDIM + 1)},
        {"shape": (-2, -2, 4, 8)},
        {"payload_len": -1, "shape": ()},
        {"token_count": -1},
        {"key": bytes(15)},
        {"key": bytes(17)},
        {"parent": bytes(15)},
        {"key": "k" * 16},
        {"namespace": bytes(7)},
        {"namespace": bytes(9)},
        {"token_count": 2**32},
        {"payload_checksum": -1},
        {"payload_checksum": 2**64},
    ],
    ids=lambda c: ",".join(f"{k}={v!r}"[:24] for k, v in c.items()),
)
def test_meta_rejects(changes: dict) -> None:
    with pytest.raises(InvalidArgument):
        dataclasses.replace(GOLDEN_META, **changes)


def test_meta_rejects_values_the_header_cannot_hold() -> None:
    """Regression: these passed validation and then failed with struct.error in encode_header."""
    for changes in ({"token_count": 2**32}, {"payload_checksum": 2**64}, {"payload_checksum": -1}):
        with pytest.raises(InvalidArgument):
            dataclasses.replace(GOLDEN_META, **changes)
    edge = dataclasses.replace(GOLDEN_META, token_count=2**32 - 1, payload_checksum=2**64 - 1)
    assert decode_header(encode_header(edge)) == edge


def test_for_payload_rejects() -> None:
    with pytest.raises(InvalidArgument):
        BlockMeta.for_payload(KEY, b"abc", dtype="float16")  # 3 bytes are not whole float16s
    with pytest.raises(InvalidArgument):
        BlockMeta.for_payload(KEY, b"abcd", shape=(3,))
    with pytest.raises(InvalidArgument):
        BlockMeta.for_payload(bytes(8), b"abcd")
    with pytest.raises(InvalidArgument):
        BlockMeta.for_payload(KEY, b"abcd", parent=b"")

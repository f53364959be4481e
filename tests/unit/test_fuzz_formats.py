"""Property-based checks of the block header and the protobuf ↔ Python mapping (issue 13, "Also").

Random and mutated input to every decoder must end in a value or a typed error of
``kvstore.errors`` (the node maps those onto gRPC status codes; anything else escapes as
``UNKNOWN``).  What must hold:

* ``decode_header`` / ``decode_block``: any bytes, valid blocks with bytes flipped, cut or
  spliced, and headers whose fields were changed *and* whose checksum was recomputed (so
  the field checks themselves are reached) give a :class:`BlockMeta` or a
  :class:`BlockFormatError`; every valid block round-trips exactly;
* ``meta_from_pb`` on any ``BlockInfo`` gives a :class:`BlockMeta` that encodes, or
  ``InvalidArgument``; ``tier_from_pb`` on any number gives a tier or ``Incompatible``;
* ``error_from_rpc`` on any status, details and trailing metadata gives a ``KVStoreError``.
"""

from __future__ import annotations

import struct
from typing import Any

import grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from proto_strategies import messages, mutated

from kvstore import errors
from kvstore.block import (
    DTYPES,
    HEADER_SIZE,
    MAX_NDIM,
    BlockMeta,
    checksum,
    decode_block,
    decode_header,
    encode_block,
    encode_header,
)
from kvstore.wire import ERROR_METADATA_KEY, error_from_rpc, meta_from_pb, meta_to_pb, tier_from_pb
from protos.kvstore.v1 import kvstore_pb2 as pb

FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
_BODY = HEADER_SIZE - 8  # the header checksum covers bytes [0, 152)


@st.composite
def blocks(draw: st.DrawFn) -> tuple[BlockMeta, bytes]:
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    size = DTYPES[dtype][1]
    shape = tuple(draw(st.lists(st.integers(0, 6), min_size=1, max_size=MAX_NDIM)))
    n = size
    for d in shape:
        n *= d
    payload = draw(st.binary(min_size=n, max_size=n))
    meta = BlockMeta.for_payload(
        draw(st.binary(min_size=16, max_size=16)),
        payload,
        namespace=draw(st.binary(min_size=8, max_size=8)),
        parent=draw(st.binary(min_size=16, max_size=16)),
        token_count=draw(st.integers(0, 2**32 - 1)),
        dtype=dtype,
        shape=shape,
    )
    return meta, payload


def typed(fn: Any, *args: Any, **kw: Any) -> Any:
    """``fn(*args)``, where the only exception allowed is a ``BlockFormatError``."""
    try:
        return fn(*args, **kw)
    except errors.BlockFormatError:
        return None


@FAST
@given(blocks())
def test_every_valid_block_round_trips(block: tuple[BlockMeta, bytes]) -> None:
    meta, payload = block
    got, view = decode_block(encode_block(meta, payload), expect_namespace=meta.namespace, expect_key=meta.key)
    assert got == meta and bytes(view) == payload
    assert decode_header(encode_header(meta)) == meta


@FAST
@given(st.binary(max_size=2 * HEADER_SIZE))
def test_random_bytes_are_a_header_or_a_format_error(data: bytes) -> None:
    typed(decode_header, data)
    typed(decode_block, data)


@FAST
@given(st.data())
def test_mutated_blocks_are_refused_with_a_format_error(data: st.DataObject) -> None:
    meta, payload = data.draw(blocks())
    raw = data.draw(mutated(encode_block(meta, payload)))
    got = typed(decode_block, raw, expect_namespace=meta.namespace)
    if got is not None:  # a mutation that still verifies: it must describe what it carries
        m, view = got
        assert m.payload_len == view.nbytes and checksum(view) == m.payload_checksum


@FAST
@given(st.data())
def test_headers_with_resealed_fields_are_refused_with_a_format_error(data: st.DataObject) -> None:
    """Fields changed and the header checksum recomputed: the field checks must hold alone."""
    meta, _ = data.draw(blocks())
    body = bytearray(encode_header(meta)[:_BODY])
    for _ in range(data.draw(st.integers(1, 6))):
        at = data.draw(st.integers(4, _BODY - 1))  # past the magic
        body[at] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):  # a dimension or length at the edge of its width
        at = data.draw(st.sampled_from([56, 64] + [72 + 8 * i for i in range(MAX_NDIM)]))
        struct.pack_into("<Q", body, at, data.draw(st.sampled_from([2**64 - 1, 2**63, 2**32, 1 << 40])))
    raw = bytes(body) + struct.pack("<Q", checksum(bytes(body)))
    got = typed(decode_header, raw)
    if got is not None:
        assert decode_header(encode_header(got)) == got


@FAST
@given(messages(pb.BlockInfo))
def test_any_block_info_is_a_meta_or_invalid_argument(info: pb.BlockInfo) -> None:
    try:
        meta = meta_from_pb(info)
    except errors.InvalidArgument:
        return
    assert decode_header(encode_header(meta)) == meta
    assert meta_from_pb(meta_to_pb(meta)) == meta


@FAST
@given(st.integers(-(2**31), 2**31 - 1))
def test_any_tier_number_is_a_tier_or_incompatible(v: int) -> None:
    try:
        tier_from_pb(v)
    except errors.Incompatible:
        assert v not in (0, 1, 2, 3)


class _Failed(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str | None, trailing: Any) -> None:
        self._code, self._details, self._trailing = code, details, trailing

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str | None:
        return self._details

    def trailing_metadata(self) -> Any:
        return self._trailing


_NAMES = st.one_of(
    st.sampled_from([n for n in dir(errors) if isinstance(getattr(errors, n), type)] + ["object", "Exception"]),
    st.text(max_size=12),
)


@FAST
@given(
    st.sampled_from(list(grpc.StatusCode)),
    st.one_of(st.none(), st.text(max_size=40)),
    st.one_of(st.none(), st.lists(st.tuples(st.sampled_from([ERROR_METADATA_KEY, "other"]), _NAMES), max_size=3)),
)
def test_any_failed_call_maps_to_a_kvstore_error(code: grpc.StatusCode, details: str | None, trailing: Any) -> None:
    e = error_from_rpc(_Failed(code, details, trailing))
    assert isinstance(e, errors.KVStoreError)

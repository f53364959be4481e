"""Hypothesis strategies for kvstore's protobuf messages, built from their descriptors.

Any message type gets a strategy that fills every field with values a hostile client
could send: edge integers of the field's wire type, NaN and infinite floats, unknown enum
numbers, bytes of the wrong length, and nested messages to a bounded depth.  Plus raw
mutations of a message's serialized bytes (flips, cuts, splices), which reach the
decoder itself.
"""

from __future__ import annotations

from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

_F = FieldDescriptor
_INT_RANGES = {
    _F.TYPE_INT32: (-(2**31), 2**31 - 1),
    _F.TYPE_SINT32: (-(2**31), 2**31 - 1),
    _F.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    _F.TYPE_INT64: (-(2**63), 2**63 - 1),
    _F.TYPE_SINT64: (-(2**63), 2**63 - 1),
    _F.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    _F.TYPE_UINT32: (0, 2**32 - 1),
    _F.TYPE_FIXED32: (0, 2**32 - 1),
    _F.TYPE_UINT64: (0, 2**64 - 1),
    _F.TYPE_FIXED64: (0, 2**64 - 1),
}


def _ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    edges = sorted({v for v in (lo, hi, 0, 1, lo + 1, hi - 1, 2**31 - 1, 2**32 - 1, 2**63 - 1, -1) if lo <= v <= hi})
    return st.one_of(st.sampled_from(edges), st.integers(max(lo, -70000), min(hi, 70000)), st.integers(lo, hi))


def _scalar(f: FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    if f.type in _INT_RANGES:
        return _ints(*_INT_RANGES[f.type])
    if f.type == _F.TYPE_BOOL:
        return st.booleans()
    if f.type in (_F.TYPE_FLOAT, _F.TYPE_DOUBLE):
        return st.floats(width=32 if f.type == _F.TYPE_FLOAT else 64)
    if f.type == _F.TYPE_ENUM:
        return st.integers(-3, 12)  # proto3 enums are open: unknown numbers reach the node
    if f.type == _F.TYPE_STRING:
        return st.one_of(st.sampled_from(["", "uint8", "float16", "bfloat16", "int64"]), st.text(max_size=24))
    if f.type == _F.TYPE_BYTES:
        return st.one_of(st.binary(min_size=16, max_size=16), st.binary(min_size=8, max_size=8), st.binary(max_size=40))
    assert f.type == _F.TYPE_MESSAGE
    return messages(f.message_type, depth + 1)


def messages(desc: Descriptor | type[Message], depth: int = 0) -> st.SearchStrategy[Message]:
    """Messages of ``desc``'s type with every field drawn independently (absent, or any value)."""
    d: Descriptor = desc if isinstance(desc, Descriptor) else desc.DESCRIPTOR
    cls = _class_of(d)
    fields: dict[str, st.SearchStrategy[Any]] = {}
    for f in d.fields:
        if f.type == _F.TYPE_MESSAGE and depth >= 2:
            continue
        one = _scalar(f, depth)
        fields[f.name] = st.lists(one, max_size=6) if f.is_repeated else st.one_of(st.none(), one)

    def build(values: dict[str, Any]) -> Message:
        m = cls()
        for name, v in values.items():
            if v is None:
                continue
            f = d.fields_by_name[name]
            if f.is_repeated:
                getattr(m, name).extend(v)
            elif f.type == _F.TYPE_MESSAGE:
                getattr(m, name).CopyFrom(v)
            else:
                setattr(m, name, v)
        return m

    return st.fixed_dictionaries(fields).map(build)


def _class_of(d: Descriptor) -> type[Message]:
    from google.protobuf import message_factory

    return message_factory.GetMessageClass(d)


@st.composite
def mutated(draw: st.DrawFn, data: bytes) -> bytes:
    """``data`` with a few random flips, cuts, insertions and splices."""
    buf = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "set", "cut", "insert", "truncate"]))
        i = draw(st.integers(0, max(len(buf) - 1, 0)))
        if op == "flip" and buf:
            buf[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and buf:
            buf[i] = draw(st.sampled_from([0, 0xFF, 0x7F, 0x80]))
        elif op == "cut" and buf:
            del buf[i : i + draw(st.integers(1, 8))]
        elif op == "insert":
            buf[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif op == "truncate":
            del buf[i:]
    return bytes(buf)

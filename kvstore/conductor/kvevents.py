"""vLLM's KV events on the wire: what a publisher sends, decoded.

vLLM publishes what its prefix cache stores and evicts (``--kv-events-config
'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
"replay_endpoint": "tcp://*:5558"}'``).  vLLM is not imported: the wire format is decoded
generically (msgspec).  :mod:`kvstore.conductor.subscriber` follows a publisher,
:mod:`kvstore.conductor.cacheindex` turns the events into each engine's cached prefix.

The wire (vLLM 0.33, ``vllm/distributed/kv_events.py``): a ZMQ PUB socket sends
``(topic, seq, payload)``: ``seq`` 8 bytes big-endian, one per batch, counting from 0 when
the publisher starts; ``payload`` a msgpack ``[ts, [event, ...], data_parallel_rank]``;
each event a map tagged ``"type"``: ``BlockStored`` (``block_hashes``,
``parent_block_hash``, ``token_ids``, ``block_size``, ``lora_name``, ``medium``,
``extra_keys``, ``group_idx``, ``locality``, ``ownership``, ...), ``BlockRemoved``
(``block_hashes``, ``medium``, ``group_idx``, ...), ``AllBlocksCleared``.  (Publishers that
encode events as arrays, ``["BlockStored", hashes, ...]``, are read by field position.)
The optional ROUTER replay socket answers ``[b"", start_seq]`` with every buffered batch
from ``start_seq`` on, as ``[b"", topic, seq, payload]``, then ``[b"", b"", -1, b""]``.

Stateless.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import msgspec

from kvstore.errors import InvalidArgument

MEDIUM_GPU, MEDIUM_CPU = "GPU", "CPU"

BlockHash = bytes | int
"""vLLM's hash of a block as published: bytes, or an int with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES."""

# field order of array-encoded events (vLLM's struct declaration order), after the tag
FIELDS = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
        "locality",
        "ownership",
        "session_id",
    ),
    "BlockRemoved": ("block_hashes", "medium", "group_idx", "locality", "ownership"),
    "AllBlocksCleared": (),
}
END_SEQ = b"\xff" * 8  # the replay's end marker: -1 as 8 signed big-endian bytes


# -- the wire -----------------------------------------------------------------------------------
class Batch(NamedTuple):
    ts: float
    events: list[Any]  # as decoded: maps (or arrays) of plain values
    data_parallel_rank: int | None


_decoder = msgspec.msgpack.Decoder()


def decode_batch(payload: bytes) -> Batch:
    """A publisher's payload (``EventBatch``) decoded generically; InvalidArgument if it is not one."""
    try:
        raw = _decoder.decode(payload)
    except msgspec.DecodeError as e:
        raise InvalidArgument(f"KV event batch does not decode: {e}") from None
    if not isinstance(raw, list | tuple) or len(raw) < 2 or not isinstance(raw[1], list):
        raise InvalidArgument(f"KV event batch is not [ts, events, ...]: {type(raw).__name__}")
    rank = raw[2] if len(raw) > 2 and isinstance(raw[2], int) else None
    return Batch(float(raw[0]) if isinstance(raw[0], int | float) else 0.0, raw[1], rank)


def event_map(ev: Any) -> dict[str, Any]:
    """An event as a map tagged ``"type"`` (array-encoded ones by :data:`FIELDS`); ``{"type": None}`` if neither."""
    if isinstance(ev, dict):
        return ev
    if isinstance(ev, list | tuple) and ev and isinstance(ev[0], str):
        fields = FIELDS.get(ev[0], ())
        return {"type": ev[0], **dict(zip(fields, ev[1:]))}
    return {"type": None}

"""The publishing side of vLLM's KV events, for mock engines (``kvstore sim serve``).

The encoder twin of :mod:`kvstore.conductor.kvevents` (which documents the wire, after
vLLM 0.33's ``ZmqEventPublisher``): a PUB socket bound to ``endpoint`` sends one
``(topic, seq, payload)`` message per batch, ``seq`` 8 bytes big-endian counting from 0
when the publisher starts, ``payload`` a msgpack ``[ts, [event, ...], data_parallel_rank]``
with each event a map tagged ``"type"``.  The optional ROUTER socket bound to
``replay_endpoint`` answers ``[b"", start_seq]`` with every buffered batch from
``start_seq`` on, as ``[b"", topic, seq, payload]``, then ``[b"", b"", -1, b""]``.

:func:`block_stored`, :func:`block_removed` and :func:`all_blocks_cleared` build the event
maps as vLLM's KV cache manager fills them for its own GPU cache (``medium`` ``"GPU"``,
``group_idx`` 0, no LoRA, no extra keys), which is what the conductor credits.

State: a :class:`KVEventPublisher` belongs to one asyncio loop (the mock engine's): it
owns its two sockets and the replay buffer (the last ``buffer_batches`` batches); nothing
is shared with other threads.  Invariants: sequence numbers go up by one per batch, the
buffer holds consecutive ones, and a batch is buffered before it is sent.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from kvstore.errors import InvalidArgument

log = logging.getLogger("kvstore.sim")

MEDIUM = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The replay's end marker."""

_encoder = msgspec.msgpack.Encoder()


def block_stored(
    block_hashes: Sequence[bytes], parent: bytes | None, token_ids: Sequence[int], block_size: int
) -> dict[str, Any]:
    """vLLM's ``BlockStored`` for consecutive full blocks of the engine's own cache."""
    if len(token_ids) != len(block_hashes) * block_size:
        raise InvalidArgument(
            f"BlockStored of {len(block_hashes)} blocks of {block_size} tokens given {len(token_ids)} token ids"
        )
    return {
        "type": "BlockStored",
        "block_hashes": list(block_hashes),
        "parent_block_hash": parent,
        "token_ids": list(token_ids),
        "block_size": block_size,
        "lora_id": None,
        "medium": MEDIUM,
        "lora_name": None,
        "extra_keys": None,
        "group_idx": 0,
    }


def block_removed(block_hashes: Sequence[bytes]) -> dict[str, Any]:
    """vLLM's ``BlockRemoved``: cached blocks evicted (reused for other content)."""
    return {"type": "BlockRemoved", "block_hashes": list(block_hashes), "medium": MEDIUM, "group_idx": 0}


def all_blocks_cleared() -> dict[str, Any]:
    """vLLM's ``AllBlocksCleared`` (``/reset_prefix_cache``)."""
    return {"type": "AllBlocksCleared"}


def encode_batch(events: Sequence[dict[str, Any]], data_parallel_rank: int = 0) -> bytes:
    """One batch's payload: msgpack ``[ts, [event, ...], data_parallel_rank]``."""
    return _encoder.encode([time.time(), list(events), data_parallel_rank])


class KVEventPublisher:
    """vLLM's ZMQ KV-event publisher on an asyncio loop (see the module docstring).

    ``endpoint`` and ``replay_endpoint`` are bound (``tcp://*:5557``, ``tcp://127.0.0.1:0``
    picks a free port: :attr:`endpoint` and :attr:`replay_endpoint` then say which).  Make it
    and call :meth:`publish` and :meth:`close` on the loop that serves it."""

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_batches: int = 10_000,
        data_parallel_rank: int = 0,
    ) -> None:
        if buffer_batches < 1:
            raise InvalidArgument(f"buffer_batches must be at least 1, got {buffer_batches}")
        self.topic = topic.encode()
        self.data_parallel_rank = data_parallel_rank
        self.seq = 0  # the next batch's
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_batches)
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._router: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        try:
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.setsockopt(zmq.SNDHWM, 100_000)
            self.endpoint = self._bind(self._pub, endpoint)
            self.replay_endpoint = ""
            if replay_endpoint:
                self._router = self._ctx.socket(zmq.ROUTER)
                self._router.setsockopt(zmq.LINGER, 0)
                self.replay_endpoint = self._bind(self._router, replay_endpoint)
        except InvalidArgument:
            self._close_sockets()
            raise
        if self._router is not None:
            self._task = asyncio.get_running_loop().create_task(self._serve_replay(), name="kv-events-replay")

    @staticmethod
    def _bind(sock: zmq.asyncio.Socket, endpoint: str) -> str:
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as e:
            raise InvalidArgument(f"KV events endpoint {endpoint!r}: {e}") from None
        return str(sock.getsockopt_string(zmq.LAST_ENDPOINT))

    def publish(self, events: Sequence[dict[str, Any]]) -> int:
        """Send one batch (never blocks: a subscriber past the high-water mark misses it and
        replays); returns its sequence number."""
        seq = self.seq
        self.seq += 1
        payload = encode_batch(events, self.data_parallel_rank)
        self._buffer.append((seq, payload))
        sent = self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)
        asyncio.ensure_future(sent).add_done_callback(_consume)
        return seq

    async def _serve_replay(self) -> None:
        assert self._router is not None
        while True:
            frames = await self._router.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("KV events replay: a request of %d frames ignored", len(frames))
                continue
            ident, start = frames[0], int.from_bytes(frames[2], "big")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await self._router.send_multipart([ident, b"", self.topic, seq.to_bytes(8, "big"), payload])
            await self._router.send_multipart([ident, b"", b"", END_SEQ, b""])

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._router is not None:
            self._router.close(linger=0)
        self._ctx.term()


def _consume(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.warning("KV events batch not sent: %s", fut.exception())

"""The conductor's KV-events subscriber against vLLM itself: vLLM's own ``ZmqEventPublisher``
publishing vLLM's own event structs.  A real engine with KV events on is followed in
test_vllm_engine_registry.py (the engine those tests start anyway, through the endpoints its
registry record advertises).

The conductor never imports vLLM; these tests do, to check that what the subscriber
decodes generically is what vLLM sends (sequence numbers, replay protocol, msgpack
shapes) and that a real engine's prefix cache is credited exactly.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import numpy as np
import pytest

from kvstore.conductor.cacheindex import FleetCacheIndex
from kvstore.conductor.subscriber import KVEventSubscriber

pytestmark = pytest.mark.vllm

BS = 16


def wait_for(pred: Callable[[], Any], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, 31000, n).tolist()


@pytest.fixture
def ipc() -> Iterator[Callable[[str], str]]:
    """Short ipc:// endpoints (vLLM binds them; a path over ~100 bytes is refused)."""
    d = tempfile.mkdtemp(prefix="kve-")
    yield lambda name: f"ipc://{d}/{name}"
    shutil.rmtree(d, ignore_errors=True)


class Hashes:
    """vLLM's block hashes for token blocks, made by vLLM's own hash_block_tokens."""

    def __init__(self) -> None:
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import hash_block_tokens

        self._hash = lambda parent, toks: hash_block_tokens(sha256, parent, toks)

    def of(self, tokens: list[int]) -> list[bytes]:
        out: list[bytes] = []
        for i in range(len(tokens) // BS):
            # the first block's parent: a fixed seed (vLLM's NONE_HASH is a process global set at start)
            out.append(self._hash(out[-1] if out else b"\x00" * 32, tokens[i * BS : (i + 1) * BS]))
        return out


def stored(h: Hashes, tokens: list[int], lo: int, hi: int, **kw: Any) -> Any:
    from vllm.distributed.kv_events import BlockStored

    hs = h.of(tokens)
    fields: dict[str, Any] = dict(lora_id=None, medium="GPU", lora_name=None, group_idx=0)
    fields.update(kw)
    return BlockStored(
        block_hashes=hs[lo:hi],
        parent_block_hash=hs[lo - 1] if lo else None,
        token_ids=tokens[lo * BS : hi * BS],
        block_size=BS,
        **fields,
    )


class Publisher:
    """vLLM's ZmqEventPublisher, and what a test needs around it."""

    def __init__(self, endpoint: str, replay: str) -> None:
        from vllm.distributed.kv_events import ZmqEventPublisher

        self.endpoint, self.replay = endpoint, replay
        self.pub = ZmqEventPublisher(data_parallel_rank=0, endpoint=endpoint, replay_endpoint=replay)

    def publish(self, *events: Any) -> None:
        from vllm.distributed.kv_events import KVEventBatch

        self.pub.publish(KVEventBatch(ts=time.time(), events=list(events)))

    def idle(self) -> None:
        wait_for(lambda: self.pub._event_queue.unfinished_tasks == 0, "the publisher's queue drained")

    def lose(self, *events: Any) -> None:
        """A batch the publisher numbers and keeps for replay but that never reaches the
        subscriber (as one dropped on the way would)."""
        from vllm.distributed.kv_events import KVEventBatch

        self.idle()
        seq = next(self.pub._seq_gen)
        payload = msgspec.msgpack.encode(KVEventBatch(ts=time.time(), events=list(events), data_parallel_rank=0))
        self.pub._buffer.append((seq, payload))

    def sync(self, sub: KVEventSubscriber) -> None:
        """Empty batches until the subscriber hears one more (a SUB misses what came before it joined)."""
        deadline = time.monotonic() + 20
        heard = sub.batches
        while sub.batches == heard:
            assert time.monotonic() < deadline, "the subscriber never heard the publisher"
            self.publish()
            time.sleep(0.05)

    def close(self) -> None:
        self.pub.shutdown()


def test_vllms_publisher_is_followed_through_gaps_replays_and_restarts(ipc: Callable[[str], str]) -> None:
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved

    from gpu_agent.vllm.events import stored_event

    h = Hashes()
    x, y, z, w = (prompt(s, 10 * BS) for s in range(4))
    pub = Publisher(ipc("pub"), ipc("replay"))
    pub.publish(stored(h, z, 0, 10))  # before anyone listens: the replay's history brings it
    ix = FleetCacheIndex()
    sub = KVEventSubscriber("e0", pub.endpoint, ix, replay=pub.replay, block_size=BS)
    try:
        pub.sync(sub)
        wait_for(lambda: ix.match(z)["e0"] == 10 * BS, "the history credited")
        pub.publish(stored(h, x, 0, 4), stored(h, x, 4, 10))
        pub.publish(BlockRemoved(block_hashes=[h.of(x)[6]], medium="GPU", group_idx=0))
        # the kvstore connector's own event, through the same publisher: the pool, not the engine
        pub.publish(stored_event(h.of(y), 0, y, BS, "", medium="GPU"))
        wait_for(lambda: ix.match(x)["e0"] == 6 * BS, "x up to its removed block")
        assert ix.match(y)["e0"] == 0 and sub.resyncs == 0

        pub.lose(stored(h, y, 0, 10))  # one batch lost on the way, kept for replay
        pub.publish(BlockRemoved(block_hashes=[h.of(y)[8]], medium="GPU", group_idx=0))
        wait_for(lambda: sub.resyncs == 1 and ix.match(y)["e0"] == 8 * BS, "cleared, then replayed")
        assert ix.match(x)["e0"] == 0 and ix.match(z)["e0"] == 0  # cleared first: not credited again

        pub.idle()
        next(pub.pub._seq_gen)  # a batch numbered but never sent nor kept: not replayable
        pub.publish(stored(h, w, 0, 3))
        wait_for(lambda: sub.resyncs == 2 and ix.match(w)["e0"] == 3 * BS, "a gap no replay fills")
        assert ix.match(y)["e0"] == 0

        pub.publish(AllBlocksCleared())
        wait_for(lambda: ix.match(w)["e0"] == 0, "all blocks cleared")

        pub.publish(stored(h, x, 0, 10))
        wait_for(lambda: ix.match(x)["e0"] == 10 * BS, "x credited")
        pub.close()  # the engine restarts: a new publisher, numbering from 0 again
        wait_for(lambda: not sub.connected and ix.match(x)["e0"] == 0, "the lost publisher's view dropped")
        pub = Publisher(pub.endpoint, pub.replay)
        pub.publish(stored(h, z, 0, 5))
        pub.sync(sub)
        wait_for(lambda: ix.match(z)["e0"] == 5 * BS, "the new publisher's history")
        assert ix.match(x)["e0"] == 0 and sub.errors == 0
    finally:
        sub.close()
        pub.close()


# -- one real engine ------------------------------------------------------------------------------

"""A real node counts what it stored and what of it was read back, per namespace and prompt
position, over Stats and /metrics (kvstore/node/readback.py)."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from client import KVClient, Namespace
from kvstore.keys import chunk_keys, parent_keys

CHUNK = 16


def scrape(url: str) -> dict[tuple[str, str, str], float]:
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return {
        (s.name, s.labels["namespace"], s.labels["position"]): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name.startswith(("kvstore_stored_", "kvstore_read_back_"))
    }


def test_stored_then_read_blocks_move_the_counters_per_namespace_and_bucket(node_factory) -> None:
    node = node_factory("--dram", "64MiB", "--nvme", "0", "--metrics-port", "0")
    chat, batch = Namespace("chat-model", chunk_tokens=CHUNK), Namespace("batch-model", chunk_tokens=CHUNK)
    chat_keys = chunk_keys(list(range(4 * CHUNK)), chat)  # positions 0, 1, 2, 3
    batch_keys = chunk_keys(list(range(1000, 1000 + 2 * CHUNK)), batch)
    with KVClient(node.unix) as kv:
        for ns, keys in ((chat, chat_keys), (batch, batch_keys)):
            assert all(kv.put_many(keys, [bytes(1000)] * len(keys), namespace=ns, parents=parent_keys(keys)))
        assert kv.get_many(chat_keys[:3]) == [bytes(1000)] * 3  # the chat's first three chunks read back
        assert kv.get(chat_keys[0]) == bytes(1000)  # read again: still one read back
        s = kv.stats()
    rows = {(bytes.fromhex(r["namespace"]), r["bucket"]): r for r in s["read_back"]}  # fingerprints in hex
    assert set(rows) == {(chat.fingerprint, 0), (chat.fingerprint, 1), (chat.fingerprint, 2)} | {
        (batch.fingerprint, 0),
        (batch.fingerprint, 1),
    }
    assert [
        (rows[chat.fingerprint, b]["stored_blocks"], rows[chat.fingerprint, b]["read_back_blocks"]) for b in (0, 1, 2)
    ] == [
        (1, 1),
        (1, 1),
        (2, 1),  # positions 2 and 3 share a bucket; only position 2 was read
    ]
    assert rows[chat.fingerprint, 2]["read_back_bytes"] == 1000 and rows[chat.fingerprint, 2]["stored_bytes"] == 2000
    assert all(rows[batch.fingerprint, b]["read_back_blocks"] == 0 for b in (0, 1))
    c = s["counters"]
    assert (c["stored_blocks"], c["stored_bytes"], c["read_back_blocks"], c["read_back_bytes"]) == (6, 6000, 3, 3000)
    m = scrape(node.endpoints["metrics"])
    assert m["kvstore_stored_blocks_total", chat.fingerprint.hex(), "2-3"] == 2
    assert m["kvstore_read_back_blocks_total", chat.fingerprint.hex(), "2-3"] == 1
    assert m["kvstore_read_back_bytes_total", batch.fingerprint.hex(), "0"] == 0

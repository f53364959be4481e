"""The node's read-back counters (kvstore/node/readback.py) and the position buckets they share
with the connector (kvstore/vocabulary.py)."""

from __future__ import annotations

import pytest

from kvstore.block import BlockMeta
from kvstore.keys import NO_PARENT
from kvstore.node.metrics import read_back_families
from kvstore.node.readback import ReadBack
from kvstore.vocabulary import LAST_BUCKET, UNKNOWN_BUCKET, bucket_label, position_bucket

NS_A = b"A" * 8
NS_B = b"B" * 8


def chain(ns: bytes, n: int, tag: int = 0, size: int = 100) -> list[BlockMeta]:
    keys = [bytes([tag + 1, i]) * 8 for i in range(n)]
    parents = [NO_PARENT, *keys[:-1]]
    return [BlockMeta(ns, k, p, 16, "uint8", (size,), size, 0) for k, p in zip(keys, parents, strict=True)]


def test_position_buckets_are_powers_of_two() -> None:
    assert [position_bucket(p) for p in (0, 1, 2, 3, 4, 7, 8, 127, 128, 10**6)] == [0, 1, 2, 2, 3, 3, 4, 7, 8, 8]
    assert [bucket_label(b) for b in (0, 1, 2, 3, LAST_BUCKET, UNKNOWN_BUCKET)] == [
        "0",
        "1",
        "2-3",
        "4-7",
        "128+",
        "unknown",
    ]
    with pytest.raises(ValueError):
        position_bucket(-1)
    with pytest.raises(ValueError):
        bucket_label(UNKNOWN_BUCKET + 1)


def test_stored_then_read_counts_each_block_once_per_namespace_and_bucket() -> None:
    rb = ReadBack()
    a, b = chain(NS_A, 4), chain(NS_B, 2, tag=1, size=50)
    for m in a + b:
        rb.stored(m)
    rb.stored(a[0])  # the same key again (a replaced block): not stored twice
    rb.read([a[0], a[1], a[0]])  # a[0] twice in one call and again below: read back once
    rb.read([a[0], a[3]])
    rows = {(r.namespace, r.bucket): r for r in rb.rows()}
    assert set(rows) == {(NS_A, 0), (NS_A, 1), (NS_A, 2), (NS_B, 0), (NS_B, 1)}
    assert (rows[NS_A, 0].stored_blocks, rows[NS_A, 0].read_back_blocks, rows[NS_A, 0].read_back_bytes) == (1, 1, 100)
    assert (rows[NS_A, 2].stored_blocks, rows[NS_A, 2].stored_bytes, rows[NS_A, 2].read_back_blocks) == (2, 200, 1)
    assert rows[NS_B, 1].read_back_blocks == 0
    assert rb.totals() == {"stored_blocks": 6, "stored_bytes": 500, "read_back_blocks": 3, "read_back_bytes": 300}


def test_a_block_whose_parent_is_not_followed_has_an_unknown_position() -> None:
    rb = ReadBack()
    a = chain(NS_A, 3)
    rb.stored(a[2])  # its parent was never stored here
    rb.stored(a[0])
    rb.left(a[0].key)
    rb.stored(a[1])  # its parent left first
    assert {r.bucket: r.stored_blocks for r in rb.rows()} == {UNKNOWN_BUCKET: 2, 0: 1}


def test_memory_is_bounded_and_a_block_that_left_is_not_counted_when_read() -> None:
    rb = ReadBack(namespace_limit=1, max_blocks=2)
    a = chain(NS_A, 3)
    for m in a:
        rb.stored(m)
    assert len(rb) == 2 and rb.forgotten == 1  # the first followed one went
    rb.read(a)  # a[0] is no longer followed: its read is not counted
    rb.left(a[1].key)
    rb.stored(chain(NS_B, 1, tag=2)[0])  # past the namespace limit: the shared row
    assert rb.totals()["read_back_blocks"] == 2
    assert {r.namespace for r in rb.rows()} == {NS_A, b""}
    with pytest.raises(ValueError):
        ReadBack(max_blocks=0)


def test_metrics_export_read_back_by_namespace_and_position() -> None:
    rb = ReadBack()
    a = chain(NS_A, 2)
    for m in a:
        rb.stored(m)
    rb.read(a[:1])
    fams = {f.name: f for f in read_back_families(rb.rows())}
    got = {
        (s.name, s.labels["namespace"], s.labels["position"]): s.value
        for name in ("kvstore_stored_blocks", "kvstore_read_back_blocks", "kvstore_read_back_bytes")
        for s in fams[name].samples
    }
    assert got == {
        ("kvstore_stored_blocks_total", NS_A.hex(), "0"): 1,
        ("kvstore_stored_blocks_total", NS_A.hex(), "1"): 1,
        ("kvstore_read_back_blocks_total", NS_A.hex(), "0"): 1,
        ("kvstore_read_back_blocks_total", NS_A.hex(), "1"): 0,
        ("kvstore_read_back_bytes_total", NS_A.hex(), "0"): 100,
        ("kvstore_read_back_bytes_total", NS_A.hex(), "1"): 0,
    }

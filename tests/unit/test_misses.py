"""The miss-reason history (a bounded, set-associative fingerprint table) and the hit ledger."""

from __future__ import annotations

import random

import pytest

from kvstore.block import BlockMeta
from kvstore.node.ledger import CORRUPT, EVICTED, INVALIDATED, NEVER_STORED, KeyHistory, Ledger, NamespaceLabels


def k(i: int) -> bytes:
    return i.to_bytes(16, "big")


def meta(i: int, ns: bytes = b"ns-one..", tokens: int = 16) -> BlockMeta:
    return BlockMeta.for_payload(k(i), b"x" * 8, namespace=ns, token_count=tokens)


def test_records_the_latest_reason_per_key() -> None:
    h = KeyHistory(1 << 10)
    assert h.lookup(k(1)) is None
    h.record(k(1), EVICTED, 3)
    h.record(k(2), INVALIDATED)
    assert h.lookup(k(1)) == (EVICTED, 3)
    assert h.lookup(k(2)) == (INVALIDATED, 0)
    h.record(k(1), CORRUPT, 3)  # the same key again: updated in place, not duplicated
    assert h.lookup(k(1)) == (CORRUPT, 3)
    assert h.occupied() == 2


def test_capacity_is_bounded_and_old_departures_age_out() -> None:
    h = KeyHistory(1 << 12)
    n = 4 * h.capacity
    for i in range(n):
        h.record(k(i), EVICTED)
    assert h.occupied() <= h.capacity
    recent = sum(h.lookup(k(i)) is not None for i in range(n - h.capacity // 4, n))
    oldest = sum(h.lookup(k(i)) is not None for i in range(h.capacity // 4))
    assert recent >= 0.95 * (h.capacity // 4)  # the last capacity/4 departures are (almost) all remembered
    assert oldest <= 0.02 * (h.capacity // 4)  # departures 4 capacities ago are forgotten


def test_false_positive_rate_stays_under_the_documented_bound() -> None:
    h = KeyHistory(1 << 12)
    for i in range(2 * h.capacity):  # every bucket full
        h.record(k(i), EVICTED)
    rng = random.Random(7)  # seeded: the outcome is fixed, not a flaky statistic
    trials = 200_000
    fp = sum(h.lookup(rng.randbytes(16)) is not None for _ in range(trials))
    assert fp / trials < 2 * 4 / 65535  # documented: <= 4/65535 per lookup of a never-stored key


def test_capacity_must_be_a_power_of_two() -> None:
    with pytest.raises(ValueError):
        KeyHistory(1000)


def test_namespace_labels_are_bounded() -> None:
    labels = NamespaceLabels(limit=3)
    tags = [labels.tag(bytes([i]) * 8) for i in range(10)]
    assert [labels.label(t) for t in tags[:3]] == [(bytes([i]) * 8).hex() for i in range(3)]
    assert {labels.label(t) for t in tags[3:]} == {"other"}
    assert labels.label(0) == "unknown"


def test_ledger_counts_every_key_once() -> None:
    led = Ledger()
    ns2 = b"ns-two.."
    tag2 = led.namespaces.tag(ns2)
    led.record("get", [("dram", meta(1)), ("nvme", meta(2))], [(EVICTED, 0), (NEVER_STORED, 0), (INVALIDATED, tag2)])
    s = led.snapshot()
    assert s["requests"] == {"get": 1}
    assert s["lookups"] == {"get": 5}
    assert s["hits"] == {("get", "dram"): 1, ("get", "nvme"): 1}
    assert s["hit_tokens"] == {("get", "dram"): 16, ("get", "nvme"): 16}
    assert s["misses"] == {("get", EVICTED): 1, ("get", NEVER_STORED): 1, ("get", INVALIDATED): 1}
    ns1 = b"ns-one..".hex()
    # untagged misses go to the request's one namespace; a tagged miss to its own
    assert s["ns_misses"] == {(ns1, "get"): 2, (ns2.hex(), "get"): 1}
    assert s["ns_hits"] == {(ns1, "get"): 2}


def test_match_prefix_tail_misses_for_the_gap_reason() -> None:
    led = Ledger()
    led.record("match_prefix", [("dram", meta(1))], extra_misses=(EVICTED, 0, 3))
    s = led.snapshot()
    assert s["lookups"] == {"match_prefix": 4}
    assert s["misses"] == {("match_prefix", EVICTED): 3}


def test_mixed_namespace_requests_attribute_unknown_misses_to_unknown() -> None:
    led = Ledger()
    led.record("exists", [("dram", meta(1)), ("dram", meta(2, ns=b"ns-two.."))], [(NEVER_STORED, 0)])
    assert led.snapshot()["ns_misses"] == {("unknown", "exists"): 1}


def test_reported_hits_from_elsewhere() -> None:
    led = Ledger()
    led.report("get", "hbm", 4, 64, namespace=b"ns-one..")
    s = led.snapshot()
    assert s["hits"] == {("get", "hbm"): 4} and s["lookups"] == {"get": 4}
    with pytest.raises(ValueError):
        led.report("get", "tape", 1)

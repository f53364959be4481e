"""Prefetch and eviction planning: pure functions over plain values."""

from __future__ import annotations

import pytest

from gpu_agent.prefetch import Bandwidths, PoolEntry, plan_evictions, plan_prefetch, usable_prefix

MiB = 1 << 20
K = [bytes([i]) * 16 for i in range(10)]


def plan(tiers, in_hbm=None, *, free=10, entries=(), byte_budget=1 << 40, time_budget=1e9, bw=Bandwidths(), block=MiB):  # noqa: B008  # frozen
    in_hbm = in_hbm or [False] * len(tiers)
    return plan_prefetch(
        tiers,
        in_hbm,
        block_bytes=block,
        free_slots=free,
        entries=list(entries),
        keys=K[: len(tiers)],
        byte_budget=byte_budget,
        time_budget_s=time_budget,
        bandwidths=bw,
    )


def test_usable_prefix_stops_at_the_first_gap() -> None:
    assert usable_prefix(["dram", "nvme", None, "dram"], [False] * 4) == 2
    assert usable_prefix([None, "dram"], [True, False]) == 2  # HBM fills the store's gap
    assert usable_prefix([], []) == 0


def test_evictions_are_lru_then_deepest_first() -> None:
    entries = [
        PoolEntry(K[0], 5, 0),
        PoolEntry(K[1], 5, 1),
        PoolEntry(K[2], 5, 2),
        PoolEntry(K[3], 1, 0),
        PoolEntry(K[4], 9, 3),
    ]
    assert plan_evictions(entries, 1) == [K[3]]
    # a prompt touched together: descendants go before their ancestors
    assert plan_evictions(entries, 3) == [K[3], K[2], K[1]]
    assert plan_evictions(entries, 2, protect={K[3], K[2]}) == [K[1], K[0]]
    assert plan_evictions(entries, 0) == []
    assert plan_evictions(entries, 10, protect={K[0], K[1], K[2], K[3]}) == [K[4]]


def test_prefetch_fetches_the_prefix_and_skips_what_hbm_has() -> None:
    p = plan(["dram", "dram", "nvme", None, "dram"], [False, True, False, False, False])
    assert p.prefix == 3 and p.resident == 1
    assert p.fetch == (0, 2)
    assert p.nbytes == 2 * MiB and p.limit == "" and p.evict == ()


def test_prefetch_of_nothing_cached() -> None:
    p = plan([None, "dram"])
    assert p.fetch == () and p.prefix == 0 and p.nbytes == 0


def test_byte_budget_cuts_the_plan() -> None:
    p = plan(["dram"] * 5, byte_budget=3 * MiB)
    assert p.fetch == (0, 1, 2) and p.limit == "bytes"


def test_time_budget_weighs_nvme_more_than_dram() -> None:
    bw = Bandwidths(dram_to_hbm=10 * MiB, nvme_to_dram=1 * MiB)
    # dram: 0.1 s a block; nvme: 1.1 s a block
    assert plan(["dram"] * 5, time_budget=0.35, bw=bw).fetch == (0, 1, 2)
    p = plan(["nvme"] * 5, time_budget=2.5, bw=bw)
    assert p.fetch == (0, 1) and p.limit == "time"
    assert p.seconds == pytest.approx(2.2)
    assert bw.seconds("remote", MiB) > bw.seconds("dram", MiB)


def test_full_pool_evicts_other_prompts_but_not_this_one() -> None:
    others = [PoolEntry(K[8], 1, 0), PoolEntry(K[9], 2, 1)]
    mine = [PoolEntry(K[0], 0, 0)]  # already resident: protected although it is the oldest
    p = plan(["dram"] * 3, [True, False, False], free=0, entries=others + mine)
    assert p.fetch == (1, 2) and p.evict == (K[8], K[9])


def test_pool_too_small_trims_the_plan() -> None:
    p = plan(["dram"] * 4, free=1, entries=[PoolEntry(K[9], 1, 0)])
    assert p.fetch == (0, 1) and p.evict == (K[9],) and p.limit == "pool"
    assert p.nbytes == 2 * MiB


def test_lengths_must_agree() -> None:
    with pytest.raises(ValueError):
        plan_prefetch(
            ["dram"],
            [False, False],
            block_bytes=1,
            free_slots=1,
            entries=[],
            keys=K[:1],
            byte_budget=1,
            time_budget_s=1,
        )

"""The reuse-aware prefix policies (``prefix-reuse``, the default, and ``prefix-freq``).

A deterministic sequence of calls is the fake clock: priorities are logical ticks plus a
bonus measured in ticks (REUSE / SHARE × the tier's peak block count).  The round protocol
(skip, stop early, mutate mid-round) is the one of ``tiers.policy``'s docstring.
"""

from __future__ import annotations

import itertools
import random

import pytest

from kvstore.keys import NO_PARENT, ChunkKey
from tiers.policy import (
    DEFAULT_POLICY,
    POLICIES,
    PrefixAwareLRUPolicy,
    PrefixFrequencyPolicy,
    PrefixReusePolicy,
    make_policy,
)

HEAP_POLICIES = [PrefixReusePolicy, PrefixFrequencyPolicy]


class Steady(PrefixReusePolicy):
    """The default policy under constant pressure: the full bonus from the first insert."""

    PRESSURE = (0.0, 0.0)


def K(i: int) -> ChunkKey:
    assert i > 0
    return ChunkKey(i.to_bytes(16, "big"))


def name(key: bytes) -> int:
    return int.from_bytes(key, "big")


def proposals(p) -> list[int]:
    return [name(k) for k in p.victims()]


def drain(p) -> list[int]:
    out = []
    for k in p.victims():
        out.append(name(k))
        p.remove(k)
    return out


def flat(p, *ids: int) -> None:
    for i in ids:
        p.insert(K(i), NO_PARENT, 1)


def chain(p, *ids: int) -> None:
    parent = NO_PARENT
    for i in ids:
        p.insert(K(i), parent, 1)
        parent = K(i)


def test_registry_and_default() -> None:
    assert DEFAULT_POLICY == "prefix-reuse"
    assert isinstance(make_policy("prefix-reuse"), PrefixReusePolicy)
    assert isinstance(make_policy("prefix-freq"), PrefixFrequencyPolicy)
    assert {"lru", "prefix-lru", "prefix-reuse", "prefix-freq"} <= set(POLICIES)


@pytest.mark.parametrize("cls", HEAP_POLICIES)
def test_common_behaviour(cls) -> None:
    p = cls()
    assert len(p) == 0 and proposals(p) == [] and drain(p) == []
    flat(p, 1, 2, 3)
    assert len(p) == 3 and K(2) in p and K(9) not in p and "x" not in p
    assert p.admit(K(9), 1 << 30)
    p.access(K(9))
    p.remove(K(9))
    p.insert(K(1), NO_PARENT, 1)  # re-insert: an access, no duplicate
    assert len(p) == 3
    p.remove(K(2))
    p.remove(K(2))
    assert len(p) == 2 and K(2) not in p
    assert sorted(drain(p)) == [1, 3] and len(p) == 0


def test_new_blocks_go_before_a_reused_one() -> None:
    """A block used twice outlives about REUSE × N ticks of newer one-time blocks; LRU would not keep it."""
    p, lru = Steady(), PrefixAwareLRUPolicy()
    for q in (p, lru):
        flat(q, *range(1, 101))  # N = 100: one reuse step is worth 50 ticks
        q.access(K(1))
        flat(q, *range(101, 131))
    assert proposals(lru)[-31:] == [1, *range(101, 131)]
    assert proposals(p)[-31:] == [*range(101, 131), 1]
    flat(p, *range(131, 171))  # 40 more: now older than its bonus
    order = proposals(p)
    assert order.index(149) < order.index(1) < order.index(150)  # priority 101 + 50: key 150's tick


def test_an_evicted_block_written_again_remembers_its_use() -> None:
    p = Steady()
    flat(p, *range(1, 101))
    p.remove(K(1))  # evicted
    p.insert(K(1), NO_PARENT, 1)  # wanted again: the sketch has seen it
    flat(p, *range(101, 121))
    assert proposals(p)[-1] == 1


def test_frequency_policy_counts_several_uses() -> None:
    p = PrefixFrequencyPolicy()
    flat(p, *range(1, 101))
    for _ in range(3):
        p.access(K(1))  # 4 uses: three reuse steps of 50 ticks
    p.access(K(2))  # 2 uses: one step
    flat(p, *range(101, 201))
    order = proposals(p)
    assert order[order.index(2) + 1] == 150  # one step: tick 104 + 50, key 150's tick
    assert order[-1] == 1  # three steps: tick 103 + 150, after everything else


def test_fanout_raises_a_shared_prefix_and_its_ancestors() -> None:
    p = Steady()
    chain(p, 1, 2, 3)  # a shared prompt 1-2-3 ...
    p.insert(K(10), K(3), 1)  # ... extended by two different conversations
    assert p._level == {}
    p.insert(K(20), K(3), 1)
    assert p._level == {K(3): 1, K(2): 1, K(1): 1}
    for i in (30, 40):
        p.insert(K(i), K(3), 1)
    assert p._level[K(1)] == 2  # four children: level floor(log2 4)
    p.insert(K(50), K(3), 1)  # five: no new level, no walk
    assert p._level[K(1)] == 2
    p.remove(K(50))
    p.insert(K(50), K(3), 1)  # a child seen lately is not a new branch
    assert p._fanout[K(3)] == 5


def test_a_shared_prefix_outlives_a_private_one_used_later() -> None:
    p, lru = Steady(), PrefixAwareLRUPolicy()
    for q in (p, lru):
        flat(q, *range(1000, 1060))  # background traffic: N = 60+
        chain(q, 1, 2)  # a system prompt ...
        q.insert(K(3), K(2), 1)  # ... that two conversations extend: fan-out 2
        q.insert(K(4), K(2), 1)
        q.access(K(1))
        q.access(K(2))
        q.remove(K(3))  # the conversations' own blocks are gone again
        q.remove(K(4))
        chain(q, 11, 12)  # a private context, written and reused after the prompt's last use
        q.access(K(11))
        q.access(K(12))
        flat(q, *range(2000, 2010))
    old = drain(lru)
    assert old.index(2) < old.index(1) < old.index(12) < old.index(11)  # LRU: the older prompt goes first
    order = drain(p)
    assert order.index(12) < order.index(11) < order.index(2) < order.index(1)


def test_no_bonus_until_evictions_cost_hits() -> None:
    """Under no pressure (every insert a block never seen) the default is prefix-aware LRU;
    once enough inserts are blocks evicted lately, reused blocks get their extra life."""
    calm, lru = PrefixReusePolicy(), PrefixAwareLRUPolicy()
    for q in (calm, lru):
        flat(q, *range(1, 101))
        q.access(K(1))
        flat(q, *range(101, 131))
    assert proposals(calm) == proposals(lru)
    p = PrefixReusePolicy()
    flat(p, *range(1, 101))
    for i in range(2, 61):  # 59 evicted and written again: 59 of 159 inserts saw their block lately
        p.remove(K(i))
        p.insert(K(i), NO_PARENT, 1)
    assert p._again / p._inserts > PrefixReusePolicy.PRESSURE[1]
    p.access(K(1))
    flat(p, *range(101, 131))
    assert proposals(p)[-1] == 1


@pytest.mark.parametrize("cls", HEAP_POLICIES)
@pytest.mark.parametrize("inserts", list(itertools.permutations([1, 2, 3])))
@pytest.mark.parametrize("accesses", list(itertools.permutations([1, 2, 3])))
def test_descendants_always_go_first(cls, inserts, accesses) -> None:
    parents = {1: NO_PARENT, 2: K(1), 3: K(2)}
    p = cls()
    for i in inserts:
        p.insert(K(i), parents[i], 1)
    for i in accesses:
        p.access(K(i))
        p.access(K(i))
    assert proposals(p) == [3]
    assert drain(p) == [3, 2, 1]


@pytest.mark.parametrize("cls", HEAP_POLICIES)
def test_skipped_victims_keep_their_place_and_are_offered_once(cls) -> None:
    p = cls()
    chain(p, 1, 2)
    chain(p, 11, 12)
    chain(p, 21, 22)
    seen = []
    for k in p.victims():
        seen.append(name(k))
        if name(k) == 12:
            p.remove(k)
    assert seen == [2, 12, 11, 22]  # 2, 11 and 22 skipped (pinned, leased)
    assert proposals(p) == [2, 11, 22] == proposals(p)
    it = p.victims()
    assert name(next(it)) == 2
    it.close()  # stopped right after a skip: 2 stays first
    assert proposals(p) == [2, 11, 22]
    with pytest.raises(RuntimeError):
        for _ in p.victims():
            raise RuntimeError("demotion failed")
    assert proposals(p) == [2, 11, 22] and len(p) == 5


@pytest.mark.parametrize("cls", HEAP_POLICIES)
def test_changes_while_a_round_is_suspended(cls) -> None:
    p = cls()
    flat(p, 1, 2, 3, 4)
    it = p.victims()
    assert [name(next(it)), name(next(it))] == [1, 2]
    p.remove(K(1))  # deleted meanwhile: never comes back
    p.access(K(2))  # read meanwhile: now recent, offered again later in this round
    p.remove(K(4))
    rest = [name(k) for k in it]
    assert rest == [3, 2]
    assert proposals(p) == [3, 2] and len(p) == 2


@pytest.mark.parametrize("cls", HEAP_POLICIES)
def test_bogus_parents_cannot_pin_blocks(cls) -> None:
    p = cls()
    p.insert(K(1), K(1), 1)
    p.insert(K(2), K(3), 1)
    p.insert(K(3), K(2), 1)
    assert sorted(drain(p)) == [1, 2, 3] and len(p) == 0


@pytest.mark.parametrize("cls", HEAP_POLICIES)
@pytest.mark.parametrize("seed", range(6))
def test_random_against_a_model(cls, seed: int) -> None:
    """Every proposal is the lowest (priority, tick) among resident keys with no resident child,
    not yet offered in the round; the heap, lazy invalidation and restores must agree with that."""
    rng = random.Random(seed)
    n = 50
    parent_of = {i: (K(rng.randrange(1, i)) if i > 1 and rng.random() < 0.8 else NO_PARENT) for i in range(1, n + 1)}
    p = cls()

    def leaves(exclude: set[bytes]) -> list[int]:
        held = {p._parent[k] for k in p._prio}
        cands = [k for k in p._prio if k not in held and k not in exclude]
        return [name(k) for k in sorted(cands, key=p._prio.__getitem__)]

    for _ in range(700):
        op = rng.random()
        i = rng.randint(1, n)
        if op < 0.45:
            p.insert(K(i), parent_of[i], 1)
        elif op < 0.7:
            p.access(K(i))
        elif op < 0.8:
            p.remove(K(i))
        else:
            offered: set[bytes] = set()
            stop = rng.choice([None, rng.randint(1, 8)])
            for count, k in enumerate(p.victims(), 1):
                expect = leaves(offered)
                assert expect and name(k) == expect[0]
                if rng.random() < 0.4:
                    offered.add(k)
                else:
                    p.remove(k)
                if stop is not None and count >= stop:
                    break
            else:
                assert leaves(offered) == []
        assert len(p) == len(p._prio) == len(p._parent)
        assert set(p._fanout) <= set(p._prio) and set(p._level) <= set(p._prio)
        assert proposals(p) == leaves(set())
        assert len(p._heap) <= 2 * len(p) + 64 + 1

"""Eviction policies.  They run on a logical tick, so a deterministic sequence of calls is the fake clock.

Round protocol (module docstring of ``tiers.policy``): iterate ``victims()``; for each
proposed key either evict it (``remove`` before asking for the next) or skip it, and a
skipped key keeps its place.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable

import pytest

from kvstore.errors import InvalidArgument
from kvstore.keys import NO_PARENT, ChunkKey
from tiers.policy import (
    DEFAULT_POLICY,
    POLICIES,
    LRUPolicy,
    PrefixAwareLRUPolicy,
    make_policy,
)


def K(i: int) -> ChunkKey:
    assert i > 0  # 0 would be NO_PARENT
    return ChunkKey(i.to_bytes(16, "big"))


def name(key: bytes) -> int:
    return int.from_bytes(key, "big")


def proposals(policy) -> list[int]:
    """One round that skips every proposal: what would be offered, in order."""
    return [name(k) for k in policy.victims()]


def drain(policy) -> list[int]:
    """One round that evicts every proposal: the whole eviction order."""
    out = []
    for k in policy.victims():
        out.append(name(k))
        policy.remove(k)
    return out


def round_(policy, evict: Iterable[int], stop_after: int | None = None) -> list[int]:
    """One round that evicts the keys in ``evict`` and skips the others; optionally stops early."""
    evict = set(evict)
    out = []
    for k in policy.victims():
        out.append(name(k))
        if name(k) in evict:
            policy.remove(k)
        if stop_after is not None and len(out) >= stop_after:
            break
    return out


def flat(policy, *ids: int) -> None:
    for i in ids:
        policy.insert(K(i), NO_PARENT, 1)


# -- registry ------------------------------------------------------------------------


def test_make_policy() -> None:
    assert isinstance(make_policy("lru"), LRUPolicy)
    assert isinstance(make_policy("prefix-lru"), PrefixAwareLRUPolicy)
    assert DEFAULT_POLICY in POLICIES
    assert make_policy("lru") is not make_policy("lru")  # a fresh instance per tier


@pytest.mark.parametrize("bad", ["LRU", "lfu", "", "prefix_lru"])
def test_make_policy_unknown_name(bad: str) -> None:
    with pytest.raises(InvalidArgument, match="unknown eviction policy") as ei:
        make_policy(bad)
    assert "lru" in str(ei.value) and "prefix-lru" in str(ei.value)  # names the choices


@pytest.mark.parametrize("cls", [LRUPolicy, PrefixAwareLRUPolicy])
def test_common_behaviour(cls) -> None:
    p = cls()
    assert len(p) == 0 and proposals(p) == [] and drain(p) == []
    flat(p, 1, 2, 3)
    assert len(p) == 3 and K(2) in p and K(9) not in p and "x" not in p
    assert p.admit(K(9), 1 << 30)
    p.access(K(9))  # unknown: ignored
    p.remove(K(9))
    assert len(p) == 3
    p.insert(K(1), NO_PARENT, 1)  # re-insert: no duplicate
    assert len(p) == 3
    p.remove(K(2))
    p.remove(K(2))
    assert len(p) == 2 and K(2) not in p
    assert sorted(drain(p)) == [1, 3] and len(p) == 0


# -- LRU -----------------------------------------------------------------------------


def test_lru_order_and_access() -> None:
    p = LRUPolicy()
    flat(p, 1, 2, 3, 4)
    assert proposals(p) == [1, 2, 3, 4]
    p.access(K(2))
    p.access(K(1))
    assert proposals(p) == [3, 4, 2, 1]
    p.insert(K(3), NO_PARENT, 1)  # re-insert counts as use
    assert proposals(p) == [4, 2, 1, 3]
    assert drain(p) == [4, 2, 1, 3]


def test_lru_skipped_victims_keep_their_place() -> None:
    p = LRUPolicy()
    flat(p, *range(1, 7))
    assert round_(p, evict={2, 4}) == [1, 2, 3, 4, 5, 6]
    assert proposals(p) == [1, 3, 5, 6]
    p.access(K(5))
    assert round_(p, evict={3}, stop_after=2) == [1, 3]  # stopped early: the rest untouched
    assert proposals(p) == [1, 6, 5]
    assert len(p) == 3


def test_lru_remove_ahead_during_a_round() -> None:
    p = LRUPolicy()
    flat(p, 1, 2, 3, 4)
    seen = []
    for k in p.victims():
        seen.append(name(k))
        if name(k) == 1:
            p.remove(K(3))  # not yet proposed: never will be
            p.insert(K(5), NO_PARENT, 1)  # arrives mid-round at the MRU end
    assert seen == [1, 2, 4, 5]
    assert proposals(p) == [1, 2, 4, 5]


def test_lru_state_while_a_round_is_suspended() -> None:
    """Regression: keys skipped by a suspended round vanished from len()/`in`, and a key removed
    meanwhile came back when the round ended (a ghost the tier no longer holds)."""
    p = LRUPolicy()
    flat(p, 1, 2, 3, 4)
    it = p.victims()
    assert name(next(it)) == 1  # skipped
    assert name(next(it)) == 2  # skipped
    assert name(next(it)) == 3  # suspended here, e.g. the caller awaits a demotion
    assert len(p) == 4 and K(1) in p and K(2) in p
    p.remove(K(1))  # deleted by another request meanwhile
    p.access(K(2))  # read by another request meanwhile: now the most recent
    assert len(p) == 3 and K(1) not in p and K(2) in p
    it.close()
    assert proposals(p) == [3, 4, 2]
    assert len(p) == 3


def test_lru_reinsert_while_set_aside() -> None:
    p = LRUPolicy()
    flat(p, 1, 2)
    it = p.victims()
    assert name(next(it)) == 1
    assert name(next(it)) == 2  # 1 set aside
    p.insert(K(1), NO_PARENT, 1)  # written again: most recent
    assert name(next(it)) == 1  # it is back in the queue, so this round offers it again
    p.remove(K(1))
    assert list(it) == []
    assert proposals(p) == [2] and len(p) == 1


@pytest.mark.parametrize("seed", range(5))
def test_lru_random_against_a_model(seed: int) -> None:
    rng = random.Random(seed)
    p = LRUPolicy()
    model: list[int] = []  # LRU first
    for _ in range(600):
        op = rng.random()
        i = rng.randint(1, 40)
        if op < 0.4:
            p.insert(K(i), NO_PARENT, 1)
            if i in model:
                model.remove(i)
            model.append(i)
        elif op < 0.7:
            p.access(K(i))
            if i in model:
                model.remove(i)
                model.append(i)
        elif op < 0.8:
            p.remove(K(i))
            if i in model:
                model.remove(i)
        else:
            evict = {j for j in model if rng.random() < 0.3}
            stop = rng.choice([None, rng.randint(1, 10)])
            seen = round_(p, evict, stop_after=stop)
            assert seen == model[: len(seen)]
            if stop is None:
                assert len(seen) == len(model)
            model = [j for j in model if not (j in evict and j in seen)]
        assert len(p) == len(model)
        assert proposals(p) == model


# -- prefix-aware LRU ----------------------------------------------------------------


def chain(p, *ids: int) -> None:
    parent = NO_PARENT
    for i in ids:
        p.insert(K(i), parent, 1)
        parent = K(i)


@pytest.mark.parametrize("accesses", list(itertools.permutations([1, 2, 3])))
def test_prefix_chain_evicts_descendants_first(accesses) -> None:
    p = PrefixAwareLRUPolicy()
    chain(p, 1, 2, 3)  # A=1 -> B=2 -> C=3
    for i in accesses:
        p.access(K(i))
    assert proposals(p) == [3]  # only the leaf is offered while the rest of the chain is there
    assert drain(p) == [3, 2, 1]


@pytest.mark.parametrize("inserts", list(itertools.permutations([1, 2, 3])))
@pytest.mark.parametrize("accesses", list(itertools.permutations([1, 2, 3])))
def test_prefix_chain_inserted_out_of_order(inserts, accesses) -> None:
    """Regression: a parent inserted after its child (out-of-order commits, a rebuild from an index
    in key order) was treated as a leaf and could be evicted before its descendants."""
    parents = {1: NO_PARENT, 2: K(1), 3: K(2)}
    p = PrefixAwareLRUPolicy()
    for i in inserts:
        p.insert(K(i), parents[i], 1)
    for i in accesses:
        p.access(K(i))
    assert drain(p) == [3, 2, 1]


def test_prefix_removed_and_reinserted_parent_still_waits_for_its_children() -> None:
    p = PrefixAwareLRUPolicy()
    chain(p, 1, 2, 3)
    p.remove(K(2))  # e.g. invalidated, then written again
    p.insert(K(2), K(1), 1)
    p.access(K(3))
    assert proposals(p) == [3]
    assert drain(p) == [3, 2, 1]


def test_prefix_shared_parent_goes_after_both_children() -> None:
    p = PrefixAwareLRUPolicy()
    p.insert(K(1), NO_PARENT, 1)  # P
    p.insert(K(2), K(1), 1)  # X
    p.insert(K(3), K(1), 1)  # Y
    p.access(K(1))
    assert proposals(p) == [2, 3]
    assert round_(p, evict={2}) == [2, 3]  # P is still held back by Y
    assert proposals(p) == [3]
    p.access(K(3))
    assert round_(p, evict={3}) == [3, 1]  # Y gone: P offered in the same round
    assert drain(p) == [1]


def test_prefix_leaves_in_lru_order_across_chains() -> None:
    p = PrefixAwareLRUPolicy()
    chain(p, 1, 2, 3)
    chain(p, 11, 12)
    chain(p, 21)
    assert proposals(p) == [3, 12, 21]
    p.access(K(3))
    assert proposals(p) == [12, 21, 3]
    # evicting 12 makes 11 a leaf with its old (earliest) tick: offered next, same round
    assert drain(p) == [12, 11, 21, 3, 2, 1]


def test_prefix_skipped_leaves_keep_their_place() -> None:
    p = PrefixAwareLRUPolicy()
    chain(p, 1, 2)
    chain(p, 11, 12)
    chain(p, 21, 22)
    assert round_(p, evict={12}) == [2, 12, 11, 22]  # 2 skipped (pinned), 11 skipped
    assert proposals(p) == [2, 11, 22]
    assert proposals(p) == [2, 11, 22]  # rounds that skip all change nothing
    assert round_(p, evict={2}, stop_after=1) == [2]
    assert proposals(p) == [1, 11, 22]  # 1 kept its old tick: still first
    assert len(p) == 4


def test_prefix_skip_then_stop_keeps_the_key() -> None:
    """Regression: a leaf skipped as the last proposal of a round the caller then stopped (break,
    an exception, a cancelled task) was dropped from the heap and never offered again."""
    p = PrefixAwareLRUPolicy()
    chain(p, 1, 2)
    flat(p, 3)
    assert round_(p, evict=(), stop_after=1) == [2]
    assert proposals(p) == [2, 3]

    with pytest.raises(RuntimeError):
        for k in p.victims():
            raise RuntimeError(f"demotion of {name(k)} failed")
    assert proposals(p) == [2, 3]
    assert drain(p) == [2, 1, 3]


def test_prefix_each_key_offered_once_per_round() -> None:
    """Regression: a parent that lost its last child got a second, equally valid heap entry, so a
    round offered it twice."""
    p = PrefixAwareLRUPolicy()
    flat(p, 1)
    p.insert(K(2), K(1), 1)
    p.remove(K(2))  # 1 is a leaf again, with the same tick it already had in the heap
    flat(p, 3)
    assert proposals(p) == [1, 3]
    assert proposals(p) == [1, 3]
    assert drain(p) == [1, 3]


def test_prefix_access_mid_round_offers_the_key_again_later() -> None:
    p = PrefixAwareLRUPolicy()
    flat(p, 1, 2)
    seen = []
    for k in p.victims():
        seen.append(name(k))
        if seen == [1]:
            p.access(K(1))  # skipped, then read by someone: now the most recent
    assert seen == [1, 2, 1]
    assert proposals(p) == [2, 1]


def test_prefix_remove_during_a_round() -> None:
    p = PrefixAwareLRUPolicy()
    flat(p, 1, 2, 3, 4)
    seen = []
    for k in p.victims():
        seen.append(name(k))
        if name(k) == 1:
            p.remove(K(3))  # an ahead leaf goes elsewhere
        if name(k) == 2:
            p.remove(K(2))
    assert seen == [1, 2, 4]
    assert proposals(p) == [1, 4]


def test_prefix_state_while_a_round_is_suspended() -> None:
    p = PrefixAwareLRUPolicy()
    flat(p, 1, 2, 3)
    it = p.victims()
    assert name(next(it)) == 1  # skipped
    assert name(next(it)) == 2
    assert len(p) == 3 and K(1) in p
    p.remove(K(1))
    p.access(K(2))
    it.close()
    assert proposals(p) == [3, 2] and len(p) == 2


def test_prefix_reinsert_existing_key_is_an_access() -> None:
    p = PrefixAwareLRUPolicy()
    chain(p, 1, 2)
    flat(p, 5)
    p.insert(K(2), K(1), 1)
    assert proposals(p) == [5, 2] and len(p) == 3
    p.insert(K(2), NO_PARENT, 1)  # a different parent on re-insert is ignored: 2 still holds 1 back
    assert drain(p) == [5, 2, 1]


def test_prefix_orphans_are_leaves() -> None:
    p = PrefixAwareLRUPolicy()
    chain(p, 1, 2, 3)
    p.remove(K(1))  # the root goes (invalidated): the rest is still evictable bottom-up
    assert drain(p) == [3, 2]
    p.insert(K(7), K(99), 1)  # parent never resident
    assert drain(p) == [7]


def test_prefix_bogus_parents_cannot_pin_blocks_forever() -> None:
    p = PrefixAwareLRUPolicy()
    p.insert(K(1), K(1), 1)  # its own parent
    assert drain(p) == [1]
    p.insert(K(2), K(3), 1)  # a two-key cycle, one edge of which is ignored
    p.insert(K(3), K(2), 1)
    assert sorted(drain(p)) == [2, 3] and len(p) == 0
    chain(p, 4, 5, 6)
    p.remove(K(4))
    p.insert(K(4), K(6), 1)  # 4 -> 5 -> 6 -> 4
    assert sorted(drain(p)) == [4, 5, 6] and len(p) == 0


def test_prefix_heap_compaction_keeps_order_and_bounds_memory() -> None:
    p = PrefixAwareLRUPolicy()
    chain(p, 1, 2, 3)
    flat(p, *range(10, 20))
    rng = random.Random(3)
    order = list(range(10, 20)) + [3]
    for _ in range(5000):
        i = rng.choice(order + [1, 2])
        p.access(K(i))
        if i in order:
            order.remove(i)
            order.append(i)
        assert len(p._heap) <= 2 * len(p) + 64 + 1
    assert proposals(p) == order
    expect = []
    for i in order:
        expect.append(i)
        if i == 3:
            expect += [2, 1]  # parents come right after, holding their old (older) ticks
    # 1 and 2 were accessed at different ticks; whichever is older does not matter: 2 must precede 1
    got = drain(p)
    assert sorted(got) == sorted(expect)
    assert got.index(3) < got.index(2) < got.index(1)
    assert [i for i in got if i not in (1, 2)] == order


@pytest.mark.parametrize("seed", range(6))
def test_prefix_random_against_a_model(seed: int) -> None:
    """Random inserts (in any order), accesses, removes and rounds against a brute-force model:
    each proposal is the least recently used resident key with no resident child."""
    rng = random.Random(seed)
    n = 40
    parent_of = {i: (K(rng.randrange(1, i)) if i > 1 and rng.random() < 0.8 else NO_PARENT) for i in range(1, n + 1)}
    p = PrefixAwareLRUPolicy()
    last: dict[int, int] = {}  # resident key -> model tick
    tick = 0

    def leaves(exclude: set[int]) -> list[int]:
        parents = {name(parent_of[i]) for i in last if parent_of[i] != NO_PARENT}
        return sorted((i for i in last if i not in parents and i not in exclude), key=last.__getitem__)

    for _ in range(500):
        op = rng.random()
        i = rng.randint(1, n)
        if op < 0.45:
            p.insert(K(i), parent_of[i], 1)
            tick += 1
            last[i] = tick
        elif op < 0.7:
            p.access(K(i))
            if i in last:
                tick += 1
                last[i] = tick
        elif op < 0.8:
            p.remove(K(i))
            last.pop(i, None)
        else:
            skipped: set[int] = set()
            stop = rng.choice([None, rng.randint(1, 8)])
            count = 0
            for k in p.victims():
                expect = leaves(skipped)
                assert expect and name(k) == expect[0]
                count += 1
                if rng.random() < 0.4:
                    skipped.add(name(k))
                else:
                    p.remove(k)
                    del last[name(k)]
                if stop is not None and count >= stop:
                    break
            else:
                assert leaves(skipped) == []
        assert len(p) == len(last)
        assert all(K(j) in p for j in last)
        assert proposals(p) == leaves(set())


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_insert_many_orders_victims_as_one_insert_each(name: str) -> None:
    """Issue 15 #3: a tier's open inserts every stored block in one call; the policy must
    end as one ``insert`` each would leave it (same victims, same order)."""
    import random

    rng = random.Random(7)
    keys = [ChunkKey(bytes([i % 251, i // 251]) + bytes(14)) for i in range(600)]
    items = [
        (k, NO_PARENT if i % 40 == 0 else keys[i - 1 - rng.randrange(min(i % 40, 3))], 4096) for i, k in enumerate(keys)
    ]
    items += [items[5], items[77]]  # a key inserted again is touched
    one, many = POLICIES[name](), POLICIES[name]()
    for k, p, s in items:
        one.insert(k, p, s)
    many.insert_many(items)
    assert len(one) == len(many) == len(keys)
    assert list(one.victims()) == list(many.victims())

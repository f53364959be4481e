"""Rendezvous (highest-random-weight) placement: which nodes own a chunk key.

Pure functions, no state.  The weight of node ``n`` for key ``k`` is::

    weight(n, k) = xxh3_64(k, seed=xxh3_64(n.node_id as UTF-8))

and a key's owners are the ``r`` nodes with the highest weights (ties, which need a
64-bit collision, go to the smaller node id).  Every client and node computes the same
owners from the same membership, with no metadata hop; when a node joins or leaves only
the keys it wins or held move (about 1/N of them).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import xxhash


def node_seed(node_id: str) -> int:
    """The per-node hash seed (a pure function of the node id)."""
    return xxhash.xxh3_64_intdigest(node_id.encode())


def weight(node_id: str, key: bytes) -> int:
    return xxhash.xxh3_64_intdigest(key, seed=node_seed(node_id))


class Ring:
    """Precomputed seeds for one membership snapshot; ``ranked``/``owners`` per key.

    Immutable after construction, so one instance is shared by threads.
    """

    __slots__ = ("nodes", "_seeds")

    def __init__(self, nodes: Iterable[str]) -> None:
        self.nodes: tuple[str, ...] = tuple(sorted(set(nodes)))
        self._seeds = [(node_seed(n), n) for n in self.nodes]

    def __len__(self) -> int:
        return len(self.nodes)

    def ranked(self, key: bytes) -> list[str]:
        """Every node, best owner first."""
        h = xxhash.xxh3_64_intdigest
        scored = sorted(((-h(key, seed=s), n) for s, n in self._seeds))
        return [n for _, n in scored]

    def owners(self, key: bytes, r: int) -> list[str]:
        """The top ``r`` nodes for ``key`` (fewer when the cluster is smaller)."""
        return self.ranked(key)[: max(0, r)]


def owners(key: bytes, nodes: Sequence[str], r: int) -> list[str]:
    """The top ``r`` of ``nodes`` for ``key``, best first."""
    return Ring(nodes).owners(key, r)

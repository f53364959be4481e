"""Typed views of what ``Stats`` answers.

:class:`Counters` is the ``"counters"`` entry of ``KVClient.stats()``: a ``dict`` (so it
prints and serialises as before) whose ``counters["name"]`` reads 0 for a counter the node
has not counted yet and raises ``KeyError`` for a name no node reports (a misspelling),
instead of every reader writing ``.get("name", 0)`` and a misspelt name reading 0 forever.
Owns no state beyond the snapshot it holds.
"""

from __future__ import annotations

from kvstore.vocabulary import NODE_COUNTERS


class Counters(dict[str, int]):
    """A node's counters by name (a snapshot)."""

    __slots__ = ()

    def __missing__(self, name: str) -> int:
        if name in NODE_COUNTERS:
            return 0  # known, not counted yet
        raise KeyError(f"no node counter named {name!r} (known: {', '.join(sorted(NODE_COUNTERS))})")

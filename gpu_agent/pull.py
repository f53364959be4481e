"""Fetch chunks this machine's node lacks from another node (or a cluster) into it.

The GPU agent loads only from the node on its own machine (its shared-memory arena).
When a lookup through another target (an ``etcd://`` cluster, a peer) found chunks the
local node does not hold, :func:`pull_missing` gets them over TCP (the SDK verifies each
block's checksum end to end) and puts them into the local node, so the load that
follows is zero-copy.  A chunk that cannot be fetched stays missing: the load stops
before it and the engine recomputes from there.  Bounded by the clients' deadlines.
"""

from __future__ import annotations

from typing import Any

from kvstore.keys import ChunkKey, Namespace, parent_keys


def pull_missing(local: Any, remote: Any, chain: list[ChunkKey], first: int, namespace: Namespace, chunk: int) -> int:
    """Put into ``local`` the chunks ``chain[first:]`` it lacks, read from ``remote``.

    ``chain`` is the whole key chain (its parents are stored with each block).  Returns the
    number of blocks put; raises the clients' errors (the caller fails open)."""
    keys = chain[first:]
    if not keys:
        return 0
    missing = [i for i, t in enumerate(local.lookup(keys)) if t is None]
    if not missing:
        return 0
    got = remote.get_many([keys[i] for i in missing])
    parents = parent_keys(chain)[first:]
    have = [(keys[i], parents[i], d) for i, d in zip(missing, got) if d is not None]
    if not have:
        return 0
    ok = local.put_many(
        [k for k, _, _ in have],
        [d for _, _, d in have],
        namespace=namespace,
        parents=[p for _, p, _ in have],
        token_counts=[chunk] * len(have),
    )
    return int(sum(ok))

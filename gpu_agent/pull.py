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


def pull_missing(
    local: Any, remote: Any, chain: list[ChunkKey], first: int, namespace: Namespace, chunk: int, tail_tokens: int = 0
) -> int:
    """Put into ``local`` the chunks ``chain[first:]`` it lacks, read from ``remote``.

    ``chain`` is the whole key chain (its parents are stored with each block); with
    ``tail_tokens`` its last key is a trailing partial chunk of that many tokens.  Returns
    the number of blocks put; raises the clients' errors (the caller fails open)."""
    keys = chain[first:]
    if not keys:
        return 0
    missing = [i for i, t in enumerate(local.lookup(keys)) if t is None]
    if not missing:
        return 0
    got = remote.get_many([keys[i] for i in missing])
    parents = parent_keys(chain)[first:]
    counts = [chunk] * len(chain)
    if tail_tokens and counts:
        counts[-1] = tail_tokens
    have = [(keys[i], parents[i], d, counts[first + i]) for i, d in zip(missing, got) if d is not None]
    if not have:
        return 0
    ok = local.put_many(
        [h[0] for h in have],
        [h[2] for h in have],
        namespace=namespace,
        parents=[h[1] for h in have],
        token_counts=[h[3] for h in have],
    )
    return int(sum(ok))

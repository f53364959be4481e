"""The benchmark's own node: a private ``kvstore serve`` child (used by the SDK paths of
``kvstore bench`` and by its TLS path).  Owns nothing beyond the child it returns; the
caller stops it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from kvstore.children import ServeProcess
from kvstore.errors import Unavailable


def private_node(dram: int, workdir: Path, *, extra: Sequence[str] = (), tag: str = "") -> ServeProcess:
    """A ``kvstore serve`` child on free ports with its data dir under ``workdir``; ``stop`` ends it."""
    suffix = f"-{tag}" if tag else ""  # a second node of the same run (the tls path's)
    arena = Path("/dev/shm") / f"kvstore-bench-{os.getpid()}-{workdir.name[-8:]}{suffix}.arena"
    node = ServeProcess(
        workdir / f"node{suffix}",
        "--listen",
        "127.0.0.1:0",
        "--dram",
        str(dram),
        "--nvme",
        "0",
        "--log-level",
        "WARNING",
        *extra,
        node_id=f"bench-{os.getpid()}{suffix}",
        arena_path=str(arena),
    )
    try:
        return node.start(timeout=120)
    except RuntimeError as e:
        raise Unavailable(f"the benchmark's node did not start: {e}") from None

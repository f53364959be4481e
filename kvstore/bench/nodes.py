"""The benchmark's own node: :func:`kvstore.children.private_node` with the benchmark's names
(node id ``bench-<pid>``, an arena file of this run), used by the SDK paths of
``kvstore bench``, by its TLS path and by the index benchmark.  Owns nothing beyond the
child it returns; the caller stops it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from kvstore import children
from kvstore.children import NodeStartError, ServeProcess
from kvstore.errors import Unavailable


def bench_node(
    dram: int | str,
    workdir: Path,
    *,
    nvme: int | str = 0,
    extra: Sequence[str] = (),
    tag: str = "",
    timeout: float = 120.0,
) -> ServeProcess:
    """A started ``kvstore serve`` child on free ports with its data dir under ``workdir``
    (``node``, or ``node-<tag>`` for a second node of the same run); ``stop`` ends it.  One
    that does not start raises ``Unavailable`` with its output."""
    suffix = f"-{tag}" if tag else ""
    arena = Path("/dev/shm") / f"kvstore-bench-{os.getpid()}-{workdir.name[-8:]}{suffix}.arena"
    try:
        return children.private_node(
            workdir / f"node{suffix}",
            *extra,
            node_id=f"bench-{os.getpid()}{suffix}",
            dram=dram,
            nvme=nvme,
            arena_path=str(arena),
            timeout=timeout,
        )
    except NodeStartError as e:
        raise Unavailable(f"the benchmark's node did not start: {e}") from None


private_node = bench_node  # its earlier name, which the sdk, latency and tls benchmarks import

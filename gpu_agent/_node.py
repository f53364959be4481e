"""A private ``kvstore serve`` child process for the demo and the benchmark.

Free ports, a data directory and an arena file of its own; ``restart()`` stops it with
SIGTERM (which demotes dirty DRAM blocks to NVMe) and starts it again on the same data
directory, so every block then comes back from NVMe.  Owned by the process that made it;
it dies with that process (:mod:`kvstore.children`).
"""

from __future__ import annotations

import uuid
from pathlib import Path

from kvstore.children import ServeProcess


class PrivateNode(ServeProcess):
    def __init__(
        self, data_dir: Path, *, dram: str = "256MiB", nvme: str = "512MiB", extra: tuple[str, ...] = ()
    ) -> None:
        node_id = f"demo-{uuid.uuid4().hex[:8]}"
        super().__init__(
            data_dir,
            "--listen",
            "127.0.0.1:0",
            "--log-level",
            "WARNING",
            "--dram",
            dram,
            "--nvme",
            nvme,
            *extra,
            node_id=node_id,
            arena_path=f"/dev/shm/kvstore-{node_id}.arena",
        )

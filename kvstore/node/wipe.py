"""``kvstore wipe``: remove a stopped node's data, so its next start is empty.

What a node keeps: its data directory (``data_dir``: the NVMe tier's segments and index,
``owners.lmdb`` with tenants, ``node.lock``, the Unix socket) and its DRAM arena file in
``/dev/shm`` (``arena_path``; removed when a node stops, left by one that was killed).
The same settings as ``kvstore serve`` say which node (``--config``, ``KVSTORE_*``,
``--data-dir``, ``--node-id``, ``--arena-path``).  Refused while a node runs on that data
directory (it holds the directory's lock).  Without ``--yes`` it only lists what it would remove.
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

from kvstore.errors import InvalidArgument


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="the node's TOML config file (as for `kvstore serve`)")
    p.add_argument("--data-dir", metavar="DIR", help="the node's data directory (default ~/.local/share/kvstore)")
    p.add_argument("--node-id", metavar="ID", help="the node's id (default: hostname): names its default arena file")
    p.add_argument("--arena-path", metavar="PATH", help="its arena file, if it was started with --arena-path")
    p.add_argument("--yes", action="store_true", help="remove them (without it: only list what would be removed)")


def targets(data_dir: Path, arena: Path) -> list[Path]:
    """What wiping removes, of what exists: the data directory and the arena file."""
    return [p for p in (data_dir, arena) if p.exists()]


def main(a: argparse.Namespace) -> int:
    from kvstore.errors import DataDirLocked
    from kvstore.node.config import load_config
    from kvstore.node.server import lock_data_dir

    cfg = load_config(a.config, overrides={"data_dir": a.data_dir, "node_id": a.node_id, "arena_path": a.arena_path})
    data_dir, arena = Path(cfg.data_dir), cfg.arena_file()
    found = targets(data_dir, arena)
    if not found:
        print(f"nothing to wipe: neither {data_dir} nor {arena} exists")
        return 0
    if data_dir.exists():
        try:
            fd = lock_data_dir(data_dir)  # a running node holds it: never wipe under a node
        except DataDirLocked as e:
            raise InvalidArgument(f"{e}: stop it first (SIGTERM), then wipe") from None
        os.close(fd)
    for p in found:
        print(("removing " if a.yes else "would remove ") + str(p) + ("/" if p.is_dir() else ""))
    if not a.yes:
        print("pass --yes to remove them")
        return 1
    for p in found:
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink(missing_ok=True)
    return 0

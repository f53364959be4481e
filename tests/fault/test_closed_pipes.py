"""A node whose output pipe has closed (issue 13, item 7).

``kvstore serve ... | head -1``, or a parent or log collector that died: the node's stdout
and stderr lead nowhere.  What must hold on SIGTERM: the drain, the demotion of dirty
blocks and the index flush all run (every committed block is there after a restart), the
exit status is 0, and the arena file is gone from ``/dev/shm``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

from conftest import ROOT, clean_env, start_clean, stop_clean

from client import KVClient

BLOCKS = 10


def test_sigterm_with_closed_stdout_and_stderr_flushes_exits_0_and_unlinks_the_arena(tmp_path: Path) -> None:
    data_dir = tmp_path / "node"
    arena = Path(f"/dev/shm/kvstore-test-pipe-{uuid.uuid4().hex[:8]}.arena")
    cmd = [
        sys.executable,
        "-m",
        "kvstore",
        "serve",
        "--data-dir",
        str(data_dir),
        "--listen",
        "127.0.0.1:0",
        "--dram",
        "64MiB",
        "--nvme",
        "256MiB",
        "--arena-path",
        str(arena),
        "--log-level",
        "INFO",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT, env=clean_env())
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # like `head`: read what we want, then go away
            if line.startswith(b"READY "):
                break
        else:
            raise AssertionError(f"no READY line (rc={proc.wait(30)})")
        proc.stdout.close()  # the node's stdout and stderr now lead nowhere
        blocks = {os.urandom(16): os.urandom(100_000) for _ in range(BLOCKS)}
        with KVClient(f"unix://{data_dir / 'kvstore.sock'}") as kv:
            for k, v in blocks.items():
                assert kv.put(k, v)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, "a stop with a closed output pipe must exit 0"
        assert not arena.exists(), "the stopped node left its arena in /dev/shm"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        arena.unlink(missing_ok=True)
    node = start_clean(data_dir, "--dram", "64MiB", "--nvme", "256MiB")  # the DRAM tier starts empty: all from NVMe
    try:
        with KVClient(node.unix) as kv:
            assert [kv.get(k) for k in blocks] == list(blocks.values()), "committed blocks were lost on the stop"
    finally:
        stop_clean(node)

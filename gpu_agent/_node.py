"""A private ``kvstore serve`` child process for the demo and the benchmark.

Free ports, a data directory and an arena file of its own; ``restart()`` stops it with
SIGTERM (which demotes dirty DRAM blocks to NVMe) and starts it again on the same data
directory, so every block then comes back from NVMe.  Owned by the process that made it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any


class PrivateNode:
    def __init__(self, data_dir: Path, *, dram: str = "256MiB", nvme: str = "512MiB", extra: tuple[str, ...] = ()) -> None:
        self.data_dir = Path(data_dir)
        self.node_id = f"demo-{uuid.uuid4().hex[:8]}"
        self.arena_path = f"/dev/shm/kvstore-{self.node_id}.arena"
        self.args = ["--dram", dram, "--nvme", nvme, *extra]
        self.proc: subprocess.Popen[str] | None = None
        self.endpoints: dict[str, Any] = {}
        self.output: list[str] = []

    @property
    def target(self) -> str:
        return str(self.endpoints["unix"])

    def start(self, timeout: float = 60.0) -> "PrivateNode":
        cmd = [
            sys.executable, "-m", "kvstore", "serve",
            "--data-dir", str(self.data_dir), "--listen", "127.0.0.1:0",
            "--node-id", self.node_id, "--arena-path", self.arena_path, "--log-level", "WARNING",
            *self.args,
        ]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"kvstore node exited before READY (rc={self.proc.wait()}):\n{''.join(self.output)}")
            self.output.append(line)
            if line.startswith("READY "):
                self.endpoints = json.loads(line[len("READY "):])
                threading.Thread(target=self._drain, args=(self.proc,), daemon=True).start()
                return self
        self.stop()
        raise RuntimeError(f"kvstore node did not become ready in {timeout:.0f} s:\n{''.join(self.output)}")

    def _drain(self, proc: "subprocess.Popen[str]") -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.output.append(line)

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def restart(self) -> "PrivateNode":
        rc = self.stop()
        if rc != 0:
            raise RuntimeError(f"kvstore node exited with {rc} on SIGTERM:\n{''.join(self.output[-20:])}")
        return self.start()

    def close(self) -> None:
        self.stop()
        try:
            os.unlink(self.arena_path)
        except FileNotFoundError:
            pass

    def __enter__(self) -> "PrivateNode":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

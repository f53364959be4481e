"""Shared fixtures: real node processes on free ports in temporary directories."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


def wait_for(pred: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    """Poll ``pred`` until it returns something truthy (returned), or fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without ``KVSTORE_*`` settings (a node reads only its flags), unbuffered."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def start_clean(
    data_dir: Path,
    *args: str,
    node_id: str | None = None,
    prefix: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> NodeProcess:
    """A node started with ``args`` in :func:`clean_env` (plus ``env``), after ``prefix`` (see :class:`NodeProcess`)."""
    n = NodeProcess(data_dir, *args, node_id=node_id, prefix=prefix)
    n.env = clean_env(**(env or {}))
    return n.start()


def stop_clean(n: NodeProcess) -> None:
    """Stop ``n`` (it must exit 0) and remove its arena file."""
    assert n.stop(timeout=30) == 0
    Path(n.arena_path).unlink(missing_ok=True)


class FakeClock:
    """A monotonic clock the test moves by hand (``advance``), for TierManager scenarios."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


class NodeProcess:
    """A ``kvstore serve`` child process.  ``endpoints`` is its READY line.

    ``prefix`` goes before the command line (``ip netns exec NS``: it execs, so the PID
    stays the node's); ``listen`` is the gRPC listener."""

    def __init__(
        self,
        data_dir: Path,
        *args: str,
        env: dict[str, str] | None = None,
        node_id: str | None = None,
        prefix: Sequence[str] = (),
        listen: str = "127.0.0.1:0",
    ) -> None:
        self.data_dir = data_dir
        self.prefix = list(prefix)
        self.listen = listen
        self.node_id = node_id or f"t{uuid.uuid4().hex[:8]}"
        self.arena_path = f"/dev/shm/kvstore-test-{self.node_id}-{uuid.uuid4().hex[:6]}.arena"
        self.args = list(args)
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc: subprocess.Popen[str] | None = None
        self.endpoints: dict[str, Any] = {}
        self.output: list[str] = []

    def start(self, timeout: float = 60.0) -> NodeProcess:
        cmd = [
            *self.prefix,
            sys.executable,
            "-m",
            "kvstore",
            "serve",
            "--data-dir",
            str(self.data_dir),
            "--listen",
            self.listen,
            "--node-id",
            self.node_id,
            "--arena-path",
            self.arena_path,
            *self.args,
        ]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=self.env, cwd=ROOT
        )
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"node exited before READY (rc={self.proc.wait()}):\n{''.join(self.output)}")
            self.output.append(line)
            if line.startswith("READY "):
                self.endpoints = json.loads(line[len("READY ") :])
                # keep draining output so the child never blocks on a full pipe
                import threading

                threading.Thread(target=self._drain, daemon=True).start()
                return self
        raise RuntimeError(f"node did not become ready in {timeout} s:\n{''.join(self.output)}")

    def _drain(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)

    @property
    def unix(self) -> str:
        return self.endpoints["unix"]

    @property
    def tcp(self) -> str:
        return self.endpoints["grpc"]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def node_factory(tmp_path: Path) -> Iterator[Any]:
    """Start nodes with ``node_factory(*extra_args, data_dir=..., env=...)``; all are stopped at teardown."""
    nodes: list[NodeProcess] = []

    def make(
        *args: str, data_dir: Path | None = None, env: dict[str, str] | None = None, node_id: str | None = None
    ) -> NodeProcess:
        d = data_dir or tmp_path / f"node{len(nodes)}"
        n = NodeProcess(d, *args, env=env, node_id=node_id).start()
        nodes.append(n)
        return n

    yield make
    for n in nodes:
        n.stop(timeout=30)
        try:
            os.unlink(n.arena_path)
        except FileNotFoundError:
            pass


@pytest.fixture
def node(node_factory: Any) -> NodeProcess:
    """One node: 256 MiB DRAM, 512 MiB NVMe."""
    return node_factory("--dram", "256MiB", "--nvme", "512MiB")

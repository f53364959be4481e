"""A private single-member etcd on free loopback ports: for ``kvstore up`` and tests.

Owns one child process (``etcd``, dying with its parent: :mod:`kvstore.children`) and its data directory.  ``stop`` ends it by its PID
and waits; ``start`` again reuses the same ports and data (an etcd outage and its
return), unless ``wipe=True`` (an etcd that lost its state).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from kvstore import children
from kvstore.errors import InvalidArgument, Unavailable

ETCD_HINT = (
    "etcd is not installed: install Debian's `etcd-server` package (apt-get install etcd-server) or put `etcd` on PATH"
)


def find_etcd(binary: str | None = None) -> str | None:
    """Path of the ``etcd`` server binary, or None."""
    if binary:
        return binary if os.access(binary, os.X_OK) else shutil.which(binary)
    return shutil.which("etcd") or next(
        (p for p in ("/usr/bin/etcd", "/usr/local/bin/etcd") if os.access(p, os.X_OK)), None
    )


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the kernel's pick; free until something binds it).

    The project's one such helper: etcd's ports here, the benchmarks' reference servers
    (``kvstore/bench/refs.py``) and serving fleet (``kvstore/bench/serving/fleet.py``).
    It lives in this light module (no ``aetcd``), which the tool layers above may import."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class LocalEtcd:
    def __init__(
        self,
        data_dir: Path,
        *,
        host: str = "127.0.0.1",
        binary: str | None = None,
        name: str = "kvstore",
        nice: int = 0,
    ) -> None:
        exe = find_etcd(binary)
        if exe is None:
            raise InvalidArgument(ETCD_HINT)
        self.exe = exe
        self.data_dir = Path(data_dir)
        self.host = host
        self.name = name
        children.nice_prefix(nice)  # a bad value is refused here, not at start
        self.nice = nice  # etcd's nice value (kvstore.children.nice_prefix), set at exec
        self.client_port = free_port(host)
        self.peer_port = free_port(host)
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: object = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, *, wipe: bool = False, timeout: float = 30.0) -> LocalEtcd:
        if self.running():
            return self
        member_dir = self.data_dir / "member-data"
        if wipe:
            shutil.rmtree(member_dir, ignore_errors=True)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        client = f"http://{self.host}:{self.client_port}"
        peer = f"http://{self.host}:{self.peer_port}"
        cmd = [
            *children.nice_prefix(self.nice),
            self.exe,
            "--name",
            self.name,
            "--data-dir",
            str(member_dir),
            "--listen-client-urls",
            client,
            "--advertise-client-urls",
            client,
            "--listen-peer-urls",
            peer,
            "--initial-advertise-peer-urls",
            peer,
            "--initial-cluster",
            f"{self.name}={peer}",
            "--initial-cluster-state",
            "new",
            "--initial-cluster-token",
            f"kvstore-{self.client_port}",
            # small and quick: this etcd holds a handful of keys
            "--heartbeat-interval",
            "100",
            "--election-timeout",
            "1000",
            "--quota-backend-bytes",
            str(256 << 20),
            "--log-level",
            "warn",
        ]
        self._log = open(self.data_dir / "etcd.log", "ab")
        # its own session, so a Ctrl-C aimed at our foreground group does not reach it first; and it dies with us
        self.proc = children.spawn(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise Unavailable(f"etcd exited at start (rc={self.proc.returncode}); see {self.data_dir / 'etcd.log'}")
            if self._healthy():
                return self
            time.sleep(0.05)
        self.stop()
        raise Unavailable(f"etcd did not become healthy within {timeout} s; see {self.data_dir / 'etcd.log'}")

    def _healthy(self) -> bool:
        from kvstore.cluster.etcd import healthy

        return healthy(self.host, self.client_port)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> None:
        proc, self.proc = self.proc, None
        children.stop(proc, timeout=timeout, sig=sig)
        if self._log is not None:
            self._log.close()  # type: ignore[attr-defined]
            self._log = None

    def __enter__(self) -> LocalEtcd:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

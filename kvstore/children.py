"""Child processes the project starts: they die with their parent and leave nothing behind.

Every long-lived child (a private ``kvstore serve``, ``redis-server``, ``etcd``, a demo
worker, a benchmark peer) is started by :func:`spawn`:

* in a session of its own, so a Ctrl-C at the terminal reaches only the parent, which stops
  its children in order (a node deregisters, drains and flushes before etcd goes);
* with ``PR_SET_PDEATHSIG``: the kernel sends it SIGTERM when the parent dies, however it
  dies (SIGKILL included).  The child sets it itself, in a small trampoline that then execs
  the command: none of the parent's Python runs between fork and exec.  A ``kvstore serve`` answers SIGTERM with its graceful stop, which
  unlinks its arena.  The signal follows the *thread* that forked: spawn from the main
  thread, or from one that lives as long as the child.

:func:`stop` ends a child (SIGTERM, then SIGKILL after a timeout).  :func:`exit_on_sigterm`
turns the parent's own SIGTERM into ``SystemExit``, so its ``finally`` blocks (children
stopped, temporary directories removed) run instead of the process vanishing where it stands.
:class:`ServeProcess` is the one private ``kvstore serve`` child: spawned, read up to its
READY line, stopped, restarted; once it has exited, however, its arena file is reclaimed.

Owner: the process (and, for PDEATHSIG, the thread) that spawned a child owns it.  A
ServeProcess's ``output`` is appended by its one reader thread and only read elsewhere.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from tiers.arena import Arena

PR_SET_PDEATHSIG = 1

# What a child runs first, in a fresh interpreter, before it execs the command (argv: the
# parent's pid, the program, the command line).  Not a ``preexec_fn``: that runs the
# parent's Python in the forked child, with its at-fork handlers (gRPC's among them), and in
# a parent whose gRPC threads are busy about 1 child in 150 died of SIGABRT before exec.
_TRAMPOLINE = """\
import ctypes, os, signal, sys
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
if os.getppid() != int(sys.argv[1]):  # the parent died before prctl took effect: nobody will send the signal
    os.kill(os.getpid(), signal.SIGTERM)
os.execv(sys.argv[2], sys.argv[3:])
"""


def spawn(cmd: Sequence[str], **popen: Any) -> subprocess.Popen[Any]:
    """``subprocess.Popen(cmd, **popen)`` in a new session, dying with this process (stdin: /dev/null
    unless given).  The child asks for ``PR_SET_PDEATHSIG`` (SIGTERM) itself and then execs
    ``cmd``, keeping its PID; a program that is not found raises ``FileNotFoundError`` here, as
    with Popen."""
    cmd = list(cmd)
    exe = cmd[0] if os.sep in cmd[0] else shutil.which(cmd[0], path=(popen.get("env") or os.environ).get("PATH"))
    if exe is None:
        raise FileNotFoundError(errno.ENOENT, f"No such file or directory: {cmd[0]!r}")
    popen.setdefault("stdin", subprocess.DEVNULL)
    if sys.platform != "linux":
        return subprocess.Popen(cmd, start_new_session=True, **popen)
    return subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", _TRAMPOLINE, str(os.getpid()), exe, *cmd], start_new_session=True, **popen
    )


def stop(proc: subprocess.Popen[Any] | None, *, timeout: float = 30.0, sig: int = signal.SIGTERM) -> int | None:
    """Send ``sig`` to a running child and wait up to ``timeout`` s, then SIGKILL it.  Its exit status."""
    if proc is None:
        return None
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def exit_on_sigterm() -> None:
    """From now on SIGTERM raises ``SystemExit(143)`` in the main thread, which unwinds it
    (``finally`` blocks and context managers stop children and remove temporary files)."""

    def _exit(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)


class ServeProcess:
    """A private ``kvstore serve`` child.  ``endpoints`` is its READY line, ``output`` what it printed
    (also appended to ``log_path`` if given).

    ``spawn`` forks (call it from a thread that outlives the child: see the module docstring);
    ``wait_ready`` reads up to READY, then a thread keeps reading so the child never blocks on
    a full pipe; ``start`` is both.  ``stop`` (SIGTERM: drain, demote, flush) waits, kills if
    it must, and reclaims the arena file the child may have left."""

    def __init__(
        self,
        data_dir: Path,
        *args: str,
        node_id: str | None = None,
        arena_path: str | None = None,
        env: Mapping[str, str] | None = None,
        log_path: Path | None = None,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.node_id = node_id
        self.arena_path = arena_path
        self.cmd = [
            sys.executable,
            "-m",
            "kvstore",
            "serve",
            "--data-dir",
            str(self.data_dir),
            *(["--node-id", node_id] if node_id else []),
            *(["--arena-path", arena_path] if arena_path else []),
            *args,
        ]
        self.env = {**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"}
        self.log_path = log_path
        self.proc: subprocess.Popen[str] | None = None
        self.endpoints: dict[str, Any] = {}
        self.output: list[str] = []
        self._log: IO[str] | None = None

    @property
    def target(self) -> str:
        """The node's Unix-socket target."""
        return str(self.endpoints["unix"])

    def spawn(self) -> ServeProcess:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self.log_path is not None and self._log is None:
            self._log = open(self.log_path, "a")
        self.endpoints = {}
        self.proc = spawn(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=self.env)
        return self

    def wait_ready(self, timeout: float = 60.0) -> ServeProcess:
        """Read output up to the READY line; raise ``RuntimeError`` (with the output) if the node
        exits first or is not ready within ``timeout`` s (then it is stopped)."""
        assert self.proc is not None and self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        timer = threading.Timer(timeout, self._kill_if_not_ready)  # a silent, stuck child would block readline
        timer.daemon = True
        timer.start()
        try:
            for line in self.proc.stdout:
                self._keep(line)
                if line.startswith("READY "):
                    self.endpoints = json.loads(line[len("READY ") :])
                    threading.Thread(target=self._drain, args=(self.proc,), daemon=True).start()
                    return self
                if time.monotonic() > deadline:
                    break
        finally:
            timer.cancel()
        rc = self.stop(timeout=10)
        raise RuntimeError(
            f"kvstore node {self.node_id or self.data_dir} did not become ready (rc={rc}):\n"
            + "".join(self.output[-30:])
        )

    def start(self, timeout: float = 60.0) -> ServeProcess:
        return self.spawn().wait_ready(timeout)

    def _kill_if_not_ready(self) -> None:
        if self.proc is not None and not self.endpoints and self.proc.poll() is None:
            self.proc.kill()

    def _keep(self, line: str) -> None:
        self.output.append(line)
        if self._log is not None:
            with contextlib.suppress(OSError, ValueError):
                self._log.write(line)
                self._log.flush()

    def _drain(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        with contextlib.suppress(OSError, ValueError):
            for line in proc.stdout:
                self._keep(line)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def terminate(self) -> None:
        """Ask the node to stop (SIGTERM) without waiting: stop several at once, then ``stop`` each."""
        if self.running():
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]

    def stop(self, timeout: float = 60.0) -> int:
        """Stop the node (SIGTERM; SIGKILL after ``timeout`` s) and reclaim its arena file.  Its exit status."""
        rc = stop(self.proc, timeout=timeout)
        arena = self.endpoints.get("arena") or self.arena_path
        if arena and self.proc is not None:
            Arena.reclaim_stale([Path(arena)], min_age_s=0)  # a node killed before its own stop left it
        return rc if rc is not None else 0

    def restart(self, timeout: float = 60.0) -> ServeProcess:
        """Stop (it must exit 0: every dirty block demoted) and start again on the same data directory."""
        rc = self.stop()
        if rc != 0:
            raise RuntimeError(f"kvstore node exited with {rc} on SIGTERM:\n{''.join(self.output[-20:])}")
        return self.start(timeout)

    def close(self) -> None:
        self.stop()
        if self._log is not None:
            with contextlib.suppress(OSError):
                self._log.close()
            self._log = None

    def __enter__(self) -> ServeProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

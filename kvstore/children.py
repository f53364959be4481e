"""Child processes the project starts: they die with their parent and leave nothing behind.

Every long-lived child (a private ``kvstore serve``, ``redis-server``, ``etcd``, a demo
worker, a benchmark peer) is started by :func:`spawn`:

* in a session of its own, so a Ctrl-C at the terminal reaches only the parent, which stops
  its children in order (a node deregisters, drains and flushes before etcd goes);
* with ``PR_SET_PDEATHSIG``: the kernel sends it SIGTERM when the parent dies, however it
  dies (SIGKILL included).  The child sets it itself, in a small trampoline that then execs
  the command: none of the parent's Python runs between fork and exec.  A ``kvstore serve``
  answers SIGTERM with its graceful stop, which unlinks its arena.

The kernel ties that signal to the *thread* that forked, not to the process: a child forked
by a worker thread would get SIGTERM when that thread ends.  So :func:`spawn` forks in the
calling thread only when that is the main thread; any other thread hands the fork to one
long-lived forker thread (a daemon started on first use, per process), which ends only with
the process.  Either way a child lives as long as the process that started it, whichever
of its threads asked.

:func:`stop` ends a child (SIGTERM, then SIGKILL after a timeout).  :func:`exit_on_sigterm`
turns the parent's own SIGTERM into ``SystemExit``, so its ``finally`` blocks (children
stopped, temporary directories removed) run instead of the process vanishing where it stands.

:class:`ServeProcess` is the one private ``kvstore serve`` child: spawned, read up to its
READY line, stopped, restarted; once it has exited, however, its arena file is reclaimed
(unless another running node holds it).  :func:`private_node` is the one way to start one
(free ports, small tiers, quiet log): the demos, the benchmarks, ``kvstore up`` and the
tests' ``NodeProcess`` all go through ``ServeProcess``.  A node that does not start raises
:class:`NodeStartError` with what it printed.

Owner: the process that spawned a child owns it.  A ServeProcess's ``output`` is appended
by its one reader thread and only read elsewhere.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import IO, Any

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

_Job = tuple[Callable[[], "subprocess.Popen[Any]"], "Future[subprocess.Popen[Any]]"]
_forker_lock = threading.Lock()
_forker: tuple[int, queue.SimpleQueue[_Job]] | None = None  # (pid that started it, its jobs)


def _fork_loop(jobs: queue.SimpleQueue[_Job]) -> None:
    while True:
        fn, done = jobs.get()
        if done.set_running_or_notify_cancel():
            try:
                done.set_result(fn())
            except BaseException as e:  # handed to the thread that asked
                done.set_exception(e)


def _in_forker(fn: Callable[[], subprocess.Popen[Any]]) -> subprocess.Popen[Any]:
    """Run ``fn`` (a Popen) in this process's forker thread and return what it returns."""
    global _forker
    with _forker_lock:
        if _forker is None or _forker[0] != os.getpid():  # none yet, or inherited over a fork: it is not running
            jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
            threading.Thread(target=_fork_loop, args=(jobs,), name="kvstore-children-forker", daemon=True).start()
            _forker = (os.getpid(), jobs)
        jobs = _forker[1]
    done: Future[subprocess.Popen[Any]] = Future()
    jobs.put((fn, done))
    return done.result()


def nice_prefix(nice: int) -> list[str]:
    """The words that run a command at nice value ``nice`` (``nice -n N``; none for 0).

    Set as the program is exec'd, so every thread it ever starts inherits it (Linux keeps a
    nice value per thread; renicing a running process misses threads started meanwhile).
    A negative value needs privileges; without them ``nice`` warns and runs the program at
    its default priority."""
    if isinstance(nice, bool) or not isinstance(nice, int) or not -20 <= nice <= 19:
        raise ValueError(f"a nice value is an integer from -20 to 19, got {nice!r}")
    return ["nice", "-n", str(nice)] if nice else []


def spawn(cmd: Sequence[str], **popen: Any) -> subprocess.Popen[Any]:
    """``subprocess.Popen(cmd, **popen)`` in a new session, dying with this process (stdin: /dev/null
    unless given).  The child asks for ``PR_SET_PDEATHSIG`` (SIGTERM) itself and then execs
    ``cmd``, keeping its PID; a program that is not found raises ``FileNotFoundError`` here, as
    with Popen.  Safe from any thread: see the module docstring."""
    cmd = list(cmd)
    exe = cmd[0] if os.sep in cmd[0] else shutil.which(cmd[0], path=(popen.get("env") or os.environ).get("PATH"))
    if exe is None:
        raise FileNotFoundError(errno.ENOENT, f"No such file or directory: {cmd[0]!r}")
    popen.setdefault("stdin", subprocess.DEVNULL)
    if sys.platform != "linux":
        return subprocess.Popen(cmd, start_new_session=True, **popen)
    argv = [sys.executable, "-I", "-S", "-c", _TRAMPOLINE, str(os.getpid()), exe, *cmd]

    def fork() -> subprocess.Popen[Any]:
        return subprocess.Popen(argv, start_new_session=True, **popen)

    return fork() if threading.current_thread() is threading.main_thread() else _in_forker(fork)


def log_tail(path: Path | None, lines: int = 40) -> str:
    """The end of a child's log file, for an error message ("" when there is none)."""
    if path is None:
        return ""
    try:
        text = path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return ""
    return f"\n--- last {len(text)} lines of {path} ---\n" + "\n".join(text)


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


SHM = Path("/dev/shm")
VLLM_SHM_PREFIXES = ("psm_", "sem.mp-", "vllm_dist_")
"""What a vLLM server leaves in /dev/shm when it is killed rather than shut down: Python's
shared memory and semaphores (its message queues) and its CPU workers' tensor-parallel
buffers.  None is removed while any process still has it open or mapped."""


def shm_names() -> set[str]:
    """The entries of /dev/shm now (empty where there is none)."""
    try:
        return set(os.listdir(SHM))
    except OSError:
        return set()


def _held_shm() -> tuple[set[str], set[int]]:
    """What in /dev/shm some process has open or mapped (every process this one can read):
    the names, and the inodes.  A POSIX named semaphore (``sem.*``) is mapped under the
    temporary name glibc created it as (``/dev/shm/sem.XXXXXX (deleted)`` in
    ``/proc/PID/maps``) before linking it to its real name, so only its inode tells that a
    live process holds it."""
    held: set[str] = set()
    inodes: set[int] = set()
    prefix = str(SHM) + "/"
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith(prefix):
                        held.add(target[len(prefix) :].split(" ", 1)[0])
                        inodes.add(os.stat(f"/proc/{pid}/fd/{fd}").st_ino)
        with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as maps:
            for line in maps:
                at = line.find(prefix)
                if at >= 0:
                    held.add(line[at + len(prefix) :].rstrip("\n").split(" ", 1)[0])
                    fields = line.split(None, 5)
                    if len(fields) > 4 and fields[4].isdigit():
                        inodes.add(int(fields[4]))
    return held, inodes


VLLM_CPU_ENV = {"VLLM_USE_AOT_COMPILE": "0"}
"""Environment defaults for every CPU vLLM engine this project starts (a caller's own
setting wins).  vLLM 0.32 on the CPU saves its AOT-compiled model to its compile cache but
cannot load it back ("'function' object has no attribute 'finalize_loading'"), so every
start compiled the model again (15-25 s of CPU an engine here); with AOT compilation off
the engine compiles the same way (torch.compile, inductor, vLLM's default mode) through
the older cache, which loads: a repeated start takes about 4 s to warm up instead of 13-26.
"""


def reclaim_shm(before: set[str], prefixes: Sequence[str] = VLLM_SHM_PREFIXES) -> list[str]:
    """Unlink the /dev/shm entries named with one of ``prefixes`` that appeared since
    ``before`` (:func:`shm_names` taken before the children started) and that no process
    has open or mapped: what children killed mid-run left behind.  The names removed."""
    new = [n for n in shm_names() - before if n.startswith(tuple(prefixes))]
    if not new:
        return []
    held, inodes = _held_shm()
    gone = []
    for n in new:
        if n in held:
            continue
        with contextlib.suppress(FileNotFoundError):
            if (SHM / n).stat().st_ino in inodes:
                continue  # a semaphore some process has mapped (see _held_shm)
            (SHM / n).unlink()
            gone.append(n)
    return gone


def exit_on_sigterm() -> None:
    """From now on SIGTERM raises ``SystemExit(143)`` in the main thread, which unwinds it
    (``finally`` blocks and context managers stop children and remove temporary files)."""

    def _exit(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)


def reclaim_arena(path: str | os.PathLike[str]) -> bool:
    """Unlink a node's arena file unless a running node holds it (the node's ``flock`` on it,
    architecture §9): True if it was unlinked.  For a parent whose node child has exited; a
    node killed before its own stop could not unlink it.  (The node's own check before it
    creates an arena, ``tiers.arena``, is the same test; a shared root module does not import
    the node's tiers, hence these few lines here.)"""
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDWR)
    except OSError:  # no such file (the node unlinked it), or not ours to open
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False  # a running node holds it
    finally:
        os.close(fd)
    p.unlink(missing_ok=True)
    return True


class NodeStartError(RuntimeError):
    """A private ``kvstore serve`` exited, or was not ready in time, before its READY line
    (it has been stopped).  ``output`` is everything it printed; the message ends with the
    last of it."""

    def __init__(self, node: str, returncode: int | None, output: Sequence[str]) -> None:
        self.node = node
        self.returncode = returncode
        self.output = list(output)
        super().__init__(f"kvstore node {node} did not become ready (rc={returncode}):\n" + "".join(self.output[-30:]))


class ServeProcess:
    """A private ``kvstore serve`` child.  ``endpoints`` is its READY line, ``output`` what it printed
    (also appended to ``log_path`` if given).

    ``spawn`` forks (from any thread: see the module docstring); ``wait_ready`` reads up to
    READY, then a thread keeps reading so the child never blocks on a full pipe; ``start`` is
    both.  ``stop`` (SIGTERM: drain, demote, flush; or ``sig``) waits, kills if it must, and
    reclaims the arena file the child may have left.  As a context manager it starts (unless
    already spawned) and closes.  The command line is built at each spawn from the fields:
    ``listen`` (``--listen``), then ``args`` (later flags win); a subclass may wrap it
    (``command``)."""

    def __init__(
        self,
        data_dir: Path,
        *args: str,
        node_id: str | None = None,
        arena_path: str | None = None,
        env: Mapping[str, str] | None = None,
        log_path: Path | None = None,
        listen: str | None = None,
        cwd: Path | None = None,
        nice: int = 0,
    ) -> None:
        self.data_dir = Path(data_dir)
        nice_prefix(nice)  # a bad value is refused here, not at the first spawn
        self.nice = nice  # the child's nice value, set as it is exec'd (``nice -n``): every thread inherits it
        self.node_id = node_id
        self.arena_path = arena_path
        self.listen = listen
        self.args = list(args)
        self.env = {**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"}
        self.cwd = cwd
        self.log_path = log_path
        self.proc: subprocess.Popen[str] | None = None
        self.endpoints: dict[str, Any] = {}
        self.output: list[str] = []
        self._log: IO[str] | None = None

    def command(self) -> list[str]:
        """The command line the next ``spawn`` runs."""
        return [
            *nice_prefix(self.nice),
            sys.executable,
            "-m",
            "kvstore",
            "serve",
            "--data-dir",
            str(self.data_dir),
            *(["--node-id", self.node_id] if self.node_id else []),
            *(["--arena-path", self.arena_path] if self.arena_path else []),
            *(["--listen", self.listen] if self.listen else []),
            *self.args,
        ]

    @property
    def cmd(self) -> list[str]:
        return self.command()

    @property
    def target(self) -> str:
        """The node's Unix-socket target."""
        return str(self.endpoints["unix"])

    def spawn(self) -> ServeProcess:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self.log_path is not None and self._log is None:
            self._log = open(self.log_path, "a")
        self.endpoints = {}
        self.proc = spawn(
            self.command(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=self.env, cwd=self.cwd
        )
        return self

    def wait_ready(self, timeout: float = 60.0) -> ServeProcess:
        """Read output up to the READY line; raise :class:`NodeStartError` (with the output) if the
        node exits first or is not ready within ``timeout`` s (then it is stopped)."""
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
        raise NodeStartError(self.node_id or str(self.data_dir), rc, self.output)

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

    def stop(self, timeout: float = 60.0, *, sig: int = signal.SIGTERM) -> int:
        """Stop the node (``sig``; SIGKILL after ``timeout`` s) and reclaim its arena file.  Its exit
        status (0 if it was never started)."""
        rc = stop(self.proc, timeout=timeout, sig=sig)
        arena = self.endpoints.get("arena") or self.arena_path
        if arena and self.proc is not None:
            reclaim_arena(arena)  # a node killed before its own stop left it
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
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()


def private_node(
    data_dir: str | os.PathLike[str],
    *args: str,
    node_id: str | None = None,
    dram: str | int = "256MiB",
    nvme: str | int = "512MiB",
    listen: str = "127.0.0.1:0",
    log_level: str = "WARNING",
    arena_path: str | None = None,
    env: Mapping[str, str] | None = None,
    log_path: Path | None = None,
    timeout: float = 60.0,
    start: bool = True,
    nice: int = 0,
) -> ServeProcess:
    """A private ``kvstore serve``, started: READY, on free ports (``listen``), its data under
    ``data_dir``, ``dram`` / ``nvme`` tiers (sizes as the flags take them; ``nvme=0``: none),
    then ``args`` (which win over the above).  ``node_id`` defaults to ``private-<random>``,
    the arena file to the node's own default (unique per data directory).

    The caller owns it: ``close()`` it, or use it as a context manager
    (``with private_node(d) as node:``; entering does not start it again).  Started from any
    thread, it lives until it is stopped or this process ends.  If it does not start within
    ``timeout`` s it is stopped and :class:`NodeStartError` (a ``RuntimeError``) says why, with
    its output.  ``start=False``: not started yet (``spawn`` then ``wait_ready`` each of several
    to start them together).  ``nice``: the node's nice value (see :func:`nice_prefix`)."""
    node = ServeProcess(
        Path(data_dir),
        "--dram",
        str(dram),
        "--nvme",
        str(nvme),
        "--log-level",
        log_level,
        *args,
        node_id=node_id or f"private-{uuid.uuid4().hex[:8]}",
        arena_path=arena_path,
        env=env,
        log_path=log_path,
        listen=listen,
        nice=nice,
    )
    if not start:
        return node
    try:
        return node.start(timeout)
    except BaseException:
        node.close()
        raise

"""The one way to start a private node (``kvstore.children.private_node`` over ``ServeProcess``),
with real ``kvstore serve`` processes: a node started from a thread that then ends keeps
serving; ``stop`` reclaims the arena of a node that was killed, never a running node's; a
node that does not start raises with what it printed; the context manager closes it."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest
from conftest import wait_for

from client import KVClient
from kvstore.children import NodeStartError, ServeProcess, private_node, reclaim_arena

SMALL = {"dram": "16MiB", "nvme": "0"}
SIGTERM_BIT = 1 << (signal.SIGTERM - 1)


def pending_signals(pid: int) -> int:
    """The signals pending for process ``pid`` (its own and its main thread's), as a bit mask."""
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["ShdPnd"], 16) | int(fields["SigPnd"], 16)


def round_trip(node: ServeProcess, key: bytes) -> bytes | None:
    with KVClient(node.target) as kv:
        assert kv.put(key, key * 256)
        return kv.get(key)


def test_a_node_started_from_a_thread_that_ends_keeps_serving(tmp_path: Path) -> None:
    """PR_SET_PDEATHSIG follows the thread that forked: a node forked by this worker thread
    would be sent SIGTERM as the thread exits.  The node is stopped (SIGSTOP) before then, so
    such a SIGTERM would wait, pending, where this test can see it."""
    started: list[ServeProcess] = []
    release = threading.Event()

    def worker() -> None:
        started.append(private_node(tmp_path / "node", **SMALL))
        release.wait()

    t = threading.Thread(target=worker)
    t.start()
    wait_for(lambda: started or not t.is_alive(), 120, "the worker to start its node")
    assert started, "the node did not start"
    node = started[0]
    tid = t.native_id
    try:
        assert node.proc is not None
        os.kill(node.proc.pid, signal.SIGSTOP)
        release.set()
        t.join()
        wait_for(lambda: not os.path.exists(f"/proc/self/task/{tid}"), 30, "the worker thread to be gone")
        assert not pending_signals(node.proc.pid) & SIGTERM_BIT, "the worker thread's exit sent the node SIGTERM"
        os.kill(node.proc.pid, signal.SIGCONT)
        assert round_trip(node, b"t" * 16) == b"t" * 16 * 256
        assert node.running()
    finally:
        os.kill(node.proc.pid, signal.SIGCONT)  # type: ignore[union-attr]
        assert node.stop(timeout=30) == 0
        node.close()


def test_stop_reclaims_the_arena_of_a_killed_node_but_never_a_running_ones(tmp_path: Path) -> None:
    with private_node(tmp_path / "live", **SMALL) as live:
        live_arena = Path(live.endpoints["arena"])
        node = private_node(tmp_path / "killed", **SMALL)
        arena = Path(node.endpoints["arena"])
        assert node.proc is not None
        node.proc.kill()  # a crash: the node cannot unlink its own arena
        node.proc.wait()
        assert arena.exists()
        assert node.stop(timeout=30) == -signal.SIGKILL
        assert not arena.exists(), "stop left the killed node's arena"
        assert reclaim_arena(live_arena) is False and live_arena.exists(), "a running node's arena was reclaimed"
        assert round_trip(live, b"l" * 16) == b"l" * 16 * 256
    assert not live.running() and not live_arena.exists()


def test_a_node_that_does_not_start_raises_with_its_output(tmp_path: Path) -> None:
    with pytest.raises(NodeStartError) as ei:
        private_node(tmp_path / "node", "--max-batch", "0", node_id="bad-batch", **SMALL)
    e = ei.value
    assert isinstance(e, RuntimeError)  # what callers of ServeProcess.start caught before
    assert e.node == "bad-batch" and e.returncode not in (0, None)
    assert any("max_batch" in line for line in e.output), e.output
    assert "max_batch" in str(e)


def test_entering_a_started_node_does_not_start_it_again(tmp_path: Path) -> None:
    node = private_node(tmp_path / "node", **SMALL)
    assert node.proc is not None
    pid = node.proc.pid
    with node as same:
        assert same is node and node.proc.pid == pid
        assert round_trip(node, b"e" * 16) == b"e" * 16 * 256
    assert not node.running()
    assert node.proc.returncode == 0  # SIGTERM: a graceful stop


def test_sigusr1_writes_every_asyncio_task_and_the_node_serves_on(tmp_path: Path) -> None:
    """An operator's view of a node that does not stop or answer: SIGUSR1 writes each task
    with the awaits it waits in to the node's log (stderr), and changes nothing."""
    log = tmp_path / "node.log"
    with private_node(tmp_path / "n", nvme=0, log_path=log) as node:
        os.kill(node.proc.pid, signal.SIGUSR1)
        wait_for(lambda: "asyncio tasks (SIGUSR1)" in log.read_text(), 10.0, "the dump")
        wait_for(lambda: "kvstore/node/server.py" in log.read_text(), 10.0, "the serve task")
        text = log.read_text()
        assert "task Task-1:" in text and "in serve" in text, text[-2000:]
        with KVClient(node.target) as c:
            assert "counters" in c.stats()  # still serving


def _nice_of_every_thread(pid: int) -> set[int]:
    return {os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir(f"/proc/{pid}/task")}


def test_a_niced_node_runs_every_thread_at_its_nice_value_and_keeps_it_across_a_restart(tmp_path: Path) -> None:
    """``nice`` is set as the node is exec'd (``nice -n``), so threads it starts later
    (gRPC's, the movers') have it too; the PID is the node's own (signals reach it)."""
    with private_node(tmp_path / "n", nice=7, **SMALL) as node:
        assert node.proc is not None
        assert _nice_of_every_thread(node.proc.pid) == {7}
        assert round_trip(node, b"n" * 16) == b"n" * 16 * 256  # the threads a put starts are niced too
        assert _nice_of_every_thread(node.proc.pid) == {7}
        node.restart()
        assert _nice_of_every_thread(node.proc.pid) == {7}
    assert node.proc.returncode == 0  # SIGTERM reached the node itself, not a wrapper


@pytest.mark.parametrize("bad", [20, -21, True, 1.5])
def test_a_nice_value_out_of_range_is_refused_before_anything_starts(tmp_path: Path, bad: object) -> None:
    with pytest.raises(ValueError, match="nice value"):
        private_node(tmp_path / "n", nice=bad, **SMALL)  # type: ignore[arg-type]
    assert not (tmp_path / "n").exists()

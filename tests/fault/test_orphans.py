"""Child processes die with their parent and clean up (issue 13, item 8).

``kvstore bench``, ``kvstore up`` and the demo's private node (``gpu_agent._node``) start
``kvstore serve``, ``redis-server`` and ``etcd`` children.  Killed with SIGTERM or SIGKILL,
the parent takes them all with it (``kvstore.children``: PR_SET_PDEATHSIG); the nodes stop
gracefully and unlink their arenas.  A node that finds a dead node's arena of its own id
reclaims it; one a live node holds is never touched.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import ROOT, clean_env, start_clean, stop_clean, wait_for

from kvstore.cluster.local_etcd import find_etcd
from kvstore.node.config import NodeConfig


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def options(cmdline: list[str]) -> dict[str, str]:
    return {k: v for k, v in zip(cmdline, cmdline[1:]) if k.startswith("--")}


def arena_of(cmdline: list[str]) -> Path:
    """The arena file a ``kvstore serve`` command line names, or the default for its id and data dir."""
    opt = options(cmdline)
    if "--arena-path" in opt:
        return Path(opt["--arena-path"])
    return NodeConfig(node_id=opt["--node-id"], data_dir=opt["--data-dir"]).arena_file()


def kill_and_check(parent: subprocess.Popen[str], sig: int, children: list[psutil.Process]) -> None:
    arenas = [arena_of(c.cmdline()) for c in children if "serve" in c.cmdline()]
    assert arenas
    wait_for(lambda: all(a.exists() for a in arenas), 60, "the nodes to create their arenas")
    time.sleep(1.0)  # and to finish starting
    names = [(c.pid, " ".join(c.cmdline()[:4])) for c in children]
    parent.send_signal(sig)
    parent.wait(timeout=60)
    for pid, line in names:
        wait_for(lambda pid=pid: gone(pid), 30, f"{line} (pid {pid}) to die with its parent")
    for a in arenas:
        assert not a.exists(), f"{a} was left in /dev/shm"


def spawned(parent: subprocess.Popen[str], *names: str) -> list[psutil.Process]:
    """Wait until ``parent`` has a child whose command line contains each of ``names``; all its children."""

    def look() -> list[psutil.Process] | None:
        kids = psutil.Process(parent.pid).children()
        lines = [" ".join(k.cmdline()) for k in kids]
        return kids if all(any(n in line for line in lines) for n in names) else None

    return wait_for(look, 120, f"children {names} of pid {parent.pid}", interval=0.2)


def start_up(tmp_path: Path, nodes: int) -> subprocess.Popen[str]:
    """``kvstore up`` with ``nodes`` 16 MiB nodes, no NVMe and no dashboard, under ``tmp_path / "up"``."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvstore",
            "up",
            "--nodes",
            str(nodes),
            "--dram",
            "16MiB",
            "--nvme",
            "0",
            "--dashboard-port",
            "-1",
            "--data-dir",
            str(tmp_path / "up"),
        ],
        cwd=ROOT,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def up_ready(up: subprocess.Popen[str]) -> dict:
    """The JSON of ``up``'s ``READY`` line."""
    assert up.stdout is not None
    return next(json.loads(line[6:]) for line in up.stdout if line.startswith("READY "))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_bench_takes_its_node_and_redis_with_it(sig: int) -> None:
    redis = [] if Path("/usr/bin/redis-server").exists() else ["--redis-server", ""]
    bench = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvstore",
            "bench",
            "--quick",
            "--paths",
            "local",
            "--sizes",
            "4MiB",
            "--repeat",
            "1000",
            *redis,
        ],
        cwd=ROOT,
        env=clean_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        kids = spawned(bench, "kvstore serve", *(["redis-server"] if not redis else []))
        work = Path(options(next(k for k in kids if "serve" in k.cmdline()).cmdline())["--data-dir"]).parent
        kill_and_check(bench, sig, kids)
        if sig == signal.SIGTERM:  # a SIGTERM unwinds the bench: its temporary directory goes too
            assert not work.exists(), f"{work} was left behind"
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()


@pytest.mark.timeout(240)
@pytest.mark.skipif(find_etcd() is None, reason="needs etcd")
def test_up_killed_with_sigkill_takes_its_nodes_and_etcd_with_it(tmp_path: Path) -> None:
    up = start_up(tmp_path, 2)
    try:
        info = up_ready(up)
        assert up.stdout is not None
        up.stdout.close()
        kids = psutil.Process(up.pid).children()
        assert {k.pid for k in kids} == {info["etcd_pid"], *(n["pid"] for n in info["nodes"])}
        kill_and_check(up, signal.SIGKILL, kids)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()


@pytest.mark.timeout(240)
@pytest.mark.skipif(find_etcd() is None, reason="needs etcd")
def test_up_removes_the_arena_of_a_node_that_was_killed(tmp_path: Path) -> None:
    up = start_up(tmp_path, 1)
    try:
        info = up_ready(up)
        node = psutil.Process(info["nodes"][0]["pid"])
        arena = arena_of(node.cmdline())
        assert arena.exists()
        node.kill()  # SIGKILL: the node cannot unlink its own arena
        wait_for(lambda: gone(node.pid), 10, "the node to die")
        assert arena.exists()
        up.send_signal(signal.SIGTERM)
        up.communicate(timeout=60)
        assert up.returncode == 0
        assert not arena.exists(), f"kvstore up left the killed node's arena {arena}"
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()


@pytest.mark.timeout(120)
def test_demo_private_node_dies_with_its_parent(tmp_path: Path) -> None:
    code = (
        "import sys, time\nfrom kvstore.children import private_node\n"
        "n = private_node(sys.argv[1], dram='16MiB', nvme='0')\nprint(n.endpoints['pid'], flush=True)\ntime.sleep(600)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path / "node")],
        cwd=ROOT,
        env=clean_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert parent.stdout is not None
        pid = int(parent.stdout.readline())
        kill_and_check(parent, signal.SIGKILL, [psutil.Process(pid)])
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


@pytest.mark.timeout(120)
def test_a_node_reclaims_a_dead_nodes_arena_of_its_own_id_but_never_a_live_ones(tmp_path: Path) -> None:
    node_id = f"reclaim-{os.getpid()}"
    args = ("--dram", "16MiB", "--nvme", "0", "--listen", "127.0.0.1:0")

    def serve(
        d: str,
    ) -> subprocess.Popen[str]:  # the default arena path: /dev/shm/kvstore-<id>-<hash of data dir>.arena
        p = subprocess.Popen(
            [sys.executable, "-m", "kvstore", "serve", "--data-dir", str(tmp_path / d), "--node-id", node_id, *args],
            cwd=ROOT,
            env=clean_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert p.stdout is not None and any(line.startswith("READY ") for line in p.stdout)
        return p

    dead, live = serve("dead"), serve("live")
    arenas = {d: NodeConfig(node_id=node_id, data_dir=tmp_path / d).arena_file() for d in ("dead", "live")}
    try:
        dead.kill()
        dead.wait()
        assert arenas["dead"].exists() and arenas["live"].exists()
        time.sleep(1.1)  # older than a file that a starting node may not hold yet
        new = start_clean(tmp_path / "new", *args, node_id=node_id)
        try:
            assert not arenas["dead"].exists(), "the dead node's arena was not reclaimed"
            assert arenas["live"].exists(), "a running node's arena was removed"
            assert any("removed" in line and str(arenas["dead"]) in line for line in new.output)
        finally:
            stop_clean(new)
    finally:
        for p in (dead, live):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.communicate(timeout=60)
        for a in arenas.values():
            a.unlink(missing_ok=True)


def test_regression_spawned_child_runs_none_of_the_parents_python_before_exec() -> None:
    """Bug (found by the chaos test: an etcd restart died with SIGABRT, rc -6): ``spawn`` set
    PR_SET_PDEATHSIG in a ``preexec_fn``, so the parent's Python (its at-fork handlers,
    gRPC's among them) ran in the forked child before exec; in a test process whose gRPC
    client threads were busy, about 1 child in 150 aborted before it became etcd.  Now the
    child sets the signal in a fresh interpreter and execs: an at-fork handler of the parent
    never runs in it.  The PDEATHSIG itself is checked by the tests above."""
    code = (
        "import os, sys; os.register_at_fork(after_in_child=lambda: os._exit(99)); "
        "from kvstore import children; p = children.spawn([sys.executable, '-c', 'print(\"exec\")'], stdout=-1, text=True); "
        "print(p.communicate(timeout=60)[0].strip(), p.returncode)"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT, env=clean_env()
    )
    assert r.stdout.split() == ["exec", "0"], (r.stdout, r.stderr)
    with pytest.raises(FileNotFoundError):
        from kvstore import children

        children.spawn(["kvstore-no-such-program"])

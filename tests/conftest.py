"""Shared fixtures: real node processes on free ports in temporary directories."""

from __future__ import annotations

import importlib.util
import os
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvstore.children import ServeProcess

ROOT = Path(__file__).resolve().parent.parent

# tests/hicache (the SGLang HiCache backend) runs in .venv-sglang (`scripts/test.sh sglang`): its
# modules import SGLang at the top, so where SGLang is not installed they are not collected (the
# `sglang` marker deselects them too); scripts/test.sh fails that phase if .venv-sglang is missing.
collect_ignore_glob = [] if importlib.util.find_spec("sglang") else ["hicache/*"]
# tests/lmcache_store (the LMCache L2 adapter) likewise runs where LMCache is installed: .venv-vllm made
# with `scripts/setup.sh --vllm --lmcache` (`scripts/test.sh lmcache`).
if not importlib.util.find_spec("lmcache"):
    collect_ignore_glob.append("lmcache_store/*")


def pytest_sessionstart(session: pytest.Session) -> None:
    """Arenas of test nodes whose run was killed before its teardown (SIGKILL, a lost
    machine session) stay in /dev/shm: reclaim those no running node holds.  Under
    pytest-xdist only the controller does, before any worker starts a node (a worker's
    sweep could meet another worker's node between creating its arena and locking it)."""
    from kvstore.children import reclaim_arena

    if os.environ.get("PYTEST_XDIST_WORKER"):
        return

    for p in Path("/dev/shm").glob("kvstore-test-*.arena"):
        reclaim_arena(p)


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


class NodeProcess(ServeProcess):
    """A ``kvstore serve`` child process for tests (:class:`kvstore.children.ServeProcess`: its
    own session, dies with the test process, safe to start from any thread).  ``endpoints``
    is its READY line, ``output`` what it printed.

    ``node_id`` defaults to a random ``t...``, the arena file to a name of the test's own
    (later ``--arena-path`` in ``args`` wins); ``env`` is added to this process's environment
    (assign ``env`` whole before ``start`` to replace it, as :func:`start_clean` does); the
    node runs in the repository root.  ``prefix`` goes before the command line (``ip netns
    exec NS``, ``bash -c 'ulimit ...; exec "$@"'``: it execs, so the PID stays the node's);
    ``listen`` is the gRPC listener.  ``stop(sig=...)`` sends another signal than SIGTERM;
    ``kill9`` kills it and leaves its arena file, as a crash does."""

    def __init__(
        self,
        data_dir: Path,
        *args: str,
        env: dict[str, str] | None = None,
        node_id: str | None = None,
        prefix: Sequence[str] = (),
        listen: str = "127.0.0.1:0",
    ) -> None:
        node_id = node_id or f"t{uuid.uuid4().hex[:8]}"
        arena = f"/dev/shm/kvstore-test-{node_id}-{uuid.uuid4().hex[:6]}.arena"
        super().__init__(
            data_dir,
            *args,
            node_id=node_id,
            arena_path=arena,
            env={**os.environ, **(env or {})},
            listen=listen,
            cwd=ROOT,
        )
        self.node_id: str = node_id
        self.arena_path: str = arena
        self.prefix = list(prefix)

    def command(self) -> list[str]:
        return [*self.prefix, *super().command()]

    def start(self, timeout: float = 60.0) -> NodeProcess:
        super().start(timeout)
        return self

    @property
    def unix(self) -> str:
        return str(self.endpoints["unix"])

    @property
    def tcp(self) -> str:
        return str(self.endpoints["grpc"])

    def kill9(self) -> None:
        """SIGKILL it and wait: its arena file stays behind (``stop`` would reclaim it)."""
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


def agent_metric(metrics_url: str, agent: str) -> Callable[..., float]:
    """A reader of one agent's ``kvstore_agent_*`` samples from a node's metrics endpoint:
    ``v("kvstore_agent_blocks_total", op="read", result="hit")`` (0 where absent).  Its
    ``agents`` attribute lists every agent the node reported."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(metrics_url, timeout=10) as r:
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(r.read().decode())
            for s in fam.samples
            if s.name.startswith("kvstore_agent_")
        }

    def v(name: str, **labels: str) -> float:
        return samples.get((name, tuple(sorted({"agent": agent, **labels}.items()))), 0.0)

    v.agents = {dict(labels).get("agent") for _, labels in samples}  # type: ignore[attr-defined]
    return v

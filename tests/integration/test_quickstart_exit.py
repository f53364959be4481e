"""Regression (issue 16 #1): a client that is never closed must not hang its process.

The README's quick-start used to hang at interpreter exit after printing its result (on
a first run, then about 1 run in 25): ``get_into`` sends its ``Release`` without waiting,
and a gRPC future still running when daemon threads are frozen blocks the main thread in
``_Rendezvous.__del__``.  Now a client's finalizer finishes or cancels such calls on
garbage collection and at exit.  Each script runs many times as a process under a
timeout, against a real node: the quick-start as it was (never closed), the README's own
quick-start block (a context manager), clients dropped with calls in flight, an async client.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import ROOT, NodeProcess, clean_env, start_clean, stop_clean
from test_readme import BLOCKS

RUNS = 30

# the quick-start as it was (no close, no context manager), on a fresh key each run so
# every run really stores, leases and releases a block
NEVER_CLOSED = """
import os, sys, numpy as np
from client import KVClient, Namespace, chunk_keys
kv = KVClient(sys.argv[1])
s = int.from_bytes(os.urandom(3), "little")
key = chunk_keys(range(s, s + 256), Namespace("llama-3-8b"))[0]
kv.put(key, np.ones(1 << 20, np.float16)); print(kv.get_into(key, np.empty(1 << 20, np.float16)), kv.match_prefix([key]))
"""

# clients dropped (garbage) with their releases in flight, then one left for exit
DROPPED = """
import gc, os, sys, numpy as np
from client import KVClient, Namespace, chunk_keys
def once():
    kv = KVClient(sys.argv[1])
    key = os.urandom(16)
    kv.put(key, b"x" * 4096)
    return kv.get_into(key, bytearray(4096))
print(sum(once() for _ in range(10))); gc.collect()
kv = KVClient(sys.argv[1]); kv.exists([os.urandom(16)])
"""

ASYNC = """
import asyncio, os, sys
from client import AsyncKVClient
async def main():
    kv = AsyncKVClient(sys.argv[1])
    key = os.urandom(16)
    await kv.put(key, b"y" * 4096)
    print(await kv.get_into(key, bytearray(4096)))
asyncio.run(main())
"""


@pytest.fixture(scope="module")
def qs_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("home")


@pytest.fixture(scope="module")
def qs_node(qs_home: Path) -> NodeProcess:
    # where the README's quick-start looks: ~/.local/share/kvstore/kvstore.sock
    n = start_clean(qs_home / ".local" / "share" / "kvstore", "--dram", "128MiB", "--nvme", "0")
    yield n
    stop_clean(n)


def run_many(tmp: Path, script: str, target: str, runs: int, home: Path | None = None) -> list[str]:
    """Run ``script`` ``runs`` times (two at a time), each under a timeout; return their stdouts."""
    path = tmp / "script.py"
    path.write_text(textwrap.dedent(script))

    def one(_: int) -> str:
        try:
            p = subprocess.run(
                [sys.executable, str(path), target],
                capture_output=True,
                text=True,
                timeout=30,
                cwd=ROOT,
                env=clean_env(PYTHONPATH=str(ROOT), **({"HOME": str(home)} if home else {})),
            )
        except subprocess.TimeoutExpired as e:
            raise AssertionError(f"the script hung (still running after 30 s); output so far: {e.stdout!r}") from None
        assert p.returncode == 0, p.stderr
        return p.stdout

    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(one, range(runs)))


def test_quickstart_never_closed_exits_every_time(qs_node: NodeProcess, tmp_path: Path) -> None:
    outs = run_many(tmp_path, NEVER_CLOSED, qs_node.unix, RUNS)
    assert outs == ["2097152 1\n"] * RUNS


def test_readme_quickstart_exits_every_time(qs_node: NodeProcess, qs_home: Path, tmp_path: Path) -> None:
    quick = BLOCKS[0]
    assert "with KVClient(" in quick.code
    assert run_many(tmp_path, quick.code, "", RUNS, home=qs_home) == [quick.expected] * RUNS


def test_clients_dropped_with_releases_in_flight_exit(qs_node: NodeProcess, tmp_path: Path) -> None:
    assert run_many(tmp_path, DROPPED, qs_node.unix, 5) == ["40960\n"] * 5
    assert run_many(tmp_path, DROPPED, qs_node.tcp, 3) == ["40960\n"] * 3


def test_async_client_never_closed_exits(qs_node: NodeProcess, tmp_path: Path) -> None:
    assert run_many(tmp_path, ASYNC, qs_node.unix, 5) == ["4096\n"] * 5

"""The smaller first-hour findings (issue 16 #6), each against the real CLI or node."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, NodeProcess, clean_env, start_clean, stop_clean

from client import InvalidArgument, KVClient
from kvstore.traces.plan_plot import pct_label


def kvstore(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvstore", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=clean_env(),
        timeout=timeout,
    )


def test_a_start_on_a_port_in_use_leaves_nothing_and_says_it_once(node: NodeProcess, tmp_path: Path) -> None:
    fresh = tmp_path / "never-made"
    r = kvstore("serve", "--data-dir", str(fresh), "--listen", node.tcp, "--dram", "16MiB", "--nvme", "0")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"kvstore: error: cannot listen on {node.tcp}: Address already in use; pick another --listen HOST:PORT "
        "(port 0: any free port)"
    ], r.stderr  # no gRPC core line (E1201 ... add_port.cc) before it
    assert not fresh.exists()


def test_a_small_dram_says_why_the_block_limit_is_lower(node_factory, tmp_path: Path) -> None:
    n = node_factory("--dram", "4MiB", "--nvme", "0")
    assert any("max_block_bytes lowered" in line and "a larger --dram" in line for line in n.output), n.output
    with (
        KVClient(n.unix) as kv,
        pytest.raises(InvalidArgument, match="DRAM arena's size if smaller: a block must fit in DRAM"),
    ):
        kv.put(b"k" * 16, np.zeros(5 << 20, np.uint8))


def test_stats_help_names_its_default_target() -> None:
    r = kvstore("stats", "--help")
    assert "127.0.0.1:50151" in r.stdout and "KVSTORE_TARGET" in r.stdout


def test_serve_help_names_the_arena_file_it_makes() -> None:
    assert "kvstore-<id>-<hash>.arena" in kvstore("serve", "--help").stdout
    from kvstore.node.config import NodeConfig

    assert "<node_id>-<hash>.arena" in (NodeConfig.model_fields["arena_path"].description or "")


def test_wipe_refuses_a_running_node_then_removes_a_stopped_ones_data(tmp_path: Path) -> None:
    data = tmp_path / "data"
    n = start_clean(data, "--dram", "16MiB", "--nvme", "16MiB", "--arena-path", str(tmp_path / "unused"))
    arena = Path(n.endpoints["arena"])
    with KVClient(n.unix) as kv:
        assert kv.put(b"w" * 16, b"x" * 4096)
    r = kvstore("wipe", "--data-dir", str(data), "--arena-path", str(arena), "--yes")
    assert r.returncode == 2 and "in use by another running kvstore node" in r.stderr and data.exists()
    n.kill9()  # killed: its arena is left behind too
    assert arena.exists()
    dry = kvstore("wipe", "--data-dir", str(data), "--arena-path", str(arena))
    assert dry.returncode == 1 and f"would remove {data}/" in dry.stdout and str(arena) in dry.stdout and data.exists()
    r = kvstore("wipe", "--data-dir", str(data), "--arena-path", str(arena), "--yes")
    assert r.returncode == 0, r.stderr
    assert not data.exists() and not arena.exists()
    again = start_clean(data, "--dram", "16MiB", "--nvme", "16MiB")
    try:
        with KVClient(again.unix) as kv:
            assert kv.get(b"w" * 16) is None  # an empty node
    finally:
        stop_clean(again)


@pytest.mark.parametrize(
    "fraction,label",
    [
        (439 / 43924, "1%"),
        (74 / 7352, "1%"),
        (0.02, "2%"),
        (0.5, "50%"),
        (0.125, "12%"),
        (0.001, "0.1%"),
        (0.0123, "1.2%"),
    ],
)
def test_plan_plot_ticks_are_round(fraction: float, label: str) -> None:
    assert pct_label(fraction) == label  # regression: a tick read "0.999%"

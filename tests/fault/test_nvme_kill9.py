"""kill -9 a process writing to an NVMe tier mid-stream, reopen, and check nothing was lost or torn.

The writer (``_nvme_writer.py``) prints each block's index only after ``write`` returned.
After the kill every reported block (not evicted since) must be present and
byte-identical; any block present at all (including writes that were in flight) must be
whole; no entry may fail verification.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.errors import DataDirLocked
from tiers.nvme import NVMeTier

WRITER_PATH = Path(__file__).with_name("_nvme_writer.py")
_spec = importlib.util.spec_from_file_location("_nvme_writer", WRITER_PATH)
assert _spec and _spec.loader
writer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(writer)


def _run_and_kill(directory: Path, start: int, kill_after: int) -> tuple[dict[bytes, int], set[bytes]]:
    """Run the writer until it reported ``kill_after`` blocks, SIGKILL it; return (written, evicted)."""
    proc = subprocess.Popen(
        [sys.executable, str(WRITER_PATH), str(directory), str(start)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    try:
        ready = proc.stdout.readline()
        assert ready.startswith("READY"), ready
        with pytest.raises(DataDirLocked, match=f"pid {proc.pid}"):
            NVMeTier(directory, writer.CAPACITY, segment_bytes=writer.SEGMENT)
        while sum(line.startswith("W ") for line in lines) < kill_after:
            line = proc.stdout.readline()
            assert line, "the writer died on its own"
            lines.append(line)
        os.kill(proc.pid, signal.SIGKILL)
        lines += proc.stdout.read().splitlines(keepends=True)  # whatever it printed before dying
    finally:
        proc.kill()
        proc.wait(10)
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    written: dict[bytes, int] = {}
    evicted: set[bytes] = set()
    for line in lines:
        if not line.endswith("\n"):
            continue  # torn by the kill: not a report
        parts = line.split()
        if parts[0] == "W":
            written[bytes.fromhex(parts[2])] = int(parts[1])
        elif parts[0] == "E":
            evicted.add(bytes.fromhex(parts[1]))
    return written, evicted


def test_kill9_mid_stream_loses_nothing_reported(tmp_path: Path) -> None:
    directory = tmp_path / "nvme"
    reported: dict[bytes, int] = {}
    evicted: set[bytes] = set()
    start = 0
    for kill_after in (17, 45, 80):  # the writer wraps its 6 MiB tier and evicts in later rounds
        written, gone = _run_and_kill(directory, start, kill_after)
        reported.update(written)
        evicted |= gone
        end = max(written.values()) + 8  # covers blocks in flight at the kill, never reported
        with NVMeTier(directory, writer.CAPACITY, segment_bytes=writer.SEGMENT) as tier:
            assert tier.corrupt_blocks == 0
            for k, i in reported.items():
                if k not in evicted:
                    assert tier.contains(k), f"block {i} was reported written but is gone"
            present = 0
            for i in range(end):
                k = writer.key(i)
                if not tier.contains(k):
                    continue
                present += 1
                out = bytearray(len(writer.payload(i)))
                r = tier.read_into(k, out)
                assert r.hit, f"block {i} is present but reads as {r.miss}"
                assert bytes(out) == writer.payload(i)
            assert present == len(tier)  # nothing unknown (torn) in the index
            assert tier.corrupt_blocks == 0 and tier.used_bytes <= tier.capacity_bytes
        start = end
    assert len(evicted) > 0  # the later rounds did reuse freed space

"""Progress of long commands (issue 16 #4): a bar on stderr when it is a terminal, one
summary line otherwise; stdout untouched."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import re
import struct
import subprocess
import sys
import termios

from conftest import ROOT

from kvstore.progress import Progress

TRACE = str(ROOT / "tests" / "data" / "mooncake_synthetic_trace.jsonl")
SUMMARY = re.compile(r"^kvstore replay --bounds: 9/9 replays in \d+\.\d s$")


def test_not_a_terminal_one_summary_line() -> None:
    out = io.StringIO()
    with Progress("plan", total=3, unit="replays", stream=out, tty=False) as p:
        for i in range(3):
            p.update(note=f"lru at {i}")
    assert re.fullmatch(r"plan: 3/3 replays in \d+\.\d s\n", out.getvalue())


def test_a_terminal_gets_a_bar_then_the_summary() -> None:
    out = io.StringIO()
    p = Progress("plan", unit="replays", stream=out, tty=True)
    p.total = 4
    for _ in range(4):
        p.update(note="optimal")
    p.close("done")
    text = out.getvalue()
    assert "\r" in text and "4/4" in text and "optimal" in text
    assert re.search(r"plan: 4/4 replays in \d+\.\d s; done\n$", text)


def test_an_open_count_and_a_failed_command() -> None:
    out = io.StringIO()
    try:
        with Progress("up", stream=out, tty=False) as p:
            p.update(2)
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert re.fullmatch(r"up: 2 steps in \d+\.\d s; stopped\n", out.getvalue())


def _bounds(stderr: int) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "kvstore", "replay", TRACE, "--capacity", "5%", "--bounds", "--requests", "120"],
        stdout=subprocess.PIPE,
        stderr=stderr,
        cwd=ROOT,
        timeout=240,
    )


def test_replay_bounds_reports_progress_on_stderr_only() -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvstore",
            "replay",
            TRACE,
            "--capacity",
            "5%",
            "--bounds",
            "--requests",
            "120",
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=240,
    )
    assert r.returncode == 0, r.stderr
    assert SUMMARY.match(r.stderr.strip().splitlines()[-1]), r.stderr
    assert r.stdout.startswith("{") and "replays in" not in r.stdout  # stdout is the JSON alone

    primary, secondary = pty.openpty()  # stderr a terminal (120 columns): a live bar
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    try:
        r2 = _bounds(secondary)
        os.close(secondary)
        chunks = []
        while True:
            try:
                data = os.read(primary, 65536)
            except OSError:
                break
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(primary)
    assert r2.returncode == 0
    tty = b"".join(chunks).decode(errors="replace")
    assert "\r" in tty and "|" in tty and "/9" in tty, tty[-500:]
    assert SUMMARY.match(tty.replace("\r", "\n").strip().splitlines()[-1]), tty[-500:]

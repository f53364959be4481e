"""``kvstore serve`` and ``kvstore stats`` as a user runs them: defaults, config file,
``KVSTORE_*`` environment and flags (in that order of precedence), clear errors, a
locked data directory, and a clean exit on SIGTERM/SIGINT.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from conftest import ROOT, clean_env

from client import KVClient
from protos.kvstore.v1 import kvstore_pb2 as pb
from protos.kvstore.v1 import kvstore_pb2_grpc as pb_grpc

MiB = 1 << 20


def kvstore(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvstore", *args],
        env=env or clean_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def arena_arg() -> list[str]:
    return ["--arena-path", f"/dev/shm/kvstore-test-cli-{uuid.uuid4().hex[:8]}.arena"]


class Served:
    def __init__(self, proc: subprocess.Popen[str], lines: list[str], endpoints: dict[str, Any]) -> None:
        self.proc, self.lines, self.endpoints = proc, lines, endpoints

    def stop(self, sig: int = signal.SIGTERM) -> int:
        self.proc.send_signal(sig)
        out, _ = self.proc.communicate(timeout=60)
        self.lines.extend(out.splitlines(keepends=True))
        return self.proc.returncode


@contextlib.contextmanager
def serving(*args: str, env: dict[str, str] | None = None) -> Iterator[Served]:
    """Run ``kvstore serve`` until its READY line; always stopped (and its arena removed) after."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore", "serve", *args],
        env=env or clean_env(),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    endpoints: dict[str, Any] = {}
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("READY "):
                endpoints = json.loads(line[len("READY ") :])
                break
        assert endpoints, f"no READY line (rc={proc.wait(timeout=30)}):\n{''.join(lines)}"
        yield Served(proc, lines, endpoints)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
        if endpoints.get("arena"):
            Path(endpoints["arena"]).unlink(missing_ok=True)


def test_serve_with_no_flags_just_works(tmp_path: Path) -> None:
    env = clean_env(HOME=str(tmp_path / "home"), XDG_DATA_HOME=str(tmp_path / "xdg"))
    with serving("--listen", "127.0.0.1:0", env=env) as node:
        text = "".join(node.lines)
        ep = node.endpoints
        for what in ("grpc (tcp)", "grpc (unix)", "data channel", "DRAM arena", "NVMe tier", ep["grpc"], ep["unix"]):
            assert what in text
        data_dir = tmp_path / "xdg" / "kvstore"
        sock = data_dir / "kvstore.sock"
        assert ep["data_dir"] == str(data_dir) and ep["unix"] == f"unix://{sock}"
        assert ep["dram_bytes"] == 1 << 30 and ep["nvme_bytes"] == 4 << 30
        assert sock.is_socket() and Path(ep["arena"]).exists()
        for target in (ep["unix"], ep["grpc"]):
            with KVClient(target) as kv:
                k, data = os.urandom(16), os.urandom(100_000)
                assert kv.put(k, data) and kv.get(k) == data
        assert node.stop(signal.SIGTERM) == 0
        assert not sock.exists() and not Path(ep["arena"]).exists()
        assert "kvstore: stopped" in "".join(node.lines)


def test_config_file_then_env_then_flags(tmp_path: Path) -> None:
    cfg = tmp_path / "node.toml"
    cfg.write_text(
        "[node]\n"
        'node_id = "from-file"\n'
        'dram = "32MiB"\n'
        "nvme = 0\n"
        "max_batch = 100\n"
        "read_lease_ttl_s = 11.0\n"
        "reservation_ttl_s = 12.0\n"
    )
    env = clean_env(KVSTORE_NODE_ID="from-env", KVSTORE_MAX_BATCH="50", KVSTORE_RESERVATION_TTL_S="13")
    args = [
        "--config",
        str(cfg),
        "--data-dir",
        str(tmp_path / "d"),
        "--listen",
        "127.0.0.1:0",
        "--node-id",
        "from-flag",
        "--reservation-ttl",
        "14",
        *arena_arg(),
    ]
    with serving(*args, env=env) as node:
        ep = node.endpoints
        assert ep["node_id"] == "from-flag"  # file < env < flag
        assert ep["dram_bytes"] == 32 * MiB and ep["nvme_bytes"] == 0  # file only
        with grpc.insecure_channel(ep["grpc"]) as ch:
            hello = pb_grpc.KVStoreStub(ch).Hello(pb.HelloRequest(), timeout=10)
        assert hello.node_id == "from-flag"
        assert hello.max_batch == 50  # env over file
        assert hello.lease_ttl_s == 11.0  # file
        assert hello.reservation_ttl_s == 14.0  # flag over env over file
        assert hello.arena_size == 32 * MiB
        assert node.stop() == 0


@pytest.mark.parametrize(
    "file_text,env,args,message",
    [
        ('[node]\ndram = "8MiB"\nbogus_key = 1\n', {}, [], "bogus_key"),
        ("[node]\n[extra]\nx = 1\n", {}, [], "extra"),
        ("[node\n", {}, [], "cannot read config file"),
        ("", {"KVSTORE_FOO": "1"}, [], "KVSTORE_FOO"),
        ("", {}, ["--dram", "lots"], "not a size"),
        ("", {}, ["--listen", "nowhere"], "HOST:PORT"),
        ("", {"KVSTORE_READ_LEASE_TTL_S": "-1"}, [], "read_lease_ttl_s"),
        ("", {}, ["--dram", "512KiB"], "too small"),
        ("", {}, ["--token-file", "/nonexistent/token"], "token_file"),
    ],
    ids=[
        "unknown-key",
        "unknown-section",
        "bad-toml",
        "unknown-env",
        "bad-size",
        "bad-listen",
        "bad-ttl",
        "tiny-dram",
        "no-token-file",
    ],
)
def test_bad_configuration_is_a_clear_error(
    tmp_path: Path, file_text: str, env: dict[str, str], args: list[str], message: str
) -> None:
    cfg = tmp_path / "node.toml"
    cfg.write_text(file_text)
    arena = arena_arg()
    r = kvstore(
        "serve",
        "--config",
        str(cfg),
        "--data-dir",
        str(tmp_path / "d"),
        "--listen",
        "127.0.0.1:0",
        *arena,
        *args,
        env=clean_env(**env),
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("kvstore: error:") or "\nkvstore: error:" in r.stderr
    assert not Path(arena[1]).exists()  # nothing left behind in /dev/shm
    # nothing holds the data directory: a good configuration starts there at once
    if (tmp_path / "d").exists():
        with serving(
            "--data-dir", str(tmp_path / "d"), "--listen", "127.0.0.1:0", "--dram", "4MiB", "--nvme", "0", *arena_arg()
        ) as node:
            assert node.stop() == 0


def test_data_dir_lock_port_clash_sizes_stats_and_sigint(tmp_path: Path) -> None:
    d = tmp_path / "d"
    args = ["--data-dir", str(d), "--listen", "127.0.0.1:0", "--dram", "64MiB", "--nvme", "0.5GiB", "--node-id", "cli"]
    with serving(*args, *arena_arg()) as node:
        ep = node.endpoints
        assert ep["dram_bytes"] == 64 * MiB and ep["nvme_bytes"] == 512 * MiB

        # a second node on the same data directory is refused, and harms nothing
        arena2 = arena_arg()
        r = kvstore("serve", *args, *arena2)
        assert r.returncode == 2 and "in use by another running kvstore node" in r.stderr, r.stderr
        assert not Path(arena2[1]).exists()

        # a second node on the same TCP port is refused with a clear message, leaving nothing behind
        r = kvstore(
            "serve",
            "--data-dir",
            str(tmp_path / "d2"),
            "--listen",
            ep["grpc"],
            "--dram",
            "8MiB",
            "--nvme",
            "0",
            *arena2,
        )
        assert r.returncode == 2 and "cannot listen on" in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert not Path(arena2[1]).exists() and not (tmp_path / "d2" / "kvstore.sock").exists()

        for target in (ep["unix"], ep["grpc"]):
            r = kvstore("stats", "--target", target)
            assert r.returncode == 0, r.stderr
            stats = json.loads(r.stdout)
            assert stats["node_id"] == "cli"
            assert stats["tiers"]["dram"]["capacity_bytes"] == 64 * MiB
            assert stats["tiers"]["nvme"]["capacity_bytes"] <= 512 * MiB
        assert node.stop(signal.SIGINT) == 0
        assert not (d / "kvstore.sock").exists() and not Path(ep["arena"]).exists()

    # the data directory is free again once the node has exited
    with serving(*args, *arena_arg()) as node:
        assert node.stop() == 0


def test_stats_of_a_node_that_is_not_there() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = kvstore("stats", "--target", f"127.0.0.1:{port}")
    assert r.returncode == 2 and "kvstore: error:" in r.stderr and "Traceback" not in r.stderr, r.stderr

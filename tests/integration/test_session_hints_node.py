"""Session hints against a real node, over every SDK path: a closed session's blocks are the
first to go, blocks of open sessions stay; ``close_session`` on the sync and async clients and
the ``kvstore close-session`` verb; a tenant cannot close another tenant's session."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
from conftest import NodeProcess

from client import AsyncKVClient, InvalidArgument, KVClient, Namespace, PermissionDenied, chunk_keys

BLOCK = 64 * 1024  # one allocation unit: a 1 MiB arena holds 16 blocks
CHUNK = 4


def blocks(tag: str, n: int) -> tuple[Namespace, list[bytes]]:
    ns = Namespace("tiny-model", chunk_tokens=CHUNK, tenant_salt=f"{tag}-{uuid.uuid4().hex}")
    return ns, chunk_keys(range(n * CHUNK), ns)


@pytest.mark.parametrize("path", ["shm", "tcp", "grpc-stream"])
def test_a_closed_sessions_blocks_go_first(node_factory, path: str) -> None:  # type: ignore[no-untyped-def]
    node = node_factory("--dram", "1MiB", "--nvme", "0", "--eviction-policy", "lru")
    target = node.unix if path == "shm" else node.tcp
    payload = np.full(BLOCK, 7, dtype=np.uint8)
    with KVClient(target, transport="grpc-stream" if path == "grpc-stream" else "auto") as kv:
        ns_a, a = blocks("a", 8)
        ns_b, b = blocks("b", 8)
        assert all(kv.put_many(b, [payload] * 8, namespace=ns_b, session_id="chat-b"))
        assert all(kv.put_many(a, [payload] * 8, namespace=ns_a, session_id="chat-a"))
        assert kv.match_prefix(a, session_id="chat-a") == 8
        assert all(x is not None for x in kv.get_many(a, session_id="chat-a"))  # a is the most recently used
        assert kv.close_session("chat-a") is True
        assert kv.close_session("chat-a") is False  # closed already
        ns_c, c = blocks("c", 4)
        assert all(kv.put_many(c, [payload] * 4, namespace=ns_c))  # the arena is full: four blocks must go
        assert kv.exists(b) == [True] * 8, "an open session's blocks stay"
        assert sum(kv.exists(a)) == 4, "the closed session's blocks went first"
        counters = kv.stats()["counters"]
        assert counters["sessions_closed"] == 1 and counters["session_blocks_dead"] == 8
        with pytest.raises(InvalidArgument, match="session id"):
            kv.put(c[0], payload, namespace=ns_c, session_id="bad\nid")


def test_async_client_and_cli_verb(node_factory) -> None:  # type: ignore[no-untyped-def]
    node = node_factory("--dram", "1MiB", "--nvme", "0")
    ns, keys = blocks("x", 2)

    async def go() -> None:
        async with AsyncKVClient(node.unix) as kv:
            assert all(await kv.put_many(keys, [b"x" * 100] * 2, namespace=ns, session_id="s1"))
            assert await kv.match_prefix(keys, session_id="s2") == 2
            assert await kv.close_session("s1") is True
            assert await kv.close_session("never-opened") is False

    asyncio.run(go())
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    cli = [sys.executable, "-m", "kvstore", "close-session", "--target", node.unix]
    done = subprocess.run([*cli, "s2"], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0 and "closed" in done.stdout
    again = subprocess.run([*cli, "s2"], capture_output=True, text=True, env=env, timeout=60)
    assert again.returncode == 1 and "was not open" in again.stdout


def test_a_tenant_cannot_close_another_tenants_session(tmp_path: Path) -> None:
    cfg = tmp_path / "node.toml"
    cfg.write_text(
        '[node]\ntoken = "admin-t"\n\n[tenants.alice]\ntoken = "alice-t"\n\n[tenants.bob]\ntoken = "bob-t"\n'
    )
    node = NodeProcess(tmp_path / "node", "--config", str(cfg), "--dram", "1MiB", "--nvme", "0")
    node.env = {**{k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}, "PYTHONUNBUFFERED": "1"}
    node.start()
    try:
        ns, keys = blocks("alice", 1)
        with (
            KVClient(node.tcp, token="alice-t") as alice,
            KVClient(node.tcp, token="bob-t") as bob,
            KVClient(node.tcp, token="admin-t") as admin,
        ):
            assert alice.put(keys[0], b"a" * 100, namespace=ns, session_id="conv-1")
            with pytest.raises(PermissionDenied, match="not one of tenant 'bob'"):
                bob.close_session("conv-1")
            assert bob.close_session("conv-2") is False  # nobody's: unknown, not refused
            assert alice.close_session("conv-1") is True
            assert alice.put(keys[0], b"a" * 100, namespace=ns, session_id="conv-3")
            assert admin.close_session("conv-3") is True  # the admin closes any tenant's session
    finally:
        node.stop(timeout=30)
        Path(node.arena_path).unlink(missing_ok=True)

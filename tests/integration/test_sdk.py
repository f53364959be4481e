"""Every SDK method against a real ``kvstore serve``, over every data path, with both clients.

Paths: a ``unix://`` target (bytes through the shared-memory arena), a TCP target (bytes
over the data channel) and a TCP target with ``transport="grpc-stream"`` (the streaming
fallback).  Clients: ``KVClient`` and ``AsyncKVClient`` (driven on a private event loop so
one test body checks both).  Data must come back byte-identical at every size, from
bytes, numpy arrays and CPU torch tensors.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import NodeProcess

from client import AsyncKVClient, InvalidArgument, KVClient, Namespace, Unavailable, chunk_keys, parent_keys

MiB = 1 << 20
SIZES = [0, 1, 4095, MiB + 7, 4 * MiB]
PATHS = {"shm": "shm", "tcp": "data-channel", "grpc-stream": "grpc-stream"}


def rkey() -> bytes:
    return os.urandom(16)


def start_node(tmp: Path, *args: str) -> NodeProcess:
    return NodeProcess(tmp / "node", *args).start()


def stop_node(n: NodeProcess) -> int:
    rc = n.stop(timeout=30)
    Path(f"/dev/shm/kvstore-test-{n.node_id}.arena").unlink(missing_ok=True)
    return rc


@pytest.fixture(scope="module")
def sdk_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    n = start_node(tmp_path_factory.mktemp("sdk"), "--dram", "128MiB", "--nvme", "0")
    yield n
    assert stop_node(n) == 0


class AsyncDriver:
    """Runs an ``AsyncKVClient``'s coroutines to completion on a private loop."""

    def __init__(self, target: str, **kw: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self.client = AsyncKVClient(target, **kw)
        self._core = self.client._core

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.client, name)
        return lambda *a, **kw: self._loop.run_until_complete(fn(*a, **kw))

    def close(self) -> None:
        self._loop.run_until_complete(self.client.close())
        self._loop.close()


def make_client(kind: str, node: NodeProcess, path: str) -> Any:
    target = node.unix if path == "shm" else node.tcp
    transport = "grpc-stream" if path == "grpc-stream" else "auto"
    return KVClient(target, transport=transport) if kind == "sync" else AsyncDriver(target, transport=transport)


@pytest.fixture(params=[(p, k) for p in PATHS for k in ("sync", "async")], ids=lambda p: f"{p[0]}-{p[1]}")
def kv(request: pytest.FixtureRequest, sdk_node: NodeProcess) -> Iterator[Any]:
    path, kind = request.param
    client = make_client(kind, sdk_node, path)
    yield client
    # the SDK really took the path under test
    transport = client._core.transport
    assert transport is None or transport.name == PATHS[path]
    client.close()


# -- bytes ------------------------------------------------------------------------------


def test_bytes_round_trip_every_size(kv: Any) -> None:
    keys = [rkey() for _ in SIZES]
    datas = [os.urandom(n) for n in SIZES]
    for k, d in zip(keys, datas):
        assert kv.put(k, d) is True
    assert kv.put(keys[2], datas[2]) is True  # already stored: still True, nothing rewritten
    for k, d in zip(keys, datas):
        got = kv.get(k)
        assert isinstance(got, bytes) and got == d
        out = bytearray(len(d) + 3)  # a bigger buffer takes the payload at its start
        assert kv.get_into(k, out) == len(d)
        assert out[: len(d)] == d and out[len(d) :] == bytes(3)
    assert kv.get_many(keys) == datas
    outs = [bytearray(n) for n in SIZES]
    assert kv.get_many_into(keys, outs) == SIZES
    assert [bytes(o) for o in outs] == datas


def test_put_many_get_many(kv: Any) -> None:
    keys = [rkey() for _ in range(10)]
    datas = [os.urandom(1000 * (i + 1)) for i in range(10)]
    assert kv.put_many(keys, datas) == [True] * 10
    missing = rkey()
    assert kv.get_many([keys[0], missing, keys[9]]) == [datas[0], None, datas[9]]
    outs = [bytearray(len(d)) for d in datas]
    assert kv.get_many_into(keys, outs) == [len(d) for d in datas]
    assert [bytes(o) for o in outs] == datas
    assert kv.exists(keys + [missing]) == [True] * 10 + [False]
    assert kv.lookup([keys[0], missing]) == ["dram", None]
    assert kv.lookup(keys[0]) == ["dram"]  # one key is accepted too
    with pytest.raises(InvalidArgument):
        kv.put_many(keys, datas[:3])


def test_miss_is_a_result(kv: Any) -> None:
    k = rkey()
    assert kv.get(k) is None
    assert kv.get_into(k, bytearray(8)) is None
    assert kv.get_many([k]) == [None]
    assert kv.get_many_into([k], [bytearray(8)]) == [None]
    assert kv.exists([k]) == [False]
    assert kv.lookup([k]) == [None]
    assert kv.match_prefix([k]) == 0
    assert kv.match_prefix_tiers([k]) == (0, [])
    assert kv.delete([k]) == 0
    assert kv.pin([k], 10.0) == 0
    assert kv.unpin([k]) == 0


# -- arrays and tensors -----------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype,shape",
    [
        ("float16", (2, 8, 16, 64)),
        ("float32", (3, 5, 7)),
        ("int32", (1000,)),
        ("uint8", (17, 3)),
        ("int64", (2, 3)),
        ("float64", (1,)),
    ],
)
def test_numpy_round_trip(kv: Any, dtype: str, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(7)
    a = (rng.standard_normal(shape) * 100).astype(dtype)
    k = rkey()
    assert kv.put(k, a)
    out = np.empty_like(a)
    assert kv.get_into(k, out) == a.nbytes
    assert out.tobytes() == a.tobytes()
    assert kv.get(k) == a.tobytes()
    flat = np.empty(a.nbytes, dtype=np.uint8)  # any buffer of the right size will do
    assert kv.get_into(k, flat) == a.nbytes and flat.tobytes() == a.tobytes()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64])
def test_torch_round_trip(kv: Any, dtype: torch.dtype) -> None:
    t = (torch.randn(2, 4, 8, 16) * 10).to(dtype)
    raw = t.view(torch.uint8).numpy().tobytes()
    k = rkey()
    assert kv.put(k, t)
    out = torch.empty_like(t)
    assert kv.get_into(k, out) == t.numel() * t.element_size()
    assert torch.equal(out, t)
    assert kv.get(k) == raw
    arr = np.empty(len(raw), np.uint8)  # tensor in, numpy out
    assert kv.get_into(k, arr) == len(raw) and arr.tobytes() == raw


def test_buffers_must_be_contiguous_and_writable(kv: Any) -> None:
    a = np.zeros((8, 8), np.float16)[:, ::2]
    t = torch.zeros(8, 4).t()
    assert not a.flags.c_contiguous and not t.is_contiguous()
    with pytest.raises(InvalidArgument, match="contiguous"):
        kv.put(rkey(), a)
    with pytest.raises(InvalidArgument, match="contiguous"):
        kv.put(rkey(), t)
    k = rkey()
    assert kv.put(k, b"x" * 64)
    with pytest.raises(InvalidArgument, match="contiguous"):
        kv.get_into(k, np.zeros((8, 16), np.uint8)[:, ::2])
    with pytest.raises(InvalidArgument, match="read-only"):
        kv.get_into(k, bytes(64))
    with pytest.raises(InvalidArgument):
        kv.put(rkey(), object())


# -- keys, prefixes, management -----------------------------------------------------------


def test_chain_prefix_pins_delete_invalidate(kv: Any) -> None:
    ns = Namespace("test-model", chunk_tokens=16, tenant_salt=uuid.uuid4().hex)
    tokens = np.random.default_rng(1).integers(0, 32000, 16 * 6 + 5)
    keys = chunk_keys(tokens, ns)
    assert len(keys) == 6 and all(len(k) == 16 for k in keys)
    blocks = [np.full((2, 16, 8), i, np.float16) for i in range(6)]
    assert (
        kv.put_many(keys, blocks, namespace=ns.fingerprint, parents=parent_keys(keys), token_counts=[16] * 6)
        == [True] * 6
    )
    assert kv.match_prefix(keys) == 6
    assert kv.match_prefix_tiers(keys) == (6, ["dram"] * 6)

    assert kv.delete([keys[3]]) == 1
    assert kv.delete([keys[3]]) == 0
    assert kv.match_prefix(keys) == 3  # a chain is useful only up to its first gap
    assert kv.match_prefix_tiers(keys) == (3, ["dram"] * 3)
    assert kv.exists(keys) == [True, True, True, False, True, True]
    assert kv.get(keys[3]) is None and kv.get(keys[4]) == blocks[4].tobytes()

    assert kv.pin(keys[:2], 60.0) == 2
    assert kv.stats()["pins"] >= 2
    assert kv.unpin(keys[:2]) == 2
    assert kv.unpin(keys[:2]) == 0
    with pytest.raises(InvalidArgument, match="ttl"):
        kv.pin(keys[:1], 0)

    other = Namespace("other-model", chunk_tokens=16, tenant_salt=uuid.uuid4().hex)
    (other_key,) = chunk_keys(tokens[:16], other)
    assert other_key not in keys  # the namespace seeds the chain
    plain = rkey()
    assert kv.put(other_key, b"other", namespace=other) and kv.put(plain, b"plain")  # a Namespace or its fingerprint
    assert kv.invalidate(ns) == 5
    assert kv.exists(keys) == [False] * 6
    assert kv.get(other_key) == b"other" and kv.get(plain) == b"plain"
    assert kv.invalidate(ns.fingerprint) == 0
    with pytest.raises(InvalidArgument, match="8 bytes"):
        kv.invalidate(b"short")
    with pytest.raises(InvalidArgument, match="8 bytes"):
        kv.put(rkey(), b"x", namespace=b"short")


def test_stats(kv: Any, sdk_node: NodeProcess) -> None:
    k = rkey()
    assert kv.put(k, b"s" * 100) and kv.get(k) == b"s" * 100
    s = kv.stats()
    assert s["node_id"] == sdk_node.node_id
    assert s["tiers"]["dram"]["capacity_bytes"] == 128 * MiB
    assert 0 < s["tiers"]["dram"]["used_bytes"] <= 128 * MiB and s["tiers"]["dram"]["blocks"] > 0
    assert "nvme" not in s["tiers"]  # started with --nvme 0
    assert s["counters"]["puts"] > 0
    assert s["reservations"] == 0 and s["leases"] == 0


# -- client lifecycle ---------------------------------------------------------------------


@pytest.mark.parametrize("path", list(PATHS))
def test_context_managers_and_close(sdk_node: NodeProcess, path: str) -> None:
    target = sdk_node.unix if path == "shm" else sdk_node.tcp
    transport = "grpc-stream" if path == "grpc-stream" else "auto"
    k = rkey()
    with KVClient(target, transport=transport) as kv:
        assert kv.put(k, b"ctx")
    with pytest.raises(Unavailable, match="closed"):
        kv.get(k)

    client = AsyncKVClient(target, transport=transport)  # made outside any loop, used inside one

    async def main() -> None:
        async with client as akv:
            assert await akv.get(k) == b"ctx"
            got = await asyncio.gather(*(akv.put(rkey(), os.urandom(5000)) for _ in range(8)))
            assert got == [True] * 8
        with pytest.raises(Unavailable, match="closed"):
            await client.get(k)

    asyncio.run(main())


# -- tiers ----------------------------------------------------------------------------------


def test_nvme_promotion_and_restart(node_factory: Any) -> None:
    n = node_factory("--dram", "16MiB", "--nvme", "128MiB")
    rng = np.random.default_rng(3)
    keys = [rkey() for _ in range(24)]
    datas = [rng.integers(0, 256, MiB + i, dtype=np.uint8).tobytes() for i in range(24)]  # 24 MiB > DRAM
    with KVClient(n.unix) as kv:
        assert kv.put_many(keys, datas) == [True] * 24
        where = kv.lookup(keys)
        assert "nvme" in where and "dram" in where and None not in where
        for k, d in zip(keys, datas):  # each NVMe hit is promoted back into DRAM to be read
            assert kv.get(k) == d
        assert kv.get_many(keys) == datas  # more than DRAM holds in one call: the SDK retries in parts
        s = kv.stats()
        assert s["counters"]["promotions"] > 0 and s["counters"]["demotions"] > 0
        assert s["tiers"]["nvme"]["blocks"] > 0 and s["leases"] == 0
    with KVClient(n.tcp) as kv:
        out = bytearray(MiB + 23)
        assert kv.get_into(keys[23], out) == MiB + 23 and bytes(out) == datas[23]
        assert kv.get_many(keys[:6]) == datas[:6]

    assert n.stop() == 0  # SIGTERM: dirty DRAM blocks are demoted to NVMe first
    assert not Path(n.unix[len("unix://") :]).exists()
    n2 = node_factory("--dram", "16MiB", "--nvme", "128MiB", data_dir=n.data_dir)
    with KVClient(n2.unix) as kv:
        assert kv.lookup(keys) == ["nvme"] * 24
        assert kv.match_prefix_tiers(keys[:3]) == (3, ["nvme"] * 3)
        for k, d in zip(keys, datas):
            assert kv.get(k) == d
    with KVClient(n2.tcp, transport="grpc-stream") as kv:
        assert kv.get_many(keys[-3:]) == datas[-3:]

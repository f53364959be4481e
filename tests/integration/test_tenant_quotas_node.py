"""Issue 13 #1 on a real node with real clients: limits hold under 0- and 1-byte blocks, and
no tenant can push another's puts to failure, or evict its working set, within its quota.

One node (64 MiB DRAM, no NVMe): ``alice`` with ``max_dram_bytes = "32MiB"``, ``bob`` with
``max_dram_bytes = "8MiB"``, ``max_reserved_bytes = 0`` for ``mallory``, ``max_pinned_bytes =
0`` for ``carol``.  Before the fix mallory reserved 1,024 zero-byte blocks (all 64 MiB),
carol pinned 1,024 empty blocks, and a 1-byte put stream evicted everyone.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import grpc
import pytest
from conftest import NodeProcess, start_clean, stop_clean

from client import CapacityExceeded, KVClient, Namespace, chunk_keys
from kvstore.block import BlockMeta
from kvstore.wire import meta_to_pb
from protos.kvstore.v1 import kvstore_pb2 as pb
from protos.kvstore.v1 import kvstore_pb2_grpc as pb_grpc

TOKENS = {"admin": "q-admin", "alice": "q-alice", "bob": "q-bob", "mallory": "q-mallory", "carol": "q-carol"}
MiB = 1 << 20


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    d = tmp_path_factory.mktemp("quotas")
    cfg = d / "node.toml"
    cfg.write_text(
        f'[node]\ntoken = "{TOKENS["admin"]}"\nmax_batch = 1024\n\n'
        f'[tenants.alice]\ntoken = "{TOKENS["alice"]}"\nmax_dram_bytes = "32MiB"\n\n'
        f'[tenants.bob]\ntoken = "{TOKENS["bob"]}"\nmax_dram_bytes = "8MiB"\n\n'
        f'[tenants.mallory]\ntoken = "{TOKENS["mallory"]}"\nmax_reserved_bytes = 0\n\n'
        f'[tenants.carol]\ntoken = "{TOKENS["carol"]}"\nmax_pinned_bytes = 0\n'
    )
    n = start_clean(d / "node", "--config", str(cfg), "--dram", "64MiB", "--nvme", "0")
    yield n
    stop_clean(n)


def ns(owner: str) -> Namespace:
    return Namespace("tiny", chunk_tokens=4, tenant_salt=f"{owner}-{uuid.uuid4().hex}")


def client(node: NodeProcess, who: str) -> KVClient:
    return KVClient(node.unix, token=TOKENS[who])


def working_set(node: NodeProcess, n: int = 256, size: int = 64 * 1024) -> tuple[Namespace, list[bytes], list[bytes]]:
    """alice's blocks: ``n`` x 64 KiB = 16 MiB by default, half her quota."""
    a = ns("alice")
    keys = chunk_keys(range(n * 4), a)
    datas = [os.urandom(size) for _ in range(n)]
    with client(node, "alice") as alice:
        assert alice.put_many(keys, datas, namespace=a) == [True] * n
    return a, keys, datas


def still_there(node: NodeProcess, keys: list[bytes], datas: list[bytes]) -> None:
    with client(node, "alice") as alice:
        assert alice.exists(keys) == [True] * len(keys)  # nothing of hers was evicted
        assert alice.get_many(keys) == datas


def test_zero_reserved_bytes_reserve_no_empty_blocks(node: NodeProcess) -> None:
    m = ns("mallory")
    infos = [meta_to_pb(BlockMeta.for_payload(k, b"", namespace=m.fingerprint)) for k in chunk_keys(range(4096), m)]
    with grpc.insecure_channel(node.unix) as ch:
        with pytest.raises(grpc.RpcError) as ei:
            pb_grpc.KVStoreStub(ch).Reserve(
                pb.ReserveRequest(blocks=infos),
                timeout=30,
                metadata=(("authorization", f"Bearer {TOKENS['mallory']}"),),
            )
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "a block of 0 bytes (it takes 65536 bytes of DRAM" in ei.value.details()
        assert (
            pb_grpc.KVStoreStub(ch)
            .Stats(pb.Empty(), timeout=10, metadata=(("authorization", f"Bearer {TOKENS['admin']}"),))
            .reservations
            == 0
        )
    with client(node, "mallory") as mallory, pytest.raises(CapacityExceeded, match="max_reserved_bytes=0"):
        mallory.put(chunk_keys(range(4), m)[0], b"", namespace=m)


def test_zero_pinned_bytes_pin_no_empty_blocks(node: NodeProcess) -> None:
    c = ns("carol")
    keys = chunk_keys(range(64 * 4), c)
    with client(node, "carol") as carol:
        assert carol.put_many(keys, [b""] * 64, namespace=c) == [True] * 64
        with pytest.raises(CapacityExceeded, match="max_pinned_bytes=0"):
            carol.pin(keys, 60)
        assert carol.delete(keys) == 64


def test_a_one_byte_flood_within_its_quota_leaves_another_tenants_working_set(node: NodeProcess) -> None:
    a, keys, datas = working_set(node)
    b = ns("bob")
    flood = chunk_keys(range(5000 * 4), b)
    with client(node, "bob") as bob:  # 5,000 x 1 byte: 312 MiB of units, against his 8 MiB
        for i in range(0, 5000, 100):  # a batch in flight is reserved whole: 100 units fit his quota, 500 would not
            assert bob.put_many(flood[i : i + 100], [b"x"] * 100, namespace=b) == [True] * 100
        assert sum(bob.exists(flood)) == 8 * MiB // (64 * 1024)  # his newest 128 blocks
    still_there(node, keys, datas)
    with client(node, "alice") as alice:  # and she still writes up to her quota
        more = chunk_keys(range(1024 * 4, 1280 * 4), a)
        assert alice.put_many(more, [b"y"] * 256, namespace=a) == [True] * 256


def test_the_admins_one_byte_stream_takes_quota_holders_blocks_last(node: NodeProcess) -> None:
    _, keys, datas = working_set(node)
    with client(node, "admin") as admin:
        for _ in range(0, 5000, 500):
            assert admin.put_many([os.urandom(16) for _ in range(500)], [b"z"] * 500) == [True] * 500
    still_there(node, keys, datas)

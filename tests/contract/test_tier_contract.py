"""One contract, every tier: what any ``tiers.base.Tier`` must do."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvstore.block import BlockMeta
from kvstore.errors import CapacityExceeded, InvalidArgument
from kvstore.keys import NO_PARENT, ChunkKey
from tiers.arena import Arena
from tiers.base import MissReason, Tier, TierKind
from tiers.dram import DRAMTier
from tiers.nvme import NVMeTier
from tiers.policy import LRUPolicy

CAP = 8 << 20


def make_dram(tmp_path: Path) -> DRAMTier:
    return DRAMTier(
        Arena.create(f"/dev/shm/kvstore-contract-{uuid.uuid4().hex}.arena", CAP), policy=LRUPolicy(), unit=4096
    )


def make_nvme(tmp_path: Path) -> NVMeTier:
    return NVMeTier(tmp_path / "nvme", CAP, policy=LRUPolicy(), segment_bytes=4 << 20)


@pytest.fixture(params=["dram", "nvme"])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Tier]:
    t = make_dram(tmp_path) if request.param == "dram" else make_nvme(tmp_path)
    yield t
    t.close()


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "little"))


def block(i: int, n: int, parent: ChunkKey = NO_PARENT) -> tuple[BlockMeta, np.ndarray]:
    data = np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8)
    return BlockMeta.for_payload(key(i), data, parent=parent), data


def test_is_a_tier(tier: Tier) -> None:
    assert isinstance(tier, Tier)
    assert tier.kind in (TierKind.DRAM, TierKind.NVME)
    assert tier.capacity_bytes <= CAP and tier.used_bytes == 0 and len(tier) == 0


@pytest.mark.parametrize("n", [1, 4095, 4096, 4097, (1 << 20) + 3])
def test_round_trip_is_byte_identical(tier: Tier, n: int) -> None:
    meta, data = block(n, n)
    tier.write(meta, data)
    out = np.zeros(n + 10, np.uint8)
    res = tier.read_into(meta.key, out)
    assert res.hit and res.nbytes == n and res.meta == meta
    assert np.array_equal(out[:n], data)
    assert tier.contains(meta.key) and tier.meta(meta.key) == meta and len(tier) == 1


def test_miss_is_a_result(tier: Tier) -> None:
    res = tier.read_into(key(99), bytearray(10))
    assert not res.hit and res.miss == MissReason.NOT_PRESENT
    assert not tier.contains(key(99)) and tier.meta(key(99)) is None
    assert tier.delete(key(99)) is False


def test_output_too_small_is_an_error(tier: Tier) -> None:
    meta, data = block(1, 5000)
    tier.write(meta, data)
    with pytest.raises(InvalidArgument):
        tier.read_into(meta.key, bytearray(100))


def test_payload_contradicting_meta_is_rejected(tier: Tier) -> None:
    meta, data = block(1, 5000)
    with pytest.raises(InvalidArgument):
        tier.write(meta, data[:4000])
    assert not tier.contains(meta.key)


def test_count_prefix(tier: Tier) -> None:
    for i in range(4):
        tier.write(*block(i, 1000))
    assert tier.count_prefix([key(0), key(1), key(2)]) == 3
    assert tier.count_prefix([key(0), key(9), key(2)]) == 1
    assert tier.count_prefix([key(9)]) == 0
    assert tier.count_prefix([]) == 0


def test_delete_frees_space(tier: Tier) -> None:
    meta, data = block(1, 1 << 20)
    tier.write(meta, data)
    used = tier.used_bytes
    assert used >= 1 << 20
    assert tier.delete(meta.key)
    assert tier.used_bytes == 0 and not tier.contains(meta.key)


def test_capacity_is_never_exceeded(tier: Tier) -> None:
    i = 0
    with pytest.raises(CapacityExceeded):
        while True:
            tier.write(*block(i, 1 << 20))
            assert tier.used_bytes <= tier.capacity_bytes
            i += 1
    assert tier.used_bytes <= tier.capacity_bytes
    assert not tier.fits(1 << 20) or tier.used_bytes + (1 << 20) <= tier.capacity_bytes
    for j in range(i):  # everything written before the refusal is intact
        out = bytearray(1 << 20)
        assert tier.read_into(key(j), out).hit
        assert bytes(out) == block(j, 1 << 20)[1].tobytes()


def test_block_larger_than_tier_is_refused(tier: Tier) -> None:
    meta, data = block(1, CAP + 1)
    with pytest.raises(CapacityExceeded):
        tier.write(meta, data)


def test_victims_follow_policy_and_skip(tier: Tier) -> None:
    for i in range(5):
        tier.write(*block(i, 1000))
    tier.read_into(key(0), bytearray(1000))  # touch: 0 becomes most recent (on tiers that track reads)
    order = list(tier.victims(lambda k: k != key(1)))
    assert key(1) not in order
    assert set(order) == {key(0), key(2), key(3), key(4)}
    # evicting while iterating: the caller deletes what it takes
    for k in tier.victims():
        tier.delete(k)
        break
    assert len(tier) == 4


def test_overwrite_replaces(tier: Tier) -> None:
    meta, data = block(1, 3000)
    tier.write(meta, data)
    data2 = np.full(2000, 7, np.uint8)
    meta2 = BlockMeta.for_payload(meta.key, data2)
    tier.write(meta2, data2)
    out = bytearray(3000)
    res = tier.read_into(meta.key, out)
    assert res.nbytes == 2000 and bytes(out[:2000]) == data2.tobytes() and len(tier) == 1


def test_fits(tier: Tier) -> None:
    assert tier.fits(1 << 20)
    assert not tier.fits(CAP + 1)

"""Writer process for the NVMe kill -9 test: a deterministic stream of blocks, forever.

    python _nvme_writer.py DIRECTORY START

Prints ``READY <pid>`` once the tier is open, ``W <i> <key hex>`` after ``write`` or
``write_many`` returned for block ``i`` (so the block is durable and indexed), and
``E <key hex>`` after evicting a block to make room.  The test kills it mid-stream.
"""

from __future__ import annotations

import os
import sys

import xxhash

from kvstore.block import BlockMeta
from kvstore.errors import CapacityExceeded
from kvstore.keys import ChunkKey
from tiers.nvme import NVMeTier

CAPACITY = 6 << 20
SEGMENT = 2 << 20
SIZES = (1, 4095, 4096, 4097, 70_000, 250_001)


def key(i: int) -> ChunkKey:
    return ChunkKey(xxhash.xxh3_128_digest(b"kill9/%d" % i))


def payload(i: int) -> bytes:
    size = SIZES[i % len(SIZES)]
    seed = xxhash.xxh3_64_digest(b"%d" % i)
    return (seed * (size // 8 + 1))[:size]


def block(i: int) -> tuple[BlockMeta, bytes]:
    data = payload(i)
    return BlockMeta.for_payload(key(i), data), data


def main() -> None:
    directory, start = sys.argv[1], int(sys.argv[2])
    tier = NVMeTier(directory, CAPACITY, segment_bytes=SEGMENT, sync=True)
    print(f"READY {os.getpid()}", flush=True)
    i = start
    while True:
        batch = [block(j) for j in range(i, i + (1 if i % 3 else 4))]  # single writes and group commits
        while True:
            try:
                tier.write_many(batch) if len(batch) > 1 else tier.write(*batch[0])
                break
            except CapacityExceeded:  # make room the way the tier manager does
                victim = next(tier.victims())
                tier.delete(victim)
                print(f"E {victim.hex()}", flush=True)
        for j, (meta, _) in enumerate(batch, start=i):
            print(f"W {j} {meta.key.hex()}", flush=True)
        i += len(batch)


if __name__ == "__main__":
    main()

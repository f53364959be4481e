"""Client-side helpers for the load and fault tests, importable and runnable as a script.

As a module it defines the deterministic workload both sides agree on: chains of
chunk keys (each block's parent is the previous key of its chain), a size and a
payload derived from each key alone, so any client in any process can check any
block it gets back byte for byte.

As a script it is one client process::

    _client_worker.py load TARGET SECONDS SEED TRANSPORT NCHAINS CHAINLEN
                                                             mixed put/get/match load; prints RESULT {json}
    _client_worker.py reserve UNIX_TARGET KEYHEX NBYTES      raw Reserve, half the bytes in, then wait to be killed
    _client_worker.py acquire UNIX_TARGET KEYHEX...          raw Acquire, then wait to be killed
    _client_worker.py putstream TARGET KEYHEX NBYTES         PutStream of half a block, then wait to be killed

The fault tests SIGKILL the waiting modes after the line that says the resource is held.
"""

from __future__ import annotations

import json
import random
import struct
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

NAMESPACE = b"loadtest"
NO_PARENT = bytes(16)
KIB = 1 << 10
MIB = 1 << 20
# mixed block sizes, 64 KiB to 2 MiB; a key-derived jitter makes most of them end mid-page
SIZES = (64 * KIB, 128 * KIB, 256 * KIB, 512 * KIB, 768 * KIB, 1 * MIB, 1536 * KIB, 2 * MIB)
STAMP_EVERY = 64 * KIB
MAX_PAYLOAD = 16 * MIB  # payload() serves up to this many bytes
_BASE = np.random.default_rng(20240607).integers(0, 256, MAX_PAYLOAD + 8 * MIB, dtype=np.uint8)


# -- the workload ------------------------------------------------------------------------
def chain_keys(chain: int, length: int, *, salt: bytes = b"") -> list[bytes]:
    """Keys of one chain: ``key_i = xxh3_128(key_{i-1} || salt || chain || i)``."""
    keys, prev = [], NAMESPACE + bytes(8)
    for i in range(length):
        prev = xxhash.xxh3_128_digest(prev + salt + struct.pack("<QQ", chain, i))
        keys.append(prev)
    return keys


def parents_of(keys: Sequence[bytes]) -> list[bytes]:
    return [NO_PARENT, *keys[:-1]]


def size_of(key: bytes) -> int:
    base = SIZES[key[0] % len(SIZES)]
    jitter = int.from_bytes(key[1:3], "little") % 4096
    return base if key[3] % 4 == 0 else base - jitter


def payload(key: bytes, n: int | None = None) -> np.ndarray:
    """The one payload ``key`` may have: a key-chosen window of a fixed random buffer, with
    the key stamped every 64 KiB and at the end (so blocks that share a window differ)."""
    n = size_of(key) if n is None else n
    assert 16 <= n <= MAX_PAYLOAD, n
    off = int.from_bytes(key[4:8], "little") % (len(_BASE) - n)
    out = _BASE[off : off + n].copy()
    k = np.frombuffer(key, dtype=np.uint8)
    full = (n // STAMP_EVERY) * STAMP_EVERY
    if full:
        out[:full].reshape(-1, STAMP_EVERY)[:, :16] = k
    out[-16:] = k
    return out


def verify(key: bytes, got: object) -> bool:
    """True iff ``got`` is exactly ``key``'s payload."""
    exp = payload(key)
    mv = memoryview(got).cast("B")  # type: ignore[arg-type]
    return mv.nbytes == exp.nbytes and mv == memoryview(exp)


# -- one load client ---------------------------------------------------------------------
class LoadStats:
    """What one client did.  ``errors`` holds formatted exceptions (there must be none)."""

    def __init__(self) -> None:
        self.c: Counter[str] = Counter()
        self.errors: list[str] = []
        self.bad: list[str] = []  # keys whose returned bytes did not verify
        self.stored: set[bytes] = set()  # keys this client saw stored (a put answered True, or a hit)

    def merge(self, d: dict[str, Any]) -> None:
        self.c.update(d["counters"])
        self.errors += d["errors"]
        self.bad += d["bad"]

    def as_dict(self) -> dict[str, Any]:
        return {"counters": dict(self.c), "errors": self.errors[:20], "bad": self.bad[:20]}


class Workload:
    """Random mixed operations over ``n_chains`` chains of ``chain_len`` keys; a hot set gets half the picks."""

    def __init__(self, n_chains: int, chain_len: int, *, hot: int = 8, salt: bytes = b"") -> None:
        self.n_chains, self.chain_len, self.hot = n_chains, chain_len, hot
        self.chains = [chain_keys(c, chain_len, salt=salt) for c in range(n_chains)]

    def working_set_bytes(self) -> int:
        return sum(size_of(k) for ch in self.chains for k in ch)

    def pick(self, rng: random.Random) -> list[bytes]:
        c = rng.randrange(self.hot) if rng.random() < 0.5 else rng.randrange(self.n_chains)
        return self.chains[c][: rng.randint(1, self.chain_len)]


def _check(
    stats: LoadStats, keys: Sequence[bytes], got: Sequence[Any], outs: Sequence[np.ndarray] | None = None
) -> None:
    for i, (k, g) in enumerate(zip(keys, got)):
        if g is None:
            stats.c["misses"] += 1
            if k in stats.stored:  # this client saw it stored before: evicted from every tier, or lost
                stats.c["misses_after_stored"] += 1
            continue
        stats.c["hits"] += 1
        stats.stored.add(k)
        if outs is not None:
            ok = g == size_of(k) and verify(k, outs[i][:g])
            stats.c["bytes_got"] += g
        else:
            ok = verify(k, g)
            stats.c["bytes_got"] += len(g)
        if not ok:
            stats.bad.append(k.hex())


def run_load(
    kv: Any, workload: Workload, seconds: float, seed: int, *, call: Callable[[Any], Any] = lambda x: x
) -> LoadStats:
    """Drive ``kv`` (a ``KVClient``; with ``call`` an ``AsyncKVClient`` whose coroutines ``call`` runs)."""
    rng = random.Random(seed)
    stats = LoadStats()
    outs = [np.empty(max(SIZES), dtype=np.uint8) for _ in range(workload.chain_len)]
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        keys = workload.pick(rng)
        op = rng.choices(("put", "get", "get_into", "match"), weights=(3, 3, 2, 2))[0]
        t0 = time.monotonic()
        try:
            if op == "put":
                datas = [payload(k) for k in keys]
                ok = call(kv.put_many(keys, datas, namespace=NAMESPACE, parents=parents_of(keys)))
                stats.c["blocks_put"] += sum(ok)
                stats.stored.update(k for k, good in zip(keys, ok) if good)
                stats.c["puts_refused"] += len(ok) - sum(ok)  # no room right now: not an error
                stats.c["bytes_put"] += sum(d.nbytes for d, good in zip(datas, ok) if good)
            elif op == "get":
                _check(stats, keys, call(kv.get_many(keys)))
            elif op == "get_into":
                _check(stats, keys, call(kv.get_many_into(keys, outs[: len(keys)])), outs)
            else:
                n = call(kv.match_prefix(keys))
                stats.c["match_keys"] += len(keys)
                stats.c["match_hits"] += n
                if n:
                    _check(stats, keys[:n], call(kv.get_many(keys[:n])))
            stats.c["ops"] += 1
            stats.c[f"ops_{op}"] += 1
            stats.c["max_op_ms"] = max(stats.c["max_op_ms"], int((time.monotonic() - t0) * 1000))
        except Exception:
            stats.errors.append(f"{op}: {traceback.format_exc()}")
            time.sleep(0.05)
    return stats


# -- script modes ------------------------------------------------------------------------
def _stub(target: str) -> Any:
    import grpc

    from protos.kvstore.v1 import kvstore_pb2_grpc as pb_grpc

    return pb_grpc.KVStoreStub(grpc.insecure_channel(target))


def _block_info(key: bytes, n: int, data: np.ndarray | None = None) -> Any:
    from kvstore.block import checksum
    from protos.kvstore.v1 import kvstore_pb2 as pb

    data = payload(key, n) if data is None else data
    return pb.BlockInfo(
        key=key,
        parent=NO_PARENT,
        namespace=NAMESPACE,
        dtype="uint8",
        shape=[n],
        payload_len=n,
        payload_checksum=checksum(data),
    )


def _wait_forever() -> None:
    while True:
        time.sleep(60)


def _mode_load(target: str, seconds: str, seed: str, transport: str, n_chains: str, chain_len: str) -> None:
    from client import KVClient, Timeouts

    wl = Workload(int(n_chains), int(chain_len))
    with KVClient(target, transport=transport, timeouts=Timeouts(rpc=30, data=60)) as kv:
        stats = run_load(kv, wl, float(seconds), int(seed))
    print("RESULT " + json.dumps(stats.as_dict()), flush=True)


def _mode_reserve(target: str, keyhex: str, nbytes: str) -> None:
    from kvstore.wire import extents_from_pb
    from protos.kvstore.v1 import kvstore_pb2 as pb
    from tiers.arena import Arena

    key, n = bytes.fromhex(keyhex), int(nbytes)
    stub = _stub(target)
    hello = stub.Hello(pb.HelloRequest(), timeout=10)
    arena = Arena.attach(hello.arena_path, hello.arena_size)
    data = payload(key, n)
    resp = stub.Reserve(pb.ReserveRequest(blocks=[_block_info(key, n, data)]), timeout=10)
    (r,) = resp.reservations
    assert r.status == pb.KEY_STATUS_OK, r
    # half the payload is in when we die: none of it may ever become visible
    views = arena.views(extents_from_pb(r.extents), n)
    pos, half = 0, n // 2
    for v in views:
        m = min(v.nbytes, half - pos)
        if m <= 0:
            break
        v[:m] = memoryview(data)[pos : pos + m]
        pos += m
    print(f"RESERVED {r.reservation_id}", flush=True)
    _wait_forever()


def _mode_acquire(target: str, *keyhexes: str) -> None:
    from protos.kvstore.v1 import kvstore_pb2 as pb

    stub = _stub(target)
    resp = stub.Acquire(pb.KeysRequest(keys=[bytes.fromhex(k) for k in keyhexes]), timeout=30)
    ok = sum(x.status == pb.KEY_STATUS_OK for x in resp.leases)
    print(f"LEASED {ok}", flush=True)
    _wait_forever()


def _mode_putstream(target: str, keyhex: str, nbytes: str) -> None:
    from protos.kvstore.v1 import kvstore_pb2 as pb

    key, n = bytes.fromhex(keyhex), int(nbytes)
    data = payload(key, n)
    stub = _stub(target)

    def chunks() -> Any:
        yield pb.BlockChunk(block=_block_info(key, n, data), data=data[: n // 4].tobytes())
        yield pb.BlockChunk(data=data[n // 4 : n // 2].tobytes())
        print("SENT", flush=True)
        _wait_forever()

    stub.PutStream(chunks(), timeout=600)


MODES = {"load": _mode_load, "reserve": _mode_reserve, "acquire": _mode_acquire, "putstream": _mode_putstream}

if __name__ == "__main__":
    MODES[sys.argv[1]](*sys.argv[2:])

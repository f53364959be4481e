"""How an SDK operation moves block bytes: one :class:`Transport` object per client core.

The core (:mod:`client._core`) does what every transport shares (validation, metadata,
batching by the node's ``max_batch`` and a byte budget, retries of keys the node could not
bring into DRAM) and hands each batch to its transport's ``put`` / ``get``, which are
sans-I/O operations too (they yield :mod:`client._instructions`):

* :class:`SharedMemory` (``"shm"``, ``unix://`` targets): gRPC carries only extents and
  leases; the bytes are copied between the caller's buffer and the node's arena, which this
  process maps once (:class:`kvstore.shm.ArenaMapping`).  Checksums are computed while
  copying and sent with ``Commit``.
* :class:`DataChannel` (``"data-channel"``, ``host:port`` targets): the bytes go on a raw
  TCP socket (:mod:`client._datachannel`), straight from and into the caller's buffers;
  TLS-wrapped when the client has TLS settings.
* :class:`GrpcStream` (``"grpc-stream"``): the slow streaming fallback, inside gRPC.

Each transport object lives as long as its core: ``connect(...)`` after every ``Hello``
(re)binds it to the node that answered (a restarted node has a new arena file or data
port).  Owner: the core; the arena mapping and the data-channel pool are thread-safe for
the disjoint copies the operations make.  Tests may pass their own :class:`Transport` (an
in-process fake: ``tests/unit/test_client_core.py``).
"""

from __future__ import annotations

import abc
import time
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

from client._datachannel import DataChannelPool
from client._instructions import RETRY, GetStream, Io, Op, PutStream, Rpc, RpcNoWait, best_effort, dest_view
from kvstore.block import BlockMeta, verify_payload
from kvstore.errors import BlockFormatError, InvalidArgument, Unavailable
from kvstore.keys import ChunkKey
from kvstore.shm import ArenaMapping
from kvstore.vocabulary import Extent
from kvstore.wire import (
    PACKED_VERSION,
    extents_from_pb,
    from_u32s,
    from_u64s,
    meta_from_pb,
    meta_to_pb,
    metas_to_packed,
)
from protos.kvstore.v1 import kvstore_pb2 as pb

STREAM_CHUNK = 1 << 20
# A put stream's blocks are all reserved until the stream ends (the node commits them
# together): this many bytes per stream keep it far inside the reservation deadline.
STREAM_BATCH_BYTES = 256 << 20


class Transport(abc.ABC):
    """How one client core moves block bytes to and from its node."""

    name: ClassVar[str]
    hashes_while_copying: ClassVar[bool] = False  # put() computes the checksums itself (else the core does)
    batch_bytes: ClassVar[int | None] = None  # a byte budget per put batch tighter than the core's default

    def connect(self, *, host: str, hello: pb.HelloResponse, timeouts: Any, tls: Any) -> None:
        """Bind to the node that answered ``hello`` (again after a restart).  Raises
        ``Unavailable`` if this transport cannot reach it.  The default has nothing to bind."""
        return None

    def stale(self) -> bool:
        """True if the node is known to have restarted since ``connect`` (ask ``Hello`` again)."""
        return False

    @abc.abstractmethod
    def put(self, metas: list[BlockMeta], views: list[memoryview], sid: str) -> Op[list[bool]]:
        """Store one batch (metadata checksummed unless ``hashes_while_copying``); stored per block."""

    @abc.abstractmethod
    def get(self, keys: list[ChunkKey], outs: list[memoryview] | None, sid: str, *, verify: bool) -> Op[list[Any]]:
        """Read one batch: per key the bytes written into ``outs[i]`` (or a new ``bytes`` without
        ``outs``), None for a miss, or ``RETRY`` for a key the node could not bring into DRAM now."""

    def close(self) -> None:
        """Give back what ``connect`` took (sockets, mappings).  The default took nothing."""
        return None


class SharedMemory(Transport):
    name = "shm"
    hashes_while_copying = True

    def __init__(self) -> None:
        self.arena: ArenaMapping | None = None
        self.packed = False  # the node takes and answers packed batches (Hello's packed_version)

    def connect(self, *, host: str, hello: pb.HelloResponse, timeouts: Any, tls: Any) -> None:
        # not closing an earlier mapping: another thread's copy may still be using it
        self.arena = ArenaMapping.attach(hello.arena_path, hello.arena_size)
        self.packed = hello.packed_version >= PACKED_VERSION

    def stale(self) -> bool:
        """The node restarted (or stopped) since we mapped its arena: it replaced the file, so
        our mapping is a dead arena.  Seen even by a client that made no call meanwhile (one
        stat, about a microsecond)."""
        return self.arena is not None and self.arena.replaced()

    def live_arena(self, granted: Sequence[int], undo: str, undo_request: Any) -> Op[ArenaMapping]:
        """The arena that Reserve/Acquire grants refer to, checked after the call (a node
        restarted since the core's ``Hello`` may have answered it; read after the call, so it is
        what another thread's reconnect mapped meanwhile).  If the node replaced its arena,
        give the grants back (``undo``) and fail like any call during a restart."""
        arena = self.arena
        if arena is None:
            raise Unavailable("this client has not mapped the node's arena (no Hello yet)")
        if granted and arena.replaced():
            yield from best_effort(undo, undo_request)
            raise Unavailable("the node restarted (its arena file was replaced); the next call reconnects")
        return arena

    def put(self, metas: list[BlockMeta], views: list[memoryview], sid: str) -> Op[list[bool]]:
        t0 = time.monotonic()
        packed = metas_to_packed(metas) if self.packed else None
        if packed is not None:
            resp = yield Rpc("Reserve", pb.ReserveRequest(packed=packed, session_id=sid))
        else:
            resp = yield Rpc("Reserve", pb.ReserveRequest(blocks=[meta_to_pb(m) for m in metas], session_id=sid))
        # The node started the reservations' deadline after t0.  Past it, their space may
        # already be another block's: a block whose copy would start that late is not copied.
        stop_at = t0 + resp.ttl_s - min(1.0, 0.1 * resp.ttl_s)
        ids: list[int] = []
        todo: list[tuple[int, list[Extent]]] = []
        out = [False] * len(metas)
        if packed is not None:
            _unpack_grants(resp.packed, len(metas), ids, todo)
            for i, st in enumerate(resp.packed.statuses):
                out[i] = st == pb.KEY_STATUS_EXISTS
        else:
            for i, r in enumerate(resp.reservations):
                if r.status == pb.KEY_STATUS_EXISTS:
                    out[i] = True
                elif r.status == pb.KEY_STATUS_OK:
                    ids.append(r.reservation_id)
                    todo.append((i, extents_from_pb(r.extents)))
        if not ids:
            return out
        arena = yield from self.live_arena(ids, "Abort", pb.AbortRequest(reservation_ids=ids))

        def copy_in() -> list[int]:
            # hashing each chunk right after copying it, while it is in cache, costs ~0.15x a copy;
            # hashing the payload first (a second pass over main memory) costs ~0.4x
            sums = []
            for i, extents in todo:
                if time.monotonic() >= stop_at:
                    break
                sums.append(arena.write_hashed(extents, views[i]))
            return sums

        try:
            sums = yield Io(copy_in)
        except BaseException:
            yield from best_effort("Abort", pb.AbortRequest(reservation_ids=ids))
            raise
        if len(sums) < len(ids):  # too slow: the rest are not stored
            yield from best_effort("Abort", pb.AbortRequest(reservation_ids=ids[len(sums) :]))
            ids = ids[: len(sums)]
            if not ids:
                return out
        resp = yield Rpc("Commit", pb.CommitRequest(reservation_ids=ids, payload_checksums=sums))
        for (i, _), st in zip(todo, resp.statuses):
            out[i] = st == pb.KEY_STATUS_OK
        return out

    def get(self, keys: list[ChunkKey], outs: list[memoryview] | None, sid: str, *, verify: bool) -> Op[list[Any]]:
        t0 = time.monotonic()
        if self.packed:
            resp = yield Rpc("Acquire", pb.KeysRequest(packed_keys=b"".join(keys), session_id=sid))
            grants = _unpack_leases(resp.packed, len(keys))
        else:
            resp = yield Rpc("Acquire", pb.KeysRequest(keys=keys, session_id=sid))
            grants = [
                (x.status, x.lease_id, extents_from_pb(x.extents), x.block.payload_len, x.block.key)
                for x in resp.leases
            ]
        ids = [g[1] for g in grants if g[0] == pb.KEY_STATUS_OK]
        result: list[Any] = [None] * len(keys)
        arena = yield from self.live_arena(ids, "Release", pb.ReleaseRequest(lease_ids=ids))
        try:
            plan = []
            for i, (status, _, extents, length, key) in enumerate(grants):
                if status == pb.KEY_STATUS_NO_SPACE:
                    result[i] = RETRY
                elif status == pb.KEY_STATUS_OK:
                    dest = _dest(outs[i], length, key or keys[i]) if outs is not None else None
                    plan.append((i, extents, length, dest))
            copied: list[Any] = []

            def copy_out() -> None:
                for _, extents, length, dest in plan:
                    if dest is not None:
                        arena.read_into(extents, dest, length)
                        copied.append(length)
                    else:  # get(): one copy, arena -> a new bytes object
                        views = arena.views(extents, length)
                        copied.append(bytes(views[0]) if len(views) == 1 else b"".join(views))

            yield Io(copy_out)
        except BaseException:
            if ids:
                yield from best_effort("Release", pb.ReleaseRequest(lease_ids=ids))
            raise
        if not ids:
            valid: Sequence[bool] = []
        elif time.monotonic() - t0 < resp.ttl_s - min(1.0, 0.1 * resp.ttl_s):
            # The copy ended well before the leases' deadline (which the node started after
            # t0), so no lease can have expired under it: release without waiting for the answer.
            yield RpcNoWait("Release", pb.ReleaseRequest(lease_ids=ids))
            valid = [True] * len(ids)
        else:
            valid = (yield Rpc("Release", pb.ReleaseRequest(lease_ids=ids))).valid
        for (i, _, _, _), ok, value in zip(plan, valid, copied):
            if ok:  # an expired lease means the bytes may have been reused under us: a miss
                result[i] = value
        return result

    def close(self) -> None:
        if self.arena is not None:
            self.arena.close(unlink=False)
            self.arena = None


class DataChannel(Transport):
    name = "data-channel"

    def __init__(self) -> None:
        self.pool: DataChannelPool | None = None
        self.packed = False  # the node takes and answers packed batches (Hello's packed_version)

    def connect(self, *, host: str, hello: pb.HelloResponse, timeouts: Any, tls: Any) -> None:
        self.packed = hello.packed_version >= PACKED_VERSION
        if self.pool is not None:  # a restarted node: the old port is gone
            self.pool.close()
        self.pool = DataChannelPool(
            host, hello.data_port, connect_timeout=timeouts.connect, io_timeout=timeouts.data, tls=tls
        )

    def put(self, metas: list[BlockMeta], views: list[memoryview], sid: str) -> Op[list[bool]]:
        assert self.pool is not None, "put before connect"
        packed = metas_to_packed(metas) if self.packed else None
        if packed is not None:
            resp = yield Rpc("StartPut", pb.ReserveRequest(packed=packed, session_id=sid))
        else:
            resp = yield Rpc("StartPut", pb.ReserveRequest(blocks=[meta_to_pb(m) for m in metas], session_id=sid))
        out = [s == pb.KEY_STATUS_EXISTS for s in resp.statuses]
        send = [i for i, s in enumerate(resp.statuses) if s == pb.KEY_STATUS_OK]
        if not send:
            return out
        pool, tid = self.pool, resp.transfer_id
        statuses = yield Io(lambda: pool.put(tid, [views[i] for i in send]))
        for i, st in zip(send, statuses):
            out[i] = st == pb.KEY_STATUS_OK
        return out

    def get(self, keys: list[ChunkKey], outs: list[memoryview] | None, sid: str, *, verify: bool) -> Op[list[Any]]:
        assert self.pool is not None, "get before connect"
        # per key: (status, lease id, payload length, payload checksum)
        grants: list[tuple[int, int, int, int]]
        if self.packed:
            resp = yield Rpc("StartGet", pb.KeysRequest(packed_keys=b"".join(keys), session_id=sid))
            p = resp.packed
            ids, lens, sums = from_u64s(p.ids), from_u64s(p.payload_lens), from_u64s(p.payload_checksums)
            if not len(p.statuses) == len(ids) == len(lens) == len(sums) == len(keys):
                raise Unavailable(f"the node answered a malformed packed batch for {len(keys)} keys")
            grants = list(zip(p.statuses, ids, lens, sums))
        else:
            resp = yield Rpc("StartGet", pb.KeysRequest(keys=keys, session_id=sid))
            grants = []
            for x in resp.leases:
                if x.status == pb.KEY_STATUS_OK:
                    meta = meta_from_pb(x.block)
                    grants.append((x.status, x.lease_id, meta.payload_len, meta.payload_checksum))
                else:
                    grants.append((x.status, x.lease_id, 0, 0))
        plan = []
        result: list[Any] = [None] * len(keys)
        try:
            for i, (status, _, length, checksum) in enumerate(grants):
                if status == pb.KEY_STATUS_NO_SPACE:
                    result[i] = RETRY
                elif status == pb.KEY_STATUS_OK:
                    dest = _dest(outs[i], length, keys[i]) if outs else memoryview(bytearray(length))
                    plan.append((i, length, checksum, dest))
        except BaseException:
            # no bytes will be fetched (e.g. an output buffer is too small): give the leases back
            # now rather than leaving them pinned until the transfer expires
            ids = [g[1] for g in grants if g[0] == pb.KEY_STATUS_OK]
            if ids:
                yield from best_effort("Release", pb.ReleaseRequest(lease_ids=ids))
            raise
        if not plan:
            return result
        pool, tid = self.pool, resp.transfer_id
        got = yield Io(lambda: pool.get(tid, [d for _, _, _, d in plan], hashed=verify))
        for n, (i, length, checksum, dest) in enumerate(plan):
            if verify and got[n] != checksum:
                continue  # corrupted in flight: a miss, never wrong bytes
            result[i] = length if outs is not None else bytes(dest)
        return result

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


class GrpcStream(Transport):
    name = "grpc-stream"
    batch_bytes = STREAM_BATCH_BYTES

    def put(self, metas: list[BlockMeta], views: list[memoryview], sid: str) -> Op[list[bool]]:
        def chunks() -> Iterator[pb.BlockChunk]:
            for m, v in zip(metas, views):
                first = True
                for off in range(0, max(v.nbytes, 1), STREAM_CHUNK):
                    data = bytes(v[off : off + STREAM_CHUNK])
                    yield (
                        pb.BlockChunk(block=meta_to_pb(m), data=data, session_id=sid)
                        if first
                        else pb.BlockChunk(data=data)
                    )
                    first = False

        resp = yield PutStream(chunks, len(metas))
        return [s in (pb.KEY_STATUS_OK, pb.KEY_STATUS_EXISTS) for s in resp.statuses]

    def get(self, keys: list[ChunkKey], outs: list[memoryview] | None, sid: str, *, verify: bool) -> Op[list[Any]]:
        chunks = yield GetStream(pb.KeysRequest(keys=keys, session_id=sid))
        result: list[Any] = [None] * len(keys)
        idx = -1
        meta: BlockMeta | None = None
        dest: memoryview | None = None
        pos = 0

        def done() -> None:
            if meta is not None and dest is not None and pos == meta.payload_len:
                try:
                    if verify:
                        verify_payload(meta, dest)
                    result[idx] = meta.payload_len if outs is not None else bytes(dest)
                except BlockFormatError:
                    pass

        for c in chunks:
            if c.HasField("block"):
                done()
                idx += 1
                meta, dest, pos = None, None, 0
                if c.status != pb.KEY_STATUS_OK:
                    continue
                meta = meta_from_pb(c.block)
                dest = dest_view(meta, outs[idx] if outs else None)
            if dest is not None and c.data:
                n = len(c.data)
                if pos + n > dest.nbytes:
                    raise Unavailable("stream carried more bytes than the block header says")
                dest[pos : pos + n] = c.data
                pos += n
        done()
        return result


def _dest(out: memoryview, length: int, key: bytes) -> memoryview:
    """The caller's buffer cut to a block's payload (``dest_view`` without a meta)."""
    if out.nbytes < length:
        raise InvalidArgument(f"output buffer holds {out.nbytes} bytes; block {key.hex()} has {length}")
    return out[:length] if out.nbytes != length else out


def _extents(counts: list[int], flat: list[int]) -> list[list[Extent]]:
    """Per block, its extents from ``extent_counts`` and the flat (offset, length) column."""
    if len(flat) != 2 * sum(counts):
        raise Unavailable("the node answered a malformed packed batch (extents do not match their counts)")
    out: list[list[Extent]] = []
    pos = 0
    for c in counts:
        if c == 1:  # the usual case
            out.append([Extent(flat[pos], flat[pos + 1])])
        else:
            out.append([Extent(flat[j], flat[j + 1]) for j in range(pos, pos + 2 * c, 2)])
        pos += 2 * c
    return out


def _unpack_grants(p: pb.PackedReservations, n: int, ids: list[int], todo: list[tuple[int, list[Extent]]]) -> None:
    """Append the granted reservations of a packed ``Reserve`` answer to ``ids`` / ``todo``."""
    statuses = p.statuses
    if len(statuses) != n:
        raise Unavailable(f"the node answered {len(statuses)} reservations for {n} blocks")
    all_ids = from_u64s(p.ids)
    counts = from_u32s(p.extent_counts)
    if len(all_ids) != n or len(counts) != n:
        raise Unavailable("the node answered a malformed packed batch (columns disagree in length)")
    ok = [i for i in range(n) if statuses[i] == pb.KEY_STATUS_OK]
    extents = _extents([counts[i] for i in ok], from_u64s(p.extents))
    for i, e in zip(ok, extents):
        ids.append(all_ids[i])
        todo.append((i, e))


def _unpack_leases(p: pb.PackedLeases, n: int) -> list[tuple[int, int, list[Extent], int, bytes]]:
    """A packed ``Acquire`` answer as ``(status, lease id, extents, payload length, b"")`` per key."""
    statuses = p.statuses
    ids, counts, lens = from_u64s(p.ids), from_u32s(p.extent_counts), from_u64s(p.payload_lens)
    if len(statuses) != n or len(ids) != n or len(counts) != n or len(lens) != n:
        raise Unavailable(f"the node answered a malformed packed batch for {n} keys (columns disagree in length)")
    ok = [i for i in range(n) if statuses[i] == pb.KEY_STATUS_OK]
    extents = iter(_extents([counts[i] for i in ok], from_u64s(p.extents)))
    none: list[Extent] = []
    return [
        (st, ids[i], next(extents) if st == pb.KEY_STATUS_OK else none, lens[i], b"") for i, st in enumerate(statuses)
    ]


BY_NAME: dict[str, type[Transport]] = {t.name: t for t in (SharedMemory, DataChannel, GrpcStream)}

"""The gRPC servicer: validates requests, calls the tier manager, maps errors to status codes.

Owner: nothing of its own beyond the transfer table; runs on the node's event loop
(``grpc.aio``) next to the tier manager, so it calls the manager directly.
Limits (keys per batch, block size) are enforced here, before any state changes.
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from kvstore import __version__, errors
from kvstore.block import BlockMeta
from kvstore.config import NodeConfig
from kvstore.datachannel import OP_GET, OP_PUT, Transfer, TransferTable
from kvstore.keys import ChunkKey, check_key
from kvstore.manager import Status, TierManager
from kvstore.metrics import NodeMetrics
from kvstore.wire import ERROR_METADATA_KEY, extents_to_pb, meta_from_pb, meta_to_pb, status_for, tier_to_pb
from protos.kvstore.v1 import kvstore_pb2 as pb
from protos.kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from tiers.base import TierKind

log = logging.getLogger(__name__)

STREAM_CHUNK = 1 << 20


class Malformed:
    """Stands in for a request whose bytes did not parse as its protobuf message.

    grpc answers a deserializer exception with UNKNOWN (and logs a traceback); the
    servicer turns this placeholder into INVALID_ARGUMENT like any other bad input.
    """

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error

    def invalid(self) -> errors.InvalidArgument:
        return errors.InvalidArgument(f"malformed request message: {self.error}")


def _lenient(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def parse_or_flag(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError as e:
            return Malformed(str(e))

    return parse_or_flag


class DecodeGuard(grpc.aio.ServerInterceptor):
    """Lets the KVStore servicer see undecodable requests (as :class:`Malformed`) and reject them itself."""

    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None or not details.method.startswith("/kvstore.v1.KVStore/"):
            return handler
        return handler._replace(request_deserializer=_lenient(handler.request_deserializer))


def _rpc(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """Map typed errors to gRPC status codes with the error's name in trailing metadata;
    time the call into ``kvstore_rpc_duration_seconds``."""
    method = fn.__name__

    @functools.wraps(fn)
    async def wrapper(self: "KVStoreService", request: Any, context: grpc.aio.ServicerContext) -> Any:
        start = time.perf_counter()
        error: str | None = None
        try:
            if isinstance(request, Malformed):
                raise request.invalid()
            return await fn(self, request, context)
        except errors.KVStoreError as e:
            error = type(e).__name__
            context.set_trailing_metadata(((ERROR_METADATA_KEY, error),))
            await context.abort(status_for(e), str(e))
        except ValueError as e:  # malformed protobuf contents that slipped past validation
            error = "InvalidArgument"
            context.set_trailing_metadata(((ERROR_METADATA_KEY, error),))
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        finally:
            if self.metrics is not None:
                self.metrics.observe_rpc(method, time.perf_counter() - start, error)

    return wrapper


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without ``authorization: Bearer <token>``; health checks stay open for probes."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        if details.method.startswith("/grpc.health.v1.Health/"):
            return await continuation(details)
        got = dict(details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(str(got).encode(), self._expected):
            return await continuation(details)
        return _deny


async def _deny_unary(request: Any, context: grpc.aio.ServicerContext) -> None:
    context.set_trailing_metadata(((ERROR_METADATA_KEY, "Unauthenticated"),))
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")


_deny = grpc.unary_unary_rpc_method_handler(_deny_unary)


class KVStoreService(pb_grpc.KVStoreServicer):
    def __init__(self, manager: TierManager, config: NodeConfig, *, arena_path: str, arena_size: int, data_port: int,
                 metrics: NodeMetrics | None = None) -> None:
        self.m = manager
        self.cfg = config
        self.metrics = metrics
        self.transfers = TransferTable(manager.clock)
        self._transfer_started: dict[int, float] = {}  # id(transfer) -> perf_counter at take
        self._hello = pb.HelloResponse(
            node_id=config.node_id,
            version=__version__,
            arena_path=arena_path,
            arena_size=arena_size,
            data_port=data_port,
            max_block_bytes=config.max_block_bytes,
            max_batch=config.max_batch,
            lease_ttl_s=config.lease_ttl_s,
            reservation_ttl_s=config.reservation_ttl_s,
        )

    # -- validation -----------------------------------------------------------------
    def _keys(self, raw: Sequence[bytes]) -> list[ChunkKey]:
        if len(raw) > self.cfg.max_batch:
            raise errors.InvalidArgument(f"{len(raw)} keys in one request; the limit is max_batch={self.cfg.max_batch}")
        return [check_key(k) for k in raw]

    def _metas(self, blocks: Sequence[pb.BlockInfo]) -> list[BlockMeta]:
        if len(blocks) > self.cfg.max_batch:
            raise errors.InvalidArgument(f"{len(blocks)} blocks in one request; the limit is max_batch={self.cfg.max_batch}")
        metas = [meta_from_pb(b) for b in blocks]
        for m in metas:
            if m.payload_len > self.cfg.max_block_bytes:
                raise errors.InvalidArgument(
                    f"block of {m.payload_len} bytes exceeds max_block_bytes={self.cfg.max_block_bytes}"
                )
        return metas

    def _lease_pb(self, leased: Any) -> pb.Lease:
        return pb.Lease(
            status=int(leased.status),
            lease_id=leased.lease_id,
            extents=extents_to_pb(leased.extents),
            block=meta_to_pb(leased.meta) if leased.meta is not None else pb.BlockInfo(key=leased.key),
            tier=tier_to_pb(leased.tier),
        )

    # -- RPCs -----------------------------------------------------------------------
    @_rpc
    async def Hello(self, request: pb.HelloRequest, context: Any) -> pb.HelloResponse:
        return self._hello

    @_rpc
    async def Lookup(self, request: pb.KeysRequest, context: Any) -> pb.LookupResponse:
        return pb.LookupResponse(tiers=[tier_to_pb(t) for t in self.m.exists(self._keys(request.keys))])

    @_rpc
    async def MatchPrefix(self, request: pb.KeysRequest, context: Any) -> pb.MatchPrefixResponse:
        n, tiers = self.m.match_prefix(self._keys(request.keys))
        return pb.MatchPrefixResponse(matched=n, tiers=[int(t) for t in tiers])

    @_rpc
    async def Reserve(self, request: pb.ReserveRequest, context: Any) -> pb.ReserveResponse:
        res = await self.m.reserve(self._metas(request.blocks))
        return pb.ReserveResponse(
            reservations=[pb.Reservation(status=int(r.status), reservation_id=r.reservation_id, extents=extents_to_pb(r.extents)) for r in res],
            ttl_s=self.m.reservation_ttl,
        )

    @_rpc
    async def Commit(self, request: pb.CommitRequest, context: Any) -> pb.StatusesResponse:
        ids = list(request.reservation_ids)
        sums = list(request.payload_checksums) or None
        if len(ids) > self.cfg.max_batch:
            raise errors.InvalidArgument(f"{len(ids)} ids in one request; the limit is {self.cfg.max_batch}")
        sizes = [r[0].payload_len if (r := self.m.reservation(rid)) else 0 for rid in ids]
        statuses = await self.m.commit(ids, sums)
        self.m.counters["local_bytes_in"] += sum(n for n, st in zip(sizes, statuses) if st == Status.OK)
        return pb.StatusesResponse(statuses=[int(s) for s in statuses])

    @_rpc
    async def Abort(self, request: pb.AbortRequest, context: Any) -> pb.Empty:
        self.m.abort(list(request.reservation_ids))
        return pb.Empty()

    @_rpc
    async def Acquire(self, request: pb.KeysRequest, context: Any) -> pb.AcquireResponse:
        leased = await self.m.acquire(self._keys(request.keys))
        self.m.counters["local_bytes_out"] += sum(x.meta.payload_len for x in leased if x.status == Status.OK)
        return pb.AcquireResponse(leases=[self._lease_pb(x) for x in leased], ttl_s=self.m.lease_ttl)

    @_rpc
    async def Release(self, request: pb.ReleaseRequest, context: Any) -> pb.ReleaseResponse:
        return pb.ReleaseResponse(valid=self.m.release(list(request.lease_ids)))

    @_rpc
    async def StartGet(self, request: pb.KeysRequest, context: Any) -> pb.StartGetResponse:
        leased = await self.m.acquire(self._keys(request.keys))
        items = [(x.lease_id, x.meta, list(x.extents)) for x in leased if x.status == Status.OK]
        tid = self.transfers.add(Transfer(OP_GET, self.m.clock() + self.m.lease_ttl, items)) if items else b""
        return pb.StartGetResponse(transfer_id=tid, leases=[self._lease_pb(x) for x in leased], ttl_s=self.m.lease_ttl)

    @_rpc
    async def StartPut(self, request: pb.ReserveRequest, context: Any) -> pb.StartPutResponse:
        metas = self._metas(request.blocks)
        res = await self.m.reserve(metas)
        items = []
        for meta, r in zip(metas, res):
            if r.status == Status.OK:
                items.append((r.reservation_id, meta, list(r.extents)))
        tid = self.transfers.add(Transfer(OP_PUT, self.m.clock() + self.m.reservation_ttl, items)) if items else b""
        return pb.StartPutResponse(transfer_id=tid, statuses=[int(r.status) for r in res], ttl_s=self.m.reservation_ttl)

    # data-channel callbacks (run on the loop, called from data-channel threads)
    async def take_transfer(self, tid: bytes, op: int) -> Transfer | None:
        t = self.transfers.take(tid, op)
        if t is None:
            return None
        self._transfer_started[id(t)] = time.perf_counter()
        # The data channel now owns these until finish_get/finish_put: the reaper must not
        # free extents that a stalled transfer still sends from or receives into.
        ids = [i for i, _, _ in t.items]
        if op == OP_GET:
            if self.m.hold(lease_ids=ids):
                return t
            self.m.release(ids)
        else:
            if self.m.hold(reservation_ids=ids):
                return t
            self.m.abort(ids)
        return None  # some expired before the client came: refuse the whole transfer

    def _transfer_done(self, t: Transfer, op: str) -> None:
        start = self._transfer_started.pop(id(t), None)
        if start is not None and self.metrics is not None:
            self.metrics.transfer_seconds.labels(op).observe(time.perf_counter() - start)

    async def finish_get(self, t: Transfer, ok: bool) -> None:
        self._transfer_done(t, "get")
        self.m.release([lid for lid, _, _ in t.items])
        if ok:
            self.m.counters["tcp_bytes_out"] += sum(m.payload_len for _, m, _ in t.items)

    async def finish_put(self, t: Transfer, complete: bool) -> list[int]:
        self._transfer_done(t, "put")
        ids = [rid for rid, _, _ in t.items]
        if not complete:
            self.m.abort(ids)
            self.m.counters["data_channel_aborted_puts"] += len(ids)
            return [int(Status.EXPIRED)] * len(ids)
        statuses = await self.m.commit(ids, verify=True)
        self.m.counters["tcp_bytes_in"] += sum(m.payload_len for _, m, _ in t.items)
        return [int(s) for s in statuses]

    def expire_transfers(self) -> None:
        for t in self.transfers.expire():
            ids = [i for i, _, _ in t.items]
            if t.op == OP_GET:
                self.m.release(ids)
            else:
                self.m.abort(ids)

    # -- streaming fallback ------------------------------------------------------------
    @_rpc
    async def PutStream(self, request_iterator: Any, context: Any) -> pb.StatusesResponse:
        statuses: list[int] = []
        current: tuple[BlockMeta, int, list[Any], bytearray | None] | None = None  # meta, rid, extents, buf

        async def finish(cur: tuple[BlockMeta, int, list[Any], Any]) -> None:
            meta, rid, extents, filled = cur
            if rid == 0:
                return
            if filled != meta.payload_len:
                self.m.abort([rid])
                raise errors.InvalidArgument(
                    f"stream for key {meta.key.hex()} carried {filled} bytes; its header says {meta.payload_len}"
                )
            (st,) = await self.m.commit([rid], verify=True)
            statuses[-1] = int(st)
            if st == Status.OK:
                self.m.counters["grpc_stream_bytes_in"] += meta.payload_len

        try:
            async for chunk in request_iterator:
                if isinstance(chunk, Malformed):
                    raise chunk.invalid()
                if chunk.HasField("block"):
                    if current is not None:
                        await finish(current)
                    if len(statuses) >= self.cfg.max_batch:
                        raise errors.InvalidArgument(f"more than max_batch={self.cfg.max_batch} blocks in one stream")
                    (meta,) = self._metas([chunk.block])
                    (r,) = await self.m.reserve([meta])
                    statuses.append(int(r.status))
                    current = (meta, r.reservation_id if r.status == Status.OK else 0, list(r.extents), 0)
                if current is None:
                    raise errors.InvalidArgument("the first chunk of a put stream must carry its block header")
                meta, rid, extents, filled = current
                data = chunk.data
                if filled + len(data) > meta.payload_len:
                    if rid:
                        self.m.abort([rid])
                    current = None
                    raise errors.InvalidArgument(f"stream for key {meta.key.hex()} carries more bytes than its header says")
                if rid and self.m.reservation(rid) is None:
                    # reclaimed at its deadline while the client stalled: its space may be
                    # another block's by now, so not one more byte goes there
                    statuses[-1] = int(Status.EXPIRED)
                    rid = 0
                if rid and data:
                    views = self.m.dram.arena.views(extents, meta.payload_len)
                    _write_at(views, filled, memoryview(data))
                current = (meta, rid, extents, filled + len(data))
            if current is not None:
                await finish(current)
                current = None
        finally:
            if current is not None and current[1]:
                self.m.abort([current[1]])  # client went away mid-stream: nothing half-written is visible
        return pb.StatusesResponse(statuses=statuses)

    async def GetStream(self, request: pb.KeysRequest, context: Any) -> Any:
        start = time.perf_counter()
        error: str | None = None
        try:
            async with contextlib.aclosing(self._get_stream(request, context)) as chunks:  # leases go back at once
                async for chunk in chunks:
                    yield chunk
        except BaseException as e:  # noqa: B036 - only named, then re-raised
            error = type(e).__name__
            raise
        finally:
            if self.metrics is not None:
                self.metrics.observe_rpc("GetStream", time.perf_counter() - start, error)

    async def _get_stream(self, request: pb.KeysRequest, context: Any) -> Any:
        try:
            if isinstance(request, Malformed):
                raise request.invalid()
            keys = self._keys(request.keys)
        except errors.KVStoreError as e:
            context.set_trailing_metadata(((ERROR_METADATA_KEY, type(e).__name__),))
            await context.abort(status_for(e), str(e))
            return
        for i, key in enumerate(keys):
            (x,) = await self.m.acquire([key], request=i == 0)  # one request, however many keys
            if x.status != Status.OK:
                yield pb.BlockChunk(block=pb.BlockInfo(key=key), status=int(x.status))
                continue
            try:
                self.m.hold(lease_ids=[x.lease_id])  # a slow reader must not outlive the lease mid-block
                views = self.m.dram.arena.views(list(x.extents), x.meta.payload_len)
                first = True
                for v in views:
                    for off in range(0, max(v.nbytes, 1), STREAM_CHUNK):
                        part = bytes(v[off : off + STREAM_CHUNK])
                        if first:
                            yield pb.BlockChunk(block=meta_to_pb(x.meta), data=part, status=pb.KEY_STATUS_OK)
                            first = False
                        else:
                            yield pb.BlockChunk(data=part)
                if first:  # an empty payload has no views, but the client still needs its header chunk
                    yield pb.BlockChunk(block=meta_to_pb(x.meta), status=pb.KEY_STATUS_OK)
                self.m.counters["grpc_stream_bytes_out"] += x.meta.payload_len
            finally:
                self.m.release([x.lease_id])

    # -- management ------------------------------------------------------------------
    @_rpc
    async def Delete(self, request: pb.KeysRequest, context: Any) -> pb.DeleteResponse:
        return pb.DeleteResponse(count=await self.m.delete(self._keys(request.keys)))

    @_rpc
    async def Invalidate(self, request: pb.InvalidateRequest, context: Any) -> pb.DeleteResponse:
        if len(request.namespace) != 8:
            raise errors.InvalidArgument(f"a namespace fingerprint is 8 bytes, got {len(request.namespace)}")
        return pb.DeleteResponse(count=await self.m.invalidate(bytes(request.namespace)))

    @_rpc
    async def Pin(self, request: pb.PinRequest, context: Any) -> pb.DeleteResponse:
        return pb.DeleteResponse(count=self.m.pin(self._keys(request.keys), request.ttl_s))

    @_rpc
    async def Unpin(self, request: pb.KeysRequest, context: Any) -> pb.DeleteResponse:
        return pb.DeleteResponse(count=self.m.unpin(self._keys(request.keys)))

    @_rpc
    async def ReportHits(self, request: pb.ReportHitsRequest, context: Any) -> pb.Empty:
        from kvstore.misses import OPS

        if request.op not in OPS:
            raise errors.InvalidArgument(f"op must be one of {OPS}, got {request.op!r}")
        if request.remote:
            tier = "remote"
        elif request.tier == pb.TIER_HBM:
            tier = "hbm"
        else:
            raise errors.InvalidArgument("report HBM hits (tier TIER_HBM) or a remote node's hits (remote=true)")
        if request.blocks > self.cfg.max_batch * 64 or request.tokens > request.blocks * (1 << 20):
            raise errors.InvalidArgument(f"implausible report: {request.blocks} blocks, {request.tokens} tokens")
        if request.namespace and len(request.namespace) != 8:
            raise errors.InvalidArgument(f"a namespace fingerprint is 8 bytes, got {len(request.namespace)}")
        self.m.ledger.report(request.op, tier, request.blocks, request.tokens, bytes(request.namespace) or None)
        return pb.Empty()

    @_rpc
    async def Stats(self, request: pb.Empty, context: Any) -> pb.StatsResponse:
        s = self.m.stats()
        tiers = [
            pb.TierStats(tier=int(TierKind[name.upper()]), capacity_bytes=t["capacity_bytes"], used_bytes=t["used_bytes"], blocks=t["blocks"])
            for name, t in s["tiers"].items()
        ]
        counters = {k: int(v) for k, v in s["counters"].items()}
        if "nvme" in s["tiers"]:
            counters["nvme_corrupt_blocks"] = int(s["tiers"]["nvme"].get("corrupt_blocks", 0))
        counters["pending_transfers"] = len(self.transfers)
        return pb.StatsResponse(
            node_id=self.cfg.node_id, tiers=tiers, counters=counters,
            reservations=s["reservations"], leases=s["leases"], pins=s["pins"],
        )


def _write_at(views: list[memoryview], offset: int, data: memoryview) -> None:
    """Copy ``data`` into the concatenation of ``views`` starting at byte ``offset``."""
    pos = 0
    for v in views:
        if offset >= v.nbytes:
            offset -= v.nbytes
            continue
        n = min(v.nbytes - offset, data.nbytes - pos)
        v[offset : offset + n] = data[pos : pos + n]
        pos += n
        offset = 0
        if pos >= data.nbytes:
            return

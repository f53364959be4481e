"""The gRPC servicer: validates requests, calls the tier manager, maps errors to status codes.

Owner: nothing of its own; runs on the node's event loop (``grpc.aio``) next to the tier
manager (``self.manager``), so it calls the manager directly.  Data-channel transfers are
negotiated here (``StartGet``/``StartPut``) and owned by ``kvstore/node/transfers.py``; the
bytes of reservations and leases (``PutStream``, ``GetStream``) go through the manager's
``write_reserved`` / ``leased_views``, never the arena directly.
Limits (keys per batch, block size) are enforced here, before any state changes.

Tenants (``kvstore/node/tenants.py``): every call learns its :class:`~kvstore.node.tenants.Caller`
from its token once, in ``_rpc``.  A tenant's reads see only blocks of namespaces it owns
or nobody owns (the rest are misses); its writes must be to namespaces it owns or now
claims (else ``PERMISSION_DENIED``); its deletes, pins and unpins skip keys of blocks it
does not own, and its commits, aborts and releases skip other callers' ids, as if unknown:
a refusal there would tell it that another tenant holds the key.  Its unfinished writes
and pins are limited by ``[tenants.NAME] max_reserved_bytes`` and ``max_pinned_bytes``
(the tier manager enforces them: over-limit answers are ``NO_SPACE`` per block, or
``RESOURCE_EXHAUSTED`` when nothing of the call could be done); they count only blocks the
tenant may see, so a refusal tells nothing about other tenants.

Session hints (``kvstore/node/sessions.py``): lookups, reads and puts may name the caller's
session (``session_id``); ``CloseSession`` ends one.  Sessions are the caller's tenant's:
closing an id only another tenant has open is ``PERMISSION_DENIED``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, cast

import grpc
from google.protobuf.message import DecodeError

from kvstore import __version__, errors
from kvstore.block import BlockMeta
from kvstore.keys import ChunkKey, check_key
from kvstore.node.config import NodeConfig
from kvstore.node.manager import Leased, Reserved, Status, TierManager
from kvstore.node.metrics import NodeMetrics
from kvstore.node.sessions import check_session_id
from kvstore.node.tenants import ADMIN, Caller, Callers, Ownership, authorization
from kvstore.node.transfers import Transfers
from kvstore.node.watch import HoldingsLog, holdings_stream
from kvstore.wire import (
    AGENT_METADATA_KEY,
    BLOCKS_METADATA_KEY,
    ERROR_METADATA_KEY,
    PACKED_VERSION,
    extents_to_pb,
    keys_from_packed,
    meta_from_pb,
    meta_to_pb,
    metas_from_packed,
    status_for,
    tier_to_pb,
    u32s,
    u64s,
)
from protos.kvstore.v1 import kvstore_pb2 as pb
from protos.kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from tiers import failpoints
from tiers.base import TierKind

log = logging.getLogger(__name__)

STREAM_CHUNK = 1 << 20
IMPLAUSIBLE_SKIPPED_SAVES = 1 << 24  # chunks in one report (a connector reports about once a second)
STREAM_STAGE_BYTES = 1 << 20
"""Payload a put stream sends before it holds any DRAM (``PutStream``)."""


@dataclasses.dataclass(slots=True)
class _StreamBlock:
    """One block of a put stream: in memory (``buf``) until reserved, then filled in place.
    ``rid``: its reservation (0: none yet, or none to fill: EXISTS, NO_SPACE; -1: it expired
    mid-block); bytes of a block without one are read and dropped."""

    index: int
    meta: BlockMeta
    session: str | None
    buf: bytearray | None = dataclasses.field(default_factory=bytearray)
    rid: int = 0
    filled: int = 0


# The caller of the unary or client-streaming call being served, set by ``_rpc`` for the
# call's duration (``GetStream`` identifies its caller itself).  Unset means "not
# identified": ``KVStoreService._caller`` refuses then, it never defaults to the admin.
_CALLER: contextvars.ContextVar[Caller | None] = contextvars.ContextVar("kvstore_caller", default=None)
_AGENT: contextvars.ContextVar[str] = contextvars.ContextVar("kvstore_agent", default="")
AGENT_METHODS = frozenset(
    {"Lookup", "MatchPrefix", "Acquire", "StartGet", "GetStream", "Reserve", "Commit", "StartPut", "PutStream"}
)
"""The data calls counted per agent (``kvstore_agent_*``): lookups, reads and writes."""


def _agent_of(metadata: Any) -> str:
    """The ``kvstore-agent`` value of a call's metadata ("" when absent)."""
    for k, v in metadata or ():
        if k == AGENT_METADATA_KEY:
            return str(v)
    return ""


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
        if (
            handler is None
            or handler.request_deserializer is None
            or not details.method.startswith("/kvstore.v1.KVStore/")
        ):
            return handler
        return handler._replace(request_deserializer=_lenient(handler.request_deserializer))


def _rpc(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """Map typed errors to gRPC status codes with the error's name in trailing metadata;
    time the call into ``kvstore_rpc_duration_seconds``."""
    method = fn.__name__

    @functools.wraps(fn)
    async def wrapper(self: KVStoreService, request: Any, context: grpc.aio.ServicerContext) -> Any:
        start = time.perf_counter()
        error: str | None = None
        identified = None
        agent = self.metrics.agent_label(_agent_of(context.invocation_metadata())) if self.metrics else ""
        named = _AGENT.set(agent)
        try:
            if isinstance(request, Malformed):
                raise request.invalid()
            identified = _CALLER.set(self._identify(context))
            return await fn(self, request, context)
        except errors.KVStoreError as e:
            error = type(e).__name__
            if isinstance(e, errors.PermissionDenied):
                self._denied("refused")
            context.set_trailing_metadata(((ERROR_METADATA_KEY, error),))
            await context.abort(status_for(e), str(e))
        except ValueError as e:  # malformed protobuf contents that slipped past validation
            error = "InvalidArgument"
            context.set_trailing_metadata(((ERROR_METADATA_KEY, error),))
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        finally:
            if identified is not None:
                _CALLER.reset(identified)
            _AGENT.reset(named)
            if self.metrics is not None:
                seconds = time.perf_counter() - start
                self.metrics.observe_rpc(method, seconds, error)
                if method in AGENT_METHODS:
                    self.metrics.observe_agent_call(agent, method, seconds)

    return wrapper


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without ``authorization: Bearer <token>`` of the admin or a tenant;
    health checks stay open for probes."""

    def __init__(self, token: str | Callers) -> None:
        self._callers = token if isinstance(token, Callers) else Callers(token)

    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        if details.method.startswith("/grpc.health.v1.Health/"):
            return await continuation(details)
        if self._callers.identify(authorization(details.invocation_metadata)) is not None:
            return await continuation(details)
        return _deny


async def _deny_unary(request: Any, context: grpc.aio.ServicerContext) -> None:
    context.set_trailing_metadata(((ERROR_METADATA_KEY, "Unauthenticated"),))
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")


_deny: grpc.RpcMethodHandler = grpc.unary_unary_rpc_method_handler(_deny_unary)


class KVStoreService(pb_grpc.KVStoreServicer):
    def __init__(
        self,
        manager: TierManager,
        config: NodeConfig,
        *,
        arena_path: str,
        arena_size: int,
        data_port: int,
        transfers: Transfers,
        metrics: NodeMetrics | None = None,
        callers: Callers | None = None,
        owners: Ownership | None = None,
        holdings: HoldingsLog | None = None,
    ) -> None:
        """``holdings``: the log ``WatchHoldings`` streams from (None: the call answers
        UNIMPLEMENTED; a node built by ``server.py`` always has one)."""
        self.manager = manager
        self.holdings = holdings
        self.cfg = config
        self.metrics = metrics
        # both or neither: a node with tenants knows who calls and who owns what
        assert (owners is None) or (callers is not None), "tenants need their tokens"
        self.callers = callers
        self.owners = owners
        self.transfers = transfers
        self._hello = pb.HelloResponse(
            node_id=config.node_id,
            version=__version__,
            arena_path=arena_path,
            arena_size=arena_size,
            data_port=data_port,
            max_block_bytes=config.max_block_bytes,
            max_batch=config.max_batch,
            lease_ttl_s=config.read_lease_ttl_s,
            reservation_ttl_s=config.reservation_ttl_s,
            packed_version=PACKED_VERSION,
        )

    # -- tenants --------------------------------------------------------------------
    def _identify(self, context: Any) -> Caller:
        """Who makes this call.  Without tenants everyone is the admin (the interceptor,
        if any, has checked the one token already)."""
        if self.owners is None:
            return ADMIN
        assert self.callers is not None
        caller = self.callers.identify(authorization(context.invocation_metadata()))
        if caller is None:  # the interceptor lets no such call through; never serve one
            raise errors.Unauthenticated("missing or wrong bearer token")
        if caller.tenant is not None and self.metrics is not None:
            self.metrics.tenant_requests.labels(caller.tenant).inc()
        return caller

    @staticmethod
    def _caller() -> Caller:
        caller = _CALLER.get()
        if caller is None:
            raise errors.Unauthenticated("the call was not identified")
        return caller

    def _agent_blocks(self, op: str, good: int, bad: int, nbytes: int = 0, agent: str | None = None) -> None:
        """Count one call's blocks for the agent that made it (``kvstore_agent_*``)."""
        if self.metrics is not None:
            self.metrics.observe_agent_blocks(_AGENT.get() if agent is None else agent, op, good, bad, nbytes)

    def _count_reads(self, leased: Sequence[Leased], agent: str | None = None) -> None:
        """Blocks handed to a reader (leased or streamed): hits, misses and their payload bytes."""
        ok = [x.meta.payload_len for x in leased if x.status == Status.OK and x.meta is not None]
        self._agent_blocks("read", len(ok), len(leased) - len(ok), sum(ok), agent)

    def _count_writes(self, statuses: Sequence[int], sizes: Sequence[int]) -> None:
        """A write's final statuses (OK and EXISTS: stored; the rest refused), and the bytes of
        those stored now (``sizes`` per status where known)."""
        if self.metrics is not None:
            self.metrics.observe_agent_writes(_AGENT.get(), statuses, sizes)

    def _denied(self, kind: str, n: int = 1, caller: Caller | None = None) -> None:
        """Count a tenant's denials: ``refused`` calls, ``hidden`` blocks, ``skipped`` keys and ids."""
        caller = caller or _CALLER.get()
        if n and caller is not None and caller.tenant is not None and self.metrics is not None:
            self.metrics.tenant_denied.labels(caller.tenant, kind).inc(n)

    def _visible(self, caller: Caller) -> Callable[[bytes], bool] | None:
        """Reads: a tenant sees namespaces it owns and those nobody owns; None: sees all."""
        if caller.tenant is None or self.owners is None:
            return None
        owners, tenant = self.owners.table(), caller.tenant

        def visible(ns: bytes) -> bool:
            if owners.get(ns, tenant) == tenant:
                return True
            self._denied("hidden", caller=caller)
            return False

        return visible

    def _may(self, caller: Caller) -> Callable[[bytes], bool] | None:
        """Deletes, pins: a tenant changes only blocks of namespaces it owns; None: all."""
        if caller.tenant is None or self.owners is None:
            return None
        owners, tenant = self.owners.table(), caller.tenant

        def may(ns: bytes) -> bool:
            if owners.get(ns) == tenant:
                return True
            self._denied("skipped", caller=caller)
            return False

        return may

    async def _claim(self, caller: Caller, metas: Sequence[BlockMeta]) -> None:
        if caller.tenant is not None and self.owners is not None:
            await self.owners.claim(caller, {m.namespace for m in metas})

    def _own_ids(self, caller: Caller, ids: list[int], tenant_of: Callable[[int], str | None]) -> list[int]:
        """``ids`` with every reservation or lease another caller made replaced by 0, which
        names none (ids start far above it): it gets the answer an unknown id gets.

        So are ids a transfer holds (the data channel or ``GetStream`` moves their bytes right
        now and resolves them itself), whoever made them: releasing or aborting one would free
        extents the transfer still sends from or receives into, and the next block there (any
        tenant's) would leak to, or be overwritten by, that transfer's client."""
        held = self.manager.held
        if caller.tenant is None:
            return [0 if held(i) else i for i in ids]
        out = [i if tenant_of(i) == caller.tenant and not held(i) else 0 for i in ids]
        self._denied("skipped", sum(1 for i in ids if tenant_of(i) not in (None, caller.tenant)), caller)
        return out

    # -- validation -----------------------------------------------------------------
    def _keys(self, raw: Sequence[bytes]) -> list[ChunkKey]:
        if len(raw) > self.cfg.max_batch:
            raise errors.InvalidArgument(f"{len(raw)} keys in one request; the limit is max_batch={self.cfg.max_batch}")
        return [check_key(k) for k in raw]

    def _request_keys(self, request: pb.KeysRequest) -> list[ChunkKey]:
        """A request's keys: ``packed_keys`` (16 bytes each) if set, else ``keys``."""
        if request.packed_keys:
            if len(request.packed_keys) > 16 * self.cfg.max_batch:
                raise errors.InvalidArgument(
                    f"{len(request.packed_keys) // 16} keys in one request; the limit is max_batch={self.cfg.max_batch}"
                )
            return keys_from_packed(request.packed_keys)
        return self._keys(request.keys)

    def _ids(self, raw: Sequence[int]) -> list[int]:
        if len(raw) > self.cfg.max_batch:
            raise errors.InvalidArgument(f"{len(raw)} ids in one request; the limit is max_batch={self.cfg.max_batch}")
        return list(raw)

    def _request_metas(self, request: pb.ReserveRequest) -> list[BlockMeta]:
        """A put's blocks: the ``packed`` columns if set, else the ``blocks`` messages."""
        if request.HasField("packed"):
            if len(request.packed.keys) > 16 * self.cfg.max_batch:
                raise errors.InvalidArgument(
                    f"{len(request.packed.keys) // 16} blocks in one request; the limit is max_batch={self.cfg.max_batch}"
                )
            return self._sized(metas_from_packed(request.packed))
        return self._metas(request.blocks)

    def _metas(self, blocks: Sequence[pb.BlockInfo]) -> list[BlockMeta]:
        if len(blocks) > self.cfg.max_batch:
            raise errors.InvalidArgument(
                f"{len(blocks)} blocks in one request; the limit is max_batch={self.cfg.max_batch}"
            )
        return self._sized([meta_from_pb(b) for b in blocks])

    def _sized(self, metas: list[BlockMeta]) -> list[BlockMeta]:
        for m in metas:
            if m.payload_len > self.cfg.max_block_bytes:
                why = (
                    " (the DRAM arena's size, to which the node lowered it: a block must fit in DRAM; start the node "
                    "with a larger --dram)"
                    if self.cfg.max_block_bytes == self.cfg.dram
                    else ""
                )
                raise errors.InvalidArgument(
                    f"block of {m.payload_len} bytes exceeds max_block_bytes={self.cfg.max_block_bytes}{why}"
                )
        return metas

    def _lease_pb(self, leased: Leased) -> pb.Lease:
        return pb.Lease(
            status=_key_status(leased.status),
            lease_id=leased.lease_id,
            extents=extents_to_pb(leased.extents),
            block=meta_to_pb(leased.meta) if leased.meta is not None else pb.BlockInfo(key=leased.key),
            tier=_tier(tier_to_pb(leased.tier)),
        )

    # -- RPCs -----------------------------------------------------------------------
    @_rpc
    async def Hello(self, request: pb.HelloRequest, context: Any) -> pb.HelloResponse:
        return self._hello

    @_rpc
    async def Lookup(self, request: pb.KeysRequest, context: Any) -> pb.LookupResponse:
        caller = self._caller()
        found = self.manager.exists(
            self._request_keys(request),
            visible=self._visible(caller),
            tenant=caller.tenant,
            session=check_session_id(request.session_id),
        )
        hits = sum(t is not None for t in found)
        self._agent_blocks("lookup", hits, len(found) - hits)
        return pb.LookupResponse(tiers=[_tier(tier_to_pb(t)) for t in found])

    @_rpc
    async def MatchPrefix(self, request: pb.KeysRequest, context: Any) -> pb.MatchPrefixResponse:
        caller = self._caller()
        keys = self._request_keys(request)
        n, tiers = self.manager.match_prefix(
            keys,
            visible=self._visible(caller),
            tenant=caller.tenant,
            session=check_session_id(request.session_id),
        )
        self._agent_blocks("lookup", n, len(keys) - n)
        return pb.MatchPrefixResponse(matched=n, tiers=[_tier(int(t)) for t in tiers])

    @_rpc
    async def CloseSession(self, request: pb.CloseSessionRequest, context: Any) -> pb.CloseSessionResponse:
        session = check_session_id(request.session_id)
        if session is None:
            raise errors.InvalidArgument("CloseSession needs a session_id")
        n = self.manager.close_session(session, tenant=self._caller().tenant)
        return pb.CloseSessionResponse(closed=n is not None, blocks=n or 0)

    @_rpc
    async def Reserve(self, request: pb.ReserveRequest, context: Any) -> pb.ReserveResponse:
        metas, caller = self._request_metas(request), self._caller()
        await self._claim(caller, metas)
        res = await self.manager.reserve(
            metas, tenant=caller.tenant, visible=self._visible(caller), session=check_session_id(request.session_id)
        )
        self._count_writes([r.status for r in res if r.status != Status.OK], [])
        if request.HasField("packed"):
            return pb.ReserveResponse(packed=_packed_reservations(res), ttl_s=self.manager.reservation_ttl)
        return pb.ReserveResponse(
            reservations=[
                pb.Reservation(
                    status=_key_status(r.status), reservation_id=r.reservation_id, extents=extents_to_pb(r.extents)
                )
                for r in res
            ],
            ttl_s=self.manager.reservation_ttl,
        )

    @_rpc
    async def Commit(self, request: pb.CommitRequest, context: Any) -> pb.StatusesResponse:
        ids = self._ids(request.reservation_ids)
        sums = list(request.payload_checksums) or None
        caller = self._caller()
        if caller.tenant is not None and not str(context.peer()).startswith("unix:"):
            # Commit publishes, unchecked, whatever the arena holds under the reservation: only a
            # local client can have written it.  Over TCP it would be the stale bytes of a block
            # freed there before (another tenant's), readable by this tenant right after.
            raise errors.PermissionDenied(
                "Commit publishes bytes written into the shared-memory arena, which only a unix:// client maps; "
                "over TCP put through StartPut and the data channel, or PutStream (what KVClient does)"
            )
        ids = self._own_ids(caller, ids, self.manager.reservation_tenant)
        sizes = [r[0].payload_len if (r := self.manager.reservation(rid)) else 0 for rid in ids]
        statuses = await self.manager.commit(ids, sums)
        self.manager.moved("local", "in", sum(n for n, st in zip(sizes, statuses) if st == Status.OK))
        self._count_writes(statuses, sizes)
        return pb.StatusesResponse(statuses=_statuses(statuses))

    @_rpc
    async def Abort(self, request: pb.AbortRequest, context: Any) -> pb.Empty:
        self.manager.abort(
            self._own_ids(self._caller(), self._ids(request.reservation_ids), self.manager.reservation_tenant)
        )
        return pb.Empty()

    @_rpc
    async def Acquire(self, request: pb.KeysRequest, context: Any) -> pb.AcquireResponse:
        caller = self._caller()
        leased = await self.manager.acquire(
            self._request_keys(request),
            tenant=caller.tenant,
            visible=self._visible(caller),
            session=check_session_id(request.session_id),
        )
        failpoints.hit("node.acquire")
        self._count_reads(leased)
        if request.packed_keys:
            packed, nbytes = _packed_leases(leased)
            self.manager.moved("local", "out", nbytes)
            return pb.AcquireResponse(packed=packed, ttl_s=self.manager.lease_ttl)
        self.manager.moved(
            "local", "out", sum(x.meta.payload_len for x in leased if x.status == Status.OK and x.meta is not None)
        )
        return pb.AcquireResponse(leases=[self._lease_pb(x) for x in leased], ttl_s=self.manager.lease_ttl)

    @_rpc
    async def Release(self, request: pb.ReleaseRequest, context: Any) -> pb.ReleaseResponse:
        ids = self._own_ids(self._caller(), self._ids(request.lease_ids), self.manager.lease_tenant)
        valid = self.manager.release(ids)
        self.transfers.released(ids)  # a TCP get given up before its bytes: its transfer goes too
        return pb.ReleaseResponse(valid=valid)

    # The data channel needs no tenant checks of its own: a transfer id is a 16-byte secret
    # that only StartGet/StartPut hand out, after the checks below, to the caller they
    # checked; it moves exactly the leased or reserved blocks, once.
    @_rpc
    async def StartGet(self, request: pb.KeysRequest, context: Any) -> pb.StartGetResponse:
        caller = self._caller()
        leased = await self.manager.acquire(
            self._request_keys(request),
            tenant=caller.tenant,
            visible=self._visible(caller),
            session=check_session_id(request.session_id),
        )
        self._count_reads(leased)
        tid = self.transfers.start_get(leased)
        if request.packed_keys:
            packed, _ = _packed_leases(leased, extents=False)
            return pb.StartGetResponse(transfer_id=tid, packed=packed, ttl_s=self.manager.lease_ttl)
        return pb.StartGetResponse(
            transfer_id=tid, leases=[self._lease_pb(x) for x in leased], ttl_s=self.manager.lease_ttl
        )

    @_rpc
    async def StartPut(self, request: pb.ReserveRequest, context: Any) -> pb.StartPutResponse:
        metas, caller = self._request_metas(request), self._caller()
        await self._claim(caller, metas)
        res = await self.manager.reserve(
            metas, tenant=caller.tenant, visible=self._visible(caller), session=check_session_id(request.session_id)
        )
        self._count_writes([r.status for r in res if r.status != Status.OK], [])
        tid = self.transfers.start_put(metas, res, agent=_AGENT.get())
        return pb.StartPutResponse(
            transfer_id=tid, statuses=_statuses(r.status for r in res), ttl_s=self.manager.reservation_ttl
        )

    # -- streaming fallback ------------------------------------------------------------
    @_rpc
    async def PutStream(self, request_iterator: Any, context: Any) -> pb.StatusesResponse:
        """One batch, like ``Reserve`` + ``Commit``, whose blocks take DRAM only as their bytes
        arrive: whole blocks are staged in memory until a stage's worth of them is waiting
        (``STREAM_STAGE_BYTES``, at most half of ``max_block_bytes``), then reserved and
        written together; a block larger than that is reserved once that many of its bytes
        came, and filled in place from then on.  All are
        committed together once the stream has ended well.  A stream that breaks a rule (more
        than ``max_batch`` blocks, a block with too few or too many bytes, data before a
        header) is refused with ``INVALID_ARGUMENT`` and stores nothing: every reservation it
        made is aborted, as when the client goes away or the call is cancelled — and one
        refused within its first stage of bytes (a flood of one-byte blocks) reserved
        nothing, so it moved no block and refused no other client.  A client that declares its
        block count (``BLOCKS_METADATA_KEY``) is refused before anything is read if the count
        is over the limit."""
        limit = self.cfg.max_batch
        declared = _declared_blocks(context)
        if declared is not None and declared > limit:
            raise errors.InvalidArgument(f"a put stream of {declared} blocks; the limit is max_batch={limit}")
        stage = min(STREAM_STAGE_BYTES, max(1, self.cfg.max_block_bytes // 2))
        statuses: list[int] = []  # per block, in order (set when it is reserved, then committed)
        lens: list[int] = []  # per block, its payload bytes
        whole: list[tuple[int, int, BlockMeta]] = []  # (index, reservation id, meta): filled, committed at the end
        staged: list[_StreamBlock] = []  # whole blocks in memory, not yet reserved
        staged_bytes = [0]
        current: _StreamBlock | None = None
        caller = self._caller()
        visible = self._visible(caller)

        async def reserve(b: _StreamBlock) -> None:
            """Reserve ``b`` (NO_SPACE over the tenant's max_reserved_bytes: the stream goes on)
            and write what of it is in memory."""
            (r,) = await self.manager.reserve(
                [b.meta], tenant=caller.tenant, visible=visible, refuse_over_limit=False, session=b.session
            )
            statuses[b.index] = int(r.status)
            b.rid = r.reservation_id if r.status == Status.OK else 0
            if b.rid and b.buf is not None and not self.manager.write_reserved(b.rid, 0, memoryview(b.buf)):
                statuses[b.index] = int(Status.EXPIRED)
                b.rid = 0
            b.buf = None  # in place from here on

        async def flush() -> None:
            for b in staged:
                await reserve(b)
                if b.rid > 0:
                    whole.append((b.index, b.rid, b.meta))
            staged.clear()
            staged_bytes[0] = 0

        async def close(b: _StreamBlock) -> None:
            if b.filled != b.meta.payload_len:
                raise errors.InvalidArgument(
                    f"stream for key {b.meta.key.hex()} carried {b.filled} bytes; its header says {b.meta.payload_len}"
                )
            if b.buf is not None:
                staged.append(b)
                staged_bytes[0] += b.meta.payload_len
                if staged_bytes[0] >= stage:
                    await flush()
            elif b.rid > 0:
                whole.append((b.index, b.rid, b.meta))

        try:
            async for chunk in request_iterator:
                if isinstance(chunk, Malformed):
                    raise chunk.invalid()
                if chunk.HasField("block"):
                    if current is not None:
                        await close(current)
                        current = None
                    if len(statuses) >= limit:
                        raise errors.InvalidArgument(
                            f"more than max_batch={limit} blocks in one stream; none was stored"
                        )
                    if declared is not None and len(statuses) >= declared:
                        raise errors.InvalidArgument(
                            f"more blocks than the {declared} the stream declared ({BLOCKS_METADATA_KEY}); none was stored"
                        )
                    (meta,) = self._metas([chunk.block])
                    await self._claim(caller, [meta])
                    statuses.append(int(Status.OK))
                    lens.append(meta.payload_len)
                    current = _StreamBlock(len(statuses) - 1, meta, check_session_id(chunk.session_id))
                if current is None:
                    raise errors.InvalidArgument("the first chunk of a put stream must carry its block header")
                data = chunk.data
                if current.filled + len(data) > current.meta.payload_len:
                    raise errors.InvalidArgument(
                        f"stream for key {current.meta.key.hex()} carries more bytes than its header says"
                    )
                if current.buf is not None:
                    current.buf += data
                    current.filled += len(data)
                    if current.filled >= stage and current.filled < current.meta.payload_len:
                        await flush()  # blocks before it first: their order is the stream's
                        await reserve(current)  # a big block: in place from here on
                    continue
                if current.rid > 0 and not self.manager.write_reserved(current.rid, current.filled, memoryview(data)):
                    # reclaimed at its deadline while the client stalled: its space may be
                    # another block's by now, so not one more byte goes there
                    statuses[current.index] = int(Status.EXPIRED)
                    current.rid = -1
                current.filled += len(data)
            if current is not None:
                await close(current)
                current = None
            await flush()
            # a reservation reclaimed at its deadline meanwhile answers EXPIRED here
            committed = await self.manager.commit([rid for _, rid, _ in whole], verify=True) if whole else []
            for (i, _rid, meta), st in zip(whole, committed):
                statuses[i] = int(st)
                if st == Status.OK:
                    self.manager.moved("grpc_stream", "in", meta.payload_len)
            whole.clear()
        finally:
            # refused, cancelled, or the client went away: nothing of this stream becomes visible
            # (ids already committed or reclaimed are no longer reservations: aborting them is a no-op)
            self.manager.abort(
                [rid for _, rid, _ in whole] + ([current.rid] if current is not None and current.rid > 0 else [])
            )
        self._count_writes(statuses, lens)
        return pb.StatusesResponse(statuses=_statuses(statuses))

    async def GetStream(self, request: pb.KeysRequest, context: Any) -> Any:
        start = time.perf_counter()
        error: str | None = None
        agent = self.metrics.agent_label(_agent_of(context.invocation_metadata())) if self.metrics else ""
        try:
            async with contextlib.aclosing(
                self._get_stream(request, context, agent)
            ) as chunks:  # leases go back at once
                async for chunk in chunks:
                    yield chunk
        except BaseException as e:  # noqa: B036 - only named, then re-raised
            error = type(e).__name__
            raise
        finally:
            if self.metrics is not None:
                self.metrics.observe_rpc("GetStream", time.perf_counter() - start, error)
                self.metrics.observe_agent_call(agent, "GetStream", time.perf_counter() - start)

    async def _get_stream(self, request: pb.KeysRequest, context: Any, agent: str = "") -> Any:
        try:
            if isinstance(request, Malformed):
                raise request.invalid()
            keys = self._request_keys(request)
            session = check_session_id(request.session_id)
            caller = self._identify(context)
        except errors.KVStoreError as e:
            context.set_trailing_metadata(((ERROR_METADATA_KEY, type(e).__name__),))
            await context.abort(status_for(e), str(e))
            return
        visible = self._visible(caller)
        for i, key in enumerate(keys):
            # one request, however many keys
            (x,) = await self.manager.acquire(
                [key], request=i == 0, tenant=caller.tenant, visible=visible, session=session
            )
            self._count_reads([x], agent)
            if x.status != Status.OK:
                yield pb.BlockChunk(block=pb.BlockInfo(key=key), status=_key_status(x.status))
                continue
            try:
                self.manager.hold(lease_ids=[x.lease_id])  # a slow reader must not outlive the lease mid-block
                views = self.manager.leased_views(x.lease_id)
                meta = x.meta
                assert views is not None and meta is not None  # leased just now, and nothing awaited since
                first = True
                for v in views:
                    for off in range(0, max(v.nbytes, 1), STREAM_CHUNK):
                        part = bytes(v[off : off + STREAM_CHUNK])
                        if first:
                            yield pb.BlockChunk(block=meta_to_pb(meta), data=part, status=pb.KEY_STATUS_OK)
                            first = False
                        else:
                            yield pb.BlockChunk(data=part)
                if first:  # an empty payload has no views, but the client still needs its header chunk
                    yield pb.BlockChunk(block=meta_to_pb(meta), status=pb.KEY_STATUS_OK)
                self.manager.moved("grpc_stream", "out", meta.payload_len)
            finally:
                self.manager.release([x.lease_id])

    # -- the holdings watch (kvstore/node/watch.py) -------------------------------------
    async def WatchHoldings(self, request: pb.WatchHoldingsRequest, context: Any) -> Any:
        """Every key this node holds, then every change (architecture §3a).  The admin's only:
        keys are content addresses, so a tenant would learn which prompts other tenants stored."""
        try:
            if isinstance(request, Malformed):
                raise request.invalid()
            if self._identify(context).tenant is not None:
                raise errors.PermissionDenied("WatchHoldings needs the admin token: it lists every tenant's keys")
            if self.holdings is None:
                context.set_trailing_metadata(((ERROR_METADATA_KEY, "Unimplemented"),))
                await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this node does not publish its holdings")
                return
            stream = holdings_stream(self.holdings, self.manager.dram, self.manager.nvme, request)
            first = await anext(stream)  # the request is checked before the first message
        except StopAsyncIteration:
            return
        except errors.KVStoreError as e:
            context.set_trailing_metadata(((ERROR_METADATA_KEY, type(e).__name__),))
            await context.abort(status_for(e), str(e))
            return
        async with contextlib.aclosing(stream):
            yield first
            async for update in stream:
                yield update

    # -- management ------------------------------------------------------------------
    @_rpc
    async def Delete(self, request: pb.KeysRequest, context: Any) -> pb.DeleteResponse:
        return pb.DeleteResponse(
            count=await self.manager.delete(self._request_keys(request), may=self._may(self._caller()))
        )

    @_rpc
    async def Invalidate(self, request: pb.InvalidateRequest, context: Any) -> pb.DeleteResponse:
        if len(request.namespace) != 8:
            raise errors.InvalidArgument(f"a namespace fingerprint is 8 bytes, got {len(request.namespace)}")
        ns, caller = bytes(request.namespace), self._caller()
        if self.owners is not None and not self.owners.may_modify(caller, ns):
            raise errors.PermissionDenied(
                f"tenant {caller.tenant!r} does not own namespace {ns.hex()}: only its owner or the admin may invalidate it"
            )
        return pb.DeleteResponse(count=await self.manager.invalidate(ns))

    def _changeable(self, keys: list[ChunkKey]) -> list[ChunkKey]:
        """Pins: the keys whose stored block the caller may change (absent keys stay: no-ops)."""
        may = self._may(self._caller())
        if may is None:
            return keys
        return [k for k in keys if (ns := self.manager.namespace_of(k)) is None or may(ns)]

    @_rpc
    async def Pin(self, request: pb.PinRequest, context: Any) -> pb.DeleteResponse:
        caller = self._caller()
        return pb.DeleteResponse(
            count=self.manager.pin(self._changeable(self._keys(request.keys)), request.ttl_s, tenant=caller.tenant)
        )

    @_rpc
    async def Unpin(self, request: pb.KeysRequest, context: Any) -> pb.DeleteResponse:
        return pb.DeleteResponse(count=self.manager.unpin(self._changeable(self._request_keys(request))))

    @_rpc
    async def ReportHits(self, request: pb.ReportHitsRequest, context: Any) -> pb.Empty:
        from kvstore.node.ledger import CLIENT_MISS_REASONS, OPS

        if request.op not in OPS:
            raise errors.InvalidArgument(f"op must be one of {OPS}, got {request.op!r}")
        tier = ""
        if request.miss_reason:
            if request.miss_reason not in CLIENT_MISS_REASONS:
                raise errors.InvalidArgument(
                    f"a reported miss_reason is one of {CLIENT_MISS_REASONS}, got {request.miss_reason!r}"
                )
        elif request.remote:
            tier = "remote"
        elif request.tier == pb.TIER_HBM:
            tier = "hbm"
        elif request.blocks or not (request.short_copies or request.namespace_name or request.skipped_saves):
            raise errors.InvalidArgument(
                "report HBM hits (tier TIER_HBM), a remote node's hits (remote=true) "
                "or a cluster client's misses (miss_reason)"
            )
        if (
            request.blocks > self.cfg.max_batch * 64
            or request.tokens > request.blocks * (1 << 20)
            or request.short_copies > self.cfg.max_batch * 64
            or request.skipped_saves > IMPLAUSIBLE_SKIPPED_SAVES
        ):
            raise errors.InvalidArgument(
                f"implausible report: {request.blocks} blocks, {request.tokens} tokens, "
                f"{request.short_copies} short copies, {request.skipped_saves} skipped saves"
            )
        if request.namespace and len(request.namespace) != 8:
            raise errors.InvalidArgument(f"a namespace fingerprint is 8 bytes, got {len(request.namespace)}")
        if request.namespace_name and (
            not request.namespace or len(request.namespace_name) > 200 or not request.namespace_name.isprintable()
        ):
            raise errors.InvalidArgument(
                "a namespace_name is printable, at most 200 characters, and names a namespace fingerprint"
            )
        caller = self._caller()
        if (
            request.namespace
            and caller.tenant is not None
            and self.owners is not None
            and self.owners.owner(bytes(request.namespace)) not in (None, caller.tenant)
        ):
            # not counted, and silently: a refusal would tell, without claiming anything (as a
            # write would), that another tenant owns the namespace
            self._denied("skipped", caller=caller)
            return pb.Empty()
        self.manager.reported(
            request.op,
            tier=tier,
            miss_reason=request.miss_reason,
            blocks=request.blocks,
            tokens=request.tokens,
            namespace=bytes(request.namespace) or None,
            short_copies=request.short_copies,
            namespace_name=request.namespace_name,
            skipped_saves=request.skipped_saves,
        )
        return pb.Empty()

    @_rpc
    async def Stats(self, request: pb.Empty, context: Any) -> pb.StatsResponse:
        s = self.manager.stats()
        tiers = [
            pb.TierStats(
                tier=_tier(int(TierKind[name.upper()])),
                capacity_bytes=t["capacity_bytes"],
                used_bytes=t["used_bytes"],
                blocks=t["blocks"],
            )
            for name, t in s["tiers"].items()
        ]
        counters = {k: int(v) for k, v in s["counters"].items()}
        if "nvme" in s["tiers"]:
            counters["nvme_corrupt_blocks"] = int(s["tiers"]["nvme"].get("corrupt_blocks", 0))
        counters["pending_transfers"] = self.transfers.pending
        counters["active_transfers"] = self.transfers.active  # taken by a connection, not yet finished
        if self.holdings is not None:
            counters.update(self.holdings.stats())
        # a tenant sees the rows of namespaces it owns or nobody owns (no denial counted: it asked for none)
        caller = self._caller()
        owners = None if caller.tenant is None or self.owners is None else self.owners.table()
        read_back = [
            pb.ReadBackCounts(
                namespace=r.namespace,
                bucket=r.bucket,
                stored_blocks=r.stored_blocks,
                stored_bytes=r.stored_bytes,
                read_back_blocks=r.read_back_blocks,
                read_back_bytes=r.read_back_bytes,
            )
            for r in s["read_back"]
            if owners is None or (r.namespace and owners.get(r.namespace, caller.tenant) == caller.tenant)
        ]
        return pb.StatsResponse(
            node_id=self.cfg.node_id,
            tiers=tiers,
            counters=counters,
            reservations=s["reservations"],
            leases=s["leases"],
            pins=s["pins"],
            read_back=read_back,
        )


def _declared_blocks(context: Any) -> int | None:
    """The block count a put stream declared in its metadata (an upper bound), if any."""
    for k, v in context.invocation_metadata() or ():
        if k == BLOCKS_METADATA_KEY:
            try:
                n = int(v)
            except ValueError:
                n = -1
            if n < 0:
                raise errors.InvalidArgument(f"{BLOCKS_METADATA_KEY} must be a block count, got {v!r:.40}")
            return n
    return None


def _key_status(status: int) -> pb.KeyStatus:
    """A ``Status`` as the protobuf enum (the same numbers)."""
    return cast(pb.KeyStatus, int(status))


def _tier(tier: int) -> pb.Tier:
    return cast(pb.Tier, tier)


def _statuses(statuses: Iterable[int]) -> list[pb.KeyStatus]:
    return [cast(pb.KeyStatus, int(s)) for s in statuses]


def _packed_reservations(res: Sequence[Reserved]) -> pb.PackedReservations:
    """``Reserve``'s answers as columns (``PackedReservations``)."""
    n = len(res)
    statuses, ids, counts = bytearray(n), [0] * n, [0] * n
    extents: list[int] = []
    for i, r in enumerate(res):
        statuses[i] = r.status
        if r.status == Status.OK:
            ids[i] = r.reservation_id
            counts[i] = len(r.extents)
            for e in r.extents:
                extents += (e.offset, e.length)
    return pb.PackedReservations(
        statuses=bytes(statuses), ids=u64s(ids), extent_counts=u32s(counts), extents=u64s(extents)
    )


def _packed_leases(leased: Sequence[Leased], *, extents: bool = True) -> tuple[pb.PackedLeases, int]:
    """``Acquire``'s answers as columns (``PackedLeases``), and the payload bytes leased.
    ``extents=False``: without extents (``StartGet``: they mean nothing to a remote client)."""
    n = len(leased)
    statuses, tiers = bytearray(n), bytearray(n)
    ids, counts, lens, sums = [0] * n, [0] * n, [0] * n, [0] * n
    flat: list[int] = []
    for i, x in enumerate(leased):
        statuses[i] = x.status
        if x.status == Status.OK and x.meta is not None:
            ids[i] = x.lease_id
            if extents:
                counts[i] = len(x.extents)
                for e in x.extents:
                    flat += (e.offset, e.length)
            lens[i] = x.meta.payload_len
            sums[i] = x.meta.payload_checksum
            tiers[i] = tier_to_pb(x.tier)
    packed = pb.PackedLeases(
        statuses=bytes(statuses),
        ids=u64s(ids),
        extent_counts=u32s(counts),
        extents=u64s(flat),
        payload_lens=u64s(lens),
        payload_checksums=u64s(sums),
        tiers=bytes(tiers),
    )
    return packed, sum(lens)

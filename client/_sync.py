"""``KVClient``: the blocking SDK over :mod:`client._core`.

The driver (``KVClient._run``) performs the core's instructions (:mod:`client._instructions`)
in the calling thread.  Thread-safe: the core's state is what it learnt from ``Hello`` and
its transport, both safe to share (see :mod:`client._transports`).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Unpack

import grpc

from client._api import BlockCalls
from client._channel import (
    CHANNEL_OPTIONS,
    FINALIZE_WAIT_S,
    RETRIES,
    Inflight,
    call_metadata,
    etcd_route,
    finalize_channel,
    resolve_token,
    rpc_error,
    stream_metadata,
)
from client._core import IDEMPOTENT, ClientCore, Op, T, as_key_list, fingerprint, report_request, skipped_request
from client._instructions import GetStream, Io, PutStream, Rpc, RpcNoWait, instruction
from client._options import ClientKwargs, ClientOptions
from kvstore.errors import InvalidArgument, KVStoreError, Unavailable
from kvstore.keys import Namespace, check_key
from kvstore.tls import secure_channel
from protos.kvstore.v1 import kvstore_pb2 as pb
from protos.kvstore.v1 import kvstore_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from client._zerocopy import LeasedBlocks, ReservedBlocks
    from kvstore.block import BlockMeta

__all__ = ["KVClient", "resolve_token"]  # resolve_token: still imported from here by the cluster clients


class KVClient(BlockCalls):
    """A blocking client of one kvstore node.  Thread-safe; reuse one per process.

    ``target`` is ``unix:///path/to/kvstore.sock`` (same machine: zero-copy shared
    memory) or ``host:port`` (bytes over the node's TCP data channel).  A miss is
    ``None`` (or ``False``), never an exception; errors are :class:`kvstore.errors.KVStoreError`.

    TLS, for ``host:port`` targets of a node started with ``tls_cert_file``: ``tls_ca_file``
    (PEM roots that verify the node; ``tls=True`` alone uses the system's roots),
    ``tls_cert_file`` / ``tls_key_file`` (a client certificate, for nodes that require one)
    and ``tls_server_name`` (the name to verify instead of the host dialled).  The files are
    read once, here; the gRPC channel and the data channel use the same settings.  Unix
    socket targets stay plaintext whatever is passed.

    Options: ``options=ClientOptions(...)`` (:class:`client.ClientOptions`) or the same fields
    as keyword arguments.  For an ``etcd://`` cluster target use :func:`client.connect`
    (``KVClient("etcd://...")`` still returns a ``ClusterClient`` in this release, with a
    ``DeprecationWarning``).
    """

    def __new__(cls, target: str, options: ClientOptions | None = None, **kwargs: Any) -> Any:
        # deprecated, for one release: an etcd:// target returns a ClusterClient (use client.connect)
        if cls is KVClient:
            route = etcd_route("sync", target, "KVClient", "client.connect")
            if route is not None:
                return route(target, options, **kwargs)
        return super().__new__(cls)

    def __init__(self, target: str, options: ClientOptions | None = None, **kwargs: Unpack[ClientKwargs]) -> None:
        opts = ClientOptions.of(options, dict(kwargs))
        self.options = opts
        self._tls = opts.client_tls()
        self._core = ClientCore(
            target, transport=opts.transport, timeouts=opts.timeouts, verify=opts.verify, tls=self._tls
        )
        tok = resolve_token(opts.token, opts.token_file)
        self._metadata = call_metadata(tok, opts.agent)
        self._channel = secure_channel(self._core.target.grpc_target, self._tls, CHANNEL_OPTIONS)
        self._stub = pb_grpc.KVStoreStub(self._channel)
        self._inflight = Inflight()
        # a client never closed must not hang the process: on GC or at exit its calls in
        # flight are finished or cancelled and its channel closed (regression:
        # tests/integration/test_quickstart_exit.py)
        self._finalizer = weakref.finalize(self, finalize_channel, self._inflight, self._channel, FINALIZE_WAIT_S)

    # -- driver -------------------------------------------------------------------------
    def _rpc(self, method: str, request: Any) -> Any:
        if method == "Stats" and self._inflight:
            self._drain()  # stats reflect this client's own releases
        attempts = RETRIES + 1 if method in IDEMPOTENT else 1
        for attempt in range(attempts):
            try:
                return getattr(self._stub, method)(request, timeout=self._core.timeouts.rpc, metadata=self._metadata)
            except grpc.RpcError as e:
                err = rpc_error(e, self._tls, self._core.target.grpc_target)
                if isinstance(err, Unavailable) and attempt + 1 < attempts:
                    time.sleep(0.05 * (attempt + 1))
                    continue
                raise err from None
        raise AssertionError("unreachable")

    def _start(self, method: str, request: Any) -> None:
        """Fire a call without waiting; failures are harmless (leases expire on their own)."""
        call = getattr(self._stub, method)
        timeout, metadata = self._core.timeouts.rpc, self._metadata
        self._inflight.add(lambda: call(request, timeout=timeout, metadata=metadata))

    def _drain(self) -> None:
        self._inflight.drain(self._core.timeouts.rpc)

    def _perform(self, instr: Any) -> Any:
        match instruction(instr):
            case Rpc(method, request):
                return self._rpc(method, request)
            case RpcNoWait(method, request):
                return self._start(method, request)
            case Io(fn):
                return fn()
            case PutStream(chunks, blocks):
                try:
                    return self._stub.PutStream(
                        chunks(), timeout=self._core.timeouts.data, metadata=stream_metadata(self._metadata, blocks)
                    )
                except grpc.RpcError as e:
                    raise rpc_error(e, self._tls, self._core.target.grpc_target) from None
            case GetStream(request):
                try:
                    return list(
                        self._stub.GetStream(request, timeout=self._core.timeouts.data, metadata=self._metadata)
                    )
                except grpc.RpcError as e:
                    raise rpc_error(e, self._tls, self._core.target.grpc_target) from None

    def _run(self, op: Op[T]) -> T:
        self._core.check_open()
        try:
            instr = next(op)
            while True:
                try:
                    result = self._perform(instr)
                except BaseException as e:  # noqa: B036 - thrown into the op, which re-raises it
                    # a KVStoreError, or an interrupt: the op first gives back what it holds
                    instr = op.throw(e)
                    continue
                instr = op.send(result)
        except StopIteration as stop:
            return stop.value

    # -- API (put / get / exists: client._api.BlockCalls) -----------------------------------
    def lookup(self, keys: Sequence[bytes], *, session_id: str | None = None) -> list[str | None]:
        """The tier (``"dram"``, ``"nvme"``) holding each key, or None."""
        return self._run(self._core.lookup(as_key_list(keys), session=session_id))

    def match_prefix(self, keys: Sequence[bytes], *, session_id: str | None = None) -> int:
        """How many leading keys are stored without a gap.  ``session_id``: the caller's session
        (session hints): the blocks found stay valuable while it is open."""
        return self._run(self._core.match_prefix(as_key_list(keys), session=session_id))[0]

    def match_prefix_tiers(self, keys: Sequence[bytes], *, session_id: str | None = None) -> tuple[int, list[str]]:
        return self._run(self._core.match_prefix(as_key_list(keys), session=session_id))

    def close_session(self, session_id: str) -> bool:
        """Session hints: ``session_id`` sends no more requests, so the blocks only it (and other
        closed sessions) used are the node's first eviction candidates (demoted from DRAM first,
        dropped from NVMe first); blocks open sessions share stay.  False if the node has no
        such session of this caller open (never used, closed already, or idle past the node's
        session_idle_ttl_s); ``PermissionDenied`` if only another tenant has it open."""
        return self._run(self._core.close_session(session_id)) is not None

    def delete(self, keys: Sequence[bytes]) -> int:
        return self._run(self._core.simple("Delete", pb.KeysRequest(keys=[check_key(k) for k in as_key_list(keys)])))

    def pin(self, keys: Sequence[bytes], ttl: float) -> int:
        return self._run(
            self._core.simple("Pin", pb.PinRequest(keys=[check_key(k) for k in as_key_list(keys)], ttl_s=ttl))
        )

    def unpin(self, keys: Sequence[bytes]) -> int:
        return self._run(self._core.simple("Unpin", pb.KeysRequest(keys=[check_key(k) for k in as_key_list(keys)])))

    def invalidate(self, namespace: bytes | Namespace) -> int:
        """Drop every block of a namespace (its 8-byte fingerprint) on this node."""
        return self._run(self._core.simple("Invalidate", pb.InvalidateRequest(namespace=fingerprint(namespace))))

    def report_hits(
        self,
        blocks: int,
        tokens: int = 0,
        *,
        tier: str = "hbm",
        op: str = "get",
        namespace: bytes | Namespace | None = None,
    ) -> None:
        """Tell the node about hits it did not serve (``tier="hbm"``: an agent's HBM pool;
        ``"remote"``: another node), so its metrics show every tier."""
        self._run(self._core.call("ReportHits", report_request(blocks, tokens, tier, op, namespace)))

    def report_skipped_saves(self, chunks: int, *, namespace: bytes | Namespace | None = None) -> None:
        """Tell the node about ``chunks`` an engine computed and chose not to store (its save
        policy), so its metrics (``kvstore_skipped_save_chunks_total``) and dashboards show them."""
        self._run(self._core.call("ReportHits", skipped_request(chunks, namespace)))

    def stats(self) -> dict[str, Any]:
        return self._run(self._core.stats())

    def warm(self) -> int:
        """Connect now (the node's Hello answered, the transport set up), so that the first
        call does not pay for it; 1 once connected, 0 if the node does not answer (its first
        call tries again)."""
        try:
            self._run(self._core.ensure_hello())
        except KVStoreError:
            return 0
        return 1

    # -- zero-copy views (local targets; used by gpu_agent) --------------------------------
    def arena_buffer(self) -> memoryview:
        """The node's whole shared-memory arena as this process maps it (connecting if needed).

        For code that registers it once with a DMA engine (``cudaHostRegister``); the bytes
        of a block may only be touched under a lease or reservation from this client."""
        if not self._core.target.local:
            raise InvalidArgument("the arena is only reachable from a unix:// target on the node's machine")
        self._run(self._core.ensure_hello())
        if self._core.arena is None:
            raise InvalidArgument(
                "this client could not map the node's arena (is the node on this machine, sharing /dev/shm?)"
            )
        return self._core.arena.buf

    def acquire(self, keys: Sequence[bytes], *, session_id: str | None = None) -> LeasedBlocks:
        """Lease blocks and get read-only views of their arena bytes (no copy).  Use as a
        context manager; the views must not be used after it exits."""
        from client._zerocopy import LeasedBlocks

        ks = [check_key(k) for k in as_key_list(keys)]
        ids, metas, views, held_until = self._run(self._core.acquire_views(ks, session=session_id))

        def release(wait: bool) -> list[bool]:
            if not ids:
                return []
            if not wait:
                self._run(self._core.release_ids_nowait(ids))
                return [True] * len(ids)
            return self._run(self._core.release_ids(ids))

        return LeasedBlocks(ks, metas, views, release, held_until)

    def reserve(self, metas: Sequence[BlockMeta], *, session_id: str | None = None) -> ReservedBlocks:
        """Reserve arena space for blocks described by ``metas`` and get writable views.
        Fill them, then ``commit(checksums)``; leaving the context without commit aborts."""
        from client._zerocopy import ReservedBlocks

        ms = list(metas)
        ids, views, existed = self._run(self._core.reserve_views(ms, session=session_id))

        def commit(checksums: list[int] | None) -> list[bool]:
            if not ids:
                return []
            return self._run(self._core.commit_ids(ids, checksums))

        def abort() -> None:
            if ids:
                try:
                    self._run(self._core.abort_ids(ids))
                except KVStoreError:
                    pass  # the node reclaims it at the deadline anyway

        return ReservedBlocks([m.key for m in ms], ms, views, commit, abort, existed)

    def close(self) -> None:
        self._drain()  # deliver releases still in flight before the channel goes
        self._core.close()
        self._finalizer()  # closes the channel, once

    def __enter__(self) -> KVClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""``AsyncKVClient``: the asyncio SDK over the same :mod:`client._core`.

The driver (``AsyncKVClient._run``) performs the core's instructions on the caller's event
loop; blocking ones (``Io``: copies, data-channel transfers) in worker threads.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Unpack

import grpc

from client._api import AsyncBlockCalls
from client._channel import (
    CHANNEL_OPTIONS,
    RETRIES,
    call_metadata,
    etcd_route,
    resolve_token,
    rpc_error,
    stream_metadata,
)
from client._core import IDEMPOTENT, ClientCore, Op, T, as_key_list, fingerprint, report_request, skipped_request
from client._instructions import GetStream, Io, PutStream, Rpc, RpcNoWait, instruction
from client._options import ClientKwargs, ClientOptions
from kvstore.aio import await_to_the_end
from kvstore.errors import Unavailable
from kvstore.keys import Namespace, check_key
from kvstore.tls import secure_channel
from protos.kvstore.v1 import kvstore_pb2 as pb
from protos.kvstore.v1 import kvstore_pb2_grpc as pb_grpc


class AsyncKVClient(AsyncBlockCalls):
    """The asyncio twin of :class:`client.KVClient` (same methods, awaited).

    Copies and data-channel transfers run in worker threads so the event loop stays free.
    Use it from one event loop.  Options (``ClientOptions`` or keyword arguments) as for
    :class:`client.KVClient`; for an ``etcd://`` target use :func:`client.connect_async`.
    """

    def __new__(cls, target: str, options: ClientOptions | None = None, **kwargs: Any) -> Any:
        # deprecated, for one release: an etcd:// target returns an AsyncClusterClient (use client.connect_async)
        if cls is AsyncKVClient:
            route = etcd_route("async", target, "AsyncKVClient", "client.connect_async")
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
        # made on first use: a grpc.aio channel belongs to the loop it was created on, and
        # clients are often constructed before the loop that uses them (asyncio.run(main()))
        self._channel: grpc.aio.Channel | None = None
        self._inflight: set[asyncio.Future[Any]] = set()
        self._stub_: pb_grpc.KVStoreStub | None = None

    @property
    def _stub(self) -> pb_grpc.KVStoreStub:
        if self._stub_ is None:
            self._channel = secure_channel(self._core.target.grpc_target, self._tls, CHANNEL_OPTIONS, aio=True)
            self._stub_ = pb_grpc.KVStoreStub(self._channel)
        return self._stub_

    async def _rpc(self, method: str, request: Any) -> Any:
        if method == "Stats" and self._inflight:  # stats reflect this client's own releases
            await asyncio.wait(list(self._inflight), timeout=self._core.timeouts.rpc)
        attempts = RETRIES + 1 if method in IDEMPOTENT else 1
        for attempt in range(attempts):
            try:
                return await getattr(self._stub, method)(
                    request, timeout=self._core.timeouts.rpc, metadata=self._metadata
                )
            except grpc.RpcError as e:
                err = rpc_error(e, self._tls, self._core.target.grpc_target)
                if isinstance(err, Unavailable) and attempt + 1 < attempts:
                    await asyncio.sleep(0.05 * (attempt + 1))
                    continue
                raise err from None
        raise AssertionError("unreachable")

    def _fire(self, method: str, request: Any) -> None:
        """Start a call without waiting; its outcome is dropped (``close`` still delivers it)."""
        task = asyncio.ensure_future(
            getattr(self._stub, method)(request, timeout=self._core.timeouts.rpc, metadata=self._metadata)
        )
        self._inflight.add(task)
        task.add_done_callback(_forget(self._inflight))

    async def _perform(self, instr: Any, cancelled: bool) -> Any:
        match instr:
            case RpcNoWait(method, request):
                self._fire(method, request)
                return None
            case Rpc(method, request) if cancelled:
                # after a cancel the op only gives things back (Abort, Release): sent, not
                # awaited, so the cancel takes effect now even if the node hangs
                self._fire(method, request)
                return None
            case Rpc(method, request):
                return await self._rpc(method, request)
            case Io(fn):
                return await _uncancellable_thread(fn)
            case PutStream(chunks, blocks):
                try:
                    return await self._stub.PutStream(
                        chunks(), timeout=self._core.timeouts.data, metadata=stream_metadata(self._metadata, blocks)
                    )
                except grpc.RpcError as e:
                    raise rpc_error(e, self._tls, self._core.target.grpc_target) from None
            case GetStream(request):
                try:
                    call = self._stub.GetStream(request, timeout=self._core.timeouts.data, metadata=self._metadata)
                    return [c async for c in call]
                except grpc.RpcError as e:
                    raise rpc_error(e, self._tls, self._core.target.grpc_target) from None
            case other:
                raise AssertionError(f"unknown instruction {other!r:.80}")

    async def _run(self, op: Op[T]) -> T:
        self._core.check_open()
        cancelled = False
        try:
            instr = next(op)
            while True:
                try:
                    result = await self._perform(instruction(instr), cancelled)
                except BaseException as e:  # noqa: B036 - thrown into the op, which re-raises it
                    # a KVStoreError, or this task cancelled (the caller gave up): either way the
                    # op first gives back what it holds (aborts, releases) rather than leaving
                    # it pinned on the node until the TTL
                    cancelled = cancelled or isinstance(e, asyncio.CancelledError)
                    instr = op.throw(e)
                    continue
                instr = op.send(result)
        except StopIteration as stop:
            return stop.value

    async def lookup(self, keys: Sequence[bytes], *, session_id: str | None = None) -> list[str | None]:
        return await self._run(self._core.lookup(as_key_list(keys), session=session_id))

    async def match_prefix(self, keys: Sequence[bytes], *, session_id: str | None = None) -> int:
        return (await self._run(self._core.match_prefix(as_key_list(keys), session=session_id)))[0]

    async def match_prefix_tiers(
        self, keys: Sequence[bytes], *, session_id: str | None = None
    ) -> tuple[int, list[str]]:
        return await self._run(self._core.match_prefix(as_key_list(keys), session=session_id))

    async def close_session(self, session_id: str) -> bool:
        """Session hints: ``session_id`` sends no more requests, so the blocks only it (and other
        closed sessions) used are the node's first eviction candidates.  False if the node has
        no such session of this caller open; ``PermissionDenied`` if another tenant's."""
        return await self._run(self._core.close_session(session_id)) is not None

    async def delete(self, keys: Sequence[bytes]) -> int:
        return await self._run(
            self._core.simple("Delete", pb.KeysRequest(keys=[check_key(k) for k in as_key_list(keys)]))
        )

    async def pin(self, keys: Sequence[bytes], ttl: float) -> int:
        return await self._run(
            self._core.simple("Pin", pb.PinRequest(keys=[check_key(k) for k in as_key_list(keys)], ttl_s=ttl))
        )

    async def unpin(self, keys: Sequence[bytes]) -> int:
        return await self._run(
            self._core.simple("Unpin", pb.KeysRequest(keys=[check_key(k) for k in as_key_list(keys)]))
        )

    async def invalidate(self, namespace: bytes | Namespace) -> int:
        return await self._run(self._core.simple("Invalidate", pb.InvalidateRequest(namespace=fingerprint(namespace))))

    async def report_hits(
        self,
        blocks: int,
        tokens: int = 0,
        *,
        tier: str = "hbm",
        op: str = "get",
        namespace: bytes | Namespace | None = None,
    ) -> None:
        await self._run(self._core.call("ReportHits", report_request(blocks, tokens, tier, op, namespace)))

    async def report_skipped_saves(self, chunks: int, *, namespace: bytes | Namespace | None = None) -> None:
        await self._run(self._core.call("ReportHits", skipped_request(chunks, namespace)))

    async def stats(self) -> dict[str, Any]:
        return await self._run(self._core.stats())

    async def close(self) -> None:
        if self._inflight:  # deliver releases still in flight before the channel goes
            await asyncio.wait(list(self._inflight), timeout=self._core.timeouts.rpc)
        self._core.close()
        if self._channel is not None:
            await self._channel.close()

    async def __aenter__(self) -> AsyncKVClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def _uncancellable_thread(fn: Any) -> Any:
    """``fn()`` in a worker thread.  If we are cancelled meanwhile, wait for the thread before
    re-raising: it copies into or out of arena extents, which the op gives back to the node
    as it unwinds (and the node may hand to another block at once)."""
    return await await_to_the_end(asyncio.ensure_future(asyncio.to_thread(fn)))


def _forget(pending: set[Any]) -> Any:
    """A done-callback that drops a fire-and-forget call and swallows its outcome."""

    def done(task: Any) -> None:
        pending.discard(task)
        if not task.cancelled():
            task.exception()

    return done

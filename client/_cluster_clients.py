"""The cluster SDK's two drivers: :class:`ClusterClient` (blocking) and
:class:`AsyncClusterClient` (asyncio), over the one routing core in :mod:`client._cluster`.

``client.connect("etcd://...")`` / ``client.connect_async("etcd://...")`` return these.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import Any, Unpack

from client._api import AsyncBlockCalls, BlockCalls
from client._cluster import ClusterCore, ClusterOp, Etcd, Fanout, NodeOp, T
from client._core import fingerprint
from client._options import ClientKwargs, ClientOptions
from kvstore.block import BlockMeta
from kvstore.cluster.membership import Membership
from kvstore.cluster.state import ClusterSnapshot, NodeInfo
from kvstore.errors import InvalidArgument, KVStoreError, Unavailable
from kvstore.keys import ChunkKey, Namespace, check_key
from protos.kvstore.v1 import kvstore_pb2 as pb

# -- drivers ---------------------------------------------------------------------------------------


def _close_request(session_id: str) -> pb.CloseSessionRequest:
    from client._core import session_field

    sid = session_field(session_id)
    if not sid:
        raise InvalidArgument("close_session needs a session id")
    return pb.CloseSessionRequest(session_id=sid)


def _closed_anywhere(results: dict[str, Any]) -> bool:
    """A close fanned out to every node: whether one had the session open (nodes that failed count as not)."""
    return any(r is True for r in results.values())


class _ClusterBase:
    """The API both drivers share: argument handling and the calls that need no I/O."""

    _core: ClusterCore

    def _init_core(
        self,
        target: str,
        opts: ClientOptions,
        *,
        replication: int | None,
        suspect_s: float,
        prefer_local: bool,
        wait_s: float,
    ) -> None:
        """The routing core, and the options of every per-node client (``_node_options``)."""
        from client._channel import resolve_token

        if not isinstance(opts.transport, str):
            raise InvalidArgument("a cluster client's transport is a name: each node gets a transport of its own")
        # TLS files are read now, so a bad one fails here rather than as every node being "down"
        opts.client_tls()
        self._core = ClusterCore(
            target,
            timeouts=opts.timeouts,
            transport=opts.transport,
            verify=opts.verify,
            replication=replication,
            suspect_s=suspect_s,
            prefer_local=prefer_local,
            wait_s=wait_s,
        )
        # the token is resolved once (a token file is read here), and every node shares the timeouts
        self._node_options = dataclasses.replace(
            opts,
            token=resolve_token(opts.token, opts.token_file) or None,
            token_file=None,
            timeouts=self._core.timeouts,
        )
        self._clients: dict[str, tuple[tuple[Any, ...], Any]] = {}

    @staticmethod
    def _ident(info: NodeInfo) -> tuple[Any, ...]:
        """What a per-node client is good for: a node restarted under its id is a new client."""
        return (info.grpc, info.unix, info.pid, info.started_at)

    @property
    def membership(self) -> Membership:
        return self._core.membership

    def snapshot(self) -> ClusterSnapshot:
        """The membership, configuration and namespace epochs this client routes by."""
        return self._core.membership.snapshot()

    def nodes(self) -> list[str]:
        return sorted(self._core.routing().nodes)

    def owners(self, key: bytes) -> list[str]:
        """The nodes that own ``key`` now, best first."""
        return self._core.routing().owners(check_key(key))

    def wait_for_nodes(self, n: int, timeout: float = 30.0) -> bool:
        """Wait until the view shows at least ``n`` live nodes."""
        return self._core.membership.wait_for(lambda s: len(s.nodes) >= n, timeout) is not None

    def chunk_keys(self, tokens: Any, namespace: Namespace) -> list[ChunkKey]:
        """Keys for ``tokens`` at the namespace's current epoch (equal to
        :func:`client.chunk_keys` until the namespace is first invalidated)."""
        return self._core.chunk_keys(tokens, namespace)

    def effective_namespace(self, namespace: Namespace | bytes) -> bytes:
        """The fingerprint blocks of ``namespace`` are stored under at its current epoch."""
        return self._core.effective(namespace)

    def epoch(self, namespace: Namespace | bytes) -> int:
        return self._core.epoch(fingerprint(namespace))

    @property
    def handoffs(self) -> int:
        """Blocks this client copied to a new owner after finding them on a previous owner."""
        return self._core.handoffs

    @property
    def suspects(self) -> dict[str, float]:
        """Nodes being routed around, with the seconds left."""
        return self._core.suspects.snapshot()

    def miss_counts(self) -> dict[str, int]:
        """Keys this client found missing because an owner was down (``node_down``: it failed,
        or was being routed around) or too slow (``deadline``).  These are the two miss reasons
        no node can count; the nodes' ``kvstore_miss_blocks_total`` counts the others."""
        with self._core._misses_lock:
            return dict(self._core.misses)

    def under_replicated(self) -> dict[str, int]:
        """Block copies this client's puts did not write, short of R per block: ``suspect``
        (the owner was being routed around, so the put skipped it; no other node stands in)
        and ``failed`` (the owner's call failed).  A put still returns True when another owner
        stored the block; with R = 1 a skipped copy is a block not stored at all."""
        return self._core.under_replicated()

    @staticmethod
    def _no_views() -> InvalidArgument:
        return InvalidArgument(
            "zero-copy views need one node: use KVClient('unix:///path/to/kvstore.sock') of the local node"
        )


def report_to_a_node(core: Any, client_for: Any, send: str) -> None:
    """Tell a live node what this client counted and nodes cannot see (misses for owners down
    or late, under-replicated copies), so its /metrics and dashboards show it.  Sent without
    waiting (``send``: the node client's fire-and-forget method); best effort: the counts stay
    in ``miss_counts()`` / ``under_replicated()`` whatever happens."""
    try:
        reqs, info = core.take_report()
        if info is None:
            return
        client = client_for(info)
        for req in reqs:
            getattr(client, send)("ReportHits", req)
    except KVStoreError:
        pass


class ClusterClient(_ClusterBase, BlockCalls):
    """A blocking client of a whole cluster; ``client.connect("etcd://...")`` returns one.

    Same methods as :class:`client.KVClient` (plus :meth:`chunk_keys`,
    :meth:`match_prefix_locations`, :meth:`owners`, ...).  Thread-safe.  Batch calls fan
    out to the owning nodes on a small thread pool.  The TLS keyword arguments (as for
    :class:`client.KVClient`) go to every per-node client; etcd itself is dialled as before.
    """

    def __init__(
        self,
        target: str,
        options: ClientOptions | None = None,
        *,
        replication: int | None = None,
        suspect_s: float = 2.0,
        prefer_local: bool = True,
        wait_s: float = 10.0,
        max_workers: int = 16,
        **kwargs: Unpack[ClientKwargs],
    ) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._init_core(
            target,
            ClientOptions.of(options, dict(kwargs)),
            replication=replication,
            suspect_s=suspect_s,
            prefer_local=prefer_local,
            wait_s=wait_s,
        )
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="kvstore-cluster")

    def _client(self, info: NodeInfo) -> Any:
        from client._sync import KVClient

        ident = self._ident(info)
        with self._lock:
            entry = self._clients.get(info.node_id)
            if entry is not None and entry[0] == ident:
                return entry[1]
            client = KVClient(self._core.node_target(info), self._node_options)
            self._clients[info.node_id] = (ident, client)
        if entry is not None:  # the node restarted: its old address is gone
            entry[1].close()
        return client

    def _call(self, info: NodeInfo, make: NodeOp) -> Any:
        try:
            client = self._client(info)
            return client._run(make(client._core))
        except KVStoreError as e:
            return e

    def _run(self, op: ClusterOp[T]) -> T:
        if self._core.closed:
            raise Unavailable("this client is closed; create a new one")
        try:
            instr = next(op)
            while True:
                result: Any
                match instr:
                    case Fanout(routing, calls):
                        infos = [self._core.node_info(routing, n) for n, _ in calls]
                        if len(calls) == 1:
                            result = [self._call(infos[0], calls[0][1])]
                        else:
                            futs = [self._pool.submit(self._call, info, make) for info, (_, make) in zip(infos, calls)]
                            result = [f.result() for f in futs]
                    case Etcd(fn):
                        result = self._core.membership.call(fn)
                    case _:
                        raise AssertionError(f"unknown instruction {instr!r}")
                instr = op.send(result)
        except StopIteration as stop:
            return stop.value
        finally:
            report_to_a_node(self._core, self._client, "_start")

    # -- API (as KVClient) --------------------------------------------------------------------------

    def warm(self) -> int:
        """Connect to every node of the current membership now, side by side (each node's
        client made and its Hello answered), so that the first call to a node does not pay
        for it (about 90 ms on a two-core machine, several times a pulled chunk's own copy).
        Returns the nodes reached; one that does not answer is left to its first call."""
        if self._core.closed:
            raise Unavailable("this client is closed; create a new one")
        routing = self._core.routing()

        def hello(node: str) -> int:
            try:
                return int(self._client(self._core.node_info(routing, node)).warm())
            except KVStoreError:
                return 0

        return sum(self._pool.map(hello, list(routing.nodes)))

    def lookup(self, keys: Sequence[bytes], *, session_id: str | None = None) -> list[str | None]:
        return self._run(self._core.lookup(keys, session=session_id))[0]

    def lookup_locations(self, keys: Sequence[bytes]) -> list[tuple[str, str] | None]:
        """``(node_id, tier)`` holding each key, or None."""
        tiers, where = self._run(self._core.lookup(keys))
        return [(w, t) if t is not None and w is not None else None for t, w in zip(tiers, where)]

    def match_prefix(self, keys: Sequence[bytes], *, session_id: str | None = None) -> int:
        return self._run(self._core.match_prefix(keys, session=session_id))[0]

    def match_prefix_tiers(self, keys: Sequence[bytes], *, session_id: str | None = None) -> tuple[int, list[str]]:
        n, tiers, _ = self._run(self._core.match_prefix(keys, session=session_id))
        return n, tiers

    def match_prefix_locations(self, keys: Sequence[bytes]) -> tuple[int, list[tuple[str, str]]]:
        """How many leading keys the cluster holds, and the (node_id, tier) of each."""
        n, tiers, where = self._run(self._core.match_prefix(keys))
        return n, list(zip(where, tiers))

    def delete(self, keys: Sequence[bytes]) -> int:
        return self._run(self._core.delete(keys))

    def pin(self, keys: Sequence[bytes], ttl: float) -> int:
        return self._run(self._core.to_owners(keys, "Pin", lambda ks: pb.PinRequest(keys=ks, ttl_s=ttl)))

    def unpin(self, keys: Sequence[bytes]) -> int:
        return self._run(self._core.to_owners(keys, "Unpin", lambda ks: pb.KeysRequest(keys=ks)))

    def invalidate(self, namespace: bytes | Namespace) -> int:
        """Bump the namespace's epoch in etcd: no node serves its old blocks, and all drop them."""
        return self._run(self._core.invalidate(namespace))

    def stats(self) -> dict[str, Any]:
        return self._run(self._core.stats())

    def close_session(self, session_id: str) -> bool:
        """Session hints: end ``session_id`` on every live node (its blocks may be on any).
        True if some node had it open; ``PermissionDenied`` if another tenant's."""
        return _closed_anywhere(
            self._run(self._core.to_all("CloseSession", _close_request(session_id), field="closed"))
        )

    def acquire(self, keys: Sequence[bytes]) -> Any:
        raise self._no_views()

    def reserve(self, metas: Sequence[BlockMeta]) -> Any:
        raise self._no_views()

    def close(self) -> None:
        if self._core.closed:
            return
        self._core.close()
        self._pool.shutdown(wait=True)
        with self._lock:
            clients, self._clients = self._clients, {}
        for _, c in clients.values():
            c.close()

    def __enter__(self) -> ClusterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClusterClient(_ClusterBase, AsyncBlockCalls):
    """The asyncio twin of :class:`ClusterClient`; ``client.connect_async("etcd://...")`` returns one.

    Use it from one event loop.  The membership view runs on its own thread either way.
    """

    def __init__(
        self,
        target: str,
        options: ClientOptions | None = None,
        *,
        replication: int | None = None,
        suspect_s: float = 2.0,
        prefer_local: bool = True,
        wait_s: float = 10.0,
        **kwargs: Unpack[ClientKwargs],
    ) -> None:
        self._init_core(
            target,
            ClientOptions.of(options, dict(kwargs)),
            replication=replication,
            suspect_s=suspect_s,
            prefer_local=prefer_local,
            wait_s=wait_s,
        )
        self._stale: list[Any] = []

    def _client(self, info: NodeInfo) -> Any:
        from client._async import AsyncKVClient

        ident = self._ident(info)
        entry = self._clients.get(info.node_id)
        if entry is not None and entry[0] == ident:
            return entry[1]
        if entry is not None:
            self._stale.append(entry[1])
        client = AsyncKVClient(self._core.node_target(info), self._node_options)
        self._clients[info.node_id] = (ident, client)
        return client

    async def _call(self, info: NodeInfo, make: NodeOp) -> Any:
        try:
            client = self._client(info)
            return await client._run(make(client._core))
        except KVStoreError as e:
            return e

    async def _run(self, op: ClusterOp[T]) -> T:
        import asyncio

        if self._core.closed:
            raise Unavailable("this client is closed; create a new one")
        while self._stale:
            await self._stale.pop().close()
        try:
            instr = next(op)
            while True:
                result: Any
                match instr:
                    case Fanout(routing, calls):
                        result = await asyncio.gather(
                            *(self._call(self._core.node_info(routing, n), make) for n, make in calls)
                        )
                    case Etcd(fn):
                        result = await asyncio.wait_for(
                            self._core.membership.run_async(fn), self._core.membership.timeout * 3 + 1
                        )
                    case _:
                        raise AssertionError(f"unknown instruction {instr!r}")
                instr = op.send(result)
        except StopIteration as stop:
            return stop.value
        except TimeoutError:
            raise Unavailable(f"etcd at {self._core.membership.endpoints} did not answer in time") from None
        finally:
            report_to_a_node(self._core, self._client, "_fire")

    async def lookup(self, keys: Sequence[bytes], *, session_id: str | None = None) -> list[str | None]:
        return (await self._run(self._core.lookup(keys, session=session_id)))[0]

    async def lookup_locations(self, keys: Sequence[bytes]) -> list[tuple[str, str] | None]:
        tiers, where = await self._run(self._core.lookup(keys))
        return [(w, t) if t is not None and w is not None else None for t, w in zip(tiers, where)]

    async def match_prefix(self, keys: Sequence[bytes], *, session_id: str | None = None) -> int:
        return (await self._run(self._core.match_prefix(keys, session=session_id)))[0]

    async def match_prefix_tiers(
        self, keys: Sequence[bytes], *, session_id: str | None = None
    ) -> tuple[int, list[str]]:
        n, tiers, _ = await self._run(self._core.match_prefix(keys, session=session_id))
        return n, tiers

    async def match_prefix_locations(self, keys: Sequence[bytes]) -> tuple[int, list[tuple[str, str]]]:
        n, tiers, where = await self._run(self._core.match_prefix(keys))
        return n, list(zip(where, tiers))

    async def delete(self, keys: Sequence[bytes]) -> int:
        return await self._run(self._core.delete(keys))

    async def pin(self, keys: Sequence[bytes], ttl: float) -> int:
        return await self._run(self._core.to_owners(keys, "Pin", lambda ks: pb.PinRequest(keys=ks, ttl_s=ttl)))

    async def unpin(self, keys: Sequence[bytes]) -> int:
        return await self._run(self._core.to_owners(keys, "Unpin", lambda ks: pb.KeysRequest(keys=ks)))

    async def invalidate(self, namespace: bytes | Namespace) -> int:
        return await self._run(self._core.invalidate(namespace))

    async def stats(self) -> dict[str, Any]:
        return await self._run(self._core.stats())

    async def close_session(self, session_id: str) -> bool:
        """See :meth:`ClusterClient.close_session`."""
        return _closed_anywhere(
            await self._run(self._core.to_all("CloseSession", _close_request(session_id), field="closed"))
        )

    def acquire(self, keys: Sequence[bytes]) -> Any:
        raise self._no_views()

    def reserve(self, metas: Sequence[BlockMeta]) -> Any:
        raise self._no_views()

    async def close(self) -> None:
        import asyncio

        if self._core.closed:
            return
        await asyncio.to_thread(self._core.close)  # joins the membership thread
        clients, self._clients = self._clients, {}
        for c in [*(c for _, c in clients.values()), *self._stale]:
            await c.close()
        self._stale = []

    async def __aenter__(self) -> AsyncClusterClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

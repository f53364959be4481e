"""The SDK core shared by ``KVClient`` and ``AsyncKVClient``.

Every operation is written once, as a generator that *yields instructions*
(:mod:`client._instructions`: ``Rpc``, ``RpcNoWait``, ``Io``, ``PutStream``, ``GetStream``)
and gets their results sent back (a sans-I/O core).  So the sync and async clients differ
only in their drivers (a ``match`` over the instructions), and tests can drive the core
with a fake node and a fake transport (``tests/unit/test_client_core.py``).  Errors raised
by a driver are thrown back into the generator, which cleans up (aborts reservations,
releases leases) before they propagate.

Session hints: ``session`` (the SDK's ``session_id=``; a string, or None) on puts, reads and lookups goes to the node
in each request's ``session_id``, so the blocks stay valuable while the session is open;
``close_session`` ends it (``kvstore/node/sessions.py``).

No request exceeds the node's ``max_batch`` (learnt from ``Hello``): batch operations go
in batches that fit, so a caller never meets the limit, whatever it passes.

Transports (:mod:`client._transports`), chosen per target after the first ``Hello``:
* ``unix://`` target: **shared memory** (``SharedMemory``).  gRPC carries only extents and
  leases; the bytes are copied between the caller's buffer and the node's arena, which this
  process maps once.  If the arena cannot be mapped (another machine's ``/dev/shm``) and
  the transport was ``"auto"``, the streaming fallback.
* ``host:port`` target: the **data channel** (``DataChannel``: bytes on a raw TCP socket,
  received straight into the caller's buffer; TLS-wrapped when the client has TLS settings);
  ``transport="grpc-stream"`` forces the slow streaming fallback (``GrpcStream``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from client._instructions import RETRY, Op, Rpc, RpcNoWait, T, best_effort
from client._options import Timeouts
from client._stats import Counters
from client._transports import (
    BY_NAME,
    STREAM_BATCH_BYTES,
    STREAM_CHUNK,
    DataChannel,
    GrpcStream,
    SharedMemory,
    Transport,
)
from kvstore.block import DTYPES, MAX_NDIM, BlockMeta, checksum
from kvstore.errors import InvalidArgument, Unavailable
from kvstore.keys import NO_PARENT, check_key
from kvstore.shm import ArenaMapping, as_bytes_view
from kvstore.vocabulary import check_session_id
from kvstore.wire import TIER_NAMES, extents_from_pb, meta_from_pb, meta_to_pb, trusted_meta
from protos.kvstore.v1 import kvstore_pb2 as pb

__all__ = [  # names other SDK modules (and the cluster router) import from here
    "IDEMPOTENT",
    "STREAM_BATCH_BYTES",
    "STREAM_CHUNK",
    "TRANSPORTS",
    "ClientCore",
    "Op",
    "T",
    "Target",
    "Timeouts",
    "as_key_list",
    "fingerprint",
    "session_field",
]

IDEMPOTENT = {
    "Hello",
    "Lookup",
    "MatchPrefix",
    "Stats",
    "Delete",
    "Pin",
    "Unpin",
    "Invalidate",
    "Release",
    "Abort",
    "CloseSession",
}
TRANSPORTS = ("auto", *BY_NAME)  # the names ``transport=`` takes
_T = TypeVar("_T", bound=Transport)


def _relearn_node_on_unavailable(op: Callable[..., Op[T]]) -> Callable[..., Op[T]]:
    """After ``Unavailable`` the node may come back as a new process, with a new data port
    or arena: mark what its ``Hello`` said as stale, so the next operation asks again."""

    @functools.wraps(op)
    def wrapper(self: ClientCore, *args: Any, **kwargs: Any) -> Op[T]:
        try:
            return (yield from op(self, *args, **kwargs))
        except Unavailable:
            self.stale = True  # not ``hello = None``: other threads' operations still read it
            raise

    return wrapper


@dataclasses.dataclass(frozen=True, slots=True)
class Target:
    grpc_target: str
    local: bool
    host: str  # for the data channel of TCP targets

    @classmethod
    def parse(cls, target: str) -> Target:
        if not isinstance(target, str) or not target:
            raise InvalidArgument(f"target must be 'unix:///path' or 'host:port', got {target!r}")
        if target.startswith("unix:"):
            path = target[len("unix:") :]
            path = "/" + path.lstrip("/") if path.startswith("//") else path
            return cls(f"unix://{path}" if path.startswith("/") else target, True, "")
        if target.startswith("etcd://"):
            # KVClient/AsyncKVClient hand etcd:// targets to the cluster router (client/_cluster.py),
            # which drives one ClientCore per node; a core itself always talks to one node
            raise InvalidArgument(
                "an etcd:// cluster target needs KVClient or AsyncKVClient (which route over the cluster), not a single-node core"
            )
        host, sep, port = target.rpartition(":")
        if not sep or not port.isdigit() or not host:
            raise InvalidArgument(f"target must be 'unix:///path' or 'host:port', got {target!r}")
        return cls(target, False, host.strip("[]"))


def session_field(session: object) -> str:
    """A ``session`` argument as the ``session_id`` field carries it ("" for none); bad ones raise InvalidArgument."""
    return check_session_id(session) or ""


def fingerprint(namespace: object) -> bytes:
    """The 8-byte fingerprint of a :class:`~kvstore.keys.Namespace`, or the fingerprint itself."""
    fp = getattr(namespace, "fingerprint", namespace)
    if isinstance(fp, (bytearray, memoryview)):
        fp = bytes(fp)
    if not isinstance(fp, bytes) or len(fp) != 8:
        raise InvalidArgument(f"namespace must be a Namespace or its fingerprint (8 bytes), got {namespace!r:.80}")
    return fp


def namespace_name(namespace: object) -> str:
    """A readable name of a :class:`~kvstore.keys.Namespace` (``model[@revision][+lora]``); "" for a bare fingerprint."""
    model = getattr(namespace, "model_id", "")
    if not model:
        return ""
    rev, lora = getattr(namespace, "model_revision", "main"), getattr(namespace, "lora_id", "")
    return model + (f"@{rev}" if rev and rev != "main" else "") + (f"+{lora}" if lora else "")


_DTYPE_NAMES: dict[object, str] = {}


def _dtype_name(dt: object) -> str:
    """``str`` of a numpy or torch dtype, without ``torch.``; cached (numpy's ``str`` of a
    dtype costs ~5 us, a tenth of a small block's whole put)."""
    try:
        return _DTYPE_NAMES[dt]
    except KeyError:
        name = _DTYPE_NAMES[dt] = str(dt).removeprefix("torch.")
        return name
    except TypeError:  # not hashable: not a dtype we know
        return str(dt).removeprefix("torch.")


def describe(
    key: bytes,
    data: memoryview,
    obj: object,
    *,
    namespace: bytes | None,
    parent: bytes | None,
    token_count: int,
    with_checksum: bool = True,
) -> BlockMeta:
    """Block metadata for a payload; dtype and shape come from numpy arrays and tensors.

    ``with_checksum=False`` leaves ``payload_checksum`` 0 for the caller to fill in later.
    """
    nbytes = data.nbytes
    dtype: str = "uint8"
    shape: tuple[int, ...] = (nbytes,)
    np_dtype = getattr(obj, "dtype", None)
    if np_dtype is not None and hasattr(obj, "shape"):
        name = _dtype_name(np_dtype)
        if name in DTYPES:
            dtype, shape = name, tuple([int(d) for d in obj.shape])
            if len(shape) > MAX_NDIM or (not shape and nbytes) or math.prod(shape) * DTYPES[name][1] != nbytes:
                dtype, shape = "uint8", (nbytes,)
    given = token_count
    try:
        token_count = operator.index(token_count)
    except TypeError:
        token_count = -1
    if not 0 <= token_count < 2**32:
        raise InvalidArgument(f"token_count must be an integer in [0, 2**32), got {given!r:.40}")
    # every rule BlockMeta checks holds by construction (keys checked, the shape matches the
    # payload, a u64 checksum): built without checking again, a third of the cost per block
    return trusted_meta(
        fingerprint(namespace) if namespace is not None else bytes(8),
        check_key(key),
        check_key(parent) if parent is not None else NO_PARENT,
        token_count,
        dtype,
        shape,
        nbytes,
        checksum(data) if with_checksum else 0,
    )


class ClientCore:
    """Holds what a client learned about its node (its ``Hello``) and the transport bound to it.

    Owned by one client object.  ``transport``: the :class:`~client._transports.Transport` chosen
    at the first ``Hello`` (None before), from ``requested`` (a name, or a Transport object used
    as is); it is thread-safe for the disjoint copies the operations make.
    """

    def __init__(
        self,
        target: str,
        *,
        transport: str | Transport = "auto",
        timeouts: Timeouts | None = None,
        verify: bool = True,
        tls: Any = None,
    ) -> None:
        if not isinstance(transport, Transport) and transport not in TRANSPORTS:
            raise InvalidArgument(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        self.target = Target.parse(target)
        self.requested = transport  # a name ("auto": by target), or a Transport object to use as is
        self.timeouts = timeouts or Timeouts()
        self.verify = verify
        self.tls = tls  # kvstore.tls.ClientTLS | None: the owning client's, for the data channel
        self.hello: pb.HelloResponse | None = None
        self.stale = False  # the node was unreachable: ask for its Hello again before the next operation
        self.transport: Transport | None = None  # chosen at the first Hello
        self.closed = False
        self.named: set[bytes] = set()  # namespaces whose name the node was sent

    @property
    def arena(self) -> ArenaMapping | None:
        """The node's arena as this process maps it, on the shared-memory transport; else None."""
        return self.transport.arena if isinstance(self.transport, SharedMemory) else None

    def check_open(self) -> None:
        if self.closed:
            raise Unavailable("this client is closed; create a new one")

    # -- connection set-up -------------------------------------------------------------
    def ensure_hello(self) -> Op[None]:
        if self.hello is not None and not self.stale and not (self.transport is not None and self.transport.stale()):
            return
        hello = yield Rpc("Hello", pb.HelloRequest())
        self.transport = self._connect(hello)
        self.hello = hello
        self.stale = False

    def _connect(self, hello: pb.HelloResponse) -> Transport:
        """The transport for the node that answered ``hello``, bound to it: the same object as
        before when the kind is unchanged (a restarted node), so its resources are replaced."""
        bind = {"host": self.target.host, "hello": hello, "timeouts": self.timeouts, "tls": self.tls}
        if isinstance(self.requested, Transport):
            self.requested.connect(**bind)
            return self.requested
        name = self.requested
        if name == "auto":
            name = "shm" if self.target.local else "data-channel"
        if name == "shm":
            if not self.target.local:
                raise InvalidArgument("transport='shm' needs a unix:// target on the node's machine")
            shm = self._reuse(SharedMemory)
            try:
                shm.connect(**bind)
                return shm
            except Unavailable:
                if self.requested == "shm":
                    raise
                name = "grpc-stream"  # same machine, but the arena is not shared with us
        if name == "data-channel":
            if self.target.local:
                raise InvalidArgument("transport='data-channel' needs a host:port target")
            dc = self._reuse(DataChannel)
            dc.connect(**bind)
            return dc
        return self._reuse(GrpcStream)

    def _reuse(self, kind: type[_T]) -> _T:
        return self.transport if isinstance(self.transport, kind) else kind()

    def _batches(
        self, n: int, sizes: Sequence[int] | None = None, *, limit: int | None = None, budget: int | None = None
    ) -> list[range]:
        """Split ``n`` items by the node's max batch and a byte budget (default 1/4 of the arena)."""
        assert self.hello is not None
        limit = max(1, min(self.hello.max_batch, limit or self.hello.max_batch))
        budget = max(1, min(self.hello.arena_size // 4, budget or self.hello.arena_size))
        out, start, acc = [], 0, 0
        for i in range(n):
            size = sizes[i] if sizes is not None else 0
            if i > start and (i - start >= limit or acc + size > budget):
                out.append(range(start, i))
                start, acc = i, 0
            acc += size
        if start < n:
            out.append(range(start, n))
        return out

    def _limit(self, n: int) -> Op[int]:
        """How many keys or ids one request may carry, for a call of ``n``: the node's
        ``max_batch``, from its ``Hello`` (asked for now if this client has not yet)."""
        if n <= 1:
            return 1
        yield from self.ensure_hello()
        assert self.hello is not None
        return max(1, self.hello.max_batch)

    @staticmethod
    def _spans(n: int, limit: int) -> list[slice]:
        """``n`` items in slices of ``limit``; an empty call is still one (empty) request."""
        return [slice(i, i + limit) for i in range(0, n, limit)] or [slice(0, 0)]

    # -- writes -------------------------------------------------------------------------
    @_relearn_node_on_unavailable
    def put_many(
        self,
        keys: Sequence[bytes],
        datas: Sequence[object],
        *,
        namespace: bytes | None = None,
        parents: Sequence[bytes | None] | None = None,
        token_counts: Sequence[int] | None = None,
        session: str | None = None,
    ) -> Op[list[bool]]:
        sid = session_field(session)
        if len(keys) != len(datas):
            raise InvalidArgument(f"{len(keys)} keys but {len(datas)} payloads")
        if parents is not None and len(parents) != len(keys):
            raise InvalidArgument(f"{len(keys)} keys but {len(parents)} parents")
        views = [as_bytes_view(d) for d in datas]
        metas = [
            describe(
                k,
                v,
                d,
                namespace=namespace,
                parent=parents[i] if parents else None,
                token_count=token_counts[i] if token_counts else 0,
                with_checksum=False,
            )
            for i, (k, v, d) in enumerate(zip(keys, views, datas))
        ]
        yield from self.ensure_hello()
        assert self.hello is not None
        name = namespace_name(namespace)
        if name and metas and metas[0].namespace not in self.named:
            # once per namespace: the node shows this name instead of the fingerprint (dashboard, /metrics)
            self.named.add(metas[0].namespace)
            yield RpcNoWait(
                "ReportHits", pb.ReportHitsRequest(op="get", namespace=metas[0].namespace, namespace_name=name)
            )
        transport = self.transport
        assert transport is not None
        if not transport.hashes_while_copying:  # shared memory hashes as it copies and sends the sums with Commit
            metas = [dataclasses.replace(m, payload_checksum=checksum(v)) for m, v in zip(metas, views)]
        for m in metas:
            if m.payload_len > self.hello.max_block_bytes:
                raise InvalidArgument(
                    f"block of {m.payload_len} bytes exceeds the node's max_block_bytes={self.hello.max_block_bytes} "
                    "(its max_block_bytes setting, or its DRAM arena's size if smaller: a block must fit in DRAM)"
                )
        stored = [False] * len(keys)
        for batch in self._batches(len(keys), [m.payload_len for m in metas], budget=transport.batch_bytes):
            ok = yield from transport.put([metas[i] for i in batch], [views[i] for i in batch], sid)
            for i, good in zip(batch, ok):
                stored[i] = good
        return stored

    # -- reads --------------------------------------------------------------------------
    @_relearn_node_on_unavailable
    def get_many_into(
        self, keys: Sequence[bytes], outs: Sequence[object] | None, *, session: str | None = None
    ) -> Op[list[Any]]:
        """With ``outs``: bytes written per key (``None`` for a miss).  Without: ``bytes | None`` per key."""
        sid = session_field(session)
        ks = [check_key(k) for k in keys]
        out_views = [as_bytes_view(o, writable=True) for o in outs] if outs is not None else None
        if out_views is not None and len(out_views) != len(ks):
            raise InvalidArgument(f"{len(ks)} keys but {len(out_views)} output buffers")
        yield from self.ensure_hello()
        transport = self.transport
        assert transport is not None
        result: list[Any] = [None] * len(ks)
        pending = list(range(len(ks)))
        limit = None
        for _round in range(6):
            retry: list[int] = []
            for batch in self._batches(len(pending), limit=limit):
                idx = [pending[j] for j in batch]
                bk = [ks[i] for i in idx]
                bo = [out_views[i] for i in idx] if out_views is not None else None
                got = yield from transport.get(bk, bo, sid, verify=self.verify)
                for i, g in zip(idx, got):
                    if g is RETRY:
                        retry.append(i)
                    else:
                        result[i] = g
            if not retry:
                break
            # the node could not fit the whole batch in DRAM at once: retry the rest in smaller batches
            limit = max(1, len(retry) // 2)
            pending = retry
        return result

    # -- small calls --------------------------------------------------------------------
    @_relearn_node_on_unavailable
    def lookup(self, keys: Sequence[bytes], *, session: str | None = None) -> Op[list[str | None]]:
        sid = session_field(session)
        ks = [check_key(k) for k in keys]
        limit = yield from self._limit(len(ks))
        out: list[str | None] = []
        for span in self._spans(len(ks), limit):
            resp = yield Rpc("Lookup", pb.KeysRequest(keys=ks[span], session_id=sid))
            out += [TIER_NAMES.get(t) for t in resp.tiers]
        return out

    @_relearn_node_on_unavailable
    def match_prefix(self, keys: Sequence[bytes], *, session: str | None = None) -> Op[tuple[int, list[str]]]:
        sid = session_field(session)
        ks = [check_key(k) for k in keys]
        limit = yield from self._limit(len(ks))
        matched, tiers = 0, []
        for span in self._spans(len(ks), limit):
            part = ks[span]
            resp = yield Rpc("MatchPrefix", pb.KeysRequest(keys=part, session_id=sid))
            matched += resp.matched
            tiers += [TIER_NAMES.get(t, "?") for t in resp.tiers]
            if resp.matched < len(part):  # a gap: the prefix ends in this batch
                break
        return matched, tiers

    @_relearn_node_on_unavailable
    def close_session(self, session: str) -> Op[int | None]:
        """End ``session`` on this node: how many blocks no open session holds now, or None
        if it had no such session open."""
        sid = session_field(session)
        if not sid:
            raise InvalidArgument("close_session needs a session id")
        resp = yield Rpc("CloseSession", pb.CloseSessionRequest(session_id=sid))
        return resp.blocks if resp.closed else None

    def call(self, method: str, request: Any) -> Op[Any]:
        """One unary call; the response as is."""
        return (yield Rpc(method, request))

    @_relearn_node_on_unavailable
    def simple(self, method: str, request: Any, field: str = "count") -> Op[Any]:
        """One call's ``field``.  A request of keys (``Delete``, ``Pin``, ``Unpin``) over the
        node's ``max_batch`` goes as several, their counts summed."""
        n = len(request.keys) if field == "count" and hasattr(request, "keys") else 0
        limit = yield from self._limit(n)
        if n <= limit:
            resp = yield Rpc(method, request)
            return getattr(resp, field)
        total = 0
        for span in self._spans(n, limit):
            part = type(request)()
            part.CopyFrom(request)
            del part.keys[:]
            part.keys.extend(request.keys[span])
            total += getattr((yield Rpc(method, part)), field)
        return total

    def release_ids(self, ids: Sequence[int]) -> Op[list[bool]]:
        """Release leases (in batches the node accepts); whether each was still valid."""
        limit = yield from self._limit(len(ids))
        valid: list[bool] = []
        for span in self._spans(len(ids), limit):
            valid += (yield Rpc("Release", pb.ReleaseRequest(lease_ids=ids[span]))).valid
        return valid

    def commit_ids(self, ids: Sequence[int], checksums: Sequence[int] | None) -> Op[list[bool]]:
        """Commit reservations (in batches the node accepts); whether each was stored."""
        limit = yield from self._limit(len(ids))
        stored: list[bool] = []
        for span in self._spans(len(ids), limit):
            req = pb.CommitRequest(reservation_ids=ids[span], payload_checksums=checksums[span] if checksums else [])
            stored += [st == pb.KEY_STATUS_OK for st in (yield Rpc("Commit", req)).statuses]
        return stored

    def abort_ids(self, ids: Sequence[int], *, quietly: bool = False) -> Op[None]:
        """Abort reservations (in batches the node accepts); ``quietly``: best effort."""
        limit = yield from self._limit(len(ids))
        for span in self._spans(len(ids), limit):
            req = pb.AbortRequest(reservation_ids=ids[span])
            if quietly:
                yield from best_effort("Abort", req)
            else:
                yield Rpc("Abort", req)

    def stats(self) -> Op[dict[str, Any]]:
        r = yield Rpc("Stats", pb.Empty())
        return {
            "node_id": r.node_id,
            "tiers": {
                TIER_NAMES.get(t.tier, str(t.tier)): {
                    "capacity_bytes": t.capacity_bytes,
                    "used_bytes": t.used_bytes,
                    "blocks": t.blocks,
                }
                for t in r.tiers
            },
            "counters": Counters(r.counters),  # counters["name"]: 0 if not counted yet, KeyError if no such counter
            "reservations": r.reservations,
            "leases": r.leases,
            "pins": r.pins,
            # what share of what the node stored was read back, per namespace and prompt-position
            # bucket (kvstore.vocabulary.position_bucket), for the namespaces the caller may see;
            # a namespace by its fingerprint in hex (stats() is JSON: `kvstore stats` prints it)
            "read_back": [
                {
                    "namespace": bytes(x.namespace).hex(),
                    "bucket": x.bucket,
                    "stored_blocks": x.stored_blocks,
                    "stored_bytes": x.stored_bytes,
                    "read_back_blocks": x.read_back_blocks,
                    "read_back_bytes": x.read_back_bytes,
                }
                for x in r.read_back
            ],
        }

    # -- zero-copy views (client/_zerocopy.py) --------------------------------------------
    def acquire_views(
        self, keys: Sequence[bytes], *, session: str | None = None
    ) -> Op[tuple[list[int], list[Any], list[Any], float]]:
        """Lease keys; return (lease ids, metas or None, arena views or None) per key, and the
        ``time.monotonic()`` before which every lease granted is certainly still held (the
        node starts a lease's TTL after this call began; a margin is kept)."""
        sid = session_field(session)
        yield from self.ensure_hello()
        shm = self.transport
        if not isinstance(shm, SharedMemory) or shm.arena is None:
            raise InvalidArgument("zero-copy views need a unix:// target whose arena this process can map")
        from client._zerocopy import views_of

        ks = [check_key(k) for k in keys]
        limit = yield from self._limit(len(ks))
        ids: list[int] = []
        metas: list[Any] = []
        views: list[Any] = []
        held_until = float("inf")
        try:
            for span in self._spans(len(ks), limit):
                t0 = time.monotonic()
                resp = yield Rpc("Acquire", pb.KeysRequest(keys=ks[span], session_id=sid))
                if resp.ttl_s > 0:
                    held_until = min(held_until, t0 + resp.ttl_s - min(1.0, 0.1 * resp.ttl_s))
                granted = [x.lease_id for x in resp.leases if x.status == pb.KEY_STATUS_OK]
                arena = yield from shm.live_arena(granted, "Release", pb.ReleaseRequest(lease_ids=granted))
                for x in resp.leases:
                    if x.status == pb.KEY_STATUS_OK:
                        meta = meta_from_pb(x.block)
                        ids.append(x.lease_id)
                        metas.append(meta)
                        views.append(views_of(arena, extents_from_pb(x.extents), meta.payload_len, writable=False))
                    else:
                        metas.append(None)
                        views.append(None)
        except BaseException:
            if ids:  # the earlier batches' leases go back
                for span in self._spans(len(ids), limit):
                    yield from best_effort("Release", pb.ReleaseRequest(lease_ids=ids[span]))
            raise
        return ids, metas, views, held_until

    def release_ids_nowait(self, ids: Sequence[int]) -> Op[None]:
        """Release leases without waiting for the answer (the caller knows they were held:
        see ``acquire_views``); a release that is lost only leaves them to expire."""
        limit = yield from self._limit(len(ids))
        for span in self._spans(len(ids), limit):
            yield RpcNoWait("Release", pb.ReleaseRequest(lease_ids=ids[span]))

    def reserve_views(
        self, metas: Sequence[BlockMeta], *, session: str | None = None
    ) -> Op[tuple[list[int], list[Any], list[bool]]]:
        """Reserve space; return (reservation ids of the writable ones, views or None, existed) per meta."""
        sid = session_field(session)
        yield from self.ensure_hello()
        shm = self.transport
        if not isinstance(shm, SharedMemory) or shm.arena is None:
            raise InvalidArgument("zero-copy views need a unix:// target whose arena this process can map")
        from client._zerocopy import views_of

        limit = yield from self._limit(len(metas))
        ids: list[int] = []
        views: list[Any] = []
        existed: list[bool] = []
        try:
            for span in self._spans(len(metas), limit):
                part = list(metas[span])
                resp = yield Rpc("Reserve", pb.ReserveRequest(blocks=[meta_to_pb(m) for m in part], session_id=sid))
                granted = [r.reservation_id for r in resp.reservations if r.status == pb.KEY_STATUS_OK]
                arena = yield from shm.live_arena(granted, "Abort", pb.AbortRequest(reservation_ids=granted))
                for m, r in zip(part, resp.reservations):
                    existed.append(r.status == pb.KEY_STATUS_EXISTS)
                    if r.status == pb.KEY_STATUS_OK:
                        ids.append(r.reservation_id)
                        views.append(views_of(arena, extents_from_pb(r.extents), m.payload_len, writable=True))
                    else:
                        views.append(None)
        except BaseException:
            if ids:  # the earlier batches' reservations go back
                yield from self.abort_ids(ids, quietly=True)
            raise
        return ids, views, existed

    def close(self) -> None:
        self.closed = True
        transport = self.transport or (self.requested if isinstance(self.requested, Transport) else None)
        if transport is not None:
            transport.close()


def as_key_list(keys: object) -> list[bytes]:
    """Accept one key or an iterable of keys."""
    if isinstance(keys, (bytes, bytearray, memoryview)):
        return [bytes(keys)]
    return list(keys)  # type: ignore[call-overload]


Driver = Callable[[Op[T]], T]


def skipped_request(chunks: int, namespace: object) -> pb.ReportHitsRequest:
    """A report of chunks a connector's save policy did not store (no hits, no misses)."""
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks <= 0:
        raise InvalidArgument(f"report a positive number of skipped chunks, got {chunks!r}")
    ns = fingerprint(namespace) if namespace is not None else b""
    return pb.ReportHitsRequest(op="match_prefix", skipped_saves=chunks, namespace=ns)


def report_request(blocks: int, tokens: int, tier: str, op: str, namespace: object) -> pb.ReportHitsRequest:
    if tier not in ("hbm", "remote"):
        raise InvalidArgument(f"report hits served from 'hbm' or 'remote', got {tier!r}")
    if blocks < 0 or tokens < 0:
        raise InvalidArgument("blocks and tokens must be non-negative")
    ns = fingerprint(namespace) if namespace is not None else b""
    return pb.ReportHitsRequest(
        op=op, tier=pb.TIER_HBM, blocks=blocks, tokens=tokens, namespace=ns, remote=tier == "remote"
    )

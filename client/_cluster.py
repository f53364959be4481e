"""Cluster routing for the SDK: ``KVClient("etcd://HOST:PORT[,HOST:PORT]/CLUSTER")``.

The client watches the cluster's membership in etcd (a
:class:`~kvstore.cluster.membership.Membership` thread) and computes each key's owners
itself (:mod:`kvstore.cluster.placement`, the scheme the cluster's ``placement`` setting
names): no metadata hop.  The placement table of a membership is built once, on the view's
thread when the membership changes, and shared by every call (``Routing``).
Per node it uses an ordinary single-node client (``KVClient`` / ``AsyncKVClient``,
unchanged), through the node's Unix socket and shared memory when the node runs on
this machine, over TCP otherwise.

Like the single-node SDK, every operation is written once, as a generator over
instructions (a sans-I/O core), and driven by a sync or an async driver:

* :class:`Fanout` ``(routing, [(node_id, op_factory), ...])`` → run ``op_factory(node_core)`` on
  each node's client in parallel; the results (or the ``KVStoreError`` each raised) come
  back in order;
* :class:`Etcd` ``(fn)`` → run ``fn(ClusterStore)`` on the membership thread's loop.

The drivers (``client/_cluster_clients.py``) ``match`` on these; the per-node operations
they run yield the single-node core's instructions (``client/_instructions.py``).

Routing rules:

* **Writes** go to all R owners of a key in parallel; a put succeeds if one owner stored it.
* **Reads** go to the owners in rank order, one round per rank, each round one batched
  call per node in parallel; the first owner that has the block answers.  After the
  owners, a key may be tried on its *previous* owners (the owners under a membership
  this client saw before the membership or the placement scheme changed, for
  ``handoff_window_s``): on a hit there the block is copied to the current owners (a
  hand-off read).
* **Hot keys** (:mod:`kvstore.cluster.hot`): a key the owners published as read-hot has
  ``k`` extra copies on more nodes (the same ones for every client); reads and lookups
  of it go first to one of its ``R + k`` copies chosen at random (live ones), then to
  the owners in rank order.  A copy missing on the extra chosen is read from an owner
  and written to that extra (with its exact metadata, as a hand-off read): extras fill
  on first read.  A dead extra is skipped like any failed node.
* **Failures**: a node that answers ``Unavailable`` or ``DeadlineExceeded`` (every call
  has a deadline) counts as a miss (in :meth:`ClusterClient.miss_counts`, reasons
  ``node_down`` / ``deadline``: nodes cannot count what never reached them) and is marked *suspect*: calls skip it for
  ``suspect_s`` (doubling while it keeps failing, up to 30 s), so only the first call
  pays the deadline.  Contract errors (``InvalidArgument``, ``Unauthenticated``) raise.
  A node that registers in etcd again (its record comes back after its lease expired, or
  is rewritten under a new lease: a restart, a new address) is cleared at once: the back-off
  is for a node that stays registered but does not answer (hung, or cut off from clients
  only).  A failure of a call made to a node's earlier registration does not suspect the
  new one.  While an owner is suspect, writes to its keys go to the other owners only
  (fewer than R copies; placement does not change): counted in
  :meth:`ClusterClient.under_replicated`.
* **Namespaces**: keys from :meth:`chunk_keys` and the namespace recorded with each block
  use the namespace's *effective* fingerprint at its current epoch
  (:func:`kvstore.cluster.state.effective_fingerprint`); ``invalidate`` bumps the epoch in
  etcd, after which old blocks are never asked for and every node drops them.

Counts returned by ``delete``, ``pin``, ``unpin`` and ``invalidate`` are block *copies*
(a block with R = 2 counts twice).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import random
import socket
import threading
import time
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any, TypeVar

from client._core import (
    STREAM_BATCH_BYTES,
    ClientCore,
    Op,
    Timeouts,
    _relearn_node_on_unavailable,
    as_key_list,
    fingerprint,
)
from client._instructions import GetStream, PutStream
from kvstore.block import BlockMeta, verify_payload
from kvstore.cluster import hot as _hot
from kvstore.cluster.membership import Membership
from kvstore.cluster.placement import Placement, group_keys, placement
from kvstore.cluster.state import ClusterSnapshot, NodeInfo, effective_fingerprint, parse_target
from kvstore.errors import (
    BlockFormatError,
    CapacityExceeded,
    DeadlineExceeded,
    InvalidArgument,
    OwnershipUnavailable,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
)
from kvstore.keys import ChunkKey, Namespace, check_key, chunk_keys
from kvstore.shm import as_bytes_view
from kvstore.vocabulary import DEADLINE, NODE_DOWN, check_session_id
from kvstore.wire import meta_from_pb, meta_to_pb
from protos.kvstore.v1 import kvstore_pb2 as pb

log = logging.getLogger("kvstore.client.cluster")
T = TypeVar("T")
NodeOp = Callable[[ClientCore], Op[Any]]


@dataclasses.dataclass(frozen=True, slots=True)
class Fanout:
    """Run each ``(node id, NodeOp)`` of ``calls`` on its node, routed by ``routing``, in parallel;
    the list of results (a value or the ``KVStoreError`` raised) comes back, in ``calls``' order."""

    routing: Any
    calls: Sequence[tuple[str, NodeOp]]


@dataclasses.dataclass(frozen=True, slots=True)
class Etcd:
    """Run ``fn(store)`` against the cluster's etcd store; its result comes back."""

    fn: Callable[[Any], Any]


ClusterInstruction = Fanout | Etcd
ClusterOp = Generator[ClusterInstruction, Any, T]

CLUSTER_TIMEOUTS = Timeouts(rpc=2.0, data=30.0, connect=1.0)
FATAL = (InvalidArgument, Unauthenticated, PermissionDenied)  # the caller's mistake: raise, whichever node said it
STREAM_CHUNK = 1 << 20


class _Seeded:
    """Duck-types the two fields :func:`kvstore.keys.chunk_keys` reads, with another seed."""

    __slots__ = ("fingerprint", "chunk_tokens")

    def __init__(self, fingerprint: bytes, chunk_tokens: int) -> None:
        self.fingerprint = fingerprint
        self.chunk_tokens = chunk_tokens


@dataclasses.dataclass(frozen=True)
class Routing:
    """Routing for one membership snapshot.  Immutable; shared by threads."""

    snapshot: ClusterSnapshot
    nodes: Mapping[str, NodeInfo]
    ring: Placement
    r: int
    previous: tuple[Placement, ...]  # placements before recent membership changes, newest first
    hot: Mapping[bytes, int] = dataclasses.field(default_factory=dict)  # read-hot key -> extra copies
    _extras: dict[bytes, list[str]] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def extras(self, key: bytes) -> list[str]:
        """The extra copies of a hot key (live members only); [] for other keys."""
        k = self.hot.get(key)
        if not k:
            return []
        got = self._extras.get(key)
        if got is None:
            got = [n for n in _hot.extras(self.ring, key, self.r, k) if n in self.nodes]
            self._extras[key] = got
        return got

    def owners(self, key: bytes) -> list[str]:
        return self.ring.owners(key, self.r)

    def owners_many(self, keys: Sequence[bytes]) -> list[list[str]]:
        many = getattr(self.ring, "owners_many", None)
        if many is not None:
            return many(keys, self.r)
        return [self.ring.owners(k, self.r) for k in keys]

    def handoff(self, key: bytes, owners: Sequence[str]) -> list[str]:
        out: list[str] = []
        for ring in self.previous:
            for n in ring.owners(key, self.r):
                if n not in owners and n not in out and n in self.nodes:
                    out.append(n)
        return out


class _Suspects:
    """Nodes that recently failed, with a doubling back-off.  Thread-safe."""

    def __init__(self, base_s: float, cap_s: float = 30.0) -> None:
        self.base, self.cap = base_s, cap_s
        self._until: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()

    def mark(self, node: str) -> None:
        # a span that ran out stays as ``last``: a node that fails again on its first call is
        # backed off twice as long; a success (``clear``) or a new registration resets it
        with self._lock:
            _, last = self._until.get(node, (0.0, 0.0))
            span = min(self.cap, last * 2) if last else self.base
            self._until[node] = (time.monotonic() + span, span)

    def clear(self, node: str) -> None:
        if node in self._until:
            with self._lock:
                self._until.pop(node, None)

    def __contains__(self, node: object) -> bool:
        entry = self._until.get(node)  # type: ignore[call-overload]
        return entry is not None and entry[0] > time.monotonic()

    def snapshot(self) -> dict[str, float]:
        now = time.monotonic()
        return {n: round(u - now, 3) for n, (u, _) in self._until.items() if u > now}


# -- per-node operations only the cluster needs (built from the core's instructions) ---------------
# Like the core's own operations, these send no request over the node's ``max_batch`` (from
# its ``Hello``): a node refuses such a request whole.


def _fetch_with_meta(keys: list[ChunkKey], verify: bool) -> NodeOp:
    """A batched read that also returns each block's metadata (for a hand-off copy): the
    streaming path, whose chunks carry the header.  Rare, so its speed does not matter."""

    @_relearn_node_on_unavailable
    def op(core: ClientCore) -> Op[list[tuple[BlockMeta, bytes] | None]]:
        limit = yield from core._limit(len(keys))
        out: list[tuple[BlockMeta, bytes] | None] = []
        for span in core._spans(len(keys), limit):
            part = keys[span]
            chunks = yield GetStream(pb.KeysRequest(keys=part))
            out += _read_stream(chunks, len(part), verify)
        return out

    return op


def _read_stream(chunks: Sequence[Any], n: int, verify: bool) -> list[tuple[BlockMeta, bytes] | None]:
    """The (metadata, payload) of each of the ``n`` keys one ``GetStream`` answered, or None."""
    out: list[tuple[BlockMeta, bytes] | None] = [None] * n
    idx, meta, buf = -1, None, bytearray()

    def done() -> None:
        if meta is not None and len(buf) == meta.payload_len:
            try:
                if verify:
                    verify_payload(meta, buf)
                out[idx] = (meta, bytes(buf))
            except BlockFormatError:
                pass

    for c in chunks:
        if c.HasField("block"):
            done()
            idx, meta, buf = idx + 1, None, bytearray()
            if c.status == pb.KEY_STATUS_OK:
                meta = meta_from_pb(c.block)
        if meta is not None and c.data:
            buf += c.data
    done()
    return out


def _put_blocks(metas: list[BlockMeta], payloads: list[bytes]) -> NodeOp:
    """Store blocks with their exact metadata (a hand-off copy keeps namespace, parent, shape).

    One ``PutStream`` per batch the node accepts: at most ``max_batch`` blocks, and (as the
    core's streaming puts) at most ``STREAM_BATCH_BYTES``, since a stream's blocks hold DRAM
    until it ends.  Each stream declares its block count, so the node refuses one over its
    limit before reading it."""

    @_relearn_node_on_unavailable
    def op(core: ClientCore) -> Op[list[bool]]:
        yield from core.ensure_hello()
        stored: list[bool] = []
        for batch in core._batches(len(metas), [m.payload_len for m in metas], budget=STREAM_BATCH_BYTES):

            def chunks(batch: range = batch) -> Any:
                for i in batch:
                    mv = memoryview(payloads[i])
                    for off in range(0, max(len(mv), 1), STREAM_CHUNK):
                        part = bytes(mv[off : off + STREAM_CHUNK])
                        yield (
                            pb.BlockChunk(block=meta_to_pb(metas[i]), data=part)
                            if off == 0
                            else pb.BlockChunk(data=part)
                        )

            resp = yield PutStream(chunks, len(batch))
            stored += [s in (pb.KEY_STATUS_OK, pb.KEY_STATUS_EXISTS) for s in resp.statuses]
        return stored

    return op


class ClusterCore:
    """Routing state shared by :class:`ClusterClient` and :class:`AsyncClusterClient`.

    Owns the membership view and the suspect list; both are thread-safe, so one core
    serves every thread of a sync client.  Session hints (``session=``) go with every
    node call an operation makes: each node keeps the blocks the session used valuable.
    """

    def __init__(
        self,
        target: str,
        *,
        timeouts: Timeouts | None,
        transport: str,
        verify: bool,
        replication: int | None,
        suspect_s: float,
        prefer_local: bool,
        wait_s: float,
    ) -> None:
        self.target = target
        endpoints, self.cluster = parse_target(target)
        if replication is not None and replication < 1:
            raise InvalidArgument(f"replication must be >= 1, got {replication}")
        self.timeouts = timeouts or CLUSTER_TIMEOUTS
        self.transport = transport
        self.verify = verify
        self.replication = replication
        self.prefer_local = prefer_local and transport in ("auto", "shm")
        self.suspects = _Suspects(suspect_s)
        self.hostname = socket.gethostname()
        self._epoch_floor: dict[bytes, int] = {}  # epochs this client bumped, before its view shows them
        self._registered: set[bytes] = set()
        self._registrations: Mapping[str, tuple[int, int]] = {}  # the latest view's, for ``_seen`` and ``failed``
        self._routing: tuple[int, float, Routing] | None = None
        # (when, placement spec before a change): membership (node -> weight) or scheme
        self._history: list[tuple[float, tuple[str, tuple[tuple[str, int], ...]]]] = []
        self._last_spec: tuple[str, tuple[tuple[str, int], ...]] | None = None
        self._hist_lock = threading.Lock()
        self.membership = Membership(endpoints, self.cluster, timeout=min(2.0, self.timeouts.rpc), on_change=self._seen)
        self.membership.start(wait=wait_s)
        self.closed = False
        self.handoffs = 0  # blocks this client copied to a new owner (hand-off reads)
        self.misses: dict[str, int] = {NODE_DOWN: 0, DEADLINE: 0}  # keys missed because an owner failed
        self.short_copies: dict[str, int] = {"suspect": 0, "failed": 0}  # block copies puts did not write
        self._misses_lock = threading.Lock()
        # what the nodes have not been told yet (no node can see it): (op, reason) -> keys, and
        # short copies; the drivers send it with ReportHits after each call (take_report)
        self._unreported: collections.Counter[tuple[str, str]] = collections.Counter()
        self._unreported_short = 0
        self._rng = random.Random()
        self.hot_reads = 0  # reads of hot keys sent to an extra copy first
        self.hot_fills = 0  # extra copies this client wrote (a hot key missing on its extra)

    # -- membership and placement ----------------------------------------------------------
    def _seen(self, snap: ClusterSnapshot) -> None:
        """Clear nodes that registered again from the suspect list, remember the placement before
        each change (for hand-off reads) and build the new one; runs on the view's thread,
        before the view swaps, so no call pays for a placement table."""
        if snap.loaded:
            last, self._registrations = self._registrations, snap.registrations
            for node, reg in snap.registrations.items():
                if last.get(node) != reg:  # a new registration: it was absent, or has a new lease
                    if node in self.suspects:
                        log.info("node %s registered again; routing to it again", node)
                    self.suspects.clear(node)
        if not snap.nodes:
            return
        spec = (snap.config.placement, tuple(sorted(snap.members().items())))
        with self._hist_lock:
            if self._last_spec is not None and spec != self._last_spec:
                self._history.insert(0, (time.monotonic(), self._last_spec))
                del self._history[4:]
            self._last_spec = spec
        try:
            ring = placement(spec[0], dict(spec[1]))
            ring_ranks = getattr(ring, "ranks", None)
            if ring_ranks is not None:
                ring_ranks(self.replication or snap.config.replication)
        except (InvalidArgument, ValueError) as e:  # cannot happen for records that parsed; never kill the view
            log.error("cannot build the placement of cluster %s: %s", self.cluster, e)

    def routing(self) -> Routing:
        snap = self.membership.snapshot()
        now = time.monotonic()
        cached = self._routing
        if cached is not None and cached[0] == id(snap) and now - cached[1] < 1.0:
            return cached[2]
        nodes = self.membership.routing_nodes()
        r = self.replication or snap.config.replication
        window = snap.config.handoff_window_s
        with self._hist_lock:
            history = [spec for t, spec in self._history if now - t < window]
        previous = tuple(
            placement(scheme, dict(members)) for scheme, members in history if any(n in nodes for n, _ in members)
        )
        routing = Routing(
            snap,
            nodes,
            placement(snap.config.placement, {n: i.weight for n, i in nodes.items()}),
            r,
            previous,
            snap.hot if snap.nodes else {},
        )
        self._routing = (id(snap), now, routing)
        return routing

    def node_info(self, routing: Routing, node: str) -> NodeInfo:
        """The record to dial ``node`` by: the newest view's, so that a call routed by an older
        routing (a later round of the same read) reaches a node that registered again at its new
        address, and the drivers never swap a node's connection back to an older registration."""
        return self.membership.routing_nodes().get(node) or routing.nodes[node]

    def node_target(self, info: NodeInfo) -> str:
        if (
            self.prefer_local
            and info.unix
            and info.host == self.hostname
            and os.path.exists(info.unix.removeprefix("unix://"))
        ):
            return info.unix
        return info.grpc

    # -- namespaces and epochs ---------------------------------------------------------------
    def epoch(self, fp: bytes) -> int:
        return max(self.membership.snapshot().epoch(fp), self._epoch_floor.get(fp, 0))

    def effective(self, namespace: object) -> bytes:
        fp = fingerprint(namespace)
        self._register(fp, namespace)
        return effective_fingerprint(fp, self.epoch(fp))

    def _register(self, fp: bytes, namespace: object) -> None:
        """Record a namespace in etcd the first time this client uses it (fire and forget)."""
        if fp in self._registered or fp in self.membership.snapshot().namespaces:
            return
        self._registered.add(fp)
        fields = namespace.to_dict() if isinstance(namespace, Namespace) else None
        try:
            self.membership.submit(lambda store: store.register_namespace(fp, fields))
        except Unavailable:
            self._registered.discard(fp)

    def chunk_keys(self, tokens: Any, namespace: Namespace) -> list[ChunkKey]:
        if not isinstance(namespace, Namespace):
            raise InvalidArgument(f"chunk_keys needs a Namespace, got {type(namespace).__name__}")
        keys = chunk_keys(tokens, _Seeded(self.effective(namespace), namespace.chunk_tokens))  # type: ignore[arg-type]
        group = self.membership.snapshot().config.chunk_group
        return keys if group == 1 else [ChunkKey(k) for k in group_keys(keys, group)]

    # -- outcome of one node call ------------------------------------------------------------
    def failed(self, node: str, result: object, routing: Routing) -> bool:
        """True if ``result`` is an error (the node is then suspect); raises contract errors.

        ``routing`` is the one the call was routed by: if the node has registered again since,
        the failure was its earlier registration's and does not make the new one suspect.
        """
        if not isinstance(result, BaseException):
            self.suspects.clear(node)
            return False
        if isinstance(result, FATAL):
            raise result
        if self._superseded(routing, node):
            log.info(
                "node %s failed (%s) but has registered again since; not routing around it", node, type(result).__name__
            )
        elif not isinstance(result, (CapacityExceeded, OwnershipUnavailable)):  # the node is up; etcd or space is not
            log.info("node %s failed (%s: %s); routing around it", node, type(result).__name__, result)
            self.suspects.mark(node)
        return True

    def _superseded(self, routing: Routing, node: str) -> bool:
        """Whether ``node`` has registered again since ``routing``'s view (and is registered now)."""
        then, now = routing.snapshot.registrations.get(node), self._registrations.get(node)
        return then is not None and now is not None and then != now

    # -- operations ----------------------------------------------------------------------------
    def put_many(
        self,
        keys: Sequence[bytes],
        datas: Sequence[object],
        *,
        namespace: object,
        parents: Sequence[bytes | None] | None,
        token_counts: Sequence[int] | None,
        session: str | None = None,
    ) -> ClusterOp[list[bool]]:
        session = check_session_id(session)
        ks = [check_key(k) for k in keys]
        datas = list(datas)
        if len(ks) != len(datas):
            raise InvalidArgument(f"{len(ks)} keys but {len(datas)} payloads")
        if parents is not None and len(parents) != len(ks):
            raise InvalidArgument(f"{len(ks)} keys but {len(parents)} parents")
        eff = self.effective(namespace) if namespace is not None else None
        routing = self.routing()
        groups: dict[str, list[int]] = {}
        skipped = 0
        for i, own in enumerate(routing.owners_many(ks)):
            for n in own:
                if n not in self.suspects:
                    groups.setdefault(n, []).append(i)
                else:  # no substitute owner: the block has one copy fewer until it is written again
                    skipped += 1
        stored = [False] * len(ks)
        calls = []
        for n, idx in groups.items():

            def op(core: ClientCore, idx: list[int] = idx) -> Op[list[bool]]:
                return core.put_many(
                    [ks[i] for i in idx],
                    [datas[i] for i in idx],
                    namespace=eff,
                    parents=[parents[i] for i in idx] if parents is not None else None,
                    token_counts=[token_counts[i] for i in idx] if token_counts is not None else None,
                    session=session,
                )

            calls.append((n, op))
        results = yield Fanout(routing, calls)
        lost = 0
        for (n, _), res in zip(calls, results):
            if not self.failed(n, res, routing):
                for i, ok in zip(groups[n], res):
                    stored[i] = stored[i] or ok
            else:
                lost += len(groups[n])
        if skipped or lost:
            with self._misses_lock:
                self.short_copies["suspect"] += skipped
                self.short_copies["failed"] += lost
                self._unreported_short += skipped + lost
        return stored

    def _rounds(
        self,
        routing: Routing,
        keys: list[ChunkKey],
        cands: list[list[str]],
        call: Callable[[list[int]], NodeOp],
        *,
        hit: Callable[[Any], bool],
        prefix: bool = False,
        why: list[str | None] | None = None,
    ) -> ClusterOp[tuple[list[Any], list[str | None]]]:
        """Ask each key's candidate nodes in order until one has it: one round per rank,
        one batched call per node per round, the calls of a round in parallel.

        Returns per key the hit result (or None) and the node that answered.  With
        ``prefix``, only keys before the first key known to be missing everywhere are asked.
        ``why`` (if given) gets, per key, ``node_down`` or ``deadline`` when a candidate failed.
        """
        n = len(keys)
        pos = [0] * n
        result: list[Any] = [None] * n
        where: list[str | None] = [None] * n
        todo = set(range(n))
        while todo:
            groups: dict[str, list[int]] = {}
            bound = n
            for i in sorted(todo):
                if i >= bound:
                    break
                while pos[i] < len(cands[i]) and cands[i][pos[i]] in self.suspects:
                    pos[i] += 1
                    if why is not None:
                        why[i] = why[i] or NODE_DOWN
                if pos[i] >= len(cands[i]):
                    todo.discard(i)
                    if prefix:
                        bound = i
                    continue
                groups.setdefault(cands[i][pos[i]], []).append(i)
            if prefix:
                todo = {i for i in todo if i < bound}
                groups = {node: kept for node, idx in groups.items() if (kept := [i for i in idx if i < bound])}
            if not groups:
                break
            calls = [(node, call(idx)) for node, idx in groups.items()]
            results = yield Fanout(routing, calls)
            for (node, _), res in zip(calls, results):
                failed = self.failed(node, res, routing)
                down = (
                    DEADLINE
                    if isinstance(res, DeadlineExceeded)
                    else NODE_DOWN
                    if isinstance(res, Unavailable)
                    else None
                )
                for j, i in enumerate(groups[node]):
                    if not failed and hit(res[j]):
                        result[i], where[i] = res[j], node
                        todo.discard(i)
                    else:
                        pos[i] += 1
                        if why is not None and down is not None:
                            why[i] = why[i] or down
        return result, where

    def _spread(
        self, routing: Routing, keys: Sequence[bytes], owners: list[list[str]]
    ) -> tuple[list[list[str]], dict[int, str]]:
        """Candidates per key with hot keys' reads spread over their copies (see the module doc),
        and the keys whose first candidate is an extra (index -> that node)."""
        if not routing.hot:
            return owners, {}
        cands, first_extra = list(owners), {}
        for i, key in enumerate(keys):
            ext = routing.extras(key)
            if not ext:
                continue
            own = owners[i]
            live = [n for n in (*own, *ext) if n not in self.suspects]
            if not live:
                continue
            pick = live[self._rng.randrange(len(live))]
            cands[i] = [pick, *(n for n in own if n != pick)]
            if pick not in own:
                first_extra[i] = pick
        if first_extra:
            with self._misses_lock:
                self.hot_reads += len(first_extra)
        return cands, first_extra

    def _fill_extras(
        self, routing: Routing, keys: list[ChunkKey], first_extra: dict[int, str], where: list[str | None]
    ) -> ClusterOp[None]:
        """Write to each extra chosen first the hot keys it missed (an owner answered instead)."""
        todo: dict[str, list[tuple[int, str]]] = {}  # answering node -> (key index, extra to fill)
        for i, extra in first_extra.items():
            src = where[i]
            if src is not None and src != extra and extra not in self.suspects:
                todo.setdefault(src, []).append((i, extra))
        if not todo:
            return
        calls = [(src, _fetch_with_meta([keys[i] for i, _ in items], self.verify)) for src, items in todo.items()]
        results = yield Fanout(routing, calls)
        copies: dict[str, list[tuple[BlockMeta, bytes]]] = {}
        for (src, _), res in zip(calls, results):
            if self.failed(src, res, routing):
                continue
            for (_, extra), got in zip(todo[src], res):
                if got is not None:
                    copies.setdefault(extra, []).append(got)
        if not copies:
            return
        puts = [(n, _put_blocks([m for m, _ in items], [p for _, p in items])) for n, items in copies.items()]
        results = yield Fanout(routing, puts)
        for (n, _), res in zip(puts, results):
            if not self.failed(n, res, routing):
                with self._misses_lock:
                    self.hot_fills += sum(bool(x) for x in res)

    def _count_misses(self, result: list[Any], why: list[str | None], op: str) -> None:
        """Count the keys that stayed missing because an owner failed (``miss_counts``)."""
        counts = collections.Counter(w for r, w in zip(result, why) if r is None and w is not None)
        if counts:
            with self._misses_lock:
                for reason, n in counts.items():
                    self.misses[reason] += n
                    self._unreported[op, reason] += n

    def take_report(self) -> tuple[list[pb.ReportHitsRequest], NodeInfo | None]:
        """The ``ReportHits`` requests that tell a node what this client counted and no node could
        see (owners down or past their deadline, under-replicated writes), and a node that answers
        to send them to; what is taken is not reported again (nothing is taken while no node is known)."""
        if not self._unreported and not self._unreported_short:
            return [], None
        routing = self.routing()
        live = sorted(n for n in routing.nodes if n not in self.suspects)
        if not live:
            return [], None
        with self._misses_lock:
            reqs = [
                pb.ReportHitsRequest(op=op, miss_reason=reason, blocks=n)
                for (op, reason), n in self._unreported.items()
            ]
            if self._unreported_short:
                if reqs:
                    reqs[0].short_copies = self._unreported_short
                else:
                    reqs.append(pb.ReportHitsRequest(op="get", short_copies=self._unreported_short))
            self._unreported.clear()
            self._unreported_short = 0
        return reqs, self.node_info(routing, live[0])

    def get_many_into(
        self, keys: Sequence[bytes], outs: Sequence[object] | None, *, session: str | None = None
    ) -> ClusterOp[list[Any]]:
        session = check_session_id(session)
        ks = [check_key(k) for k in keys]
        if outs is not None and len(outs) != len(ks):
            raise InvalidArgument(f"{len(ks)} keys but {len(outs)} output buffers")
        routing = self.routing()
        owners = routing.owners_many(ks)
        cands, first_extra = self._spread(routing, ks, owners)
        # 1) the owners, in rank order (a hot key: one of its copies first)
        why: list[str | None] = [None] * len(ks)
        result, where = yield from self._rounds(
            routing,
            ks,
            cands,
            lambda idx: (
                lambda core: core.get_many_into(
                    [ks[i] for i in idx], [outs[i] for i in idx] if outs is not None else None, session=session
                )
            ),
            hit=lambda v: v is not None,
            why=why,
        )
        if first_extra:
            yield from self._fill_extras(routing, ks, first_extra, where)
        # 2) hand-off: the previous owners of keys every owner missed
        missing = [i for i, v in enumerate(result) if v is None] if routing.previous else []
        cands = [routing.handoff(ks[i], owners[i]) for i in missing]
        if not any(cands):
            self._count_misses(result, why, "get")
            return result
        sub = [ks[i] for i in missing]
        found, _ = yield from self._rounds(
            routing,
            sub,
            cands,
            lambda idx: _fetch_with_meta([sub[j] for j in idx], self.verify),
            hit=lambda v: v is not None,
        )
        copies: dict[str, list[tuple[BlockMeta, bytes]]] = {}
        for j, i in enumerate(missing):
            if found[j] is None:
                continue
            meta, payload = found[j]
            if outs is not None:
                dest = as_bytes_view(outs[i], writable=True)
                if dest.nbytes < meta.payload_len:
                    raise InvalidArgument(
                        f"output buffer holds {dest.nbytes} bytes; block {meta.key.hex()} has {meta.payload_len}"
                    )
                dest[: meta.payload_len] = payload
                result[i] = meta.payload_len
            else:
                result[i] = payload
            for n in owners[i]:
                if n not in self.suspects:
                    copies.setdefault(n, []).append((meta, payload))
        if copies:  # the hand-off proper: the current owners get the block now
            calls = [(n, _put_blocks([m for m, _ in items], [p for _, p in items])) for n, items in copies.items()]
            results = yield Fanout(routing, calls)
            for (n, _), res in zip(calls, results):
                if not self.failed(n, res, routing):
                    self.handoffs += sum(bool(x) for x in res)
        self._count_misses(result, why, "get")
        return result

    def lookup(
        self, keys: Sequence[bytes], *, prefix: bool = False, session: str | None = None
    ) -> ClusterOp[tuple[list[str | None], list[str | None]]]:
        """Tier and node of each key: owners first, then previous owners (a later get hands it off)."""
        session = check_session_id(session)
        ks = [check_key(k) for k in as_key_list(keys)]
        routing = self.routing()
        owners = routing.owners_many(ks)
        cands, _ = self._spread(routing, ks, owners)
        if routing.previous:
            cands = [c + routing.handoff(k, o) for k, o, c in zip(ks, owners, cands)]
        why: list[str | None] = [None] * len(ks)
        tiers, where = yield from self._rounds(
            routing,
            ks,
            cands,
            lambda idx: lambda core: core.lookup([ks[i] for i in idx], session=session),
            hit=lambda t: t is not None,
            prefix=prefix,
            why=why,
        )
        self._count_misses(tiers, why, "match_prefix" if prefix else "exists")
        return tiers, where

    def match_prefix(
        self, keys: Sequence[bytes], *, session: str | None = None
    ) -> ClusterOp[tuple[int, list[str], list[str]]]:
        tiers, where = yield from self.lookup(keys, prefix=True, session=session)
        n = next((i for i, t in enumerate(tiers) if t is None), len(tiers))
        return n, [t for t in tiers[:n] if t is not None], [w for w in where[:n] if w is not None]

    def to_owners(self, keys: Sequence[bytes], method: str, make: Callable[[list[ChunkKey]], Any]) -> ClusterOp[int]:
        """One call per node with the keys it owns (pin, unpin); returns the summed counts."""
        ks = [check_key(k) for k in as_key_list(keys)]
        routing = self.routing()
        groups: dict[str, list[ChunkKey]] = {}
        for k, own in zip(ks, routing.owners_many(ks)):
            for n in own:
                if n not in self.suspects:
                    groups.setdefault(n, []).append(k)
        calls = [(n, lambda core, sub=sub: core.simple(method, make(sub))) for n, sub in groups.items()]
        results = yield Fanout(routing, calls)
        return sum(r for (n, _), r in zip(calls, results) if not self.failed(n, r, routing))

    def to_all(self, method: str, request: Any, field: str = "count") -> ClusterOp[dict[str, Any]]:
        """The same call on every live node (delete, invalidate, stats): node -> result or error."""
        routing = self.routing()
        calls = [(n, lambda core: core.simple(method, request, field)) for n in routing.nodes if n not in self.suspects]
        results = yield Fanout(routing, calls)
        out: dict[str, Any] = {}
        for (n, _), r in zip(calls, results):
            self.failed(n, r, routing)  # raises contract errors, marks failed nodes
            out[n] = r
        return out

    def delete(self, keys: Sequence[bytes]) -> ClusterOp[int]:
        # every live node, not only the owners: a copy left on a former owner must not come back
        res = yield from self.to_all("Delete", pb.KeysRequest(keys=[check_key(k) for k in as_key_list(keys)]))
        return sum(v for v in res.values() if not isinstance(v, BaseException))

    def invalidate(self, namespace: object) -> ClusterOp[int]:
        fp = fingerprint(namespace)
        fields = namespace.to_dict() if isinstance(namespace, Namespace) else None
        rec = yield Etcd(lambda store: store.bump_epoch(fp, fields))
        self._epoch_floor[fp] = max(self._epoch_floor.get(fp, 0), rec.epoch)
        retired = effective_fingerprint(fp, rec.epoch - 1)
        # nodes drop the old epoch's blocks when their watch sees the bump; asking them now
        # as well closes the window for clients that key by the plain fingerprint
        res = yield from self.to_all("Invalidate", pb.InvalidateRequest(namespace=retired))
        return sum(v for v in res.values() if not isinstance(v, BaseException))

    def stats(self) -> ClusterOp[dict[str, Any]]:
        routing = self.routing()
        calls = [(n, lambda core: core.stats()) for n in routing.nodes]
        results = yield Fanout(routing, calls)
        nodes = {}
        for (n, _), r in zip(calls, results):
            nodes[n] = {"error": f"{type(r).__name__}: {r}"} if isinstance(r, BaseException) else r
            if isinstance(r, BaseException) and not isinstance(r, FATAL) and not self._superseded(routing, n):
                self.suspects.mark(n)
        return {
            "target": self.target,
            "cluster": self.cluster,
            "replication": routing.r,
            "membership": routing.snapshot.to_dict(),
            "suspects": self.suspects.snapshot(),
            "under_replicated": self.under_replicated(),
            "hot": {"keys": len(routing.hot), "reads_to_extras": self.hot_reads, "extra_fills": self.hot_fills},
            "nodes": nodes,
        }

    def under_replicated(self) -> dict[str, int]:
        with self._misses_lock:
            return dict(self.short_copies)

    def close(self) -> None:
        self.closed = True
        self.membership.close()

"""``PoolView``: which leading chunks of a prompt the pool holds, where, answered in-process.

A view follows every node of a pool through the node's ``WatchHoldings`` stream
(``kvstore/node/watch.py``, architecture §3a): a snapshot, then deltas with revisions,
as etcd's watch does.  ``match(keys)`` then answers from memory in microseconds, with no
call to any node.  It may be stale by the measured lag (``stats()``); whoever acts on it
confirms at the point of use (an ``Acquire`` that may miss), so a stale answer costs a
recompute or one failed call, never wrong bytes.

Nodes come from an explicit list of targets, or from a cluster's membership in etcd
(``etcd://HOST:PORT/CLUSTER``, the same :class:`~kvstore.cluster.membership.Membership`
the cluster client routes by): a node that leaves the membership, or registers again at
another address, is dropped from the view at once.

Per node, one daemon thread (:class:`_Follower`) holds one stream and writes that node's
:class:`~client._holdings.NodeHoldings`.  It resumes a broken stream from the last
revision it applied; the node answers with the missing deltas, or a snapshot flagged
``resync`` when it no longer has them or restarted (a new incarnation: what the view held
of it goes at the first message).  A node not heard from for ``node_deadline_s`` (its
stream broke and it did not come back, or it went silent: no heartbeat) is dropped from
answers at once by the view's watchdog thread, and followed again from a fresh snapshot
when it answers.

Owner: the :class:`PoolView` owns its followers, its watchdog and (for a cluster) its
membership thread.  The follower set is a tuple swapped whole under ``_lock``, so
``match`` reads it without locks; each node's holdings have their own lock
(``client/_holdings.py``); counters and lag samples are under ``_stats_lock``.  Lock order:
``_lock`` before a holdings lock; ``_stats_lock`` is taken alone.  ``close()`` stops every
thread and channel and waits for them (bounded); it is idempotent.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import socket
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

import grpc
import numpy as np

from client._channel import CHANNEL_OPTIONS, call_metadata, resolve_token
from client._core import Target
from client._holdings import NodeHoldings, best_holders, entries, key_hashes
from client._options import ClientOptions
from kvstore.errors import InvalidArgument
from kvstore.tls import ClientTLS, secure_channel
from kvstore.vocabulary import TierKind
from protos.kvstore.v1 import kvstore_pb2 as pb
from protos.kvstore.v1 import kvstore_pb2_grpc as pb_grpc

__all__ = ["ChunkHolder", "PoolMatch", "PoolView", "PoolViewStats"]

log = logging.getLogger(__name__)

_LAG_SAMPLES = 4096
# connections of their own: a view retrying a node that is down must not put the subchannel
# that the process's other clients of that node share into its reconnect back-off
_OPTIONS = [*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
_BACKOFF_S = (0.05, 1.0)  # first and longest wait before following a node again


@dataclasses.dataclass(frozen=True, slots=True)
class ChunkHolder:
    """Where the pool holds one chunk: the node (its id in a cluster, else the target as
    given) and its fastest tier there."""

    node: str
    tier: TierKind


@dataclasses.dataclass(frozen=True, slots=True)
class PoolMatch:
    """``hits``: how many leading chunks of the queried chain the pool holds; ``holders``:
    one :class:`ChunkHolder` for each of them (the fastest copy; DRAM before NVMe)."""

    hits: int
    holders: tuple[ChunkHolder, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class PoolViewStats:
    """What a view holds and how stale it is.

    ``lag_ms_p50`` / ``lag_ms_p99``: from a change on a node (its clock) to the view
    applying it, over the last 4,096 delta messages (each measured from its oldest change;
    across machines this includes their clock difference); 0 before any delta.
    ``resyncs``: snapshots that replaced what the view held of a node (it fell behind,
    came back too late, or the node restarted); ``restarts``: of those, new incarnations;
    ``nodes_lost``: nodes dropped for silence past the deadline or for leaving the
    membership; ``index_bytes``: memory of the compact indexes; ``refused``: streams a node
    refused for the credentials (a tenant's token: watching needs the admin's)."""

    nodes: int
    nodes_synced: int
    blocks: int
    index_bytes: int
    deltas: int
    resyncs: int
    restarts: int
    nodes_lost: int
    lag_ms_p50: float
    lag_ms_p99: float
    refused: int = 0


class _Gap(Exception):
    """The stream skipped a revision: follow again from the last one applied."""


class _Follower:
    """One node's stream and holdings.  Its thread alone writes ``holdings``,
    ``incarnation`` and ``revision``; ``heard`` (monotonic time of the last message) is read
    by the watchdog."""

    def __init__(self, view: PoolView, node: str, target: str) -> None:
        self.view = view
        self.node = node
        self.target = target
        self.holdings = NodeHoldings()
        self.incarnation = b""
        self.revision = 0
        self.synced = False  # a snapshot of the current incarnation is applied
        self.heard = time.monotonic()
        self.expired = False  # the watchdog dropped its holdings: follow again from scratch
        self._stop = threading.Event()
        self._call: Any = None
        self._channel = secure_channel(Target.parse(target).grpc_target, view._tls, _OPTIONS)
        self._stub = pb_grpc.KVStoreStub(self._channel)
        self._thread = threading.Thread(target=self._run, name=f"kvstore-poolview-{node}", daemon=True)
        self._thread.start()

    # -- the follower thread ----------------------------------------------------------------
    def _run(self) -> None:
        backoff = _BACKOFF_S[0]
        while not self._stop.is_set():
            if self.expired:
                self.holdings.clear()
                self.incarnation, self.revision, self.synced, self.expired = b"", 0, False, False
            try:
                self._follow()
                backoff = _BACKOFF_S[0]  # the node ended the stream (it is stopping): try again soon
            except _Gap:
                log.warning("holdings of node %s skipped a revision; following again from %d", self.node, self.revision)
            except grpc.RpcError as e:
                if self._stop.is_set():
                    return
                code = e.code() if isinstance(e, grpc.Call) else None
                if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                    log.error("node %s refuses to publish its holdings: %s", self.node, e)
                    self.view._count(refused=1)
                    backoff = _BACKOFF_S[1]
                elif code != grpc.StatusCode.CANCELLED:
                    log.debug("holdings stream of node %s broke: %s", self.node, code)
            except Exception:  # a follower must outlive any one bad stream
                if self._stop.is_set():
                    return
                log.exception("following the holdings of node %s failed; following again", self.node)
            self._stop.wait(backoff)
            backoff = min(backoff * 2, _BACKOFF_S[1])

    def _follow(self) -> None:
        request = pb.WatchHoldingsRequest(
            incarnation=self.incarnation, revision=self.revision, heartbeat_ms=int(self.view.heartbeat_s * 1000)
        )
        call = self._stub.WatchHoldings(request, metadata=self.view._metadata)
        self._call = call
        try:
            if self._stop.is_set() or self.expired:
                call.cancel()
            parts: list[Any] = []  # the snapshot so far: index entries of each message
            for update in call:
                if self.expired:
                    call.cancel()
                    return
                self.heard = time.monotonic()
                self._apply(update, parts)
        finally:
            self._call = None
            call.cancel()

    def _apply(self, u: pb.HoldingsUpdate, parts: list[Any]) -> None:
        if u.kind == pb.HOLDINGS_KIND_SNAPSHOT:
            restarted = bool(self.incarnation) and u.incarnation != self.incarnation
            if restarted and not parts:  # another incarnation: nothing of the old one stays
                self.holdings.clear()
                self.synced = False
            parts.append(entries(key_hashes(u.keys), np.frombuffer(u.changes, np.uint8)))
            if not u.last:
                return
            snapshot = np.concatenate(parts)
            parts.clear()
            self.holdings.replace(snapshot)
            self.view._count(resyncs=int(u.resync or restarted), restarts=int(restarted))
            self.incarnation, self.revision, self.synced = u.incarnation, u.revision, True
            self.view._synced()
        elif u.kind == pb.HOLDINGS_KIND_DELTAS:
            if u.incarnation != self.incarnation or u.first_revision != self.revision + 1:
                raise _Gap
            self.holdings.apply(key_hashes(u.keys), np.frombuffer(u.changes, np.uint8))
            self.revision = u.revision
            self.view._lagged((time.time_ns() - u.changed_unix_ns) / 1e6, len(u.changes))

    # -- any thread -------------------------------------------------------------------------
    def expire(self) -> None:
        """Drop what the view holds of this node now, and follow it again from a snapshot.
        (A message the follower was applying at this moment may put entries back until its
        thread sees ``expired``, before its next message; a silent node sends none.)"""
        self.expired = True
        self.holdings.clear()
        self.synced = False
        call = self._call
        if call is not None:
            call.cancel()

    def stop(self) -> None:
        self._stop.set()
        call = self._call
        if call is not None:
            call.cancel()
        self._channel.close()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def alive(self) -> bool:
        return self._thread.is_alive()


class PoolView:
    """Which leading chunks of a key chain the pool holds, and where (module docstring).

    ``PoolView(["unix:///run/kvstore.sock"])`` follows the nodes listed (their names in
    answers are the targets as given); ``PoolView("etcd://HOST:PORT/CLUSTER")`` follows the
    cluster's membership (names are node ids).  ``options``: the token and TLS settings of
    :class:`~client.ClientOptions` (the view needs the admin token where nodes have tenants).
    ``heartbeat_s``: how often an idle node says it is alive; ``node_deadline_s``: how long
    a node may stay unheard before its entries are dropped (at least twice the heartbeat).
    ``prefer_local``: in a cluster, reach nodes of this machine by their Unix socket.
    ``wait_s``: how long a cluster view waits for etcd at start (``Unavailable`` after).
    A context manager; ``close()`` stops it.
    """

    def __init__(
        self,
        nodes: str | Sequence[str],
        options: ClientOptions | None = None,
        *,
        heartbeat_s: float = 1.0,
        node_deadline_s: float = 5.0,
        prefer_local: bool = True,
        wait_s: float = 10.0,
    ) -> None:
        if not 0.01 <= heartbeat_s <= 60:
            raise InvalidArgument(f"heartbeat_s must be within 0.01..60, got {heartbeat_s}")
        if not node_deadline_s >= 2 * heartbeat_s:
            raise InvalidArgument(
                f"node_deadline_s ({node_deadline_s}) must be at least twice heartbeat_s ({heartbeat_s}): "
                "else a node that is merely idle is dropped"
            )
        opts = options or ClientOptions()
        self.heartbeat_s = heartbeat_s
        self.node_deadline_s = node_deadline_s
        self.prefer_local = prefer_local
        self._tls: ClientTLS | None = opts.client_tls()
        token = resolve_token(opts.token, opts.token_file)
        self._metadata = call_metadata(token, opts.agent)
        self._lock = threading.Lock()
        self._followers: tuple[_Follower, ...] = ()
        self._retired: list[_Follower] = []
        self._stats_lock = threading.Lock()
        self._counts: collections.Counter[str] = collections.Counter()
        self._lags: collections.deque[float] = collections.deque(maxlen=_LAG_SAMPLES)
        self._fresh_lags: collections.deque[float] = collections.deque(maxlen=_LAG_SAMPLES)  # for take_lags
        self._synced_cond = threading.Condition()
        self._closed = False
        self._done = threading.Event()
        self._membership: Any = None
        self._hostname = socket.gethostname()
        cluster = isinstance(nodes, str) and nodes.startswith("etcd://")
        if not cluster:
            targets = [nodes] if isinstance(nodes, str) else list(nodes)
            if not targets or len(set(targets)) != len(targets):
                raise InvalidArgument(f"a pool view follows one or more distinct node targets, got {nodes!r}")
            for t in targets:
                Target.parse(t)  # InvalidArgument for a malformed one, before any thread starts
            self._set_nodes({t: t for t in targets})
        self._watchdog = threading.Thread(target=self._watch_deadlines, name="kvstore-poolview-watchdog", daemon=True)
        self._watchdog.start()
        if cluster:
            from kvstore.cluster.membership import Membership
            from kvstore.cluster.state import parse_target

            endpoints, name = parse_target(str(nodes))
            try:
                self._membership = Membership(endpoints, name, timeout=2.0, on_change=self._membership_changed)
                self._membership.start(wait=wait_s)
            except BaseException:
                self.close()
                raise

    # -- nodes ------------------------------------------------------------------------------
    def _membership_changed(self, snap: Any) -> None:
        """On the membership thread: follow the nodes registered now (an empty node list,
        etcd having lost its state, keeps the last one: their streams decide)."""
        if not snap.loaded or not snap.nodes:
            return
        self._set_nodes({node: self._target_of(info) for node, info in snap.nodes.items()})

    def _target_of(self, info: Any) -> str:
        unix = info.unix
        if self.prefer_local and unix and info.host == self._hostname and os.path.exists(unix.removeprefix("unix://")):
            return str(unix)
        return str(info.grpc)

    def _set_nodes(self, targets: dict[str, str]) -> None:
        """Follow exactly ``targets`` (node → target): new nodes get a follower, nodes gone or
        at another target lose theirs, and their entries, at once."""
        with self._lock:
            if self._closed:
                return
            keep: list[_Follower] = []
            for f in self._followers:
                if targets.get(f.node) == f.target:
                    keep.append(f)
                else:
                    f.holdings.clear()
                    f.stop()
                    self._retired.append(f)
                    self._count(nodes_lost=1)
            self._retired = [f for f in self._retired if f.alive()]
            known = {f.node for f in keep}
            keep.extend(_Follower(self, n, t) for n, t in targets.items() if n not in known)
            self._followers = tuple(sorted(keep, key=lambda f: f.node))
        with self._synced_cond:
            self._synced_cond.notify_all()

    def _watch_deadlines(self) -> None:
        period = min(self.heartbeat_s, 0.25)
        while not self._done.wait(period):
            now = time.monotonic()
            for f in self._followers:
                if not f.expired and now - f.heard > self.node_deadline_s and (f.synced or f.holdings.blocks):
                    log.warning("node %s not heard from for %.1f s: dropping its entries", f.node, now - f.heard)
                    f.expire()
                    self._count(nodes_lost=1)

    # -- answers ----------------------------------------------------------------------------
    def match(self, keys: Sequence[bytes], prefer: str | None = None) -> PoolMatch:
        """How many leading chunks of ``keys`` (a chain of 16-byte chunk keys, first chunk
        first) some node holds, and the fastest holder of each (DRAM before NVMe; among
        equally fast copies node ``prefer``'s, e.g. the caller's own node, whose copy needs
        no network).  ``InvalidArgument`` for a key that is not 16 bytes."""
        if not keys:
            return PoolMatch(0, ())
        hashes = key_hashes(list(keys))
        followers = self._followers
        if prefer is not None:  # stable: the preferred node first, the rest in their order
            followers = tuple(sorted(followers, key=lambda f: f.node != prefer))
        hits, who, in_dram = best_holders([f.holdings for f in followers], hashes)
        return PoolMatch(
            hits,
            tuple(ChunkHolder(followers[w].node, TierKind.DRAM if d else TierKind.NVME) for w, d in zip(who, in_dram)),
        )

    def nodes(self) -> list[str]:
        """The nodes followed now."""
        return [f.node for f in self._followers]

    def node_for(self, target: str) -> str | None:
        """The node followed at ``target`` (as the view dials it: in a cluster, a node of this
        machine by its Unix socket), or None: which holders are a caller's own node."""
        for f in self._followers:
            if f.target == target:
                return f.node
        return None

    def wait_synced(self, timeout: float) -> bool:
        """Wait until every node followed has sent its snapshot (True), or ``timeout`` s pass
        (False).  True at once when no node is followed (a cluster with none registered)."""
        deadline = time.monotonic() + timeout
        with self._synced_cond:
            while not all(f.synced for f in self._followers):
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    return False
                self._synced_cond.wait(min(left, 0.1))
            return True

    def stats(self) -> PoolViewStats:
        followers = self._followers
        with self._stats_lock:
            counts = dict(self._counts)
            lags = np.fromiter(self._lags, np.float64, len(self._lags))
        p50, p99 = (float(x) for x in np.percentile(lags, [50, 99])) if len(lags) else (0.0, 0.0)
        return PoolViewStats(
            nodes=len(followers),
            nodes_synced=sum(f.synced for f in followers),
            blocks=sum(f.holdings.blocks for f in followers),
            index_bytes=sum(f.holdings.nbytes() for f in followers),
            deltas=counts.get("deltas", 0),
            resyncs=counts.get("resyncs", 0),
            restarts=counts.get("restarts", 0),
            nodes_lost=counts.get("nodes_lost", 0),
            lag_ms_p50=p50,
            lag_ms_p99=p99,
            refused=counts.get("refused", 0),
        )

    def take_lags(self) -> list[float]:
        """The lag samples (ms, as in :meth:`stats`) measured since the last call, at most
        the newest 4,096: for a caller that exports them (a histogram) rather than quantiles."""
        with self._stats_lock:
            out = list(self._fresh_lags)
            self._fresh_lags.clear()
        return out

    # -- from followers ---------------------------------------------------------------------
    def _count(self, **n: int) -> None:
        with self._stats_lock:
            self._counts.update(n)

    def _lagged(self, ms: float, deltas: int) -> None:
        with self._stats_lock:
            self._lags.append(max(ms, 0.0))
            self._fresh_lags.append(max(ms, 0.0))
            self._counts["deltas"] += deltas

    def _synced(self) -> None:
        with self._synced_cond:
            self._synced_cond.notify_all()

    # -- lifecycle --------------------------------------------------------------------------
    def close(self, timeout: float = 5.0) -> None:
        """Stop following: the membership thread, the watchdog, every stream and channel."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            followers, self._followers = [*self._followers, *self._retired], ()
            self._retired = []
        self._done.set()
        if self._membership is not None:
            self._membership.close()
        for f in followers:
            f.stop()
        _join_all(followers, timeout)
        self._watchdog.join(timeout)
        with self._synced_cond:
            self._synced_cond.notify_all()

    def __enter__(self) -> PoolView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _join_all(followers: Iterable[_Follower], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for f in followers:
        f.join(max(0.0, deadline - time.monotonic()))

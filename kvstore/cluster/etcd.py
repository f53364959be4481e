"""All etcd access: the only module that imports the etcd client (``aetcd``).

Its users, each with its own :class:`EtcdSession` (one gRPC channel, rotating over
the configured endpoints after a failure):

* :class:`Registration` (a node): puts ``nodes/<id>`` under a lease and keeps the lease
  alive; if etcd is unreachable the node serves on, and when etcd answers again the
  record is checked and, if the lease or the key is gone, registered anew.
  :class:`EngineRegistration` does the same for a vLLM engine's ``engines/<id>``; both
  are a :class:`LeasedRecord`.
* :class:`ClusterWatcher` (nodes and clients): loads everything under the cluster
  prefix, then follows a watch from the next revision, publishing an immutable
  :class:`~kvstore.cluster.state.ClusterSnapshot` after each change.  A ping beside the
  watch notices a dead or hung etcd; the last snapshot stays published (marked
  ``connected=False``) until a full reload succeeds.
* :class:`ClusterStore` (CLI and SDK): configuration, namespace epochs and owners.
* :class:`OwnerRegistry` (a node with tenants): claims namespaces for tenants with a
  create-if-absent transaction on ``owners/<fingerprint hex>``; the node's
  :class:`ClusterWatcher` follows that prefix into its ownership cache (``on_owners``).

Everything here runs on the caller's asyncio loop and owns no thread.  etcd failures
surface as :class:`kvstore.errors.Unavailable`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

import aetcd
import aetcd.exceptions

from kvstore.aio import bounded, cancel_and_wait
from kvstore.cluster import hot as _hot
from kvstore.cluster import state
from kvstore.cluster.state import (
    ClusterConfig,
    ClusterSnapshot,
    EngineRecord,
    NamespaceRecord,
    NodeInfo,
    OwnerRecord,
)
from kvstore.errors import InvalidArgument, Unavailable

log = logging.getLogger("kvstore.cluster.etcd")
T = TypeVar("T")
R = TypeVar("R", NodeInfo, EngineRecord)  # a record kept alive under a lease (LeasedRecord)

# reconnect quickly when etcd comes back; notice a silent peer through keepalive pings
# (etcd allows pings on open streams every 5 s or more)
CHANNEL_OPTIONS = {
    "grpc.initial_reconnect_backoff_ms": 200,
    "grpc.min_reconnect_backoff_ms": 200,
    "grpc.max_reconnect_backoff_ms": 1000,
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 5_000,
}
ETCD_ERRORS = (aetcd.exceptions.ClientError, asyncio.TimeoutError, OSError)
UNKNOWN_OWNER = ""
"""The owner of a namespace whose etcd record cannot be read: never a tenant's name."""


class EtcdSession:
    """One etcd client at a time, moving to the next endpoint after a failure."""

    def __init__(self, endpoints: str, *, timeout: float = 2.0) -> None:
        self.spec = endpoints
        self.endpoints = state.parse_endpoints(endpoints)
        self.timeout = timeout
        self._i = 0
        self._client: aetcd.Client | None = None

    async def client(self) -> aetcd.Client:
        if self._client is None:
            host, port = self.endpoints[self._i % len(self.endpoints)]
            c = aetcd.Client(
                host=host, port=port, timeout=max(1, math.ceil(self.timeout)), options=dict(CHANNEL_OPTIONS)
            )
            await c.connect()  # builds the channel; nothing is sent yet
            self._client = c
        return self._client

    async def reset(self) -> None:
        """Drop the current client (its channel and watches) and move to the next endpoint."""
        c, self._client = self._client, None
        self._i += 1
        if c is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(c.close(), 2.0)

    async def run(self, fn: Callable[[aetcd.Client], Awaitable[T]], what: str = "etcd call") -> T:
        """``fn(client)`` on the current endpoint, trying each endpoint once on failure."""
        last: BaseException | None = None
        for _ in range(len(self.endpoints)):
            c = await self.client()
            try:
                return await bounded(fn(c), self.timeout)
            except ETCD_ERRORS as e:
                last = e
                await self.reset()
        raise Unavailable(f"{what}: etcd at {self.spec} is unreachable ({type(last).__name__}: {last})")

    async def close(self) -> None:
        c, self._client = self._client, None
        if c is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(c.close(), 2.0)


def healthy(host: str, port: int, timeout: float = 0.5) -> bool:
    """etcd's HTTP ``/health`` on its client port: True once the member has a leader."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.sendall(f"GET /health HTTP/1.0\r\nHost: {host}\r\n\r\n".encode())
            s.settimeout(timeout)
            data = b""
            while chunk := s.recv(4096):
                data += chunk
        return b'"health":"true"' in data
    except OSError:
        return False


# -- reading the whole cluster --------------------------------------------------------------
class _Builder:
    """Mutable state a watcher applies events to; ``freeze`` makes a snapshot."""

    def __init__(self, cluster: str) -> None:
        self.cluster = cluster
        self.prefix = state.prefix(cluster).encode()
        self.nodes: dict[str, NodeInfo] = {}
        self.config_raw: dict[str, bytes] = {}
        self.namespaces: dict[bytes, NamespaceRecord] = {}
        self.registrations: dict[str, tuple[int, int]] = {}
        self.engines: dict[str, EngineRecord] = {}
        self.owners: dict[bytes, OwnerRecord] = {}  # filled by a full load only (see apply)
        self.hot = _hot.HotTable()
        self.revision = 0
        self.etcd_cluster_id = 0  # etcd's own cluster id: a new etcd (data lost) has a new one

    def apply(
        self, key: bytes, value: bytes | None, revision: int, lease: int = 0
    ) -> tuple[bytes, OwnerRecord | None] | None:
        """``value`` None: the key was deleted.  ``revision`` is the key's mod revision.

        Namespace owners are not part of the snapshot (a cluster may hold many of them and
        only nodes with tenants follow them): an ``owners/`` key is returned as
        ``(fingerprint, record or None)`` for the caller to pass on; other keys return None."""
        self.revision = max(self.revision, revision)
        rel = key[len(self.prefix) :].decode(errors="replace")
        kind, _, name = rel.partition("/")
        try:
            if kind == "nodes" and name:
                if value is None:
                    self.nodes.pop(name, None)
                    self.registrations.pop(name, None)
                else:
                    info = NodeInfo.from_json(value)
                    if info.node_id != name:  # two records would claim one id: neither key nor record wins
                        raise ValueError(f"record of node {name!r} names node {info.node_id!r}")
                    self.nodes[name] = info
                    self.registrations[name] = (revision, lease)
            elif kind == "engines" and name:
                if value is None:
                    self.engines.pop(name, None)
                else:
                    engine = EngineRecord.from_json(value)
                    if engine.engine_id != name:  # a second claim to an id: ignored, like a node's
                        raise ValueError(f"record of engine {name!r} names engine {engine.engine_id!r}")
                    self.engines[name] = engine
            elif kind == "hot" and name:
                self.hot.set(name, None)  # a record that does not parse counts as none
                if value is not None:
                    self.hot.set(name, _hot.from_json(value))
            elif kind == "config" and name:
                if value is None:
                    self.config_raw.pop(name, None)
                else:
                    self.config_raw[name] = value
            elif kind == "namespaces" and name:
                fp = bytes.fromhex(name)
                if value is None:
                    self.namespaces.pop(fp, None)
                else:
                    self.namespaces[fp] = NamespaceRecord.from_json(fp, value)
            elif kind == "owners" and name:
                fp = bytes.fromhex(name)
                if len(fp) != 8:
                    raise ValueError("not an 8-byte fingerprint")
                if value is None:
                    return fp, None
                try:
                    return fp, OwnerRecord.from_json(fp, value, revision)
                except (ValueError, TypeError) as e:  # fail closed: owned, by nobody a tenant can be
                    log.warning(
                        "malformed owner record %s (%s): no tenant may use the namespace until an operator "
                        "releases it (kvstore cluster release)",
                        key.decode(errors="replace"),
                        e,
                    )
                    return fp, OwnerRecord(fp, UNKNOWN_OWNER, revision=revision)
        except (ValueError, TypeError, KeyError) as e:
            log.warning("ignoring malformed etcd record %s: %s", key.decode(errors="replace"), e)
        return None

    def freeze(self, *, connected: bool) -> ClusterSnapshot:
        return ClusterSnapshot(
            cluster=self.cluster,
            revision=self.revision,
            nodes=dict(self.nodes),
            config=ClusterConfig.from_raw(self.config_raw),
            namespaces=dict(self.namespaces),
            registrations=dict(self.registrations),
            connected=connected,
            loaded=True,
            hot=dict(self.hot.merged),
            engines=dict(self.engines),
        )


async def _load(session: EtcdSession, cluster: str) -> tuple[_Builder, int]:
    b = _Builder(cluster)
    resp = await session.run(lambda c: c.get_prefix(b.prefix), "loading the cluster state")
    for kv in resp:
        owner = b.apply(kv.key, kv.value, kv.mod_revision, kv.lease)
        if owner is not None and owner[1] is not None:
            b.owners[owner[0]] = owner[1]
    b.revision = resp.header.revision
    b.etcd_cluster_id = resp.header.cluster_id
    return b, resp.header.revision


@dataclasses.dataclass(frozen=True, slots=True)
class OwnersUpdate:
    """Namespace owners seen by a watcher: every record after a (re)load (``full``), else
    the records one watch event changed (None: deleted, i.e. released)."""

    records: dict[bytes, OwnerRecord | None]
    full: bool
    revision: int  # full: the load's etcd revision; else the event's
    etcd_cluster_id: int = 0  # full loads only


class ClusterWatcher:
    """Publishes a :class:`ClusterSnapshot` to ``on_snapshot`` after every change, and (with
    ``on_owners``) namespace owners as :class:`OwnersUpdate` values.

    ``run()`` never returns until cancelled; etcd outages are retried with backoff.  A
    reload after an outage passes every owner again (``full``): releases made meanwhile
    are the records missing from it.
    """

    def __init__(
        self,
        endpoints: str,
        cluster: str,
        on_snapshot: Callable[[ClusterSnapshot], None],
        *,
        timeout: float = 2.0,
        ping_s: float = 5.0,
        on_owners: Callable[[OwnersUpdate], None] | None = None,
        batch_s: float = 0.005,
    ) -> None:
        self.cluster = state.check_cluster_name(cluster)
        self.batch_s = batch_s
        self.session = EtcdSession(endpoints, timeout=timeout)
        self.on_snapshot = on_snapshot
        self.on_owners = on_owners
        self.ping_s = ping_s
        self.last: ClusterSnapshot = ClusterSnapshot(cluster)
        self.loads = 0  # full reads of the cluster prefix (start-up, and after each lost watch)
        self.events = 0  # watch events applied
        self.publishes = 0  # snapshots published from the watch (one per batch of events)

    def _owners(self, update: OwnersUpdate) -> None:
        if self.on_owners is None:
            return
        try:
            self.on_owners(update)
        except Exception:
            log.exception("namespace owners callback failed")

    def _publish(self, snap: ClusterSnapshot) -> None:
        self.last = snap
        try:
            self.on_snapshot(snap)
        except Exception:
            log.exception("membership callback failed")

    async def run(self) -> None:
        backoff = 0.1
        while True:
            try:
                b, rev = await _load(self.session, self.cluster)
                self.loads += 1
                self._owners(OwnersUpdate(dict(b.owners), True, rev, b.etcd_cluster_id))
                b.owners.clear()  # the callback keeps its own table; events carry changes from here
                self._publish(b.freeze(connected=True))
                backoff = 0.1
                await self._follow(b, rev)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # etcd down, hung, compacted, or a bug: reload from scratch
                if self.last.connected:
                    log.warning(
                        "etcd watch of cluster %s lost (%s: %s); keeping the last membership (%d nodes)",
                        self.cluster,
                        type(e).__name__,
                        e,
                        len(self.last.nodes),
                    )
                    self._publish(dataclasses.replace(self.last, connected=False))
                await self.session.reset()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)

    async def _follow(self, b: _Builder, rev: int) -> None:
        client = await self.session.client()
        watch = await bounded(client.watch_prefix(b.prefix, start_revision=rev + 1), self.session.timeout)

        loop = asyncio.get_running_loop()
        pending: list[asyncio.Handle] = []

        def publish() -> None:
            pending.clear()
            self.publishes += 1
            self._publish(b.freeze(connected=True))

        async def consume() -> None:
            # Events are applied one by one to the builder (O(1) each: nothing re-reads etcd);
            # the snapshot is published once per batch: the events that arrive within
            # ``batch_s`` of the first (a burst of joins or leaves, and everything that queued
            # while a subscriber was busy building a placement table) give one snapshot.
            async for ev in watch:
                self.events += 1
                owner = b.apply(ev.kv.key, ev.kv.value if ev.kind == "PUT" else None, ev.kv.mod_revision, ev.kv.lease)
                if owner is None:
                    if not pending:
                        pending.append(loop.call_later(self.batch_s, publish))
                else:  # not in the snapshot: no new snapshot either
                    self._owners(OwnersUpdate({owner[0]: owner[1]}, False, ev.kv.mod_revision))
            raise Unavailable("the etcd watch ended")

        async def ping() -> None:
            while True:
                await asyncio.sleep(self.ping_s)
                try:
                    await bounded(client.get(b.prefix + b"nodes/"), self.session.timeout)
                except ETCD_ERRORS as e:
                    raise Unavailable(f"etcd did not answer a ping: {type(e).__name__}: {e}") from None

        tasks = [asyncio.ensure_future(consume()), asyncio.ensure_future(ping())]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                t.result()  # raises what ended it
        finally:
            for h in pending:
                h.cancel()
            for t in tasks:
                t.cancel()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(watch.cancel(), 1.0)
            await cancel_and_wait(tasks, timeout=1.0)

    async def close(self) -> None:
        await self.session.close()


# -- registration: a record kept alive under a lease -------------------------------------------
class LeasedRecord(Generic[R]):
    """Keeps one record (``key`` = ``record.to_json()``) alive under a lease for as long as its
    owner runs: :meth:`run` refreshes the lease every ttl/3 and registers anew when the lease
    expired or the record vanished or changed hands; if etcd is unreachable the owner serves
    on (one warning) and registers when etcd answers.  :meth:`deregister` revokes the lease,
    which deletes the record.  Subclasses say what the record is (``kind``, for the logs) and
    whom an existing record under the key may belong to (:meth:`_conflict`)."""

    kind = "record"

    def __init__(
        self,
        endpoints: str,
        cluster: str,
        key: bytes,
        name: str,
        record: R,
        *,
        ttl_s: float = 10.0,
        timeout: float = 2.0,
    ) -> None:
        self.cluster = state.check_cluster_name(cluster)
        self.record: R = record
        self.name = name
        self.key = key
        self.ttl = max(1, math.ceil(ttl_s))
        self.session = EtcdSession(endpoints, timeout=min(timeout, max(0.5, self.ttl / 3)))
        self.lease_id: int | None = None
        self.registered = asyncio.Event()
        self.registrations = 0  # how many times a record was written (1 + re-registrations)
        self._reachable = True

    def _conflict(self, existing: bytes, record: R) -> str | None:
        """Why ``existing`` (the value under our key) must not be replaced by ``record`` (None: it may)."""
        return None

    async def register(self) -> None:
        """Grant a lease and put our record on it (refusing to clobber another live owner of the key)."""
        record = dataclasses.replace(self.record, started_at=self.record.started_at or time.time())

        async def put(c: aetcd.Client) -> int:
            existing = await c.get(self.key)
            if existing is not None:
                why = self._conflict(existing.value, record)
                if why is not None:
                    raise InvalidArgument(why)
            lease = await c.lease(self.ttl)
            await c.put(self.key, record.to_json(), lease=lease.id)
            return int(lease.id)

        self.lease_id = await self.session.run(put, f"registering {self.kind} {self.name}")
        self.record = record
        self.registrations += 1
        self.registered.set()
        log.info(
            "registered %s %s in cluster %s (lease %x, ttl %d s)",
            self.kind,
            self.name,
            self.cluster,
            self.lease_id,
            self.ttl,
        )

    async def run(self) -> None:
        """Keep-alive loop: refresh every ttl/3; re-register when the lease or record is gone."""
        interval = max(0.2, self.ttl / 3)
        while True:
            try:
                if self.lease_id is None:
                    await self.register()
                else:
                    await self._refresh()
                if not self._reachable:
                    log.info("etcd reachable again; %s %s is registered", self.kind, self.name)
                self._reachable = True
                await asyncio.sleep(interval)
            except asyncio.CancelledError:
                raise
            except InvalidArgument as e:
                log.error("%s", e)
                await asyncio.sleep(interval * 3)
            except Exception as e:  # etcd unreachable: keep serving, retry soon
                if self._reachable:
                    log.warning(
                        "etcd unreachable (%s); %s %s keeps serving and will re-register", e, self.kind, self.name
                    )
                self._reachable = False
                await asyncio.sleep(min(interval, 0.5))

    async def _refresh(self) -> None:
        lease_id = self.lease_id

        async def keepalive(c: aetcd.Client) -> tuple[int, Any]:
            reply = await c.refresh_lease(lease_id)
            rec = await c.get(self.key)
            return (reply.TTL if reply is not None else -1), rec

        ttl, rec = await self.session.run(keepalive, "lease keep-alive")
        if ttl <= 0:
            log.warning(
                "lease of %s %s expired (etcd lost it or we were away too long); registering again",
                self.kind,
                self.name,
            )
            self.lease_id = None
            await self.register()
        elif rec is None or rec.lease != lease_id:
            log.warning("record of %s %s vanished or changed hands; registering again", self.kind, self.name)
            await self._revoke_quietly(lease_id)
            self.lease_id = None
            await self.register()

    async def _revoke_quietly(self, lease_id: int | None) -> None:
        if lease_id is None:
            return
        with contextlib.suppress(Exception):
            await self.session.run(lambda c: c.revoke_lease(lease_id), "revoking a lease")

    async def deregister(self, timeout: float = 2.0) -> bool:
        """Revoke the lease (which deletes the record).  False if etcd did not answer in time."""
        lease_id, self.lease_id = self.lease_id, None
        if lease_id is None:
            return False
        try:
            await bounded(self.session.run(lambda c: c.revoke_lease(lease_id), "deregistering"), timeout)
            return True
        except (TimeoutError, Unavailable):
            return False

    async def close(self) -> None:
        await self.session.close()


class Registration(LeasedRecord[NodeInfo]):
    """Keeps ``nodes/<id>`` alive under a lease for as long as the node runs."""

    kind = "node"

    def __init__(
        self, endpoints: str, cluster: str, info: NodeInfo, *, ttl_s: float = 10.0, timeout: float = 2.0
    ) -> None:
        super().__init__(
            endpoints, cluster, state.node_key(cluster, info.node_id), info.node_id, info, ttl_s=ttl_s, timeout=timeout
        )

    @property
    def info(self) -> NodeInfo:
        return self.record

    def _conflict(self, existing: bytes, record: NodeInfo) -> str | None:
        try:
            other = NodeInfo.from_json(existing)
        except ValueError:
            return None
        if (other.host, other.data_dir) == (record.host, record.data_dir):
            return None  # this node, an earlier incarnation
        return (
            f"node id {record.node_id!r} is already registered in cluster {self.cluster!r} by "
            f"{other.host}:{other.data_dir} (pid {other.pid}); give this node a unique --node-id"
        )


class EngineRegistration(LeasedRecord[EngineRecord]):
    """Keeps ``engines/<engine_id>`` alive under a lease for as long as the engine runs (the
    vLLM connector's scheduler half, through :class:`kvstore.cluster.engines.EngineRegistrar`)."""

    kind = "engine"

    def __init__(
        self, endpoints: str, cluster: str, record: EngineRecord, *, ttl_s: float = 10.0, timeout: float = 2.0
    ) -> None:
        super().__init__(
            endpoints,
            cluster,
            state.engine_key(cluster, record.engine_id),
            record.engine_id,
            record,
            ttl_s=ttl_s,
            timeout=timeout,
        )

    def _conflict(self, existing: bytes, record: EngineRecord) -> str | None:
        try:
            other = EngineRecord.from_json(existing)
        except ValueError:
            return None
        if other.url == record.url:
            return None  # the engine behind this URL, an earlier incarnation: replaced
        return (
            f"engine id {record.engine_id!r} is already registered in cluster {self.cluster!r} by the engine at "
            f"{other.url} ({other.host}, pid {other.pid}); give this engine a unique "
            "kv_connector_extra_config.engine_id"
        )


# -- configuration and namespaces -----------------------------------------------------------------
class ClusterStore:
    """Cluster-wide settings and namespace epochs (short-lived use: CLI and SDK calls)."""

    def __init__(self, endpoints: str, cluster: str, *, timeout: float = 3.0) -> None:
        self.cluster = state.check_cluster_name(cluster)
        self.session = EtcdSession(endpoints, timeout=timeout)

    async def snapshot(self) -> ClusterSnapshot:
        b, _ = await _load(self.session, self.cluster)
        return b.freeze(connected=True)

    async def set_config(self, name: str, value: object) -> Any:
        v = state.parse_setting(name, value if not isinstance(value, str) else value.strip())
        raw = json.dumps(v).encode()
        await self.session.run(lambda c: c.put(state.config_key(self.cluster, name), raw), f"setting {name}")
        return v

    async def unset_config(self, name: str) -> None:
        if name not in state.CONFIG:
            raise InvalidArgument(f"unknown cluster setting {name!r}; known: {', '.join(sorted(state.CONFIG))}")
        await self.session.run(lambda c: c.delete(state.config_key(self.cluster, name)), f"unsetting {name}")

    async def register_namespace(self, fingerprint: bytes, namespace: dict[str, Any] | None = None) -> NamespaceRecord:
        """Record a namespace at epoch 0 if it is not known yet; return its record."""
        key = state.namespace_key(self.cluster, fingerprint)
        rec = NamespaceRecord(bytes(fingerprint), 0, namespace, time.time())

        async def create(c: aetcd.Client) -> NamespaceRecord:
            tx = c.transactions
            ok, _ = await c.transaction(
                compare=[tx.version(key) == 0], success=[tx.put(key, rec.to_json())], failure=[]
            )
            if ok:
                return rec
            got = await c.get(key)
            return NamespaceRecord.from_json(bytes(fingerprint), got.value) if got is not None else rec

        return await self.session.run(create, "registering a namespace")

    async def bump_epoch(self, fingerprint: bytes, namespace: dict[str, Any] | None = None) -> NamespaceRecord:
        """Increment a namespace's epoch atomically (compare-and-swap on the record's revision)."""
        key = state.namespace_key(self.cluster, fingerprint)
        fp = bytes(fingerprint)

        async def bump(c: aetcd.Client) -> NamespaceRecord | None:
            tx = c.transactions
            got = await c.get(key)
            if got is None:
                new = NamespaceRecord(fp, 1, namespace, time.time())
                cmp = [tx.version(key) == 0]
            else:
                old = NamespaceRecord.from_json(fp, got.value)
                new = NamespaceRecord(fp, old.epoch + 1, namespace or old.namespace, time.time())
                cmp = [tx.mod(key) == got.mod_revision]
            ok, _ = await c.transaction(compare=cmp, success=[tx.put(key, new.to_json())], failure=[])
            return new if ok else None

        for _ in range(20):  # lost a race with another bump: read again
            rec = await self.session.run(bump, "bumping a namespace epoch")
            if rec is not None:
                return rec
        raise Unavailable("could not bump the namespace epoch: too much contention")

    async def owners(self) -> tuple[dict[bytes, OwnerRecord], int]:
        """Every namespace owner (``kvstore cluster owners``) and the revision read at."""
        return await list_owners(self.session, self.cluster)

    async def release_owner(self, fingerprint: bytes, *, to: str | None = None) -> OwnerRecord | None:
        """Delete a namespace's owner record (``to``: hand it to that tenant instead); the
        previous record, None if the namespace had no owner.  Every node with tenants drops
        the namespace's blocks as it sees the change: blocks never pass from one tenant to
        another."""
        key = state.owner_key(self.cluster, fingerprint)
        fp = bytes(fingerprint)

        async def change(c: aetcd.Client) -> OwnerRecord | None:
            tx = c.transactions
            ops = [tx.put(key, OwnerRecord(fp, to, "", time.time()).to_json())] if to is not None else [tx.delete(key)]
            _, responses = await c.transaction(compare=[], success=[tx.get(key), *ops], failure=[])
            return _owner_from_range(fp, responses[0])

        return await self.session.run(change, "releasing a namespace owner")

    async def close(self) -> None:
        await self.session.close()


# -- namespace owners (tenants) -----------------------------------------------------------------
def _owner_from_range(fp: bytes, rng: list[Any]) -> OwnerRecord | None:
    """The record in a transaction's range response (a list of ``(value, meta)``), if any."""
    if not rng:
        return None
    value, meta = rng[0]
    try:
        return OwnerRecord.from_json(fp, value, meta.mod_revision)
    except (ValueError, TypeError):
        return OwnerRecord(fp, UNKNOWN_OWNER, revision=meta.mod_revision)  # unreadable: nobody's (fail closed)


async def _claim(
    c: aetcd.Client, cluster: str, namespaces: list[bytes], tenant: str, node: str
) -> dict[bytes, OwnerRecord]:
    """One transaction: every namespace of the batch is created for ``tenant`` if none of them
    has an owner yet; otherwise nothing is written and the existing records are read back.
    All or nothing, so a batch that touches another tenant's namespace claims nothing."""
    tx = c.transactions
    keys = [state.owner_key(cluster, ns) for ns in namespaces]
    now = time.time()
    records = [OwnerRecord(ns, tenant, node, now) for ns in namespaces]
    ok, responses = await c.transaction(
        compare=[tx.version(k) == 0 for k in keys],
        success=[tx.put(k, r.to_json()) for k, r in zip(keys, records)],
        failure=[tx.get(k) for k in keys],
    )
    if ok:
        revision = responses[0].response_put.header.revision if responses else 0
        return {r.fingerprint: dataclasses.replace(r, revision=revision) for r in records}
    return {ns: rec for ns, rng in zip(namespaces, responses) if (rec := _owner_from_range(ns, rng)) is not None}


async def claim_owners(
    session: EtcdSession, cluster: str, namespaces: list[bytes], tenant: str, node: str = ""
) -> dict[bytes, OwnerRecord]:
    """Claim ``namespaces`` for ``tenant`` (create-if-absent): the owner etcd holds for each.

    Whoever etcd applied first wins, across every node.  Namespaces already owned by
    ``tenant`` (another node claimed them for it meanwhile) are fine: the rest are claimed
    again.  If another tenant owns one of them, the answer holds the owners found and the
    rest of the batch stays unclaimed (the caller refuses the write)."""
    todo = list(dict.fromkeys(bytes(ns) for ns in namespaces))
    out: dict[bytes, OwnerRecord] = {}
    for _ in range(16):
        if not todo:
            return out

        async def attempt(c: aetcd.Client, batch: list[bytes] = todo) -> dict[bytes, OwnerRecord]:
            return await _claim(c, cluster, batch, tenant, node)

        got = await session.run(attempt, "claiming a namespace")
        out.update(got)
        if any(r.tenant != tenant for r in got.values()):
            return out
        todo = [ns for ns in todo if ns not in got]  # owned by this tenant already, or deleted meanwhile: again
    raise Unavailable("could not claim the namespace in etcd: too much contention")


async def list_owners(session: EtcdSession, cluster: str) -> tuple[dict[bytes, OwnerRecord], int]:
    """Every namespace owner, and the etcd revision they were read at."""
    pfx = state.owners_prefix(cluster)
    resp = await session.run(lambda c: c.get_prefix(pfx), "listing namespace owners")
    out: dict[bytes, OwnerRecord] = {}
    for kv in resp:
        try:
            fp = bytes.fromhex(kv.key[len(pfx) :].decode())
        except ValueError:
            continue
        if len(fp) == 8:
            out[fp] = _owner_from_range(fp, [(kv.value, kv)]) or OwnerRecord(fp, UNKNOWN_OWNER)
    return out, resp.header.revision


class OwnerRegistry:
    """A node's claims of namespaces for its tenants (``kvstore.node.tenants.Ownership`` calls
    :meth:`claim` for namespaces its cache does not know).  One etcd session of its own, so
    a claim never queues behind the watch or the lease keep-alive."""

    def __init__(self, endpoints: str, cluster: str, node_id: str, *, timeout: float = 2.0) -> None:
        self.cluster = state.check_cluster_name(cluster)
        self.node_id = node_id
        self.session = EtcdSession(endpoints, timeout=timeout)
        self.where = f"etcd at {endpoints}"

    async def claim(self, namespaces: list[bytes], tenant: str) -> dict[bytes, tuple[str, int]]:
        """namespace → (owning tenant, revision) for each namespace etcd resolved."""
        got = await claim_owners(self.session, self.cluster, namespaces, tenant, self.node_id)
        return {ns: (r.tenant, r.revision) for ns, r in got.items()}

    async def close(self) -> None:
        await self.session.close()

"""All etcd access: the only module that imports the etcd client (``aetcd``).

Three users, each with its own :class:`EtcdSession` (one gRPC channel, rotating over
the configured endpoints after a failure):

* :class:`Registration` (a node): puts ``nodes/<id>`` under a lease and keeps the lease
  alive; if etcd is unreachable the node serves on, and when etcd answers again the
  record is checked and, if the lease or the key is gone, registered anew.
* :class:`ClusterWatcher` (nodes and clients): loads everything under the cluster
  prefix, then follows a watch from the next revision, publishing an immutable
  :class:`~kvstore.cluster.state.ClusterSnapshot` after each change.  A ping beside the
  watch notices a dead or hung etcd; the last snapshot stays published (marked
  ``connected=False``) until a full reload succeeds.
* :class:`ClusterStore` (CLI and SDK): configuration and namespace epochs.

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
from typing import Any, TypeVar

import aetcd
import aetcd.exceptions

from kvstore.cluster import state
from kvstore.cluster.state import ClusterConfig, ClusterSnapshot, NamespaceRecord, NodeInfo
from kvstore.errors import InvalidArgument, Unavailable

log = logging.getLogger("kvstore.cluster.etcd")
T = TypeVar("T")

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
            c = aetcd.Client(host=host, port=port, timeout=max(1, math.ceil(self.timeout)), options=dict(CHANNEL_OPTIONS))
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
                return await asyncio.wait_for(fn(c), self.timeout)
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
        self.revision = 0

    def apply(self, key: bytes, value: bytes | None, revision: int, lease: int = 0) -> None:
        """``value`` None: the key was deleted.  ``revision`` is the key's mod revision."""
        self.revision = max(self.revision, revision)
        rel = key[len(self.prefix) :].decode(errors="replace")
        kind, _, name = rel.partition("/")
        try:
            if kind == "nodes" and name:
                if value is None:
                    self.nodes.pop(name, None)
                    self.registrations.pop(name, None)
                else:
                    self.nodes[name] = NodeInfo.from_json(value)
                    self.registrations[name] = (revision, lease)
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
        except (ValueError, TypeError, KeyError) as e:
            log.warning("ignoring malformed etcd record %s: %s", key.decode(errors="replace"), e)

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
        )


async def _load(session: EtcdSession, cluster: str) -> tuple[_Builder, int]:
    b = _Builder(cluster)
    resp = await session.run(lambda c: c.get_prefix(b.prefix), "loading the cluster state")
    for kv in resp:
        b.apply(kv.key, kv.value, kv.mod_revision, kv.lease)
    b.revision = resp.header.revision
    return b, resp.header.revision


class ClusterWatcher:
    """Publishes a :class:`ClusterSnapshot` to ``on_snapshot`` after every change.

    ``run()`` never returns until cancelled; etcd outages are retried with backoff.
    """

    def __init__(self, endpoints: str, cluster: str, on_snapshot: Callable[[ClusterSnapshot], None], *,
                 timeout: float = 2.0, ping_s: float = 5.0) -> None:
        self.cluster = state.check_cluster_name(cluster)
        self.session = EtcdSession(endpoints, timeout=timeout)
        self.on_snapshot = on_snapshot
        self.ping_s = ping_s
        self.last: ClusterSnapshot = ClusterSnapshot(cluster)

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
                self._publish(b.freeze(connected=True))
                backoff = 0.1
                await self._follow(b, rev)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # etcd down, hung, compacted, or a bug: reload from scratch
                if self.last.connected:
                    log.warning("etcd watch of cluster %s lost (%s: %s); keeping the last membership (%d nodes)",
                                self.cluster, type(e).__name__, e, len(self.last.nodes))
                    self._publish(dataclasses.replace(self.last, connected=False))
                await self.session.reset()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)

    async def _follow(self, b: _Builder, rev: int) -> None:
        client = await self.session.client()
        watch = await asyncio.wait_for(client.watch_prefix(b.prefix, start_revision=rev + 1), self.session.timeout)

        async def consume() -> None:
            async for ev in watch:
                b.apply(ev.kv.key, ev.kv.value if ev.kind == "PUT" else None, ev.kv.mod_revision, ev.kv.lease)
                self._publish(b.freeze(connected=True))
            raise Unavailable("the etcd watch ended")

        async def ping() -> None:
            while True:
                await asyncio.sleep(self.ping_s)
                try:
                    await asyncio.wait_for(client.get(b.prefix + b"nodes/"), self.session.timeout)
                except ETCD_ERRORS as e:
                    raise Unavailable(f"etcd did not answer a ping: {type(e).__name__}: {e}") from None

        tasks = [asyncio.ensure_future(consume()), asyncio.ensure_future(ping())]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                t.result()  # raises what ended it
        finally:
            for t in tasks:
                t.cancel()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(watch.cancel(), 1.0)
            await asyncio.gather(*tasks, return_exceptions=True)

    async def close(self) -> None:
        await self.session.close()


# -- node registration ------------------------------------------------------------------------
class Registration:
    """Keeps ``nodes/<id>`` alive under a lease for as long as the node runs."""

    def __init__(self, endpoints: str, cluster: str, info: NodeInfo, *, ttl_s: float = 10.0, timeout: float = 2.0) -> None:
        self.cluster = state.check_cluster_name(cluster)
        self.info = info
        self.ttl = max(1, math.ceil(ttl_s))
        self.key = state.node_key(cluster, info.node_id)
        self.session = EtcdSession(endpoints, timeout=min(timeout, max(0.5, self.ttl / 3)))
        self.lease_id: int | None = None
        self.registered = asyncio.Event()
        self.registrations = 0  # how many times a record was written (1 + re-registrations)
        self._reachable = True

    async def register(self) -> None:
        """Grant a lease and put our record on it (refusing to clobber another live node with our id)."""
        info = dataclasses.replace(self.info, started_at=self.info.started_at or time.time())

        async def put(c: aetcd.Client) -> int:
            existing = await c.get(self.key)
            if existing is not None:
                try:
                    other = NodeInfo.from_json(existing.value)
                except ValueError:
                    other = None
                if other is not None and (other.host, other.data_dir) != (info.host, info.data_dir):
                    raise InvalidArgument(
                        f"node id {info.node_id!r} is already registered in cluster {self.cluster!r} by "
                        f"{other.host}:{other.data_dir} (pid {other.pid}); give this node a unique --node-id"
                    )
            lease = await c.lease(self.ttl)
            await c.put(self.key, info.to_json(), lease=lease.id)
            return int(lease.id)

        self.lease_id = await self.session.run(put, f"registering node {info.node_id}")
        self.info = info
        self.registrations += 1
        self.registered.set()
        log.info("registered node %s in cluster %s (lease %x, ttl %d s)", info.node_id, self.cluster, self.lease_id, self.ttl)

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
                    log.info("etcd reachable again; node %s is registered", self.info.node_id)
                self._reachable = True
                await asyncio.sleep(interval)
            except asyncio.CancelledError:
                raise
            except InvalidArgument as e:
                log.error("%s", e)
                await asyncio.sleep(interval * 3)
            except Exception as e:  # etcd unreachable: keep serving, retry soon
                if self._reachable:
                    log.warning("etcd unreachable (%s); node %s keeps serving and will re-register", e, self.info.node_id)
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
            log.warning("lease of node %s expired (etcd lost it or we were away too long); registering again", self.info.node_id)
            self.lease_id = None
            await self.register()
        elif rec is None or rec.lease != lease_id:
            log.warning("record of node %s vanished or changed hands; registering again", self.info.node_id)
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
            await asyncio.wait_for(self.session.run(lambda c: c.revoke_lease(lease_id), "deregistering"), timeout)
            return True
        except (Unavailable, asyncio.TimeoutError):
            return False

    async def close(self) -> None:
        await self.session.close()


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
            ok, _ = await c.transaction(compare=[tx.version(key) == 0], success=[tx.put(key, rec.to_json())], failure=[])
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

    async def close(self) -> None:
        await self.session.close()

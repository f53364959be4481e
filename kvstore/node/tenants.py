"""Tenants: who a bearer token is, and which tenant owns which namespace.

A node configured with ``tenants`` (``kvstore/node/config.py``) knows two kinds of caller:

* the **admin**: the node's single ``token`` (or every caller of a node without auth).
  Allowed everything; its writes claim no namespace.
* a **tenant**: one of the ``tenants`` tokens.  The first tenant to write a block of a
  namespace (by the namespace fingerprint the block declares) owns that namespace from then
  on.  Another tenant's reads of its blocks are misses, and its writes, deletes, pins and
  invalidations there are refused or skipped (``kvstore/node/service.py`` applies the rules).

Owner: :class:`Ownership` belongs to the node's event loop (the service calls it there);
its lmdb environment is written from one worker thread at a time, per claim.  The
in-memory table is the hot path: one dict lookup per namespace of a batch.

Cluster mode (a node with ``etcd``): the owner of a namespace is agreed cluster-wide in
etcd (``owners/<fingerprint hex>``, created only if absent: whichever claim etcd applies
first wins, through any node).  The table here becomes a cache of etcd, kept durable in
the same lmdb environment so a node restarted while etcd is down still enforces what it
knew: a namespace the cache does not know is claimed in etcd (``OwnerAuthority``) before a
tenant's write to it is answered, and a claim that cannot reach etcd fails (``Unavailable``):
never a local claim that another node could contradict.  The node's etcd watcher feeds
changes in (:meth:`Ownership.apply`, :meth:`Ownership.sync`); etcd wins every conflict.

Invariants: a namespace's owner changes only by an operator (cluster mode: ``kvstore
cluster release``; single node: never); a claim is durable (lmdb, and in cluster mode etcd
first) before the write that made it is answered.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import hashlib
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Protocol

import lmdb

from kvstore.errors import CapacityExceeded, InvalidArgument, OwnershipUnavailable, PermissionDenied, Unavailable

log = logging.getLogger(__name__)

NO_NAMESPACE = bytes(8)
"""What a block declares when its writer named no namespace: never owned by a tenant."""

MAX_NAMESPACES_PER_TENANT = 65536
"""Claims one tenant may hold: bounds the table, and one tenant inventing namespaces
cannot keep the others from claiming theirs."""

_MAP_SIZE = 1 << 30  # virtual: lmdb's file grows with its records (about 100 bytes a claim)
_SYNC_KEY = b"cluster-synced-with"
"""Cluster mode: the etcd (``cluster@etcd-cluster-id``) this table last agreed with.  Not 8
bytes long, so never a namespace."""


@dataclasses.dataclass(frozen=True, slots=True)
class Caller:
    """Who made a call: ``tenant`` None is the admin (unrestricted)."""

    tenant: str | None


ADMIN = Caller(None)


def _digest(header: str | bytes) -> bytes:
    return hashlib.sha256(header.encode() if isinstance(header, str) else header).digest()


def authorization(metadata: object) -> str:
    """The ``authorization`` header of a call's metadata; "" when absent or given more than
    once (which one a proxy in front checked is unknowable: neither is trusted)."""
    values = [v for k, v in (metadata or ()) if k == "authorization"]  # type: ignore[attr-defined]
    return str(values[0]) if len(values) == 1 else ""


class Callers:
    """``authorization`` header value → :class:`Caller`.  Built once at start-up, read-only.

    Keyed by the SHA-256 of the whole header (``Bearer <token>``), so a lookup's timing
    says nothing useful about the tokens (it depends on digests, not on token prefixes).
    """

    def __init__(self, admin_token: str, tenant_tokens: Mapping[str, str] | None = None) -> None:
        self._by_digest: dict[bytes, Caller] = {}
        if admin_token:
            self._by_digest[_digest(f"Bearer {admin_token}")] = ADMIN
        for token, tenant in (tenant_tokens or {}).items():
            self._by_digest[_digest(f"Bearer {token}")] = Caller(tenant)
        self.tenants = frozenset(c.tenant for c in self._by_digest.values() if c.tenant is not None)

    def identify(self, header: str | bytes) -> Caller | None:
        """The caller a header authenticates, or None (missing or wrong token)."""
        if not header:
            return None
        return self._by_digest.get(_digest(header))


class OwnerAuthority(Protocol):
    """Where a clustered node's claims are decided (``kvstore.cluster.etcd.OwnerRegistry``)."""

    where: str  # for messages: "etcd at HOST:PORT"

    async def claim(self, namespaces: list[bytes], tenant: str) -> dict[bytes, tuple[str, int]]:
        """Claim for ``tenant`` those nobody owns, all or nothing; namespace → (owner, etcd
        revision) for each namespace resolved.  Raises ``Unavailable`` when etcd does not answer."""
        ...


Change = tuple[str | None, int]
"""A namespace's owner in etcd (None: none) and the etcd revision that says so."""


class Ownership:
    """Namespace fingerprint → owning tenant, in memory and in an lmdb environment.

    lmdb because the node already depends on it (the NVMe index), a claim is one small
    durable transaction, and a restart reads the whole table in one scan.  It lives in the
    data directory beside the NVMe tier (``<data_dir>/owners.lmdb``), so it survives
    restarts exactly as long as the blocks it guards do, whether or not the NVMe tier is on.
    """

    def __init__(
        self, path: Path, *, max_per_tenant: int = MAX_NAMESPACES_PER_TENANT, authority: OwnerAuthority | None = None
    ) -> None:
        self.path = Path(path)
        self.max_per_tenant = max_per_tenant
        self.authority = authority  # cluster mode: claims are agreed there, this table caches them
        self.synced_with: str | None = None  # cluster mode: the etcd this cache last agreed with
        self.on_lost: Callable[[set[bytes]], None] | None = None  # namespaces taken from their owner (cluster mode)
        # cluster mode: the tenant a namespace passes to, if it is a later epoch of one a tenant owns
        self.heir: Callable[[bytes], str | None] | None = None
        self.path.mkdir(parents=True, exist_ok=True)
        self.created = not (self.path / "data.mdb").exists()  # no claims recorded before: a new table
        self._env: lmdb.Environment | None = None
        self._writer: concurrent.futures.ThreadPoolExecutor | None = (
            None  # cluster mode: one thread, lmdb writes in order
        )
        self._owners: dict[bytes, str] = {}
        try:  # fail closed: a node that cannot read who owns what must not serve tenants
            self._env = lmdb.open(
                str(self.path), map_size=_MAP_SIZE, max_dbs=1, readahead=False, mode=0o600
            )  # the node's alone
            self._db = self._env.open_db(b"owners")
            with self._env.begin(db=self._db) as txn:
                for ns, tenant in txn.cursor():
                    if len(ns) != 8:  # not a namespace: the cluster-mode marker
                        if bytes(ns) == _SYNC_KEY:
                            self.synced_with = bytes(tenant).decode()
                        continue
                    self._owners[bytes(ns)] = bytes(tenant).decode()
        except (lmdb.Error, UnicodeDecodeError) as e:
            self.close()
            raise InvalidArgument(
                f"cannot read the namespace ownership table {self.path}: {e}; restore it from a backup "
                "(removing it hands every namespace to whichever tenant writes it first)"
            ) from None
        self._counts = collections.Counter(self._owners.values())
        self._pending: dict[bytes, asyncio.Task[None]] = {}  # claims not yet durable
        self._tasks: set[asyncio.Task[None]] = set()
        # cluster mode
        self._claiming: dict[bytes, asyncio.Task[None]] = {}  # etcd claims in flight
        self._revs: dict[bytes, int] = {}  # etcd revision of what the table says (also of a release)
        self._revs_of: str | None = None  # the etcd (sync marker) those revisions are of

    def __len__(self) -> int:
        return len(self._owners)

    def owner(self, namespace: bytes) -> str | None:
        return self._owners.get(namespace)

    def table(self) -> dict[bytes, str]:
        """The live table (the hot path reads it directly; only :meth:`claim`, and in cluster
        mode :meth:`apply` and :meth:`sync`, write it)."""
        return self._owners

    def may_modify(self, caller: Caller, namespace: bytes) -> bool:
        """Write, delete, pin or invalidate: the admin, or the namespace's owner."""
        return caller.tenant is None or self._owners.get(namespace) == caller.tenant

    async def claim(self, caller: Caller, namespaces: set[bytes]) -> None:
        """Let ``caller`` write blocks of ``namespaces``: claim those nobody owns, durably.

        All or nothing: one namespace owned by another tenant refuses the whole batch
        before anything is claimed.  The admin claims nothing.  In cluster mode the
        namespaces this table does not know are claimed in etcd, whose answer stands.
        """
        tenant = caller.tenant
        if tenant is None:
            return
        self._check(tenant, namespaces)
        if self.authority is not None:
            await self._claim_in_cluster(tenant, namespaces)
            return
        new = [ns for ns in namespaces if ns not in self._owners]
        if new and self._counts[tenant] + len(new) > self.max_per_tenant:
            raise CapacityExceeded(
                f"tenant {tenant!r} owns {self._counts[tenant]} namespaces; the limit is {self.max_per_tenant}"
            )
        for ns in new:  # in memory first, on the loop: a concurrent claim of another tenant now sees it
            self._owners[ns] = tenant
            self._counts[tenant] += 1
        if new:
            # recorded by a task of its own: a cancelled caller leaves memory and lmdb agreeing
            task = asyncio.get_running_loop().create_task(self._record(new, tenant))
            self._tasks.add(task)
            task.add_done_callback(self._settled)
            for ns in new:
                self._pending[ns] = task
        # wait for every claim of this batch to be durable, also one a concurrent call of the
        # same tenant made: no write is answered before its namespace's claim is recorded
        for task in {id(t): t for ns in namespaces if (t := self._pending.get(ns)) is not None}.values():
            await asyncio.shield(task)

    def _check(self, tenant: str, namespaces: set[bytes]) -> None:
        for ns in namespaces:
            if ns == NO_NAMESPACE:
                raise PermissionDenied(
                    f"tenant {tenant!r} must put blocks with a namespace (put(..., namespace=Namespace(...))): "
                    "blocks without one cannot be owned"
                )
            owner = self._owners.get(ns)
            if owner is not None and owner != tenant:
                raise PermissionDenied(
                    f"namespace {ns.hex()} belongs to another tenant; tenant {tenant!r} may not write to it"
                )

    def _settled(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()  # seen by the callers that awaited it; none may be left to see it

    async def _record(self, namespaces: list[bytes], tenant: str) -> None:
        try:
            await asyncio.get_running_loop().run_in_executor(None, self._store, namespaces, tenant)
        except Exception as e:
            for ns in namespaces:
                if self._owners.get(ns) == tenant:
                    del self._owners[ns]
                    self._counts[tenant] -= 1
            log.error("cannot record namespace ownership in %s: %s", self.path, e)
            raise Unavailable(f"cannot record namespace ownership: {e}") from e
        finally:
            for ns in namespaces:
                self._pending.pop(ns, None)

    def _store(self, namespaces: list[bytes], tenant: str) -> None:
        """Worker thread: one durable transaction."""
        assert self._env is not None
        with self._env.begin(write=True, db=self._db) as txn:
            for ns in namespaces:
                txn.put(ns, tenant.encode(), overwrite=False)

    # -- cluster mode: etcd decides, this table is its durable cache -----------------------------
    async def _claim_in_cluster(self, tenant: str, namespaces: set[bytes]) -> None:
        """Namespaces the cache does not know are claimed in etcd (all or nothing), and what
        etcd answers (this tenant, or another that claimed first through any node) is cached,
        durably, before the write is answered or refused."""
        loop = asyncio.get_running_loop()
        for _ in range(8):
            # a claim or record in flight for one of them (a concurrent call's): wait, then look again
            waits = {
                id(t): t for ns in namespaces if (t := self._claiming.get(ns) or self._pending.get(ns)) is not None
            }
            new = [ns for ns in namespaces if ns not in self._owners and ns not in self._claiming]
            if new:
                if self._counts[tenant] + len(new) > self.max_per_tenant:
                    raise CapacityExceeded(
                        f"tenant {tenant!r} owns {self._counts[tenant]} namespaces; the limit is {self.max_per_tenant}"
                    )
                task = loop.create_task(self._claim_remote(new, tenant))
                self._tasks.add(task)
                task.add_done_callback(self._settled)
                for ns in new:
                    self._claiming[ns] = task
                waits[id(task)] = task
            if not waits:
                return
            for t in waits.values():
                await asyncio.shield(t)
            self._check(tenant, namespaces)  # etcd may have said: another tenant's
        raise Unavailable(f"could not settle the owners of namespaces {sorted(ns.hex() for ns in namespaces)}; retry")

    async def _claim_remote(self, namespaces: list[bytes], tenant: str) -> None:
        assert self.authority is not None
        me = asyncio.current_task()
        try:
            try:
                got = await self._ask(namespaces, tenant)
            except Unavailable as e:
                log.warning("cannot claim namespaces %s for tenant %r: %s", [ns.hex() for ns in namespaces], tenant, e)
                raise OwnershipUnavailable(
                    f"cannot claim namespace {', '.join(ns.hex() for ns in namespaces)} for tenant {tenant!r}: in a cluster, "
                    f"namespace owners are agreed in etcd, and {self.authority.where} is unreachable, so a namespace this node "
                    "does not know yet cannot be written (namespaces it knows keep working); retry when etcd is back"
                ) from None
            recorded = self.apply(dict(got.items()))
        finally:
            for ns in namespaces:
                if self._claiming.get(ns) is me:
                    del self._claiming[ns]
        if recorded is not None:
            await asyncio.shield(recorded)

    async def _ask(self, namespaces: list[bytes], tenant: str) -> dict[bytes, tuple[str, int]]:
        """The claim etcd decides.  A later epoch of a namespace (``kvstore cluster invalidate``
        makes one) is claimed for the owner of its earlier epoch, whoever writes it first: an
        invalidation never puts a namespace up for grabs."""
        assert self.authority is not None
        heirs = {
            ns: h for ns in namespaces if self.heir is not None and (h := self.heir(ns)) is not None and h != tenant
        }
        got: dict[bytes, tuple[str, int]] = {}
        for ns, heir in heirs.items():
            got.update(await self.authority.claim([ns], heir))
        rest = [ns for ns in namespaces if ns not in heirs]
        if rest and not heirs:  # with an heir that is not this tenant, the batch is refused anyway
            got.update(await self.authority.claim(rest, tenant))
        return got

    def apply(self, changes: Mapping[bytes, Change]) -> asyncio.Task[None] | None:
        """Take owners from etcd (a claim's answer, a watch event): newer revisions win, a
        release (owner None) forgets the namespace.  A namespace taken from a tenant (released,
        or given to another) is reported to ``on_lost``: its blocks here must go, because a
        tenant never reads blocks another tenant wrote.  Returns the task making it durable."""
        changed: list[bytes] = []
        lost: dict[bytes, str] = {}  # namespace -> the tenant it was taken from
        for ns, (owner, rev) in changes.items():
            if rev < self._revs.get(ns, 0):
                continue  # older than what the table already says (a watch event behind a claim)
            self._revs[ns] = rev
            old = self._owners.get(ns)
            if owner == old:
                continue
            if old is not None:
                self._counts[old] -= 1
                lost[ns] = old
            if owner is None:
                del self._owners[ns]
            else:
                self._owners[ns] = owner
                self._counts[owner] += 1
            changed.append(ns)
        if lost:
            for ns, old in sorted(lost.items()):
                now = self._owners.get(ns)
                log.warning(
                    "namespace %s no longer belongs to tenant %r in etcd (now: %s); dropping its blocks on this node",
                    ns.hex(),
                    old,
                    repr(now) if now is not None else "no owner",
                )
            if self.on_lost is not None:
                self.on_lost(set(lost))
        return self._persist(changed) if changed else None

    def sync(
        self, table: Mapping[bytes, Change], revision: int, marker: str
    ) -> tuple[dict[bytes, str], asyncio.Task[None] | None]:
        """A full load of etcd's owners at ``revision``: etcd wins every disagreement (logged).

        Namespaces cached here but absent from etcd: if this table agreed with this etcd
        before (``marker`` matches), they were released meanwhile and are forgotten; if not
        (the node's first sync, tenants used before it joined the cluster, or a new etcd),
        they are returned, namespace → tenant, for the caller to claim in etcd
        (:meth:`confirmed` afterwards).  Until then they stay enforced."""
        if self._revs_of not in (None, marker):
            self._revs.clear()  # another etcd (a new cluster id): its revisions start afresh
        self._revs_of = marker
        changes: dict[bytes, Change] = {}
        for ns, (owner, rev) in table.items():
            cur = self._owners.get(ns)
            if rev < self._revs.get(ns, 0):
                continue  # the table learnt something newer (a claim) while the load was under way
            if cur != owner:
                if cur is not None:
                    log.warning(
                        "namespace %s: this node's ownership cache says tenant %r, etcd says %r; etcd wins",
                        ns.hex(),
                        cur,
                        owner,
                    )
                changes[ns] = (owner, rev)
            else:
                self._revs[ns] = rev
        local_only = {ns: t for ns, t in self._owners.items() if ns not in table and self._revs.get(ns, 0) <= revision}
        unconfirmed: dict[bytes, str] = {}
        if self.synced_with == marker:
            for ns, t in local_only.items():
                log.warning(
                    "namespace %s: tenant %r owned it here, but etcd no longer says so (released while this node "
                    "was away); etcd wins",
                    ns.hex(),
                    t,
                )
                changes[ns] = (None, revision)
        else:
            unconfirmed = local_only
        # releases older than this load are in it now: forget them
        for ns in [
            ns for ns, r in self._revs.items() if ns not in self._owners and r <= revision and ns not in changes
        ]:
            del self._revs[ns]
        task = self.apply(changes)
        if not unconfirmed:
            task = self.confirmed(marker) or task
        return unconfirmed, task

    def confirmed(self, marker: str) -> asyncio.Task[None] | None:
        """Every namespace cached here is now etcd's answer: remember which etcd agreed."""
        if self.synced_with == marker:
            return None
        self.synced_with = marker
        return self._persist([], marker=marker)

    def _persist(self, namespaces: list[bytes], *, marker: str | None = None) -> asyncio.Task[None]:
        """Write the table's current entries for ``namespaces`` to lmdb (deleting forgotten ones).
        One writer thread, fed in order from the loop: lmdb ends as the table ends."""
        if self._writer is None:
            self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvstore-owners")
        loop = asyncio.get_running_loop()
        items = [(ns, self._owners.get(ns)) for ns in namespaces]
        fut = loop.run_in_executor(self._writer, self._store_items, items, marker)

        async def wait() -> None:
            try:
                await fut
            except Exception as e:
                log.error("cannot record namespace ownership in %s: %s", self.path, e)
                raise Unavailable(f"cannot record namespace ownership: {e}") from e
            finally:
                for ns in namespaces:
                    if self._pending.get(ns) is task:
                        del self._pending[ns]

        task = loop.create_task(wait())
        self._tasks.add(task)
        task.add_done_callback(self._settled)
        for ns in namespaces:
            self._pending[ns] = task
        return task

    def _store_items(self, items: list[tuple[bytes, str | None]], marker: str | None) -> None:
        """Worker thread: one durable transaction."""
        assert self._env is not None
        with self._env.begin(write=True, db=self._db) as txn:
            for ns, tenant in items:
                if tenant is None:
                    txn.delete(ns)
                else:
                    txn.put(ns, tenant.encode())
            if marker is not None:
                txn.put(_SYNC_KEY, marker.encode())

    def close(self) -> None:
        if self._writer is not None:
            self._writer.shutdown(wait=True)  # what was recorded before the stop stays recorded
            self._writer = None
        if self._env is not None:
            self._env.close()
            self._env = None

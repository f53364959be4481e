"""Tenants: who a bearer token is, and which tenant owns which namespace.

A node configured with ``tenants`` (``kvstore/config.py``) knows two kinds of caller:

* the **admin**: the node's single ``token`` (or every caller of a node without auth).
  Allowed everything; its writes claim no namespace.
* a **tenant**: one of the ``tenants`` tokens.  The first tenant to write a block of a
  namespace (by the namespace fingerprint the block declares) owns that namespace from then
  on.  Another tenant's reads of its blocks are misses, and its writes, deletes, pins and
  invalidations there are refused or skipped (``kvstore/service.py`` applies the rules).

Owner: :class:`Ownership` belongs to the node's event loop (the service calls it there);
its lmdb environment is written from one worker thread at a time, per claim.  The
in-memory table is the hot path: one dict lookup per namespace of a batch.

Invariants: a namespace's owner never changes once recorded (there is no RPC to give a
namespace away); a claim is durable in lmdb before the write that made it is answered.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
import logging
from collections.abc import Mapping
from pathlib import Path

import lmdb

from kvstore.errors import CapacityExceeded, InvalidArgument, PermissionDenied, Unavailable

log = logging.getLogger(__name__)

NO_NAMESPACE = bytes(8)
"""What a block declares when its writer named no namespace: never owned by a tenant."""

MAX_NAMESPACES_PER_TENANT = 65536
"""Claims one tenant may hold: bounds the table, and one tenant inventing namespaces
cannot keep the others from claiming theirs."""

_MAP_SIZE = 1 << 30  # virtual: lmdb's file grows with its records (about 100 bytes a claim)


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


class Ownership:
    """Namespace fingerprint → owning tenant, in memory and in an lmdb environment.

    lmdb because the node already depends on it (the NVMe index), a claim is one small
    durable transaction, and a restart reads the whole table in one scan.  It lives in the
    data directory beside the NVMe tier (``<data_dir>/owners.lmdb``), so it survives
    restarts exactly as long as the blocks it guards do, whether or not the NVMe tier is on.
    """

    def __init__(self, path: Path, *, max_per_tenant: int = MAX_NAMESPACES_PER_TENANT) -> None:
        self.path = Path(path)
        self.max_per_tenant = max_per_tenant
        self.path.mkdir(parents=True, exist_ok=True)
        self.created = not (self.path / "data.mdb").exists()  # no claims recorded before: a new table
        self._env: lmdb.Environment | None = None
        self._owners: dict[bytes, str] = {}
        try:  # fail closed: a node that cannot read who owns what must not serve tenants
            self._env = lmdb.open(str(self.path), map_size=_MAP_SIZE, max_dbs=1, readahead=False)
            self._db = self._env.open_db(b"owners")
            with self._env.begin(db=self._db) as txn:
                for ns, tenant in txn.cursor():
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

    def __len__(self) -> int:
        return len(self._owners)

    def owner(self, namespace: bytes) -> str | None:
        return self._owners.get(namespace)

    def table(self) -> dict[bytes, str]:
        """The live table (the hot path reads it directly; only :meth:`claim` writes it)."""
        return self._owners

    def may_modify(self, caller: Caller, namespace: bytes) -> bool:
        """Write, delete, pin or invalidate: the admin, or the namespace's owner."""
        return caller.tenant is None or self._owners.get(namespace) == caller.tenant

    async def claim(self, caller: Caller, namespaces: set[bytes]) -> None:
        """Let ``caller`` write blocks of ``namespaces``: claim those nobody owns, durably.

        All or nothing: one namespace owned by another tenant refuses the whole batch
        before anything is claimed.  The admin claims nothing.
        """
        tenant = caller.tenant
        if tenant is None:
            return
        for ns in namespaces:
            if ns == NO_NAMESPACE:
                raise PermissionDenied(
                    f"tenant {tenant!r} must put blocks with a namespace (put(..., namespace=Namespace(...))): "
                    "blocks without one cannot be owned"
                )
            owner = self._owners.get(ns)
            if owner is not None and owner != tenant:
                raise PermissionDenied(f"namespace {ns.hex()} belongs to another tenant; tenant {tenant!r} may not write to it")
        new = [ns for ns in namespaces if ns not in self._owners]
        if new and self._counts[tenant] + len(new) > self.max_per_tenant:
            raise CapacityExceeded(f"tenant {tenant!r} owns {self._counts[tenant]} namespaces; the limit is {self.max_per_tenant}")
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

    def close(self) -> None:
        if self._env is not None:
            self._env.close()
            self._env = None

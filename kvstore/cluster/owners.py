"""A clustered node's namespace owners: etcd's ``owners/`` records → the node's ownership cache.

Owned by :class:`kvstore.cluster.node.NodeAgent` and run on the node's event loop (the loop
that owns :class:`kvstore.node.tenants.Ownership` and the tier manager).  Claims themselves go
from ``Ownership`` straight to :class:`~kvstore.cluster.etcd.OwnerRegistry`; this module
keeps the cache in step with etcd afterwards:

* a full load (start-up, and every reload after an etcd outage) is reconciled with the
  cache: etcd wins every disagreement (logged).  Namespaces only the cache knows were
  either released while the node was away (the cache agreed with this etcd before: they
  are forgotten) or claimed before the node agreed with this etcd at all (tenants used in
  single-node mode, a node's first join, a new etcd): those are claimed in etcd for their
  cached owner, in the background, and whatever etcd answers stands;
* each watch event is applied as it comes (a claim through another node, a release);
* a namespace taken from a tenant (released, or reassigned) has its blocks dropped here
  (``TierManager.invalidate``): a tenant never reads blocks another tenant wrote, even
  after an operator hands the namespace over.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from kvstore.aio import cancel_and_wait
from kvstore.cluster.etcd import OwnerRegistry, OwnersUpdate
from kvstore.errors import KVStoreError
from kvstore.node.tenants import Ownership

log = logging.getLogger("kvstore.cluster.owners")

PUSH_BATCH = 32  # cache-only namespaces claimed in etcd concurrently (start-up only)


class OwnersFollower:
    def __init__(self, owners: Ownership, registry: OwnerRegistry, cluster: str, manager: Any) -> None:
        self.owners = owners
        self.registry = registry
        self.cluster = cluster
        self.manager = manager
        self.synced = asyncio.Event()  # set after the first full load was reconciled
        self.dropped = 0  # namespaces whose blocks were dropped here
        self._push: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        owners.on_lost = self._lost

    # -- from the watcher (on the loop) ----------------------------------------------------
    def on_owners(self, update: OwnersUpdate) -> None:
        records = {
            ns: ((r.tenant, r.revision) if r is not None else (None, update.revision))
            for ns, r in update.records.items()
        }
        if not update.full:
            self.owners.apply(records)  # made durable by a task of Ownership's own
            return
        marker = f"{self.cluster}@{update.etcd_cluster_id:x}"
        if self._push is not None:
            self._push.cancel()  # a newer load supersedes it
            self._push = None
        unconfirmed, _recorded = self.owners.sync(
            {ns: (t, rev) for ns, (t, rev) in records.items() if t is not None}, update.revision, marker
        )
        if unconfirmed:
            log.info(
                "%d namespace owners known only to this node (before it agreed with etcd): claiming them in etcd",
                len(unconfirmed),
            )
            self._push = self._spawn(self._confirm(unconfirmed, marker))
        self.synced.set()

    async def _confirm(self, unconfirmed: dict[bytes, str], marker: str) -> None:
        """Claim the cache-only namespaces in etcd for their cached owners; retried until etcd answers."""
        delay = 0.5
        todo = dict(unconfirmed)
        while todo:
            try:
                items = list(todo.items())
                for i in range(0, len(items), PUSH_BATCH):
                    part = items[i : i + PUSH_BATCH]
                    answers = await asyncio.gather(*(self.registry.claim([ns], tenant) for ns, tenant in part))
                    for (ns, tenant), got in zip(part, answers):
                        if ns in got and got[ns][0] != tenant:
                            log.warning(
                                "namespace %s: this node's cache says tenant %r, but %r claimed it in etcd first; "
                                "etcd wins",
                                ns.hex(),
                                tenant,
                                got[ns][0],
                            )
                        self.owners.apply(got)
                        todo.pop(ns, None)
            except KVStoreError as e:
                log.warning("cannot confirm namespace owners in etcd yet (%s); retrying", e)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
        self.owners.confirmed(marker)

    # -- dropping what a tenant lost ----------------------------------------------------------
    def _lost(self, namespaces: set[bytes]) -> None:
        self._spawn(self._drop(namespaces))

    async def _drop(self, namespaces: set[bytes]) -> None:
        n = await self.manager.drop_namespaces(namespaces, why="owner_change")
        self.dropped += len(namespaces)
        if n:
            log.info("dropped %d blocks of %d namespaces that changed owner", n, len(namespaces))

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("namespace owners: %s", task.exception())

    async def stop(self) -> None:
        await cancel_and_wait(list(self._tasks))
        await self.registry.close()

"""A node's part in a cluster: membership registration, namespace-epoch reclaim and (with
tenants) namespace owners followed from etcd (:mod:`kvstore.cluster.owners`).

Owned by :class:`kvstore.node.server.Node` and run on the node's event loop (the same loop
that owns the tier manager, so reclaiming calls the manager directly).  Nothing here
is on the data path: if etcd is down the node keeps serving, its registration retries
and re-registers when etcd returns (see :class:`~kvstore.cluster.etcd.Registration`).

Hot keys (:mod:`kvstore.cluster.hot`, when the cluster setting ``hot_extras`` is above 0):
the node counts the keys it serves (the ledger's ``on_hits``), weighs them every
``hot_window_s`` and publishes the read-hot keys it owns in ``hot/<node id>`` on its
lease; as an extra of another node's hot key it drops its copy once the key leaves the
hot set.

Reclaim: when a namespace's epoch rises to ``E``, every block whose recorded namespace
is the effective fingerprint of an older epoch (``effective_fingerprint(fp, e)``,
``e < E``) is deleted from DRAM and NVMe in one pass.  The first snapshot after start-up
does the same for every known namespace, so bumps made while the node was down are
applied to what it finds on NVMe.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from typing import Any

from kvstore import __version__
from kvstore.aio import cancel_and_wait
from kvstore.cluster import hot as _hot
from kvstore.cluster.etcd import ETCD_ERRORS, ClusterWatcher, OwnerRegistry, Registration
from kvstore.cluster.owners import OwnersFollower
from kvstore.cluster.placement import Placement, placement
from kvstore.cluster.state import ClusterSnapshot, NodeInfo, effective_fingerprint, hot_key
from kvstore.errors import Unavailable
from kvstore.keys import ChunkKey
from kvstore.node.config import NodeConfig
from kvstore.node.manager import TierManager
from kvstore.node.tenants import Ownership

log = logging.getLogger("kvstore.cluster.node")

MAX_HEIR_EPOCHS = 16
HEAT_SAMPLE = 4  # the heat counter sees 1 in 4 of the keys served (about 0.5 us per key served)  # how many earlier epochs a namespace's new epoch looks back for its owner


class NodeAgent:
    def __init__(
        self, cfg: NodeConfig, endpoints: dict[str, Any], manager: TierManager, owners: Ownership | None = None
    ) -> None:
        self.cfg = cfg
        self.manager = manager
        self.info = NodeInfo(
            node_id=cfg.node_id,
            grpc=endpoints["grpc"],
            data=endpoints.get("data", ""),
            unix=endpoints.get("unix", ""),
            host=socket.gethostname(),
            zone=cfg.zone,
            version=__version__,
            dram_bytes=cfg.dram,
            nvme_bytes=cfg.nvme,
            pid=endpoints.get("pid", 0),
            data_dir=str(endpoints.get("data_dir", cfg.data_dir)),
            started_at=time.time(),
            metrics=str(endpoints.get("metrics") or ""),
            weight=cfg.placement_weight,
        )
        self.registration = Registration(cfg.etcd, cfg.cluster, self.info, ttl_s=cfg.membership_ttl_s)
        # with tenants: the ownership table caches etcd's owners/ records (claims go to the registry)
        self.owners: OwnersFollower | None = None
        if owners is not None and isinstance(owners.authority, OwnerRegistry):
            self.owners = OwnersFollower(owners, owners.authority, cfg.cluster, manager)
            owners.heir = self._heir
        self._earlier: dict[bytes, list[bytes]] = {}  # effective fingerprint at epoch e > 0 -> those of e-1 .. 0
        self.watcher = ClusterWatcher(
            cfg.etcd,
            cfg.cluster,
            self._on_snapshot,
            on_owners=self.owners.on_owners if self.owners is not None else None,
        )
        self.snapshot = ClusterSnapshot(cfg.cluster)
        self._applied: dict[bytes, int] = {}  # namespace fingerprint -> epoch whose stale blocks are gone
        self._first = True
        self._reclaim_lock = asyncio.Lock()
        self._tasks: list[asyncio.Task[Any]] = []
        self._pending: set[asyncio.Task[Any]] = set()
        # hot keys: what this node serves, what it published, the extra copies it holds
        self.heat = _hot.HeatCounter(sample=HEAT_SAMPLE)
        self.hot_published: dict[bytes, int] = {}
        self._hot_lease: int | None = None
        self.extra_copies = _hot.ExtraCopies(cfg.node_id)
        self.extras_dropped = 0
        self._extras_task: asyncio.Task[Any] | None = None
        self._extras_again = False
        manager.watch_hits(self._on_hits)

    async def start(self, first_timeout: float = 5.0) -> dict[str, Any]:
        """Register (waiting up to ``first_timeout`` s; an unreachable etcd is retried in the
        background) and start watching.  A node id taken by another live node is an error."""
        registered = True
        try:
            await asyncio.wait_for(self.registration.register(), first_timeout)
        except (TimeoutError, Unavailable) as e:
            registered = False
            log.warning(
                "cannot register with etcd at %s yet (%s); serving anyway, retrying in the background", self.cfg.etcd, e
            )
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self.registration.run()),
            loop.create_task(self.watcher.run()),
            loop.create_task(self._hot_loop()),
        ]
        out = {
            "cluster": self.cfg.cluster,
            "etcd": self.cfg.etcd,
            "registered": registered,
            "lease_ttl_s": self.registration.ttl,
            "zone": self.cfg.zone,
        }
        if self.owners is not None:
            # serve etcd's owners from the start when etcd answers (the cached ones meanwhile)
            if registered:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.owners.synced.wait(), first_timeout)
            out["owners_synced"] = self.owners.synced.is_set()
        return out

    async def leave(self) -> None:
        """:meth:`stop` within a bound, never raising (:func:`stop_quietly`)."""
        await stop_quietly(self)

    async def stop(self) -> None:
        """Deregister first (clients stop routing here), then stop watching."""
        stuck = await cancel_and_wait(self._tasks)
        if stuck:
            log.warning("stopping: %d cluster tasks did not end on cancellation: %s", len(stuck), stuck)
        if self.registration.lease_id is not None and not await self.registration.deregister():
            log.warning("could not deregister from etcd; the record expires with its lease")
        await self.registration.close()
        await self.watcher.close()
        if self.owners is not None:
            await self.owners.stop()
        await cancel_and_wait(list(self._pending))

    # -- hot keys (kvstore.cluster.hot) ----------------------------------------------------------
    def _on_hits(self, hits: list[tuple[str, Any]]) -> None:
        if self.snapshot.config.hot_extras > 0:
            self.heat.add_many([meta.key for _, meta in hits])

    async def _table(self, snap: ClusterSnapshot) -> Placement | None:
        """The placement of ``snap`` (built off the loop the first time: it is cached)."""
        members = snap.members()
        if not members:
            return None
        return await asyncio.get_running_loop().run_in_executor(None, placement, snap.config.placement, members)

    async def _hot_loop(self) -> None:
        """Every ``hot_window_s``: weigh this window's reads, publish the hot keys this node owns."""
        while True:
            window = self.snapshot.config.hot_window_s
            await asyncio.sleep(window)
            try:
                await self._hot_window(window)
            except asyncio.CancelledError:
                raise
            except (*ETCD_ERRORS, Unavailable) as e:
                log.debug("cannot publish hot keys yet: %s", e)
            except Exception:
                log.exception("hot keys: weighing or publishing failed")

    async def _hot_window(self, window: float) -> None:
        counts, total = self.heat.take()
        snap = self.snapshot
        cfg = snap.config
        hot: dict[bytes, int] = {}
        if cfg.hot_extras > 0 and counts and snap.connected:
            table = await self._table(snap)
            if table is not None:
                me, r = self.cfg.node_id, cfg.replication
                hot = _hot.decide(
                    counts,
                    total,
                    window,
                    r=r,
                    current=snap.hot,
                    owns=lambda key: me in table.owners(key, r),
                    floor=cfg.hot_reads_per_s,
                    max_extras=cfg.hot_extras,
                )
        await self._publish_hot(hot)

    async def _publish_hot(self, hot: dict[bytes, int]) -> None:
        """Write ``hot/<node id>`` (on the node's lease) when the set or the lease changed."""
        lease = self.registration.lease_id
        if hot == self.hot_published and (lease == self._hot_lease or not hot):
            return
        key = hot_key(self.cfg.cluster, self.cfg.node_id)
        if not hot:
            await self.registration.session.run(lambda c: c.delete(key), "clearing hot keys")
        elif lease is None:
            return  # not registered (yet): the record would outlive the node
        else:
            raw = _hot.to_json(hot)
            await self.registration.session.run(lambda c: c.put(key, raw, lease=lease), "publishing hot keys")
        if hot.keys() != self.hot_published.keys():
            log.info("hot keys: %d (extra copies %s)", len(hot), _hot.summary(hot))
        self.hot_published, self._hot_lease = hot, lease

    def _extras_changed(self) -> None:
        """Drop the extra copies this node holds of keys that left the hot set (one task at a time)."""
        if self._extras_task is not None and not self._extras_task.done():
            self._extras_again = True
            return
        self._extras_task = asyncio.get_running_loop().create_task(self._drop_extras())
        self._pending.add(self._extras_task)
        self._extras_task.add_done_callback(self._pending.discard)

    async def _drop_extras(self) -> None:
        while True:
            self._extras_again = False
            snap = self.snapshot
            if snap.hot or self.extra_copies.held:
                table = await self._table(snap)
                gone = self.extra_copies.update(table, snap.hot, snap.config.replication)
                if gone:
                    n = await self.manager.delete([ChunkKey(k) for k in gone])
                    self.extras_dropped += n
                    # a reader may still be filling a copy it routed by an older view: drop once more later
                    await asyncio.sleep(snap.config.hot_window_s)
                    again = [k for k in gone if k not in self.extra_copies.held]
                    if again:
                        n = await self.manager.delete([ChunkKey(k) for k in again])
                        self.extras_dropped += n
            if not self._extras_again:
                return

    # -- namespace epochs ---------------------------------------------------------------------
    def _on_snapshot(self, snap: ClusterSnapshot) -> None:
        prev, self.snapshot = self.snapshot, snap
        if not snap.connected:
            return
        if (
            snap.hot is not prev.hot
            and (snap.hot or self.extra_copies.held)
            and (snap.hot != prev.hot or snap.nodes.keys() != prev.nodes.keys())
        ):
            self._extras_changed()
        if self.owners is not None:
            self._earlier = {
                rec.effective: [
                    effective_fingerprint(fp, e)
                    for e in range(rec.epoch - 1, max(-1, rec.epoch - 1 - MAX_HEIR_EPOCHS), -1)
                ]
                for fp, rec in snap.namespaces.items()
                if rec.epoch > 0
            }
        stale: set[bytes] = set()
        for fp, rec in snap.namespaces.items():
            applied = self._applied.get(fp, None if self._first else 0)
            if rec.epoch > 0 and (applied is None or rec.epoch > applied):
                stale.update(effective_fingerprint(fp, e) for e in range(rec.epoch))
            self._applied[fp] = rec.epoch
        self._first = False
        if stale:
            task = asyncio.get_running_loop().create_task(self._reclaim(stale))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)

    def _heir(self, namespace: bytes) -> str | None:
        """The owner of an earlier epoch of ``namespace``, if it is a later epoch of one."""
        assert self.owners is not None
        for fp in self._earlier.get(namespace, ()):
            if (tenant := self.owners.owners.owner(fp)) is not None:
                return tenant
        return None

    async def _reclaim(self, stale: set[bytes]) -> int:
        """Delete every block recorded under one of the ``stale`` effective fingerprints."""
        async with self._reclaim_lock:
            n = await self.manager.drop_namespaces(stale, why="epoch")
            if n:
                log.info("namespace epoch bump: reclaimed %d stale blocks", n)
            return n


STOP_TIMEOUT_S = 10.0


async def stop_quietly(agent: NodeAgent | None, timeout: float = STOP_TIMEOUT_S) -> bool:
    """Leave the cluster (:meth:`NodeAgent.stop`) within ``timeout`` s; never raise, never hang.

    A node that stops while etcd is unreachable must still exit: past the bound the stop is
    abandoned (cancelled, not awaited: a call stuck in the etcd client may not honour the
    cancellation) and the node's record expires with its lease.  True if the stop finished."""
    if agent is None:
        return True
    task = asyncio.ensure_future(agent.stop())
    done, _ = await asyncio.wait({task}, timeout=timeout)
    if not done:
        task.cancel()
        log.warning(
            "leaving the cluster did not finish in %.0f s (is etcd reachable?); going on: "
            "this node's record expires with its lease",
            timeout,
        )
        return False
    if not task.cancelled() and task.exception() is not None:
        log.debug("leaving the cluster failed: %s", task.exception())
    return True


class ClusterLink:
    """What ``kvstore serve`` hands a node with ``etcd`` set (``kvstore.node.server.ClusterLink``):
    etcd decides its namespace owners (:class:`~kvstore.cluster.etcd.OwnerRegistry`) and a
    :class:`NodeAgent` registers it.  Stateless."""

    def owner_authority(self, cfg: NodeConfig) -> OwnerRegistry:
        return OwnerRegistry(cfg.etcd, cfg.cluster, cfg.node_id)

    def agent(
        self, cfg: NodeConfig, endpoints: dict[str, Any], manager: TierManager, owners: Ownership | None
    ) -> NodeAgent:
        return NodeAgent(cfg, endpoints, manager, owners=owners)

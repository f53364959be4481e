"""Moving blocks between tiers: DRAM space by eviction, demotion DRAM → NVMe, promotion NVMe → DRAM.

Owner: the tier manager's event loop (``TierManager.movers``).  The coroutines here run
on that loop; the functions named as executor work (``_write_nvme``, ``_nvme_room``,
``_nvme_read_to_arena``) run in ``executor`` threads through :meth:`io` and touch only
the NVMe tier (thread-safe), arena bytes that a reference in ``holds`` keeps in place,
``counters`` and the ``departed`` queue (which the loop drains).

State (blocks in flight, by key):

* ``_busy``: DRAM blocks an eviction round is demoting (not evictable meanwhile);
* ``_promoting``: one future per key being read from NVMe, which every caller asking for
  that key awaits (a block is promoted once, however many calls want it);
* ``_persisting``: how many writes to NVMe carry each key right now;
* ``_doomed``: keys deleted while being written to NVMe: they count as gone from NVMe at
  once, and the copy being written is deleted when its write ends;
* ``background``: write-through groups, the cleaner and other persists still running;
* ``_cleaner``: the task writing the next DRAM victims to NVMe ahead of their eviction
  (``clean_ahead_bytes``), so a reserve that needs room deletes clean blocks instead of
  waiting on the disk;
* ``_wt_queue``: write-through commits waiting for the next group (``write_through``);
* ``_corrupt_demoted``: dirty blocks that failed their checksum on the way out (so their
  eviction is remembered as ``corrupt``; bounded); the cleaner drops them at once.

Invariants: a block is evicted from DRAM only if ``can_evict`` (not being demoted, not
pinned, no reference); its bytes are read by an executor thread only under a reference
in ``holds``, and a cancelled caller waits for that thread before anything is freed
(:meth:`io`); a delete sticks: no promotion or demotion that was under way brings the
block back to DRAM or NVMe; a dirty block whose payload fails its checksum is never
written to NVMe; NVMe never exceeds its capacity, and never evicts a block being
promoted or a pinned one to make room.  A write-through commit returns only after its
blocks' payload and index entries are durable (``NVMeTier.write_many``), or the tier
refused them (counted in ``nvme_write_failures``).  Demotion fails open: whatever the
disk or the index raises, the block is not demoted and is counted; the put or get that
needed the DRAM space never fails with it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvstore.aio import await_to_the_end
from kvstore.block import BlockMeta, checksum
from kvstore.errors import CapacityExceeded, KVStoreError
from kvstore.keys import NO_PARENT, ChunkKey
from kvstore.node.holds import Holds, allocation
from kvstore.node.ledger import CORRUPT, EVICTED
from kvstore.node.outcomes import Status
from tiers.allocator import Extent
from tiers.base import LowerTier, MissReason
from tiers.dram import DRAMTier

log = logging.getLogger("kvstore.node.manager")  # the tier manager's log, as before the split

STALL_S = 1.0
"""Most seconds one allocation waits while no DRAM block is evictable but background work
(demotions, write-through groups, the cleaner) may free some: past it the allocation fails
(``CapacityExceeded``: a Reserve answers ``NO_SPACE``, a save becomes a future miss) instead
of holding its caller until the caller's deadline."""

Forget = Callable[[ChunkKey, str, BlockMeta | None], None]
"""Loop only: remember that a key left the node, and why (``TierManager._forget``)."""


class TierMovers:
    def __init__(
        self,
        dram: DRAMTier,
        nvme: LowerTier | None,
        holds: Holds,
        *,
        executor: ThreadPoolExecutor,
        counters: collections.Counter[str],
        forget: Forget,
        departed: collections.deque[tuple[ChunkKey, str, bytes | None]],
        verify_demotions: bool = True,
    ) -> None:
        self.dram = dram
        self.nvme = nvme
        self.holds = holds
        self.counters = counters
        self.verify_demotions = verify_demotions
        self._executor = executor
        self._forget = forget
        self._departed = departed  # (key, reason, namespace) from executor threads
        self._busy: set[ChunkKey] = set()  # being demoted
        self._promoting: dict[ChunkKey, asyncio.Future[Status | None]] = {}
        self._persisting: collections.Counter[ChunkKey] = collections.Counter()  # being written to NVMe
        self._doomed: set[ChunkKey] = set()  # deleted while being written to NVMe: that copy goes when the write ends
        self.background: set[asyncio.Task[Any]] = set()
        self._corrupt_demoted: set[ChunkKey] = set()  # from executor threads: dirty blocks that failed their checksum
        self._wt_queue: list[tuple[Sequence[ChunkKey], asyncio.Future[None]]] = []
        self._wt_writer: asyncio.Task[Any] | None = None
        self.clean_ahead_bytes = 0  # DRAM kept free or clean (on NVMe too) at the victims' end; 0: no cleaner
        self.clean_batch_bytes = 64 << 20  # most bytes one cleaning write carries
        self.stall_s = STALL_S  # most seconds one allocation waits with nothing evictable
        self._cleaner: asyncio.Task[Any] | None = None

    # -- executor ---------------------------------------------------------------------
    async def io(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn`` in the executor.  A cancelled caller still waits for it to end before
        unwinding: the thread cannot be stopped, and it may be reading or writing arena
        extents that the caller frees (and another block gets) as it unwinds."""
        return await await_to_the_end(asyncio.get_running_loop().run_in_executor(self._executor, fn, *args))

    def spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return task

    # -- what is where ------------------------------------------------------------------
    def can_evict(self, key: ChunkKey) -> bool:
        if key in self._busy or self.holds.pinned(key):
            return False
        alloc = allocation(self.dram.extents(key))
        return alloc is None or not self.holds.leased(alloc)

    def on_nvme(self, key: ChunkKey) -> bool:
        return self.nvme is not None and key not in self._doomed and self.nvme.contains(key)

    def nvme_meta(self, key: ChunkKey) -> BlockMeta | None:
        """The NVMe copy's meta, unless there is none or it was deleted (while being written)."""
        if self.nvme is None or key in self._doomed:
            return None
        return self.nvme.meta(key)

    def delete_nvme(self, key: ChunkKey) -> bool:
        """Delete ``key`` from NVMe (memory only: the index commit comes later).  A copy being
        written right now goes when its write ends.  True if a live copy was there."""
        assert self.nvme is not None
        hit = bool(self.nvme.delete(key)) and key not in self._doomed  # a doomed key was deleted already
        if self._persisting[key]:
            self._doomed.add(key)
        return hit

    # -- DRAM space ---------------------------------------------------------------------
    async def allocate(self, nbytes: int) -> list[Extent]:
        """DRAM extents for ``nbytes``, evicting (and demoting) victims to make room.
        ``CapacityExceeded`` if it can never fit, or nothing became evictable within
        ``stall_s`` (every block pinned, leased or reserved)."""
        extents = self.dram.reserve(nbytes)  # raises CapacityExceeded if it can never fit
        waited = False
        give_up_at = asyncio.get_running_loop().time() + self.stall_s
        while extents is None:
            waited = await self._evict_dram(nbytes, give_up_at) or waited
            extents = self.dram.reserve(nbytes)
        if waited:  # the cleaner fell behind (or there is none): this put waited on the disk
            self.counters["reserve_waited_on_nvme"] += 1
        self.kick_cleaner()
        return extents

    # -- cleaning ahead of eviction -------------------------------------------------------
    def kick_cleaner(self) -> None:
        """Start the cleaner unless it runs or is not needed: the DRAM victims' end that is
        free or clean (also on NVMe, or one the NVMe tier would not admit, so its eviction
        is a delete) is below ``clean_ahead_bytes``.  Loop only."""
        if self.nvme is None or self.clean_ahead_bytes <= 0 or self._cleaner is not None:
            return
        if self.dram.allocator.free_bytes >= self.clean_ahead_bytes:
            return
        self._cleaner = self.spawn(self._clean())

    def _dirty_victims(self) -> list[ChunkKey]:
        """The next victims to write so the victims' end is clean (at most ``clean_batch_bytes``)."""
        assert self.nvme is not None
        have = self.dram.allocator.free_bytes
        batch: list[ChunkKey] = []
        size = 0
        for key in self._eviction_order():
            if have >= self.clean_ahead_bytes or size >= self.clean_batch_bytes:
                break
            meta = self.dram.meta(key)
            n = sum(e.length for e in self.dram.extents(key) or [])
            have += n
            if meta is None or self.nvme.contains(key) or self._persisting[key]:
                continue
            if not self.nvme.admit(key, meta.payload_len):
                continue  # evicting it is a delete: clean already
            batch.append(key)
            size += n
        return batch

    def _eviction_order(self) -> Iterator[ChunkKey]:
        """The DRAM blocks in the order they are likely to be evicted: the policy's victims,
        each followed by its ancestors in DRAM (prefix-aware policies offer a chain's leaf
        first and its parent only once the leaf is gone)."""
        seen: set[ChunkKey] = set()
        for key in self.dram.victims(self.can_evict):
            k: ChunkKey | None = key
            while k is not None and k not in seen and self.dram.contains(k) and self.can_evict(k):
                seen.add(k)
                yield k
                meta = self.dram.meta(k)
                k = meta.parent if meta is not None and meta.parent != NO_PARENT else None

    async def _clean(self) -> None:
        """Write dirty victims to NVMe, keeping them in DRAM (readable; not evictable while
        written), until the victims' end is clean.  Fails open like a demotion."""
        try:
            while True:
                batch = self._dirty_victims()
                if not batch:
                    return
                self._busy.update(batch)
                try:
                    before = self.counters["demotions"]
                    await self.persist(batch)
                finally:
                    self._busy.difference_update(batch)
                # a block whose payload failed its checksum on the way out can never be written
                # nor served: dropped now (as corrupt), or every later commit would read and
                # check it again (a node holding one spent its loop on it, a retry per commit)
                self._drop([k for k in batch if k in self._corrupt_demoted])
                wrote = self.counters["demotions"] - before
                self.counters["cleaned_ahead"] += wrote
                if not wrote:
                    return  # the disk refused them all: the next commit tries again
        except Exception:  # a cache fails open: evictions then write as before
            log.warning("cleaning DRAM ahead of eviction failed", exc_info=True)
        finally:
            self._cleaner = None

    async def _evict_dram(self, nbytes: int, give_up_at: float) -> bool:
        """Free DRAM for ``nbytes`` by evicting victims, writing the dirty ones to NVMe first;
        True if this waited on the disk (a write, or the cleaner's blocks in flight).
        With no victim at all it waits a moment for background work to free some, until
        the loop's clock reaches ``give_up_at``, then raises ``CapacityExceeded``.

        With a cleaner, clean victims (already on NVMe) within the cleaned window at the
        eviction end go first: the policy's order moves as blocks come and go, so the
        blocks the cleaner wrote need not be the very first victims by now."""
        need = self.dram.allocator.rounded(nbytes) - self.dram.allocator.free_bytes
        if self.clean_ahead_bytes > 0 and self._evict_clean(need):
            return False
        batch: list[ChunkKey] = []
        freed = 0
        for key in self.dram.victims(self.can_evict):
            batch.append(key)
            ext = self.dram.extents(key) or []
            freed += sum(e.length for e in ext)
            if freed >= need:
                break
        if not batch:
            # another round is demoting, or write-through persists hold blocks for a moment:
            # let them finish, then retry (those blocks are not pinned or leased), but not
            # for ever: background work need not free anything (the cleaner, a write of
            # blocks that stay), and the caller's deadline is better spent elsewhere
            if self._busy or self.background:
                if asyncio.get_running_loop().time() < give_up_at:
                    await asyncio.sleep(0.001)
                    return True
                self.counters["reserve_stalled"] += 1
                raise CapacityExceeded(
                    f"DRAM tier has nothing evictable after {self.stall_s:g} s ({self.dram.used_bytes} of "
                    f"{self.dram.capacity_bytes} bytes pinned, leased, reserved or being demoted)"
                )
            raise CapacityExceeded(
                f"DRAM tier is full of pinned, leased or reserved blocks ({self.dram.used_bytes} of "
                f"{self.dram.capacity_bytes} bytes); release leases, unpin, or raise --dram"
            )
        self._busy.update(batch)
        before = self.counters["demotions"]
        try:
            if self.nvme is not None:
                await self.persist(batch)
        finally:
            self._busy.difference_update(batch)
        waited = self.counters["demotions"] > before
        self._drop(batch)
        return waited

    def _drop(self, keys: Sequence[ChunkKey]) -> None:
        """Evict ``keys`` from DRAM (those still there and evictable); one not on NVMe left the node."""
        for key in keys:
            if self.dram.contains(key) and self.can_evict(key):
                meta = self.dram.meta(key)
                self.dram.delete(key)
                self.counters["dram_evictions"] += 1
                if self.nvme is None or not self.nvme.contains(key):  # it left the node
                    self._forget(key, CORRUPT if key in self._corrupt_demoted else EVICTED, meta)
                self._corrupt_demoted.discard(key)

    def _evict_clean(self, need: int) -> bool:
        """Free ``need`` bytes by evicting clean victims only (each is a delete: NVMe has it),
        looking no further than ``clean_ahead_bytes`` past ``need`` into the eviction order.
        False (nothing evicted) if they do not add up."""
        if self.nvme is None or need <= 0:
            return need <= 0
        clean: list[ChunkKey] = []
        got = scanned = 0
        for key in self.dram.victims(self.can_evict):
            n = sum(e.length for e in self.dram.extents(key) or [])
            scanned += n
            if key not in self._doomed and self.nvme.contains(key):
                clean.append(key)
                got += n
                if got >= need:
                    break
            if scanned >= need + self.clean_ahead_bytes:
                break
        if got < need:
            return False
        self._drop(clean)
        self.counters["evicted_clean"] += len(clean)
        return True

    # -- demotion DRAM -> NVMe --------------------------------------------------------------
    async def write_through(self, keys: Sequence[ChunkKey]) -> None:
        """Persist just-committed DRAM blocks, returning once they are durable on NVMe.

        Group commit: calls that arrive while a group is being written wait together for
        the next one (one fdatasync and one index transaction for all of them).  A caller
        cancelled meanwhile leaves its blocks in the group."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._wt_queue.append((keys, fut))
        if self._wt_writer is None:
            self._wt_writer = self.spawn(self._write_through_groups())
        await asyncio.shield(fut)

    async def _write_through_groups(self) -> None:
        try:
            while self._wt_queue:
                group, self._wt_queue = self._wt_queue, []
                try:
                    await self.persist(list(dict.fromkeys(k for keys, _ in group for k in keys)), admit=False)
                except BaseException as e:
                    for _, fut in group:
                        if not fut.done():
                            fut.set_exception(e)
                    raise
                for _, fut in group:
                    if not fut.done():
                        fut.set_result(None)
        finally:
            self._wt_writer = None

    async def persist(self, keys: Sequence[ChunkKey], *, admit: bool = True) -> None:
        """Write DRAM blocks that NVMe lacks to NVMe (one group commit).  ``admit``: only
        those the NVMe policy admits (demotions); write-through stores every one."""
        assert self.nvme is not None
        items: list[tuple[BlockMeta, memoryview]] = []
        for k in keys:
            meta = self.dram.meta(k)
            if meta is None or self.nvme.contains(k):
                continue
            if admit and not self.nvme.admit(k, meta.payload_len):
                self.counters["nvme_rejected"] += 1
                continue
            ext = self.dram.extents(k) or []
            views = self.dram.arena.views(ext, meta.payload_len)
            items.append((meta, views[0] if len(views) == 1 else memoryview(b"".join(views))))
        if not items:
            return
        allocs = [allocation(self.dram.extents(m.key)) for m, _ in items]
        for a in allocs:  # internal leases: the bytes must stay put while the executor reads them
            if a is not None:
                self.holds.ref(a)
        for m, _ in items:
            self._persisting[m.key] += 1
        try:
            written = await self.io(self._write_nvme, items)
        finally:
            for a in allocs:
                if a is not None:
                    self.holds.drop_ref(a)
            for m, _ in items:
                k = m.key
                self._persisting[k] -= 1
                if k in self._doomed:  # deleted while we wrote it: the copy must not outlive the delete
                    self.nvme.delete(k)
                if self._persisting[k] <= 0:
                    del self._persisting[k]
                    self._doomed.discard(k)
        self.counters["demotions"] += written
        self.counters["demoted_bytes"] += sum(m.payload_len for m, _ in items[:written])

    async def flush(self, deadline_s: float) -> int:
        """Demote every dirty DRAM block to NVMe, within a time budget; returns blocks written."""
        if self.nvme is None:
            return 0
        if self.background:
            await asyncio.wait(self.background, timeout=deadline_s)
        dirty = [k for k in self.dram.keys() if not self.nvme.contains(k)]
        before = self.counters["demotions"]
        try:
            await asyncio.wait_for(self.persist(dirty), timeout=deadline_s)
        except TimeoutError:
            log.warning("flush did not finish within %.0f s", deadline_s)
        return self.counters["demotions"] - before

    def _write_nvme(self, items: list[tuple[BlockMeta, memoryview]]) -> int:
        """Executor thread: verify, make room on NVMe, group-commit.  Returns blocks written."""
        assert self.nvme is not None
        good = []
        for meta, view in items:
            if self.verify_demotions and checksum(view) != meta.payload_checksum:
                self.counters["corrupt_demotions"] += 1
                if len(self._corrupt_demoted) < 4096:
                    self._corrupt_demoted.add(meta.key)
                log.warning("not demoting %s: payload does not match its checksum", meta.key.hex())
                continue
            good.append((meta, view))
        protect = {m.key for m, _ in good}
        written = 0
        for i in range(0, len(good), 16):
            part = good[i : i + 16]
            if self._nvme_room(part, protect):
                try:
                    self.nvme.write_many(part)
                    written += len(part)
                    continue
                except (KVStoreError, OSError):
                    pass  # fragmented (or a failing disk): fall back to one block at a time
            for item in part:
                try:
                    if self._nvme_room([item], protect):
                        self.nvme.write_many([item])
                        written += 1
                        continue
                    log.warning(
                        "NVMe tier has no room for %s: every block there is pinned or being read", item[0].key.hex()
                    )
                except (KVStoreError, OSError) as e:
                    # a cache fails open: the block is not demoted (counted), and the put or
                    # get that needed its DRAM space does not fail with the disk's error
                    log.warning("NVMe tier refused %s: %s", item[0].key.hex(), e)
                self.counters["nvme_write_failures"] += 1
        return written

    def _nvme_room(self, part: list[tuple[BlockMeta, memoryview]], protect: set[ChunkKey]) -> bool:
        """Evict NVMe victims until ``part`` should fit; False if nothing more can go."""
        assert self.nvme is not None
        from tiers.nvme import record_bytes

        need = sum(record_bytes(m.payload_len) for m, _ in part)
        biggest = max(m.payload_len for m, _ in part)
        while self.nvme.capacity_bytes - self.nvme.used_bytes < need or not self.nvme.fits(biggest):
            # never the block being promoted (it would vanish while we make room for it)
            victim = next(
                self.nvme.victims(lambda k: k not in protect and k not in self._promoting and not self.holds.pinned(k)),
                None,
            )
            if victim is None:
                return False
            vmeta = self.nvme.meta(victim)
            self.nvme.delete(victim)
            self.counters["nvme_evictions"] += 1
            if not self.dram.contains(victim):  # read racily from this thread: at worst a stale reason
                self._departed.append((victim, EVICTED, vmeta.namespace if vmeta is not None else None))
        return True

    # -- promotion NVMe -> DRAM --------------------------------------------------------------
    async def promote(self, key: ChunkKey) -> Status:
        """Bring ``key`` from NVMe into DRAM (once, however many calls ask): ``OK`` if it is
        in DRAM now, ``CORRUPT``, or ``MISS`` (gone meanwhile)."""
        while (fut := self._promoting.get(key)) is not None:
            st = await asyncio.shield(fut)
            if st is not None:
                return st
        fut = asyncio.get_running_loop().create_future()
        self._promoting[key] = fut
        try:
            st = await self._promote_once(key)
        except asyncio.CancelledError:
            fut.set_result(None)  # the leader's call was cancelled, not the waiters': they try again
            raise
        except BaseException as e:
            fut.set_exception(e)
            fut.exception()  # mark retrieved: concurrent waiters get it via shield
            raise
        finally:
            del self._promoting[key]
        fut.set_result(st)
        return st

    async def _promote_once(self, key: ChunkKey) -> Status:
        assert self.nvme is not None
        meta = self.nvme.meta(key) if key not in self._doomed else None
        if meta is None:
            return Status.MISS
        extents = await self.allocate(meta.payload_len)
        try:
            res = await self.io(self._nvme_read_to_arena, key, extents)
        except BaseException:
            self.dram.abort(extents)
            raise
        # deleted while we read it (deletes leave NVMe at once): it must not come back
        gone = not self.on_nvme(key)
        if not res.hit or gone or self.dram.contains(key):
            self.dram.abort(extents)
            if res.miss == MissReason.CORRUPT:
                self.counters["corrupt_blocks"] += 1
                if not self.dram.contains(key) and not self.on_nvme(key):  # it left the node
                    self._forget(key, CORRUPT, meta)
                return Status.CORRUPT
            return Status.OK if self.dram.contains(key) else Status.MISS
        self.dram.commit(res.meta, extents)
        self.counters["promotions"] += 1
        self.counters["promoted_bytes"] += res.meta.payload_len
        return Status.OK

    def _nvme_read_to_arena(self, key: ChunkKey, extents: list[Extent]) -> Any:
        """Executor thread: read an NVMe block straight into its new arena extents."""
        assert self.nvme is not None
        meta = self.nvme.meta(key)
        n = meta.payload_len if meta else 0
        if len(extents) == 1:
            return self.nvme.read_into(key, self.dram.arena.buf[extents[0].offset : extents[0].offset + max(n, 1)])
        tmp = bytearray(n)
        res = self.nvme.read_into(key, tmp)
        if res.meta is not None:  # a hit
            self.dram.arena.write(extents, memoryview(tmp)[: res.meta.payload_len])
        return res

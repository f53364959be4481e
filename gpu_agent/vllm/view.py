"""The scheduler half's lookups answered from the pool's view (scheduler process only).

vLLM asks ``get_num_new_matched_tokens`` on its scheduler thread for every waiting request
on every step it waits; an answer that needs a store call either holds the engine or makes
the request wait a step ("not yet").  :class:`ViewLookups` answers from a
:class:`~client.PoolView` instead: every node of the pool streams what it holds
(``WatchHoldings``), the view keeps it in memory, and a lookup is a few hash probes per
chunk, microseconds, with no RPC.  A miss is 0 at once; a hit is planned at once and the
node confirms it at load time (the worker's ``Acquire``): a block evicted since the view
last heard is a load error that vLLM recomputes (``kv_load_failure_policy="recompute"``,
which the connector requires), never wrong KV.

State it owns: the view (its threads and streams) and, once known, the name under which
the view lists the engine's own node (``own``), for locality: a chunk held there loads
from shared memory, one held elsewhere is pulled.  Until the view has a snapshot of a
node, that node holds nothing (a miss, not a wait).

Watching needs the node's admin token (the keys would tell a tenant what other tenants
stored): when every node refuses the view's credentials, :attr:`refused` turns True and
the scheduler half falls back to asking the store (``lookups="rpc"``), with a warning.
"""

from __future__ import annotations

import logging
import os
import time

from client import ClientOptions, PoolView
from gpu_agent.vllm.settings import AGENT, ConnectorSettings
from gpu_agent.vllm.spec import rank_lookup_keys
from gpu_agent.vllm.storelink import LookupAnswer
from kvstore.keys import Namespace
from kvstore.vocabulary import TierKind

log = logging.getLogger(__name__)

_TIER = {TierKind.DRAM: "dram", TierKind.NVME: "nvme", TierKind.HBM: "hbm"}
REFUSAL_CHECK_S = 1.0
"""How often :attr:`ViewLookups.refused` reads the view's counters (not on every ask)."""


def _expand(target: str) -> str:
    return "unix://" + os.path.expanduser(target[len("unix://") :]) if target.startswith("unix://~") else target


class ViewLookups:
    """Prefix lookups from the pool's view (see the module docstring)."""

    def __init__(self, settings: ConnectorSettings, ranks: list[tuple[int, int]]) -> None:
        self.settings, self.ranks = settings, ranks
        self.target = _expand(settings.lookup_target or settings.target)
        self.own_target = _expand(settings.target)
        opts = ClientOptions(
            token=settings.token,
            token_file=settings.token_file,
            tls=settings.tls,
            tls_ca_file=settings.tls_ca_file,
            tls_cert_file=settings.tls_cert_file,
            tls_key_file=settings.tls_key_file,
            agent=AGENT,
        )
        nodes: str | list[str] = self.target if self.target.startswith("etcd://") else [self.target]
        # a cluster's etcd that does not answer yet is no reason to hold the engine's start:
        # the membership thread finds the nodes when it does
        self.view = PoolView(nodes, opts, wait_s=0.0)
        self._own: str | None = None
        self._refused = False
        self._checked_at = 0.0

    @property
    def refused(self) -> bool:
        """Every node followed refused the view's credentials (checked once a second)."""
        now = time.monotonic()
        if not self._refused and now - self._checked_at >= REFUSAL_CHECK_S:
            self._checked_at = now
            s = self.view.stats()
            if s.refused and s.nodes and not s.nodes_synced:
                self._refused = True
                log.warning(
                    "kvstore: the nodes refuse to publish their holdings to this connector's token "
                    "(watching needs the admin token); lookups ask the store instead (lookups='rpc')"
                )
        return self._refused

    def _own_node(self) -> str | None:
        if self._own is None:
            self._own = self.view.node_for(self.own_target)
        return self._own

    def lookup(self, tokens: list[int], ns: Namespace, first: int) -> LookupAnswer:
        """Leading chunks of ``tokens`` from chunk ``first`` on (the trailing partial chunk
        counted last) that every rank's shard holds in the view, rank 0's tiers, and per
        chunk whether the engine's own node holds it (:class:`LookupAnswer`; ``seconds`` and
        ``cpu_seconds`` are this call's)."""
        t0, c0 = time.perf_counter(), time.thread_time()
        n = -1
        tiers: tuple[str, ...] = ()
        local: tuple[bool, ...] = ()
        own = self._own_node()
        for t, p in self.ranks:
            m = self.view.match(rank_lookup_keys(tokens, ns, t, p, first), prefer=own)
            if n < 0:
                tiers = tuple(_TIER[h.tier] for h in m.holders)
                local = tuple(own is not None and h.node == own for h in m.holders)
            n = m.hits if n < 0 else min(n, m.hits)
            if n == 0:
                break
        n = max(n, 0)
        return LookupAnswer(n, tiers[:n], local[:n], time.perf_counter() - t0, cpu_seconds=time.thread_time() - c0)

    def take_lags(self) -> list[float]:
        """The view's lag samples (ms) since the last call (:meth:`client.PoolView.take_lags`)."""
        return self.view.take_lags()

    def close(self) -> None:
        self.view.close()

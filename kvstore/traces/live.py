"""Live mode of ``kvstore replay``: drive a running node through the SDK with a trace.

Each request makes the calls :mod:`kvstore.traces.simulator` makes on its in-process tier
manager, over the SDK (:func:`client.connect`: a node or a cluster): ``match_prefix`` → ``get_many_into`` of the hit
prefix (the node's ``acquire`` tells the policy they were used) → ``put_many`` of the
rest with their parents, ``put_batch`` blocks per call.  Payloads are synthetic: one
buffer of ``block_bytes`` reused for every block, so the trace need not fit anywhere;
the node still copies, checksums and evicts real bytes.

An ``etcd://HOST:PORT/CLUSTER`` target drives a whole cluster through the SDK's cluster
router; capacity and byte counters are then summed over the nodes (capacity divided by
the replication factor).  Each node evicts on its own, so a cluster's hit ratio only
approximates the simulator's single tier of the same size (exactly, while nothing is
evicted).

For the hit ratio to equal the simulator's, the node must hold exactly ``capacity``
blocks in DRAM and nothing else: start it with ``--dram`` = capacity × block bytes
(rounded up to the 64 KiB allocation unit), ``--nvme 0`` and ``--eviction-policy`` set to
the policy under test, and replay into an empty node.  The capacity is read from the
node (DRAM bytes ÷ rounded block bytes), and each run salts its keys (a fresh namespace
salt) so a second run against the same node shares nothing with the first.

Session hints: each request's ``session_id`` goes with its calls and each ``close_session``
event of the trace is a ``close_session`` call at its place, so the node's own session code
decides (its ``session_idle_ttl_s`` runs on its wall clock: for the simulator's figures to
match, the replay must not leave a session idle that long).  A cluster target's puts cannot
carry a session yet: there the trace's sessions are dropped, with a warning.

Owner of state: one :class:`LiveReplay` per run, single-threaded.
"""

from __future__ import annotations

import dataclasses
import sys
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any, TextIO

import numpy as np

from kvstore.errors import InvalidArgument
from kvstore.traces.format import HitRatios, Trace
from kvstore.traces.simulator import put_batch
from tiers.dram import DEFAULT_UNIT

# node counters reported as bytes moved per tier (before/after difference)
BYTE_COUNTERS = {
    "client_to_dram": "put_bytes",
    "dram_to_client": "get_bytes",
    "dram_to_nvme": "demoted_bytes",
    "nvme_to_dram": "promoted_bytes",
}
EVENT_COUNTERS = ("dram_evictions", "nvme_evictions", "puts", "puts_deduplicated", "get_hits_dram", "get_hits_nvme")


def rounded(block_bytes: int, unit: int = DEFAULT_UNIT) -> int:
    return max(1, -(-block_bytes // unit)) * unit


def new_salt() -> str:
    return f"replay-{uuid.uuid4().hex[:12]}"


@dataclasses.dataclass(frozen=True, slots=True)
class LiveResult(HitRatios):
    target: str
    capacity_blocks: int
    block_bytes: int
    requests: int
    blocks: int
    hit_blocks: int
    tokens: int
    hit_tokens: int
    per_request_hits: tuple[int, ...]
    elapsed_s: float
    bytes_moved: dict[str, int]
    events: dict[str, int]
    node_tiers: dict[str, Any]
    warnings: tuple[str, ...]


def node_capacity_blocks(stats: dict[str, Any], block_bytes: int) -> int:
    dram = stats.get("tiers", {}).get("dram", {})
    return int(dram.get("capacity_bytes", 0)) // rounded(block_bytes)


def per_node(stats: dict[str, Any]) -> tuple[dict[str, dict[str, Any]], int]:
    """A node's stats, or a cluster's (``etcd://`` targets: one entry per node), and the replication factor."""
    if "nodes" not in stats:
        return {str(stats.get("node_id", "node")): stats}, 1
    nodes = {n: s for n, s in stats["nodes"].items() if "error" not in s}
    return nodes, max(1, int(stats.get("replication", 1)))


def summed_counters(stats: dict[str, Any]) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in per_node(stats)[0].values():
        for k, v in s.get("counters", {}).items():
            out[k] = out.get(k, 0) + int(v)
    return out


def serve_hint(capacity_blocks: int, block_bytes: int, policy: str | None = None) -> str:
    pol = f" --eviction-policy {policy}" if policy else ""
    return f"kvstore serve --dram {capacity_blocks * rounded(block_bytes)} --nvme 0{pol}"


def replay_live(
    trace: Trace,
    target: str,
    *,
    block_bytes: int,
    batch: int,
    speedup: float = 0.0,
    capacity_blocks: int | None = None,
    token_file: str | None = None,
    client_options: Mapping[str, Any] | None = None,
    log: TextIO | None | bool = True,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> LiveResult:
    """Replay ``trace`` (already salted, see :func:`new_salt`) against the node at ``target``.

    ``log``: where warnings go as they happen (True: stderr; None/False: only in the result).
    """
    from client import connect  # the SDK pulls in gRPC: only live mode needs it

    if block_bytes <= 0:
        raise InvalidArgument(f"--block-bytes must be positive, got {block_bytes}")
    if speedup < 0:
        raise InvalidArgument(f"--speedup must be zero (as fast as possible) or positive, got {speedup}")
    warnings: list[str] = []
    if log is True:
        log = sys.stderr  # looked up now, not at import: callers may have redirected it

    def warn(msg: str) -> None:
        warnings.append(msg)
        if log:
            print(f"kvstore replay: warning: {msg}", file=log)

    ns = trace.namespace.fingerprint
    payload = np.full(block_bytes, 0x5A, dtype=np.uint8)
    longest = max((len(k) for k in trace.keys), default=0)
    scratch = np.empty(max(1, longest) * block_bytes, dtype=np.uint8)  # get_many_into destinations
    with connect(target, token_file=token_file, **(client_options or {})) as kv:
        before = kv.stats()
        nodes, replication = per_node(before)
        cap = sum(node_capacity_blocks(n, block_bytes) for n in nodes.values()) // replication
        if cap <= 0:
            raise InvalidArgument(
                f"no DRAM room for one {block_bytes}-byte block at {target} ({len(nodes)} node(s) answered)"
            )
        if len(nodes) > 1 or replication > 1:
            warn(
                f"{len(nodes)} nodes, {replication} replica(s) per block: each node evicts on its own, so hit ratios "
                f"only approximate the simulator's single tier of {cap} blocks"
            )
        if capacity_blocks is not None and capacity_blocks != cap:
            warn(
                f"--capacity is {capacity_blocks} blocks but the node holds {cap} blocks of {block_bytes} bytes; "
                f"using the node's.  For {capacity_blocks} blocks start it with: {serve_hint(capacity_blocks, block_bytes)}"
            )
        if any("nvme" in n.get("tiers", {}) for n in nodes.values()):
            warn("the node has an NVMe tier: hits will differ from the DRAM-only simulator (start it with --nvme 0)")
        resident = sum(int(n.get("tiers", {}).get("dram", {}).get("blocks", 0)) for n in nodes.values())
        if resident:
            warn(f"the node already holds {resident} blocks: they take room the simulator does not model")
        per_batch = put_batch(cap, batch)
        hints = trace.has_sessions
        if hints and target.startswith("etcd://"):
            warn("a cluster client's puts cannot carry session ids yet: the trace's sessions and closes are not sent")
            hints = False
        hits: list[int] = []
        start = clock()
        for i, req in trace.events():
            if speedup:
                delay = req.timestamp / 1000.0 / speedup - (clock() - start)
                if delay > 0:
                    sleep(delay)
            if i < 0:  # a close_session event
                if hints:
                    assert req.session_id is not None  # the trace reader gives every close event its id
                    kv.close_session(req.session_id)
                continue
            keys = trace.keys[i]
            hint = {"session_id": req.session_id} if hints else {}  # cluster clients take none
            n = kv.match_prefix(keys, **hint) if keys else 0
            if n:
                outs = [scratch[j * block_bytes : (j + 1) * block_bytes] for j in range(n)]
                got = kv.get_many_into(keys[:n], outs, **hint)
                if any(g is None for g in got):
                    warn(f"request {i}: {sum(g is None for g in got)} of {n} matched blocks vanished before the read")
            parents = trace.parents(i)
            tokens = trace.block_token_counts(req)  # type: ignore[arg-type]
            for s in range(n, len(keys), per_batch):
                e = min(s + per_batch, len(keys))
                kv.put_many(
                    keys[s:e], [payload] * (e - s), namespace=ns, parents=parents[s:e], token_counts=tokens[s:e], **hint
                )
            hits.append(n)
        elapsed = clock() - start
        after = kv.stats()
    c0, c1 = summed_counters(before), summed_counters(after)
    return LiveResult(
        target=target,
        capacity_blocks=cap,
        block_bytes=block_bytes,
        requests=len(trace),
        blocks=trace.total_blocks,
        hit_blocks=sum(hits),
        tokens=trace.total_tokens,
        hit_tokens=sum(trace.hit_tokens(r, n) for r, n in zip(trace.requests, hits)),
        per_request_hits=tuple(hits),
        elapsed_s=elapsed,
        bytes_moved={name: int(c1.get(c, 0)) - int(c0.get(c, 0)) for name, c in BYTE_COUNTERS.items()},
        events={c: int(c1.get(c, 0)) - int(c0.get(c, 0)) for c in EVENT_COUNTERS},
        node_tiers={n: s.get("tiers", {}) for n, s in per_node(after)[0].items()},
        warnings=tuple(warnings),
    )

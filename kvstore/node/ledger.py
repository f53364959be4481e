"""Why a lookup missed, and what each lookup found: the node's cache-hit ledger.

Owner: the tier manager's event loop (``TierManager.history`` and ``TierManager.ledger``);
nothing here is thread-safe, and nothing here does I/O.  ``kvstore.node.metrics`` reads a
:meth:`Ledger.snapshot` taken on that loop.

**Miss reasons** (the ``reason`` label of ``kvstore_miss_blocks_total``):

==================  ============================================================================
``evicted``         the key was stored here and left the node to make room (dropped from DRAM
                    with no NVMe copy, or evicted from NVMe)
``invalidated``     the key was stored here and was dropped on purpose: ``Delete``,
                    ``Invalidate`` of its namespace, or a namespace epoch bump in a cluster
``corrupt``         the key's payload failed its checksum (on NVMe, in a put over the network,
                    or before a demotion) and was dropped rather than served
``never_stored``    none of the above is remembered: the key was never stored here, or it left
                    so long ago (or before a restart) that :class:`KeyHistory` forgot it
``node_down``       (client side) the owner did not answer; counted by the cluster SDK, never here
``deadline``        (client side) the owner answered after the call's deadline; idem
==================  ============================================================================

Every lookup key ends as exactly one hit (per tier) or one miss (per reason), so
``lookups == hits + misses`` per operation.  In ``match_prefix`` the keys after the first
missing key count as misses with that key's reason (a chunk is useless without its
ancestors, so the first gap is why the rest of the prompt missed).  A key that exists but
cannot be brought into DRAM right now (``NO_SPACE``: the SDK retries it) counts as neither.

**KeyHistory** remembers why keys left, in bounded memory: a set-associative table of
``capacity`` 32-bit entries (4 bytes each; 4 MiB by default), 4 per bucket, each a 16-bit
fingerprint of an xxh3-64 hash of the key, the reason, and a namespace tag.  A bucket keeps
its 4 most recent departures, so old ones age out by themselves.

* False positives (a never-stored key reported as evicted/invalidated/corrupt): at most
  4 / 65535 ≈ 6.1e-5 per lookup of a missing key, reached when its bucket is full.
* Forgetting: after ``n`` later departures a key is still remembered with probability
  P[Binomial(n, 4/capacity) < 4]: ≈ 0.86 at ``n = capacity/2``, ≈ 0.43 at ``n = capacity``.
  A forgotten key's miss is reported as ``never_stored``.

**Namespaces** get their own label value (the 8-byte fingerprint in hex) for the first
``limit`` fingerprints seen, in order; later ones share ``other``, so a client inventing
namespaces cannot blow up the label cardinality.  A miss is attributed to the namespace the
history remembers for its key, else to the one namespace of the request's hits, else to
``unknown`` (a request carries keys, not namespaces: a never-stored key has no known one).
"""

from __future__ import annotations

import collections
from array import array
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import xxhash

from kvstore.block import BlockMeta
from kvstore.vocabulary import (  # the reason labels are shared with the SDK; re-exported for the node
    CLIENT_MISS_REASONS as CLIENT_MISS_REASONS,
)
from kvstore.vocabulary import CORRUPT as CORRUPT
from kvstore.vocabulary import DEADLINE as DEADLINE
from kvstore.vocabulary import EVICTED as EVICTED
from kvstore.vocabulary import INVALIDATED as INVALIDATED
from kvstore.vocabulary import NEVER_STORED as NEVER_STORED
from kvstore.vocabulary import NODE_DOWN as NODE_DOWN
from kvstore.vocabulary import REASONS as REASONS
from kvstore.vocabulary import TierKind

# -- label values (part of the metrics contract: never rename) ---------------------------

OPS = ("get", "match_prefix", "exists")
TIERS = ("hbm", "dram", "nvme", "remote")
TIER_LABEL = {TierKind.HBM: "hbm", TierKind.DRAM: "dram", TierKind.NVME: "nvme"}

OTHER = "other"
UNKNOWN = "unknown"

_CODE = {EVICTED: 1, INVALIDATED: 2, CORRUPT: 3}
_REASON = {v: k for k, v in _CODE.items()}
_WAYS = 4
_TAG_UNKNOWN = 0
_TAG_OTHER = 255


class KeyHistory:
    """Bounded memory of why keys left this node (see the module docstring for its error rates)."""

    def __init__(self, capacity: int = 1 << 20) -> None:
        if capacity < _WAYS or capacity & (capacity - 1):
            raise ValueError(f"key history capacity must be a power of two >= {_WAYS}, got {capacity}")
        self.capacity = capacity
        self._mask = capacity // _WAYS - 1
        self._slots = array("I", bytes(4 * capacity))
        self.recorded = 0

    def _where(self, key: bytes) -> tuple[int, int]:
        h = xxhash.xxh3_64_intdigest(key)
        return (h & self._mask) * _WAYS, (h >> 48) or 1

    def record(self, key: bytes, reason: str, tag: int = _TAG_UNKNOWN) -> None:
        """Remember that ``key`` left for ``reason`` (one of evicted/invalidated/corrupt)."""
        base, fp = self._where(key)
        s = self._slots
        entry = fp << 16 | _CODE[reason] << 8 | tag
        # most recent first: drop this key's older entry (or the bucket's oldest), shift, insert
        stop = base + _WAYS - 1
        for i in range(base, base + _WAYS):
            if s[i] >> 16 == fp or s[i] == 0:
                stop = i
                break
        for i in range(stop, base, -1):
            s[i] = s[i - 1]
        s[base] = entry
        self.recorded += 1

    def lookup(self, key: bytes) -> tuple[str, int] | None:
        """``(reason, namespace tag)`` if ``key`` is remembered, else None."""
        base, fp = self._where(key)
        s = self._slots
        for i in range(base, base + _WAYS):
            e = s[i]
            if e >> 16 == fp:
                return _REASON[(e >> 8) & 0xFF], e & 0xFF
            if e == 0:
                return None
        return None

    def occupied(self) -> int:
        return self.capacity - self._slots.count(0)


class NamespaceLabels:
    """Fingerprint → label value, for at most ``limit`` namespaces (the first seen); the rest are ``other``."""

    def __init__(self, limit: int = 32) -> None:
        if not 0 <= limit < _TAG_OTHER:
            raise ValueError(f"namespace label limit must be in [0, {_TAG_OTHER}), got {limit}")
        self.limit = limit
        self._tags: dict[bytes, int] = {}
        self._labels: list[str] = []

    def tag(self, fingerprint: bytes) -> int:
        t = self._tags.get(fingerprint)
        if t is not None:
            return t
        if len(self._labels) >= self.limit:
            return _TAG_OTHER
        self._labels.append(fingerprint.hex())
        t = self._tags[fingerprint] = len(self._labels)
        return t

    def label(self, tag: int) -> str:
        if tag == _TAG_UNKNOWN:
            return UNKNOWN
        if tag == _TAG_OTHER:
            return OTHER
        return self._labels[tag - 1]


class Ledger:
    """Counts of lookups, hits (per tier, in blocks and tokens) and misses (per reason).

    Keys of the counters are label tuples, in the order the metric names them.
    """

    def __init__(self, namespace_limit: int = 32) -> None:
        self.namespaces = NamespaceLabels(namespace_limit)
        self.requests: collections.Counter[str] = collections.Counter()  # op
        self.lookups: collections.Counter[str] = collections.Counter()  # op -> blocks asked
        self.hits: collections.Counter[tuple[str, str]] = collections.Counter()  # (op, tier) -> blocks
        self.hit_tokens: collections.Counter[tuple[str, str]] = collections.Counter()  # (op, tier) -> tokens
        self.misses: collections.Counter[tuple[str, str]] = collections.Counter()  # (op, reason) -> blocks
        self.ns_hits: collections.Counter[tuple[str, str]] = collections.Counter()  # (namespace, op)
        self.ns_hit_tokens: collections.Counter[tuple[str, str]] = collections.Counter()
        self.ns_misses: collections.Counter[tuple[str, str]] = collections.Counter()
        self.short_copies = 0  # block copies cluster clients' puts could not write (reported to this node)
        self.skipped_saves = 0  # chunks connectors' save policies did not store (reported to this node)
        self.names: dict[str, str] = {}  # namespace label -> readable name, for labels that have one
        self.on_hits: Callable[[list[tuple[str, BlockMeta]]], None] | None = None  # kvstore.cluster.hot's heat

    def tag(self, meta: BlockMeta | None) -> int:
        return self.namespaces.tag(meta.namespace) if meta is not None else _TAG_UNKNOWN

    def record(
        self,
        op: str,
        hits: Iterable[tuple[str, BlockMeta]],
        misses: Sequence[tuple[str, int]] = (),
        *,
        request: bool = True,
        extra_misses: tuple[str, int, int] | None = None,
    ) -> None:
        """One lookup call: its hits as ``(tier label, meta)``, its misses as ``(reason, namespace tag)``.

        ``extra_misses`` = ``(reason, tag, n)`` adds ``n`` more misses at once (the tail of a
        match_prefix after its first gap).
        """
        if request:
            self.requests[op] += 1
        if self.on_hits is not None:
            hits = list(hits)
            self.on_hits(hits)
        # aggregate first (one dict op per hit), then touch the counters once per (tier, namespace)
        groups: dict[tuple[str, bytes], list[int]] = {}
        for tier, meta in hits:
            g = groups.get((tier, meta.namespace))
            if g is None:
                groups[tier, meta.namespace] = [1, meta.token_count]
            else:
                g[0] += 1
                g[1] += meta.token_count
        asked = 0
        request_tag: int | None = None
        mixed = False
        for (tier, fp), (n, tokens) in groups.items():
            t = self.namespaces.tag(fp)
            ns = self.namespaces.label(t)
            self.hits[op, tier] += n
            self.hit_tokens[op, tier] += tokens
            self.ns_hits[ns, op] += n
            self.ns_hit_tokens[ns, op] += tokens
            if request_tag is None:
                request_tag = t
            elif t != request_tag:
                mixed = True
            asked += n
        fallback = _TAG_UNKNOWN if request_tag is None or mixed else request_tag
        if misses:
            mgroups: dict[tuple[str, int], int] = {}
            for reason, tag in misses:
                key = (reason, tag or fallback)
                mgroups[key] = mgroups.get(key, 0) + 1
            for (reason, tag), n in mgroups.items():
                self.misses[op, reason] += n
                self.ns_misses[self.namespaces.label(tag), op] += n
                asked += n
        if extra_misses is not None:
            reason, tag, n = extra_misses
            if n > 0:
                self.misses[op, reason] += n
                self.ns_misses[self.namespaces.label(tag or fallback), op] += n
                asked += n
        self.lookups[op] += asked

    def report(self, op: str, tier: str, blocks: int, tokens: int = 0, namespace: bytes | None = None) -> None:
        """Hits that happened elsewhere (HBM in a GPU agent, a remote node) reported to this node.

        Fed by the ``ReportHits`` RPC (``KVClient.report_hits``).
        """
        if op not in OPS or tier not in TIERS:
            raise ValueError(f"unknown op {op!r} or tier {tier!r}")
        self.hits[op, tier] += blocks
        self.hit_tokens[op, tier] += tokens
        self.lookups[op] += blocks
        if namespace is not None:
            ns = self.namespaces.label(self.namespaces.tag(namespace))
            self.ns_hits[ns, op] += blocks
            self.ns_hit_tokens[ns, op] += tokens

    def report_misses(self, op: str, reason: str, blocks: int, namespace: bytes | None = None) -> None:
        """Misses a cluster client saw and no node could (an owner down or past its deadline),
        reported to this node (``ReportHits`` with ``miss_reason``) so its metrics show them."""
        if op not in OPS or reason not in CLIENT_MISS_REASONS:
            raise ValueError(f"unknown op {op!r} or client miss reason {reason!r}")
        self.misses[op, reason] += blocks
        self.lookups[op] += blocks
        tag = self.namespaces.tag(namespace) if namespace is not None else _TAG_UNKNOWN
        self.ns_misses[self.namespaces.label(tag), op] += blocks

    def name(self, namespace: bytes, name: str) -> None:
        """A readable name for a namespace (sent by the SDK): bounded like the namespace labels."""
        label = self.namespaces.label(self.namespaces.tag(namespace))
        if label not in ("other", "unknown"):
            self.names[label] = name

    def snapshot(self) -> dict[str, Any]:
        return {
            "requests": dict(self.requests),
            "lookups": dict(self.lookups),
            "hits": dict(self.hits),
            "hit_tokens": dict(self.hit_tokens),
            "misses": dict(self.misses),
            "ns_hits": dict(self.ns_hits),
            "ns_hit_tokens": dict(self.ns_hit_tokens),
            "ns_misses": dict(self.ns_misses),
            "short_copies": self.short_copies,
            "skipped_saves": self.skipped_saves,
            "names": dict(self.names),
        }

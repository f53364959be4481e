"""What a cluster agrees on, as plain immutable values: node records, cluster
configuration, namespace epochs and owners, and one consistent snapshot of the first three
(namespace owners are followed by nodes with tenants only: see ``ClusterWatcher``).

Pure: no I/O (``kvstore.cluster.etcd`` reads and writes these; ``membership`` and the
SDK read snapshots).  The etcd key schema, under ``/kvstore/<cluster>/``:

====================================  ==============================================
``nodes/<node_id>``                   JSON :class:`NodeInfo`, attached to the node's lease
``config/<name>``                     JSON value of one :data:`CONFIG` setting
``namespaces/<fingerprint hex>``      JSON ``{"epoch": int, "namespace": {...} | null,
                                      "updated_at": unix seconds}``
``owners/<fingerprint hex>``          JSON :class:`OwnerRecord`: the tenant that owns the
                                      namespace (nodes with tenants; created only if absent)
``hot/<node_id>``                     JSON ``{"keys": {key hex: extra copies}}``: the read-hot
                                      keys a node owns (:mod:`kvstore.cluster.hot`), on the
                                      node's lease
``engines/<engine_id>``               JSON :class:`EngineRecord`: a vLLM engine serving with
                                      the kvstore connector, on the engine's lease (for a
                                      request scheduler: ``ClusterSnapshot.engines``)
====================================  ==============================================

**Epochs.** Bumping a namespace's epoch invalidates its KV everywhere.  The epoch is
folded into the namespace fingerprint the cluster uses (:func:`effective_fingerprint`):
epoch 0 is the plain ``Namespace.fingerprint`` (so a cluster that never invalidates
keys exactly like a single node, and the golden key vectors stay as they are); epoch
``e > 0`` uses ``xxh3_64(b"kvstore-epoch\\0" || fingerprint || e as u64 little-endian)``.
Keys derived from it (``ClusterClient.chunk_keys``) and the namespace recorded in each
block both change with the epoch, so a node that has not yet heard of a bump still never
serves an old block to a client that has; nodes drop blocks of stale effective
fingerprints when they see the bump (and at start-up, for bumps they missed).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping
from typing import Any

import xxhash

from kvstore.cluster import placement as _placement
from kvstore.errors import InvalidArgument

ROOT = "/kvstore"


def prefix(cluster: str) -> str:
    check_cluster_name(cluster)
    return f"{ROOT}/{cluster}/"


def check_cluster_name(cluster: str) -> str:
    if not cluster or "/" in cluster or not cluster.isprintable() or cluster.strip() != cluster:
        raise InvalidArgument(f"cluster name must be non-empty, printable and without '/', got {cluster!r}")
    return cluster


def node_key(cluster: str, node_id: str) -> bytes:
    return f"{prefix(cluster)}nodes/{node_id}".encode()


def engine_key(cluster: str, engine_id: str) -> bytes:
    return f"{prefix(cluster)}engines/{check_engine_id(engine_id)}".encode()


ENGINE_ID = re.compile(r"[A-Za-z0-9\[][A-Za-z0-9._:\[\]-]{0,252}")
"""An engine id: a node id's characters (letters, digits, ``.``, ``_``, ``-``) plus ``:`` and
the brackets of an IPv6 address, so the default id, ``host:port`` of the engine's URL, is one."""


def check_engine_id(engine_id: object) -> str:
    if not isinstance(engine_id, str) or not ENGINE_ID.fullmatch(engine_id):
        raise InvalidArgument(
            "an engine id is letters, digits, '.', '_', '-', ':' or IPv6 brackets (starting with a letter, "
            f"a digit or '['), at most 253 characters; got {engine_id!r}"
        )
    return engine_id


def config_key(cluster: str, name: str) -> bytes:
    return f"{prefix(cluster)}config/{name}".encode()


def namespace_key(cluster: str, fingerprint: bytes) -> bytes:
    return f"{prefix(cluster)}namespaces/{bytes(fingerprint).hex()}".encode()


def owners_prefix(cluster: str) -> bytes:
    return f"{prefix(cluster)}owners/".encode()


def hot_key(cluster: str, node_id: str) -> bytes:
    return f"{prefix(cluster)}hot/{node_id}".encode()


def owner_key(cluster: str, fingerprint: bytes) -> bytes:
    fp = bytes(fingerprint)
    if len(fp) != 8:
        raise InvalidArgument(f"a namespace fingerprint is 8 bytes, got {len(fp)}")
    return owners_prefix(cluster) + fp.hex().encode()


# -- epochs ---------------------------------------------------------------------------
def effective_fingerprint(fingerprint: bytes, epoch: int) -> bytes:
    """The fingerprint a cluster uses for a namespace at ``epoch`` (see the module doc)."""
    fp = bytes(fingerprint)
    if len(fp) != 8:
        raise InvalidArgument(f"a namespace fingerprint is 8 bytes, got {len(fp)}")
    if epoch < 0:
        raise InvalidArgument(f"epoch must be >= 0, got {epoch}")
    if epoch == 0:
        return fp
    return xxhash.xxh3_64_digest(b"kvstore-epoch\0" + fp + epoch.to_bytes(8, "little"))


# -- configuration ----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True)
class Setting:
    kind: type
    default: Any
    minimum: float
    doc: str
    maximum: float = math.inf
    choices: tuple[str, ...] = ()  # for str settings: the values allowed


CONFIG: dict[str, Setting] = {
    "replication": Setting(int, 1, 1, "copies of each block: the first R owners of the placement own it"),
    "handoff_window_s": Setting(
        float,
        300.0,
        0,
        "for this long after the membership changes, a miss on a new owner is retried on the previous owners (hand-off read)",
    ),
    "placement": Setting(
        str,
        _placement.DEFAULT_SCHEME,
        0,
        "how keys map to owners: bounded-v1 (O(1) table, weighted) or rendezvous-v1 "
        "(the original scheme, for fleets with clients older than bounded-v1; see kvstore.cluster.placement)",
        choices=_placement.SCHEMES,
    ),
    "chunk_group": Setting(
        int,
        1,
        1,
        "consecutive chunks of one prefix that share owners in keys from ClusterClient.chunk_keys "
        "(1: every chunk placed alone); changing it re-keys every prefix, like an invalidation",
        maximum=4096,
    ),
    "hot_extras": Setting(
        int,
        0,
        0,
        "the most extra copies a read-hot key gets beyond its R owners, on more nodes, while it stays hot "
        "(0: hot replicas off; see kvstore.cluster.hot)",
        maximum=1024,
    ),
    "hot_reads_per_s": Setting(
        float,
        100.0,
        0.01,
        "reads per second below which a key never counts as hot (the floor of the per-copy load target)",
    ),
    "hot_window_s": Setting(
        float,
        2.0,
        0.1,
        "how often a node weighs its keys' read heat (and how long an idle key keeps its extra copies, at least)",
        maximum=600.0,
    ),
}


def parse_setting(name: str, raw: object) -> Any:
    """Validate one setting (from the CLI or etcd); raises InvalidArgument naming it."""
    s = CONFIG.get(name)
    if s is None:
        raise InvalidArgument(f"unknown cluster setting {name!r}; known: {', '.join(sorted(CONFIG))}")
    if s.kind is str:
        text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
        if isinstance(text, str) and text.startswith('"'):
            try:
                text = json.loads(text)
            except ValueError:
                pass
        if text not in s.choices:
            raise InvalidArgument(f"cluster setting {name} must be one of {', '.join(s.choices)}; got {raw!r}")
        return text
    try:
        value = s.kind(json.loads(raw) if isinstance(raw, (str, bytes)) else raw)
        if s.kind is int and isinstance(raw, (str, bytes)) and not float(json.loads(raw)).is_integer():
            raise ValueError
    except (ValueError, TypeError):
        raise InvalidArgument(f"cluster setting {name} must be {s.kind.__name__}, got {raw!r}") from None
    if isinstance(value, float) and not math.isfinite(value) or value < s.minimum:
        raise InvalidArgument(f"cluster setting {name} must be >= {s.minimum}, got {value}")
    if value > s.maximum:
        raise InvalidArgument(f"cluster setting {name} must be <= {s.maximum:g}, got {value}")
    return value


@dataclasses.dataclass(frozen=True, slots=True)
class ClusterConfig:
    replication: int = 1
    handoff_window_s: float = 300.0
    placement: str = _placement.DEFAULT_SCHEME
    chunk_group: int = 1
    hot_extras: int = 0
    hot_reads_per_s: float = 100.0
    hot_window_s: float = 2.0

    @classmethod
    def from_raw(cls, raw: Mapping[str, bytes]) -> ClusterConfig:
        """Known settings from etcd values; bad or unknown ones keep their defaults (logged by the caller)."""
        kw: dict[str, Any] = {}
        for name, value in raw.items():
            try:
                kw[name] = parse_setting(name, value)
            except InvalidArgument:
                continue
        return cls(**kw)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# -- nodes --------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True)
class NodeInfo:
    """A node's membership record: how to reach it and what it holds."""

    node_id: str
    grpc: str  # host:port of the gRPC TCP listener
    data: str = ""  # host:port of the data channel
    unix: str = ""  # unix:///path of the local socket (same machine only)
    host: str = ""  # hostname of the machine
    zone: str = ""
    version: str = ""
    dram_bytes: int = 0
    nvme_bytes: int = 0
    pid: int = 0
    data_dir: str = ""
    started_at: float = 0.0  # unix seconds when this incarnation registered
    metrics: str = ""  # http://host:port/metrics when the node serves Prometheus metrics
    # share of keys relative to other nodes (_placement.DEFAULT_WEIGHT = one ordinary node's);
    # added with bounded-v1 placement: records without it (older nodes) count the default
    weight: int = _placement.DEFAULT_WEIGHT

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> NodeInfo:
        """A record from etcd; ValueError if it does not parse (the watcher then ignores it, logged)."""
        d = json.loads(raw)
        if not isinstance(d, dict):
            raise ValueError(f"a node record is a JSON object, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        try:
            info = cls(**{k: v for k, v in d.items() if k in names})  # newer nodes may add fields
        except TypeError as e:  # a required field missing
            raise ValueError(f"not a node record: {e}") from None
        if not isinstance(info.node_id, str) or not info.node_id or not isinstance(info.grpc, str):
            raise ValueError("a node record needs a node_id and a grpc address")
        try:
            _placement.check_weight(info.weight, f"weight of node {info.node_id!r}")
        except InvalidArgument as e:
            raise ValueError(str(e)) from None
        return info


# -- engines --------------------------------------------------------------------------------
ENGINE_ROLES = ("both", "prefill", "decode")


@dataclasses.dataclass(frozen=True, slots=True)
class EngineRecord:
    """A vLLM engine serving with the kvstore connector (``engines/<engine_id>``, on its lease):
    where clients reach it and what a request scheduler needs to key and route a prompt.

    Keying: ``fingerprint`` is the engine's rank-0 base namespace (no LoRA adapter, no
    ``cache_salt``); :func:`kvstore.keys.chunk_keys` seeds its chain with it, so a prompt's
    chunk keys are the xxh3-128 chain over ``chunk_tokens``-token chunks from these 8 bytes.
    Invalid values raise :class:`InvalidArgument` (a ``ValueError``)."""

    engine_id: str
    url: str  # the engine's OpenAI base URL as clients reach it: http://10.0.0.5:8000
    role: str  # "both" | "prefill" (vLLM kv_producer) | "decode" (kv_consumer)
    fingerprint: str  # hex of the rank-0 base namespace's 8-byte fingerprint
    chunk_tokens: int
    block_size: int  # vLLM's
    models: tuple[str, ...] = ()  # served model names
    node: str = ""  # the kvstore target the engine saves and loads through
    kv_events: str = ""  # vLLM's KV-events ZMQ publisher, reachable from elsewhere ("": none)
    kv_events_replay: str = ""  # its replay endpoint ("": none)
    tp_size: int = 1
    bytes_per_token: int = 0  # KV bytes per token over all ranks
    host: str = ""  # hostname of the machine
    pid: int = 0
    started_at: float = 0.0  # unix seconds when this incarnation registered

    def __post_init__(self) -> None:
        check_engine_id(self.engine_id)
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "models":
                if not isinstance(v, (tuple, list)) or not all(isinstance(m, str) and m for m in v):
                    raise InvalidArgument(f"engine {self.engine_id!r}: models must be a list of names, got {v!r}")
                object.__setattr__(self, "models", tuple(v))
            elif f.type == "float":
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                    raise InvalidArgument(f"engine {self.engine_id!r}: {f.name} must be a number, got {v!r}")
                object.__setattr__(self, f.name, float(v))
            elif f.type == "int":
                if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                    raise InvalidArgument(f"engine {self.engine_id!r}: {f.name} must be an integer >= 0, got {v!r}")
            elif not isinstance(v, str):
                raise InvalidArgument(f"engine {self.engine_id!r}: {f.name} must be a string, got {v!r}")
        if not self.url.startswith(("http://", "https://")):
            raise InvalidArgument(f"engine {self.engine_id!r}: url must be http(s)://HOST:PORT, got {self.url!r}")
        if self.role not in ENGINE_ROLES:
            raise InvalidArgument(f"engine {self.engine_id!r}: role must be one of {ENGINE_ROLES}, got {self.role!r}")
        try:
            fp_ok = len(bytes.fromhex(self.fingerprint)) == 8
        except ValueError:
            fp_ok = False
        if not fp_ok:
            raise InvalidArgument(
                f"engine {self.engine_id!r}: fingerprint must be 16 hex digits, got {self.fingerprint!r}"
            )
        if self.block_size <= 0 or self.chunk_tokens <= 0 or self.chunk_tokens % self.block_size:
            raise InvalidArgument(
                f"engine {self.engine_id!r}: chunk_tokens ({self.chunk_tokens}) must be a positive multiple "
                f"of block_size ({self.block_size})"
            )
        if self.tp_size < 1:
            raise InvalidArgument(f"engine {self.engine_id!r}: tp_size must be >= 1, got {self.tp_size}")

    @property
    def namespace_fingerprint(self) -> bytes:
        """``fingerprint`` as the 8 bytes a chunk-key chain starts from."""
        return bytes.fromhex(self.fingerprint)

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> EngineRecord:
        """A record from etcd; ValueError if it does not parse or is not valid (the watcher then
        ignores it, logged).  Unknown fields are dropped: newer engines may add some."""
        d = json.loads(raw)
        if not isinstance(d, dict):
            raise ValueError(f"an engine record is a JSON object, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        try:
            return cls(**{k: v for k, v in d.items() if k in names})
        except TypeError as e:  # a required field missing
            raise ValueError(f"not an engine record: {e}") from None


@dataclasses.dataclass(frozen=True, slots=True)
class NamespaceRecord:
    fingerprint: bytes
    epoch: int = 0
    namespace: dict[str, Any] | None = None
    updated_at: float = 0.0

    @property
    def effective(self) -> bytes:
        return effective_fingerprint(self.fingerprint, self.epoch)

    def to_json(self) -> bytes:
        return json.dumps(
            {"epoch": self.epoch, "namespace": self.namespace, "updated_at": self.updated_at}, sort_keys=True
        ).encode()

    @classmethod
    def from_json(cls, fingerprint: bytes, raw: bytes) -> NamespaceRecord:
        d = json.loads(raw)
        return cls(bytes(fingerprint), int(d.get("epoch", 0)), d.get("namespace"), float(d.get("updated_at", 0.0)))


@dataclasses.dataclass(frozen=True, slots=True)
class OwnerRecord:
    """Which tenant owns a namespace, cluster-wide (``owners/<fingerprint hex>``).

    Written once by the node through which the tenant first wrote the namespace (a
    create-if-absent transaction: the first claim etcd applies wins), changed only by an
    operator (``kvstore cluster release``).  ``revision`` is the record's etcd mod revision
    (not stored in the value)."""

    fingerprint: bytes
    tenant: str
    node: str = ""  # the node that made the claim
    claimed_at: float = 0.0
    revision: int = 0

    def to_json(self) -> bytes:
        return json.dumps(
            {"tenant": self.tenant, "node": self.node, "claimed_at": self.claimed_at}, sort_keys=True
        ).encode()

    @classmethod
    def from_json(cls, fingerprint: bytes, raw: bytes, revision: int = 0) -> OwnerRecord:
        d = json.loads(raw)
        tenant = d.get("tenant") if isinstance(d, dict) else None
        if not isinstance(tenant, str) or not tenant:
            raise ValueError(f"owner record without a tenant: {raw[:80]!r}")
        return cls(bytes(fingerprint), tenant, str(d.get("node", "")), float(d.get("claimed_at", 0.0)), revision)

    def to_dict(self) -> dict[str, Any]:
        return {"tenant": self.tenant, "node": self.node, "claimed_at": self.claimed_at, "revision": self.revision}


@dataclasses.dataclass(frozen=True, slots=True)
class ClusterSnapshot:
    """Everything under ``/kvstore/<cluster>/`` at one etcd revision.  Immutable."""

    cluster: str
    revision: int = 0
    nodes: Mapping[str, NodeInfo] = dataclasses.field(default_factory=dict)
    config: ClusterConfig = ClusterConfig()
    namespaces: Mapping[bytes, NamespaceRecord] = dataclasses.field(default_factory=dict)
    # node id -> (revision its record was written at, its lease): one value per registration.
    # A node that registers again (a new lease after its old one expired, a restart under the
    # same id) gets a new one even when its NodeInfo is unchanged; a lease keep-alive does not.
    registrations: Mapping[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    connected: bool = False  # False: etcd unreachable, this is the last view we had
    loaded: bool = False  # False: never reached etcd (the view is empty, not known-empty)
    # read-hot keys -> extra copies (the most any live publisher asked for): kvstore.cluster.hot
    hot: Mapping[bytes, int] = dataclasses.field(default_factory=dict)
    # live vLLM engines with the kvstore connector (engine id -> record), for a request scheduler
    engines: Mapping[str, EngineRecord] = dataclasses.field(default_factory=dict)

    def members(self) -> dict[str, int]:
        """Live nodes and their placement weights (what placement is a function of)."""
        return {n: i.weight for n, i in self.nodes.items()}

    def epoch(self, fingerprint: bytes) -> int:
        rec = self.namespaces.get(bytes(fingerprint))
        return rec.epoch if rec is not None else 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "cluster": self.cluster,
            "revision": self.revision,
            "connected": self.connected,
            "config": self.config.to_dict(),
            "nodes": {n: dataclasses.asdict(i) for n, i in sorted(self.nodes.items())},
            "namespaces": {
                fp.hex(): {
                    "epoch": r.epoch,
                    "effective_fingerprint": r.effective.hex(),
                    "namespace": r.namespace,
                    "updated_at": r.updated_at,
                }
                for fp, r in sorted(self.namespaces.items())
            },
            "engines": {e: dataclasses.asdict(r) for e, r in sorted(self.engines.items())},
        }


def parse_endpoints(spec: str) -> list[tuple[str, int]]:
    """``HOST:PORT[,HOST:PORT...]`` (an ``http://`` prefix is tolerated)."""
    out = []
    for part in (spec or "").split(","):
        part = part.strip().removeprefix("http://")
        if not part:
            continue
        host, sep, port = part.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise InvalidArgument(f"etcd endpoint must be HOST:PORT, got {part!r} (in {spec!r})")
        out.append((host.strip("[]"), int(port)))
    if not out:
        raise InvalidArgument(f"no etcd endpoint in {spec!r}; give HOST:PORT[,HOST:PORT]")
    return out


def parse_target(target: str) -> tuple[str, str]:
    """``etcd://HOST:PORT[,HOST:PORT]/CLUSTER`` → (endpoints, cluster)."""
    if not target.startswith("etcd://"):
        raise InvalidArgument(f"a cluster target is etcd://HOST:PORT[,HOST:PORT]/CLUSTER, got {target!r}")
    rest = target[len("etcd://") :]
    eps, sep, cluster = rest.partition("/")
    if not sep or not cluster:
        raise InvalidArgument(f"a cluster target names its cluster: etcd://HOST:PORT/CLUSTER, got {target!r}")
    parse_endpoints(eps)
    return eps, check_cluster_name(cluster.rstrip("/"))

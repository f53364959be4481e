"""Node configuration: one typed, frozen schema, loaded once and passed down.

Precedence, lowest first: defaults → config file (TOML) → ``KVSTORE_*`` environment →
command-line flags.  Unknown keys anywhere are errors that name the key and list the
valid ones.  Runtime state never lives here.

Renamed keys (``DEPRECATED_KEYS``): the old spelling still works in the file, the environment
and the overrides for one release, with a ``FutureWarning`` naming the new one; giving both
spellings in one layer is an error.  The old attribute names stay readable as properties.
"""

from __future__ import annotations

import os
import re
import socket
import tomllib
import warnings
from collections.abc import Callable, Mapping
from fractions import Fraction
from pathlib import Path
from typing import Any

import xxhash
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kvstore.errors import InvalidArgument

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
ENV_PREFIX = "KVSTORE_"
# KVSTORE_* variables that belong to the SDK and CLI, not to the node's schema (the
# KVSTORE_TLS_* ones: what `kvstore dashboard` trusts and presents when it scrapes https /metrics;
# KVSTORE_FAILPOINTS: fault tests' failure points, tiers/failpoints.py).
CLIENT_ENV = {
    "KVSTORE_TARGET",
    "KVSTORE_TLS_CA_FILE",
    "KVSTORE_TLS_SERVER_NAME",
    "KVSTORE_TLS_CLIENT_CERT_FILE",
    "KVSTORE_TLS_CLIENT_KEY_FILE",
    "KVSTORE_FAILPOINTS",
}
# old key -> new key: `lease_ttl_s` was the read lease beside `etcd_lease_ttl_s`, the membership one
DEPRECATED_KEYS = {
    "lease_ttl_s": "read_lease_ttl_s",
    "etcd_lease_ttl_s": "membership_ttl_s",
}


def parse_size(value: object) -> int:
    """``4GiB``, ``512MiB``, ``1.5G``, ``65536`` → bytes."""
    if isinstance(value, bool):
        raise InvalidArgument(f"not a size: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise InvalidArgument(f"size must be non-negative, got {value}")
        return value
    m = _SIZE.match(str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise InvalidArgument(f"not a size: {value!r} (examples: 4GiB, 512MiB, 1G, 65536)")
    n = Fraction(m.group(1)) * _UNITS[m.group(2).lower()]  # exact: no float rounding of big sizes
    if n.denominator != 1:
        raise InvalidArgument(f"not a whole number of bytes: {value!r}")
    return int(n)


def default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "kvstore"


TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class TenantConfig(BaseModel):
    """One tenant's credentials: each token (inline or in a file) authenticates as it.  Several
    tokens let a tenant rotate one without downtime.  And its limits on what eviction cannot
    reclaim (its unfinished writes and its pins) and on what its blocks may occupy per tier
    (TOML only; ``NAME=TOKEN_FILE`` has none).  Every limit counts space as allocated."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    token: tuple[str, ...] = Field((), repr=False, description="Bearer token(s) of the tenant: a string or a list.")
    token_file: tuple[str, ...] = Field(
        (), description="File(s) each holding one bearer token of the tenant: a path or a list."
    )
    max_reserved_bytes: int | None = Field(
        None,
        description="Most DRAM the tenant's unfinished writes (reservations) may hold at once, counted as allocated: every block takes whole 64 KiB units, a 0-byte one too (accepts 512MiB-style strings); unset: only the DRAM size limits it.",
    )
    max_pinned_bytes: int | None = Field(
        None,
        description="Most DRAM the blocks the tenant keeps pinned may take at once, in whole 64 KiB units per block (accepts 512MiB-style strings); unset: only the DRAM size limits it.",
    )
    max_dram_bytes: int | None = Field(
        None,
        description="Capacity quota: most DRAM the tenant's blocks (those of its namespaces) and unfinished writes may occupy, in whole 64 KiB units per block (accepts 512MiB-style strings). Over it, its own blocks are evicted first; blocks of tenants within their quotas are the last any eviction takes. Unset: no quota (its blocks are evicted like the admin's, before quota-holders').",
    )
    max_nvme_bytes: int | None = Field(
        None,
        description="Capacity quota: most NVMe space the tenant's blocks may occupy, as records take it (header page plus the payload in 4 KiB pages; accepts 512MiB-style strings). Over it, its own blocks leave NVMe first, and a block it cannot make room for is not demoted. Unset: no quota.",
    )

    @field_validator("max_reserved_bytes", "max_pinned_bytes", "max_dram_bytes", "max_nvme_bytes", mode="before")
    @classmethod
    def _limit_size(cls, v: object) -> object:
        if v is None:
            return v
        try:
            return parse_size(v)
        except InvalidArgument as e:
            raise ValueError(str(e)) from None

    @field_validator("token", "token_file", mode="before")
    @classmethod
    def _one_or_many(cls, v: object) -> object:
        return (v,) if isinstance(v, str) else v

    @field_validator("token", "token_file")
    @classmethod
    def _non_empty(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if any(not t.strip() for t in v):
            raise ValueError("an empty token or token file name")
        return tuple(t.strip() for t in v)  # as for token files: surrounding whitespace is not part of it

    @model_validator(mode="after")
    def _some(self) -> TenantConfig:
        if not self.token and not self.token_file:
            raise ValueError("a tenant needs token or token_file")
        return self

    def resolve(self, name: str) -> list[str]:
        """The tenant's tokens, files read now (surrounding whitespace is not part of a token)."""
        out = list(self.token)
        for path in self.token_file:
            try:
                text = Path(path).read_text().strip()
            except OSError as e:
                raise InvalidArgument(f"cannot read token_file {path} of tenant {name!r}: {e}") from e
            if not text:
                raise InvalidArgument(f"token_file {path} of tenant {name!r} is empty")
            out.append(text)
        return out


def _tenant_pairs(v: object) -> object:
    """``NAME=TOKEN_FILE[,NAME=TOKEN_FILE]`` (env) or a list of ``NAME=TOKEN_FILE`` (flags)
    → the table form.  Tokens are never given inline there: they would show in ``ps``."""
    if isinstance(v, str):
        v = [p for p in (x.strip() for x in v.split(",")) if p]
    if not isinstance(v, (list, tuple)):
        return v
    table: dict[str, dict[str, list[str]]] = {}
    for item in v:
        name, sep, path = str(item).partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"expected NAME=TOKEN_FILE, got {item!r}")
        table.setdefault(name.strip(), {"token_file": []})["token_file"].append(path.strip())
    return table


class NodeConfig(BaseModel):
    """Everything a ``kvstore serve`` process is told at start-up."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    node_id: str = Field(default_factory=socket.gethostname, description="Name of this node in its cluster.")
    listen: str = Field("127.0.0.1:50151", description="HOST:PORT of the gRPC TCP listener (port 0: any free port).")
    data_listen: str = Field("", description="HOST:PORT of the TCP data channel; empty: listen host, any free port.")
    socket: str = Field("", description="Unix socket path for local clients; empty: <data_dir>/kvstore.sock.")
    data_dir: Path = Field(
        default_factory=default_data_dir,
        description="NVMe tier directory (segments + lmdb index); locked while in use.",
    )
    dram: int = Field(1 << 30, description="DRAM arena size in bytes (accepts 4GiB-style strings).")
    nvme: int = Field(4 << 30, description="NVMe tier size in bytes; 0 disables the tier.")
    arena_path: str = Field(
        "",
        description="Shared-memory file of the DRAM arena; empty: /dev/shm/kvstore-<node_id>-<hash>.arena "
        "(<hash>: of the data directory, so nodes of one id in different directories never share one).",
    )
    eviction_policy: str = Field(
        "prefix-reuse", description="DRAM and NVMe eviction policy (see tiers.policy.POLICIES)."
    )
    write_through: bool = Field(False, description="Persist every commit to NVMe at once instead of on eviction.")
    dram_clean_ahead: float = Field(
        0.25,
        ge=0.0,
        le=1.0,
        description="Share of DRAM at the eviction end kept free or already on NVMe by a background writer, "
        "so a put that needs room deletes clean blocks instead of waiting on the disk (0: off).",
    )
    direct_io: bool | None = Field(
        None, description="O_DIRECT on NVMe segment files; unset: use it where the filesystem allows."
    )
    reservation_ttl_s: float = Field(30.0, gt=0, description="Unfinished writes are reclaimed after this many seconds.")
    read_lease_ttl_s: float = Field(30.0, gt=0, description="Read leases expire after this many seconds.")
    max_pin_ttl_s: float = Field(
        3600.0,
        gt=0,
        allow_inf_nan=False,
        description="Longest a pin lasts, in seconds: a pin asking for more (or for ever, ttl inf) is cut to this, for tenants and the admin alike; re-pin to keep a block longer.",
    )
    session_idle_ttl_s: float = Field(
        1800.0,
        gt=0,
        allow_inf_nan=False,
        description="Session hints: a session that sent no lookup, read or put for this many seconds is closed as if its client had called close_session (its blocks no open session holds become the first eviction candidates).",
    )
    max_sessions: int = Field(
        1 << 16,
        gt=0,
        description="Session hints: most sessions open at once; past it the least recently active is closed early.",
    )
    max_session_blocks: int = Field(
        1 << 22,
        gt=0,
        description="Session hints: most block keys the node remembers for open sessions plus closed sessions' blocks (about 100 bytes each); past it the least recently active session is closed early and the oldest closed-session blocks are forgotten.",
    )
    max_block_bytes: int = Field(256 << 20, gt=0, description="Largest block payload accepted.")
    max_batch: int = Field(4096, gt=0, description="Most keys in one request.")
    data_min_rate: int = Field(
        8 << 20,
        gt=0,
        description="Bytes per second (accepts 8MiB-style strings) a data-channel transfer must average: one is cut, and its leases or reservations end, at the later of its id's own deadline and size / data_min_rate after it started (plus 2 s). Lower it for clients on slow links.",
    )
    data_max_connections: int | None = Field(
        None,
        gt=0,
        description="Most data-channel connections open at once (more are closed at accept); unset: half the open-file limit, at most 4096.",
    )
    data_max_connections_per_peer: int | None = Field(
        None,
        gt=0,
        description="Most data-channel connections open at once from one peer address; unset: a quarter of data_max_connections.",
    )
    token: str = Field("", description="Bearer token required on every RPC and data-channel transfer; empty: no auth.")
    token_file: str = Field("", description="File holding the bearer token (overrides `token`).")
    tenants: dict[str, TenantConfig] = Field(
        default_factory=dict,
        description="Tenant name -> its bearer token(s) (TOML: [tenants.NAME] token/token_file; env and flags: NAME=TOKEN_FILE[,...]). A tenant owns the namespaces it writes first; `token` stays the admin's, allowed everything.",
    )
    drain_timeout_s: float = Field(
        10.0,
        gt=0,
        description="On SIGTERM, calls and data-channel transfers already running get this long to finish (new ones are refused at once); whatever still runs then is cancelled, its reservations aborted (nothing half-written becomes visible) and its leases dropped.",
    )
    flush_on_shutdown_s: float = Field(
        30.0, ge=0, description="On SIGTERM, after the drain, spend up to this long demoting dirty DRAM blocks to NVMe."
    )
    prefault: bool = Field(
        True, description="Touch every arena page at start-up so copies never pay first-touch costs."
    )
    watch_history: int = Field(
        65536,
        ge=1,
        le=1 << 24,
        description="Holdings watch (WatchHoldings): how many recent changes the node keeps so a client that reconnects gets only what it missed; one further behind gets a fresh snapshot (resync). About 100 bytes each.",
    )
    metrics_port: int | None = Field(None, description="Port of the Prometheus /metrics endpoint; unset: none.")
    metrics_tls: bool | None = Field(
        None,
        description="Serve /metrics over HTTPS with the TCP listeners' certificate (tls_cert_file; client certificates required under tls_client_ca_file). Unset: whenever the node serves TLS; false: plain HTTP even then (the admin token, if any, then crosses the network in clear); true: TLS is required.",
    )
    advertise_host: str = Field(
        "",
        description="Host that clients and peers should dial (published in etcd and the READY line); empty: the listen host, or this machine's name when listening on a wildcard address.",
    )
    arena_mode: str = Field(
        "0600",
        description="Permission bits of the arena file and Unix socket, octal: 0660 lets an engine container of the same group (another uid) use them.",
    )

    @field_validator("arena_mode")
    @classmethod
    def _mode(cls, v: str) -> str:
        if not re.fullmatch(r"0?[0-7]{3}", v):
            raise ValueError(f"expected octal permission bits like 0600 or 0660, got {v!r}")
        return v

    etcd: str = Field(
        "", description="etcd endpoints HOST:PORT[,HOST:PORT] of the cluster to join; empty: a standalone node."
    )
    cluster: str = Field(
        "default", description="Cluster name: membership, config and namespaces live under /kvstore/<cluster>/ in etcd."
    )
    zone: str = Field("", description="Failure zone of this node, published in its membership record.")
    membership_ttl_s: float = Field(
        10.0,
        ge=1,
        description="TTL of the etcd lease that holds this node's membership record (whole seconds, rounded up).",
    )
    placement_weight: int = Field(
        100,
        ge=1,
        le=10_000,
        description="This node's share of keys in its cluster relative to others (100: an ordinary node; 200: twice the keys), published in its membership record; bounded-v1 placement only.",
    )
    tls_cert_file: str = Field(
        "",
        description="PEM certificate (chain) of the TCP listeners (gRPC and data channel); with tls_key_file, they serve TLS 1.2+ only. The Unix socket stays plaintext.",
    )
    tls_key_file: str = Field("", description="PEM private key (unencrypted) of tls_cert_file.")
    tls_client_ca_file: str = Field(
        "",
        description="PEM CA certificate(s): when set, TCP clients must present a certificate it signed (mutual TLS).",
    )

    @model_validator(mode="after")
    def _tls_pair(self) -> NodeConfig:
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            given, missing = (
                ("tls_cert_file", "tls_key_file") if self.tls_cert_file else ("tls_key_file", "tls_cert_file")
            )
            raise ValueError(
                f"{given} is set but {missing} is not: TLS needs both the certificate and its private key (or neither)"
            )
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise ValueError(
                "tls_client_ca_file (mutual TLS) needs tls_cert_file and tls_key_file: the node must serve TLS to verify clients"
            )
        if self.metrics_tls and not self.tls_cert_file:
            raise ValueError(
                "metrics_tls = true needs tls_cert_file and tls_key_file: /metrics serves the TCP listeners' certificate"
            )
        return self

    def serves_metrics_tls(self) -> bool:
        """Whether /metrics is HTTPS: ``metrics_tls``, or by default whenever the node serves TLS."""
        return bool(self.tls_cert_file) and self.metrics_tls is not False

    @field_validator("dram", "nvme", "max_block_bytes", "data_min_rate", mode="before")
    @classmethod
    def _size(cls, v: object) -> int:
        return parse_size(v)

    @field_validator("node_id")
    @classmethod
    def _node_id(cls, v: str) -> str:
        # it names files (the arena under /dev/shm): no separators, no surprises
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", v):
            raise ValueError(
                f"node_id must be letters, digits, '.', '_' or '-' (starting with a letter or digit), got {v!r}"
            )
        return v

    @field_validator("listen", "data_listen")
    @classmethod
    def _hostport(cls, v: str) -> str:
        if v and (":" not in v or not v.rsplit(":", 1)[1].isdigit()):
            raise ValueError(f"expected HOST:PORT, got {v!r}")
        return v

    # -- derived -----------------------------------------------------------------------
    @property
    def lease_ttl_s(self) -> float:
        """Deprecated name of ``read_lease_ttl_s`` (read leases, not membership)."""
        return self.read_lease_ttl_s

    @property
    def etcd_lease_ttl_s(self) -> float:
        """Deprecated name of ``membership_ttl_s`` (the etcd lease of the membership record)."""
        return self.membership_ttl_s

    def socket_path(self) -> Path:
        return Path(self.socket) if self.socket else Path(self.data_dir) / "kvstore.sock"

    def arena_file(self) -> Path:
        if self.arena_path:
            return Path(self.arena_path)
        # unique per data directory (which is locked), so two nodes never share an arena
        tag = xxhash.xxh3_64_hexdigest(str(Path(self.data_dir).resolve()).encode())[:8]
        return Path("/dev/shm") / f"kvstore-{self.node_id}-{tag}.arena"

    def own_arena_files(self) -> list[Path]:
        """Every default-named arena file of this ``node_id``, whatever its data directory (a
        node of the same name that died, e.g. under ``kvstore up``'s throwaway directories)."""
        name = re.compile(rf"kvstore-{re.escape(self.node_id)}-[0-9a-f]{{8}}\.arena")
        return sorted(p for p in Path("/dev/shm").glob(f"kvstore-{self.node_id}-*.arena") if name.fullmatch(p.name))

    @field_validator("tenants", mode="before")
    @classmethod
    def _tenants_in(cls, v: object) -> object:
        return _tenant_pairs(v)

    @field_validator("tenants")
    @classmethod
    def _tenant_names(cls, v: dict[str, TenantConfig]) -> dict[str, TenantConfig]:
        for name in v:
            if not TENANT_NAME.fullmatch(name):
                raise ValueError(
                    f"tenant names are 1-64 letters, digits, '.', '_' or '-' (starting with a letter or digit), got {name!r}"
                )
        # inline tokens are checked here; tokens in files when the node starts (tenant_tokens)
        _token_table(self_token="", tenants={n: list(t.token) for n, t in v.items()})
        return v

    @model_validator(mode="after")
    def _tenants_and_admin(self) -> NodeConfig:
        if self.tenants and self.token:
            _token_table(self_token=self.token, tenants={n: list(t.token) for n, t in self.tenants.items()})
        if self.tenants and self.metrics_port is not None and not (self.token or self.token_file):
            # /metrics is node-wide (every namespace's counters): no tenant token may read it
            raise ValueError("metrics_port with tenants needs the admin token (token or token_file) to guard /metrics")
        return self

    def tenant_tokens(self) -> dict[str, str]:
        """Every tenant token → its tenant, token files read now.  A token given to two
        tenants, or to a tenant and the admin (``token``), is an error."""
        return _token_table(self_token=self.auth_token(), tenants={n: t.resolve(n) for n, t in self.tenants.items()})

    def auth_token(self) -> str:
        if self.token_file:
            try:
                text = Path(self.token_file).read_text().strip()
            except OSError as e:
                raise InvalidArgument(f"cannot read token_file {self.token_file}: {e}") from e
            if not text:  # "" means "no auth": an empty file must not switch authentication off
                raise InvalidArgument(
                    f"token_file {self.token_file} is empty: write the bearer token into it, or drop token_file to run without auth"
                )
            return text
        return self.token


def _token_table(*, self_token: str, tenants: Mapping[str, list[str]]) -> dict[str, str]:
    by_token: dict[str, str] = {}
    for name, tokens in tenants.items():
        for tok in tokens:
            other = by_token.get(tok)
            if other is not None and other != name:
                raise InvalidArgument(f"tenants {other!r} and {name!r} share a token: each token must name one tenant")
            if self_token and tok == self_token:
                raise InvalidArgument(f"tenant {name!r} has the admin token (`token`/`token_file`): give it its own")
            by_token[tok] = name
    return by_token


def _env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    fields = NodeConfig.model_fields
    out: dict[str, Any] = {}
    for name, value in environ.items():
        if not name.startswith(ENV_PREFIX) or name in CLIENT_ENV:
            continue
        key = name[len(ENV_PREFIX) :].lower()
        if key not in fields and key not in DEPRECATED_KEYS:
            raise InvalidArgument(
                f"unknown environment variable {name}; known: {', '.join(ENV_PREFIX + f.upper() for f in fields)}"
            )
        out[key] = value
    return _renamed(out, "environment variable", lambda k: ENV_PREFIX + k.upper())


def _renamed(layer: dict[str, Any], what: str, spell: Callable[[str], str] = str) -> dict[str, Any]:
    """``layer`` with its deprecated keys under their new names, warning for each one used."""
    for old, new in DEPRECATED_KEYS.items():
        if old not in layer:
            continue
        if new in layer:
            raise InvalidArgument(f"{what} {spell(old)} and {spell(new)} are one setting: give only {spell(new)}")
        warnings.warn(f"{what} {spell(old)} is deprecated, use {spell(new)}", FutureWarning, stacklevel=3)
        layer[new] = layer.pop(old)
    return layer


def load_config(
    file: str | os.PathLike[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> NodeConfig:
    """Build the config from a TOML file, the environment and flag overrides (in that order)."""
    merged: dict[str, Any] = {}
    if file:
        try:
            with open(file, "rb") as f:
                data = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise InvalidArgument(f"cannot read config file {file}: {e}") from e
        node = data.pop("node", None)
        tenants = data.pop("tenants", None)  # [tenants.NAME] sits beside [node]
        if data and node is None:
            node, data = data, {}
        if data:
            raise InvalidArgument(f"unknown section(s) in {file}: {sorted(data)}; put settings under [node]")
        merged.update(_renamed(dict(node or {}), f"{file}: config key"))
        if tenants is not None:
            if "tenants" in merged:
                raise InvalidArgument(
                    f"{file} gives tenants twice: use [tenants.NAME] or [node.tenants.NAME], not both"
                )
            merged["tenants"] = tenants
    merged.update(_env_overrides(os.environ if environ is None else environ))
    merged.update(_renamed({k: v for k, v in (overrides or {}).items() if v is not None}, "setting"))
    unknown = sorted(set(merged) - set(NodeConfig.model_fields))
    if unknown:
        raise InvalidArgument(f"unknown config key(s) {unknown}; known: {sorted(NodeConfig.model_fields)}")
    try:
        return NodeConfig(**merged)
    except ValidationError as e:
        raise InvalidArgument(f"invalid configuration: {'; '.join(_describe(err) for err in e.errors())}") from None


def _describe(err: Any) -> str:
    """One pydantic error as ``field: what is wrong (got value)``, without pydantic's boilerplate."""
    where = ".".join(str(p) for p in err["loc"]) or "config"
    if err["type"] == "value_error":  # our own validators' messages already quote the value
        return f"{where}: {err['msg'].removeprefix('Value error, ')}"
    return f"{where}: {err['msg']} (got {err.get('input')!r})"

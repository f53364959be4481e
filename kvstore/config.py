"""Node configuration: one typed, frozen schema, loaded once and passed down.

Precedence, lowest first: defaults → config file (TOML) → ``KVSTORE_*`` environment →
command-line flags.  Unknown keys anywhere are errors that name the key and list the
valid ones.  Runtime state never lives here.
"""

from __future__ import annotations

import os
import re
import socket
import tomllib
from fractions import Fraction
from pathlib import Path
from typing import Any, Mapping

import xxhash
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kvstore.errors import InvalidArgument

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
ENV_PREFIX = "KVSTORE_"
# KVSTORE_* variables that belong to the SDK and CLI, not to the node's schema.
CLIENT_ENV = {"KVSTORE_TARGET"}


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


class NodeConfig(BaseModel):
    """Everything a ``kvstore serve`` process is told at start-up."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    node_id: str = Field(default_factory=socket.gethostname, description="Name of this node in its cluster.")
    listen: str = Field("127.0.0.1:50151", description="HOST:PORT of the gRPC TCP listener (port 0: any free port).")
    data_listen: str = Field("", description="HOST:PORT of the TCP data channel; empty: listen host, any free port.")
    socket: str = Field("", description="Unix socket path for local clients; empty: <data_dir>/kvstore.sock.")
    data_dir: Path = Field(default_factory=default_data_dir, description="NVMe tier directory (segments + lmdb index); locked while in use.")
    dram: int = Field(1 << 30, description="DRAM arena size in bytes (accepts 4GiB-style strings).")
    nvme: int = Field(4 << 30, description="NVMe tier size in bytes; 0 disables the tier.")
    arena_path: str = Field("", description="Shared-memory file of the DRAM arena; empty: /dev/shm/kvstore-<node_id>.arena.")
    eviction_policy: str = Field("prefix-reuse", description="DRAM and NVMe eviction policy (see kvstore.policy.POLICIES).")
    write_through: bool = Field(False, description="Persist every commit to NVMe at once instead of on eviction.")
    direct_io: bool | None = Field(None, description="O_DIRECT on NVMe segment files; unset: use it where the filesystem allows.")
    reservation_ttl_s: float = Field(30.0, gt=0, description="Unfinished writes are reclaimed after this many seconds.")
    lease_ttl_s: float = Field(30.0, gt=0, description="Read leases expire after this many seconds.")
    max_block_bytes: int = Field(256 << 20, gt=0, description="Largest block payload accepted.")
    max_batch: int = Field(4096, gt=0, description="Most keys in one request.")
    token: str = Field("", description="Bearer token required on every RPC and data-channel transfer; empty: no auth.")
    token_file: str = Field("", description="File holding the bearer token (overrides `token`).")
    flush_on_shutdown_s: float = Field(30.0, ge=0, description="On SIGTERM, spend up to this long demoting dirty DRAM blocks to NVMe.")
    prefault: bool = Field(True, description="Touch every arena page at start-up so copies never pay first-touch costs.")
    metrics_port: int | None = Field(None, description="Port of the Prometheus /metrics endpoint; unset: none.")
    advertise_host: str = Field("", description="Host that clients and peers should dial (published in etcd and the READY line); empty: the listen host, or this machine's name when listening on a wildcard address.")
    arena_mode: str = Field("0600", description="Permission bits of the arena file and Unix socket, octal: 0660 lets an engine container of the same group (another uid) use them.")

    @field_validator("arena_mode")
    @classmethod
    def _mode(cls, v: str) -> str:
        if not re.fullmatch(r"0?[0-7]{3}", v):
            raise ValueError(f"expected octal permission bits like 0600 or 0660, got {v!r}")
        return v
    etcd: str = Field("", description="etcd endpoints HOST:PORT[,HOST:PORT] of the cluster to join; empty: a standalone node.")
    cluster: str = Field("default", description="Cluster name: membership, config and namespaces live under /kvstore/<cluster>/ in etcd.")
    zone: str = Field("", description="Failure zone of this node, published in its membership record.")
    etcd_lease_ttl_s: float = Field(10.0, ge=1, description="TTL of the etcd lease that holds this node's membership record (whole seconds, rounded up).")

    @field_validator("dram", "nvme", "max_block_bytes", mode="before")
    @classmethod
    def _size(cls, v: object) -> int:
        return parse_size(v)

    @field_validator("node_id")
    @classmethod
    def _node_id(cls, v: str) -> str:
        # it names files (the arena under /dev/shm): no separators, no surprises
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", v):
            raise ValueError(f"node_id must be letters, digits, '.', '_' or '-' (starting with a letter or digit), got {v!r}")
        return v

    @field_validator("listen", "data_listen")
    @classmethod
    def _hostport(cls, v: str) -> str:
        if v and (":" not in v or not v.rsplit(":", 1)[1].isdigit()):
            raise ValueError(f"expected HOST:PORT, got {v!r}")
        return v

    # -- derived -----------------------------------------------------------------------
    def socket_path(self) -> Path:
        return Path(self.socket) if self.socket else Path(self.data_dir) / "kvstore.sock"

    def arena_file(self) -> Path:
        if self.arena_path:
            return Path(self.arena_path)
        # unique per data directory (which is locked), so two nodes never share an arena
        tag = xxhash.xxh3_64_hexdigest(str(Path(self.data_dir).resolve()).encode())[:8]
        return Path("/dev/shm") / f"kvstore-{self.node_id}-{tag}.arena"

    def auth_token(self) -> str:
        if self.token_file:
            try:
                return Path(self.token_file).read_text().strip()
            except OSError as e:
                raise InvalidArgument(f"cannot read token_file {self.token_file}: {e}") from e
        return self.token


def _env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    fields = NodeConfig.model_fields
    out: dict[str, Any] = {}
    for name, value in environ.items():
        if not name.startswith(ENV_PREFIX) or name in CLIENT_ENV:
            continue
        key = name[len(ENV_PREFIX) :].lower()
        if key not in fields:
            raise InvalidArgument(f"unknown environment variable {name}; known: {', '.join(ENV_PREFIX + f.upper() for f in fields)}")
        out[key] = value
    return out


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
        if data and node is None:
            node, data = data, {}
        if data:
            raise InvalidArgument(f"unknown section(s) in {file}: {sorted(data)}; put settings under [node]")
        merged.update(node or {})
    merged.update(_env_overrides(os.environ if environ is None else environ))
    merged.update({k: v for k, v in (overrides or {}).items() if v is not None})
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

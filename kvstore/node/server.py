"""``kvstore serve``: the one wiring function of a node process.

Builds, in order: the data-directory lock, the TLS material (``tls_cert_file``: read
and checked before anything else is built), the tenants' tokens and namespace
ownership table (with ``tenants``), the DRAM arena and tier, the NVMe tier,
the tier manager, the metrics registry, the gRPC service (Unix socket, plaintext; TCP,
with TLS when configured), the data channel (TLS-wrapped likewise), the reaper and (with ``metrics_port``) the ``/metrics`` endpoint
(HTTPS with the same context on a TLS node, unless ``metrics_tls = false``); tears them down in reverse on SIGTERM/SIGINT: stop accepting, drain in-flight
calls, demote dirty DRAM blocks to NVMe (bounded by ``flush_on_shutdown_s``), flush
and close the index, exit 0.

The drain (``drain_timeout_s``, one deadline for both): gRPC calls already running, and
data-channel transfers already negotiated, may finish; new calls are refused at once.
At the deadline gRPC cancels the calls still running (a cancelled put stream aborts its
reservations, a cancelled get stream releases its lease), the data channel closes its
connections (an unfinished put is aborted), and every reservation and lease left, such as
a local writer's that never committed, is dropped.  Only committed blocks are ever demoted
or indexed, so nothing half-written becomes visible, before or after a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import math
import os
import shutil
import signal
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from kvstore.errors import DataDirLocked, InvalidArgument
from kvstore.node.config import NodeConfig
from kvstore.node.datachannel import ConnectionCaps, DataChannelServer, raise_open_files_limit
from kvstore.node.holds import TenantLimits
from kvstore.node.loopwatch import LoopWatch
from kvstore.node.manager import TierManager
from kvstore.node.metrics import MetricsServer, NodeMetrics, manager_snapshot
from kvstore.node.service import AuthInterceptor, DecodeGuard, KVStoreService
from kvstore.node.sessions import Sessions, hinted
from kvstore.node.tenants import Callers, OwnerAuthority, Ownership
from kvstore.node.transfers import Transfers
from kvstore.node.watch import HoldingsLog
from kvstore.tls import ServerTLS
from protos.kvstore.v1 import kvstore_pb2 as pb
from protos.kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from tiers.arena import Arena
from tiers.dram import DRAMTier
from tiers.policy import make_policy

if TYPE_CHECKING:
    from tiers.nvme import NVMeTier

log = logging.getLogger("kvstore.node.server")

GRPC_OPTIONS = [
    ("grpc.so_reuseport", 0),  # a second node on the same port must fail, not share it
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
]


def human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def lock_data_dir(data_dir: Path) -> int:
    """Hold an exclusive lock on ``data_dir`` for the life of the process."""
    data_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(data_dir / "node.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DataDirLocked(f"data directory {data_dir} is in use by another running kvstore node") from None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    return fd


def check_port_free(listen: str, flag: str) -> None:
    """Refuse a TCP listener whose port is taken before anything is created (the data directory,
    the arena), and before gRPC's core logs its own bind error: a failed start leaves nothing."""
    host, _, port = listen.rpartition(":")
    if not port.isdigit() or int(port) == 0:
        return
    host = host.strip("[]") or "0.0.0.0"
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except OSError:
        return  # an unresolvable host fails later, with gRPC's own message
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: TIME_WAIT does not count as taken
        try:
            s.bind(addr)
        except OSError as e:
            raise InvalidArgument(
                f"cannot listen on {listen}: {e.strerror or e}; pick another {flag} HOST:PORT (port 0: any free port)"
            ) from None


class ClusterAgent(Protocol):
    """A node's membership of its cluster, once it serves: registered by ``start`` (which
    returns what it adds to the node's endpoints), deregistered by ``stop`` on a clean stop
    or by ``leave`` when whatever is left is released."""

    async def start(self) -> dict[str, Any]: ...

    async def stop(self) -> None:
        """Deregister (the node drains after it: clients route elsewhere meanwhile)."""
        ...

    async def leave(self) -> None:
        """Deregister within a bound; never raise, never hang (etcd may be gone)."""
        ...


class ClusterLink(Protocol):
    """How a node with ``etcd`` set joins its cluster, handed to it by the composition root
    (``kvstore serve``: :class:`kvstore.cluster.node.ClusterLink`), so that this package never
    names the cluster package that builds on it."""

    def owner_authority(self, cfg: NodeConfig) -> OwnerAuthority:
        """Where the node's namespace claims are decided (its ``owners.lmdb`` caches it)."""
        ...

    def agent(
        self, cfg: NodeConfig, endpoints: dict[str, Any], manager: TierManager, owners: Ownership | None
    ) -> ClusterAgent:
        """The node's registration, not started."""
        ...


class Node:
    """One running node.  Owns every component it builds; ``stop`` releases them.

    ``cluster``: the link to its cluster, needed when ``config.etcd`` is set."""

    def __init__(self, config: NodeConfig, *, cluster: ClusterLink | None = None) -> None:
        if config.etcd and cluster is None:
            raise InvalidArgument("this node has etcd set but was given no cluster link (`kvstore serve` gives it one)")
        self.cfg = config
        self._link = cluster if config.etcd else None
        self.endpoints: dict[str, Any] = {}
        self._stopped = asyncio.Event()
        self._lock_fd: int | None = None
        self.arena: Arena | None = None
        self._nvme: NVMeTier | None = None
        self.manager: TierManager | None = None
        self.data: DataChannelServer | None = None
        self.server: grpc.aio.Server | None = None
        self.cluster: ClusterAgent | None = None  # registered once serving, when cfg.etcd is set
        self._loopwatch: LoopWatch | None = None  # started with the reaper (kvstore.node.loopwatch)
        self.metrics: NodeMetrics | None = None
        self.metrics_server: MetricsServer | None = None
        self.owners: Ownership | None = None  # with tenants: which tenant owns which namespace
        self.tls: ServerTLS | None = None  # read once at start; the TCP listeners' credentials
        self._loop: asyncio.AbstractEventLoop | None = None
        self.holdings = HoldingsLog(config.watch_history)  # this process's incarnation of the holdings watch

    async def start(self) -> dict[str, Any]:
        check_port_free(self.cfg.listen, "--listen")
        if self.cfg.data_listen:
            check_port_free(self.cfg.data_listen, "--data-listen")
        data_dir = Path(self.cfg.data_dir)
        created = not data_dir.exists()
        self._lock_fd = lock_data_dir(data_dir)
        try:
            return await self._start()
        except BaseException:
            await self._release()
            if created:  # made by this start, which failed: nothing in it is anyone's data
                shutil.rmtree(data_dir, ignore_errors=True)
            raise

    async def _release(self) -> None:
        """Close whatever is still open, each part on its own: after a start that failed
        half-way or at the end of every stop, no arena file, socket, listener or lock is left.
        Idempotent: each part is forgotten once closed."""
        if self.cluster is not None:
            cluster, self.cluster = self.cluster, None
            await _quietly("leave the cluster", cluster.leave())
        if self.metrics_server is not None:
            _quietly_call("close /metrics", self.metrics_server.close)
            self.metrics_server = None
        if self.server is not None:
            server, self.server = self.server, None
            await _quietly("stop the gRPC server", server.stop(None))
            with contextlib.suppress(OSError):
                self.cfg.socket_path().unlink()
        if self.data is not None:
            _quietly_call("close the data channel", self.data.close)
            self.data = None
        if self.owners is not None:
            _quietly_call("close the owners table", self.owners.close)
            self.owners = None
        if self.manager is not None:  # closes the NVMe tier (the index) and the DRAM tier (unlinks the arena)
            _quietly_call("close the tiers", self.manager.close)
            self.manager = None
        elif self._nvme is not None:
            _quietly_call("close the NVMe tier", self._nvme.close)
        self._nvme = None
        if self.arena is not None:  # again, whatever happened above: the arena file never outlives the node
            _quietly_call("unlink the DRAM arena", self.arena.close)
            self.arena = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    async def _start(self) -> dict[str, Any]:
        """Build the node in dependency order, each step one concern; ``_release`` undoes any prefix."""
        cfg = self.cfg = _fitted(self.cfg)
        # everything read from files (TLS material, token files) is read and checked before anything is built
        if cfg.tls_cert_file:
            self.tls = ServerTLS.load(cfg.tls_cert_file, cfg.tls_key_file, cfg.tls_client_ca_file)
        token, tenant_tokens = cfg.auth_token(), cfg.tenant_tokens()
        callers = Callers(token, tenant_tokens) if token or tenant_tokens else None
        if tenant_tokens:
            self.owners = self._build_ownership()
        soft, hard = raise_open_files_limit()
        log.debug("open-file limit: %d (hard %d)", soft, hard)
        self.arena = self._build_arena()
        self.manager = self._build_tiers()
        # the holdings watch (kvstore/node/watch.py) hears every tier change from the start
        self.holdings.attach(self.manager.dram, self._nvme)
        loop = self._loop = asyncio.get_running_loop()
        from kvstore import __version__

        self.metrics = NodeMetrics(cfg.node_id, __version__, self._metrics_snapshot)
        # negotiated by the service, moved by the data channel
        self.transfers = Transfers(self.manager, self.metrics)
        self.data = self._build_data_channel(loop)
        self.service = KVStoreService(
            self.manager,
            cfg,
            arena_path=str(self.arena.path),
            arena_size=self.arena.size,
            data_port=self.data.address[1],
            transfers=self.transfers,
            metrics=self.metrics,
            callers=callers,
            owners=self.owners,
            holdings=self.holdings,
        )
        self.server, self.health = _grpc_server(self.service, callers)
        sock = self._listen_unix(self.server)
        bound = self._listen_tcp(self.server)
        self.metrics_server = self._build_metrics_server(token)
        await self._serve(loop)
        self.endpoints = self._endpoints(bound, sock)
        if self._link is not None:  # join the cluster only once we serve: a registered node must answer
            self.cluster = self._link.agent(cfg, self.endpoints, self.manager, self.owners)
            self.endpoints.update(await self.cluster.start())
        return self.endpoints

    # -- the steps of _start ----------------------------------------------------------------
    def _build_ownership(self) -> Ownership:
        """With tenants: the table of which tenant owns which namespace, kept beside the NVMe tier
        (it lives as long as the blocks it guards); in a cluster a cache of etcd's."""
        cfg = self.cfg
        authority = None
        if self._link is not None:  # in a cluster, etcd decides who owns a namespace; owners.lmdb caches it
            authority = self._link.owner_authority(cfg)
        return Ownership(Path(cfg.data_dir) / "owners.lmdb", authority=authority)

    def _build_arena(self) -> Arena:
        """The DRAM arena, after removing this node's arena files that no running node holds."""
        cfg = self.cfg
        for stale in Arena.reclaim_stale(cfg.own_arena_files()):
            log.warning(
                "removed %s: an arena of node %s that no running node holds (left by a node that died)",
                stale,
                cfg.node_id,
            )
        return Arena.create(cfg.arena_file(), cfg.dram, prefault=cfg.prefault, mode=int(cfg.arena_mode, 8))

    def _build_tiers(self) -> TierManager:
        """The DRAM tier, the NVMe tier (``nvme > 0``) and the tier manager over them."""
        cfg = self.cfg
        assert self.arena is not None
        # session hints (kvstore/node/sessions.py): both tiers' policies put closed sessions' blocks first
        sessions = Sessions(
            idle_ttl=cfg.session_idle_ttl_s, max_sessions=cfg.max_sessions, max_keys=cfg.max_session_blocks
        )
        dram = DRAMTier(self.arena, policy=hinted(make_policy(cfg.eviction_policy), sessions))
        nvme = self._nvme = self._build_nvme(sessions) if cfg.nvme > 0 else None
        return TierManager(
            dram,
            nvme,
            write_through=cfg.write_through,
            reservation_ttl=cfg.reservation_ttl_s,
            lease_ttl=cfg.read_lease_ttl_s,
            max_pin_ttl=cfg.max_pin_ttl_s,
            tenant_limits={
                name: TenantLimits(t.max_reserved_bytes, t.max_pinned_bytes, t.max_dram_bytes, t.max_nvme_bytes)
                for name, t in cfg.tenants.items()
            },
            # blocks kept across a restart keep their owner
            owner_of=self.owners.owner if self.owners is not None else None,
            sessions=sessions,
            clean_ahead=cfg.dram_clean_ahead,
        )

    def _build_nvme(self, sessions: Sessions) -> NVMeTier:
        from tiers.nvme import NVMeTier

        cfg = self.cfg
        directory = Path(cfg.data_dir) / "nvme"
        nvme = NVMeTier(
            directory, cfg.nvme, policy=hinted(make_policy(cfg.eviction_policy), sessions), direct_io=cfg.direct_io
        )
        if self.owners is not None and self.owners.created and len(nvme):
            # blocks kept from before, but no record of who owns them (tenants just enabled,
            # or owners.lmdb lost): every tenant can read them until one writes their namespace
            log.warning(
                "%s is new but the NVMe tier holds %d blocks: their namespaces have no recorded owner, so "
                "every tenant can read them (restore owners.lmdb if it was lost, or remove %s to drop them)",
                self.owners.path,
                len(nvme),
                directory,
            )
        return nvme

    def _build_data_channel(self, loop: asyncio.AbstractEventLoop) -> DataChannelServer:
        """The data channel's listener (``data_listen``; else any free port on the gRPC host)."""
        cfg = self.cfg
        host = cfg.listen.rsplit(":", 1)[0]
        dhost, dport = cfg.data_listen.rsplit(":", 1) if cfg.data_listen else (host, "0")
        try:
            return DataChannelServer(
                dhost.strip("[]"),
                int(dport),
                transfers=self.transfers,
                loop=loop,
                ssl_context=self.tls.context if self.tls is not None else None,
                caps=ConnectionCaps(cfg.data_max_connections, cfg.data_max_connections_per_peer),
                min_rate=cfg.data_min_rate,
            )
        except OSError as e:
            raise InvalidArgument(
                f"cannot listen for the data channel on {dhost}:{dport}: {e}; pass --data-listen"
            ) from e

    def _listen_unix(self, server: grpc.aio.Server) -> Path:
        """gRPC on the node's Unix socket (plaintext: local clients, who map the arena)."""
        sock = self.cfg.socket_path()
        if len(str(sock)) > 100:
            raise InvalidArgument(f"unix socket path {sock} is too long (max ~100 chars); pass --socket")
        sock.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            sock.unlink()  # a stale socket of a dead node: we hold the data-dir lock, so it is ours
        try:
            server.add_insecure_port(f"unix:{sock}")
        except RuntimeError as e:  # grpc raises instead of returning 0 when it cannot bind
            raise InvalidArgument(f"cannot listen on unix socket {sock}: {e}") from None
        return sock

    def _listen_tcp(self, server: grpc.aio.Server) -> int:
        """gRPC on ``listen`` (with TLS when configured); the port bound."""
        cfg = self.cfg
        host, port = cfg.listen.rsplit(":", 1)
        try:
            if self.tls is not None:
                bound = server.add_secure_port(f"{host}:{port}", self.tls.credentials)
            else:
                bound = server.add_insecure_port(f"{host}:{port}")
        except RuntimeError:
            bound = 0
        if bound == 0:
            raise InvalidArgument(
                f"cannot listen on {cfg.listen} (in use?); pick another --listen HOST:PORT (port 0: any free port)"
            )
        os.chmod(cfg.socket_path(), int(cfg.arena_mode, 8))
        return bound

    def _build_metrics_server(self, token: str) -> MetricsServer | None:
        """``/metrics`` on ``metrics_port`` (HTTPS with the node's TLS context unless ``metrics_tls = false``)."""
        cfg = self.cfg
        if cfg.metrics_port is None:
            return None
        assert self.metrics is not None
        if not 0 <= cfg.metrics_port <= 65535:
            raise InvalidArgument(f"metrics_port={cfg.metrics_port} is not a TCP port (0: any free port)")
        metrics_tls = self.tls.context if self.tls is not None and cfg.serves_metrics_tls() else None
        if self.tls is not None and metrics_tls is None and token:
            log.warning(
                "metrics_tls = false on a TLS node: /metrics is plain HTTP and every scrape sends the "
                "admin token in clear; drop metrics_tls to serve it over HTTPS"
            )
        host = cfg.listen.rsplit(":", 1)[0]
        try:
            return MetricsServer(host.strip("[]"), cfg.metrics_port, self.metrics, token=token, ssl_context=metrics_tls)
        except OSError as e:
            raise InvalidArgument(
                f"cannot serve metrics on {host}:{cfg.metrics_port}: {e}; pick another --metrics-port"
            ) from e

    async def _serve(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start every listener, report SERVING, start the reaper and the loop watchdog."""
        assert self.server is not None and self.data is not None and self.manager is not None
        await self.server.start()
        self.data.start()
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self.health.set("kvstore.v1.KVStore", health_pb2.HealthCheckResponse.SERVING)
        self._reaper = loop.create_task(self._reap_forever())
        self._loopwatch = LoopWatch(self.manager.counters)  # says when and where the loop was blocked
        self._loopwatch.start(loop)
        if self.metrics_server is not None:
            self.metrics_server.start()

    def _endpoints(self, bound: int, sock: Path) -> dict[str, Any]:
        """What the node tells the world (the READY line, the cluster's membership record)."""
        cfg = self.cfg
        assert self.data is not None and self.arena is not None
        host = cfg.listen.rsplit(":", 1)[0]
        public = cfg.advertise_host or (socket.getfqdn() if host.strip("[]") in ("0.0.0.0", "::", "") else host)
        return {
            "node_id": cfg.node_id,
            "grpc": f"{public}:{bound}",
            "unix": f"unix://{sock}",
            "data": f"{public}:{self.data.address[1]}",
            "tls": "mutual" if self.tls is not None and self.tls.mutual else "on" if self.tls is not None else "off",
            # the scheme tells the dashboard (via the membership record) to scrape over TLS
            "metrics": (
                f"{'https' if self.metrics_server.tls else 'http'}://{public}:{self.metrics_server.address[1]}/metrics"
                if self.metrics_server
                else None
            ),
            "arena": str(self.arena.path),
            "dram_bytes": cfg.dram,
            "nvme_bytes": cfg.nvme,
            "data_dir": str(Path(cfg.data_dir)),
            "pid": os.getpid(),
        }

    def _metrics_snapshot(self) -> dict[str, Any]:
        """Called by the metrics HTTP thread: the manager's state, read on the loop that owns it."""
        assert self._loop is not None and self.manager is not None
        manager, transfers = self.manager, self.transfers

        async def snap() -> dict[str, Any]:
            return manager_snapshot(manager, {"pending_transfers": transfers.pending})

        return asyncio.run_coroutine_threadsafe(snap(), self._loop).result(timeout=5.0)

    async def _reap_forever(self) -> None:
        manager, transfers = self.manager, self.transfers
        assert manager is not None
        while True:
            await asyncio.sleep(0.5)
            try:
                manager.reap()
                transfers.expire()
            except Exception:  # never let the reaper die silently
                log.exception("reaper round failed")

    def request_stop(self) -> None:
        self._stopped.set()

    async def wait(self) -> None:
        await self._stopped.wait()

    async def stop(self) -> None:
        """Drain, demote dirty blocks, then release everything (always, even if a step fails)."""
        try:
            await self._drain_and_flush()
        finally:
            await self._release()

    async def _drain_and_flush(self) -> None:
        server, data, manager = self.server, self.data, self.manager
        assert server is not None and data is not None and manager is not None, "stop() of a node that never started"
        if self.cluster is not None:  # deregister first, so clients route elsewhere while we drain
            cluster, self.cluster = self.cluster, None
            await cluster.stop()
        await self.health.enter_graceful_shutdown()
        self.holdings.close()  # holdings watches end now: the drain does not wait for them
        if self.metrics_server is not None:
            self.metrics_server.close()
            self.metrics_server = None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.drain_timeout_s
        await server.stop(grace=self.cfg.drain_timeout_s)  # refuses new calls; cancels what still runs at the deadline
        while (self.transfers.pending or data.busy) and loop.time() < deadline:
            await asyncio.sleep(0.05)  # data-channel transfers negotiated before the stop: same deadline
        data.close()
        self._reaper.cancel()
        left = manager.reap(now=math.inf)  # what the drain left: unfinished writes aborted, leases dropped
        if left["reservations"] or left["leases"]:
            log.info(
                "drain over: aborted %d unfinished writes, dropped %d read leases", left["reservations"], left["leases"]
            )
        flushed = await manager.flush(self.cfg.flush_on_shutdown_s)
        if flushed:
            log.info("demoted %d dirty blocks to NVMe before exit", flushed)
        if self._loopwatch is not None:
            await self._loopwatch.stop()


def _fitted(cfg: NodeConfig) -> NodeConfig:
    """``cfg`` checked for what a node cannot start with, and with ``max_block_bytes`` lowered to
    the DRAM arena's size if it was larger (a block must fit in DRAM)."""
    if cfg.dram < (1 << 20):
        raise InvalidArgument(f"dram={cfg.dram} bytes is too small; give at least 1MiB (e.g. --dram 1GiB)")
    if cfg.max_block_bytes > cfg.dram:
        # say so, since errors will name the lowered limit
        log.info(
            "max_block_bytes lowered from %d to %d, the DRAM arena's size (a block must fit in DRAM; a larger "
            "--dram allows larger blocks)",
            cfg.max_block_bytes,
            cfg.dram,
        )
        cfg = cfg.model_copy(update={"max_block_bytes": cfg.dram})
    return cfg


def _grpc_server(service: KVStoreService, callers: Callers | None) -> tuple[grpc.aio.Server, health_aio.HealthServicer]:
    """The gRPC server with the KVStore service, health checking and reflection (no port yet)."""
    interceptors = [AuthInterceptor(callers), DecodeGuard()] if callers is not None else [DecodeGuard()]
    server = grpc.aio.server(options=GRPC_OPTIONS, interceptors=interceptors)
    pb_grpc.add_KVStoreServicer_to_server(service, server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (
            pb.DESCRIPTOR.services_by_name["KVStore"].full_name,
            reflection.SERVICE_NAME,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        ),
        server,
    )
    return server, health


async def _quietly(what: str, aw: Any) -> None:
    try:
        await aw
    except Exception:
        log.exception("stopping: could not %s", what)


def _quietly_call(what: str, fn: Any) -> None:
    try:
        fn()
    except Exception:
        log.exception("stopping: could not %s", what)


def say(text: str, out: Any) -> None:
    """Print ``text`` to ``out``; a stream whose reader is gone never raises.

    The dead stream's descriptor is pointed at ``/dev/null`` (see :func:`quiet_dead_stdio`), so
    later prints, log records and the interpreter's last flush succeed too."""
    try:
        print(text, file=out, flush=True)
    except (OSError, ValueError):
        _to_devnull(out)


def quiet_dead_stdio() -> None:
    """Point ``sys.stdout``/``sys.stderr`` at ``/dev/null`` where their reader is gone.

    Python exits with status 120 when its last flush of a standard stream fails, and keeps
    the bytes a failed write left in the buffer: a node whose pipe closed would exit non-zero
    after a clean stop."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            _to_devnull(stream)


def _to_devnull(stream: Any) -> None:
    try:
        fd = stream.fileno()
    except (OSError, ValueError, AttributeError):
        return  # not a file (a test's StringIO): nothing to redirect
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)
    with contextlib.suppress(OSError, ValueError):
        stream.flush()  # what the failed write left in the buffer now goes to /dev/null


def dump_tasks(out: Any = None) -> None:
    """Write every asyncio task of the running loop with the chain of awaits it waits in
    (``SIGUSR1`` on a serving node): what a node that does not stop, or a call that does
    not end, waits on.  ``out``: a text stream (default: ``sys.stderr`` at the call, the log)."""
    out = sys.stderr if out is None else out
    tasks = asyncio.all_tasks()
    print(f"kvstore: {len(tasks)} asyncio tasks (SIGUSR1)", file=out)
    for t in sorted(tasks, key=lambda t: t.get_name()):
        print(f"task {t.get_name()}:", file=out)
        aw: Any = t.get_coro()
        for _ in range(32):  # an await chain is short; a cycle must not hang the dump
            if aw is None:
                break
            f = getattr(aw, "cr_frame", None) or getattr(aw, "gi_frame", None) or getattr(aw, "ag_frame", None)
            where = f"{f.f_code.co_filename}:{f.f_lineno} in {f.f_code.co_name}" if f is not None else repr(aw)[:200]
            print(f"    {where}", file=out)
            aw = getattr(aw, "cr_await", None) or getattr(aw, "gi_yieldfrom", None) or getattr(aw, "ag_await", None)
    with contextlib.suppress(OSError, ValueError):
        out.flush()


async def serve(config: NodeConfig, *, cluster: ClusterLink | None = None, out: Any = sys.stdout) -> int:
    """Run a node until SIGTERM or SIGINT (``cluster``: see :class:`Node`)."""
    node = Node(config, cluster=cluster)
    ep = await node.start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, node.request_stop)
    loop.add_signal_handler(signal.SIGUSR1, dump_tasks)
    tls = {"on": " (TLS)", "mutual": " (TLS, client certificates required)"}.get(ep["tls"], "")
    remote_kw = (
        ", tls_ca_file=CA"
        if ep["tls"] == "on"
        else ", tls_ca_file=CA, tls_cert_file=CERT, tls_key_file=KEY"
        if ep["tls"] == "mutual"
        else ""
    )
    say(
        f"kvstore node {ep['node_id']} serving\n"
        f"  grpc (tcp)   {ep['grpc']}{tls}\n"
        f"  grpc (unix)  {ep['unix']}\n"
        f"  data channel {ep['data']}{tls}\n"
        f"  DRAM arena   {ep['arena']} ({human(ep['dram_bytes'])})\n"
        f"  NVMe tier    {ep['data_dir']}/nvme ({human(ep['nvme_bytes'])})\n"
        + (f"  metrics      {ep['metrics']}\n" if ep.get("metrics") else "")
        + f"  SDK: KVClient({ep['unix']!r}) locally, KVClient({ep['grpc']!r}{remote_kw}) remotely\n"
        + (
            f"  cluster      {ep['cluster']} via etcd {ep['etcd']} (registered: {ep['registered']}); "
            f"SDK: KVClient('etcd://{ep['etcd']}/{ep['cluster']}')\n"
            if ep.get("cluster")
            else ""
        )
        + f"READY {json.dumps(ep)}",
        out,
    )
    try:
        await node.wait()
        say("kvstore: stopping (draining calls, flushing the index)", out)
    finally:
        await node.stop()
    say("kvstore: stopped", out)
    quiet_dead_stdio()
    return 0

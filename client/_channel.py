"""What the blocking and the asyncio drivers share: gRPC channel settings, the bearer token,
the gRPC → kvstore error mapping with TLS hints, calls started without waiting, and the
(deprecated) routing of ``etcd://`` targets given to the single-node client classes.

Owns no state of its own beyond :data:`ETCD_ROUTES` (filled once, at import of
:mod:`client._connect`).
"""

from __future__ import annotations

import collections
import os
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import grpc

from kvstore.errors import InvalidArgument, KVStoreError, Unavailable
from kvstore.tls import ClientTLS, explain
from kvstore.wire import AGENT_METADATA_KEY, BLOCKS_METADATA_KEY, error_from_rpc

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    # reconnect to a restarted node within seconds, not gRPC's default of up to 120 s
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
    # a keepalive time makes gRPC set TCP_USER_TIMEOUT (= the keepalive timeout) on its
    # sockets: a connection whose packets went unacknowledged for 5 s (a network partition)
    # is closed and reopened, instead of waiting out TCP's backed-off retransmissions for
    # about as long again as the partition lasted once it heals (every client in the process
    # shares that connection).  Pings stay rare: only during calls, and further apart than
    # the 5 min gRPC servers allow by default.  Regression: tests/fault/test_partition_netns.py
    ("grpc.keepalive_time_ms", 360_000),
    ("grpc.keepalive_timeout_ms", 5_000),
]
RETRIES = 2
# How long a client that was never closed waits, at garbage collection or interpreter exit,
# for the calls it started without waiting (releases) before cancelling them.  A cancelled
# release costs nothing lasting: the node drops the lease at its TTL.
FINALIZE_WAIT_S = 2.0


_IDLE_S = 2.0  # how long an Inflight worker waits for another call before it ends


class Inflight:
    """Calls a client starts without waiting (``Release``), made one after another by a worker
    thread, so they are finished before the client, or the interpreter, goes.

    Not gRPC futures: each ``future()`` of a blocking channel starts the channel's polling
    thread anew when none runs (about 1.5 ms of a loaded machine's time per batch, as much as
    copying 16 MiB), and a future still running at interpreter exit hangs it (its ``__del__``
    takes the call's lock, which gRPC's polling thread may hold when daemon threads are
    frozen).  The worker is a daemon thread started at a call when none runs, ending once idle
    for ``_IDLE_S``; the client's finalizer
    (``weakref.finalize``: on GC and at exit, while threads still run) waits for the calls
    briefly, drops those not started and closes the channel, which cancels one in progress.
    It must not refer to the client.  Thread-safe.
    """

    __slots__ = ("_cond", "_pending", "_queue", "_stopped", "_worker")

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queue: collections.deque[Callable[[], Any]] = collections.deque()
        self._pending = 0  # queued or being made
        self._worker: threading.Thread | None = None
        self._stopped = False

    def add(self, call: Callable[[], Any]) -> None:
        """Make ``call()`` (a blocking RPC) soon, in the worker; its outcome is not needed
        (a release that fails costs nothing lasting: the node drops the lease at its TTL)."""
        with self._cond:
            if self._stopped:
                return
            self._queue.append(call)
            self._pending += 1
            if self._worker is None:
                self._worker = threading.Thread(target=self._run, name="kvstore-release", daemon=True)
                self._worker.start()
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._queue and not self._stopped:
                    # idle: the thread ends after a while (a cluster client has one of these per
                    # node it talks to); the next add() starts another
                    self._cond.wait(_IDLE_S)
                if not self._queue:
                    self._worker = None
                    return
                call = self._queue.popleft()
            try:
                call()
            except Exception:  # see add(): the outcome is not needed
                pass
            finally:
                with self._cond:
                    self._pending -= 1
                    self._cond.notify_all()

    def __bool__(self) -> bool:
        return self._pending > 0

    def drain(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the calls made so far."""
        end = time.monotonic() + timeout
        with self._cond:
            while self._pending and (left := end - time.monotonic()) > 0:
                self._cond.wait(left)

    def stop(self) -> None:
        """Make no more calls: those not started are dropped, the worker ends."""
        with self._cond:
            self._stopped = True
            self._pending -= len(self._queue)
            self._queue.clear()
            self._cond.notify_all()


def finalize_channel(inflight: Inflight, channel: grpc.Channel, timeout: float) -> None:
    """Finish the client's calls in flight (or drop them), then close its channel (which
    cancels one still in progress)."""
    inflight.drain(timeout)
    inflight.stop()
    channel.close()


def resolve_token(token: str | None, token_file: str | None) -> str:
    """Explicit token → token file → ``KVSTORE_TOKEN`` → ``KVSTORE_TOKEN_FILE``; empty: no auth."""
    if token:
        return token
    path = token_file or (None if os.environ.get("KVSTORE_TOKEN") else os.environ.get("KVSTORE_TOKEN_FILE"))
    if path:
        try:
            with open(path) as f:
                return f.read().strip()
        except OSError as e:
            raise InvalidArgument(f"cannot read token file {path}: {e}") from e
    return os.environ.get("KVSTORE_TOKEN", "")


def call_metadata(token: str, agent: str) -> tuple[tuple[str, str], ...]:
    """Every call's metadata: the bearer token (if any) and the agent name (if any)."""
    md: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()
    return (*md, (AGENT_METADATA_KEY, agent)) if agent else md


def stream_metadata(metadata: tuple[tuple[str, str], ...], blocks: int | None) -> tuple[tuple[str, str], ...]:
    """A put stream's metadata: the call's, and its block count when the op declared one."""
    return (*metadata, (BLOCKS_METADATA_KEY, str(blocks))) if blocks is not None else metadata


def rpc_error(e: grpc.RpcError, tls: ClientTLS | None, target: str) -> KVStoreError:
    """``error_from_rpc``, plus what to check when a connection failed the way a TLS mismatch does."""
    err = error_from_rpc(e)
    if isinstance(err, Unavailable):
        msg = explain(str(err), tls, target)
        if msg != str(err):
            return type(err)(msg)
    return err


# ``KVClient("etcd://...")`` / ``AsyncKVClient("etcd://...")`` still return a cluster client, for
# one release, with a DeprecationWarning: ``client.connect`` / ``client.connect_async`` are the way.
# The cluster clients' constructors are registered here by client/_connect.py ("sync", "async"),
# so the single-node clients do not import the cluster router (which imports them).
ETCD_ROUTES: dict[str, Callable[..., Any]] = {}


def etcd_route(kind: str, target: object, old: str, new: str) -> Callable[..., Any] | None:
    """The cluster client constructor for an ``etcd://`` ``target`` given to ``old`` (warning that
    ``new`` replaces it); None for any other target."""
    if not (isinstance(target, str) and target.startswith("etcd://")):
        return None
    warnings.warn(
        f"{old}('etcd://...') returning a cluster client is deprecated and goes in the next release; "
        f"use {new}('etcd://...')",
        DeprecationWarning,
        stacklevel=3,
    )
    try:
        return ETCD_ROUTES[kind]
    except KeyError:
        raise AssertionError("client/_connect.py registers the etcd routes when the client package loads") from None

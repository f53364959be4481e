"""What the blocking and the asyncio drivers share: gRPC channel settings, the bearer token,
the gRPC → kvstore error mapping with TLS hints, calls started without waiting, and the
(deprecated) routing of ``etcd://`` targets given to the single-node client classes.

Owns no state of its own beyond :data:`ETCD_ROUTES` (filled once, at import of
:mod:`client._connect`).
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import grpc

from kvstore.errors import InvalidArgument, KVStoreError, Unavailable
from kvstore.tls import ClientTLS, explain
from kvstore.wire import BLOCKS_METADATA_KEY, error_from_rpc

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


class Inflight:
    """Calls a client started without waiting (``Release``), kept so they are finished or
    cancelled before the client, or the interpreter, goes.

    A gRPC future still running at interpreter exit hangs it: its ``__del__`` takes the
    call's lock, which gRPC's polling thread may hold when daemon threads are frozen.  So the
    client's finalizer (``weakref.finalize``: on GC and at exit, while threads still run) waits
    for them briefly, cancels the rest and drops them.  It must not refer to the client."""

    __slots__ = ("calls", "lock")

    def __init__(self) -> None:
        self.calls: list[Any] = []
        self.lock = threading.Lock()

    def add(self, call: Any) -> None:
        with self.lock:
            self.calls = [f for f in self.calls if not f.done()]
            self.calls.append(call)

    def __bool__(self) -> bool:
        return bool(self.calls)

    def drain(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds in all for the calls; cancel those still running."""
        with self.lock:
            pending, self.calls = self.calls, []
        end = time.monotonic() + timeout
        for f in pending:
            try:
                f.result(timeout=max(0.0, end - time.monotonic()))
            except Exception:  # noqa: BLE001 - a release's outcome is not needed (leases expire)
                f.cancel()


def finalize_channel(inflight: Inflight, channel: grpc.Channel, timeout: float) -> None:
    """Finish or cancel the client's calls in flight, then close its channel."""
    inflight.drain(timeout)
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

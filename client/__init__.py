"""kvstore client SDK.

from client import KVClient, Namespace, chunk_keys
with KVClient("unix:///path/to/kvstore.sock") as kv:
    keys = chunk_keys(tokens, Namespace("llama-3-8b"))
    kv.put(keys[0], kv_block)            # numpy array, CPU tensor or bytes
    kv.get_into(keys[0], out)            # zero-copy into your buffer; None on a miss

``connect(target)`` returns the right client for any target (``etcd://`` → a cluster client);
``ClientOptions`` holds the options every client takes.
"""

from client._async import AsyncKVClient
from client._connect import connect, connect_async
from client._options import ClientOptions, Timeouts
from client._poolview import ChunkHolder, PoolMatch, PoolView, PoolViewStats
from client._sync import KVClient
from kvstore.errors import (
    CapacityExceeded,
    DeadlineExceeded,
    Incompatible,
    InvalidArgument,
    KVStoreError,
    NotFound,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
)
from kvstore.keys import NO_PARENT, ChunkKey, KVLayout, Namespace, chunk_keys, parent_keys

__all__ = [
    "AsyncClusterClient",
    "AsyncKVClient",
    "CapacityExceeded",
    "ChunkHolder",
    "ClientOptions",
    "ClusterClient",
    "ChunkKey",
    "DeadlineExceeded",
    "Incompatible",
    "InvalidArgument",
    "KVClient",
    "KVLayout",
    "KVStoreError",
    "NO_PARENT",
    "Namespace",
    "NotFound",
    "PermissionDenied",
    "PoolMatch",
    "PoolView",
    "PoolViewStats",
    "Timeouts",
    "Unauthenticated",
    "Unavailable",
    "chunk_keys",
    "connect",
    "connect_async",
    "parent_keys",
]


def __getattr__(name: str) -> object:
    # the cluster router pulls in the etcd client: load it only when it is asked for
    if name in ("ClusterClient", "AsyncClusterClient"):
        from client import _cluster_clients

        return getattr(_cluster_clients, name)
    raise AttributeError(f"module 'client' has no attribute {name!r}")

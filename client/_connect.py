"""``connect`` / ``connect_async``: one entry point for every kind of target.

* ``unix:///path/kvstore.sock`` or ``host:port``: one node → :class:`client.KVClient`
  (:class:`client.AsyncKVClient`);
* ``etcd://HOST:PORT[,HOST:PORT]/CLUSTER``: a whole cluster, routed by the client →
  ``ClusterClient`` (``AsyncClusterClient``), which also takes the cluster's own keyword
  arguments (``replication``, ``suspect_s``, ``prefer_local``, ``wait_s``; the blocking one
  ``max_workers``).

Both take ``options=ClientOptions(...)`` and/or the option fields as keyword arguments.
The cluster router (and its etcd client) is imported only when an ``etcd://`` target asks
for it.  Importing this module also registers the cluster clients for the deprecated
``KVClient("etcd://...")`` spelling (:data:`client._channel.ETCD_ROUTES`).  Owns no state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from client._async import AsyncKVClient
from client._channel import ETCD_ROUTES
from client._options import ClientOptions
from client._sync import KVClient

if TYPE_CHECKING:
    from client._cluster_clients import AsyncClusterClient, ClusterClient


def _is_cluster(target: object) -> bool:
    return isinstance(target, str) and target.startswith("etcd://")


def cluster_client(target: str, options: ClientOptions | None = None, **kwargs: Any) -> ClusterClient:
    from client._cluster_clients import ClusterClient

    return ClusterClient(target, options, **kwargs)


def async_cluster_client(target: str, options: ClientOptions | None = None, **kwargs: Any) -> AsyncClusterClient:
    from client._cluster_clients import AsyncClusterClient

    return AsyncClusterClient(target, options, **kwargs)


def connect(target: str, options: ClientOptions | None = None, **kwargs: Any) -> KVClient | ClusterClient:
    """A blocking client of ``target``: a :class:`~client.KVClient` for one node, a
    ``ClusterClient`` for an ``etcd://`` cluster target."""
    if _is_cluster(target):
        return cluster_client(target, options, **kwargs)
    return KVClient(target, options, **kwargs)


def connect_async(
    target: str, options: ClientOptions | None = None, **kwargs: Any
) -> AsyncKVClient | AsyncClusterClient:
    """An asyncio client of ``target``: an :class:`~client.AsyncKVClient` for one node, an
    ``AsyncClusterClient`` for an ``etcd://`` cluster target.  (Connections open on first use.)"""
    if _is_cluster(target):
        return async_cluster_client(target, options, **kwargs)
    return AsyncKVClient(target, options, **kwargs)


ETCD_ROUTES.update({"sync": cluster_client, "async": async_cluster_client})

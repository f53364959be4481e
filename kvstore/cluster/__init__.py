"""Cluster mode: etcd-managed membership (nodes, and the vLLM engines that use them),
configuration, namespace epochs and owners; placement; the node's registration agent;
``kvstore up`` and ``kvstore cluster``.

Modules:

* :mod:`kvstore.cluster.state` — the values a cluster agrees on, and the etcd key schema (pure);
* :mod:`kvstore.cluster.placement` — which nodes own a key: bounded-v1 tables, rendezvous-v1 (pure);
* :mod:`kvstore.cluster.etcd` — every etcd call (the only importer of ``aetcd``);
* :mod:`kvstore.cluster.membership` — a watched view for synchronous code (its own thread);
* :mod:`kvstore.cluster.engines` — a vLLM engine's registration for synchronous code (its own thread);
* :mod:`kvstore.cluster.node` — a node's registration and epoch reclaim (the node's loop);
* :mod:`kvstore.cluster.owners` — a node's namespace owners followed from etcd (with tenants);
* :mod:`kvstore.cluster.local_etcd` — a private etcd process for ``kvstore up`` and tests;
* :mod:`kvstore.cluster.cli` — ``kvstore cluster set|show|invalidate|owners|release`` (``bench-placement``, now
  ``kvstore bench placement``, is routed there by ``kvstore.cli``).

Importing this package imports nothing heavy; the SDK side lives in ``client/_cluster.py``.
"""

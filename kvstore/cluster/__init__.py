"""Cluster mode: etcd-managed membership, configuration, namespace epochs and owners;
rendezvous placement; the node's registration agent; ``kvstore up`` and ``kvstore cluster``.

Modules:

* :mod:`kvstore.cluster.state` — the values a cluster agrees on, and the etcd key schema (pure);
* :mod:`kvstore.cluster.placement` — rendezvous hashing (pure);
* :mod:`kvstore.cluster.etcd` — every etcd call (the only importer of ``aetcd``);
* :mod:`kvstore.cluster.membership` — a watched view for synchronous code (its own thread);
* :mod:`kvstore.cluster.node` — a node's registration and epoch reclaim (the node's loop);
* :mod:`kvstore.cluster.owners` — a node's namespace owners followed from etcd (with tenants);
* :mod:`kvstore.cluster.local_etcd` — a private etcd process for ``kvstore up`` and tests;
* :mod:`kvstore.cluster.cli` — ``kvstore cluster set|show|invalidate|owners|release``.

Importing this package imports nothing heavy; the SDK side lives in ``client/_cluster.py``.
"""

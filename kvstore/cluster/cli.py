"""``kvstore cluster``: cluster-wide settings and namespace epochs in etcd.

    kvstore cluster set replication 2 --etcd 127.0.0.1:2379 --cluster prod
    kvstore cluster show [--json]
    kvstore cluster invalidate NAMESPACE

``NAMESPACE`` is a fingerprint (16 hex digits), a JSON object of
:class:`~kvstore.keys.Namespace` fields, or a model id (a namespace with every other
field at its default).  ``--etcd`` and ``--cluster`` default to ``KVSTORE_ETCD`` and
``KVSTORE_CLUSTER``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import re
from typing import Any

from kvstore.errors import InvalidArgument


def add_arguments(p: argparse.ArgumentParser) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--etcd", default=os.environ.get("KVSTORE_ETCD", "127.0.0.1:2379"), metavar="HOST:PORT[,HOST:PORT]",
                        help="etcd endpoints (default $KVSTORE_ETCD or 127.0.0.1:2379)")
    common.add_argument("--cluster", default=os.environ.get("KVSTORE_CLUSTER", "default"), metavar="NAME",
                        help="cluster name (default $KVSTORE_CLUSTER or 'default')")
    common.add_argument("--timeout", type=float, default=5.0, metavar="S", help="etcd call timeout (default 5 s)")
    sub = p.add_subparsers(dest="cluster_command", required=True)
    s = sub.add_parser("set", parents=[common], help="set a cluster-wide setting (replication, handoff_window_s)")
    s.add_argument("name")
    s.add_argument("value")
    u = sub.add_parser("unset", parents=[common], help="return a setting to its default")
    u.add_argument("name")
    sh = sub.add_parser("show", parents=[common], help="settings, live nodes and namespaces")
    sh.add_argument("--json", action="store_true", help="print JSON")
    inv = sub.add_parser("invalidate", parents=[common], help="bump a namespace's epoch: its KV is dropped on every node")
    inv.add_argument("namespace", help="fingerprint (16 hex digits), JSON namespace fields, or a model id")


def parse_namespace(arg: str) -> tuple[bytes, dict[str, Any] | None]:
    """A CLI namespace argument → (fingerprint, namespace fields or None)."""
    from kvstore.keys import Namespace

    if re.fullmatch(r"[0-9a-fA-F]{16}", arg):
        return bytes.fromhex(arg), None
    if arg.lstrip().startswith("{"):
        try:
            ns = Namespace.from_dict(json.loads(arg))
        except (ValueError, TypeError) as e:
            raise InvalidArgument(f"not a namespace: {e}") from None
    else:
        ns = Namespace(model_id=arg)
    return ns.fingerprint, ns.to_dict()


async def _run(a: argparse.Namespace) -> int:
    from kvstore.cluster.etcd import ClusterStore
    from kvstore.cluster.state import CONFIG

    store = ClusterStore(a.etcd, a.cluster, timeout=a.timeout)
    try:
        if a.cluster_command == "set":
            v = await store.set_config(a.name, a.value)
            print(f"cluster {a.cluster}: {a.name} = {v}")
        elif a.cluster_command == "unset":
            await store.unset_config(a.name)
            print(f"cluster {a.cluster}: {a.name} back to its default ({CONFIG[a.name].default})")
        elif a.cluster_command == "show":
            snap = (await store.snapshot()).to_dict()
            snap.pop("connected", None)
            if a.json:
                print(json.dumps(snap, indent=2, sort_keys=True))
            else:
                _print_human(snap)
        elif a.cluster_command == "invalidate":
            fp, ns = parse_namespace(a.namespace)
            rec = await store.bump_epoch(fp, ns)
            print(f"namespace {fp.hex()}: epoch {rec.epoch} (effective fingerprint {rec.effective.hex()}); "
                  "nodes drop its older blocks as they see the change")
        return 0
    finally:
        await store.close()


def _print_human(snap: dict[str, Any]) -> None:
    print(f"cluster {snap['cluster']} (etcd revision {snap['revision']})")
    print("settings:")
    for k, v in sorted(snap["config"].items()):
        print(f"  {k:<18} {v}")
    print(f"nodes ({len(snap['nodes'])} live):")
    for n, info in snap["nodes"].items():
        since = datetime.datetime.fromtimestamp(info["started_at"]).isoformat(timespec="seconds") if info["started_at"] else "?"
        print(f"  {n:<16} grpc {info['grpc']:<22} data {info['data']:<22} zone {info['zone'] or '-':<8} "
              f"dram {info['dram_bytes'] >> 20} MiB  nvme {info['nvme_bytes'] >> 20} MiB  v{info['version']}  up since {since}")
    print(f"namespaces ({len(snap['namespaces'])}):")
    for fp, r in snap["namespaces"].items():
        model = (r["namespace"] or {}).get("model_id", "")
        print(f"  {fp}  epoch {r['epoch']:<4} effective {r['effective_fingerprint']}  {model}")


def main(a: argparse.Namespace) -> int:
    return asyncio.run(_run(a))

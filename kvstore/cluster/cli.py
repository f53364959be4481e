"""``kvstore cluster``: cluster-wide settings, namespace epochs and namespace owners in etcd.

    kvstore cluster set replication 2 --etcd 127.0.0.1:2379 --cluster prod
    kvstore cluster show [--json]
    kvstore cluster invalidate NAMESPACE
    kvstore cluster owners [--json]
    kvstore cluster release NAMESPACE_HEX [--to TENANT]

``NAMESPACE`` is a fingerprint (16 hex digits), a JSON object of
:class:`~kvstore.keys.Namespace` fields, or a model id (a namespace with every other
field at its default).  ``NAMESPACE_HEX`` is the fingerprint a tenant's blocks declare
(16 hex digits, as ``owners`` lists it).  ``--etcd`` and ``--cluster`` default to
``KVSTORE_ETCD`` and ``KVSTORE_CLUSTER``.
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
    common.add_argument(
        "--etcd",
        default=os.environ.get("KVSTORE_ETCD", "127.0.0.1:2379"),
        metavar="HOST:PORT[,HOST:PORT]",
        help="etcd endpoints (default $KVSTORE_ETCD or 127.0.0.1:2379)",
    )
    common.add_argument(
        "--cluster",
        default=os.environ.get("KVSTORE_CLUSTER", "default"),
        metavar="NAME",
        help="cluster name (default $KVSTORE_CLUSTER or 'default')",
    )
    common.add_argument("--timeout", type=float, default=5.0, metavar="S", help="etcd call timeout (default 5 s)")
    sub = p.add_subparsers(dest="cluster_command", required=True)
    s = sub.add_parser("set", parents=[common], help="set a cluster-wide setting (replication, handoff_window_s)")
    s.add_argument("name")
    s.add_argument("value")
    u = sub.add_parser("unset", parents=[common], help="return a setting to its default")
    u.add_argument("name")
    sh = sub.add_parser("show", parents=[common], help="settings, live nodes and namespaces")
    sh.add_argument("--json", action="store_true", help="print JSON")
    inv = sub.add_parser(
        "invalidate", parents=[common], help="bump a namespace's epoch: its KV is dropped on every node"
    )
    inv.add_argument("namespace", help="fingerprint (16 hex digits), JSON namespace fields, or a model id")
    ow = sub.add_parser("owners", parents=[common], help="which tenant owns which namespace (nodes with tenants)")
    ow.add_argument("--json", action="store_true", help="print JSON")
    rel = sub.add_parser(
        "release",
        parents=[common],
        help="take a namespace from its tenant: every node drops its blocks; the next tenant to write it owns it",
    )
    rel.add_argument(
        "namespace", metavar="NAMESPACE_HEX", help="the namespace fingerprint (16 hex digits, as `owners` lists it)"
    )
    rel.add_argument("--to", metavar="TENANT", help="give it to this tenant instead of releasing it")


def parse_fingerprint(arg: str) -> bytes:
    if not re.fullmatch(r"[0-9a-fA-F]{16}", arg):
        raise InvalidArgument(f"a namespace fingerprint is 16 hex digits (see `kvstore cluster owners`), got {arg!r}")
    return bytes.fromhex(arg)


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
            print(
                f"namespace {fp.hex()}: epoch {rec.epoch} (effective fingerprint {rec.effective.hex()}); "
                "nodes drop its older blocks as they see the change"
            )
        elif a.cluster_command == "owners":
            owners, revision = await store.owners()
            names = _namespace_names((await store.snapshot()).namespaces)
            table = {fp.hex(): {**r.to_dict(), "namespace": names.get(fp)} for fp, r in sorted(owners.items())}
            if a.json:
                print(
                    json.dumps({"cluster": a.cluster, "revision": revision, "owners": table}, indent=2, sort_keys=True)
                )
            else:
                _print_owners(a.cluster, revision, table)
        elif a.cluster_command == "release":
            return await _release(store, a)
        return 0
    finally:
        await store.close()


async def _release(store: Any, a: argparse.Namespace) -> int:
    from kvstore.errors import NotFound
    from kvstore.node.config import TENANT_NAME

    fp = parse_fingerprint(a.namespace)
    if a.to is not None and not TENANT_NAME.fullmatch(a.to):
        raise InvalidArgument(f"not a tenant name: {a.to!r}")
    old = await store.release_owner(fp, to=a.to)
    was = f"tenant {old.tenant!r}" if old is not None else "no owner"
    if a.to is not None:
        print(
            f"namespace {fp.hex()}: given to tenant {a.to!r} (was {was}); nodes drop its blocks as they see the change"
        )
    elif old is None:
        raise NotFound(
            f"namespace {fp.hex()} has no owner in cluster {a.cluster!r}; nothing changed (see `kvstore cluster owners`)"
        )
    else:
        print(
            f"namespace {fp.hex()}: released (was {was}); nodes drop its blocks as they see the change, "
            "and the next tenant to write it owns it"
        )
    return 0


def _namespace_names(namespaces: Any) -> dict[bytes, str]:
    """Owned fingerprint → a readable name, where etcd's namespace records tell (the model id;
    a later epoch's effective fingerprint names its epoch)."""
    out: dict[bytes, str] = {}
    for fp, r in namespaces.items():
        model = str((r.namespace or {}).get("model_id", "")) or fp.hex()
        out[fp] = model
        if r.epoch:
            out[r.effective] = f"{model} (epoch {r.epoch})"
    return out


def _print_owners(cluster: str, revision: int, table: dict[str, dict[str, Any]]) -> None:
    print(f"namespace owners in cluster {cluster} (etcd revision {revision}): {len(table)}")
    for fp, r in table.items():
        since = (
            datetime.datetime.fromtimestamp(r["claimed_at"]).isoformat(timespec="seconds") if r["claimed_at"] else "?"
        )
        print(
            f"  {fp}  {r['tenant'] or '(unreadable record)':<16} since {since}  via {r['node'] or '-':<12} {r['namespace'] or ''}".rstrip()
        )


def _print_human(snap: dict[str, Any]) -> None:
    print(f"cluster {snap['cluster']} (etcd revision {snap['revision']})")
    print("settings:")
    for k, v in sorted(snap["config"].items()):
        print(f"  {k:<18} {v}")
    print(f"nodes ({len(snap['nodes'])} live):")
    for n, info in snap["nodes"].items():
        since = (
            datetime.datetime.fromtimestamp(info["started_at"]).isoformat(timespec="seconds")
            if info["started_at"]
            else "?"
        )
        print(
            f"  {n:<16} grpc {info['grpc']:<22} data {info['data']:<22} zone {info['zone'] or '-':<8} "
            f"dram {info['dram_bytes'] >> 20} MiB  nvme {info['nvme_bytes'] >> 20} MiB  v{info['version']}  up since {since}"
        )
    print(f"namespaces ({len(snap['namespaces'])}):")
    for fp, r in snap["namespaces"].items():
        model = (r["namespace"] or {}).get("model_id", "")
        print(f"  {fp}  epoch {r['epoch']:<4} effective {r['effective_fingerprint']}  {model}")


def main(a: argparse.Namespace) -> int:
    return asyncio.run(_run(a))

"""The optional deploy/ pieces, for tests/unit/test_deploy.py: how they combine with the
base files, and what the node makes of the files they hand it.

Two small, strict mergers, each for the subset the repository's files use (anything else
raises instead of guessing):

* :func:`strategic_merge`: Kubernetes strategic-merge patches (``kubectl patch``, a
  kustomization's ``patches:``) of a Deployment, as in ``deploy/k8s/patches/``.  Maps
  merge recursively, ``null`` deletes a field, and lists of containers, init containers,
  env vars, volumes, volume mounts and ports merge by their patch merge keys (``name``,
  ``mountPath``, ``containerPort``: new items are appended, matching items merged); the
  primitive lists ``args`` and ``command`` are replaced.  ``$patch`` directives are refused.
* :func:`compose_merge`: Compose's merge of ``-f base -f override`` files
  (https://docs.docker.com/reference/compose-file/merge/): maps merge, ``command``,
  ``entrypoint`` and ``healthcheck.test`` are replaced, ``volumes`` and ``secrets`` merge by
  their target, other lists append.  YAML anchors are resolved per file by the loader.

Then :func:`materialize` puts what a deployment mounts at each path the node's config
names into a temporary directory and runs the node's own start-up checks on those files,
and :func:`health_target` says what a ``kvstore health`` probe dials in the container.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvstore.cli import build_parser
from kvstore.node.config import NodeConfig

# the Kubernetes API's patchMergeKey of each list this repository's patches touch
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
}
REPLACED_LISTS = {"args", "command"}


class MergeError(Exception):
    pass


def strategic_merge(base: Any, patch: Any, field: str = "") -> Any:
    if isinstance(patch, dict):
        if base is not None and not isinstance(base, dict):
            raise MergeError(f"{field}: a map patches a {type(base).__name__}")
        out = copy.deepcopy(base) if base else {}
        for k, v in patch.items():
            if k.startswith("$"):
                raise MergeError(f"{field}.{k}: patch directives are not supported here")
            if v is None:
                out.pop(k, None)
            else:
                out[k] = strategic_merge(out.get(k), v, k)
        return out
    if isinstance(patch, list):
        if field in REPLACED_LISTS:
            return copy.deepcopy(patch)
        key = MERGE_KEYS.get(field)
        if key is None:
            raise MergeError(f"list {field!r}: its merge strategy is not modelled here")
        out = copy.deepcopy(base) if base else []
        for item in patch:
            if not isinstance(item, dict) or key not in item:
                raise MergeError(f"{field}: every item needs its merge key {key!r}: {item!r}")
            i = next((i for i, x in enumerate(out) if x.get(key) == item[key]), None)
            if i is None:
                out.append(copy.deepcopy(item))
            else:
                out[i] = strategic_merge(out[i], item, field)
        return out
    return copy.deepcopy(patch)


def patch_documents(docs: list[dict[str, Any]], patch: dict[str, Any]) -> list[dict[str, Any]]:
    """``docs`` with ``patch`` applied to the one object of its kind and name."""
    ident = (patch.get("apiVersion"), patch.get("kind"), patch.get("metadata", {}).get("name"))
    hits = [i for i, d in enumerate(docs) if (d.get("apiVersion"), d.get("kind"), d["metadata"]["name"]) == ident]
    if len(hits) != 1:
        raise MergeError(f"the patch for {ident} matches {len(hits)} objects")
    out = list(docs)
    out[hits[0]] = strategic_merge(docs[hits[0]], patch)
    return out


_REPLACED = {("services", "*", "command"), ("services", "*", "entrypoint"), ("services", "*", "healthcheck", "test")}
_BY_TARGET = {("services", "*", "volumes"), ("services", "*", "secrets")}


def _target(item: Any, what: tuple[str, ...]) -> str:
    if isinstance(item, dict):
        return str(item["target"])
    if what[-1] == "volumes":  # short syntax SRC:DST[:MODE]
        return str(item).split(":")[1]
    raise MergeError(f"{'.'.join(what)}: short syntax {item!r} is not modelled here")


def compose_merge(base: Any, override: Any, path: tuple[str, ...] = ()) -> Any:
    shape = tuple("*" if len(path) > 1 and i == 1 and path[0] == "services" else p for i, p in enumerate(path))
    if shape in _REPLACED:
        return copy.deepcopy(override)
    if isinstance(base, dict) and isinstance(override, dict):
        out = copy.deepcopy(base)
        for k, v in override.items():
            out[k] = compose_merge(base[k], v, (*path, k)) if k in base else copy.deepcopy(v)
        return out
    if isinstance(base, list) and isinstance(override, list):
        if shape in _BY_TARGET:
            out = copy.deepcopy(base)
            for item in override:
                i = next((i for i, x in enumerate(out) if _target(x, shape) == _target(item, shape)), None)
                if i is None:
                    out.append(copy.deepcopy(item))
                else:
                    out[i] = copy.deepcopy(item)
            return out
        return copy.deepcopy(base) + copy.deepcopy(override)
    if isinstance(base, (dict, list)) or isinstance(override, (dict, list)):
        raise MergeError(f"{'.'.join(path)}: cannot merge a {type(override).__name__} into a {type(base).__name__}")
    return copy.deepcopy(override)


PRIVATE_SETTINGS = ("tls_cert_file", "tls_key_file", "tls_client_ca_file")  # and the tenants' token files


def private_files(cfg: NodeConfig) -> list[str]:
    """Files only the node may read: its TLS material and the tenants' tokens."""
    return [
        *filter(None, (getattr(cfg, k) for k in PRIVATE_SETTINGS)),
        *(f for t in cfg.tenants.values() for f in t.token_file),
    ]


def materialize(cfg: NodeConfig, content: Callable[[str], bytes], tmp: Path) -> NodeConfig:
    """``cfg`` with every file it names replaced by a copy, under ``tmp``, of what the
    deployment puts at that path (``content``), then the node's own start-up checks of
    those files (kvstore/node/server.py): TLS credentials loaded, every token file read."""
    from kvstore.tls import ServerTLS

    mapped: dict[str, str] = {}
    for path in [*private_files(cfg), *filter(None, [cfg.token_file])]:
        local = tmp / "files" / path.lstrip("/")
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_bytes(content(path))
        mapped[path] = str(local)
    data = cfg.model_dump()
    data.update({k: mapped[v] for k in (*PRIVATE_SETTINGS, "token_file") if (v := data[k])})
    data["tenants"] = {
        n: {"token": t["token"], "token_file": [mapped[f] for f in t["token_file"]]} for n, t in data["tenants"].items()
    }
    node = NodeConfig(**data)
    if node.tls_cert_file:
        assert ServerTLS.load(node.tls_cert_file, node.tls_key_file, node.tls_client_ca_file).mutual == bool(
            node.tls_client_ca_file
        )
    assert set(node.tenant_tokens().values()) == set(node.tenants)
    return node


def health_target(
    check: list[str], config_text: str, environ: dict[str, str], tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> str:
    """What ``kvstore health`` (``check``) dials inside the container: its config file and environment."""
    from kvstore.node.health import resolve_target

    args = build_parser(check[1]).parse_args(check[1:])
    assert check[0] == "kvstore" and args.command == "health" and args.target is None
    conf = tmp / "probe.toml"
    conf.write_text(config_text)
    args.config = str(conf)
    for k in [k for k in os.environ if k.startswith("KVSTORE_")]:
        monkeypatch.delenv(k)
    for k, v in environ.items():
        monkeypatch.setenv(k, v)
    return resolve_target(args)

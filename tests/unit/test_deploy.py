"""Deployment artifacts (deploy/), checked without a container engine or a cluster.

Every manifest parses; the Kubernetes objects validate against the Kubernetes schemas
(``kubernetes-validate``, strict); the Helm chart renders (tests/helm_lite.py, and real
Helm through ``helm-python-sdk`` where installed, compared); and each form — the image,
compose.yaml, the plain manifests, the chart — is checked against the node itself: its
config goes through the real loader (``kvstore.node.config.load_config``: unknown keys fail)
with the file, the ``KVSTORE_*`` environment and the flags it would get; ports agree
between the config, container ports, Services and probes; the arena and the socket lie
on volumes both containers mount at the same path; memory covers the arena; commands
are ones the package installs and its parsers accept.

The optional pieces are checked the same way, combined with the base files as their tools
would (tests/deploy_variants.py): TLS and tenants in the chart's values, the strategic-merge
patches in deploy/k8s/patches/ and the compose override files.  Every file they hand the
node comes from a read-only Secret (or a compose secret) that only the sidecar mounts, and
with the files such a Secret would hold (throwaway certificates from ``kvstore.local.ca``)
the node's own start-up checks accept them; with TLS the probes check the node over its
Unix socket, since the kubelet's gRPC probes cannot speak TLS.  With TLS the nodes serve
``/metrics`` over HTTPS, and the dashboard of every form completes a real TLS handshake with
a node, using only what it mounts (the CA alone, never the node's key; its own client
certificate under mutual TLS).  Every form gives the node time to drain and flush on
SIGTERM: its grace period exceeds the configured drain and flush with a margin.
"""

from __future__ import annotations

import json
import re
import shlex
import socket
import ssl
import threading
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml
from deploy_variants import compose_merge, health_target, materialize, patch_documents, private_files

from kvstore.cli import build_parser
from kvstore.errors import InvalidArgument
from kvstore.node.config import NodeConfig, load_config

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
CHART = DEPLOY / "helm" / "kvstore"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
UID = 10001  # the image's user; the arena file is mode 0600, so its clients share it
K8S_VERSION = "1.30"  # oldest Kubernetes the manifests claim (native sidecars, gRPC probes)
MiB = 1 << 20
CLIENT_ENV = {"KVSTORE_TARGET", "KVSTORE_TOKEN", "KVSTORE_TOKEN_FILE"}  # what the SDK reads
# SIGTERM: after the drain and the flush, the node deregisters, closes its index and exits;
# in a pod the engine stops first, within the same grace period
SHUTDOWN_MARGIN_S = 5
ENGINE_STOP_S = 20  # what the manifests and the chart's default allow the engine


# -- small parsers ------------------------------------------------------------------------
def k8s_quantity(q: object) -> int:
    """A Kubernetes resource quantity (``9Gi``, ``512M``, ``1e3``) in bytes, whole."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E|[eE]\d+)?", str(q))
    assert m, f"not a Kubernetes quantity: {q!r}"
    unit = m.group(2) or ""
    scale = {
        "Ki": 1 << 10,
        "Mi": 1 << 20,
        "Gi": 1 << 30,
        "Ti": 1 << 40,
        "Pi": 1 << 50,
        "Ei": 1 << 60,
        "k": 10**3,
        "M": 10**6,
        "G": 10**9,
        "T": 10**12,
        "P": 10**15,
        "E": 10**18,
    }.get(unit) or (10 ** int(unit[1:]) if unit else 1)
    return int(float(m.group(1)) * scale)


def docker_bytes(v: object) -> int:
    """Compose's byte values (``320m``: binary units)."""
    m = re.fullmatch(r"(\d+)\s*([bkmg]?)b?", str(v).lower())
    assert m, f"not a compose byte value: {v!r}"
    return int(m.group(1)) * {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2)]


def duration_s(v: object) -> float:
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", str(v))
    assert parts and "".join(a + b for a, b in parts) == str(v), f"not a duration: {v!r}"
    return sum(float(n) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[u] for n, u in parts)


def hostport(v: str) -> tuple[str, int]:
    host, _, port = v.rpartition(":")
    return host, int(port)


def under(path: str | Path, mount: str) -> bool:
    return PurePosixPath(path).is_relative_to(PurePosixPath(mount))


def serve_config(argv: list[str], environ: dict[str, str], files: dict[str, str], tmp: Path) -> NodeConfig:
    """What ``kvstore <argv>`` (a serve command) would run with: the real parser and loader.
    ``files`` maps container paths to file contents (the config file it names)."""
    args = build_parser("serve").parse_args(argv)
    assert args.command == "serve"
    path = None
    if args.config:
        assert args.config in files, f"--config {args.config} is not provided by any volume or the image"
        path = tmp / PurePosixPath(args.config).name
        path.write_text(files[args.config])
    overrides = {k: v for k, v in vars(args).items() if k in NodeConfig.model_fields}
    return load_config(
        path, environ={k: v for k, v in environ.items() if k.startswith("KVSTORE_")}, overrides=overrides
    )


def test_serve_flags_are_config_keys() -> None:
    """Every `kvstore serve` flag sets a NodeConfig key of the same name (the manifests rely on it)."""
    dests = set(vars(build_parser("serve").parse_args(["serve"]))) - {"command", "fn", "config", "log_level"}
    assert dests <= set(NodeConfig.model_fields), dests - set(NodeConfig.model_fields)


# -- the image ----------------------------------------------------------------------------
@dataclass
class Dockerfile:
    stages: list[list[tuple[str, str]]] = field(default_factory=list)  # [[(INSTR, rest)]]

    @classmethod
    def load(cls, path: Path) -> Dockerfile:
        text = re.sub(
            r"\\\n", " ", "\n".join(ln for ln in path.read_text().splitlines() if not ln.lstrip().startswith("#"))
        )
        df = cls()
        for line in filter(None, (ln.strip() for ln in text.splitlines())):
            instr, _, rest = line.partition(" ")
            instr = instr.upper()
            if instr == "FROM":
                df.stages.append([])
            assert df.stages, "instruction before FROM"
            df.stages[-1].append((instr, rest.strip()))
        return df

    @property
    def final(self) -> list[tuple[str, str]]:
        return self.stages[-1]

    def get(self, instr: str) -> list[str]:
        return [rest for i, rest in self.final if i == instr]

    def exec_form(self, instr: str) -> list[str]:
        (rest,) = self.get(instr)[-1:]
        if instr == "HEALTHCHECK":
            rest = rest.partition("CMD ")[2]
        value = json.loads(rest)
        assert isinstance(value, list), f"{instr} must be in exec form (JSON list): {rest}"
        return value

    def env(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for rest in self.get("ENV"):
            for tok in shlex.split(rest):
                k, _, v = tok.partition("=")
                out[k] = v
        return out

    def copies(self) -> dict[str, str]:
        """Final-stage ``COPY src dest`` from the build context (not --from): dest -> src."""
        return {
            parts[-1]: parts[0]
            for rest in self.get("COPY")
            if not rest.startswith("--") and len(parts := rest.split()) == 2
        }

    def image_files(self) -> dict[str, str]:
        return {dest: (ROOT / src).read_text() for dest, src in self.copies().items() if (ROOT / src).is_file()}


DOCKERFILE = Dockerfile.load(DEPLOY / "Dockerfile")


def image_config(tmp: Path, environ: dict[str, str] | None = None) -> NodeConfig:
    return serve_config(
        DOCKERFILE.exec_form("CMD"), {**DOCKERFILE.env(), **(environ or {})}, DOCKERFILE.image_files(), tmp
    )


def test_image_base_user_and_no_torch() -> None:
    assert [stage[0] for stage in DOCKERFILE.stages] == [
        ("FROM", "python:3.11-slim AS build"),
        ("FROM", "python:3.11-slim"),
    ]
    assert DOCKERFILE.get("USER") == [f"{UID}:{UID}"]
    assert any(f"--uid {UID}" in r for r in DOCKERFILE.get("RUN"))
    installs = " ".join(r for stage in DOCKERFILE.stages for i, r in stage if i == "RUN")
    assert "torch" not in installs and "[gpu" not in installs  # the node runs without torch


def test_image_entrypoint_is_an_installed_console_script() -> None:
    entry = DOCKERFILE.exec_form("ENTRYPOINT")
    assert entry == ["kvstore"]
    target = PYPROJECT["project"]["scripts"]["kvstore"]
    from importlib import metadata

    installed = {
        ep.name: ep.value for ep in metadata.distribution("kvstore").entry_points if ep.group == "console_scripts"
    }
    assert installed.get("kvstore") == target  # what pip put on PATH, not only what pyproject says
    module, _, func = target.partition(":")
    assert callable(getattr(__import__(module, fromlist=[func]), func))
    cmd = DOCKERFILE.exec_form("CMD")
    assert build_parser(cmd[0]).parse_args(cmd).command == "serve"


def test_image_healthcheck_probes_the_configured_socket(tmp_path: Path) -> None:
    from kvstore.node.health import resolve_target

    check = DOCKERFILE.exec_form("HEALTHCHECK")
    assert check[0] == "kvstore" and "kvstore" in PYPROJECT["project"]["scripts"]
    args = build_parser(check[1]).parse_args(check[1:])
    assert args.command == "health"
    cmd = build_parser("serve").parse_args(DOCKERFILE.exec_form("CMD"))
    assert args.config == cmd.config  # the probe reads what serve reads
    cfg = image_config(tmp_path)
    conf = tmp_path / "probe.toml"
    conf.write_text(DOCKERFILE.image_files()[args.config])
    args.config = str(conf)
    assert resolve_target(args) == f"unix://{cfg.socket_path()}"


def test_image_config_paths_ports_and_build_context(tmp_path: Path) -> None:
    cfg = image_config(tmp_path)
    # the directories the node writes exist and belong to its user
    runs = " ".join(DOCKERFILE.get("RUN"))
    for d in (cfg.socket_path().parent, Path(cfg.data_dir)):
        assert "mkdir -p" in runs and str(d) in runs.split("chown", 1)[1], f"{d} is not created for uid {UID}"
    assert under(cfg.arena_file(), "/dev/shm")
    assert hostport(cfg.listen)[0] == "0.0.0.0" and hostport(cfg.data_listen)[0] == "0.0.0.0"
    exposed = {int(p) for rest in DOCKERFILE.get("EXPOSE") for p in rest.split()}
    assert exposed == {hostport(cfg.listen)[1], hostport(cfg.data_listen)[1], cfg.metrics_port}
    # every package the project ships is copied into the build, and the ignore file lets it through
    from setuptools import find_packages

    packages = {
        p.split(".")[0]
        for p in find_packages(str(ROOT), include=PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"])
    }
    build = [rest.split() for i, rest in DOCKERFILE.stages[0] if i == "COPY"]
    copied = {src.rstrip("/") for *srcs, _ in build for src in srcs}
    assert packages <= copied, packages - copied
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    allowed = {line[1:] for line in ignore if line.startswith("!")}
    for src in copied | set(DOCKERFILE.copies().values()):
        assert (ROOT / src).exists(), src
        assert src in allowed, f"{src} is excluded from the build context by Dockerfile.dockerignore"


def test_health_reports_failure_as_exit_1(tmp_path: Path) -> None:
    """Docker reserves exit 2 of a health check: every failure is 1."""
    from kvstore.node.health import main

    for argv in (
        ["--config", str(tmp_path / "missing.toml")],
        ["--target", f"unix://{tmp_path}/none.sock", "--timeout", "0.5"],
    ):
        assert main(build_parser("health").parse_args(["health", "--quiet", *argv])) == 1


# -- compose ------------------------------------------------------------------------------
COMPOSE = yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def compose_nodes() -> dict[str, dict[str, Any]]:
    return {name: s for name, s in COMPOSE["services"].items() if s.get("command", [None])[0] == "serve"}


def compose_config(name: str, tmp: Path) -> NodeConfig:
    svc = COMPOSE["services"][name]
    files = DOCKERFILE.image_files()
    assert not any(str(v).split(":")[1].startswith("/etc/kvstore") for v in svc.get("volumes", [])), (
        "config mounts: read them here"
    )
    return serve_config(svc["command"], {k: str(v) for k, v in svc.get("environment", {}).items()}, files, tmp)


def test_compose_topology_is_etcd_three_nodes_and_the_dashboard() -> None:
    assert set(COMPOSE["services"]) == {"etcd", "dashboard", *compose_nodes()}
    assert len(compose_nodes()) == 3
    for name in [*compose_nodes(), "dashboard"]:
        svc = COMPOSE["services"][name]
        assert svc["image"] == f"kvstore:{VERSION}"
        assert (DEPLOY / svc["build"]["context"]).resolve() == ROOT and svc["build"][
            "dockerfile"
        ] == "deploy/Dockerfile"
        assert "entrypoint" not in svc  # the image's ENTRYPOINT: kvstore
        assert svc.get("network_mode") != "host" and svc.get("ipc") != "host" and not svc.get("privileged")


def test_compose_nodes_configs_are_valid_and_agree(tmp_path: Path) -> None:
    configs = {name: compose_config(name, tmp_path) for name in compose_nodes()}
    declared = set(COMPOSE.get("volumes") or {})
    etcd = COMPOSE["services"]["etcd"]
    etcd_port = next(
        hostport(a.split("=", 1)[1].split(",")[0].removeprefix("http://"))[1]
        for a in etcd["command"]
        if a.startswith("--listen-client-urls=")
    )
    assert "healthcheck" in etcd
    seen_volumes: set[str] = set()
    for name, cfg in configs.items():
        svc = COMPOSE["services"][name]
        assert cfg.node_id == name == svc["hostname"]
        # peers and the dashboard dial what the node registers: its own service name
        assert hostport(cfg.listen)[0] == name and hostport(cfg.data_listen)[0] == name
        assert [hostport(e) for e in cfg.etcd.split(",")] == [("etcd", etcd_port)]
        assert svc["depends_on"]["etcd"]["condition"] == "service_healthy"
        assert docker_bytes(svc["shm_size"]) >= cfg.dram + 64 * MiB, "/dev/shm must hold the arena"
        assert under(cfg.arena_file(), "/dev/shm")
        assert (
            duration_s(svc["stop_grace_period"]) >= cfg.flush_on_shutdown_s + cfg.drain_timeout_s
        )  # SIGTERM: drain, then flush
        mounts = {v.split(":")[1]: v.split(":")[0] for v in svc["volumes"]}
        for path in (cfg.data_dir, cfg.socket_path().parent):
            vol = next((src for dst, src in mounts.items() if under(path, dst)), None)
            assert vol in declared, f"{name}: {path} is not on a named volume"
            assert vol not in seen_volumes, f"{vol} is shared between nodes"
            seen_volumes.add(vol)
        for p in svc.get("ports", []):
            *_, host_port, container_port = str(p).split(":")
            assert int(container_port) in (hostport(cfg.listen)[1], hostport(cfg.data_listen)[1])
            assert host_port == container_port  # clients dial the data port the node announces
    assert len({c.cluster for c in configs.values()}) == 1
    assert len({c.metrics_port for c in configs.values()}) == 1


def test_compose_dashboard_scrapes_the_nodes(tmp_path: Path) -> None:
    cfg = compose_config(next(iter(compose_nodes())), tmp_path)
    svc = COMPOSE["services"]["dashboard"]
    args = build_parser("dashboard").parse_args(svc["command"])
    assert (args.etcd, args.cluster, args.metrics_port) == (cfg.etcd, cfg.cluster, cfg.metrics_port)
    host, port = hostport(args.listen)
    assert host == "0.0.0.0" and any(str(p).endswith(f":{port}") for p in svc["ports"])
    assert f"{port}/healthz" in " ".join(svc["healthcheck"]["test"])


# -- TLS and tenants: the files the node is handed ----------------------------------------
def pki_files(directory: Path, hosts: list[str]) -> dict[str, bytes]:
    """A throwaway CA (the product's own generator), a node certificate for ``hosts`` and a
    client certificate: {file name: bytes}, as ``kvstore certs --client`` writes them."""
    from kvstore.local.ca import make

    c = make(directory, hosts, client=True)
    return {Path(f).name: Path(f).read_bytes() for f in (c.ca, c.cert, c.key, c.client_cert, c.client_key)}


@pytest.fixture(scope="module")
def secret_data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, bytes]]:
    """The Secrets the variants name, as a cluster would hold them: {name: {key: bytes}}."""
    f = pki_files(tmp_path_factory.mktemp("pki"), ["10.1.2.3", "kvstore.default.svc"])
    tls = {"tls.crt": f["tls.crt"], "tls.key": f["tls.key"], "ca.crt": f["ca.crt"]}
    alice, bob = b"alice-s3cret\n", b"bob-s3cret\n"
    return {
        "kvstore-tls": tls,
        "node-certs": tls,
        "kvstore-token": {"token": b"admin-s3cret\n"},
        "kvstore-tenants": {"alice.token": alice, "bob.token": bob, "bob-token": bob},
        # the dashboard's client certificate, signed by the nodes' CA (kubernetes.io/tls keys)
        "kvstore-dashboard-tls": {"tls.crt": f["client.crt"], "tls.key": f["client.key"]},
    }


def tls_handshake(server: ssl.SSLContext, client: Any, host: str) -> None:
    """A real TLS handshake between a node's context and the dashboard's ``ClientTLS``,
    the dashboard dialling ``host``, and one byte each way (with TLS 1.3 the node checks a
    client certificate only after the client's side of the handshake is done)."""
    a, b = socket.socketpair()
    a.settimeout(10)
    b.settimeout(10)
    failed: list[BaseException] = []

    def node() -> None:
        try:
            with server.wrap_socket(a, server_side=True) as s:
                assert s.recv(1) == b"?"
                s.sendall(b"!")
        except BaseException as e:  # reported below
            failed.append(e)

    t = threading.Thread(target=node, daemon=True)
    t.start()
    try:
        with client.wrap(b, host) as c:
            c.sendall(b"?")
            assert c.recv(1) == b"!"
    except (OSError, AssertionError) as e:
        t.join(10)
        raise AssertionError(f"the dashboard cannot scrape {host} over TLS: {e}; the node saw: {failed}") from None
    t.join(10)
    assert not failed, f"the node refused the dashboard: {failed}"


def check_dashboard_tls(
    cfg: NodeConfig, node_files: NodeConfig, options: dict[str, Any], content: Any, tmp: Path
) -> None:
    """The dashboard (TLS ``options``: flags and ``KVSTORE_TLS_*``, files read through
    ``content``) scrapes ``cfg``'s node: over HTTPS with what it mounts when the node serves
    TLS there, else plain HTTP with no TLS settings at all."""
    from kvstore.tls import ClientTLS, ServerTLS

    if not cfg.serves_metrics_tls():
        assert not any(options.values()), f"/metrics is plain HTTP, yet the dashboard has TLS settings: {options}"
        return
    assert options["ca_file"], "the nodes serve /metrics over HTTPS: the dashboard needs the CA"
    files = {}
    for k in ("ca_file", "cert_file", "key_file"):
        if options[k]:
            local = tmp / "dashboard" / options[k].lstrip("/")
            local.parent.mkdir(parents=True, exist_ok=True)
            local.write_bytes(content(options[k]))
            files[k] = str(local)
    client = ClientTLS.from_options(tls=options["tls"], server_name=options["server_name"], **files)
    server = ServerTLS.load(node_files.tls_cert_file, node_files.tls_key_file, node_files.tls_client_ca_file)
    assert server.mutual == bool(cfg.tls_client_ca_file)
    # the dashboard dials the host in the node's membership record: what it advertises
    tls_handshake(server.context, client, cfg.advertise_host or hostport(cfg.listen)[0])


def dashboard_tls_options(argv: list[str], environ: dict[str, str]) -> dict[str, Any]:
    from kvstore.dashboard.cli import tls_options

    return tls_options(build_parser("dashboard").parse_args(argv), environ)


COMPOSE_OVERRIDES = {"tls": "compose.tls.yaml", "tenants": "compose.tenants.yaml"}
COMPOSE_VARIANTS = [(), ("tls",), ("tenants",), ("tls", "tenants")]
GITIGNORE = (ROOT / ".gitignore").read_text().split()


def compose_merged(overrides: tuple[str, ...]) -> dict[str, Any]:
    merged = COMPOSE
    for name in overrides:  # docker compose -f compose.yaml -f compose.<name>.yaml ...
        merged = compose_merge(merged, yaml.safe_load((DEPLOY / COMPOSE_OVERRIDES[name]).read_text()))
    return merged


@pytest.mark.parametrize("overrides", COMPOSE_VARIANTS[1:], ids="+".join)
def test_compose_overrides_wire_tls_and_tenants(
    overrides: tuple[str, ...], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    merged = compose_merged(overrides)
    assert set(merged["services"]) == set(COMPOSE["services"]), "the overrides add no service"
    # what deploy/compose.tls.yaml's comment makes: `kvstore certs --out deploy/tls node1 node2 node3 localhost 127.0.0.1`
    on_disk = {
        f"tls/{k}": v for k, v in pki_files(tmp_path / "pki", [*compose_nodes(), "localhost", "127.0.0.1"]).items()
    }
    on_disk |= {"secrets/admin.token": b"admin\n", "secrets/alice.token": b"alice\n", "secrets/bob.token": b"bob\n"}
    check = DOCKERFILE.exec_form("HEALTHCHECK")

    def reader(svc: dict[str, Any]) -> Any:
        secrets = {s["target"]: s["source"] for s in svc.get("secrets", [])}

        def content(path: str) -> bytes:
            assert path in secrets, f"{path} is no secret's target"
            src = PurePosixPath(merged["secrets"][secrets[path]]["file"])
            assert not src.is_absolute() and f"/deploy/{src.parts[0]}/" in GITIGNORE, (
                f"{src}: keys and tokens are never committed"
            )
            return on_disk[str(src)]

        return content

    dash = merged["services"]["dashboard"]
    dash_env = {k: str(v) for k, v in dash.get("environment", {}).items()}
    args = build_parser("dashboard").parse_args(dash["command"])
    for name in compose_nodes():
        svc = merged["services"][name]
        env = {k: str(v) for k, v in svc["environment"].items()}
        cfg = serve_config(svc["command"], env, DOCKERFILE.image_files(), tmp_path)
        assert bool(cfg.tls_cert_file) == ("tls" in overrides) and bool(cfg.tenants) == ("tenants" in overrides)
        node_files = materialize(cfg, reader(svc), tmp_path / name)
        # the image's health check runs with this environment, over the Unix socket
        config_text = DOCKERFILE.image_files()[build_parser("health").parse_args(check[1:]).config]
        assert (
            health_target(check, config_text, {**DOCKERFILE.env(), **env}, tmp_path, monkeypatch)
            == f"unix://{cfg.socket_path()}"
        )
        # with TLS the node serves /metrics over HTTPS, and the dashboard reaches it with its secrets alone
        assert cfg.serves_metrics_tls() == ("tls" in overrides)
        check_dashboard_tls(
            cfg, node_files, dashboard_tls_options(dash["command"], dash_env), reader(dash), tmp_path / name
        )
        if cfg.tls_cert_file:
            assert not {cfg.tls_key_file} & {s["target"] for s in dash.get("secrets", [])}, (
                "the node's key is the node's"
            )
    assert (args.metrics_port, args.etcd) == (cfg.metrics_port, cfg.etcd)
    if "tenants" in overrides:
        (ds,) = [s for s in dash["secrets"] if s["target"] == args.token_file]
        assert (
            args.token_file == cfg.token_file
            and ds["source"] == {s["target"]: s["source"] for s in svc["secrets"]}[cfg.token_file]
        )
        assert "/healthz" not in " ".join(dash["healthcheck"]["test"]), "/healthz wants the token"
    else:
        assert not args.token_file and dash["command"] == COMPOSE["services"]["dashboard"]["command"]
        assert dash["healthcheck"] == COMPOSE["services"]["dashboard"]["healthcheck"]


@pytest.mark.parametrize("overrides", COMPOSE_VARIANTS, ids=lambda o: "+".join(o) or "base")
def test_compose_stop_grace_period_outlasts_the_drain(overrides: tuple[str, ...], tmp_path: Path) -> None:
    """``docker compose stop`` sends SIGKILL after ``stop_grace_period``: it must cover the
    drain (``drain_timeout_s``, set explicitly), the flush and the exit, in every variant."""
    merged = compose_merged(overrides)
    for name in compose_nodes():
        svc = merged["services"][name]
        cfg = serve_config(
            svc["command"], {k: str(v) for k, v in svc["environment"].items()}, DOCKERFILE.image_files(), tmp_path
        )
        assert "KVSTORE_DRAIN_TIMEOUT_S" in svc["environment"], (
            "the drain is part of the deployment, not a hidden default"
        )
        assert (
            duration_s(svc["stop_grace_period"]) >= cfg.drain_timeout_s + cfg.flush_on_shutdown_s + SHUTDOWN_MARGIN_S
        ), name


# -- Kubernetes: the plain manifests and the rendered chart -------------------------------
def load_docs(texts: list[str]) -> list[dict[str, Any]]:
    return [d for t in texts for d in yaml.safe_load_all(t) if d]


def manifests() -> list[dict[str, Any]]:
    return load_docs([p.read_text() for p in sorted((DEPLOY / "k8s").glob("*.yaml"))])


CHART_VARIANTS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "external-etcd-auth-hostpath": {
        "etcd": {"enabled": False, "endpoints": "etcd-a.example:2379,etcd-b.example:2379"},
        "auth": {"existingSecret": "kvstore-token"},
        "kvstore": {
            "nvmeHostPath": "/mnt/nvme0/kvstore",
            "dramMiB": 65536,
            "nvmeMiB": 512000,
            "zone": "zone-a",
            "cluster": "prod",
            "ports": {"grpc": 7000, "data": 7001, "metrics": 7002},
            "config": {
                "eviction_policy": "prefix-lru",
                "write_through": True,
                "max_batch": 1024,
                "reservation_ttl_s": 2.5,
            },
        },
        "engine": {"args": ["--model", "m"], "env": [{"name": "HF_HOME", "value": "/tmp/hf"}], "replicas": 2},
        "dashboard": {"port": 9000},
    },
    "no-dashboard": {"dashboard": {"enabled": False}},
    "tls": {"tls": {"enabled": True, "secretName": "kvstore-tls"}},
    "tls-plain-metrics": {"tls": {"enabled": True, "secretName": "kvstore-tls", "metrics": False}},
    "mtls-auth-tenants": {
        "tls": {
            "enabled": True,
            "secretName": "node-certs",
            "clientCA": True,
            "serverName": "kvstore.default.svc",
            "dashboardSecretName": "kvstore-dashboard-tls",
        },
        "auth": {"existingSecret": "kvstore-token"},
        "tenants": {"existingSecret": "kvstore-tenants", "tokens": {"alice": "alice.token", "bob": "bob-token"}},
    },
    "mtls-no-dashboard": {
        "tls": {"enabled": True, "secretName": "kvstore-tls", "clientCA": True},
        "dashboard": {"enabled": False},
    },
    "long-drain": {"kvstore": {"drainTimeoutS": 45, "flushOnShutdownS": 30}, "engine": {"shutdownS": 40}},
}
# the plain manifests with the patches of deploy/k8s/patches/ applied in order (kubectl patch)
MANIFEST_VARIANTS: dict[str, list[str]] = {
    "manifests": [],
    "manifests+tls": ["tls.yaml", "tls-dashboard.yaml"],
    "manifests+mtls-auth-tenants": [
        "tls.yaml",
        "tls-dashboard.yaml",
        "mtls.yaml",
        "mtls-dashboard.yaml",
        "auth.yaml",
        "auth-dashboard.yaml",
        "tenants.yaml",
    ],
}


def chart_docs(values: dict[str, Any], renderer: str = "lite", release: str = "kvstore") -> list[dict[str, Any]]:
    if renderer == "helm":
        helm = pytest.importorskip("helm_python", reason="helm-python-sdk (real Helm) is not installed")
        with helm.Chart.load(str(CHART)) as chart:
            rendered = chart.render(values, name=release, namespace="default")
        return load_docs([rendered[k] for k in sorted(rendered)])
    import helm_lite

    return load_docs(list(helm_lite.render_chart(CHART, values, release=release).values()))


SOURCES = [*MANIFEST_VARIANTS, *[f"chart:{v}" for v in CHART_VARIANTS]]


def patched_manifests(patches: list[str]) -> list[dict[str, Any]]:
    docs = manifests()
    for name in patches:
        docs = patch_documents(docs, yaml.safe_load((DEPLOY / "k8s" / "patches" / name).read_text()))
    return docs


def docs_of(source: str) -> list[dict[str, Any]]:
    if source in MANIFEST_VARIANTS:
        return patched_manifests(MANIFEST_VARIANTS[source])
    return chart_docs(CHART_VARIANTS[source.split(":", 1)[1]])


class Pod:
    """The inference pod: its spec, the kvstore sidecar and the engine container."""

    def __init__(self, workload: dict[str, Any]) -> None:
        self.workload = workload
        self.spec = workload["spec"]["template"]["spec"]
        self.labels = workload["spec"]["template"]["metadata"]["labels"]
        everyone = self.spec.get("initContainers", []) + self.spec["containers"]
        (self.sidecar,) = [c for c in everyone if c.get("args", [None])[0] == "serve"]
        (self.engine,) = [c for c in self.spec["containers"] if c is not self.sidecar]
        self.volumes = {v["name"]: v for v in self.spec["volumes"]}

    def env(self, c: dict[str, Any]) -> dict[str, str]:
        """The container's environment as the kubelet builds it: downward-API fields with
        sample values, ``$(VAR)`` expanded from the variables defined before it."""
        fields = {
            "metadata.name": "kvstore-inference-7d9f8-x2k4p",
            "status.podIP": "10.1.2.3",
            "metadata.namespace": "default",
            "spec.nodeName": "gpu-node-1",
        }
        out: dict[str, str] = {}
        for e in c.get("env", []):
            if "value" in e:
                out[e["name"]] = re.sub(
                    r"\$\$|\$\((\w+)\)",
                    lambda m: "$" if m.group(0) == "$$" else out.get(m.group(1), m.group(0)),
                    e["value"],
                )
            else:
                assert set(e["valueFrom"]) == {"fieldRef"}, f"unsupported env source in this test: {e}"
                out[e["name"]] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
        assert not c.get("envFrom"), "envFrom: read it here"
        return out

    def mount(self, c: dict[str, Any], path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
        """(volumeMount, volume) under which ``path`` lies in container ``c`` (the deepest)."""
        mounts = sorted(
            (m for m in c.get("volumeMounts", []) if under(path, m["mountPath"])), key=lambda m: len(m["mountPath"])
        )
        assert mounts, f"{path} is on no volume of container {c['name']}"
        m = mounts[-1]
        assert "subPath" not in m and "subPathExpr" not in m
        return m, self.volumes[m["name"]]

    def shared(self, path: str | Path) -> dict[str, Any]:
        """``path`` must be on the same volume, at the same mount path, in both containers:
        the engine opens exactly the path the node reports."""
        ms, vol = self.mount(self.sidecar, path)
        me, vol_e = self.mount(self.engine, path)
        assert vol is vol_e and ms["mountPath"] == me["mountPath"], f"{path}: {ms} vs {me}"
        return vol

    def uid(self, c: dict[str, Any]) -> int:
        return (c.get("securityContext") or {}).get(
            "runAsUser", (self.spec.get("securityContext") or {}).get("runAsUser")
        )


@dataclass
class Cluster:
    docs: list[dict[str, Any]]

    def kind(self, kind: str) -> list[dict[str, Any]]:
        return [d for d in self.docs if d["kind"] == kind]

    def named(self, kind: str, name: str) -> dict[str, Any] | None:
        return next((d for d in self.kind(kind) if d["metadata"]["name"] == name), None)

    def workloads(self) -> list[dict[str, Any]]:
        return self.kind("Deployment") + self.kind("StatefulSet")

    def pod(self) -> Pod:
        (w,) = [
            w
            for w in self.kind("Deployment")
            if any(
                c.get("args", [None])[0] == "serve"
                for c in w["spec"]["template"]["spec"].get("initContainers", [])
                + w["spec"]["template"]["spec"]["containers"]
            )
        ]
        return Pod(w)

    def config(self, pod: Pod, tmp: Path) -> NodeConfig:
        return serve_config(pod.sidecar["args"], pod.env(pod.sidecar), self.config_files(pod), tmp)

    def config_files(self, pod: Pod) -> dict[str, str]:
        """The config file ``serve --config`` names, from the ConfigMap mounted there."""
        args = build_parser("serve").parse_args(pod.sidecar["args"])
        files = {}
        if args.config:
            m, vol = pod.mount(pod.sidecar, args.config)
            assert "configMap" in vol and "items" not in vol["configMap"], vol
            cm = self.named("ConfigMap", vol["configMap"]["name"])
            assert cm is not None, f"no ConfigMap {vol['configMap']['name']}"
            files[args.config] = cm["data"][str(PurePosixPath(args.config).relative_to(m["mountPath"]))]
            assert m.get("readOnly")
        return files

    def services_for(self, labels: dict[str, str]) -> list[dict[str, Any]]:
        return [s for s in self.kind("Service") if s["spec"]["selector"].items() <= labels.items()]


def container_port(c: dict[str, Any], target: int | str) -> int:
    ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
    if isinstance(target, str):
        assert target in ports, f"{c['name']} has no port named {target}"
        return ports[target]
    assert target in ports.values(), f"{c['name']} does not expose {target}"
    return target


@pytest.fixture(params=SOURCES)
def cluster(request: pytest.FixtureRequest) -> Cluster:
    return Cluster(docs_of(request.param))


def test_every_manifest_validates_against_the_kubernetes_schemas(cluster: Cluster) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed")
    for d in cluster.docs:
        kv.validate(d, K8S_VERSION, strict=True)  # strict: unknown fields fail too


def test_workloads_are_unprivileged_and_namespace_less(cluster: Cluster) -> None:
    assert cluster.docs
    for d in cluster.docs:
        assert "namespace" not in d["metadata"], "manifests are namespace-less"
    for w in cluster.workloads():
        selector = w["spec"]["selector"]["matchLabels"]
        assert selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()
        spec = w["spec"]["template"]["spec"]
        assert not (spec.get("hostIPC") or spec.get("hostNetwork") or spec.get("hostPID")), w["metadata"]["name"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        for c in spec.get("initContainers", []) + spec["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert not c["securityContext"].get("privileged")


def test_sidecar_runs_the_image_entrypoint_with_a_valid_config(cluster: Cluster, tmp_path: Path) -> None:
    pod = cluster.pod()
    side = pod.sidecar
    assert side.get("command", ["kvstore"]) == ["kvstore"] and DOCKERFILE.exec_form("ENTRYPOINT") == ["kvstore"]
    assert side["image"].rsplit(":", 1)[1] == VERSION
    if side in pod.spec.get("initContainers", []):
        assert side["restartPolicy"] == "Always", "an init container must be a native sidecar"
    cfg = cluster.config(pod, tmp_path)  # raises on any unknown key or bad value
    # per-pod identity and reachable addresses: the node registers what it binds
    assert cfg.node_id == pod.env(side)["KVSTORE_NODE_ID"] != "localhost"
    pod_ip = "10.1.2.3"
    assert hostport(cfg.listen)[0] == pod_ip and hostport(cfg.data_listen)[0] == pod_ip
    assert cfg.etcd, "a cluster node"
    assert pod.uid(side) == UID == pod.uid(pod.engine), "the arena (mode 0600) needs one uid in both containers"


def test_grace_period_outlasts_the_drain(cluster: Cluster, tmp_path: Path) -> None:
    """The kubelet kills the pod ``terminationGracePeriodSeconds`` after SIGTERM; the engine
    stops first, then the sidecar drains (``drain_timeout_s``, set in its config), flushes
    and exits: the grace period covers all of it, in every variant."""
    pod = cluster.pod()
    cfg = cluster.config(pod, tmp_path)
    text = cluster.config_files(pod)[build_parser("serve").parse_args(pod.sidecar["args"]).config]
    assert "drain_timeout_s" in tomllib.loads(text)["node"], "the drain is part of the deployment, not a hidden default"
    need = ENGINE_STOP_S + cfg.drain_timeout_s + cfg.flush_on_shutdown_s + SHUTDOWN_MARGIN_S
    assert pod.spec["terminationGracePeriodSeconds"] >= need


def test_chart_passes_the_drain_to_the_node_and_the_grace_period_follows(tmp_path: Path) -> None:
    values = CHART_VARIANTS["long-drain"]
    c = Cluster(chart_docs(values))
    cfg = c.config(c.pod(), tmp_path)
    assert (cfg.drain_timeout_s, cfg.flush_on_shutdown_s) == (45, 30)
    assert c.pod().spec["terminationGracePeriodSeconds"] == 40 + 45 + 30 + 10  # engine + drain + flush + 10
    default = Cluster(chart_docs({}))
    assert (
        default.pod().spec["terminationGracePeriodSeconds"]
        == 60
        == Cluster(manifests()).pod().spec["terminationGracePeriodSeconds"]
    )


def test_ports_agree_between_config_containers_probes_and_services(cluster: Cluster, tmp_path: Path) -> None:
    pod = cluster.pod()
    cfg = cluster.config(pod, tmp_path)
    grpc, data = hostport(cfg.listen)[1], hostport(cfg.data_listen)[1]
    ports = {p["name"]: p["containerPort"] for p in pod.sidecar["ports"]}
    assert ports == {"grpc": grpc, "data": data, "metrics": cfg.metrics_port}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        p = pod.sidecar[probe]
        if "grpc" in p:
            assert p["grpc"]["port"] == grpc and p["grpc"].get("service", "") in ("", "kvstore.v1.KVStore")
        else:
            cmd = p["exec"]["command"]
            assert cmd[:2] == ["kvstore", "health"] and build_parser("health").parse_args(cmd[1:])
    (svc,) = cluster.services_for(pod.labels)
    assert svc["spec"]["clusterIP"] == "None", "headless: a data connection must reach the pod its gRPC call did"
    targeted = {container_port(pod.sidecar, p["targetPort"]) for p in svc["spec"]["ports"]}
    assert {p["port"] for p in svc["spec"]["ports"]} == targeted == {grpc, data, cfg.metrics_port}


def test_arena_socket_and_nvme_volumes(cluster: Cluster, tmp_path: Path) -> None:
    pod = cluster.pod()
    cfg = cluster.config(pod, tmp_path)
    arena = pod.shared(cfg.arena_file())
    assert arena["emptyDir"]["medium"] == "Memory"
    assert k8s_quantity(arena["emptyDir"]["sizeLimit"]) >= cfg.dram
    pod.shared(cfg.socket_path())
    assert pod.env(pod.engine)["KVSTORE_TARGET"] == f"unix://{cfg.socket_path()}"
    assert {k for k in pod.env(pod.engine) if k.startswith("KVSTORE_")} <= CLIENT_ENV
    _, nvme = pod.mount(pod.sidecar, cfg.data_dir)
    assert nvme is not arena and not any(m["name"] == nvme["name"] for m in pod.engine.get("volumeMounts", []))
    if "emptyDir" in nvme:
        assert nvme["emptyDir"].get("medium", "") == "" and k8s_quantity(nvme["emptyDir"]["sizeLimit"]) >= cfg.nvme
    else:
        assert "hostPath" in nvme or "ephemeral" in nvme or "persistentVolumeClaim" in nvme, nvme
    if cfg.token_file:
        assert pod.shared(cfg.token_file).get("secret"), "the token comes from a Secret"
        assert pod.env(pod.engine)["KVSTORE_TOKEN_FILE"] == cfg.token_file


def test_sidecar_memory_accounts_for_the_arena(cluster: Cluster, tmp_path: Path) -> None:
    pod = cluster.pod()
    cfg = cluster.config(pod, tmp_path)
    res = pod.sidecar["resources"]
    # the sidecar touches every arena page first (prefault), so the tmpfs pages are charged to it
    assert cfg.prefault
    assert k8s_quantity(res["requests"]["memory"]) == k8s_quantity(res["limits"]["memory"]) >= cfg.dram + 256 * MiB


def test_etcd_is_a_statefulset_or_an_external_endpoint(cluster: Cluster, tmp_path: Path) -> None:
    cfg = cluster.config(cluster.pod(), tmp_path)
    endpoints = [hostport(e) for e in cfg.etcd.split(",")]
    sets = cluster.kind("StatefulSet")
    if not sets:
        assert all(not h.endswith("-etcd") for h, _ in endpoints)  # an external etcd
        return
    (sts,) = sets
    ((host, port),) = endpoints
    svc = cluster.named("Service", host)
    assert svc is not None and sts["spec"]["serviceName"] == host
    assert svc["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    (etcd,) = sts["spec"]["template"]["spec"]["containers"]
    (sp,) = [p for p in svc["spec"]["ports"] if p["port"] == port]
    listen = next(a.split("=", 1)[1] for a in etcd["command"] if a.startswith("--listen-client-urls="))
    assert container_port(etcd, sp["targetPort"]) == port == hostport(listen.removeprefix("http://"))[1]
    assert etcd["readinessProbe"] and sts["spec"]["replicas"] == 1


def test_dashboard_follows_the_cluster(cluster: Cluster, tmp_path: Path) -> None:
    pod = cluster.pod()
    cfg = cluster.config(pod, tmp_path)
    dash = [
        w
        for w in cluster.kind("Deployment")
        if w["spec"]["template"]["spec"]["containers"][0].get("args", [None])[0] == "dashboard"
    ]
    if not dash:
        return
    (w,) = dash
    (c,) = w["spec"]["template"]["spec"]["containers"]
    args = build_parser("dashboard").parse_args(c["args"])
    assert (args.etcd, args.cluster, args.metrics_port) == (cfg.etcd, cfg.cluster, cfg.metrics_port)
    port = hostport(args.listen)[1]
    probe = c["readinessProbe"]
    assert container_port(c, (probe.get("httpGet") or probe.get("tcpSocket"))["port"]) == port
    (svc,) = cluster.services_for(w["spec"]["template"]["metadata"]["labels"])
    assert {container_port(c, p["targetPort"]) for p in svc["spec"]["ports"]} == {port}
    if cfg.token_file:
        assert args.token_file == cfg.token_file
        m = next(m for m in c["volumeMounts"] if under(args.token_file, m["mountPath"]))
        vols = {v["name"]: v for v in w["spec"]["template"]["spec"]["volumes"]}
        assert vols[m["name"]]["secret"]["secretName"] == pod.shared(cfg.token_file)["secret"]["secretName"]
        assert "tcpSocket" in probe  # /healthz wants the token


def test_dashboard_scrapes_https_metrics_with_what_it_mounts(
    cluster: Cluster, secret_data: dict[str, dict[str, bytes]], tmp_path: Path
) -> None:
    """With TLS the nodes serve /metrics over HTTPS: the dashboard completes a handshake
    with a node (dialling its pod IP, or the server name it is given) using only its own
    mounts: the CA alone from the node's Secret, and its own certificate under mutual TLS."""
    pod = cluster.pod()
    cfg = cluster.config(pod, tmp_path)
    dash = [
        w
        for w in cluster.kind("Deployment")
        if w["spec"]["template"]["spec"]["containers"][0].get("args", [None])[0] == "dashboard"
    ]
    if not dash:
        return
    (w,) = dash
    spec = w["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    vols = {v["name"]: v for v in spec.get("volumes", [])}
    node_secrets = {pod.mount(pod.sidecar, f)[1]["secret"]["secretName"] for f in private_files(cfg)}
    for m in c.get("volumeMounts", []):  # never the node's key, nor the tenants' tokens
        sec = vols[m["name"]].get("secret", {})
        if sec.get("secretName") in node_secrets and sec["secretName"] != vols.get("token", {}).get("secret", {}).get(
            "secretName"
        ):
            assert [i["key"] for i in sec.get("items", [])] == ["ca.crt"], (
                f"the dashboard mounts more than the CA of {sec}"
            )
        assert m.get("readOnly")

    def content(path: str) -> bytes:
        m = max(
            (m for m in c.get("volumeMounts", []) if under(path, m["mountPath"])), key=lambda m: len(m["mountPath"])
        )
        sec = vols[m["name"]]["secret"]
        rel = str(PurePosixPath(path).relative_to(m["mountPath"]))
        key = next((i["key"] for i in sec["items"] if i["path"] == rel), None) if "items" in sec else rel
        assert key in secret_data.get(sec["secretName"], {}), f"{path}: Secret {sec['secretName']} has no key {key}"
        return secret_data[sec["secretName"]][key]

    def node_content(path: str) -> bytes:
        m, vol = pod.mount(pod.sidecar, path)
        return secret_data[vol["secret"]["secretName"]][str(PurePosixPath(path).relative_to(m["mountPath"]))]

    node_files = materialize(cfg, node_content, tmp_path / "node")
    check_dashboard_tls(cfg, node_files, dashboard_tls_options(c["args"], pod.env(c)), content, tmp_path)


def test_tls_and_tenant_files_come_from_secrets_the_node_accepts(
    cluster: Cluster, secret_data: dict[str, dict[str, bytes]], tmp_path: Path
) -> None:
    pod = cluster.pod()
    cfg = cluster.config(pod, tmp_path)

    def content(path: str) -> bytes:
        m, vol = pod.mount(pod.sidecar, path)
        assert "secret" in vol and m.get("readOnly") and "items" not in vol["secret"], (
            f"{path}: not a read-only Secret: {vol}"
        )
        name, key = vol["secret"]["secretName"], str(PurePosixPath(path).relative_to(m["mountPath"]))
        assert key in secret_data.get(name, {}), f"{path}: Secret {name} has no key {key}"
        return secret_data[name][key]

    for path in private_files(cfg):  # the node's key and the tenants' tokens: not even the engine beside it reads them
        m, _ = pod.mount(pod.sidecar, path)
        assert all(x["name"] != m["name"] for x in pod.engine.get("volumeMounts", [])), (
            f"{path} is mounted in the engine"
        )
    materialize(cfg, content, tmp_path)


def test_probes_reach_the_node_under_tls(cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kubelet's gRPC probes speak no TLS: with TLS on, every sidecar probe runs
    ``kvstore health`` on the Unix socket, in the sidecar's own environment."""
    pod = cluster.pod()
    cfg = cluster.config(pod, tmp_path)
    serve = build_parser("serve").parse_args(pod.sidecar["args"])
    for name in ("startupProbe", "readinessProbe", "livenessProbe"):
        p = pod.sidecar[name]
        handlers = set(p) & {"grpc", "httpGet", "tcpSocket", "exec"}
        if not cfg.tls_cert_file:
            assert handlers == {"grpc"}, name
            continue
        assert handlers == {"exec"}, name
        check = p["exec"]["command"]
        assert build_parser("health").parse_args(check[1:]).config == serve.config
        # the check's own deadline (--timeout, 3 s) plus a Python start-up; the kubelet's default is 1 s
        assert p.get("timeoutSeconds", 1) >= build_parser("health").parse_args(check[1:]).timeout + 1, name
        text = cluster.config_files(pod)[serve.config]
        assert health_target(check, text, pod.env(pod.sidecar), tmp_path, monkeypatch) == f"unix://{cfg.socket_path()}"


# -- the chart itself ---------------------------------------------------------------------
def test_chart_metadata_and_values_keys() -> None:
    meta = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert meta["apiVersion"] == "v2" and meta["name"] == "kvstore" and meta["appVersion"] == VERSION
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for variant in CHART_VARIANTS.values():
        extra = variant.get("kvstore", {}).get("config", {}) | values["kvstore"]["config"]
        assert set(extra) <= set(NodeConfig.model_fields), set(extra) - set(NodeConfig.model_fields)


@pytest.mark.parametrize("variant", list(CHART_VARIANTS))
def test_real_helm_renders_the_same(variant: str) -> None:
    assert chart_docs(CHART_VARIANTS[variant], "helm") == chart_docs(CHART_VARIANTS[variant], "lite")


def test_chart_defaults_match_the_plain_manifests(tmp_path: Path) -> None:
    plain, chart = Cluster(manifests()), Cluster(chart_docs({}))
    a, b = plain.config(plain.pod(), tmp_path), chart.config(chart.pod(), tmp_path)
    assert a == b
    assert sorted((d["kind"], d["metadata"]["name"]) for d in plain.docs) == sorted(
        (d["kind"], d["metadata"]["name"].replace("kvstore-inference", "inference")) for d in chart.docs
    )


@pytest.mark.parametrize(
    "config,error",
    [
        ({"no_such_key": 1}, "unknown config key"),
        ({"dram": "1GiB"}, "cannot read config file"),  # the chart sets it: a duplicate TOML key
        ({"max_batch": 0}, "max_batch"),
    ],
)
def test_chart_config_passthrough_goes_through_the_real_loader(
    config: dict[str, Any], error: str, tmp_path: Path
) -> None:
    c = Cluster(chart_docs({"kvstore": {"config": config}}))
    with pytest.raises(InvalidArgument, match=error):
        c.config(c.pod(), tmp_path)


@pytest.mark.parametrize(
    "values,error",
    [
        ({"tls": {"enabled": True}}, "tls.enabled needs tls.secretName"),
        ({"tls": {"clientCA": True, "secretName": "kvstore-tls"}}, "tls.clientCA (mutual TLS) needs tls.enabled"),
        (
            {"tenants": {"tokens": {"alice": "alice.token"}}, "auth": {"existingSecret": "t"}},
            "tenants.tokens needs tenants.existingSecret",
        ),
        (
            {"tenants": {"existingSecret": "kvstore-tenants", "tokens": {"alice": "alice.token"}}},
            "tenants need auth.existingSecret",
        ),
        (
            {"tls": {"enabled": True, "secretName": "kvstore-tls", "clientCA": True}},
            "the dashboard needs tls.dashboardSecretName",
        ),
        ({"kvstore": {"terminationGracePeriodSeconds": 30}}, "kvstore.terminationGracePeriodSeconds is computed now"),
    ],
)
@pytest.mark.parametrize("renderer", ["lite", "helm"])
def test_chart_refuses_tls_and_tenants_it_cannot_wire(values: dict[str, Any], error: str, renderer: str) -> None:
    import helm_lite

    with pytest.raises(helm_lite.ChartFailed if renderer == "lite" else Exception, match=re.escape(error)):
        chart_docs(values, renderer)


@pytest.mark.parametrize(
    "template,error",
    [
        ('{{ include "x" . }}', "include"),
        ("{{ .Values.nope }}", "missing"),
        ("{{ .Values.a | upper }}", "upper"),
        ("{{ .Values.big }}", "1e6"),
        ("{{ if .Values.a }}x{{ else if .Values.b }}y{{ end }}", "else"),
        ("{{ .Values.a", "unbalanced"),
        ("{{ with .Values.a }}{{ end }}", "with"),
    ],
)
def test_helm_lite_refuses_what_it_does_not_support(template: str, error: str) -> None:
    import helm_lite

    r = helm_lite.Renderer({"Values": {"a": "x", "big": 1_000_000}}, "t")
    with pytest.raises(helm_lite.TemplateError, match=error):
        r.render(helm_lite.parse(template, "t"), {})


def test_helm_lite_semantics() -> None:
    import helm_lite

    r = helm_lite.Renderer(
        {"Values": {"m": {"b": 2, "a": "x"}, "l": ["p", "q"], "n": 3, "e": ""}, "Chart": {"AppVersion": "9"}}, "t"
    )
    src = (
        "a:\n  {{- range $k, $v := .Values.m }}\n  {{ $k }}={{ toJson $v }}\n  {{- end }}\n"
        "b: {{ .Values.e | default .Chart.AppVersion | quote }} {{ add .Values.n 4 }}\n"
        "c:{{- toYaml .Values.l | nindent 2 }}\n{{- if .Values.e }}\nno{{ else }}\nyes{{ end }}"
    )
    assert r.render(helm_lite.parse(src, "t"), {}) == 'a:\n  a="x"\n  b=2\nb: "9" 7\nc:\n  - p\n  - q\nyes'


def iter_yaml_files() -> Iterator[Path]:
    yield DEPLOY / "compose.yaml"
    yield from (DEPLOY / f for f in COMPOSE_OVERRIDES.values())
    yield from sorted((DEPLOY / "k8s").glob("*.yaml"))
    yield from sorted((DEPLOY / "k8s" / "patches").glob("*.yaml"))
    yield CHART / "Chart.yaml"
    yield CHART / "values.yaml"


@pytest.mark.parametrize("path", list(iter_yaml_files()), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_yaml_files_parse(path: Path) -> None:
    assert list(yaml.safe_load_all(path.read_text()))


def test_prometheus_example_has_a_commented_https_variant() -> None:
    """Uncommented, the https job of deploy/prometheus/prometheus.yml is a scrape config
    like the plain one, with the CA (and, commented again, the client certificate)."""
    text = (DEPLOY / "prometheus" / "prometheus.yml").read_text()
    (plain,) = yaml.safe_load(text)["scrape_configs"]
    start = text.index("  # - job_name: kvstore-tls")
    block = text[start:].split("\n\n", 1)[0].splitlines()
    assert all(ln.startswith("  # ") for ln in block)
    (job,) = yaml.safe_load("\n".join(ln[4:] for ln in block))
    assert job["scheme"] == "https" and job["metrics_path"] == plain["metrics_path"]
    assert set(job["tls_config"]) == {"ca_file"} and job["static_configs"] == plain["static_configs"]
    again = "\n".join(re.sub(r"^(\s*)# ", r"\1", ln[4:]) for ln in block)  # the optional lines too
    (full,) = yaml.safe_load(again)
    assert set(full["tls_config"]) == {"ca_file", "server_name", "cert_file", "key_file"}
    assert full["authorization"]["type"] == "Bearer"

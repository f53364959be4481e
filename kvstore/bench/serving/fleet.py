"""The fleet a serving benchmark runs against: vLLM OpenAI servers and, for the store's
configurations, one kvstore node per engine, joined into one cluster over a private etcd.

Owned by :class:`Fleet`, a context manager: every process it starts (etcd, the nodes, the
``python -m vllm.entrypoints.openai.api_server`` servers and the processes vLLM starts
under them) is a child tied to this process (``kvstore.children.spawn``: it dies with
us) in a session of its own, and is stopped on exit, its whole process group killed if
it lingers; the nodes' arenas and the temporary directory go with them.

Configurations (:data:`CONFIGS`):

* ``baseline``: vLLM with its own prefix cache only;
* ``pool``: every engine with the kvstore connector (``kv_both``) on its own node,
  lookups cluster-wide (``lookup_target`` ``etcd://``), so an engine loads what any
  engine stored, pulling it from the other node when it is not on its own;
* ``pd``: ``prefill`` engines ``kv_producer`` and the others ``kv_consumer``; KV goes
  from the prefill engine's node to the decode engine through the store;
* ``conductor`` and ``conductor-pd``: the fleets of ``pool`` and ``pd``, each engine also
  publishing vLLM's KV events and registered in the cluster (connector setting
  ``advertise_url``), behind ``kvstore conductor`` (a process of its own): requests go
  to the conductor, which picks the engine (:mod:`kvstore.conductor`);
* ``null-connector`` (a reference, not run by default): every engine with a KV connector
  that does nothing (:mod:`kvstore.bench.serving.null_connector`), no node: what vLLM's
  own connector path costs, so that ``pool`` against it is what kvstore's connector costs.

Mock engines (``FleetSpec.engine = "sim"``, ``--engine sim``): ``kvstore sim serve``
processes of this Python (:mod:`kvstore.sim.server`, the simulator's engine model behind
vLLM's API, in real time) instead of vLLM servers, for ``baseline``, ``pool`` and
``conductor`` (:data:`SIM_CONFIGS`) only.  In ``pool`` each has a real kvstore node, as
vLLM's ``pool`` fleet does (one per engine, one cluster, replication = engines), and
moves KV scaled down ``kv_scale`` times through it (:mod:`kvstore.sim.live_pool`: lookups
from the cluster's view, loads, saves); the nodes' ``node_dram`` and ``node_nvme`` are
divided by the same scale, so they hold as many chunks as unscaled nodes of those sizes
would.  In ``conductor`` they have no nodes: they publish vLLM's KV events and register
themselves in a private etcd, which the conductor follows.  They are not bound to CPUs
(each is one light process).

Equal cores: every configuration's engines get the same CPUs.  vLLM's CPU backend binds
a worker's OpenMP threads and, left to itself (``auto``), reserves a core for engines
without a KV connector but none for engines with one on a 2-core machine, which would
give ``baseline`` half the compute of ``pool``.  Here each engine's worker is bound
explicitly (``VLLM_CPU_OMP_THREADS_BIND``) to its share of this process's CPUs
(:func:`engine_cpus`), the same for every configuration, and reported.  Once it is up,
the engine's other processes (its server and its engine core, with the connector's
scheduler half) are pinned to the same CPUs (:func:`pin_engine`): vLLM's engine core
busy-waits (``sched_yield``) for its worker's output, and left to float it spun on the
other engine's core, taking 1 to 8 s of CPU from the workers in a 15 s run, differently
in every run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvstore.children import VLLM_CPU_ENV, log_tail, nice_prefix, reclaim_shm, shm_names, spawn, stop
from kvstore.errors import InvalidArgument
from kvstore.sim.server import DEFAULT_KV_SCALE

DEFAULT_CONFIGS = ("baseline", "pool", "pd", "conductor", "conductor-pd")
"""What ``kvstore bench serving`` runs when ``--configs`` is not given."""
CONFIGS = (*DEFAULT_CONFIGS, "null-connector")
STORELESS_CONFIGS = ("baseline", "null-connector")
"""The vLLM configurations with no kvstore node (no store, no sessions to close)."""
NULL_CONNECTOR = ("NullConnector", "kvstore.bench.serving.null_connector")
"""``null-connector``'s KV connector class and module (:mod:`kvstore.bench.serving.null_connector`)."""
SIM_CONFIGS = ("baseline", "pool", "conductor")
"""What mock engines (``engine="sim"``) run."""
SIM_STORE_CONFIGS = ("pool",)
"""Of those, the ones whose mock engines move KV through kvstore nodes."""
ENGINE_KINDS = ("vllm", "sim")
SERVED_NAME = "kvstore-bench"


@dataclasses.dataclass
class Engine:
    """One vLLM server of the fleet."""

    name: str
    url: str  # http://host:port
    role: str  # "both" (baseline/pool), "prefill" or "decode"
    cpus: str  # the worker's CPU binding
    node: str = ""  # the kvstore node's target ("" without the connector)
    proc: subprocess.Popen[Any] | None = None
    log_path: Path | None = None
    alive: bool = True

    def log_tail(self, lines: int = 30) -> str:
        return log_tail(self.log_path, lines)


@dataclasses.dataclass(frozen=True)
class FleetSpec:
    """What to start (the CLI's options)."""

    model: str
    engines: int = 2
    prefill: int = 1  # pd: how many of the engines prefill
    max_model_len: int = 4096
    kv_cache_bytes: int = 64 << 20  # each engine's own KV cache (its "HBM")
    max_num_batched_tokens: int | None = None  # None: vLLM's default
    node_dram: str = "1GiB"
    node_nvme: str = "2GiB"
    connector_extra: tuple[tuple[str, Any], ...] = ()
    conductor_args: tuple[str, ...] = ()  # extra flags of `kvstore conductor` (conductor configurations)
    front_nice: int = 0  # the conductor's nice value (see renice)
    node_nice: int = 0  # the nodes' and etcd's nice value, set at exec (kvstore.children.nice_prefix)
    python: str = sys.executable
    start_timeout_s: float = 900.0
    engine: str = "vllm"  # "sim": mock engines (`kvstore sim serve`) instead of vLLM servers
    profile: str = "local"  # the mock engines' profile (name or file)
    kv_scale: int = DEFAULT_KV_SCALE  # mock engines' pool: KV bytes (and node sizes) divided by it
    cpus: tuple[str, ...] = ()  # each vLLM engine's CPUs ("0", "0,1"); () splits this process's evenly

    def __post_init__(self) -> None:
        if self.engine not in ENGINE_KINDS:
            raise InvalidArgument(f"engine must be one of {', '.join(ENGINE_KINDS)}, got {self.engine!r}")
        if self.engines < 1:
            raise InvalidArgument(f"--engines must be at least 1, got {self.engines}")
        if not 1 <= self.prefill < max(2, self.engines):
            raise InvalidArgument(f"--prefill must be between 1 and --engines - 1, got {self.prefill}")
        try:
            nice_prefix(self.node_nice)
        except ValueError as e:
            raise InvalidArgument(f"--node-nice: {e}") from None
        if isinstance(self.kv_scale, bool) or self.kv_scale < 1:
            raise InvalidArgument(f"--kv-scale must be at least 1, got {self.kv_scale}")


def engine_cpus(n: int, cpus: list[int] | None = None) -> list[str]:
    """The CPU binding of each of ``n`` engines: this process's CPUs split evenly (an
    engine per CPU when there are as many CPUs as engines; engines share CPUs round-robin
    when there are fewer)."""
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else cpus
    if n >= len(cpus):
        return [str(cpus[i % len(cpus)]) for i in range(n)]
    per = len(cpus) // n
    return [",".join(str(c) for c in cpus[i * per : (i + 1) * per]) for i in range(n)]


def roles(config: str, spec: FleetSpec) -> list[str]:
    if config not in CONFIGS:
        raise InvalidArgument(f"unknown configuration {config!r} (known: {', '.join(CONFIGS)})")
    if spec.engine == "sim" and config not in SIM_CONFIGS:
        raise InvalidArgument(f"mock engines run {', '.join(SIM_CONFIGS)} only, not {config!r}")
    if config in ("pd", "conductor-pd"):
        if spec.engines < 2:
            raise InvalidArgument(f"configuration {config} needs at least 2 engines (--engines)")
        return ["prefill"] * spec.prefill + ["decode"] * (spec.engines - spec.prefill)
    return ["both"] * spec.engines


def renice(pid: int, nice: int) -> bool:
    """Set every thread of process ``pid`` (0: this one) to ``nice``; False if not allowed.

    Why the benchmark does it: on a machine where the front (the conductor, the client)
    shares its cores with the engines, whose CPU workers busy-wait, a request waits for a
    core before the front sees it: the conductor's decisions took 10 x their CPU time at
    p99 and refusals 245 ms, none of it the conductor's work.  In a fleet the front has
    hosts of its own; a higher priority here is the nearest this machine comes to that.
    Linux sets the nice value per thread, and threads inherit their creator's."""
    tasks = Path(f"/proc/{pid or os.getpid()}/task")
    try:
        tids = [int(t.name) for t in tasks.iterdir()]
    except OSError:
        tids = [pid]
    ok = True
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except ProcessLookupError:
            continue
        except PermissionError:
            ok = False
    return ok


def pin_engine(e: Engine) -> bool:
    """Pin every thread of the engine's processes but its workers (whose OpenMP threads
    vLLM bound already) to the worker's CPUs ``e.cpus`` (``"0"``, ``"0,1"``); False where
    not possible (no such CPUs, a process gone).  Affinity is per thread on Linux, so each
    thread is set; threads started later inherit their creator's."""
    import psutil

    try:
        cpus = {int(c) for c in e.cpus.split(",")}
    except ValueError:
        return False
    if e.proc is None:
        return False
    try:
        root = psutil.Process(e.proc.pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return False
    ok = True
    for q in procs:
        try:
            if "Worker" in q.name():
                continue
            tids = [t.id for t in q.threads()]
        except psutil.Error:
            ok = False
            continue
        for tid in tids:
            try:
                os.sched_setaffinity(tid, cpus)
            except OSError:  # the thread ended, or the CPUs are not ours
                ok = False
    return ok


_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


def kv_bytes_per_token(model: str) -> int | None:
    """KV-cache bytes one token takes in a Hugging Face model directory's engine (keys and
    values of every layer: ``2 x layers x KV heads x head dim x dtype bytes``, from its
    ``config.json``), or None where the model is not a local directory or its config lacks
    the figures.  The conductor's ``--bytes-per-token``: its prior load costs per token."""
    try:
        cfg = json.loads((Path(model) / "config.json").read_text())
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return None
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    n = 2 * layers * kv_heads * head_dim * _DTYPE_BYTES.get(dtype, 2)
    return n if n > 0 else None


def _free_port() -> int:
    from kvstore.cluster.local_etcd import free_port

    return int(free_port("127.0.0.1"))


def _get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return int(r.status), r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return int(e.code), ""


class Fleet(contextlib.AbstractContextManager["Fleet"]):
    """The processes of one configuration (see the module docstring)."""

    def __init__(self, config: str, spec: FleetSpec, *, log_dir: Path | None = None) -> None:
        self.config = config
        self.spec = spec
        self.roles = roles(config, spec)
        self.engines: list[Engine] = []
        self.nodes: list[Any] = []  # kvstore.children.ServeProcess, one per engine (store configs)
        self.cluster_target = ""
        self.conductor: Engine | None = None  # the conductor configurations' front
        self._etcd: Any = None
        self._stack = contextlib.ExitStack()
        self._tmp = Path(self._stack.enter_context(tempfile.TemporaryDirectory(prefix=f"kvstore-serving-{config}-")))
        self.log_dir = log_dir or self._tmp
        self.started_s = 0.0

    @property
    def uses_store(self) -> bool:
        """Whether the fleet has kvstore nodes (mock engines: in :data:`SIM_STORE_CONFIGS` only)."""
        if self.simulated:
            return self.config in SIM_STORE_CONFIGS
        return self.config not in STORELESS_CONFIGS

    def node_sizes(self) -> tuple[int | str, int | str]:
        """Each node's DRAM and NVMe (``--node-dram``, ``--node-nvme``); for mock engines
        divided by ``kv_scale``, as their chunks are (an NVMe of 0 stays none)."""
        s = self.spec
        if not self.simulated:
            return s.node_dram, s.node_nvme
        from kvstore.node.config import parse_size

        dram, nvme = parse_size(s.node_dram), parse_size(s.node_nvme)
        if dram // s.kv_scale < 1 << 20:
            raise InvalidArgument(
                f"--node-dram {s.node_dram} scaled down {s.kv_scale} times is under 1 MiB: give at least "
                f"{s.kv_scale} MiB"
            )
        return dram // s.kv_scale, nvme // s.kv_scale

    @property
    def simulated(self) -> bool:
        return self.spec.engine == "sim"

    @property
    def conducted(self) -> bool:
        return self.config.startswith("conductor")

    def start(self) -> Fleet:
        t0 = time.perf_counter()
        # last on the way out: what killed vLLM servers left in /dev/shm (not held by anyone)
        self._stack.callback(reclaim_shm, shm_names())
        try:
            if self.uses_store:
                self._start_store()
            elif self.simulated and self.conducted:  # mock engines register in etcd for the conductor
                self._start_etcd()
            self._start_engines()
            if self.conducted:
                self._start_conductor()
        except BaseException:
            self.close()
            raise
        self.started_s = time.perf_counter() - t0
        return self

    def _start_etcd(self) -> tuple[Any, str]:
        """A private etcd and this fleet's cluster name in it (``cluster_target`` set)."""
        import uuid

        from kvstore.cluster.local_etcd import LocalEtcd, find_etcd

        if find_etcd() is None:
            raise InvalidArgument("etcd is not installed (scripts/setup.sh installs Debian's etcd-server)")
        etcd = self._etcd = self._stack.enter_context(LocalEtcd(self._tmp / "etcd", nice=self.spec.node_nice))
        name = f"serving-{uuid.uuid4().hex[:8]}"
        self.cluster_target = f"etcd://{etcd.endpoint}/{name}"
        return etcd, name

    def _start_store(self) -> None:
        import asyncio

        from kvstore.children import private_node
        from kvstore.cluster.etcd import ClusterStore

        etcd, name = self._start_etcd()

        async def configure() -> None:
            store = ClusterStore(etcd.endpoint, name)
            try:  # every node owns every chunk: an engine's own node is always an owner of what it saved
                await store.set_config("replication", len(self.roles))
            finally:
                await store.close()

        asyncio.run(configure())
        member = ("--etcd", etcd.endpoint, "--cluster", name)
        dram, nvme = self.node_sizes()
        nodes = [
            private_node(
                self._tmp / f"node{i}",
                *member,
                dram=dram,
                nvme=nvme,
                log_path=self.log_dir / f"{self.config}-node{i}.log",
                start=False,
                nice=self.spec.node_nice,
            )
            for i in range(len(self.roles))
        ]
        for n in nodes:
            self._stack.callback(n.close)
            n.spawn()
        for n in nodes:
            n.wait_ready(60.0)
        self.nodes = nodes

    def _sim_command(self, i: int, port: int) -> list[str]:
        """A mock engine (``kvstore sim serve``), from this Python; in ``pool`` on its own
        node, its lookups following the cluster; in the conductor's configuration with
        vLLM's KV events and registered in the fleet's etcd."""
        s = self.spec
        cmd = [s.python, "-m", "kvstore", "sim", "serve", "--port", str(port), "--profile", s.profile]
        cmd += ["--model", SERVED_NAME, "--max-model-len", str(s.max_model_len), "--seed", str(i)]
        if self.uses_store:
            cmd += ["--kv-node", self.nodes[i].target, "--kv-view", self.cluster_target, "--kv-scale", str(s.kv_scale)]
        if self.conducted:
            ev, replay = _free_port(), _free_port()
            cmd += ["--kv-events-endpoint", f"tcp://127.0.0.1:{ev}"]
            cmd += ["--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay}", "--etcd", self.cluster_target]
        return cmd

    def _command(self, i: int, role: str, port: int) -> list[str]:
        s = self.spec
        if self.simulated:
            return self._sim_command(i, port)
        cmd = [
            s.python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            s.model,
            "--served-model-name",
            SERVED_NAME,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--skip-tokenizer-init",
            "--dtype",
            "float32",
            "--max-model-len",
            str(s.max_model_len),
            "--kv-cache-memory-bytes",
            str(s.kv_cache_bytes),
            "--seed",
            "0",
        ]
        if s.max_num_batched_tokens:
            cmd += ["--max-num-batched-tokens", str(s.max_num_batched_tokens)]
        if self.config == "null-connector":
            name, module = NULL_CONNECTOR
            cfg = {"kv_connector": name, "kv_connector_module_path": module, "kv_role": "kv_both"}
            cmd += ["--kv-transfer-config", json.dumps(cfg)]
        if self.uses_store:
            kv_role = {"both": "kv_both", "prefill": "kv_producer", "decode": "kv_consumer"}[role]
            extra = {"target": self.nodes[i].target, "lookup_target": self.cluster_target, **dict(s.connector_extra)}
            if self.conducted:  # registered for the conductor, with the engine's KV events
                extra["advertise_url"] = f"http://127.0.0.1:{port}"
                ev, replay = _free_port(), _free_port()
                cmd += [
                    "--kv-events-config",
                    json.dumps(
                        {
                            "enable_kv_cache_events": True,
                            "publisher": "zmq",
                            "endpoint": f"tcp://*:{ev}",  # bound (a host makes vLLM connect out)
                            "replay_endpoint": f"tcp://*:{replay}",
                        }
                    ),
                ]
            cmd += [
                "--kv-transfer-config",
                json.dumps(
                    {
                        "kv_connector": "KVStoreConnector",
                        "kv_connector_module_path": "gpu_agent.vllm",
                        "kv_role": kv_role,
                        "kv_connector_extra_config": extra,
                        "kv_load_failure_policy": "recompute",
                    }
                ),
            ]
        return cmd

    def _start_engines(self) -> None:
        # mock engines are not bound: each is one light asyncio process
        if self.simulated:
            cpus = ["any"] * len(self.roles)
        elif self.spec.cpus:
            if len(self.spec.cpus) != len(self.roles):
                raise InvalidArgument(f"{len(self.spec.cpus)} CPU bindings for {len(self.roles)} engines")
            cpus = list(self.spec.cpus)
        else:
            cpus = engine_cpus(len(self.roles))
        for i, role in enumerate(self.roles):
            port = _free_port()
            name = f"{self.config}-{role}{i}" if role != "both" else f"{self.config}-engine{i}"
            log = self.log_dir / f"{name}.log"
            env = {
                **VLLM_CPU_ENV,
                **os.environ,
                "VLLM_CPU_OMP_THREADS_BIND": cpus[i],
                "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
                "PYTHONUNBUFFERED": "1",
            }
            with open(log, "w") as f:
                proc = spawn(self._command(i, role, port), stdout=f, stderr=subprocess.STDOUT, env=env)
            e = Engine(
                name,
                f"http://127.0.0.1:{port}",
                role,
                cpus[i],
                self.nodes[i].target if self.nodes else "",
                proc,
                log,
            )
            self.engines.append(e)
            self._stack.callback(_stop_engine, e)
        deadline = time.monotonic() + self.spec.start_timeout_s
        pending = list(self.engines)
        while pending:
            for e in list(pending):
                assert e.proc is not None
                if e.proc.poll() is not None:
                    raise RuntimeError(
                        f"engine {e.name} exited (code {e.proc.returncode}) while starting{e.log_tail()}"
                    )
                with contextlib.suppress(OSError):
                    if _get(e.url + "/v1/models", timeout=2.0)[0] == 200:
                        pending.remove(e)
            if pending and time.monotonic() > deadline:
                raise TimeoutError(
                    f"engine {pending[0].name} not ready in {self.spec.start_timeout_s:.0f} s{pending[0].log_tail()}"
                )
            if pending:
                time.sleep(1.0)
        if not self.simulated:
            for e in self.engines:
                pin_engine(e)

    def _start_conductor(self) -> None:
        """``kvstore conductor`` over the engines (listed, and found in etcd with their
        namespaces, nodes and KV events), ready once it knows every engine's KV events."""
        port = _free_port()
        cmd = [self.spec.python, "-m", "kvstore", "conductor", "--port", str(port), "--etcd", self.cluster_target]
        cmd += ["--pd"] if self.config == "conductor-pd" else []
        for e in self.engines:
            cmd += ["--engine", f"{e.url}={e.role}"]
        # its prior load costs in the served model's own KV bytes (the default is Llama-3-8B's)
        bpt = None if self.simulated else kv_bytes_per_token(self.spec.model)
        if bpt is not None and "--bytes-per-token" not in self.spec.conductor_args:
            cmd += ["--bytes-per-token", str(bpt)]
        cmd += list(self.spec.conductor_args)
        log = self.log_dir / f"{self.config}-conductor.log"
        with open(log, "w") as f:
            proc = spawn(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.conductor = Engine("conductor", f"http://127.0.0.1:{port}", "both", "", "", proc, log)
        self._stack.callback(_stop_engine, self.conductor)
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"the conductor exited (code {proc.returncode}) while starting{self.conductor.log_tail()}"
                )
            with contextlib.suppress(OSError, ValueError):
                code, text = _get(self.conductor.url + "/conductor/state", timeout=2.0)
                engines = json.loads(text)["engines"] if code == 200 else None
                # mock engines have no kvstore node to learn
                if engines is not None and all(e["kv_events"] and (e["node_id"] or self.simulated) for e in engines):
                    if self.spec.front_nice:
                        renice(proc.pid, self.spec.front_nice)
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the conductor did not learn every engine's registration in 60 s{self.conductor.log_tail()}"
                )
            time.sleep(0.5)

    def routing(self) -> dict[str, Any] | None:
        """The conductor's routing record (``/conductor/state``), None without one."""
        if self.conductor is None:
            return None
        try:
            code, text = _get(self.conductor.url + "/conductor/state", timeout=10.0)
            return dict(json.loads(text)["routing"]) if code == 200 else None
        except (OSError, ValueError, KeyError):
            return None

    def metrics(self) -> dict[str, dict[str, float]]:
        """Each live engine's Prometheus counters (``/metrics``), summed over labels."""
        return {e.name: scrape(e.url) for e in self.engines if e.alive}

    def node_counters(self) -> dict[str, dict[str, int]]:
        """Each node's counters (``get_hits_dram``, ``get_hits_nvme``, ...)."""
        from client import KVClient

        out: dict[str, dict[str, int]] = {}
        for i, n in enumerate(self.nodes):
            try:
                with KVClient(n.target) as c:
                    out[f"node{i}"] = {k: int(v) for k, v in c.stats()["counters"].items()}
            except Exception:  # a node that died is reported as missing, not fatal
                out[f"node{i}"] = {}
        return out

    def close_session(self, session_id: str) -> None:
        """A trace's ``close_session`` event: every node hears it (the session's blocks go first)."""
        from client import KVClient

        for n in self.nodes:
            with KVClient(n.target) as c:
                c.close_session(session_id)

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time (user + system) each process of the fleet has used so far: per engine its
        server (``NAME/api``), engine core (``NAME/core``: vLLM's scheduler, the connector's
        lookups) and workers (``NAME/worker``: the model, the connector's loads and saves);
        every node; etcd; the conductor."""
        import psutil

        def times(p: Any) -> float:
            try:
                t = p.cpu_times()
                return float(t.user + t.system)
            except psutil.Error:
                return 0.0

        out: dict[str, float] = {}
        for e in self.engines:
            if e.proc is None:
                continue
            try:
                root = psutil.Process(e.proc.pid)
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                continue
            for q in procs:
                try:
                    name = q.name()
                except psutil.Error:
                    continue
                part = "core" if "EngineCore" in name else "worker" if "Worker" in name else "api"
                key = f"{e.name}/{part}"
                out[key] = out.get(key, 0.0) + times(q)
        for i, n in enumerate(self.nodes):
            if n.proc is not None:
                with contextlib.suppress(psutil.Error):
                    out[f"node{i}"] = times(psutil.Process(n.proc.pid))
        if self._etcd is not None and self._etcd.pid is not None:
            with contextlib.suppress(psutil.Error):
                out["etcd"] = times(psutil.Process(self._etcd.pid))
        if self.conductor is not None and self.conductor.proc is not None:
            with contextlib.suppress(psutil.Error):
                out["conductor"] = times(psutil.Process(self.conductor.proc.pid))
        return out

    def close(self) -> None:
        self._stack.close()

    def __exit__(self, *exc: object) -> None:
        self.close()


SPLIT_LABELS = ("source",)
"""Labels whose values are kept apart (as ``name{label="value"}``) besides the sum over labels."""


def parse_metrics(text: str) -> dict[str, float]:
    """A Prometheus exposition as {sample name: value}, summed over labels (an engine's
    ``model_name`` and ``engine``, ...), with two exceptions, so that what is summed still
    means something:

    * a histogram's ``_bucket`` samples are keyed by their bound, ``name{le="0.005"}``
      (summed over the other labels), never merged into one ``name_bucket``: the bounds
      are kept as the exposition writes them (``+Inf`` included), and
      :func:`kvstore.bench.serving.report.histogram` reads them back;
    * a sample with a label of :data:`SPLIT_LABELS` (vLLM's ``source`` of
      ``vllm:prompt_tokens_by_source``) also counts under ``name{source="..."}``, beside
      the unchanged sum under its plain name.

    Every other sample is keyed by its name alone, as before."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}

    def add(key: str, v: float) -> None:
        out[key] = out.get(key, 0.0) + v

    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            v = float(s.value)
            if s.name.endswith("_bucket") and "le" in s.labels:
                add(f'{s.name}{{le="{s.labels["le"]}"}}', v)
                continue
            add(s.name, v)
            for label in SPLIT_LABELS:
                if label in s.labels:
                    add(f'{s.name}{{{label}="{s.labels[label]}"}}', v)
    return out


def scrape(url: str) -> dict[str, float]:
    """An engine's ``/metrics`` as :func:`parse_metrics` reads it ({} when it does not answer)."""
    try:
        code, text = _get(url + "/metrics", timeout=10.0)
    except OSError:
        return {}
    if code != 200:
        return {}
    return parse_metrics(text)


# -- faults: kvstore nodes killed and restarted during a replay ----------------------------

FAULT_ACTIONS = ("kill", "restart")


@dataclasses.dataclass(frozen=True, order=True)
class Fault:
    """One action of ``--fault``: at ``at_s`` seconds after the replay's start, ``kill``
    (SIGKILL to the node's process group, as a crash) or ``restart`` (start it again on the
    same data directory, node id, tiers, arena file, Unix socket and TCP ports; a node
    that is still running is stopped first, gracefully) the fleet's node ``node`` (its
    index: ``node0`` is the first engine's)."""

    at_s: float
    node: int
    action: str

    def to_json(self) -> dict[str, Any]:
        return {"action": self.action, "node": self.node, "at_s": self.at_s}


def parse_faults(specs: Sequence[str], *, nodes: int | None = None) -> tuple[Fault, ...]:
    """``--fault`` values (each ``ACTION:NODE@SECONDS[,...]``, ``NODE`` as ``node1`` or
    ``1``) as a plan sorted by time.  A clear :class:`InvalidArgument` for an unknown
    action, a malformed item, a negative or infinite time, a node index outside
    ``0..nodes-1``, two actions on one node at one time, or a kill of a node an earlier
    kill left down (restart it first)."""
    plan: list[Fault] = []
    for spec in specs:
        items = [x.strip() for x in spec.split(",")]
        if not any(items):
            raise InvalidArgument(f"--fault: empty spec {spec!r} (e.g. kill:node1@20,restart:node1@40)")
        for item in items:
            action, sep, rest = item.partition(":")
            node, at_sep, at = rest.partition("@")
            if not sep or not at_sep or not node or not at:
                raise InvalidArgument(
                    f"--fault: {item!r} is not ACTION:NODE@SECONDS (e.g. kill:node1@20,restart:node1@40)"
                )
            if action not in FAULT_ACTIONS:
                raise InvalidArgument(
                    f"--fault: unknown action {action!r} in {item!r} (known: {', '.join(FAULT_ACTIONS)})"
                )
            digits = node[len("node") :] if node.startswith("node") else node
            if not digits.isdigit():
                raise InvalidArgument(f"--fault: node {node!r} in {item!r} must be nodeN or N (N: the node's index)")
            try:
                at_s = float(at)
            except ValueError:
                raise InvalidArgument(f"--fault: time {at!r} in {item!r} is not a number of seconds") from None
            if not math.isfinite(at_s) or at_s < 0:
                raise InvalidArgument(f"--fault: time {at!r} in {item!r} must be zero or more seconds")
            index = int(digits)
            if nodes is not None and index >= nodes:
                raise InvalidArgument(
                    f"--fault: node {node!r} in {item!r}: the fleet has {nodes} node(s), node0..node{nodes - 1}"
                )
            plan.append(Fault(at_s, index, action))
    plan.sort()
    down: set[int] = set()
    seen: set[tuple[int, float]] = set()
    for f in plan:
        if (f.node, f.at_s) in seen:
            raise InvalidArgument(f"--fault: two actions on node{f.node} at {f.at_s:g} s (give them different times)")
        seen.add((f.node, f.at_s))
        if f.action == "kill":
            if f.node in down:
                raise InvalidArgument(f"--fault: node{f.node} is killed at {f.at_s:g} s while down (restart it first)")
            down.add(f.node)
        else:
            down.discard(f.node)
    return tuple(plan)


class FaultScheduler:
    """Carries out a fault plan against a fleet's nodes, on a thread of its own, timed
    from the replay's start (``start(t0)``, ``t0`` on :func:`time.monotonic`, the runner's
    clock).  ``finish()`` stops it: an action in progress completes (a restart waits for
    its READY), the ones not reached are reported as such.  Owns ``results``: one
    ``{"action", "node", "at_s", "done_at_s", "error"}`` per planned action, written by
    its thread and read after ``finish``; ``done_at_s`` is when the action completed
    (None: it did not), ``error`` why it failed (None: it did not)."""

    def __init__(self, nodes: Sequence[Any], plan: Sequence[Fault], *, ready_timeout_s: float = 60.0) -> None:
        self.nodes = list(nodes)  # kvstore.children.ServeProcess
        self.plan = list(plan)
        self.ready_timeout_s = ready_timeout_s
        self.results = [{**f.to_json(), "done_at_s": None, "error": None} for f in self.plan]
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0

    def start(self, t0: float) -> None:
        self._t0 = t0
        self._thread = threading.Thread(target=self._run, name="kvstore-bench-faults", daemon=True)
        self._thread.start()

    def finish(self) -> list[dict[str, Any]]:
        """Stop (see the class docstring) and return ``results``."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return self.results

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for every action to be carried out; True if they were."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self._thread is not None and not self._thread.is_alive()

    def _now(self) -> float:
        return time.monotonic() - self._t0

    def _run(self) -> None:
        for f, res in zip(self.plan, self.results, strict=True):
            if self._stop.wait(max(0.0, f.at_s - self._now())):
                res["error"] = f"not carried out: the replay ended at {self._now():.1f} s"
                continue
            try:
                node = self.nodes[f.node]
                if f.action == "kill":
                    self._kill(node)
                else:
                    self._restart(node)
                res["done_at_s"] = round(self._now(), 3)
            except Exception as e:  # a fault that fails is reported, never fatal
                res["error"] = f"{type(e).__name__}: {e}"

    @staticmethod
    def _kill(node: Any) -> None:
        proc = node.proc
        if proc is None or proc.poll() is not None:
            raise RuntimeError("the node is not running")
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # spawn() made it a session (and group) leader
        except (ProcessLookupError, PermissionError):
            proc.kill()
        proc.wait()

    def _restart(self, node: Any) -> None:
        old = dict(node.endpoints)
        if node.running():
            rc = node.stop()
            if rc != 0:
                raise RuntimeError(f"the node exited with {rc} on SIGTERM before its restart")
        # the same command as before (data directory, node id, tiers, arena, cluster) and the
        # same TCP ports, so engines and peers find it where they left it
        if old.get("grpc"):
            node.listen = old["grpc"]
        if old.get("data") and "--data-listen" not in node.args:
            node.args += ["--data-listen", old["data"]]
        node.spawn().wait_ready(self.ready_timeout_s)


def _stop_engine(e: Engine) -> None:
    """SIGTERM the server (it stops the engine core and workers), then kill what is left of its session."""
    if e.proc is None:
        return
    stop(e.proc, timeout=30)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(e.proc.pid, signal.SIGKILL)  # spawn() made it a session (and group) leader
        deadline = time.monotonic() + 5  # gone, mappings and all, before /dev/shm is swept
        while time.monotonic() < deadline:
            os.killpg(e.proc.pid, 0)
            time.sleep(0.05)

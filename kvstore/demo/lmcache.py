"""``kvstore demo lmcache``: vLLM with LMCache's multi-process server, kvstore as its L2.

Three configurations serve the same prompts on real vLLM CPU engines (random weights, token
ids in and out):

* ``none``: vLLM alone, no cache (the reference every result is compared with);
* ``lmcache-fs``: LMCache's multi-process connector and server, its L2 LMCache's own
  local-disk adapter (``fs``);
* ``lmcache-kvstore``: the same server with kvstore as its L2 (``gpu_agent.lmcache``).

Each prompt is computed once on each LMCache engine (its chunks go to the server's L1 and on
to its L2); then the server's L1 is emptied and vLLM's prefix cache reset, so the prompt can
only come back from L2: that hit's TTFT is what the table compares, against the reference's
full prefill.  The summary (``--json``) has ``hit_tokens`` (prompt tokens the kvstore engine
did not compute), ``tokens_equal`` (every configuration's greedy tokens equal the
reference's), ``ttft_ms`` per configuration (median over the prompts) and ``backend_reads``
(chunks the node handed to LMCache's server).

:class:`LMCacheServer` starts a real ``lmcache server`` (the tests use it too).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ENGINE_EXTRA = "lmcache.mp."
"""The prefix of LMCache's multi-process connector's keys in vLLM's ``kv_connector_extra_config``."""


def kvstore_l2(target: str, **params: Any) -> dict[str, Any]:
    """The ``--l2-adapter`` JSON that makes kvstore an LMCache server's L2."""
    return {
        "type": "plugin",
        "module_path": "gpu_agent.lmcache",
        "class_name": "KVStoreL2Adapter",
        "adapter_params": {"target": target, **params},
    }


class LMCacheServer:
    """A real ``lmcache server`` process (LMCache's CLI, from this environment) with a CPU L1
    of ``l1_gb`` and one ``--l2-adapter``; :meth:`clear_l1` empties L1 through its HTTP API.
    It dies with its parent; :meth:`close` stops it."""

    def __init__(self, l2: dict[str, Any], log: Path, *, l1_gb: float = 0.25, chunk: int = 256) -> None:
        from kvstore.children import spawn
        from kvstore.cluster.local_etcd import free_port

        self.port, self.http_port = free_port(), free_port()
        self.log_path = log
        self._log = open(log, "w")
        cli = "import sys; from lmcache.cli.main import main; sys.argv[0] = 'lmcache'; sys.exit(main())"
        args = {
            "--host": "127.0.0.1",
            "--port": str(self.port),
            "--http-port": str(self.http_port),
            "--chunk-size": str(chunk),
            "--l1-size-gb": str(l1_gb),
            "--eviction-policy": "LRU",
            # the default (lmcache_driven) has no handler for a CPU engine's registration: it hangs
            "--supported-transfer-mode": "auto",
            "--l2-adapter": json.dumps(l2),
        }
        self.proc = spawn(
            [sys.executable, "-c", cli, "server", *(x for kv in args.items() for x in kv)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "LMCACHE_DISABLE_BANNER": "1"},
        )

    def wait_ready(self, timeout: float = 120.0) -> LMCacheServer:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"lmcache server exited ({self.proc.returncode}):\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/metrics", timeout=2):
                    return self
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"lmcache server not ready in {timeout} s:\n{self.log_tail()}") from None
                time.sleep(0.5)

    def clear_l1(self) -> None:
        """Empty the server's L1 (LMCache's ``POST /cache/clear``)."""
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.http_port}/cache/clear",
            data=json.dumps({"tier": "l1"}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            if r.status != 200:
                raise RuntimeError(f"lmcache server refused /cache/clear: {r.status} {r.read()!r}")

    def engine_connector(self) -> dict[str, Any]:
        """An ``EngineProcess`` ``connector`` for LMCache's multi-process connector with this
        server (vLLM's own copy of that connector is CUDA-only: the module path picks LMCache's)."""
        return {
            "name": "LMCacheMPConnector",
            "module": "lmcache.integration.vllm.lmcache_mp_connector",
            "role": "kv_both",
            "extra": {f"{ENGINE_EXTRA}host": "tcp://127.0.0.1", f"{ENGINE_EXTRA}port": self.port},
        }

    def log_tail(self, n: int = 30) -> str:
        self._log.flush()
        return "".join(self.log_path.read_text(errors="replace").splitlines(keepends=True)[-n:])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()


def _agent_blocks(metrics_url: str, agent: str, op: str, result: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(metrics_url, timeout=10) as r:
        for fam in text_string_to_metric_families(r.read().decode()):
            for s in fam.samples:
                if s.name == "kvstore_agent_blocks_total" and s.labels == {"agent": agent, "op": op, "result": result}:
                    return float(s.value)
    return 0.0


def agent_reads(metrics_url: str, agent: str) -> float:
    """Blocks a node handed to ``agent`` (its ``kvstore_agent_blocks_total`` read hits)."""
    return _agent_blocks(metrics_url, agent, "read", "hit")


def agent_writes(metrics_url: str, agent: str) -> float:
    """Blocks a node stored for ``agent``."""
    return _agent_blocks(metrics_url, agent, "write", "stored")


def _until(done: Any, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not receive the prompt's chunks within {timeout} s")
        time.sleep(0.1)


def run(a: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    import numpy as np

    from kvstore.children import private_node
    from kvstore.demo.engine import EngineProcess, make_model

    chunk, n, max_len = int(a.chunk_tokens), int(a.prompt_tokens), int(a.prompt_tokens) + int(a.new_tokens) + 16
    with contextlib.ExitStack() as stack:
        node = private_node(workdir / "node", "--metrics-port", "0", dram=a.dram, nvme=0, log_path=workdir / "node.log")
        stack.callback(node.close)
        servers = {
            "lmcache-fs": LMCacheServer(
                {"type": "fs", "base_path": str(workdir / "fs-l2")}, workdir / "lmcache-fs.log", chunk=chunk
            ),
            "lmcache-kvstore": LMCacheServer(kvstore_l2(node.target), workdir / "lmcache-kvstore.log", chunk=chunk),
        }
        for s in servers.values():
            stack.callback(s.close)
            s.wait_ready()
        model = make_model(workdir / "model", layers=a.layers or 4, hidden=a.hidden or 512, max_tokens=max_len)
        engines = {
            name: EngineProcess(
                model,
                max_tokens=max_len,
                kv_bytes=256 << 20,
                connector=None if name == "none" else servers[name].engine_connector(),
                log_path=workdir / f"engine-{name}.log",
            )
            for name in ("none", *servers)
        }
        for e in engines.values():
            stack.callback(e.close)
        for e in engines.values():
            e.wait_ready()
        rng = np.random.default_rng(a.seed)
        prompts = [rng.integers(1, 31000, n).tolist() for _ in range(a.repeat)]
        ttft: dict[str, list[float]] = {name: [] for name in engines}
        equal = True
        hit_tokens: list[int] = []
        reads0 = agent_reads(node.endpoints["metrics"], "lmcache-l2")
        metrics = node.endpoints["metrics"]
        fs_dir = workdir / "fs-l2"
        stored = dict.fromkeys(servers, 0)
        wait_l2 = {
            "lmcache-fs": lambda k: _until(lambda: len(list(fs_dir.glob("*.data"))) >= k, "LMCache's fs L2"),
            "lmcache-kvstore": lambda k: _until(lambda: agent_writes(metrics, "lmcache-l2") >= k, "kvstore"),
        }
        for tokens in prompts:
            want = engines["none"].generate(tokens, max_tokens=a.new_tokens)
            ttft["none"].append(float(want["ttft_ms"]))
            for name, server in servers.items():
                eng = engines[name]
                first = eng.generate(tokens, max_tokens=a.new_tokens)  # computes, stores to L1 and L2
                equal &= first["tokens"] == want["tokens"]
                stored[name] += n // chunk  # LMCache stores whole chunks: its server writes L2 behind the request
                wait_l2[name](stored[name])
                server.clear_l1()
                eng.reset_prefix_cache()
                hit = eng.generate(tokens, max_tokens=a.new_tokens)
                equal &= hit["tokens"] == want["tokens"]
                ttft[name].append(float(hit["ttft_ms"]))
                if name == "lmcache-kvstore":
                    hit_tokens.append(int(hit.get("num_cached_tokens") or 0))
        reads = agent_reads(node.endpoints["metrics"], "lmcache-l2") - reads0
    return {
        "hit_tokens": int(statistics.median(hit_tokens)) if hit_tokens else 0,
        "prompt_tokens": n,
        "tokens_equal": bool(equal),
        "ttft_ms": {name: round(statistics.median(v), 2) for name, v in ttft.items()},
        "ttft_ms_all": {name: [round(x, 2) for x in v] for name, v in ttft.items()},
        "backend_reads": int(reads),
        "prompts": len(prompts),
    }


def format_table(r: dict[str, Any]) -> str:
    lines = [
        f"{r['prompts']} prompt(s) of {r['prompt_tokens']} tokens; L2 hits after the server's L1 was cleared",
        f"{'configuration':<18} {'TTFT p50 ms':>12}",
    ]
    for name, ms in r["ttft_ms"].items():
        lines.append(f"{name:<18} {ms:>12.1f}")
    lines.append(
        f"kvstore: {r['hit_tokens']} prompt tokens not computed, {r['backend_reads']} chunk(s) read from the node; "
        + ("tokens equal vLLM alone" if r["tokens_equal"] else "MISMATCH: tokens differ from vLLM alone")
    )
    return "\n".join(lines)


def main(a: argparse.Namespace) -> int:
    try:
        import lmcache  # noqa: F401
    except ImportError:
        print(
            "kvstore demo lmcache: LMCache is not installed here (scripts/setup.sh --vllm --lmcache)", file=sys.stderr
        )
        return 2
    a.repeat = max(1, int(a.repeat))
    if a.log_dir:
        workdir = Path(a.log_dir)
        workdir.mkdir(parents=True, exist_ok=True)
        r = run(a, workdir)
    else:
        with tempfile.TemporaryDirectory(prefix="kvstore-demo-lmcache-") as d:
            r = run(a, Path(d))
    print(json.dumps(r) if a.json else format_table(r))
    return 0 if r["tokens_equal"] and r["backend_reads"] > 0 else 1

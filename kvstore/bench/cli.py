"""``kvstore bench SUBCOMMAND``: one subcommand per benchmark, each its own module.

Every benchmark module exports ``add_arguments(parser)`` and ``main(args) -> int``; this
module only parses ``kvstore bench``'s command line and picks the module, importing the
one that runs and no other (a benchmark's heavy imports, torch or vLLM, never slow or
break another).  Plain ``kvstore bench [FLAGS]`` is ``kvstore bench sdk``.

The flag ladder of earlier releases (``kvstore bench --engine``, ``--connector``,
``--latency``, ``--engine --index-blocks N``, ``--cluster-sim``, ``--conductor-sim``) and
``kvstore cluster bench-placement`` still run, with a deprecation message on stderr: the
selecting flag names the subcommand, the other flags are that subcommand's own (their old
names are kept as aliases).  They go in the release after next.

State: none.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "sdk": (
        "kvstore.bench.sdk",
        "the SDK's data paths (local shared memory, TCP data channel, gRPC stream) against memcpy, "
        "a raw socket and Redis (plain `kvstore bench` runs this)",
    ),
    "engine": ("kvstore.bench.engine", "the storage engine in-process: DRAM tier vs memcpy, NVMe tier vs direct I/O"),
    "index": (
        "kvstore.bench.index",
        "a node's NVMe tier filled with N small blocks: restart time, index size, lookup cost",
    ),
    "latency": ("kvstore.bench.latency", "p50/p99 of single-block put/get/exists/match_prefix, local and TCP"),
    "connector": (
        "kvstore.bench.connector",
        "the engine's data path (the GPU agent vLLM's connector drives) against memcpy; load latency per tier",
    ),
    "gpu": (
        "kvstore.bench.gpu",
        "arena <-> HBM copies against pinned cudaMemcpyAsync, and load/compute overlap (CUDA)",
    ),
    "placement": (
        "kvstore.bench.placement",
        "placement at 3..1,024 nodes in-process: us/key against rendezvous, keys moved, balance, owners per request",
    ),
    "cluster-sim": (
        "kvstore.bench.cluster_sim",
        "cluster figures at sizes one machine cannot run: placement, moves, balance, fan-out, hot-node load, "
        "membership convergence against a private etcd",
    ),
    "conductor-sim": (
        "kvstore.bench.conductor_sim",
        "the conductor's decision time per request over a simulated fleet (target <= 1 ms)",
    ),
    "serving": (
        "kvstore.bench.serving.cli",
        "a request trace through fleets of real vLLM servers, with and without the store: TTFT, TBT, goodput",
    ),
}
"""Subcommand → (module with ``add_arguments``/``main``, one line of help)."""

_LEGACY: tuple[tuple[str, str], ...] = (
    ("--cluster-sim", "cluster-sim"),
    ("--conductor-sim", "conductor-sim"),
    ("--connector", "connector"),
    ("--engine", "engine"),
    ("--latency", "latency"),
)
"""The old selecting flags, in the order the old ``kvstore bench`` tested them."""


def _legacy(argv: Sequence[str]) -> tuple[str, list[str]]:
    """The subcommand and its arguments for an old-style ``kvstore bench FLAGS`` line."""
    given = {flag for flag, _ in _LEGACY if flag in argv}
    index = any(a == "--index-blocks" or a.startswith("--index-blocks=") for a in argv)
    sub = "sdk"
    for flag, name in _LEGACY:
        if flag in given:
            sub = "index" if name == "engine" and index else name
            break
    rest = [a for a in argv if a not in given]
    if given:
        old = " ".join(f for f, _ in _LEGACY if f in given)
        print(
            f"kvstore: `kvstore bench {old}` is deprecated and goes in the release after next: "
            f"run `kvstore bench {sub} ...` (the other flags are the same)",
            file=sys.stderr,
            flush=True,
        )
    return sub, rest


def overview() -> argparse.ArgumentParser:
    """``kvstore bench --help``: the subcommands, one line each (no module imported)."""
    p = argparse.ArgumentParser(
        prog="kvstore bench",
        description="Benchmarks, every figure a ratio against a reference measured in the same run.",
        epilog="Plain `kvstore bench [FLAGS]` runs `sdk`; `kvstore bench SUBCOMMAND --help` lists its flags.",
    )
    sub = p.add_subparsers(dest="bench", metavar="SUBCOMMAND")
    for name, (_module, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return p


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """Parse ``kvstore bench``'s arguments (``argv`` after ``bench``); ``args.fn`` runs it."""
    argv = list(argv)
    if argv and argv[0] in SUBCOMMANDS:
        name, rest = argv[0], argv[1:]
    elif argv and argv[0] in ("-h", "--help"):
        overview().print_help()
        raise SystemExit(0)
    else:
        name, rest = _legacy(argv)
    module, help_text = SUBCOMMANDS[name]
    mod = importlib.import_module(module)
    doc = (mod.__doc__ or help_text).split("\n\n")[0].strip().replace("``", "`")
    p = argparse.ArgumentParser(prog=f"kvstore bench {name}", description=doc)
    mod.add_arguments(p)
    args = p.parse_args(rest)
    args.fn = mod.main
    return args


def cluster_bench_placement(argv: Sequence[str]) -> argparse.Namespace:
    """``kvstore cluster bench-placement ...`` (deprecated): ``kvstore bench placement ...``."""
    print(
        "kvstore: `kvstore cluster bench-placement` is deprecated and goes in the release after next: "
        "run `kvstore bench placement ...`",
        file=sys.stderr,
        flush=True,
    )
    return parse(["placement", *argv])

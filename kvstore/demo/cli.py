"""``kvstore demo``: the subcommand's arguments and its dispatch to one demo module.

    kvstore demo pd       # prefill -> decode handoff, a small random Llama (kvstore.demo.pd)
    kvstore demo vllm     # the same with real vLLM engines and the connector (kvstore.demo.vllm)
    kvstore demo lmcache  # vLLM with LMCache's server, kvstore as its L2 (kvstore.demo.lmcache)

The CLI imports this module only when ``kvstore demo`` runs, and this module imports the
chosen demo (and with it torch, transformers or vLLM) only in :func:`main`.
"""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "scenario",
        choices=["pd", "vllm", "lmcache"],
        help="pd: prefill -> decode handoff through the store; "
        "vllm: the same with real vLLM engine processes and the vLLM connector (in .venv-vllm); "
        "lmcache: vLLM with LMCache's multi-process server, kvstore as its L2, against LMCache's own "
        "disk L2 and vLLM alone (in .venv-vllm with LMCache: setup.sh --vllm --lmcache)",
    )
    p.add_argument("--prompt-tokens", type=int, default=4096, help="prompt length (default 4096)")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens to generate (default 32)")
    p.add_argument(
        "--chunk-tokens", type=int, default=256, help="store chunk size in tokens, a multiple of 16 (default 256)"
    )
    p.add_argument("--seed", type=int, default=0, help="model weights and prompt seed (default 0)")
    p.add_argument("--layers", type=int, help="transformer layers of the demo model (default 4)")
    p.add_argument("--hidden", type=int, help="hidden size of the demo model (default: pd 256, vllm 512)")
    p.add_argument(
        "--target", help="use this running node (unix:///path) instead of a private one; skips the NVMe scenario"
    )
    p.add_argument("--dram", default="256MiB", help="DRAM tier of the private node (default 256MiB)")
    p.add_argument("--nvme", default="512MiB", help="NVMe tier of the private node (default 512MiB)")
    p.add_argument("--device", help="torch device of the workers (default: cuda if available, else cpu)")
    p.add_argument("--repeat", type=int, default=3, help="runs per scenario; TTFT is the fastest (default 3)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument(
        "--log-dir", help="vllm: keep each engine's and node's log in this directory (default: a temporary one)"
    )
    p.add_argument(
        "--async-loads",
        choices=["auto", "always", "never"],
        default="auto",
        help="vllm: the decode engines' async_loads (default auto: NVMe and remote hits load while the batch runs on)",
    )


def main(a: argparse.Namespace) -> int:
    if a.scenario == "vllm":
        from kvstore.demo.vllm import main as vllm_main

        return vllm_main(a)
    if a.scenario == "lmcache":
        from kvstore.demo.lmcache import main as lmcache_main

        return lmcache_main(a)
    from kvstore.demo.pd import main as pd_main

    return pd_main(a)

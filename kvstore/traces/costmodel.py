"""Prefill time a cache saves: recomputing hit tokens, less loading their KV from DRAM or NVMe.

    saved = hit_tokens / recompute_tokens_per_s
            − dram_hit_blocks × block_bytes / dram_load_Bps − nvme_hit_blocks × block_bytes / nvme_load_Bps

Inputs are measured, not assumed: the load rates come from ``kvstore bench engine --json``
(``dram_get_gbps``, ``nvme_read_gbps``; ``--bench FILE``) or are given (``--dram-gbps``,
``--nvme-gbps``), the recompute rate from the engine (``--recompute-tps``, e.g. the prefill
throughput ``kvstore demo`` prints), the KV size per token from the model
(``--bytes-per-token``).  A figure whose inputs are missing is not reported.  Pure
functions; the replay and the planner call them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from typing import Any

from kvstore.errors import InvalidArgument


@dataclasses.dataclass(frozen=True, slots=True)
class CostModel:
    recompute_tps: float  # prefill tokens per second the engine computes
    bytes_per_token: int  # KV bytes per token
    dram_gbps: float  # loading KV from the node's DRAM, GB/s (1e9 bytes)
    nvme_gbps: float  # ... from its NVMe tier

    def saved_s(self, hit_tokens: int, dram_blocks: int, nvme_blocks: int, block_tokens: int) -> float:
        """Seconds of prefill saved in all by these hits (negative: loading costs more than recomputing)."""
        block_bytes = self.bytes_per_token * block_tokens
        load = dram_blocks * block_bytes / (self.dram_gbps * 1e9) + nvme_blocks * block_bytes / (self.nvme_gbps * 1e9)
        return hit_tokens / self.recompute_tps - load

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def add_arguments(group: argparse._ArgumentGroup) -> None:
    """The cost model's flags (``kvstore replay`` and ``kvstore plan`` take the same ones)."""
    group.add_argument(
        "--recompute-tps",
        type=float,
        metavar="TOK/S",
        help="prefill tokens per second the engine recomputes (e.g. from kvstore demo)",
    )
    group.add_argument(
        "--dram-gbps", type=float, metavar="GB/S", help="KV load rate from DRAM (default: --bench's dram_get_gbps)"
    )
    group.add_argument(
        "--nvme-gbps", type=float, metavar="GB/S", help="KV load rate from NVMe (default: --bench's nvme_read_gbps)"
    )
    group.add_argument(
        "--bench",
        metavar="FILE",
        help="output of `kvstore bench engine --json`: the measured DRAM and NVMe load rates",
    )


def from_args(
    recompute_tps: float | None,
    bytes_per_token: int | None,
    dram_gbps: float | None,
    nvme_gbps: float | None,
    bench_file: str | None,
) -> CostModel | None:
    """The model from flags and a ``kvstore bench engine --json`` file (flags win); None if
    an input is missing (the caller then reports no time saved)."""
    if bench_file:
        measured = read_bench(bench_file)
        dram_gbps = dram_gbps or measured.get("dram_get_gbps")
        nvme_gbps = nvme_gbps or measured.get("nvme_read_gbps")
    for flag, v in (("--recompute-tps", recompute_tps), ("--dram-gbps", dram_gbps), ("--nvme-gbps", nvme_gbps)):
        if v is not None and not (math.isfinite(v) and v > 0):
            raise InvalidArgument(f"{flag} must be a positive number, got {v}")
    if not (recompute_tps and bytes_per_token and dram_gbps and nvme_gbps):
        return None
    return CostModel(float(recompute_tps), int(bytes_per_token), float(dram_gbps), float(nvme_gbps))


def read_bench(path: str) -> dict[str, float]:
    """Load rates from the JSON ``kvstore bench engine --json`` printed (its last JSON line)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = [ln for ln in f.read().splitlines() if ln.strip().startswith("{")]
    except OSError as e:
        raise InvalidArgument(f"--bench: cannot read {path}: {e.strerror or e}") from None
    for line in reversed(lines):
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict) and ("dram_get_gbps" in obj or "nvme_read_gbps" in obj):
            return {
                k: float(obj[k]) for k in ("dram_get_gbps", "nvme_read_gbps") if isinstance(obj.get(k), (int, float))
            }
    raise InvalidArgument(
        f"--bench: {path} holds no `kvstore bench engine --json` result (dram_get_gbps, nvme_read_gbps)"
    )

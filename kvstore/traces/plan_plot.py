"""The capacity planner's plots: hit ratio against capacity for every policy and the optimum
(``--plot``), and the two-tier grid as a heat map (``--heatmap``).

matplotlib is an optional dependency (the ``plan`` extra); it is imported here only, with
the non-interactive Agg backend, so ``kvstore plan`` without ``--plot`` never needs it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from kvstore.errors import InvalidArgument
from kvstore.traces.sweep import OPTIMAL, SweepPoint

GiB = 1 << 30


def amount(x: float) -> str:
    """A size or a price as people write it: thousands grouped, never in scientific notation
    (2,750 rather than 2.75e+03), three significant digits below 100."""
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def pct_label(fraction: float) -> str:
    """A tick's percentage to two significant digits: capacities are whole blocks, so 1% of a
    trace's blocks is 0.9995% or 1.0065% of them, and a tick says "1%" (not "0.999%")."""
    return f"{float(f'{100 * fraction:.2g}'):g}%"


def _pyplot() -> tuple[Any, Any]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib import ticker
    except ImportError:
        raise InvalidArgument(
            "--plot and --heatmap need matplotlib: pip install 'kvstore[plan]' (or pip install matplotlib)"
        ) from None
    return plt, ticker


def plot_sweep(
    points: Sequence[SweepPoint],
    path: str | os.PathLike[str],
    *,
    title: str,
    unique_blocks: int,
    unlimited: float,
    block_bytes: int | None = None,
    target: float | None = None,
    marks: dict[str, int] | None = None,
) -> None:
    """Write a PNG: one line per policy (the optimum dashed), log-scaled capacity axis in blocks
    (and GiB on top when ``block_bytes`` is known), the target as a horizontal line and the
    planned capacities (``marks``: label → blocks) as vertical ones."""
    plt, ticker = _pyplot()
    if not points:
        raise InvalidArgument("nothing to plot: the sweep is empty")
    caps = [p.capacity_blocks for p in points]
    names = list(points[0].hit_ratio)
    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=120)
    styles = ["o-", "s-", "^-", "D-", "v-", "P-", "X-"]
    for i, name in enumerate(n for n in names if n != OPTIMAL):
        ax.plot(
            caps,
            [100 * p.hit_ratio[name] for p in points],
            styles[i % len(styles)],
            label=name,
            linewidth=1.6,
            markersize=4,
        )
    ax.plot(caps, [100 * p.hit_ratio[OPTIMAL] for p in points], "k--", label="offline optimum (Belady)", linewidth=1.6)
    ax.axhline(
        100 * unlimited, color="grey", linestyle=":", linewidth=1, label=f"unlimited capacity ({100 * unlimited:.1f}%)"
    )
    if target is not None:
        ax.axhline(100 * target, color="tab:red", linestyle="-.", linewidth=1, label=f"target {100 * target:.1f}%")
    for label, blocks in (marks or {}).items():
        ax.axvline(blocks, color="tab:red", linestyle=":", linewidth=1)
        ax.annotate(label, (blocks, 2), rotation=90, fontsize=8, color="tab:red", ha="right", va="bottom")
    ax.set_xscale("log")
    ax.set_xticks(caps, [f"{c:,}\n{pct_label(c / unique_blocks)}" for c in caps])
    ax.xaxis.set_minor_formatter(ticker.NullFormatter())
    ax.set_xlabel(f"capacity in blocks, and % of the trace's {unique_blocks:,} unique blocks")
    ax.set_ylabel("prefix hit ratio (% of blocks)")
    ax.set_ylim(0, max(5.0, 100 * unlimited * 1.08))
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title(title, fontsize=10, pad=30 if block_bytes else 6)
    ax.legend(loc="upper left", fontsize=8)
    if block_bytes:
        sec = ax.secondary_xaxis("top", functions=(lambda b: b * block_bytes / GiB, lambda g: g * GiB / block_bytes))
        sec.set_xlabel("capacity (GiB of KV)")
        sec.xaxis.set_major_formatter(ticker.FuncFormatter(lambda g, _: f"{g:,.0f}" if g >= 10 else f"{g:.3g}"))
        sec.xaxis.set_minor_formatter(ticker.NullFormatter())
    fig.tight_layout()
    try:
        fig.savefig(path)
    except OSError as e:
        raise InvalidArgument(f"--plot: cannot write {path}: {e.strerror or e}") from None
    finally:
        plt.close(fig)


def plot_grid(
    splits: Sequence[dict[str, Any]],
    path: str | os.PathLike[str],
    *,
    title: str,
    unlimited: float,
    marks: dict[str, dict[str, Any]] | None = None,
) -> None:
    """Write a PNG heat map of a two-tier grid (``kvstore plan --json``'s ``grid.splits``):
    DRAM rows × NVMe columns, each cell its hit ratio and cost, coloured by the share of the
    unlimited-capacity hit ratio it reaches; ``marks`` (label → split) outlined."""
    plt, _ = _pyplot()
    if not splits:
        raise InvalidArgument("nothing to plot: the grid is empty")
    drams = sorted({r["dram_blocks"] for r in splits})
    nvmes = sorted({r["nvme_blocks"] for r in splits})
    by = {(r["dram_blocks"], r["nvme_blocks"]): r for r in splits}
    share = [[100 * by[(d, n)]["hit_ratio"] / unlimited if unlimited else 0.0 for n in nvmes] for d in drams]
    fig, ax = plt.subplots(figsize=(1.6 * len(nvmes) + 3, 0.8 * len(drams) + 2.5), dpi=120)
    im = ax.imshow(share, cmap="viridis", vmin=0, vmax=100, origin="lower", aspect="auto")
    for i, d in enumerate(drams):
        for j, n in enumerate(nvmes):
            r = by[(d, n)]
            ax.text(
                j,
                i,
                f"{100 * r['hit_ratio']:.1f}%\n{amount(r['cost'])}",
                ha="center",
                va="center",
                fontsize=8,
                color="white" if share[i][j] < 60 else "black",
            )
    colors = ["tab:red", "tab:orange", "tab:pink"]
    for k, (label, r) in enumerate((marks or {}).items()):
        i, j = drams.index(r["dram_blocks"]), nvmes.index(r["nvme_blocks"])
        ax.add_patch(
            plt.Rectangle(
                (j - 0.48, i - 0.48), 0.96, 0.96, fill=False, edgecolor=colors[k % 3], linewidth=2.5, label=label
            )
        )
    ax.set_xticks(
        range(len(nvmes)),
        [
            f"{amount(r['nvme_bytes'] / GiB)} GiB\n{pct_label(r['nvme_fraction'])}"
            for r in (by[(drams[0], n)] for n in nvmes)
        ],
    )
    ax.set_yticks(
        range(len(drams)),
        [
            f"{amount(r['dram_bytes'] / GiB)} GiB ({pct_label(r['dram_fraction'])})"
            for r in (by[(d, nvmes[0])] for d in drams)
        ],
    )
    ax.set_xlabel("NVMe capacity (and % of the trace's unique blocks)")
    ax.set_ylabel("DRAM capacity")
    ax.set_title(title + "\ncell: hit ratio, cost", fontsize=9)
    fig.colorbar(im, ax=ax, label=f"% of the unlimited-capacity hit ratio ({100 * unlimited:.1f}%)")
    if marks:
        ax.legend(loc="upper left", bbox_to_anchor=(0, -0.18), fontsize=8, ncol=len(marks))
    fig.tight_layout()
    try:
        fig.savefig(path)
    except OSError as e:
        raise InvalidArgument(f"--heatmap: cannot write {path}: {e.strerror or e}") from None
    finally:
        plt.close(fig)

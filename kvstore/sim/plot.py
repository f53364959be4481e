"""``kvstore sim --capacity --plot PNG``: goodput against offered load, per configuration.

Every run of a ``--capacity`` search (:mod:`kvstore.sim.capacity`) is a point: the offered
rate and the goodput it gave (requests per second that met the SLO, the benchmark's
``goodput_rps``); the configuration's capacity, the highest rate at which at least 90 % of
requests met the SLO, is marked on its curve (the knee: past it, goodput stops following
the offered load).  A second panel shows TTFT p50 at the same rates.

Reads the result dictionary ``kvstore sim --json`` prints (``configs.NAME.capacity.steps``
with ``goodput_rps`` and ``ttft_p50_ms``); owns no state.  matplotlib is the optional
``plan`` extra, imported here only.
"""

from __future__ import annotations

import os
from typing import Any

from kvstore.errors import InvalidArgument


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InvalidArgument(
            "--plot needs matplotlib: pip install 'kvstore[plan]' (or pip install matplotlib)"
        ) from None
    return plt


def curves(result: dict[str, Any]) -> dict[str, list[dict[str, float]]]:
    """Each configuration's search runs, by offered rate (one point a rate)."""
    out: dict[str, list[dict[str, float]]] = {}
    for name, c in result["configs"].items():
        steps = (c.get("capacity") or {}).get("steps") or []
        by_rate = {s["rate_rps"]: s for s in steps if s.get("goodput_rps") is not None}
        if by_rate:
            out[name] = [by_rate[r] for r in sorted(by_rate)]
    return out


def plot_capacity(result: dict[str, Any], path: str | os.PathLike[str], *, title: str) -> None:
    """Write the PNG (see the module docstring); a result without a capacity search is refused."""
    pts = curves(result)
    if not pts:
        raise InvalidArgument("--plot needs --capacity: it plots the search's runs")
    plt = _pyplot()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    top = max(p["rate_rps"] for ps in pts.values() for p in ps)
    ax.plot([0, top], [0, top], color="grey", linestyle=":", linewidth=1, label="goodput = offered")
    for name, ps in pts.items():
        xs = [p["rate_rps"] for p in ps]
        (line,) = ax.plot(xs, [p["goodput_rps"] for p in ps], marker="o", label=name)
        ax2.plot(xs, [p["ttft_p50_ms"] for p in ps], marker="o", color=line.get_color(), label=name)
        cap = result["configs"][name].get("capacity_rps") or 0.0
        if cap > 0:
            at = next((p for p in ps if abs(p["rate_rps"] - cap) < 1e-6), None)
            y = at["goodput_rps"] if at else cap
            ax.plot([cap], [y], marker="*", markersize=16, color=line.get_color())
            ax.annotate(f"{cap:.3g}", (cap, y), textcoords="offset points", xytext=(6, -12), fontsize=8)
    slo = result.get("slo") or {}
    ax.set_xlabel("offered load (req/s)")
    ax.set_ylabel("goodput at the SLO (req/s)")
    ax.set_title(f"{title}: capacity (*) at >= 90 % within the SLO")
    ax.legend()
    ax2.set_xlabel("offered load (req/s)")
    ax2.set_ylabel("TTFT p50 (ms)")
    ax2.set_yscale("log")
    ax2.yaxis.set_major_formatter(plt.matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    if slo.get("ttft_ms"):
        ax2.axhline(slo["ttft_ms"], color="grey", linestyle=":", label="TTFT SLO")
    ax2.set_title("TTFT p50")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

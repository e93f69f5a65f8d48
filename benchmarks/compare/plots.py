"""One PNG of variants against the offered rate: attainment, goodput, and TTFT/TPOT p90 (log scale).
Skipped with a warning when matplotlib is not installed."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

STYLES = ("o-", "s--", "^-.", "d:", "v-", "x--")


def plot_rates(rows: Sequence[dict[str, Any]], names: Sequence[str], slo: dict[str, float], out_dir: Path,
               filename: str = "compare.png", title: str | None = None) -> list[str]:
    """``rows``: one per rate with ``rate`` and, per variant name, a ``metrics_of`` dict. Returns the
    file names written (``[filename]``, or none without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: skipping %s", filename)
        return []
    xs = [r["rate"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for i, name in enumerate(names):
        style = STYLES[i % len(STYLES)]
        axes[0].plot(xs, [r[name]["attainment"] * 100 for r in rows], style, label=name)
        axes[1].plot(xs, [r[name]["goodput_rps"] for r in rows], style, label=name)
        axes[2].plot(xs, [(r[name]["tpot_p90"] or 0) * 1000 for r in rows], style, label=f"{name} TPOT p90")
        axes[2].plot(xs, [(r[name]["ttft_p90"] or 0) * 1000 for r in rows], style, alpha=0.4,
                     label=f"{name} TTFT p90")
    axes[0].set_ylabel("SLO attainment %")
    axes[0].set_ylim(0, 105)
    axes[1].set_ylabel("goodput req/s")
    axes[2].set_ylabel("ms (log)")
    axes[2].set_yscale("log")
    axes[2].axhline(slo["tpot_s"] * 1000, color="grey", lw=0.8, ls=":")
    axes[2].axhline(slo["ttft_s"] * 1000, color="grey", lw=0.8, ls="-.")
    for ax in axes:
        ax.set_xlabel("offered rate req/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{title or ' vs '.join(names)} (TTFT <= {slo['ttft_s']:g} s, TPOT <= {slo['tpot_s'] * 1000:g} ms)")
    fig.tight_layout()
    fig.savefig(out_dir / filename, dpi=100)
    plt.close(fig)
    return [filename]

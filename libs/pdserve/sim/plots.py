"""PNG plots of a simulation (matplotlib, Agg): TTFT and TPOT distributions, the mean TTFT breakdown, and
a search's attainment against the request rate."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from pdserve.sim.results import SimResult  # noqa: E402
from pdserve.sim.search import RateProbe  # noqa: E402


def plot_result(
    results: dict[str, SimResult],
    path: Path,
    title: str,
    probes: dict[str, Sequence[RateProbe]] | None = None,
) -> Path:
    """One row per figure: TTFT CDF, TPOT CDF, TTFT breakdown (stacked mean), and, with `probes`,
    attainment vs request rate; one line per labelled result."""
    ncols = 4 if probes else 3
    fig, axes = plt.subplots(1, ncols, figsize=(4.2 * ncols, 3.6))
    for label, r in results.items():
        done = r.done
        for ax, values, name in ((axes[0], r.ttft_s[done], "TTFT"), (axes[1], r.tpot_s[done], "TPOT")):
            v = np.sort(values) * 1000.0
            ax.plot(v, np.arange(1, len(v) + 1) / max(len(v), 1), label=label)
            ax.set_xlabel(f"{name} (ms)")
            ax.set_ylabel("fraction of requests")
            ax.grid(alpha=0.3)
    axes[0].set_xscale("log")
    labels = list(results)
    bottom = np.zeros(len(labels))
    for phase in next(iter(results.values())).ttft_breakdown_s():
        vals = np.array([results[k].ttft_breakdown_s()[phase] * 1000.0 for k in labels])
        axes[2].bar(labels, vals, bottom=bottom, label=phase)
        bottom += vals
    axes[2].set_ylabel("mean TTFT (ms)")
    axes[2].legend(fontsize=7)
    axes[2].tick_params(axis="x", labelsize=7)
    if probes:
        for label, ps in probes.items():
            ps = sorted(ps)
            axes[3].plot([p.rate for p in ps], [p.attainment for p in ps], "o-", label=label)
        axes[3].set_xlabel("request rate (req/s)")
        axes[3].set_ylabel("SLO attainment")
        axes[3].grid(alpha=0.3)
        axes[3].legend(fontsize=7)
    axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

"""Figures for `pdserve advise`: the transfer against the prefill per link (exercise A), the weight
duplication share against fleet size (E), and an advice's measured transfer and hit rates."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pdserve.advise.decide import Advice
from pdserve.advise.economics import Economics


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_economics(results: Sequence[Economics], path: Path) -> Path:
    """One row per model: left, transfer time per link at each prompt length (bars, log scale) beside
    the prefill time (dashed line, same colour); right, the duplication share against fleet size."""
    plt = _plt()
    fig, axes = plt.subplots(len(results), 2, figsize=(13, 3.6 * len(results)), squeeze=False)
    for (ax, ax_dup), eco in zip(axes, results, strict=True):
        links = [r.link for r in eco.prompts[0].rows]
        width = 0.8 / len(eco.prompts)
        for i, pr in enumerate(eco.prompts):
            xs = [j + i * width for j in range(len(links))]
            bars = ax.bar(
                xs,
                [r.transfer_s * 1e3 for r in pr.rows],
                width,
                label=f"{pr.label}: {pr.num_tokens} tokens, {pr.transfer_bytes / 1e6:.1f} MB",
            )
            ax.axhline(
                pr.prefill_s * 1e3,
                ls="--",
                color=bars.patches[0].get_facecolor(),
                label=f"prefill {pr.prefill_s * 1e3:.1f} ms",
            )
        ax.set_xticks(
            [j + 0.4 - width / 2 for j in range(len(links))], links, rotation=35, ha="right", fontsize=7
        )
        ax.set_yscale("log")
        ax.set_ylabel("ms")
        ax.set_title(f"{eco.model.name} ({eco.model.kv_dtype} KV): transfer vs prefill", fontsize=9)
        ax.legend(fontsize=6)
        d = eco.duplication
        ax_dup.plot(
            [r.fleet_accelerators for r in d.rows], [100 * r.weight_share for r in d.rows], marker="o"
        )
        ax_dup.axhline(
            100 * d.threshold,
            ls=":",
            color="grey",
            label=f"{d.threshold:.0%}: from {d.fleet_for_threshold} accelerators",
        )
        ax_dup.set_xscale("log", base=2)
        ax_dup.set_yscale("log")
        ax_dup.set_xlabel("fleet size (accelerators)")
        ax_dup.set_ylabel("% of fleet memory")
        ax_dup.set_title(f"second weight copy ({d.weight_bytes / 1e9:.2f} GB) / fleet memory", fontsize=9)
        ax_dup.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_advice(advice: Advice, path: Path, title: str = "") -> Path:
    """Left: each stage's status; middle: p95 transfer on the link against p95 prefill; right: hit rate
    per replica against the router's ceiling."""
    plt = _plt()
    fig, (ax_s, ax_t, ax_h) = plt.subplots(1, 3, figsize=(14, 3.8))
    colours = {
        "baseline": "#7f7f7f",
        "in place": "#2ca02c",
        "warranted": "#d62728",
        "not yet": "#1f77b4",
        "unknown": "#bcbd22",
    }
    for v in advice.stages:
        ax_s.barh(v.stage, 1, color=colours[v.status])
        ax_s.text(0.02, v.stage, f"{v.stage}: {v.status}", va="center", color="white", fontsize=9)
    ax_s.set_yticks([])
    ax_s.set_xticks([])
    ax_s.invert_yaxis()
    ax_s.set_title(f"stage {advice.stage}", fontsize=10)
    m = advice.measurements
    names, vals = [], []
    for key, label in (
        ("transfer_s_p95_on_link", f"transfer p95\n({advice.link.name})"),
        ("transfer_s_p95", "transfer p95\n(measured)"),
        ("prefill_s_p95", "prefill p95"),
    ):
        if key in m and m[key].value is not None:
            names.append(label)
            vals.append(m[key].value * 1e3)
    ax_t.bar(names, vals, color=["#1f77b4", "#ff7f0e", "#2ca02c"][: len(vals)])
    ax_t.set_yscale("log")
    ax_t.set_ylabel("ms")
    ax_t.set_title("transfer vs recompute", fontsize=10)
    ax_t.tick_params(axis="x", labelsize=7)
    if advice.replicas:
        xs = range(len(advice.replicas))
        ax_h.bar([x - 0.2 for x in xs], [100 * r.hit_rate for r in advice.replicas], 0.4, label="hit rate")
        ax_h.bar(
            [x + 0.2 for x in xs],
            [100 * r.ceiling_hit_rate for r in advice.replicas],
            0.4,
            label="perfect-router ceiling",
        )
        ax_h.set_xticks(list(xs), [r.replica for r in advice.replicas], fontsize=7)
        ax_h.set_ylabel("% of prompt tokens")
        ax_h.legend(fontsize=7)
    elif "hit_rate" in m and m["hit_rate"].value is not None:
        ax_h.bar(
            ["hit rate", "router ceiling", "reuse ceiling"],
            [
                100 * (m[k].value or 0) if k in m else 0
                for k in ("hit_rate", "router_ceiling_hit_rate", "reuse_ceiling_hit_rate")
            ],
            color=["#1f77b4", "#ff7f0e", "#7f7f7f"],
        )
        ax_h.set_ylabel("% of prompt tokens")
    else:
        ax_h.text(0.5, 0.5, "hit rate not in this log", ha="center", va="center")
    ax_h.set_title("prefix cache", fontsize=10)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

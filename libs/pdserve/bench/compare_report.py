"""The colocated-vs-disaggregated report: JSON, Markdown (tables, interference check, verdict) and PNG,
all rendered from the sweep's results dict (so a JSON can be re-rendered without re-measuring)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# A mode "wins" a point when it meets the SLO for at least this many more requests out of each run's
# `num_prompts` (2 of 20 = 10 %): smaller gaps are within run-to-run noise on a shared 2-core machine.
WIN_MARGIN_REQUESTS = 2
INTERFERENCE_FACTOR = 2.0  # the check: p99 ITL > 2 × p50 ITL


def _key(p: dict[str, Any]) -> tuple[str, float]:
    return p["ratio"], p["request_rate"]


def paired_points(results: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(colocated, disaggregated) summaries of every (ratio, rate) measured in both modes, sweep order."""
    by_mode: dict[str, dict[tuple[str, float], dict[str, Any]]] = {}
    for p in results["points"]:
        by_mode.setdefault(p["mode"], {})[_key(p)] = p
    co, dis = by_mode.get("colocated", {}), by_mode.get("disaggregated", {})
    return [(co[k], dis[k]) for k in co if k in dis]


def good_requests(p: dict[str, Any]) -> float:
    return p["goodput_fraction"] * (p["completed"] + p["failed"])


def verdict_lines(results: dict[str, Any]) -> list[str]:
    """Where disaggregation wins goodput, where it loses, and what happens to ITL — from the numbers."""
    pairs = paired_points(results)
    if not pairs:
        return ["Only one mode was measured: no comparison."]
    wins = [d for c, d in pairs if good_requests(d) - good_requests(c) >= WIN_MARGIN_REQUESTS]
    losses = [d for c, d in pairs if good_requests(c) - good_requests(d) >= WIN_MARGIN_REQUESTS]
    itl_better = [d for c, d in pairs if d["latency_ms"]["itl"]["p99"] < 0.8 * c["latency_ms"]["itl"]["p99"]]
    name = lambda p: f"{p['ratio']} @ {p['request_rate']:g} req/s"  # noqa: E731
    lines = [f"- Goodput (SLO met by ≥ {WIN_MARGIN_REQUESTS} more requests of each run): disaggregation wins "
             f"at {len(wins)} of {len(pairs)} points" + (f" ({', '.join(map(name, wins))})" if wins else ""),
             f"- colocated wins at {len(losses)} of {len(pairs)} points"
             + (f" ({', '.join(map(name, losses))})" if losses else ""),
             f"- ties (within the margin): {len(pairs) - len(wins) - len(losses)} points",
             f"- p99 ITL at least 20 % lower disaggregated at {len(itl_better)} of {len(pairs)} points"
             + (f" ({', '.join(map(name, itl_better))})" if itl_better else "")]
    if not wins:
        lines.append("- **Verdict: disaggregation does not pay on this machine for these workloads.**")
    elif len(wins) > len(losses):
        lines.append("- **Verdict: disaggregation pays at the points listed above, not everywhere.**")
    else:
        lines.append("- **Verdict: mixed; disaggregation wins only at the points listed above.**")
    return lines


def interference_lines(results: dict[str, Any]) -> list[str]:
    """The issue's interference check on every colocated point: is p99 ITL > 2 × p50 ITL?"""
    lines = ["| ratio | rate (req/s) | ITL p50 (ms) | ITL p99 (ms) | p99/p50 | p99 > 2 × p50 ? |",
             "|---|---:|---:|---:|---:|---|"]
    hits = total = 0
    for p in results["points"]:
        if p["mode"] != "colocated":
            continue
        itl, r = p["latency_ms"]["itl"], p["itl_p99_over_p50"]
        hit = r is not None and r > INTERFERENCE_FACTOR
        hits, total = hits + hit, total + 1
        lines.append(f"| {p['ratio']} | {p['request_rate']:g} | {itl['p50']:.1f} | {itl['p99']:.1f} | "
                     f"{r:.2f} | {'**yes**' if hit else 'no'} |" if r is not None else
                     f"| {p['ratio']} | {p['request_rate']:g} | – | – | – | no ITL |")
    lines.append("")
    lines.append(f"Interference (p99 ITL > 2 × p50 ITL) in the colocated stack at {hits} of {total} points.")
    return lines


def markdown(results: dict[str, Any]) -> str:
    c, m = results["config"], results["machine"]
    slo = " ".join(f"{k}:{v:g}" for k, v in c["goodput_slo_ms"].items())
    lines = [
        "# Colocated vs disaggregated on this machine", "",
        f"Model {c['model']}; {c['num_prompts']} random requests per point (`ignore_eos`, exact lengths, "
        f"{c['tokens_per_request']} tokens per request split by the ratio); Poisson-family arrivals "
        f"(burstiness {c['burstiness']:g}, seed {c['seed']}); goodput SLO `--goodput {slo}` (ms). "
        "Metric definitions: `vllm bench serve`.",
        f"Machine: {m['cpus']} CPUs, {m['platform']}, load average at start {m['loadavg_at_start']}; "
        f"code at commit {results.get('commit', '?')}; started {results['started_at']}, "
        f"took {results.get('elapsed_s', 0):.0f} s.",
        f"Pinning (worker → core): {results.get('pinning') or 'none'}; the gateway, router, coordinator "
        "and recorder float over both cores. Other work shared these 2 cores during the run, so "
        "absolute numbers are noisy; compare modes within one ratio and rate.",
        "", f"Re-run: `{results.get('command', 'pdserve bench compare')}` (then `pdserve bench compare "
        "--render <out>/colocated-vs-disaggregated.json` re-renders this page and the plot).", "",
        "## Results", "",
        "| ratio (in:out tokens) | rate | mode | goodput (req/s) | SLO met | TTFT p50 / p99 (ms) | "
        "TPOT p50 (ms) | ITL p50 / p99 (ms) | E2EL p50 (ms) | failed |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in sorted(results["points"], key=lambda p: (p["ratio"], p["request_rate"], p["mode"])):
        lat = p["latency_ms"]
        n = p["completed"] + p["failed"]
        lines.append(
            f"| {p['ratio']} ({p['input_len']}:{p['output_len']}) | {p['request_rate']:g} | {p['mode']} | "
            f"{p['request_goodput'] or 0:.3f} | {good_requests(p):.0f}/{n} | "
            f"{lat['ttft']['p50']:.0f} / {lat['ttft']['p99']:.0f} | {lat['tpot']['p50']:.1f} | "
            f"{lat['itl']['p50']:.1f} / {lat['itl']['p99']:.1f} | {lat['e2el']['p50']:.0f} | {p['failed']} |")
    lines += ["", "## Server-side TTFT breakdown (event log, mean ms)", "",
              "| ratio | rate | mode | queue | route | reserve | prefill | exposed transfer | first token | "
              "server TTFT |", "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    stages = ("queue", "route", "reserve", "prefill", "exposed_transfer", "first_token", "server_ttft")
    for p in sorted(results["points"], key=lambda p: (p["ratio"], p["request_rate"], p["mode"])):
        b = p["ttft_breakdown_mean_ms"]
        cells = " | ".join(f"{b[s]:.0f}" if s in b else "–" for s in stages)
        lines.append(f"| {p['ratio']} | {p['request_rate']:g} | {p['mode']} | {cells} |")
    lines += ["", "## Interference check (colocated)", "", *interference_lines(results), "",
              "## Verdict", "", *verdict_lines(results)]
    if notes := results.get("notes"):
        lines += ["", "## Notes", "", *[f"- {n}" for n in notes]]
    errors = {e for p in results["points"] for e in p["errors"]}
    if errors:
        lines += ["", "## Errors seen", "", *[f"- {e}" for e in sorted(errors)[:5]]]
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> None:
    """Rows: ratios. Columns: goodput, TTFT p50, ITL p50 (dashed) and p99 (solid), against the rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ratios = list(dict.fromkeys(p["ratio"] for p in results["points"]))
    modes = list(dict.fromkeys(p["mode"] for p in results["points"]))
    fig, axes = plt.subplots(len(ratios), 3, figsize=(15, 3.6 * len(ratios)), squeeze=False)
    for row, ratio in zip(axes, ratios, strict=True):
        for i, mode in enumerate(modes):
            pts = sorted((p for p in results["points"] if p["ratio"] == ratio and p["mode"] == mode),
                         key=lambda p: p["request_rate"])
            x = [p["request_rate"] for p in pts]
            color = f"C{i}"
            row[0].plot(x, [p["request_goodput"] or 0 for p in pts], "o-", color=color, label=mode)
            row[1].plot(x, [p["latency_ms"]["ttft"]["p50"] for p in pts], "o-", color=color, label=mode)
            row[2].plot(x, [p["latency_ms"]["itl"]["p99"] for p in pts], "o-", color=color,
                        label=f"{mode} p99")
            row[2].plot(x, [p["latency_ms"]["itl"]["p50"] for p in pts], "o--", color=color,
                        label=f"{mode} p50")
        for ax, title in zip(row, ("goodput (req/s)", "TTFT p50 (ms)", "ITL p50 / p99 (ms)"), strict=True):
            ax.set_title(f"{ratio}: {title}")
            ax.set_xlabel("request rate (req/s)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_compare(results: dict[str, Any], out_dir: Path, stem: str, final: bool = True) -> list[Path]:
    """Write `<stem>.json`, and when `final` also `<stem>.md` and `<stem>.png`; returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{stem}.json"]
    paths[0].write_text(json.dumps(results, indent=1, default=str) + "\n")
    if final and results["points"]:
        paths.append(out_dir / f"{stem}.md")
        paths[1].write_text(markdown(results))
        paths.append(out_dir / f"{stem}.png")
        plot(results, paths[2])
    return paths

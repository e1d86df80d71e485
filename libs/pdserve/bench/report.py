"""`pdserve bench serve` results as JSON, Markdown and PNG (latency CDFs and the TTFT breakdown)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.bench.breakdown import BREAKDOWN_STAGES, TTFTBreakdown, mean_stages_ms
from pdserve.bench.metrics import AIPERF_NAMES, LATENCY_METRICS, BenchmarkMetrics, RequestRecord

_LABELS = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
           "itl": "Inter-token Latency (per chunk)", "e2el": "End-to-end Latency"}


@dataclass
class ServeReport:
    """One benchmark run: what was asked (`config`), what came out (`metrics`), every request, and the
    server-side TTFT breakdowns keyed by request id (empty when the event store was not read)."""

    config: dict[str, Any]
    metrics: BenchmarkMetrics
    records: list[RequestRecord]
    breakdowns: dict[str, TTFTBreakdown] = field(default_factory=dict)

    def request_rows(self) -> list[dict[str, Any]]:
        rows = []
        for r in self.records:
            row: dict[str, Any] = {"index": r.index, "request_id": r.request_id, "success": r.success,
                                   "error": r.error or None, "prompt_len": r.prompt_len,
                                   "output_tokens": r.num_output_tokens if r.success else 0}
            if r.success and r.chunk_times_s:
                row |= {"ttft_ms": r.ttft_s * 1e3, "tpot_ms": r.tpot_s * 1e3, "e2el_ms": r.e2el_s * 1e3,
                        "itl_ms": [x * 1e3 for x in r.itls_s]}
            if r.request_id and (b := self.breakdowns.get(r.request_id)) is not None:
                row["server"] = {"state": b.state, "mode": b.mode, "ttft_ms": _ms(b.ttft_s),
                                 "cached_tokens": b.cached_tokens, "kv_bytes": b.kv_bytes,
                                 **{k.removesuffix("_s") + "_ms": _ms(v) for k, v in b.stages_s.items()}}
            rows.append(row)
        return rows

    def to_json(self) -> dict[str, Any]:
        return {"config": self.config, "metrics": asdict(self.metrics), "aiperf_names": AIPERF_NAMES,
                "ttft_breakdown_mean_ms": mean_stages_ms(list(self.breakdowns.values())),
                "requests": self.request_rows()}


def _ms(v: float | None) -> float | None:
    return None if v is None else v * 1e3


def markdown(report: ServeReport) -> str:
    """vLLM's "Serving Benchmark Result" block as Markdown tables, AIPerf's metric names beside ours."""
    m, c = report.metrics, report.config
    lines = [f"# Serving benchmark: {c.get('dataset')} against {c.get('base_url')}", "",
             "Metric definitions: `vllm bench serve` (vllm/benchmarks/serve.py); AIPerf names in the last "
             "column (docs.nvidia.com/aiperf/reference/ai-perf-metrics-reference).", "",
             "| setting | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in c.items()]
    lines += ["", "| result | value | AIPerf |", "|---|---:|---|",
              f"| successful requests | {m.completed} | |", f"| failed requests | {m.failed} | |",
              f"| benchmark duration (s) | {m.duration_s:.2f} | benchmark_duration |",
              f"| total input tokens | {m.total_input} | |",
              f"| total generated tokens | {m.total_output} | |",
              f"| request throughput (req/s) | {m.request_throughput:.3f} | request_throughput |"]
    if m.request_goodput is not None:
        slo = " ".join(f"{k}:{v:g}" for k, v in m.goodput_slo_ms.items())
        lines.append(f"| request goodput (req/s) at {slo} ms | {m.request_goodput:.3f} | goodput |")
    lines += [f"| output token throughput (tok/s) | {m.output_throughput:.2f} | output_token_throughput |",
              f"| total token throughput (tok/s) | {m.total_token_throughput:.2f} | |",
              f"| peak concurrent requests | {m.max_concurrent_requests} | |", ""]
    pcts = list(next(iter(m.latency.values())).percentiles_ms)
    lines += ["| latency (ms) | AIPerf | mean | median | std | " + " | ".join(f"p{p:g}" for p in pcts) + " |",
              "|---|---|" + "---:|" * (3 + len(pcts))]
    for key in LATENCY_METRICS:
        d = m.latency[key]
        cells = [f"{v:.2f}" for v in (d.mean_ms, d.median_ms, d.std_ms, *(d.p(p) for p in pcts))]
        lines.append(f"| {key.upper()}: {_LABELS[key]} | {AIPERF_NAMES[key]} | " + " | ".join(cells) + " |")
    means = mean_stages_ms(list(report.breakdowns.values()))
    if means:
        n = len(report.breakdowns)
        lines += ["", f"## Server-side TTFT breakdown (event log, {n} requests, mean ms)",
                  "", "| " + " | ".join(means) + " |", "|" + "---:|" * len(means),
                  "| " + " | ".join(f"{v:.2f}" for v in means.values()) + " |", "",
                  f"Client-side mean TTFT: {m.latency['ttft'].mean_ms:.2f} ms "
                  "(adds HTTP, tokenization and detokenization to the server's)."]
    if failures := [r for r in report.records if not r.success]:
        lines += ["", f"## Failed requests ({len(failures)}; first 5)", ""]
        lines += [f"- #{r.index} `{r.request_id}`: {r.error[:300]}" for r in failures[:5]]
    return "\n".join(lines) + "\n"


def plot(report: ServeReport, path: Path) -> None:
    """Four latency CDFs and, when the event log was read, the per-request TTFT breakdown (stacked)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in report.records if r.success and r.chunk_times_s]
    values = {"ttft": [r.ttft_s for r in done], "tpot": [r.tpot_s for r in done if r.num_output_tokens > 1],
              "itl": [x for r in done for x in r.itls_s], "e2el": [r.e2el_s for r in done]}
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, key in zip(axes.flat, LATENCY_METRICS, strict=False):
        cdf(ax, {"": values[key]}, f"{key.upper()} ({AIPERF_NAMES[key]})")
    ax = axes.flat[4]
    ranked = [(r, report.breakdowns.get(r.request_id or "")) for r in done]
    ranked = [(r, b) for r, b in ranked if b is not None]
    if ranked:
        stacked_breakdown(ax, [b for _, b in ranked], [r.ttft_s for r, _ in ranked])
    else:
        ax.set_axis_off()
    axes.flat[5].set_axis_off()
    fig.suptitle(f"{report.config.get('dataset')} @ {report.config.get('request_rate')} req/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cdf(ax: Any, series: dict[str, Sequence[float]], title: str) -> None:
    """Empirical CDFs of each series (seconds, plotted in ms) on one axis."""
    for label, vals in series.items():
        if len(vals):
            x = np.sort(np.asarray(vals)) * 1e3
            ax.plot(x, np.arange(1, len(x) + 1) / len(x), label=label or None, drawstyle="steps-post")
    ax.set_title(title)
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of values ≤ x")
    ax.grid(alpha=0.3)
    if any(series):
        ax.legend(fontsize=7)


def stacked_breakdown(ax: Any, breakdowns: Sequence[TTFTBreakdown], client_ttft_s: Sequence[float]) -> None:
    """One stacked bar per request (sorted by client TTFT): the server's stages, and a dot for the client's
    TTFT."""
    order = np.argsort(client_ttft_s)
    x = np.arange(len(order))
    bottom = np.zeros(len(order))
    for stage in BREAKDOWN_STAGES:
        h = np.array([(breakdowns[i].stages_s[stage] or 0.0) * 1e3 for i in order])
        ax.bar(x, h, bottom=bottom, label=stage.removesuffix("_s"), width=0.9)
        bottom += h
    ax.plot(x, np.asarray(client_ttft_s)[order] * 1e3, "k.", label="client TTFT")
    ax.set_title("TTFT breakdown per request (event log)")
    ax.set_xlabel("request (sorted by client TTFT)")
    ax.set_ylabel("ms")
    ax.legend(fontsize=7)


def write_report(report: ServeReport, out_dir: Path, stem: str) -> list[Path]:
    """Write `<stem>.json`, `<stem>.md` and `<stem>.png` under `out_dir`; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{stem}.{ext}" for ext in ("json", "md", "png")]
    paths[0].write_text(json.dumps(report.to_json(), indent=1, default=str) + "\n")
    paths[1].write_text(markdown(report))
    plot(report, paths[2])
    return paths

"""Serving metrics as pure functions over the timestamps a client recorded (no I/O, no clock).

Definitions are `vllm bench serve`'s (vllm/benchmarks/serve.py `calculate_metrics` and
vllm/benchmarks/lib/endpoint_request_func.py `async_request_openai_completions`), so numbers compare:

- TTFT: first streamed chunk carrying a choice − request sent.
- ITL: time between consecutive chunks, one value per chunk after the first (a chunk may hold several
  tokens; vLLM counts per chunk too).
- E2EL: last chunk carrying a choice − request sent (the trailing usage chunk and `[DONE]` do not count).
- TPOT: (E2EL − TTFT) / (output_tokens − 1) per request with more than one output token; for goodput a
  request with one output token has TPOT 0 (vLLM's rule).
- output_tokens: the server's `usage.completion_tokens` when given, else the number of chunks.
- throughputs: completed requests (tokens) / benchmark duration; goodput: requests meeting every SLO of
  `--goodput` / duration.
- mean / median / std / percentiles with numpy's default (linear) interpolation, in milliseconds.

AIPerf (docs.nvidia.com/aiperf/reference/ai-perf-metrics-reference) names the same quantities
differently; `AIPERF_NAMES` maps ours to theirs. Note that AIPerf's "inter_token_latency" is vLLM's TPOT,
and AIPerf's "inter_chunk_latency" is vLLM's ITL.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
AIPERF_NAMES: dict[str, str] = {
    "ttft": "time_to_first_token",
    "tpot": "inter_token_latency",
    "itl": "inter_chunk_latency",
    "e2el": "request_latency",
    "request_throughput": "request_throughput",
    "output_throughput": "output_token_throughput",
    "request_goodput": "goodput",
}


@dataclass
class RequestRecord:
    """What the client saw of one request. Times are seconds on one monotonic clock (perf_counter).

    `chunk_times_s`: arrival time of every streamed chunk that carried a choice, in order.
    `output_tokens`: `usage.completion_tokens`, or None when the server sent no usage.
    `request_id`: the server's `X-Request-Id` response header (joins the event log), or None.
    """

    index: int
    prompt_len: int
    expected_output_len: int
    start_s: float = 0.0
    chunk_times_s: list[float] = field(default_factory=list)
    output_tokens: int | None = None
    success: bool = False
    error: str = ""
    request_id: str | None = None
    text: str = ""

    @property
    def ttft_s(self) -> float:
        return self.chunk_times_s[0] - self.start_s

    @property
    def e2el_s(self) -> float:
        return self.chunk_times_s[-1] - self.start_s

    @property
    def itls_s(self) -> list[float]:
        t = self.chunk_times_s
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    @property
    def num_output_tokens(self) -> int:
        return self.output_tokens if self.output_tokens is not None else len(self.chunk_times_s)

    @property
    def tpot_s(self) -> float:
        """0.0 when the request produced one token or fewer (counted as meeting any TPOT SLO)."""
        n = self.num_output_tokens
        return (self.e2el_s - self.ttft_s) / (n - 1) if n > 1 else 0.0


@dataclass(frozen=True)
class Distribution:
    """Summary of one latency metric, milliseconds. `percentiles` maps p (e.g. 99.0) to its value."""

    mean_ms: float
    median_ms: float
    std_ms: float
    percentiles_ms: dict[float, float]
    count: int

    def p(self, q: float) -> float:
        return self.percentiles_ms[float(q)]


@dataclass(frozen=True)
class BenchmarkMetrics:
    """vLLM's `BenchmarkMetrics` fields: counts, tokens, throughputs (per second of `duration_s`) and one
    `Distribution` per latency metric (`ttft`, `tpot`, `itl`, `e2el`)."""

    completed: int
    failed: int
    total_input: int
    total_output: int
    duration_s: float
    request_throughput: float
    request_goodput: float | None
    output_throughput: float
    total_token_throughput: float
    latency: dict[str, Distribution]
    goodput_slo_ms: dict[str, float]
    max_concurrent_requests: int


def parse_goodput(items: Iterable[str]) -> dict[str, float]:
    """`["ttft:200", "tpot:50"]` (vLLM's `--goodput KEY:VALUE ...`, milliseconds) → {"ttft": 200.0, ...}.
    Raises ValueError on an unknown key, a malformed item or a negative value."""
    slo: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition(":")
        if not sep or key not in GOODPUT_METRICS:
            keys = ", ".join(GOODPUT_METRICS)
            raise ValueError(f"--goodput {item!r}: expected KEY:MS with KEY one of {keys}")
        try:
            ms = float(value)
        except ValueError as e:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from e
        if ms < 0:
            raise ValueError(f"--goodput {item!r}: an SLO cannot be negative")
        slo[key] = ms
    return slo


def distribution(values_s: Sequence[float], percentiles: Sequence[float]) -> Distribution:
    """Mean, median, std and `percentiles` of `values_s` (seconds) in milliseconds; all 0 when empty
    (vLLM's `np.mean(x or 0)` convention)."""
    a = np.asarray(values_s if len(values_s) else [0.0], dtype=np.float64) * 1000.0
    return Distribution(
        mean_ms=float(np.mean(a)),
        median_ms=float(np.median(a)),
        std_ms=float(np.std(a)),
        percentiles_ms={float(p): float(np.percentile(a, p)) for p in percentiles},
        count=len(values_s),
    )


def meets_slo(record: RequestRecord, slo_ms: Mapping[str, float]) -> bool:
    """True when every SLO in `slo_ms` (ms; keys ttft, tpot, e2el) is met: value ≤ SLO, as vLLM compares."""
    values = {"ttft": record.ttft_s, "tpot": record.tpot_s, "e2el": record.e2el_s}
    return all(values[k] * 1000.0 <= v for k, v in slo_ms.items())


def peak_concurrency(records: Iterable[RequestRecord]) -> int:
    """Most requests in flight at once, over half-open intervals [start, last chunk) (vLLM's sweep line)."""
    events = sorted([(r.start_s, 1) for r in records] + [(r.start_s + r.e2el_s, -1) for r in records])
    current = peak = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


def calculate_metrics(records: Sequence[RequestRecord], duration_s: float,
                      percentiles: Sequence[float] = (50.0, 90.0, 99.0),
                      goodput_slo_ms: Mapping[str, float] | None = None) -> BenchmarkMetrics:
    """Aggregate `records` over a run that lasted `duration_s` seconds (first send → last response).

    A record counts as completed when `success` is set and it streamed at least one chunk. Goodput is
    None when no SLO is given. Raises ValueError when `duration_s` is not positive.
    """
    if duration_s <= 0:
        raise ValueError(f"duration_s must be positive, got {duration_s}")
    done = [r for r in records if r.success and r.chunk_times_s]
    itls = [x for r in done for x in r.itls_s]
    tpots = [r.tpot_s for r in done if r.num_output_tokens > 1]
    total_input = sum(r.prompt_len for r in done)
    total_output = sum(r.num_output_tokens for r in done)
    slo = dict(goodput_slo_ms or {})
    goodput = sum(meets_slo(r, slo) for r in done) / duration_s if slo else None
    return BenchmarkMetrics(
        completed=len(done),
        failed=len(records) - len(done),
        total_input=total_input,
        total_output=total_output,
        duration_s=duration_s,
        request_throughput=len(done) / duration_s,
        request_goodput=goodput,
        output_throughput=total_output / duration_s,
        total_token_throughput=(total_input + total_output) / duration_s,
        latency={
            "ttft": distribution([r.ttft_s for r in done], percentiles),
            "tpot": distribution(tpots, percentiles),
            "itl": distribution(itls, percentiles),
            "e2el": distribution([r.e2el_s for r in done], percentiles),
        },
        goodput_slo_ms=slo,
        max_concurrent_requests=peak_concurrency(done),
    )

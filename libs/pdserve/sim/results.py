"""What a simulation returns and the metrics read from it: `vllm bench serve`'s (the definitions and the
`Distribution` of `bench/metrics.py`), goodput under an SLO and its attainment (DistServe: the fraction
of requests meeting every SLO), and the TTFT broken into the phases the simulation models."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdserve.bench.metrics import BenchmarkMetrics, Distribution, distribution
from pdserve.sim.config import ClusterConfig
from pdserve.sim.workload import SimRequest

PERCENTILES = (50.0, 90.0, 99.0)
TTFT_PHASES = ("control", "admission", "prefill_queue", "prefill", "exposed_transfer", "first_token")


@dataclass
class SimResult:
    """Per request (arrays indexed as `requests`, virtual seconds, NaN where a request never got there):
    sent, admitted (decode KV reserved), prefill scheduled, prefill done, first token at the client, KV
    transfer done (disaggregated), last token; prefix-cache hit tokens. ITL: every decode step's duration
    with the number of tokens it produced at that gap (`itl_values_s`, `itl_weights`) and each sequence's
    first decode gap (`itl_first_s`). `busy_s`: each replica's total step time; `step_ends_s`: each
    replica's step end times,
    with `join_step` and `decode_replica` enough to list any request's token times (`token_times_s`)."""

    config: ClusterConfig
    requests: list[SimRequest]
    arrival_s: np.ndarray
    admit_s: np.ndarray
    prefill_start_s: np.ndarray
    prefill_end_s: np.ndarray
    first_token_s: np.ndarray
    kv_done_s: np.ndarray
    finish_s: np.ndarray
    cached_tokens: np.ndarray
    itl_values_s: np.ndarray
    itl_weights: np.ndarray
    itl_first_s: np.ndarray
    rejected: list[int] = field(default_factory=list)
    join_step: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    decode_replica: list[str] = field(default_factory=list)
    step_ends_s: dict[str, np.ndarray] = field(default_factory=dict)
    busy_s: dict[str, float] = field(default_factory=dict)

    def token_times_s(self, i: int) -> list[float]:
        """Request `i`'s output token times: its first token, then the end of each decode step it was in
        (`join_step`: the steps its decode replica had done when it joined)."""
        n = self.requests[i].output_len
        if n == 1:
            return [float(self.first_token_s[i])]
        steps = self.step_ends_s[self.decode_replica[i]]
        s = int(self.join_step[i])
        return [float(self.first_token_s[i]), *(float(t) for t in steps[s : s + n - 1])]

    @property
    def done(self) -> np.ndarray:
        return ~np.isnan(self.finish_s)

    @property
    def output_len(self) -> np.ndarray:
        return np.array([r.output_len for r in self.requests])

    @property
    def prompt_len(self) -> np.ndarray:
        return np.array([r.prompt_len for r in self.requests])

    @property
    def ttft_s(self) -> np.ndarray:
        return self.first_token_s - self.arrival_s

    @property
    def e2el_s(self) -> np.ndarray:
        return self.finish_s - self.arrival_s

    @property
    def tpot_s(self) -> np.ndarray:
        """(E2EL − TTFT) / (output − 1); 0 for one output token (vLLM's rule, counted as meeting a TPOT "
        "SLO)."""
        out = self.output_len
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(out > 1, (self.finish_s - self.first_token_s) / np.maximum(out - 1, 1), 0.0)

    def itl_s(self) -> np.ndarray:
        """Every inter-token latency, one value per decode token (vLLM's ITL with one token per chunk)."""
        return np.concatenate([np.repeat(self.itl_values_s, self.itl_weights), self.itl_first_s])

    def attainment(self, slo_ms: Mapping[str, float]) -> float:
        """Fraction of all requests (rejected and unfinished count as missing) meeting every SLO."""
        return float(self.meets(slo_ms).sum()) / max(len(self.requests), 1)

    def meets(self, slo_ms: Mapping[str, float]) -> np.ndarray:
        values = {"ttft": self.ttft_s, "tpot": self.tpot_s, "e2el": self.e2el_s}
        ok = self.done.copy()
        for key, ms in slo_ms.items():
            ok &= np.nan_to_num(values[key], nan=np.inf) * 1000.0 <= ms
        return ok

    def metrics(
        self, goodput_slo_ms: Mapping[str, float] | None = None, percentiles: Sequence[float] = PERCENTILES
    ) -> BenchmarkMetrics:
        """`calculate_metrics`' numbers (bench/metrics.py) from the simulated times: duration = first send
        → last token."""
        done = self.done
        slo = dict(goodput_slo_ms or {})
        out = self.output_len
        duration = float(np.nanmax(self.finish_s) - np.min(self.arrival_s)) if done.any() else 1.0
        total_in = int(self.prompt_len[done].sum())
        total_out = int(out[done].sum())
        tpot = self.tpot_s[done & (out > 1)]
        return BenchmarkMetrics(
            completed=int(done.sum()),
            failed=int((~done).sum()),
            total_input=total_in,
            total_output=total_out,
            duration_s=duration,
            request_throughput=done.sum() / duration,
            request_goodput=float(self.meets(slo).sum()) / duration if slo else None,
            output_throughput=total_out / duration,
            total_token_throughput=(total_in + total_out) / duration,
            latency={
                "ttft": distribution(self.ttft_s[done], percentiles),
                "tpot": distribution(tpot, percentiles),
                "itl": weighted_distribution(
                    np.concatenate([self.itl_values_s, self.itl_first_s]),
                    np.concatenate([self.itl_weights, np.ones(len(self.itl_first_s), dtype=np.int64)]),
                    percentiles,
                ),
                "e2el": distribution(self.e2el_s[done], percentiles),
            },
            goodput_slo_ms=slo,
            max_concurrent_requests=_peak(self.arrival_s[done], self.finish_s[done]),
        )

    def ttft_breakdown_s(self) -> dict[str, float]:
        """Mean seconds of each TTFT phase over completed requests; the phases sum to the mean TTFT."""
        done = self.done
        ov = self.config.overheads
        reached = self.arrival_s + ov.request_s
        first_from_decode = self.config.first_token_from == "decode" and self.config.mode == "disaggregated"
        exposed = (
            (self.first_token_s - ov.first_token_s - self.prefill_end_s)
            if first_from_decode
            else np.zeros_like(self.arrival_s)
        )
        phases = {
            "control": np.full_like(self.arrival_s, ov.request_s),
            "admission": self.admit_s - reached,
            "prefill_queue": self.prefill_start_s - self.admit_s,
            "prefill": self.prefill_end_s - self.prefill_start_s,
            "exposed_transfer": exposed,
            "first_token": np.full_like(self.arrival_s, ov.first_token_s),
        }
        return {k: float(np.mean(v[done])) if done.any() else 0.0 for k, v in phases.items()}

    def summary(self, goodput_slo_ms: Mapping[str, float]) -> dict[str, Any]:
        """The numbers a report prints (latencies in ms), as `bench compare`'s point summary names them."""
        m = self.metrics(goodput_slo_ms)
        lat = {
            k: {"p50": d.median_ms, "p90": d.p(90), "p99": d.p(99), "mean": d.mean_ms}
            for k, d in m.latency.items()
        }
        return {
            "mode": self.config.mode,
            "requests": len(self.requests),
            "completed": m.completed,
            "rejected": len(self.rejected),
            "duration_s": m.duration_s,
            "request_throughput": m.request_throughput,
            "request_goodput": m.request_goodput,
            "slo_attainment": self.attainment(goodput_slo_ms),
            "output_throughput": m.output_throughput,
            "latency_ms": lat,
            "ttft_breakdown_mean_ms": {k: v * 1000.0 for k, v in self.ttft_breakdown_s().items()},
            "prefix_hit_rate": float(self.cached_tokens.sum()) / max(int(self.prompt_len.sum()), 1),
            "utilization": {k: v / m.duration_s for k, v in self.busy_s.items()},
        }


def weighted_distribution(
    values_s: np.ndarray, weights: np.ndarray, percentiles: Sequence[float]
) -> Distribution:
    """`distribution(np.repeat(values_s, weights), percentiles)` without the repeat: the same mean, std and
    linear-interpolation percentiles (numpy's default: position (N − 1)·q/100 in the sorted expansion),
    from the values sorted with their cumulative weights. 20M ITLs of a 100k-request run stay 100k steps."""
    keep = weights > 0
    v, w = values_s[keep] * 1000.0, weights[keep].astype(np.int64)
    n = int(w.sum())
    if n == 0:
        return distribution([], percentiles)
    order = np.argsort(v, kind="stable")
    v, w = v[order], w[order]
    ends = np.cumsum(w)  # expanded indices [ends[j] - w[j], ends[j]) hold v[j]

    def at(k: np.ndarray) -> np.ndarray:
        return v[np.searchsorted(ends, k, side="right")]

    def pct(q: float) -> float:
        h = (n - 1) * q / 100.0
        lo = int(np.floor(h))
        a, b = at(np.array([lo, min(lo + 1, n - 1)]))
        return float(a + (h - lo) * (b - a))

    mean = float((v * w).sum() / n)
    return Distribution(
        mean_ms=mean,
        median_ms=pct(50.0),
        std_ms=float(np.sqrt((w * (v - mean) ** 2).sum() / n)),
        percentiles_ms={float(p): pct(p) for p in percentiles},
        count=n,
    )


def _peak(starts: np.ndarray, ends: np.ndarray) -> int:
    """Most requests in flight at once over [start, end) (bench/metrics.py `peak_concurrency`)."""
    if not len(starts):
        return 0
    t = np.concatenate([starts, ends])
    d = np.concatenate([np.ones(len(starts), dtype=np.int64), -np.ones(len(ends), dtype=np.int64)])
    order = np.lexsort((d, t))
    return int(np.cumsum(d[order]).max())

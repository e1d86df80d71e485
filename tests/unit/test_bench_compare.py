"""The comparison's bookkeeping: ratios, token splits, pool pinning, interference check, verdict."""

from __future__ import annotations

import pytest

from pdserve.bench.compare import parse_ratio, split_tokens
from pdserve.bench.compare_report import interference_lines, markdown, verdict_lines
from pdserve.bench.pinning import pool_cores
from pdserve.stack_state import ServiceState, StackState


def test_ratios_parse_and_split_the_token_budget():
    assert parse_ratio("10:1") == (10, 1)
    assert split_tokens(220, (10, 1)) == (200, 20)
    assert split_tokens(220, (1, 1)) == (110, 110)
    assert split_tokens(21, (1, 20)) == (1, 20)
    for bad in ("10", "0:1", "a:b", "1:-2"):
        with pytest.raises(ValueError):
            parse_ratio(bad)


def _state(*roles: str) -> StackState:
    services = {f"{r}-{i}": ServiceState(module="m", role=r, log="x") for i, r in enumerate(roles)}
    return StackState(supervisor_pid=1, supervisor_create_time=0.0, mode="m", model="tiny", var_dir="v",
                      gateway_url="http://x", services=services)


def test_each_pool_gets_its_own_core():
    disaggregated = _state("router", "prefill", "decode", "gateway")
    assert pool_cores(disaggregated, ncpu=2) == {"prefill-1": 0, "decode-2": 1}
    assert pool_cores(_state("unified", "unified", "recorder"), ncpu=2) == {"unified-0": 0, "unified-1": 1}


def _point(mode: str, ratio: str, rate: float, good: int, itl50: float, itl99: float) -> dict:
    lat = {k: {"p50": 1.0, "p99": 2.0, "mean": 1.0} for k in ("ttft", "tpot", "e2el")}
    lat["itl"] = {"p50": itl50, "p99": itl99, "mean": itl50}
    return {"mode": mode, "ratio": ratio, "request_rate": rate, "input_len": 10, "output_len": 10,
            "completed": 20, "failed": 0, "duration_s": 10.0, "request_throughput": 2.0,
            "request_goodput": good / 10.0, "goodput_fraction": good / 20, "output_throughput": 1.0,
            "latency_ms": lat, "itl_p99_over_p50": itl99 / itl50, "ttft_breakdown_mean_ms": {}, "errors": []}


RESULTS = {
    "config": {"model": "tiny", "num_prompts": 20, "tokens_per_request": 20, "burstiness": 1.0, "seed": 0,
               "goodput_slo_ms": {"ttft": 100.0}},
    "machine": {"cpus": 2, "platform": "linux", "loadavg_at_start": [1, 1, 1]},
    "started_at": "now",
    "points": [
        _point("colocated", "10:1", 1.0, good=10, itl50=10.0, itl99=30.0),      # interference
        _point("disaggregated", "10:1", 1.0, good=15, itl50=10.0, itl99=12.0),  # wins by 5 requests
        _point("colocated", "1:1", 1.0, good=10, itl50=10.0, itl99=15.0),
        _point("disaggregated", "1:1", 1.0, good=11, itl50=10.0, itl99=14.0),   # within the margin
    ],
}


def test_interference_is_p99_itl_above_twice_p50_in_colocated_points_only():
    lines = interference_lines(RESULTS)
    assert sum("**yes**" in line for line in lines) == 1
    assert lines[-1].endswith("at 1 of 2 points.")


def test_verdict_counts_wins_beyond_the_margin_only():
    text = "\n".join(verdict_lines(RESULTS))
    assert "disaggregation wins at 1 of 2 points (10:1 @ 1 req/s)" in text
    assert "ties (within the margin): 1 points" in text
    assert "does not pay" not in text


def test_no_win_anywhere_says_so():
    results = {**RESULTS, "points": RESULTS["points"][2:]}
    assert any("does not pay on this machine" in line for line in verdict_lines(results))
    assert "Interference check" in markdown(results)

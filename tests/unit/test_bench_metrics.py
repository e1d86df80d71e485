"""vllm bench serve's metric definitions, computed exactly from scripted timestamps (binary-exact values)."""

from __future__ import annotations

import pytest

from pdserve.bench.metrics import RequestRecord, calculate_metrics, meets_slo, parse_goodput, peak_concurrency


def record(index: int, start: float, chunks: list[float], tokens: int | None = None, prompt_len: int = 8,
           success: bool = True) -> RequestRecord:
    return RequestRecord(index=index, prompt_len=prompt_len, expected_output_len=len(chunks), start_s=start,
                         chunk_times_s=chunks, output_tokens=tokens, success=success)


# Request A: sent at 0, chunks at 0.25, 0.375, 0.5, 1.0 → TTFT 0.25, ITLs 0.125 0.125 0.5, E2EL 1.0,
#   TPOT (1.0 - 0.25) / 3 = 0.25.
# Request B: sent at 0.5, chunks at 1.5, 1.75 with usage saying 3 tokens (one chunk held two) →
#   TTFT 1.0, ITL 0.25, E2EL 1.25, TPOT 0.25 / 2 = 0.125.
# Request C: sent at 1.0, a single chunk at 1.125 → TTFT 0.125, no ITL, TPOT 0 (excluded from TPOT stats).
# Request D: failed.
RECORDS = [
    record(0, 0.0, [0.25, 0.375, 0.5, 1.0]),
    record(1, 0.5, [1.5, 1.75], tokens=3, prompt_len=16),
    record(2, 1.0, [1.125]),
    record(3, 1.5, [], success=False),
]


def test_per_request_ttft_itl_e2el_tpot_follow_vllm_definitions():
    a, b, c, _ = RECORDS
    assert (a.ttft_s, a.itls_s, a.e2el_s, a.tpot_s) == (0.25, [0.125, 0.125, 0.5], 1.0, 0.25)
    assert (b.ttft_s, b.itls_s, b.e2el_s, b.num_output_tokens, b.tpot_s) == (1.0, [0.25], 1.25, 3, 0.125)
    assert (c.ttft_s, c.itls_s, c.tpot_s) == (0.125, [], 0.0)


def test_aggregates_count_only_successful_requests_and_divide_by_duration():
    m = calculate_metrics(RECORDS, duration_s=2.0, percentiles=[50, 99])
    assert (m.completed, m.failed) == (3, 1)
    assert (m.total_input, m.total_output) == (8 + 16 + 8, 4 + 3 + 1)
    assert m.request_throughput == 1.5
    assert m.output_throughput == 4.0
    assert m.total_token_throughput == 20.0
    assert m.request_goodput is None


def test_distributions_are_in_milliseconds_with_linear_percentiles():
    m = calculate_metrics(RECORDS, duration_s=2.0, percentiles=[50, 99])
    ttft = m.latency["ttft"]  # 125, 250, 1000 ms
    assert ttft.mean_ms == pytest.approx(1375 / 3)
    assert ttft.median_ms == 250.0
    assert ttft.p(99) == pytest.approx(250 + 0.98 * 750)
    itl = m.latency["itl"]  # per chunk: 125, 125, 500, 250 ms
    assert (itl.count, itl.mean_ms, itl.median_ms) == (4, 250.0, 187.5)
    tpot = m.latency["tpot"]  # only requests with more than one token: 250, 125 ms
    assert (tpot.count, tpot.mean_ms) == (2, 187.5)
    assert m.latency["e2el"].percentiles_ms[50.0] == 1000.0


def test_goodput_counts_requests_meeting_every_slo():
    # TTFT ≤ 300 ms: A and C; TPOT ≤ 200 ms: B and C (C's TPOT is 0) → only C meets both.
    m = calculate_metrics(RECORDS, duration_s=2.0, goodput_slo_ms=parse_goodput(["ttft:300", "tpot:200"]))
    assert m.request_goodput == 0.5
    # E2EL ≤ 1000 ms: A (equal) and C
    assert calculate_metrics(RECORDS, 2.0, goodput_slo_ms={"e2el": 1000}).request_goodput == 1.0


def test_an_slo_equal_to_the_value_is_met():
    assert meets_slo(RECORDS[0], {"ttft": 250.0, "tpot": 250.0, "e2el": 1000.0})
    assert not meets_slo(RECORDS[0], {"ttft": 249.9})


def test_peak_concurrency_uses_half_open_intervals():
    # A [0, 1.0), B [0.5, 1.75), C [1.0, 1.125): C starts exactly when A ends.
    assert peak_concurrency(RECORDS[:3]) == 2


def test_an_empty_run_reports_zeros_not_errors():
    m = calculate_metrics([record(0, 0.0, [], success=False)], duration_s=1.0)
    assert (m.completed, m.failed, m.latency["ttft"].mean_ms, m.latency["itl"].count) == (0, 1, 0.0, 0)


@pytest.mark.parametrize("bad", [["ttft"], ["speed:3"], ["ttft:abc"], ["tpot:-1"]])
def test_malformed_goodput_is_refused(bad):
    with pytest.raises(ValueError):
        parse_goodput(bad)


def test_duration_must_be_positive():
    with pytest.raises(ValueError):
        calculate_metrics(RECORDS, duration_s=0.0)

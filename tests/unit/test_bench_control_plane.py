"""Control-plane overhead: client TTFT − worker forward − exposed transfer, split into phases that add up."""

from __future__ import annotations

import pytest

from pdserve.bench.breakdown import TTFTBreakdown
from pdserve.bench.control_plane import PHASES, request_overheads, summarise
from pdserve.bench.metrics import RequestRecord


def record(rid: str, ttft_s: float, success: bool = True) -> RequestRecord:
    return RequestRecord(index=0, prompt_len=4, expected_output_len=2, start_s=10.0,
                         chunk_times_s=[10.0 + ttft_s, 10.0 + ttft_s + 0.01], success=success, request_id=rid)


def breakdown(rid: str, mode: str = "disaggregated", **stages: float) -> TTFTBreakdown:
    st = {"queue_s": 0.002, "route_s": 0.001, "reserve_s": 0.003, "prefill_s": 0.020,
          "exposed_transfer_s": 0.004, "first_token_s": 0.001} | {f"{k}_s": v for k, v in stages.items()}
    return TTFTBreakdown(request_id=rid, state="completed", mode=mode, ttft_s=sum(st.values()),
                         stages_s=st, cached_tokens=0, kv_bytes=1)


def test_overhead_excludes_the_forward_and_the_exposed_transfer_and_its_phases_add_up():
    b = breakdown("a")
    rows = request_overheads([record("a", 0.040)], {"a": b}, {"a": 0.015})
    assert len(rows) == 1
    row = rows[0]
    assert row["overhead"] == pytest.approx(0.040 - 0.015 - 0.004)
    assert row["client_gateway"] == pytest.approx(0.040 - b.ttft_s)
    assert row["prefill_dispatch"] == pytest.approx(0.020 - 0.015)
    assert sum(row[p] for p in PHASES) == pytest.approx(row["overhead"])


def test_without_a_transfer_the_breakdowns_exposed_transfer_is_the_start_hop_and_counts_as_overhead():
    row = request_overheads([record("a", 0.040)], {"a": breakdown("a", mode="colocated")}, {"a": 0.015})[0]
    assert row["exposed_transfer"] == 0.0
    assert row["start_decode"] == pytest.approx(0.004)
    assert row["overhead"] == pytest.approx(0.040 - 0.015)
    assert sum(row[p] for p in PHASES) == pytest.approx(row["overhead"])


def test_requests_without_a_breakdown_a_prefill_event_or_success_are_left_out():
    recs = [record("a", 0.04), record("b", 0.04), record("c", 0.04), record("d", 0.04, success=False)]
    bds = {"a": breakdown("a"), "c": breakdown("c"), "d": breakdown("d")}
    rows = request_overheads(recs, bds, {"a": 0.01, "b": 0.01, "d": 0.01})
    assert len(rows) == 1


def test_summary_subtracts_the_floor_percentiles():
    rows = [request_overheads([record(str(i), 0.030 + i * 0.001)], {str(i): breakdown(str(i))},
                              {str(i): 0.010})[0] for i in range(11)]
    s = summarise(rows, [0.001] * 11)
    assert s["requests"] == 11
    assert s["overhead_p50_ms"] == pytest.approx((0.035 - 0.010 - 0.004) * 1e3)
    assert s["above_floor_p50_ms"] == pytest.approx(s["overhead_p50_ms"] - 1.0)
    assert sum(s["phases_mean_ms"].values()) == pytest.approx(s["overhead_mean_ms"])

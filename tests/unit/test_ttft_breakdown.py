"""The coordinator's TTFT breakdown: its phases add up to the TTFT, whichever worker sent the first token."""

from __future__ import annotations

import pytest

from pdserve.lifecycle.completion import ttft_breakdown
from pdserve.messages import DecodeAdmitted, DecodeFinished, FinishReason

RECEIVED = 1000.0
TIMINGS = {"route": 1000.002, "reserve": 1000.004, "prefill": 1000.007, "prefilled": 1000.250}


def admitted(transfer_done_ts: float, first_token_ts: float) -> DecodeAdmitted:
    return DecodeAdmitted(request_id="r", worker_id="decode-0", transfer_bytes=1, transfer_s=0.1,
                          transfer_done_ts=transfer_done_ts, first_token_ts=first_token_ts)


DONE = DecodeFinished(request_id="r", worker_id="decode-0", finish_reason=FinishReason.LENGTH,
                      num_output_tokens=4, first_token_ts=1000.3, last_token_ts=1001.0)


def phases_sum(b) -> float:
    return b.queue_s + b.route_s + b.reserve_s + b.prefill_s + b.exposed_transfer_s + b.first_token_s


def test_a_first_token_streamed_by_the_prefill_worker_ends_the_ttft_at_the_prefill():
    b = ttft_breakdown(RECEIVED, DONE, admitted(1000.260, 1000.270), {**TIMINGS, "first_token": 1000.240})
    assert b.ttft_s == pytest.approx(0.240)
    assert b.prefill_s == pytest.approx(0.233) and b.exposed_transfer_s == 0 and b.first_token_s == 0
    assert (b.queue_s, b.route_s, b.reserve_s) == pytest.approx((0.002, 0.002, 0.003))
    assert phases_sum(b) == pytest.approx(b.ttft_s)


def test_without_a_streamed_first_token_the_transfer_tail_and_the_start_count():
    b = ttft_breakdown(RECEIVED, DONE, admitted(1000.260, 1000.270), TIMINGS)
    assert b.ttft_s == pytest.approx(0.270)
    assert b.prefill_s == pytest.approx(0.243)
    assert b.exposed_transfer_s == pytest.approx(0.010) and b.first_token_s == pytest.approx(0.010)
    assert phases_sum(b) == pytest.approx(b.ttft_s)

"""The recorder's metrics from committed events (pdserve.store.event_metrics): outcomes by reason, TTFT by
phase, and every series present at 0 before any event."""

from __future__ import annotations

from prometheus_client import REGISTRY

from pdserve.events import Event, RequestCompleted, RequestFailed, RequestMigrated, TTFTBreakdown
from pdserve.ids import new_id
from pdserve.messages import FinishReason
from pdserve.store import event_metrics


def outcome(outcome: str, reason: str) -> float | None:
    return REGISTRY.get_sample_value("pdserve:request_outcomes_total", {"outcome": outcome, "reason": reason})


def phase_count(phase: str) -> float | None:
    return REGISTRY.get_sample_value("pdserve:ttft_phase_seconds_count", {"phase": phase})


def phase_sum(phase: str) -> float | None:
    return REGISTRY.get_sample_value("pdserve:ttft_phase_seconds_sum", {"phase": phase})


def event(payload) -> Event:
    return Event.of(new_id(), payload, service="coordinator")


def test_series_exist_at_zero_before_any_event() -> None:
    event_metrics.init_series()
    assert outcome("failed", "transfer") is not None
    assert outcome("recovered", "re-prefill") is not None
    assert phase_count("exposed_transfer") is not None


def test_outcomes_and_ttft_phases_are_counted_from_events() -> None:
    event_metrics.init_series()
    before = (outcome("completed", "length"), outcome("failed", "prefill"), outcome("migrated", "decode"),
              phase_count("prefill"), phase_sum("exposed_transfer"))
    ttft = TTFTBreakdown(queue_s=0.001, route_s=0.002, reserve_s=0.003, prefill_s=0.05,
                         exposed_transfer_s=0.004, first_token_s=0.01, ttft_s=0.07)
    resumed = TTFTBreakdown(queue_s=0, route_s=0, reserve_s=0, prefill_s=0, exposed_transfer_s=0,
                            first_token_s=0, ttft_s=0.5)
    event_metrics.observe([
        event(RequestCompleted(finish_reason=FinishReason.LENGTH, prompt_tokens=3, completion_tokens=4,
                               ttft=ttft, e2e_s=0.2)),
        event(RequestCompleted(finish_reason=FinishReason.LENGTH, prompt_tokens=3, completion_tokens=4,
                               ttft=resumed, e2e_s=0.9)),  # no placement of its own: no phases
        event(RequestFailed(phase="prefill", reason="boom")),
        event(RequestMigrated(from_worker_id="decode-0", phase="decode", reason="lost",
                              num_committed_tokens=2, attempt=1)),
    ])
    after = (outcome("completed", "length"), outcome("failed", "prefill"), outcome("migrated", "decode"),
             phase_count("prefill"), phase_sum("exposed_transfer"))
    assert [a - b for a, b in zip(after, before, strict=True)][:4] == [2, 1, 1, 1]
    assert abs(after[4] - before[4] - 0.004) < 1e-9

"""A request's hops to its prefill from its spans (libs/pdserve/bench/hops.py): one hop per pair of marks,
the marks found through any span of the request's trace, the first of a name when a prefill was redone."""

from __future__ import annotations

from pdserve.bench.hops import HOPS, request_hops
from pdserve.telemetry.spans import SpanRecord

MS = 1_000_000  # ns


def span(name: str, start_ms: float, trace: str = "t1", service: str = "svc", rid: str | None = None,
         span_id: str | None = None) -> SpanRecord:
    return SpanRecord(trace_id=trace, span_id=span_id or f"{trace}-{name}-{start_ms}", parent_span_id=None,
                      name=name, service=service, start_unix_ns=int(start_ms * MS),
                      end_unix_ns=int((start_ms + 1) * MS),
                      attributes={"pdserve.request_id": rid} if rid else {})


def request_spans(rid: str, trace: str, worker: str = "unified-0") -> list[SpanRecord]:
    """A colocated request's spans: only gateway.request carries the request id, as the HTTP and handler
    spans do not."""
    return [span("POST /v1/completions", 100.0, trace),
            span("gateway.request", 101.0, trace, rid=rid),
            span("coordinator.handle submit", 103.5, trace),
            span("coordinator.request", 103.8, trace, rid=rid),
            span("coordinator.attempt", 105.0, trace, rid=rid),
            span("coordinator.prefill", 105.25, trace, rid=rid),
            span(f"{worker}.handle prefill", 107.0, trace),
            span("prefill.forward", 107.5, trace, rid=rid)]


def test_each_hop_is_the_time_between_two_marks_and_they_add_up_to_http_to_forward():
    hops = request_hops(request_spans("r1", "t1"), ["r1"])["r1"]
    assert list(hops) == list(HOPS)
    assert {k: round(v * 1e3, 6) for k, v in hops.items()} == {
        "http": 1.0, "submit": 2.5, "claim": 1.5, "dispatch": 0.25, "command": 1.75, "handler": 0.5}
    assert round(sum(hops.values()) * 1e3, 6) == 7.5


def test_requests_are_told_apart_by_trace_and_a_disaggregated_prefill_workers_handler_counts():
    spans = request_spans("r1", "t1") + request_spans("r2", "t2", worker="prefill-0")
    out = request_hops(spans, ["r1", "r2"])
    assert set(out) == {"r1", "r2"}
    assert round(out["r2"]["command"] * 1e3, 6) == 1.75


def test_a_redone_prefill_keeps_the_first_attempts_marks():
    spans = request_spans("r1", "t1") + [span("coordinator.prefill", 300.0, "t1", rid="r1"),
                                         span("unified-0.handle prefill", 301.0, "t1"),
                                         span("prefill.forward", 302.0, "t1", rid="r1")]
    assert round(request_hops(spans, ["r1"])["r1"]["handler"] * 1e3, 6) == 0.5


def test_a_request_missing_a_mark_or_not_asked_for_is_left_out():
    partial = [s for s in request_spans("r1", "t1") if s.name != "prefill.forward"]
    assert request_hops(partial + request_spans("r2", "t2"), ["r1"]) == {}

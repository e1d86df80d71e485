"""`pdserve trace` logic on spans made by the real OTel SDK and written by our JSON-lines exporter, one
file per emulated service, with context carried between them the way the bus carries it (headers)."""

from __future__ import annotations

import argparse
import io
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from rich.console import Console

from pdserve.cli import trace as trace_cli
from pdserve.telemetry.jsonl_exporter import JsonLinesSpanExporter
from pdserve.telemetry.setup import build_tracer_provider
from pdserve.telemetry.spans import load_spans, services_seen, spans_of_request, trace_ids
from pdserve.telemetry.waterfall import bar_cells, build_tree, layout, ttft_breakdown

MS = 1_000_000  # ns
T0 = 1_700_000_000_000 * MS
RID = "0190c5a8-0000-7000-8000-000000000001"
OTHER_RID = "0190c5a8-0000-7000-8000-000000000002"
TTFT_ATTRS = {
    "pdserve.ttft.queue_s": 0.001, "pdserve.ttft.route_s": 0.002, "pdserve.ttft.reserve_s": 0.003,
    "pdserve.ttft.prefill_s": 0.040, "pdserve.ttft.exposed_transfer_s": 0.004,
    "pdserve.ttft.first_token_s": 0.010, "pdserve.ttft_s": 0.060,
}


class Stack:
    """One tracer provider per service, each exporting to its own file under `trace_dir`."""

    def __init__(self, trace_dir: Path) -> None:
        self.trace_dir = trace_dir
        self.providers = {
            svc: build_tracer_provider(svc, JsonLinesSpanExporter(trace_dir / f"{svc}-{i + 100}.jsonl"))
            for i, svc in enumerate(("gateway", "coordinator", "router", "prefill", "decode"))
        }

    @contextmanager
    def span(self, svc: str, name: str, start_ms: float, end_ms: float, parent: dict | None = None,
             **attrs) -> Iterator[dict]:
        """A span of `svc` from `start_ms` to `end_ms` after T0; `parent` is a carrier from another span.
        Yields the carrier (the `traceparent` header) its children receive."""
        tracer = self.providers[svc].get_tracer(svc)
        ctx = propagate.extract(parent) if parent is not None else Context()
        span = tracer.start_span(name, context=ctx, attributes=attrs, start_time=T0 + int(start_ms * MS))
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(span))
        try:
            yield carrier
        finally:
            span.end(end_time=T0 + int(end_ms * MS))

    def leaf(self, svc: str, name: str, start_ms: float, end_ms: float, parent: dict, **attrs) -> None:
        with self.span(svc, name, start_ms, end_ms, parent, **attrs):
            pass

    def flush(self) -> None:
        for p in self.providers.values():
            p.shutdown()


def emit_request(stack: Stack, rid: str, layers: int, bad_layer: int | None = None, t: float = 0.0) -> None:
    """One disaggregated request as the services emit it (span names from the telemetry conventions)."""
    r = {"pdserve.request_id": rid}
    with stack.span("gateway", "gateway.request", t, t + 100, **r, **{
            "gen_ai.request.model": "SmolLM2-135M-Instruct", "gen_ai.usage.input_tokens": 40,
            "gen_ai.usage.output_tokens": 8}) as gw:
        with stack.span("coordinator", "coordinator.request", t + 1, t + 99, gw, **r, **TTFT_ATTRS) as co:
            with stack.span("coordinator", "coordinator.route", t + 2, t + 4, co, **r) as route:
                with stack.span("router", "router.handle route", t + 2.5, t + 3.8, route) as handle:
                    stack.leaf("router", "router.route", t + 2.6, t + 3.5, handle, **r)
            stack.leaf("coordinator", "coordinator.reserve", t + 4, t + 7, co, **r)
            with stack.span("coordinator", "coordinator.prefill", t + 7, t + 50, co, **r) as cp:
                with stack.span("prefill", "prefill.forward", t + 8, t + 48, cp, **r) as fwd:
                    for layer in range(layers):
                        start = t + 10 + layer * 4
                        stack.leaf("prefill", "transfer.send", start, start + 2, fwd, **r, **{
                            "pdserve.layer": layer, "pdserve.bytes": 24576})
                        stack.leaf("decode", "transfer.verify_checksum", start + 2, start + 3, fwd, **r, **{
                            "pdserve.layer": layer, "pdserve.checksum_ok": layer != bad_layer})
            with stack.span("coordinator", "coordinator.start_decode", t + 50, t + 52, co, **r) as sd:
                stack.leaf("decode", "decode.admit", t + 51, t + 51.5, sd, **r)
                stack.leaf("decode", "decode.generate", t + 51.5, t + 98, sd, **r)


@pytest.fixture
def traces(tmp_path: Path) -> Path:
    """var/traces with two requests: RID (8 layers) and OTHER_RID (an unrelated one, later)."""
    stack = Stack(tmp_path / "var" / "traces")
    emit_request(stack, RID, layers=8)
    emit_request(stack, OTHER_RID, layers=8, t=500)
    stack.flush()
    return stack.trace_dir


def request_spans(trace_dir: Path, rid: str = RID):
    return spans_of_request(load_spans(trace_dir).spans, rid)


def test_exporter_writes_one_file_per_service_process(traces: Path) -> None:
    assert sorted(p.name for p in traces.glob("*.jsonl")) == [
        "coordinator-101.jsonl", "decode-104.jsonl", "gateway-100.jsonl", "prefill-103.jsonl",
        "router-102.jsonl"]


def test_request_spans_come_from_every_service_and_one_trace_only(traces: Path) -> None:
    spans = request_spans(traces)
    assert len(trace_ids(spans)) == 1
    assert services_seen(spans) == [f"pdserve-{s}" for s in ("gateway", "coordinator", "router", "prefill",
                                                             "decode")]
    assert all(s.request_id in (RID, None) for s in spans)
    # The bus handler span has no request id, yet belongs to the request through its trace.
    assert "router.handle route" in {s.name for s in spans}
    assert len(spans) == 11 + 8 * 2  # 11 request-level spans, a send and a verify per layer


def test_tree_nests_spans_across_services_with_children_in_start_order(traces: Path) -> None:
    (root,) = build_tree(request_spans(traces))
    assert root.span.name == "gateway.request"
    (coord,) = root.children
    assert coord.span.name == "coordinator.request"
    assert [c.span.name for c in coord.children] == [
        "coordinator.route", "coordinator.reserve", "coordinator.prefill", "coordinator.start_decode"]
    forward = coord.children[2].children[0]
    assert forward.span.name == "prefill.forward" and forward.span.service == "pdserve-prefill"
    assert [c.span.name for c in coord.children[3].children] == ["decode.admit", "decode.generate"]
    starts = [c.span.start_unix_ns for c in forward.children]
    assert starts == sorted(starts)


def test_many_per_layer_transfer_spans_collapse_into_one_summary_row_each(traces: Path) -> None:
    rows = layout(build_tree(request_spans(traces))).rows
    assert not [r for r in rows if r.span is not None and r.name.startswith("transfer.")]
    send, verify = (r.group for r in rows if r.group is not None)
    assert (send.name, send.count, send.layers, send.kv_bytes) == ("transfer.send", 8, 8, 8 * 24576)
    assert send.checksums_ok is None
    assert (verify.name, verify.count, verify.checksums_ok, verify.checksum_failures) == (
        "transfer.verify_checksum", 8, True, 0)
    send_row = next(r for r in rows if r.group is send)
    # The summary spans the first send's start to the last send's end, under prefill.forward.
    assert send_row.offset_s == pytest.approx(0.010) and send_row.duration_s == pytest.approx(0.030)
    assert rows[rows.index(send_row) - 1].name == "prefill.forward"


def test_a_failed_checksum_shows_in_the_collapsed_row(tmp_path: Path) -> None:
    stack = Stack(tmp_path)
    emit_request(stack, RID, layers=6, bad_layer=3)
    stack.flush()
    (verify,) = (r.group for r in layout(build_tree(request_spans(tmp_path))).rows
                 if r.group is not None and r.name == "transfer.verify_checksum")
    assert verify.checksums_ok is False and verify.checksum_failures == 1


def test_few_layer_spans_stay_individual_rows(tmp_path: Path) -> None:
    stack = Stack(tmp_path)
    emit_request(stack, RID, layers=2)
    stack.flush()
    rows = layout(build_tree(request_spans(tmp_path))).rows
    assert [r.name for r in rows if r.name.startswith("transfer.")] == [
        "transfer.send", "transfer.verify_checksum", "transfer.send", "transfer.verify_checksum"]
    assert all(r.group is None for r in rows)


def test_layout_puts_every_row_on_one_axis_starting_at_the_root(traces: Path) -> None:
    wf = layout(build_tree(request_spans(traces)))
    assert wf.total_s == pytest.approx(0.100)
    assert [(r.name, r.depth) for r in wf.rows[:4]] == [
        ("gateway.request", 0), ("coordinator.request", 1), ("coordinator.route", 2),
        ("router.handle route", 3)]
    assert wf.rows[0].offset_s == 0 and wf.rows[0].guide == ""
    reserve = next(r for r in wf.rows if r.name == "coordinator.reserve")
    assert reserve.offset_s == pytest.approx(0.004) and reserve.duration_s == pytest.approx(0.003)
    assert reserve.guide == "   ├─ "
    generate = wf.rows[-1]
    assert generate.name == "decode.generate" and generate.guide == "      └─ "


def test_bars_stay_inside_the_axis_and_are_never_empty() -> None:
    assert bar_cells(0.0, 0.1, 0.1, 40) == (0, 40)
    assert bar_cells(0.05, 0.0, 0.1, 40) == (20, 1)
    assert bar_cells(0.1, 0.0, 0.1, 40) == (39, 1)
    assert bar_cells(0.09, 0.05, 0.1, 40) == (36, 4)
    assert bar_cells(0.0, 0.0, 0.0, 40) == (0, 1)


def test_ttft_breakdown_comes_from_the_coordinator_request_attributes(traces: Path) -> None:
    b = ttft_breakdown(request_spans(traces))
    assert b is not None
    assert b.phases() == [("queue", 0.001), ("route", 0.002), ("reserve", 0.003), ("prefill", 0.040),
                          ("exposed transfer", 0.004), ("first token", 0.010)]
    assert b.ttft_s == 0.060


def test_ttft_breakdown_is_none_without_a_coordinator_span(traces: Path) -> None:
    assert ttft_breakdown([s for s in request_spans(traces) if s.name != "coordinator.request"]) is None


def test_span_whose_parent_was_never_exported_becomes_a_marked_root(traces: Path) -> None:
    spans = [s for s in request_spans(traces) if s.name != "coordinator.prefill"]
    roots = build_tree(spans)
    assert [(r.span.name, r.orphan) for r in roots] == [("gateway.request", False), ("prefill.forward", True)]


def test_a_torn_line_is_skipped_and_counted(traces: Path) -> None:
    with (traces / "decode-104.jsonl").open("a") as f:
        f.write('{"trace_id": "abc", "span_')
    loaded = load_spans(traces)
    assert loaded.bad_lines == 1 and loaded.files == 5
    assert len(spans_of_request(loaded.spans, RID)) == 11 + 8 * 2


# ------------------------------------------------------------------ the command


def run_cli(argv: list[str]) -> tuple[int, str]:
    parser = argparse.ArgumentParser()
    trace_cli.add_parsers(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    out = io.StringIO()
    rc = trace_cli.run(args, console=Console(file=out, width=200, color_system=None))
    return rc, out.getvalue()


def test_trace_command_prints_waterfall_breakdown_services_and_trace_id(traces: Path) -> None:
    rc, out = run_cli(["trace", RID, "--var-dir", str(traces.parent)])
    assert rc == 0
    lines = out.splitlines()
    assert lines[1].lstrip().startswith("gateway.request") and "gateway" in lines[1]
    assert "transfer.send ×8 (8 layers, 192.0 KiB)" in out
    assert "transfer.verify_checksum ×8 (8 layers, checksums ok)" in out
    assert "TTFT breakdown" in out and "exposed transfer" in out and "60.0" in out
    assert "services: gateway, coordinator, router, prefill, decode" in out
    assert f"trace id: {trace_ids(request_spans(traces))[0]}" in out


def test_trace_command_exits_1_when_no_span_has_the_request_id(traces: Path) -> None:
    rc, out = run_cli(["trace", "no-such-request", "--var-dir", str(traces.parent)])
    assert rc == 1
    assert "no span with pdserve.request_id = no-such-request" in out


def test_var_dir_comes_from_env_then_stack_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    default = tmp_path / "var"
    monkeypatch.setenv("PDS_VAR_DIR", str(default))
    assert trace_cli.resolve_var_dir(None) == default
    (default / "run").mkdir(parents=True)
    (default / "run" / "stack.json").write_text(json.dumps({"var_dir": str(tmp_path / "elsewhere")}))
    assert trace_cli.resolve_var_dir(None) == tmp_path / "elsewhere"
    assert trace_cli.resolve_var_dir(tmp_path / "flag") == tmp_path / "flag"


def test_checksum_verifications_under_collapsed_sends_stay_visible_as_their_own_group(tmp_path: Path) -> None:
    # As the services emit them: each decode-side verify is parented on its send (the UCX header's context).
    stack = Stack(tmp_path)
    r = {"pdserve.request_id": RID}
    with stack.span("prefill", "prefill.forward", 0, 40, **r) as fwd:
        for layer in range(6):
            with stack.span("prefill", "transfer.send", layer * 5, layer * 5 + 2, fwd, **r,
                            **{"pdserve.layer": layer, "pdserve.bytes": 100}) as send:
                stack.leaf("decode", "transfer.verify_checksum", layer * 5 + 2, layer * 5 + 3, send, **r,
                           **{"pdserve.layer": layer, "pdserve.checksum_ok": True})
    stack.flush()
    rows = layout(build_tree(request_spans(tmp_path))).rows
    assert [(r.name, r.depth, r.group.count if r.group else None) for r in rows] == [
        ("prefill.forward", 0, None), ("transfer.send", 1, 6), ("transfer.verify_checksum", 2, 6)]
    assert rows[2].group.checksums_ok is True

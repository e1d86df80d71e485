"""`pdserve.telemetry.otlp_json` reads a collector's OTLP/JSON lines into the `SpanRecord`s the JSON-lines
exporter gives: checked on spans the OTel SDK made, encoded by the OTLP exporter's own encoder (protobuf's
JSON mapping: base64 ids) and in the hex-id form OTLP/JSON and observability/rotel_file_processor.py use."""

from __future__ import annotations

import base64
import json

from google.protobuf.json_format import MessageToDict
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Link, Status, StatusCode

from pdserve.telemetry.jsonl_exporter import span_to_record
from pdserve.telemetry.otlp_json import load_otlp_json
from pdserve.telemetry.spans import SpanRecord


def finished_spans():
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "pdserve-coordinator"}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("t")
    with tracer.start_as_current_span("coordinator.request", attributes={"pdserve.request_id": "r1"}):
        with tracer.start_as_current_span("coordinator.attempt", attributes={"pdserve.attempt": 0}) as first:
            first.set_status(Status(StatusCode.ERROR, "worker lost"))
        with tracer.start_as_current_span(
                "coordinator.attempt", links=[Link(first.get_span_context(), {"pdserve.link": "retry_of"})],
                attributes={"pdserve.attempt": 1, "pdserve.ttft_s": 0.25, "pdserve.checksum_ok": True,
                            "gen_ai.response.finish_reasons": ["length"]}) as span:
            span.add_event("migrated", {"from": "decode-0"})
    return memory.get_finished_spans()


def hexify(obj):
    """protobuf's JSON mapping (base64 bytes) → OTLP/JSON's hex trace and span ids."""
    if isinstance(obj, dict):
        ids = ("traceId", "spanId", "parentSpanId")
        return {k: base64.b64decode(v).hex() if k in ids and v else hexify(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [hexify(v) for v in obj]
    return obj


def test_collector_lines_read_as_the_jsonl_exporter_records(tmp_path) -> None:
    spans = finished_spans()
    request = MessageToDict(encode_spans(spans))
    (tmp_path / "protobuf.json").write_text(json.dumps(request) + "\n{torn")
    (tmp_path / "hex.jsonl").write_text(json.dumps(hexify(request)) + "\n")
    expected = sorted((SpanRecord.from_json(span_to_record(s)) for s in spans), key=lambda s: s.span_id)
    for name in ("protobuf.json", "hex.jsonl"):
        loaded = load_otlp_json(tmp_path / name)
        assert loaded.bad_lines == (1 if name == "protobuf.json" else 0)
        assert sorted(loaded.spans, key=lambda s: s.span_id) == expected
    both = load_otlp_json(tmp_path)
    assert both.files == 2 and len(both.spans) == 2 * len(spans)
    retry = next(s for s in expected if s.attributes.get("pdserve.attempt") == 1)
    first = next(s for s in expected if s.attributes.get("pdserve.attempt") == 0)
    assert retry.links == [{"trace_id": first.trace_id, "span_id": first.span_id,
                            "attributes": {"pdserve.link": "retry_of"}}]
    assert first.status_code == "ERROR" and first.status_description == "worker lost"

"""A span exporter that appends one JSON object per finished span to a file (docs/architecture.md §8: the
export used
when no OTLP collector is configured; `pdserve trace` reads these files back).

One line = one span:

    {"trace_id": "<32 hex>", "span_id": "<16 hex>", "parent_span_id": "<16 hex>" | null,
     "name": str, "service": str (resource service.name, e.g. "pdserve-gateway"),
     "start_unix_ns": int, "end_unix_ns": int, "attributes": {str: value},
     "events": [{"name": str, "unix_ns": int, "attributes": {...}}],
     "links": [{"trace_id": "<32 hex>", "span_id": "<16 hex>", "attributes": {...}}],
     "status": {"code": "UNSET" | "OK" | "ERROR", "description": str | null}}

Each process writes its own file, so lines never interleave across processes; within a process the
BatchSpanProcessor's worker thread is the only writer, and a lock guards `export` against a concurrent
`force_flush` from another thread.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from opentelemetry.sdk.resources import SERVICE_NAME
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult


def _attributes(attrs: Mapping[str, Any] | None) -> dict[str, Any]:
    # OTel attribute values are scalars or homogeneous sequences (tuples): JSON takes them as lists.
    return {k: list(v) if isinstance(v, tuple) else v for k, v in (attrs or {}).items()}


def span_to_record(span: ReadableSpan) -> dict[str, Any]:
    """The JSON-ready dict of one finished span (shape in the module docstring)."""
    ctx = span.get_span_context()
    parent = span.parent
    return {
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_span_id": f"{parent.span_id:016x}" if parent is not None else None,
        "name": span.name,
        "service": str(span.resource.attributes.get(SERVICE_NAME, "")),
        "start_unix_ns": span.start_time,
        "end_unix_ns": span.end_time,
        "attributes": _attributes(span.attributes),
        "events": [
            {"name": ev.name, "unix_ns": ev.timestamp, "attributes": _attributes(ev.attributes)}
            for ev in span.events
        ],
        "links": [
            {"trace_id": f"{link.context.trace_id:032x}", "span_id": f"{link.context.span_id:016x}",
             "attributes": _attributes(link.attributes)}
            for link in span.links
        ],
        "status": {"code": span.status.status_code.name, "description": span.status.description},
    }


class JsonLinesSpanExporter(SpanExporter):
    """Appends spans to `path` (created with its parent folders on first export), one JSON line each.

    Lifecycle: construct, hand to a `BatchSpanProcessor`, `shutdown()` at process exit (the processor
    calls it). Export after shutdown returns FAILURE. I/O errors are reported as FAILURE, never raised
    into the application.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._shutdown = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._shutdown:
            return SpanExportResult.FAILURE
        lines = "".join(json.dumps(span_to_record(s), default=str) + "\n" for s in spans)
        try:
            with self._lock:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                with self.path.open("a", encoding="utf-8") as f:
                    f.write(lines)
        except OSError:
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self._shutdown = True

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Nothing is buffered here: every export is written and closed before it returns."""
        return True

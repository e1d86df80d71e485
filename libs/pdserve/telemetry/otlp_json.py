"""Spans from a collector's storage: OTLP/JSON lines, one `ExportTraceServiceRequest` (`{"resourceSpans":
[...]}`) per line — what the OpenTelemetry Collector's `file` exporter writes, and what
observability/rotel_file_processor.py stores for Rotel (docs/architecture.md §8). Read into the same
`SpanRecord`s as the JSON-lines exporter's, so `pdserve trace` draws either.

OTLP/JSON as the specification has it: ids in hex, 64-bit integers (times, intValue) as decimal strings,
attribute values as `{"stringValue" | "intValue" | "doubleValue" | "boolValue" | "arrayValue": ...}`,
status codes as enum names (`STATUS_CODE_ERROR`) or numbers.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pdserve.telemetry.spans import LoadedSpans, SpanRecord

_STATUS = {0: "UNSET", 1: "OK", 2: "ERROR", "STATUS_CODE_UNSET": "UNSET", "STATUS_CODE_OK": "OK",
           "STATUS_CODE_ERROR": "ERROR"}


def _value(v: dict[str, Any]) -> Any:
    if "stringValue" in v:
        return v["stringValue"]
    if "boolValue" in v:
        return bool(v["boolValue"])
    if "intValue" in v:
        return int(v["intValue"])
    if "doubleValue" in v:
        return float(v["doubleValue"])
    if "arrayValue" in v:
        return [_value(x) for x in (v["arrayValue"] or {}).get("values", [])]
    if "kvlistValue" in v:
        return {kv["key"]: _value(kv.get("value") or {}) for kv in (v["kvlistValue"] or {}).get("values", [])}
    if "bytesValue" in v:
        return v["bytesValue"]
    return None


def _attributes(kvs: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {kv["key"]: _value(kv.get("value") or {}) for kv in kvs or []}


def _hex_id(raw: str | None, length: int) -> str | None:
    """OTLP/JSON ids are hex; some writers use protobuf's JSON mapping (base64) instead: both read."""
    if not raw:
        return None
    if len(raw) == length:
        return raw.lower()
    return base64.b64decode(raw).hex()


def records_of(request: dict[str, Any]) -> Iterator[SpanRecord]:
    """The spans of one `ExportTraceServiceRequest` object."""
    for rs in request.get("resourceSpans") or []:
        service = str(_attributes((rs.get("resource") or {}).get("attributes")).get("service.name", ""))
        for ss in rs.get("scopeSpans") or []:
            for s in ss.get("spans") or []:
                status = s.get("status") or {}
                yield SpanRecord(
                    trace_id=_hex_id(s["traceId"], 32) or "",
                    span_id=_hex_id(s["spanId"], 16) or "",
                    parent_span_id=_hex_id(s.get("parentSpanId"), 16),
                    name=str(s["name"]),
                    service=service,
                    start_unix_ns=int(s["startTimeUnixNano"]),
                    end_unix_ns=int(s["endTimeUnixNano"]),
                    attributes=_attributes(s.get("attributes")),
                    events=[{"name": e.get("name", ""), "unix_ns": int(e.get("timeUnixNano", 0)),
                             "attributes": _attributes(e.get("attributes"))} for e in s.get("events") or []],
                    status_code=_STATUS.get(status.get("code", 0), "UNSET"),
                    status_description=status.get("message") or None,
                    links=[{"trace_id": _hex_id(link.get("traceId"), 32),
                            "span_id": _hex_id(link.get("spanId"), 16),
                            "attributes": _attributes(link.get("attributes"))}
                           for link in s.get("links") or []],
                )


def load_otlp_json(path: Path) -> LoadedSpans:
    """Every span in `path` (a file, or a folder whose *.json / *.jsonl files are read). A missing path
    reads as empty; a line that is not an OTLP/JSON request counts as bad (a torn last line)."""
    path = Path(path)
    files = [path] if path.is_file() else sorted([*path.glob("*.json"), *path.glob("*.jsonl")])
    spans: list[SpanRecord] = []
    bad = 0
    for file in files:
        with file.open(encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    spans.extend(records_of(json.loads(line)))
                except (ValueError, KeyError, TypeError, AttributeError):
                    bad += 1
    return LoadedSpans(spans, len(files), bad)

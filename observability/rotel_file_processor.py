"""A Rotel trace processor that stores what the collector receives: each batch of spans as one line of
OTLP/JSON (`{"resourceSpans": [...]}`, the line format of the OpenTelemetry Collector's `file` exporter)
appended to `$PDS_OTLP_TRACES_FILE`. Rotel (PyPI `rotel`) has no file exporter of its own; its Python
processors see every span it received, so this is its storage, which `pdserve trace --otlp-file` reads
(docs/architecture.md §8).

    rotel-agent start --exporter blackhole --otlp-with-trace-processor observability/rotel_file_processor.py

Rotel runs this inside its own process and aborts if a processor raises: every error is caught and
printed instead, and the batch is passed on unchanged. Only the standard library is used.
"""

import json
import os
import sys
import threading

_LOCK = threading.Lock()
_STATUS = {0: "STATUS_CODE_UNSET", 1: "STATUS_CODE_OK", 2: "STATUS_CODE_ERROR"}


def _any_value(value):
    """An AnyValue's `.value` (a Python scalar, or Rotel's ArrayValue of AnyValues) as OTLP/JSON."""
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}
    if isinstance(value, float):
        return {"doubleValue": value}
    if isinstance(value, str):
        return {"stringValue": value}
    if isinstance(value, bytes):
        return {"bytesValue": value.hex()}
    if value is None:
        return {}
    if type(value).__name__ == "ArrayValue":
        return {"arrayValue": {"values": [_any_value(item.value) for item in value]}}
    return {"stringValue": str(value)}


def _attributes(kvs):
    return [{"key": kv.key, "value": _any_value(kv.value.value if kv.value is not None else None)}
            for kv in kvs]


def _hex(raw):
    return bytes(raw).hex() if raw else ""


def _span(s):
    status = s.status
    return {
        "traceId": _hex(s.trace_id),
        "spanId": _hex(s.span_id),
        "parentSpanId": _hex(s.parent_span_id),
        "name": s.name,
        "kind": s.kind,
        "startTimeUnixNano": str(s.start_time_unix_nano),
        "endTimeUnixNano": str(s.end_time_unix_nano),
        "attributes": _attributes(s.attributes),
        "events": [{"name": e.name, "timeUnixNano": str(e.time_unix_nano),
                    "attributes": _attributes(e.attributes)} for e in s.events],
        "links": [{"traceId": _hex(link.trace_id), "spanId": _hex(link.span_id),
                   "attributes": _attributes(link.attributes)} for link in s.links],
        "status": {"code": _STATUS.get(status.code, "STATUS_CODE_UNSET"), "message": status.message}
        if status is not None else {},
    }


def _resource_spans(rs):
    resource = rs.resource
    scopes = []
    for ss in rs.scope_spans:
        scope = ss.scope
        scopes.append({
            "scope": {"name": scope.name, "version": scope.version} if scope is not None else {},
            "spans": [_span(s) for s in ss.spans],
        })
    return {"resource": {"attributes": _attributes(resource.attributes) if resource is not None else []},
            "scopeSpans": scopes}


def process_spans(resource_spans):
    path = os.environ.get("PDS_OTLP_TRACES_FILE")
    if not path:
        return
    try:
        line = json.dumps({"resourceSpans": [_resource_spans(resource_spans)]}, separators=(",", ":"))
        with _LOCK, open(path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
    except Exception as e:  # never let Rotel see it: it would abort
        print(f"rotel_file_processor: batch not stored: {type(e).__name__}: {e}", file=sys.stderr)

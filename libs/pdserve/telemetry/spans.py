"""Spans as `JsonLinesSpanExporter` wrote them: parse, load a trace folder, select one request's traces.

Every span of a request carries the attribute `pdserve.request_id`; spans that do not (a bus handler span)
still belong to the request through their trace id.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

REQUEST_ID_ATTR = "pdserve.request_id"


@dataclass(frozen=True)
class SpanRecord:
    """One finished span as `JsonLinesSpanExporter` wrote it; times in Unix nanoseconds."""

    trace_id: str
    span_id: str
    parent_span_id: str | None
    name: str
    service: str
    start_unix_ns: int
    end_unix_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    status_code: str = "UNSET"
    status_description: str | None = None
    # Links to other spans ({"trace_id", "span_id", "attributes"}): a retried attempt links the one before.
    links: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> SpanRecord:
        """Parse one exporter line (already `json.loads`-ed). Raises KeyError/TypeError/ValueError on a
        line missing a required field."""
        status = obj.get("status") or {}
        return cls(
            trace_id=str(obj["trace_id"]),
            span_id=str(obj["span_id"]),
            parent_span_id=obj.get("parent_span_id") or None,
            name=str(obj["name"]),
            service=str(obj.get("service", "")),
            start_unix_ns=int(obj["start_unix_ns"]),
            end_unix_ns=int(obj["end_unix_ns"]),
            attributes=dict(obj.get("attributes") or {}),
            events=list(obj.get("events") or []),
            status_code=str(status.get("code", "UNSET")),
            status_description=status.get("description"),
            links=list(obj.get("links") or []),
        )

    @property
    def duration_s(self) -> float:
        return (self.end_unix_ns - self.start_unix_ns) / 1e9

    @property
    def request_id(self) -> str | None:
        value = self.attributes.get(REQUEST_ID_ATTR)
        return None if value is None else str(value)


class LoadedSpans(NamedTuple):
    """Every span under a trace folder, with how many files were read and lines skipped as unreadable
    (a process killed mid-write leaves a torn last line)."""

    spans: list[SpanRecord]
    files: int
    bad_lines: int


def load_spans(trace_dir: Path) -> LoadedSpans:
    """Read every `*.jsonl` in `trace_dir` (one file per process). A missing folder reads as empty."""
    spans: list[SpanRecord] = []
    files = bad = 0
    for path in sorted(Path(trace_dir).glob("*.jsonl")):
        files += 1
        with path.open(encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    spans.append(SpanRecord.from_json(json.loads(line)))
                except (ValueError, KeyError, TypeError):
                    bad += 1
    return LoadedSpans(spans, files, bad)


def spans_of_request(spans: Iterable[SpanRecord], request_id: str) -> list[SpanRecord]:
    """Every span of every trace in which some span has `pdserve.request_id == request_id` (a span
    without the attribute, such as a bus handler span, still belongs through its trace), deduplicated
    by (trace id, span id), ordered by start time. Empty when nothing matches."""
    spans = list(spans)
    traces = {s.trace_id for s in spans if s.request_id == request_id}
    unique = {(s.trace_id, s.span_id): s for s in spans if s.trace_id in traces}
    return sorted(unique.values(), key=lambda s: (s.start_unix_ns, s.name))


def services_seen(spans: Iterable[SpanRecord]) -> list[str]:
    """Distinct service names in order of their first span's start."""
    first: dict[str, int] = {}
    for s in spans:
        first[s.service] = min(first.get(s.service, s.start_unix_ns), s.start_unix_ns)
    return sorted(first, key=lambda svc: (first[svc], svc))


def trace_ids(spans: Iterable[SpanRecord]) -> list[str]:
    """Distinct trace ids in order of their first span's start."""
    first: dict[str, int] = {}
    for s in spans:
        first[s.trace_id] = min(first.get(s.trace_id, s.start_unix_ns), s.start_unix_ns)
    return sorted(first, key=lambda t: (first[t], t))

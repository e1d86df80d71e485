"""A request's way to its prefill, hop by hop, from the spans its services exported.

Each mark is the start of one span of the request's trace (docs/architecture.md §8); a hop is the time from
one mark to the next, so the hops of a request add up to the time from the gateway's HTTP span to the
prefill worker starting its forward. Where the control-plane benchmark's phases come from the event log
(one stamp per phase), these split the same way into the services' own work and the messages between
them — a hop that crosses processes holds the message, the receiver's wake-up and its decoding:

- `http`: the gateway's HTTP server span (`POST /v1/completions`) → `gateway.request`: FastAPI's
  middleware and routing, reading, validating and tokenizing the body;
- `submit`: → `coordinator.handle submit`: the gateway's subscriptions and Submit, the message, the
  coordinator's decoding;
- `claim`: → `coordinator.attempt`: the request's lease claimed and its RequestReceived stored (JetStream
  round trips, the placement beside them), the run started;
- `dispatch`: → `coordinator.prefill`: the placement's bookkeeping (disaggregated: the decode worker's
  reservation round trip too);
- `command`: → `<worker>.handle prefill`: the prefill command's message, the worker's wake-up and decoding;
- `handler`: → `prefill.forward`: the worker's handler up to its wait on the step (a local placement's
  reservation, the PrefillStarted event).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence

from pdserve.telemetry.spans import SpanRecord

# (hop, the span whose start ends it): a name, or ".handle prefill" as the suffix of any worker's span
HOP_MARKS: tuple[tuple[str, str], ...] = (
    ("http", "gateway.request"),
    ("submit", "coordinator.handle submit"),
    ("claim", "coordinator.attempt"),
    ("dispatch", "coordinator.prefill"),
    ("command", ".handle prefill"),
    ("handler", "prefill.forward"),
)
HOPS = tuple(hop for hop, _ in HOP_MARKS)
HTTP_SPAN_PREFIX = "POST "  # the gateway's HTTP server span (FastAPI's telemetry): the first mark


def _first_start(spans: Sequence[SpanRecord], mark: str) -> int | None:
    """The earliest start (Unix ns) of a span named `mark` (or ending with it, for a leading '.')."""
    starts = [s.start_unix_ns for s in spans
              if (s.name.endswith(mark) if mark.startswith(".") else s.name == mark)]
    return min(starts) if starts else None


def request_hops(spans: Iterable[SpanRecord], request_ids: Iterable[str]) -> dict[str, dict[str, float]]:
    """Each request's hops (`HOPS`, seconds), keyed by request id, from every span of its traces (a span
    belongs to a request through any span of its trace carrying `pdserve.request_id`). A request missing
    any mark (its spans not exported yet, a prefill that never started) is left out. Where a mark repeats
    (a redone prefill, a request resumed in a trace of its own) the earliest counts: the first attempt's."""
    wanted = set(request_ids)
    by_trace: dict[str, list[SpanRecord]] = defaultdict(list)
    traces_of: dict[str, set[str]] = defaultdict(set)
    for s in spans:
        by_trace[s.trace_id].append(s)
        if s.request_id in wanted:
            traces_of[s.request_id].add(s.trace_id)
    out: dict[str, dict[str, float]] = {}
    for rid, traces in traces_of.items():
        mine = [s for t in traces for s in by_trace[t]]
        http = [s.start_unix_ns for s in mine if s.name.startswith(HTTP_SPAN_PREFIX)]
        marks = [min(http) if http else None] + [_first_start(mine, mark) for _, mark in HOP_MARKS]
        if any(m is None for m in marks):
            continue
        out[rid] = {hop: (b - a) / 1e9 for hop, a, b in zip(HOPS, marks[:-1], marks[1:], strict=True)}
    return out

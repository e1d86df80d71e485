"""The logic behind `pdserve trace`: arrange one request's spans as a tree on a shared time axis, collapse
per-layer transfer spans, and read the TTFT breakdown. No terminal here; `pdserve.cli.trace` renders.

Span conventions every service follows (attribute and span names below are the contract):
every span of a request carries `pdserve.request_id`; `coordinator.request` carries the TTFT phases
(`pdserve.ttft.*_s`) and `pdserve.ttft_s`; per-layer transfer spans (`transfer.send`,
`transfer.verify_checksum`) carry `pdserve.layer` and `pdserve.bytes` / `pdserve.checksum_ok`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from pdserve.telemetry.spans import SpanRecord

LAYER_ATTR = "pdserve.layer"
KV_BYTES_ATTR = "pdserve.bytes"  # what transfer/chunked.py and transfer/receiver.py set
CHECKSUM_OK_ATTR = "pdserve.checksum_ok"
COORDINATOR_REQUEST_SPAN = "coordinator.request"
TTFT_ATTR = "pdserve.ttft_s"
# (label, attribute) in the order the phases happen (docs/architecture.md §3 steps 2–6).
TTFT_PHASE_ATTRS = (
    ("queue", "pdserve.ttft.queue_s"),
    ("route", "pdserve.ttft.route_s"),
    ("reserve", "pdserve.ttft.reserve_s"),
    ("prefill", "pdserve.ttft.prefill_s"),
    ("exposed transfer", "pdserve.ttft.exposed_transfer_s"),
    ("first token", "pdserve.ttft.first_token_s"),
)
# A model has tens of layers: a row per layer would bury the waterfall. The tiny test model's 2 stay visible.
COLLAPSE_MIN_SPANS = 4


@dataclass
class SpanNode:
    """A span with its children (ordered by start time). `orphan`: its parent span was not found
    (the parent's process died before exporting it, or it went to another backend)."""

    span: SpanRecord
    children: list[SpanNode] = field(default_factory=list)
    orphan: bool = False


def build_tree(spans: Sequence[SpanRecord]) -> list[SpanNode]:
    """Parent → children forest of `spans`; roots (no parent, or parent missing) ordered by start."""
    nodes = {(s.trace_id, s.span_id): SpanNode(s) for s in spans}
    roots: list[SpanNode] = []
    for node in nodes.values():
        s = node.span
        parent = nodes.get((s.trace_id, s.parent_span_id)) if s.parent_span_id else None
        if parent is None:
            node.orphan = s.parent_span_id is not None
            roots.append(node)
        else:
            parent.children.append(node)

    def order(ns: list[SpanNode]) -> None:
        ns.sort(key=lambda n: (n.span.start_unix_ns, n.span.name))
        for n in ns:
            order(n.children)

    order(roots)
    return roots


@dataclass(frozen=True)
class CollapsedGroup:
    """Sibling per-layer spans of one name shown as one row: `count` spans over `layers` distinct
    layers, `kv_bytes` summed, `checksum_failures` spans with checksum_ok false; `checksums_ok` is None
    when no member carries `pdserve.checksum_ok`."""

    name: str
    count: int
    layers: int
    kv_bytes: int
    checksum_failures: int
    checksums_ok: bool | None


@dataclass(frozen=True)
class WaterfallRow:
    """One line of the waterfall. `guide` is the tree drawing before the name ("│  ├─ "); offsets and
    durations are seconds from the waterfall's start. `span` is None on a collapsed row."""

    guide: str
    depth: int
    name: str
    service: str
    offset_s: float
    duration_s: float
    span: SpanRecord | None = None
    group: CollapsedGroup | None = None
    orphan: bool = False

    @property
    def error(self) -> bool:
        return self.span is not None and self.span.status_code == "ERROR"


@dataclass(frozen=True)
class Waterfall:
    """Rows in display order on a shared axis starting at `start_unix_ns` and `total_s` seconds long."""

    rows: list[WaterfallRow]
    start_unix_ns: int
    total_s: float


def _collapse(group: list[SpanNode]) -> CollapsedGroup:
    attrs = [n.span.attributes for n in group]
    oks = [bool(a[CHECKSUM_OK_ATTR]) for a in attrs if CHECKSUM_OK_ATTR in a]
    return CollapsedGroup(
        name=group[0].span.name,
        count=len(group),
        layers=len({a.get(LAYER_ATTR) for a in attrs}),
        kv_bytes=sum(int(a.get(KV_BYTES_ATTR, 0)) for a in attrs),
        checksum_failures=sum(not ok for ok in oks),
        checksums_ok=all(oks) if oks else None,
    )


def _display_items(children: list[SpanNode], collapse_min: int) -> list[SpanNode | list[SpanNode]]:
    """Children in start order, with each name's per-layer spans replaced by one group (at its first
    member's place) when there are at least `collapse_min` of them."""
    groups: dict[str, list[SpanNode]] = {}
    for n in children:
        if LAYER_ATTR in n.span.attributes:
            groups.setdefault(n.span.name, []).append(n)
    items: list[SpanNode | list[SpanNode]] = []
    for n in children:
        group = groups.get(n.span.name) if LAYER_ATTR in n.span.attributes else None
        if group is None or len(group) < collapse_min:
            items.append(n)
        elif group[0] is n:
            items.append(group)
    return items


def layout(roots: Sequence[SpanNode], collapse_min: int = COLLAPSE_MIN_SPANS) -> Waterfall:
    """Flatten the forest into display rows (depth-first, children by start time), collapsing per-layer
    span groups of at least `collapse_min` (their children listed as groups too). Empty forest → no rows."""
    all_spans = [s for r in roots for s in _walk(r)]
    if not all_spans:
        return Waterfall([], 0, 0.0)
    t0 = min(s.start_unix_ns for s in all_spans)
    total_s = (max(s.end_unix_ns for s in all_spans) - t0) / 1e9
    rows: list[WaterfallRow] = []

    def offset(ns: int) -> float:
        return (ns - t0) / 1e9

    def visit(item: SpanNode | list[SpanNode], lead: str, last: bool, depth: int) -> None:
        guide = "" if depth == 0 else lead + ("└─ " if last else "├─ ")
        child_lead = "" if depth == 0 else lead + ("   " if last else "│  ")
        if isinstance(item, list):
            start = min(n.span.start_unix_ns for n in item)
            end = max(n.span.end_unix_ns for n in item)
            rows.append(WaterfallRow(guide, depth, item[0].span.name, item[0].span.service,
                                     offset(start), (end - start) / 1e9, group=_collapse(item)))
            # The group's children (e.g. each layer's transfer.verify_checksum under its transfer.send)
            # are shown as groups of their own, so the verification stays visible at one line.
            children = sorted((c for n in item for c in n.children), key=lambda c: c.span.start_unix_ns)
            items = _display_items(children, 1)
        else:
            s = item.span
            rows.append(WaterfallRow(guide, depth, s.name, s.service, offset(s.start_unix_ns), s.duration_s,
                                     span=s, orphan=item.orphan))
            items = _display_items(item.children, collapse_min)
        for i, child in enumerate(items):
            visit(child, child_lead, i == len(items) - 1, depth + 1)

    for root in roots:
        visit(root, "", True, 0)
    return Waterfall(rows, t0, total_s)


def _walk(node: SpanNode) -> Iterable[SpanRecord]:
    yield node.span
    for c in node.children:
        yield from _walk(c)


def bar_cells(offset_s: float, duration_s: float, total_s: float, width: int) -> tuple[int, int]:
    """(first column, length) of a span's bar in a `width`-column axis covering `total_s` seconds.
    Every span gets at least one cell, and the bar never runs past the axis."""
    if width <= 0:
        return 0, 0
    if total_s <= 0:
        return 0, 1
    start = min(int(offset_s / total_s * width), width - 1)
    length = max(1, round(duration_s / total_s * width))
    return start, min(length, width - start)


class TTFTBreakdown(NamedTuple):
    """Where the time to first token went, seconds, as the coordinator measured it. A phase the span
    does not carry is None (e.g. no transfer in local or colocated mode)."""

    queue_s: float | None
    route_s: float | None
    reserve_s: float | None
    prefill_s: float | None
    exposed_transfer_s: float | None
    first_token_s: float | None
    ttft_s: float | None

    def phases(self) -> list[tuple[str, float | None]]:
        """(label, seconds) in the order the phases happen."""
        return [(label, self[i]) for i, (label, _) in enumerate(TTFT_PHASE_ATTRS)]


def ttft_breakdown(spans: Iterable[SpanRecord]) -> TTFTBreakdown | None:
    """The breakdown from the last-ending `coordinator.request` span that carries `pdserve.ttft_s`
    (a retried or resumed request has several), else the last-ending one; None when there is none."""
    coord = [s for s in spans if s.name == COORDINATOR_REQUEST_SPAN]
    if not coord:
        return None
    with_ttft = [s for s in coord if TTFT_ATTR in s.attributes] or coord
    span = max(with_ttft, key=lambda s: s.end_unix_ns)

    def get(attr: str) -> float | None:
        v = span.attributes.get(attr)
        return None if v is None else float(v)

    return TTFTBreakdown(*(get(attr) for _, attr in TTFT_PHASE_ATTRS), ttft_s=get(TTFT_ATTR))

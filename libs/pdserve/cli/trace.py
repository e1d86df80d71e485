"""`pdserve trace <request_id>`: one request's waterfall in the terminal, then its TTFT breakdown, services
and trace id. Spans come from a collector's storage when one is named (`--otlp-file` or
`$PDS_OTLP_TRACES_FILE`: OTLP/JSON lines, as the OTel Collector's file exporter and
observability/rotel_file_processor.py write them), else from the JSON-lines files every process writes
under `<var_dir>/traces/` (docs/architecture.md §8)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from pdserve.cli.output import make_console
from pdserve.ids import request_id_of
from pdserve.telemetry.otlp_json import load_otlp_json
from pdserve.telemetry.spans import SpanRecord, load_spans, services_seen, spans_of_request, trace_ids
from pdserve.telemetry.waterfall import Waterfall, WaterfallRow, bar_cells, build_tree, layout, ttft_breakdown

_PALETTE = ("cyan", "magenta", "green", "yellow", "blue", "bright_red", "bright_cyan", "bright_magenta")


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "trace", help="Print one request's trace as a waterfall with its TTFT breakdown.")
    p.add_argument("request_id", type=request_id_of,
                   help="The request id (UUIDv7) the gateway assigned, or the response body's id.")
    p.add_argument("--var-dir", type=Path, default=None,
                   help="Folder holding traces/ (default: $PDS_VAR_DIR, else ./var; a var/run/stack.json "
                        "written by `pdserve up` that names another var_dir wins over the default).")
    p.add_argument("--otlp-file", type=Path, default=os.environ.get("PDS_OTLP_TRACES_FILE") or None,
                   help="A collector's OTLP/JSON lines file or folder to read instead of var/traces "
                        "(default: $PDS_OTLP_TRACES_FILE).")
    p.add_argument("--width", type=int, default=48, help="Columns of the time axis (default 48).")
    p.set_defaults(func=run)


def resolve_var_dir(explicit: Path | None) -> Path:
    """`explicit` if given; else $PDS_VAR_DIR or ./var, redirected by `<that>/run/stack.json`'s
    "var_dir" when the file exists and names one (the stack may have been started with another)."""
    if explicit is not None:
        return explicit
    default = Path(os.environ.get("PDS_VAR_DIR") or "var")
    stack_file = default / "run" / "stack.json"
    try:
        named = json.loads(stack_file.read_text()).get("var_dir")
    except (OSError, ValueError, AttributeError):
        named = None
    return Path(named) if named else default


def _short(service: str) -> str:
    return service.removeprefix("pdserve-")


def _ms(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds * 1e3:.1f}"


def _human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _label(row: WaterfallRow) -> Text:
    text = Text(row.guide, style="dim")
    if row.group is not None:
        g = row.group
        text.append(f"{g.name} ×{g.count}", style="bold")
        detail = f" ({g.layers} layers"
        if g.kv_bytes:
            detail += f", {_human_bytes(g.kv_bytes)}"
        if g.checksums_ok is not None:
            detail += ", checksums ok" if g.checksums_ok else f", {g.checksum_failures} checksum failures"
        text.append(detail + ")", style="red" if g.checksums_ok is False else "dim")
        return text
    text.append(row.name, style="bold red" if row.error else "")
    if row.orphan:
        text.append(" (parent span missing)", style="yellow")
    if row.span is not None and row.span.links:
        n = len(row.span.links)
        text.append(f" (linked to {n} earlier span{'s' if n > 1 else ''})", style="dim")
    return text


def _render_waterfall(console: Console, wf: Waterfall, width: int) -> None:
    colors: dict[str, str] = {}
    table = Table(box=None, pad_edge=False, show_edge=False)
    # Only the span names give way when the terminal is narrow: the numbers and the bars are the point.
    table.add_column("span", no_wrap=True, overflow="ellipsis", min_width=24)
    table.add_column("service", no_wrap=True, min_width=11)
    table.add_column("start ms", justify="right", no_wrap=True, min_width=8)
    table.add_column("dur ms", justify="right", no_wrap=True, min_width=7)
    table.add_column(f"0 ─ {wf.total_s * 1e3:.1f} ms", no_wrap=True, min_width=width)
    for row in wf.rows:
        color = colors.setdefault(row.service, _PALETTE[len(colors) % len(_PALETTE)])
        start, length = bar_cells(row.offset_s, row.duration_s, wf.total_s, width)
        bar = Text(" " * start)
        bar.append("█" * length, style="red" if row.error else color)
        table.add_row(_label(row), Text(_short(row.service), style=color), _ms(row.offset_s),
                      _ms(row.duration_s), bar)
    console.print(table)


def _render_ttft(console: Console, spans: list[SpanRecord]) -> None:
    breakdown = ttft_breakdown(spans)
    if breakdown is None:
        console.print("\nTTFT breakdown: no coordinator.request span in this trace.")
        return
    table = Table(title="TTFT breakdown", title_justify="left", box=None, show_edge=False)
    table.add_column("phase")
    table.add_column("ms", justify="right")
    table.add_column("share", justify="right")
    total = breakdown.ttft_s
    for label, seconds in breakdown.phases():
        share = f"{seconds / total:.0%}" if seconds is not None and total else ""
        table.add_row(label, _ms(seconds), share)
    table.add_row(Text("TTFT", style="bold"), Text(_ms(total), style="bold"), "")
    console.print()
    console.print(table)


def run(args: argparse.Namespace, console: Console | None = None) -> int:
    """Print the waterfall of `args.request_id`. Returns 0, or 1 when no span carries that id."""
    console = console or make_console()
    otlp_file = getattr(args, "otlp_file", None)
    trace_dir = Path(otlp_file) if otlp_file else resolve_var_dir(args.var_dir) / "traces"
    loaded = load_otlp_json(trace_dir) if otlp_file else load_spans(trace_dir)
    spans = spans_of_request(loaded.spans, args.request_id)
    if not spans:
        console.print(f"[red]no span with pdserve.request_id = {args.request_id}[/red] in {trace_dir} "
                      f"({len(loaded.spans)} spans in {loaded.files} files). Spans are written ~0.5 s after "
                      "they end; with OTEL_EXPORTER_OTLP_ENDPOINT set they go to the collector instead "
                      "(--otlp-file reads its storage).")
        return 1
    _render_waterfall(console, layout(build_tree(spans)), args.width)
    _render_ttft(console, spans)
    console.print(f"\nservices: {', '.join(_short(s) for s in services_seen(spans))}")
    console.print(f"trace id: {', '.join(trace_ids(spans))}")
    if loaded.bad_lines:
        console.print(f"[yellow]{loaded.bad_lines} unreadable lines skipped in {trace_dir}[/yellow]")
    return 0

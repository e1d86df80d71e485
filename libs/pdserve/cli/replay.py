"""`pdserve replay`: rebuild the `requests` projection from the events table (docs/architecture.md §7), or,
with
`--request ID`, print that request's lifecycle in stream order with its projection row.

The database is `--database-url`, else `$PDS_DATABASE_URL`, else the one a running `pdserve up` stack
recorded in `<var_dir>/run/stack.json`, else `CommonSettings`' default.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from rich.table import Table
from sqlalchemy.exc import DBAPIError

from pdserve.cli import routing_replay
from pdserve.cli.output import make_console
from pdserve.config import CommonSettings
from pdserve.events import SCHEMA_VERSION
from pdserve.ids import request_id_of
from pdserve.stack_state import read_state
from pdserve.store.queries import make_db, rebuild_projections, request_snapshot, state_counts
from pdserve.store.rows import RecordedEvent

console = make_console()

# The payload fields worth a column's glance, per event type (every type of pdserve.events.PAYLOAD_TYPES,
# tests/unit/test_replay_details.py checks); unknown types show their scalar fields.
KEY_FIELDS: dict[str, tuple[str, ...]] = {
    "RequestReceived": ("model", "num_prompt_tokens", "max_tokens", "stream"),
    "RequestRouted": ("mode", "prefill_worker_id", "decode_worker_id", "predicted_cached_tokens",
                      "best_cached_tokens", "route_s"),
    "DecodeReserved": ("decode_worker_id", "num_tokens", "reserve_s"),
    "AdmissionDeferred": ("decode_worker_id", "reason"),
    "PrefillStarted": ("prefill_worker_id", "num_prompt_tokens"),
    "PrefillCompleted": ("num_cached_tokens", "num_computed_tokens", "kv_bytes", "prefill_s"),
    "TransferCompleted": ("transport", "kv_bytes", "num_layers", "transfer_s", "checksum_ok"),
    "ChecksumMismatch": ("layer", "expected", "actual"),
    "DecodeStarted": ("decode_worker_id", "num_running"),
    "TokensCommitted": ("start_index",),
    "RequestMigrated": ("from_worker_id", "phase", "reason", "num_committed_tokens", "attempt"),
    "RequestRecovered": ("state", "num_committed_tokens", "action"),
    "RequestTakenOver": ("from_coordinator_id", "reason"),
    "RequestCompleted": ("finish_reason", "prompt_tokens", "completion_tokens", "e2e_s"),
    "RequestFailed": ("phase", "reason"),
    "RequestAborted": ("reason",),
}
_AGE = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_AGE_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_TERMINAL_STYLE = {"RequestCompleted": "green", "RequestFailed": "bold red", "RequestAborted": "yellow",
                   "RequestMigrated": "magenta", "RequestRecovered": "magenta", "RequestTakenOver": "magenta",
                   "ChecksumMismatch": "red", "AdmissionDeferred": "yellow"}


def parse_since(text: str) -> datetime:
    """An ISO 8601 time (UTC when it has no offset) or an age before now: `90s`, `15m`, `2h`, `1d`.
    Raises argparse.ArgumentTypeError otherwise."""
    if m := _AGE.match(text.strip()):
        return datetime.now(UTC) - timedelta(seconds=float(m[1]) * _AGE_UNIT_S[m[2]])
    try:
        ts = datetime.fromisoformat(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: not an ISO 8601 time nor an age like 15m") from e
    return ts if ts.tzinfo is not None else ts.replace(tzinfo=UTC)


def resolve_database_url(explicit: str | None, var_dir: Path | None) -> str:
    """`explicit`, else $PDS_DATABASE_URL, else the running stack's (var/run/stack.json), else the default."""
    if explicit:
        return explicit
    if url := os.environ.get("PDS_DATABASE_URL"):
        return url
    state = read_state(var_dir or Path(os.environ.get("PDS_VAR_DIR") or "var"))
    if state is not None and state.database_url:
        return state.database_url
    return CommonSettings().database_url


def _value(key: str, v: Any) -> str:
    if isinstance(v, float) and key.endswith("_s"):
        return f"{v * 1e3:.1f}ms"
    if isinstance(v, int) and not isinstance(v, bool) and key.endswith("bytes"):
        return f"{v / 2**20:.2f}MiB" if v >= 2**20 else f"{v}B"
    return str(v)


def details(record: RecordedEvent) -> str:
    """The key payload fields of one event as `name=value` pairs (durations in ms, sizes in MiB)."""
    e = record.event
    p = e.payload
    keys = KEY_FIELDS.get(e.type) or tuple(k for k, v in p.items() if isinstance(v, str | int | float | bool))
    parts = [f"{k.removesuffix('_s').removesuffix('_id')}={_value(k, p[k])}" for k in keys if k in p]
    if e.type == "TokensCommitted":
        parts.append(f"tokens={len(p.get('token_ids', []))}")
    if e.type == "RequestCompleted" and isinstance(p.get("ttft"), dict):
        parts.insert(1, f"ttft={_value('ttft_s', p['ttft'].get('ttft_s'))}")
    if e.schema_version > SCHEMA_VERSION:
        parts.insert(0, f"(schema v{e.schema_version})")
    elif e.type not in KEY_FIELDS:
        parts.insert(0, "(unknown type)")
    return "  ".join(parts)[:160]


def lifecycle_table(request_id: str, records: list[RecordedEvent]) -> Table:
    """One row per event: stream sequence, UTC time, ms since the first event, type, service, worker,
    details."""
    table = Table(title=f"request {request_id}", title_justify="left", header_style="bold")
    for name, just in (("seq", "right"), ("ts (UTC)", "left"), ("+ms", "right"), ("type", "left"),
                       ("service", "left"), ("worker", "left"), ("details", "left")):
        table.add_column(name, justify=just, no_wrap=name != "details")
    t0 = records[0].event.ts
    for r in records:
        e = r.event
        when = datetime.fromtimestamp(e.ts, UTC).strftime("%H:%M:%S.%f")[:-3]
        table.add_row(str(r.stream_seq), when, f"{(e.ts - t0) * 1e3:.1f}", e.type, e.service,
                      e.worker_id or "", details(r), style=_TERMINAL_STYLE.get(e.type))
    return table


def _ms(v: float | None) -> str:
    return "—" if v is None else f"{v * 1e3:.1f}"


def projection_summary(row: dict[str, Any]) -> str:
    """The request's projection row in two lines: outcome and tokens, then the TTFT breakdown (ms)."""
    outcome = row["state"]
    if row["finish_reason"]:
        outcome += f" ({row['finish_reason']})"
    if row["failure_phase"] or row["failure_reason"]:
        outcome += f" in {row['failure_phase'] or '?'}: {row['failure_reason'] or ''}"
    first = (f"state {outcome} · mode {row['mode'] or '—'} · prompt {row['prompt_tokens']} · "
             f"completion {row['completion_tokens']} · cached {row['cached_tokens']} · "
             f"e2e {_ms(row['e2e_s'])} ms")
    second = (f"TTFT {_ms(row['ttft_s'])} ms = queue {_ms(row['queue_s'])} + route {_ms(row['route_s'])} + "
              f"reserve {_ms(row['reserve_s'])} + prefill {_ms(row['prefill_s'])} + exposed transfer "
              f"{_ms(row['exposed_transfer_s'])} + first token {_ms(row['first_token_s'])}")
    return f"{first}\n{second}"


async def _show_request(url: str, request_id: str, since: datetime | None) -> int:
    db = make_db(url)
    try:
        row, records = await request_snapshot(db, request_id, since)
    finally:
        await db.dispose()
    if not records:
        console.print(f"no events recorded for request {request_id}" + (" since then" if since else ""))
        return 1
    console.print(lifecycle_table(request_id, records))
    if row is not None:
        console.print(projection_summary(row))
    return 0


async def _rebuild(url: str, since: datetime | None) -> int:
    db = make_db(url)
    try:
        start = time.perf_counter()
        n = await rebuild_projections(db, since)
        elapsed = time.perf_counter() - start
        counts = await state_counts(db)
    finally:
        await db.dispose()
    scope = f"with events since {since.isoformat()}" if since else "in total"
    console.print(f"rebuilt {n} request rows ({scope}) from the events table in {elapsed:.2f} s")
    table = Table("state", "requests", header_style="bold")
    for state, count in counts.items():
        table.add_row(state, str(count))
    console.print(table)
    return 0


def run(args: argparse.Namespace) -> int:
    """Exit status: 0 done, 1 no events for `--request`, 2 the database could not be read."""
    url = resolve_database_url(args.database_url, args.var_dir)
    try:
        if args.routing:
            return routing_replay.run(args, url)
        if args.request:
            return asyncio.run(_show_request(url, args.request, args.since))
        return asyncio.run(_rebuild(url, args.since))
    except (DBAPIError, OSError) as e:
        console.print(f"[red]cannot read the event store at {url}: {type(e).__name__}: {e}[/red]")
        return 2


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    """Register `replay` on the `pdserve` command line."""
    p = subparsers.add_parser(
        "replay",
        help="Rebuild the requests projection from the event log, or print one request's lifecycle.")
    p.add_argument("--request", metavar="ID", type=request_id_of,
                   help="Print this request's events in stream order instead (the request id, or the "
                   "response body's id).")
    p.add_argument("--since", type=parse_since, default=None,
                   help="Only requests (or, with --request, events) at or after this time: ISO 8601 "
                        "(UTC without an offset) or an age such as 15m, 2h, 1d.")
    p.add_argument("--database-url", default=None,
                   help="SQLAlchemy asyncpg URL (default: $PDS_DATABASE_URL, else the running stack's "
                        "var/run/stack.json, else postgresql+asyncpg://postgres@127.0.0.1:5432/pdserve).")
    p.add_argument("--var-dir", type=Path, default=None,
                   help="Where to look for run/stack.json (default: $PDS_VAR_DIR, else ./var).")
    routing_replay.add_arguments(p)
    p.set_defaults(func=run)

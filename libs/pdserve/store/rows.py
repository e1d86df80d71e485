"""Between `Event` and the `events` table, and the one way `requests` rows are written.

Shared by the recorder (live) and replay (`queries.rebuild_projections`), so both write identically.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import asyncpg
import sqlalchemy as sa
from pydantic_core import to_json
from sqlalchemy.dialects import postgresql
from sqlalchemy.ext.asyncio import AsyncConnection

from pdserve.events import Event
from pdserve.store.projection import Row, fold, to_datetime
from pdserve.store.tables import REQUEST_COLUMNS, events, requests

# Replay folds and writes this many request rows per statement (its memory stays bounded).
ROWS_PER_STATEMENT = 1000


class RecordedEvent(NamedTuple):
    """One stored event and its position in the JetStream stream (the lifecycle order)."""

    stream_seq: int
    event: Event


EVENT_COLUMNS = [c.name for c in events.columns]
EVENTS_OF_REQUEST = "SELECT * FROM events WHERE request_id = $1::uuid ORDER BY stream_seq"
_STAGING = "events_staging"
_COLS = ", ".join(REQUEST_COLUMNS)
# The one way `requests` rows are written (recorder and replay), as plain SQL on the driver connection:
# one statement per batch whatever its number of rows, each column an array (`unnest`), instead of an
# executemany of one row per execution (Postgres started and ran the plan once per row).
_PG_TYPES = {c.name: c.type.compile(dialect=postgresql.dialect()) for c in requests.columns}
_UPSERT_REQUESTS = (
    f"INSERT INTO requests ({_COLS}) SELECT * FROM unnest("
    + ", ".join(f"${i}::{_PG_TYPES[c]}[]" for i, c in enumerate(REQUEST_COLUMNS, 1))
    + ") ON CONFLICT (request_id) DO UPDATE SET "
    + ", ".join(f"{c} = EXCLUDED.{c}" for c in REQUEST_COLUMNS if c != "request_id")
)
_LOCK_REQUESTS = f"SELECT {_COLS} FROM requests WHERE request_id = ANY($1::uuid[]) FOR UPDATE"


async def driver(conn: AsyncConnection) -> asyncpg.Connection:
    """The asyncpg connection under `conn`, with the caller's transaction open on it (SQLAlchemy's asyncpg
    dialect begins lazily, at the first statement through `conn`): raw statements on it commit or roll
    back with the transaction."""
    pg = (await conn.get_raw_connection()).driver_connection
    if not pg.is_in_transaction():
        await conn.execute(sa.text("SELECT 1"))
    return pg


def event_row(event: Event, stream_seq: int) -> dict[str, Any]:
    """The `events` row of `event` stored at `stream_seq` (ts as an aware UTC datetime)."""
    return {
        "event_id": event.event_id, "stream_seq": stream_seq, "request_id": event.request_id,
        "type": event.type, "schema_version": event.schema_version, "ts": to_datetime(event.ts),
        "service": event.service, "worker_id": event.worker_id, "trace_id": event.trace_id,
        "span_id": event.span_id, "payload": event.payload,
    }


def row_event(row: Mapping[str, Any]) -> RecordedEvent:
    """An `events` row back to its event (ts as UNIX seconds) with its stream sequence."""
    event = Event(
        event_id=str(row["event_id"]), request_id=str(row["request_id"]), type=row["type"],
        schema_version=row["schema_version"], ts=row["ts"].timestamp(), service=row["service"],
        worker_id=row["worker_id"], trace_id=row["trace_id"], span_id=row["span_id"],
        payload=row["payload"],
    )
    return RecordedEvent(row["stream_seq"], event)


def request_dict(row: Mapping[str, Any]) -> Row:
    """A `requests` row as the dict the projection folds (request_id as its string)."""
    out = {c: row[c] for c in REQUEST_COLUMNS}
    out["request_id"] = str(out["request_id"])
    return out


async def upsert_requests(pg: asyncpg.Connection, rows: Sequence[Row]) -> None:
    """Insert or overwrite whole `requests` rows (every column; at most one row per request_id), inside
    the transaction open on the driver connection `pg` (`driver`)."""
    if rows:
        await pg.execute(_UPSERT_REQUESTS, *([r[c] for r in rows] for c in REQUEST_COLUMNS))


async def lock_requests(pg: asyncpg.Connection, request_ids: Sequence[str]) -> dict[str, Row]:
    """The `requests` rows of `request_ids` that exist, locked (FOR UPDATE) in the transaction open on the
    driver connection `pg`, by request_id."""
    return {str(r["request_id"]): request_dict(r) for r in await pg.fetch(_LOCK_REQUESTS, list(request_ids))}


def event_record(stream_seq: int, event: Event) -> tuple[Any, ...]:
    """`event_row` as a COPY record, in `EVENT_COLUMNS` order, the payload as JSON text (pydantic-core's
    serializer: ~4× `json.dumps` on these payloads, and this runs once per event)."""
    return (event.event_id, stream_seq, event.request_id, event.type, event.schema_version,
            to_datetime(event.ts), event.service, event.worker_id, event.trace_id, event.span_id,
            to_json(event.payload).decode())


async def insert_events(pg: asyncpg.Connection, records: Sequence[tuple[Any, ...]]) -> set[int]:
    """Insert `event_record`s (distinct event ids) into `events` in the transaction open on the driver
    connection `pg`: one COPY straight into `events` (COPY is ~5× an executemany here,
    docs/architecture.md §10).
    Returns the stream sequences inserted (all of them). Raises `asyncpg.UniqueViolationError` (constraint
    `events_pkey`; the transaction is then aborted) if an event_id is already stored (a JetStream
    redelivery, or a republish outside the dedup window): redo the transaction with `insert_new_events`."""
    if records:
        await pg.copy_records_to_table("events", columns=EVENT_COLUMNS, records=records)
    return {r[1] for r in records}


async def insert_new_events(pg: asyncpg.Connection, records: Sequence[tuple[Any, ...]]) -> set[int]:
    """`insert_events` skipping the events already stored: through a staging table and one INSERT …
    SELECT … ON CONFLICT DO NOTHING (twice Postgres's work, hence not the first try). Returns the stream
    sequences actually inserted."""
    if not records:
        return set()
    # The staged rows commit (and are cleared, ON COMMIT DELETE ROWS) with the insert.
    await pg.execute(f"CREATE TEMP TABLE IF NOT EXISTS {_STAGING} (LIKE events) ON COMMIT DELETE ROWS")
    await pg.copy_records_to_table(_STAGING, columns=EVENT_COLUMNS, records=records)
    cols = ", ".join(EVENT_COLUMNS)
    inserted = await pg.fetch(f"INSERT INTO events ({cols}) SELECT {cols} FROM {_STAGING} "
                              "ON CONFLICT (event_id) DO NOTHING RETURNING stream_seq")
    return {r["stream_seq"] for r in inserted}


async def project(pg: asyncpg.Connection, new: Sequence[tuple[int, Event]]) -> None:
    """Fold newly inserted `(stream_seq, event)` pairs, in stream order, into their requests' rows, in the
    transaction open on the driver connection `pg` (rows locked, folded, upserted in one statement)."""
    by_request: dict[str, list[tuple[int, Event]]] = defaultdict(list)
    for seq, event in new:
        by_request[event.request_id].append((seq, event))
    if not by_request:
        return
    current = await lock_requests(pg, list(by_request))
    rows: list[Row] = []
    for request_id, evs in by_request.items():
        row = current.get(request_id)
        if row is not None and evs[0][0] < row["last_stream_seq"]:
            # An older event landed after newer ones were folded (redelivery across a restart): fold the
            # request again from its whole history, which now holds it.
            row = fold(row_event(r) for r in await pg.fetch(EVENTS_OF_REQUEST, request_id))
        else:
            row = fold(evs, row)
        assert row is not None
        rows.append(row)
    await upsert_requests(pg, rows)

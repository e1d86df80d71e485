"""Between `Event` and the `events` table, and the one way `requests` rows are written.

Shared by the recorder (live) and replay (`queries.rebuild_projections`), so both write identically.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import asyncpg
import sqlalchemy as sa
from pydantic_core import to_json
from sqlalchemy.ext.asyncio import AsyncConnection

from pdserve.events import Event
from pdserve.store.projection import Row, to_datetime
from pdserve.store.tables import REQUEST_COLUMNS, events

# asyncpg allows 32,767 bind parameters per statement; 26 columns × 1,000 rows stays under it.
ROWS_PER_STATEMENT = 1000


class RecordedEvent(NamedTuple):
    """One stored event and its position in the JetStream stream (the lifecycle order)."""

    stream_seq: int
    event: Event


EVENT_COLUMNS = [c.name for c in events.columns]
_STAGING = "events_staging"
_SAVEPOINT = "copy_events"
_COLS = ", ".join(REQUEST_COLUMNS)
# The one way `requests` rows are written (recorder and replay), as plain SQL on the driver connection:
# asyncpg's executemany of one prepared statement, no SQLAlchemy statement building per batch (at ~10
# transactions/s it took the recorder's CPU per event from ~545 to ~500 µs on this machine).
_PARAMS = ", ".join(f"${i}" for i in range(1, len(REQUEST_COLUMNS) + 1))
_UPSERT_REQUESTS = (
    f"INSERT INTO requests ({_COLS}) VALUES ({_PARAMS}) ON CONFLICT (request_id) DO UPDATE SET "
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


async def upsert_requests(conn: AsyncConnection, rows: Sequence[Row]) -> None:
    """Insert or overwrite whole `requests` rows (every column), inside the caller's transaction."""
    if rows:
        pg = await driver(conn)
        await pg.executemany(_UPSERT_REQUESTS, [tuple(r[c] for c in REQUEST_COLUMNS) for r in rows])


async def lock_requests(conn: AsyncConnection, request_ids: Sequence[str]) -> dict[str, Row]:
    """The `requests` rows of `request_ids` that exist, locked (FOR UPDATE) in the caller's transaction,
    by request_id."""
    pg = await driver(conn)
    return {str(r["request_id"]): request_dict(r) for r in await pg.fetch(_LOCK_REQUESTS, list(request_ids))}


def event_record(stream_seq: int, event: Event) -> tuple[Any, ...]:
    """`event_row` as a COPY record, in `EVENT_COLUMNS` order, the payload as JSON text (pydantic-core's
    serializer: ~4× `json.dumps` on these payloads, and this runs once per event)."""
    return (event.event_id, stream_seq, event.request_id, event.type, event.schema_version,
            to_datetime(event.ts), event.service, event.worker_id, event.trace_id, event.span_id,
            to_json(event.payload).decode())


async def insert_events(conn: AsyncConnection, batch: Sequence[tuple[int, Event]]) -> set[str]:
    """Insert `(stream_seq, event)` pairs (distinct event ids) into `events`, skipping any whose event_id
    is already stored (a JetStream redelivery, or a republish outside the dedup window). Returns the event
    ids actually inserted. Runs inside the caller's transaction."""
    if not batch:
        return set()
    records = [event_record(seq, e) for seq, e in batch]
    # Usually no event of a batch is stored yet: one COPY straight into `events` (COPY is ~5× an
    # executemany here, DESIGN §9). A redelivered batch fails it on the primary key; then the batch goes
    # again through a staging table and one INSERT … SELECT … ON CONFLICT DO NOTHING, which skips the
    # stored ones (twice the work for Postgres, hence not the default path).
    await conn.execute(sa.text(f"SAVEPOINT {_SAVEPOINT}"))  # (opens the transaction if not yet open)
    pg = await driver(conn)
    try:
        await pg.copy_records_to_table("events", columns=EVENT_COLUMNS, records=records)
        return {e.event_id for _, e in batch}
    except asyncpg.UniqueViolationError:
        await pg.execute(f"ROLLBACK TO SAVEPOINT {_SAVEPOINT}")
    # The staged rows commit (and are cleared, ON COMMIT DELETE ROWS) with the insert.
    await pg.execute(f"CREATE TEMP TABLE IF NOT EXISTS {_STAGING} (LIKE events) ON COMMIT DELETE ROWS")
    await pg.copy_records_to_table(_STAGING, columns=EVENT_COLUMNS, records=records)
    cols = ", ".join(EVENT_COLUMNS)
    inserted = await pg.fetch(f"INSERT INTO events ({cols}) SELECT {cols} FROM {_STAGING} "
                              "ON CONFLICT (event_id) DO NOTHING RETURNING stream_seq")
    seqs = {r["stream_seq"] for r in inserted}
    return {e.event_id for seq, e in batch if seq in seqs}

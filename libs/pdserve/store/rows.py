"""Between `Event` and the `events` table, and the one way `requests` rows are written.

Shared by the recorder (live) and replay (`queries.rebuild_projections`), so both write identically.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import asyncpg
import sqlalchemy as sa
from pydantic_core import to_json
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncConnection

from pdserve.events import Event
from pdserve.store.projection import Row, to_datetime
from pdserve.store.tables import REQUEST_COLUMNS, events, requests

# asyncpg allows 32,767 bind parameters per statement; 26 columns × 1,000 rows stays under it.
ROWS_PER_STATEMENT = 1000


class RecordedEvent(NamedTuple):
    """One stored event and its position in the JetStream stream (the lifecycle order)."""

    stream_seq: int
    event: Event


EVENT_COLUMNS = [c.name for c in events.columns]
_STAGING = "events_staging"
_SAVEPOINT = "copy_events"
_upsert = insert(requests)
_UPSERT_REQUESTS = _upsert.on_conflict_do_update(
    index_elements=[requests.c.request_id],
    set_={c: _upsert.excluded[c] for c in REQUEST_COLUMNS if c != "request_id"},
)


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
    if not rows:
        return
    # One cached statement run as executemany (SQLAlchemy batches it into multi-row VALUES itself):
    # `.values(list)` instead compiles a fresh statement per batch, which was most of the recorder's time.
    await conn.execute(_UPSERT_REQUESTS, list(rows))


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
    # The SQLAlchemy statement first opens the caller's transaction on this connection (asyncpg's BEGIN is
    # lazy). Usually no event of a batch is stored yet: one COPY straight into `events` (COPY is ~5× an
    # executemany here, DESIGN §9). A redelivered batch fails it on the primary key; then the batch goes
    # again through a staging table and one INSERT … SELECT … ON CONFLICT DO NOTHING, which skips the
    # stored ones (twice the work for Postgres, hence not the default path).
    await conn.execute(sa.text(f"SAVEPOINT {_SAVEPOINT}"))
    pg = (await conn.get_raw_connection()).driver_connection
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

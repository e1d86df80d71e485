"""Between `Event` and the `events` table, and the one way `requests` rows are written.

Shared by the recorder (live) and replay (`queries.rebuild_projections`), so both write identically.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import sqlalchemy as sa
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


async def insert_events(conn: AsyncConnection, rows: Sequence[dict[str, Any]]) -> set[str]:
    """Insert `events` rows, skipping any whose event_id is already stored (a JetStream redelivery, or
    a republish outside the dedup window). Returns the event ids actually inserted."""
    if not rows:
        return set()
    # COPY into a per-connection staging table, then one INSERT … SELECT … ON CONFLICT: COPY is ~5× an
    # executemany here (DESIGN §9), and the conflict clause keeps redeliveries idempotent. The SQLAlchemy
    # statement first opens the caller's transaction on this connection (asyncpg's BEGIN is lazy), so the
    # staged rows and the insert commit (and are cleared, ON COMMIT DELETE ROWS) together.
    await conn.execute(sa.text(f"CREATE TEMP TABLE IF NOT EXISTS {_STAGING} (LIKE events) "
                               "ON COMMIT DELETE ROWS"))
    pg = (await conn.get_raw_connection()).driver_connection
    await pg.copy_records_to_table(_STAGING, columns=EVENT_COLUMNS, records=[
        tuple(json.dumps(r[c]) if c == "payload" else r[c] for c in EVENT_COLUMNS) for r in rows])
    cols = ", ".join(EVENT_COLUMNS)
    inserted = await pg.fetch(f"INSERT INTO events ({cols}) SELECT {cols} FROM {_STAGING} "
                              "ON CONFLICT (event_id) DO NOTHING RETURNING event_id")
    return {str(r["event_id"]) for r in inserted}

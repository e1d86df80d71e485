"""Between `Event` and the `events` table, and the one way `requests` rows are written.

Shared by the recorder (live) and replay (`queries.rebuild_projections`), so both write identically.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

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
    for i in range(0, len(rows), ROWS_PER_STATEMENT):
        chunk = rows[i:i + ROWS_PER_STATEMENT]
        stmt = insert(requests).values(list(chunk))
        stmt = stmt.on_conflict_do_update(
            index_elements=[requests.c.request_id],
            set_={c: stmt.excluded[c] for c in REQUEST_COLUMNS if c != "request_id"},
        )
        await conn.execute(stmt)


async def insert_events(conn: AsyncConnection, rows: Sequence[dict[str, Any]]) -> set[str]:
    """Insert `events` rows, skipping any whose event_id is already stored (a JetStream redelivery, or
    a republish outside the dedup window). Returns the event ids actually inserted."""
    inserted: set[str] = set()
    for i in range(0, len(rows), ROWS_PER_STATEMENT):
        chunk = rows[i:i + ROWS_PER_STATEMENT]
        stmt = (insert(events).values(list(chunk)).on_conflict_do_nothing(index_elements=[events.c.event_id])
                .returning(events.c.event_id))
        inserted.update(str(r) for r in (await conn.execute(stmt)).scalars())
    return inserted

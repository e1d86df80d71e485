"""Reads of the event store, and replay (rebuilding the `requests` projection from the `events` table).

Used by the gateway (`GET /v1/requests/{id}`), the coordinator at start (resume) and `pdserve replay`.
Every function takes the `db` (an `AsyncEngine`) from `make_db`; database errors propagate as
`sqlalchemy.exc.DBAPIError` (or `OSError` when the server cannot be reached).
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from pdserve.events import Event
from pdserve.states import TERMINAL_STATES
from pdserve.store.projection import Row, apply
from pdserve.store.rows import (
    ROWS_PER_STATEMENT,
    RecordedEvent,
    driver,
    request_dict,
    row_event,
    upsert_requests,
)
from pdserve.store.tables import REQUEST_STATES, events, requests


def make_db(url: str, **kwargs) -> AsyncEngine:
    """The event store's handle for a SQLAlchemy asyncpg URL (`postgresql+asyncpg://user@host:port/db`):
    a SQLAlchemy `AsyncEngine`, called `db` wherever it is held (`engine` means the model's). Connections
    are checked before use, so a Postgres restart costs one failed statement, not a dead pool.
    Call `await db.dispose()` when done."""
    return create_async_engine(url, pool_pre_ping=True, **kwargs)


def _uuid(request_id: str) -> str | None:
    try:
        return str(uuid.UUID(request_id))
    except (ValueError, AttributeError, TypeError):
        return None


def _aware(ts: datetime) -> datetime:
    return ts if ts.tzinfo is not None else ts.replace(tzinfo=UTC)


async def lifecycle_records(db: AsyncEngine, request_id: str,
                            since: datetime | None = None) -> list[RecordedEvent]:
    """Every stored event of `request_id` with its stream sequence, in stream order; only those with
    `ts >= since` when given (a naive `since` is UTC). [] for an unknown or malformed id."""
    rid = _uuid(request_id)
    if rid is None:
        return []
    async with db.connect() as conn:
        return await _records(conn, rid, since)


async def lifecycle(db: AsyncEngine, request_id: str) -> list[Event]:
    """Every stored event of `request_id`, in stream order (the order the services' steps happened in).
    [] for an unknown or malformed id."""
    return [r.event for r in await lifecycle_records(db, request_id)]


async def request_row(db: AsyncEngine, request_id: str) -> Row | None:
    """The `requests` projection row of `request_id` as a dict of every column (request_id a string,
    timestamps aware datetimes, durations in seconds, sizes in bytes), or None if unknown/malformed."""
    rid = _uuid(request_id)
    if rid is None:
        return None
    async with db.connect() as conn:
        return await _row(conn, rid)


async def request_snapshot(db: AsyncEngine, request_id: str,
                           since: datetime | None = None) -> tuple[Row | None, list[RecordedEvent]]:
    """`request_row` and `lifecycle_records` of `request_id` read in one snapshot (REPEATABLE READ): the
    recorder commits a batch's events and their projection together, so read apart a batch committed in
    between gave a complete lifecycle beside no row, or a row ahead of its events."""
    rid = _uuid(request_id)
    if rid is None:
        return None, []
    async with db.connect() as conn:
        conn = await conn.execution_options(isolation_level="REPEATABLE READ")
        async with conn.begin():
            return await _row(conn, rid), await _records(conn, rid, since)


async def _row(conn: AsyncConnection, rid: str) -> Row | None:
    row = (await conn.execute(sa.select(requests).where(requests.c.request_id == rid))).mappings().first()
    return request_dict(row) if row is not None else None


async def _records(conn: AsyncConnection, rid: str, since: datetime | None) -> list[RecordedEvent]:
    q = sa.select(events).where(events.c.request_id == rid).order_by(events.c.stream_seq)
    rows = (await conn.execute(q)).mappings().all()
    # seq is the rank in the whole history, so it is computed before `since` filters.
    out = [RecordedEvent(r.stream_seq, r.event.model_copy(update={"seq": i}))
           for i, r in enumerate(map(row_event, rows), start=1)]
    if since is not None:
        out = [r for r in out if r.event.ts >= _aware(since).timestamp()]
    return out


async def unfinished_requests(db: AsyncEngine) -> list[Row]:
    """Projection rows of every request not yet completed, failed or aborted, oldest first (what the
    coordinator resumes at start, once `recorder.caught_up` says Postgres holds every event)."""
    q = (sa.select(requests).where(requests.c.state.not_in(sorted(map(str, TERMINAL_STATES))))
         .order_by(requests.c.received_at.nulls_first(), requests.c.request_id))
    async with db.connect() as conn:
        return [request_dict(r) for r in (await conn.execute(q)).mappings()]


async def events_of_requests(db: AsyncEngine, request_ids: list[str],
                             types: tuple[str, ...] = ()) -> list[RecordedEvent]:
    """Stored events of `request_ids` (only `types` when given), ordered by stream sequence. Used by
    coordinator recovery and resumable streams; malformed ids are skipped."""
    rids = [r for r in map(_uuid, request_ids) if r is not None]
    if not rids:
        return []
    q = sa.select(events).where(events.c.request_id.in_(rids)).order_by(events.c.stream_seq)
    if types:
        q = q.where(events.c.type.in_(types))
    async with db.connect() as conn:
        return [row_event(r) for r in (await conn.execute(q)).mappings()]


async def state_counts(db: AsyncEngine) -> dict[str, int]:
    """Number of `requests` rows per state, states in lifecycle order, absent states left out."""
    async with db.connect() as conn:
        q = sa.select(requests.c.state, sa.func.count()).group_by(requests.c.state)
        found = dict((await conn.execute(q)).all())
    return {s: found[s] for s in REQUEST_STATES if s in found}


async def _refold(conn: AsyncConnection, q: sa.Select) -> int:
    """Fold the events `q` selects, ordered by (request_id, stream_seq), and upsert one row per request."""
    written = 0
    pending: list[Row] = []
    row: Row | None = None
    result = await conn.stream(q.execution_options(yield_per=ROWS_PER_STATEMENT))
    async for r in result.mappings():
        seq, event = row_event(r)
        if row is not None and row["request_id"] != event.request_id:
            pending.append(row)
            row = None
        row = apply(row, event, seq)
        if len(pending) >= ROWS_PER_STATEMENT:
            await upsert_requests(await driver(conn), pending)
            written += len(pending)
            pending = []
    if row is not None:
        pending.append(row)
    await upsert_requests(await driver(conn), pending)
    return written + len(pending)


async def rebuild_projections(db: AsyncEngine, since: datetime | None = None) -> int:
    """Replay: recompute `requests` from the `events` table in stream order, in one transaction, and
    return the number of request rows written. With `since` (naive = UTC), only requests having an event
    at or after it are recomputed (each from its whole history); without, every row is. Deterministic:
    running it twice yields identical rows. The live recorder waits on the table lock meanwhile, then
    folds its next batch onto the rebuilt rows."""
    order = (events.c.request_id, events.c.stream_seq)
    async with db.begin() as conn:
        # EXCLUSIVE blocks the recorder's projection writes but not readers (unlike TRUNCATE).
        await conn.execute(sa.text("LOCK TABLE requests IN EXCLUSIVE MODE"))
        if since is None:
            await conn.execute(sa.delete(requests))
            return await _refold(conn, sa.select(events).order_by(*order))
        touched = (sa.select(events.c.request_id).where(events.c.ts >= _aware(since)).distinct()
                   .scalar_subquery())
        await conn.execute(sa.delete(requests).where(requests.c.request_id.in_(touched)))
        return await _refold(conn, sa.select(events).where(events.c.request_id.in_(touched)).order_by(*order))

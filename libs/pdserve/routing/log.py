"""Reading the routing facts of a time window out of the event store (the `events` table)."""

from __future__ import annotations

from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from pdserve.routing.report import RoutedRequest, fold_routed
from pdserve.store.rows import row_event
from pdserve.store.tables import events

ROUTING_TYPES = ("RequestReceived", "RequestRouted", "PrefillCompleted")


async def routed_requests(
    db: AsyncEngine, since: datetime | None = None, until: datetime | None = None
) -> list[RoutedRequest]:
    """Every request routed (a `RequestRouted` event) in [since, until), with its received and prefill
    events whenever they happened, in routing order. Raises `sqlalchemy.exc.DBAPIError` / `OSError`
    when the store cannot be read."""
    window = sa.select(events.c.request_id).where(events.c.type == "RequestRouted")
    if since is not None:
        window = window.where(events.c.ts >= since)
    if until is not None:
        window = window.where(events.c.ts < until)
    q = (
        sa.select(events)
        .where(events.c.request_id.in_(window.distinct().scalar_subquery()))
        .where(events.c.type.in_(ROUTING_TYPES))
        .order_by(events.c.stream_seq)
    )
    async with db.connect() as conn:
        rows = (await conn.execute(q)).mappings().all()
    return fold_routed(row_event(r).event for r in rows)

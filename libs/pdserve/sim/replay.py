"""Replay a served stack's traffic in the simulator: every completed request of the event store, sent when
it was received (seconds from the first), with its prompt and completion token counts (the `requests`
projection) and its prompt's block hashes as the router logged them (`RequestRouted.prompt_block_hashes`,
`routing/log.py`), so the simulated prefix caches see the same shared prefixes."""

from __future__ import annotations

import asyncio
from datetime import datetime

import sqlalchemy as sa

from pdserve.routing.log import routed_requests
from pdserve.sim.workload import SimRequest
from pdserve.store.queries import make_db
from pdserve.store.tables import requests as requests_table


async def _load(url: str, since: datetime | None) -> list[SimRequest]:
    db = make_db(url)
    try:
        hashes = {r.request_id: r.block_hashes for r in await routed_requests(db, since)}
        q = sa.select(
            requests_table.c.request_id,
            requests_table.c.received_at,
            requests_table.c.prompt_tokens,
            requests_table.c.completion_tokens,
        ).where(requests_table.c.state == "completed")
        if since is not None:
            q = q.where(requests_table.c.received_at >= since)
        async with db.connect() as conn:
            rows = (await conn.execute(q.order_by(requests_table.c.received_at))).all()
    finally:
        await db.dispose()
    rows = [r for r in rows if r.received_at and r.prompt_tokens and r.completion_tokens]
    if not rows:
        return []
    t0 = rows[0].received_at
    return [
        SimRequest(
            (r.received_at - t0).total_seconds(),
            r.prompt_tokens,
            r.completion_tokens,
            tuple(hashes.get(str(r.request_id), ())),
        )
        for r in rows
    ]


def replay_requests(database_url: str, since: datetime | None = None) -> list[SimRequest]:
    """The completed requests of the event store at `database_url` (SQLAlchemy asyncpg URL), received
    since `since` (None: all). Raises ValueError when there are none, and what the store raises when it
    cannot be read."""
    reqs = asyncio.run(_load(database_url, since))
    if not reqs:
        raise ValueError("the event store holds no completed request to replay")
    return reqs

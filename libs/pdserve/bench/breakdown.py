"""The server's side of TTFT, joined from the event log: each request's `requests` projection row (queue,
route, reserve, prefill, exposed transfer, first token — docs/architecture.md §8) keyed by the `X-Request-Id`
the
gateway returned."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

import sqlalchemy as sa

from pdserve.states import TERMINAL_STATES
from pdserve.store.queries import make_db
from pdserve.store.tables import requests

BREAKDOWN_STAGES = ("queue_s", "route_s", "reserve_s", "prefill_s", "exposed_transfer_s", "first_token_s")


@dataclass(frozen=True)
class TTFTBreakdown:
    """One request's server-side TTFT and its stages, seconds (None where the projection has no value).
    `mode`: 'disaggregated', 'local' or 'colocated' as routed; `cached_tokens`: prompt tokens served from
    the prefix cache."""

    request_id: str
    state: str
    mode: str | None
    ttft_s: float | None
    stages_s: dict[str, float | None]
    cached_tokens: int | None
    kv_bytes: int | None


async def fetch_breakdowns(database_url: str, request_ids: Sequence[str],
                           wait_s: float = 15.0) -> dict[str, TTFTBreakdown]:
    """Projection rows of `request_ids` (SQLAlchemy asyncpg URL), waiting up to `wait_s` seconds for the
    recorder to have folded every one of them to a terminal state. Returns what is there by then (ids
    without a row are absent). Raises what SQLAlchemy raises when Postgres cannot be reached."""
    ids = sorted(set(request_ids))
    db = make_db(database_url)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            async with db.connect() as conn:
                q = sa.select(requests).where(requests.c.request_id.in_(ids))
                rows = (await conn.execute(q)).mappings().all()
            done = sum(r["state"] in TERMINAL_STATES for r in rows)
            if done == len(ids) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
    finally:
        await db.dispose()
    return {
        str(r["request_id"]): TTFTBreakdown(
            request_id=str(r["request_id"]), state=r["state"], mode=r["mode"], ttft_s=r["ttft_s"],
            stages_s={s: r[s] for s in BREAKDOWN_STAGES}, cached_tokens=r["cached_tokens"],
            kv_bytes=r["kv_bytes"],
        )
        for r in rows
    }


def mean_stages_ms(breakdowns: Sequence[TTFTBreakdown]) -> dict[str, float]:
    """Mean of each stage over the requests that have it, milliseconds, stage names without `_s`;
    plus `server_ttft`. Stages no request has are left out."""
    out: dict[str, float] = {}
    for key in (*BREAKDOWN_STAGES, "server_ttft"):
        vals = [b.ttft_s if key == "server_ttft" else b.stages_s[key] for b in breakdowns]
        present = [v for v in vals if v is not None]
        if present:
            out[key.removesuffix("_s")] = 1000.0 * sum(present) / len(present)
    return out

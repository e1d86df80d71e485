"""`GET /v1/requests/{request_id}`: a request's lifecycle, with read-your-writes.

The recorder commits events to Postgres a little after they happen (its batches linger up to
`PDS_LINGER_S`), and the coordinator records `RequestCompleted` after the last token reached the client.
So for a request this gateway answered (`Answered`), the read waits up to `read_your_writes_wait_s` for
the request's terminal event to be in Postgres; whatever Postgres still lacks then, or for any request it
knows nothing of, is read from JetStream — which holds every event until the recorder has it — and the
projection row is folded from those events exactly as the recorder folds it. An id the gateway has
answered is therefore never 404 while its events are in JetStream or Postgres.

Ids are taken in every form a response shows: the bare request id (a UUID), `cmpl-<id>` or
`chatcmpl-<id>`; anything else is 404 (it names no request).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from typing import Any

from fastapi.encoders import jsonable_encoder
from sqlalchemy.ext.asyncio import AsyncEngine

from pdserve.bus import Bus
from pdserve.events import TERMINAL_TYPES, Event
from pdserve.gateway.errors import APIError
from pdserve.ids import request_id_of
from pdserve.lifecycle.journal import request_events
from pdserve.store import projection, queries

log = logging.getLogger(__name__)

POLL_S = 0.05


def parse_request_id(text: str) -> str:
    """The canonical request id in `text` (bare, `cmpl-…` or `chatcmpl-…`). Raises `APIError` 404
    `request_not_found` when it is no UUID (so it can never reach a NATS subject or a query)."""
    try:
        return str(uuid.UUID(request_id_of(text.strip())))
    except (ValueError, AttributeError):
        raise APIError(404, f"No request with id `{text}`: not a request id.", code="request_not_found",
                       param="request_id") from None


class Answered:
    """The request ids this gateway answered most recently (bounded: the oldest are forgotten), and
    whether each answer has ended."""

    def __init__(self, capacity: int = 100_000) -> None:
        self.capacity = capacity
        self._ids: OrderedDict[str, bool] = OrderedDict()

    def add(self, request_id: str) -> None:
        self._ids[request_id] = False
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)

    def ended(self, request_id: str) -> None:
        if request_id in self._ids:
            self._ids[request_id] = True

    def has_ended(self, request_id: str) -> bool:
        return self._ids.get(request_id, False)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._ids


async def read_lifecycle(bus: Bus, db: AsyncEngine | None, answered: Answered, raw_id: str,
                         wait_s: float) -> dict[str, Any]:
    """`{"request": <projection row>, "events": [<event>, ...]}` in stream order (`seq` 1-based). Raises
    `APIError` 404 when neither Postgres nor JetStream knows `raw_id`, 503 when there is no event store
    configured or neither can be read."""
    if db is None:
        raise APIError(503, "This gateway has no event store configured.", code="event_store_unavailable")
    rid = parse_request_id(raw_id)
    deadline = time.monotonic() + (wait_s if answered.has_ended(rid) else 0.0)
    row, events, store_error = None, [], None
    while True:
        try:
            row, records = await queries.request_snapshot(db, rid)
            events = [(r.stream_seq, r.event) for r in records]
            store_error = None
        except Exception as e:  # Postgres down: serving goes on, JetStream answers below
            log.warning("event store read for %s failed: %s", rid, e)
            store_error = e
        if any(e.type in TERMINAL_TYPES for _, e in events) or time.monotonic() >= deadline:
            break
        await asyncio.sleep(POLL_S)
    if row is None or not any(e.type in TERMINAL_TYPES for _, e in events):
        merged = await _with_jetstream(bus, rid, events)
        if len(merged) > len(events):
            events, row = merged, projection.fold(merged)
    if row is None and not events:
        if store_error is not None:
            raise APIError(503, f"The event store cannot be read now: {type(store_error).__name__}",
                           code="event_store_unavailable") from store_error
        raise APIError(404, f"No request with id `{rid}` is recorded.", code="request_not_found",
                       param="request_id")
    out = [e.model_copy(update={"seq": i}).model_dump(mode="json") for i, (_, e) in enumerate(events, 1)]
    return jsonable_encoder({"request": row, "events": out})


async def _with_jetstream(bus: Bus, rid: str, events: list[tuple[int, Event]]) -> list[tuple[int, Event]]:
    """`events` (from Postgres) plus the request's events only JetStream has yet, in stream order."""
    found = {e.event_id: (seq, e) for seq, e in events}
    try:
        for rec in await request_events(bus, rid):
            found.setdefault(rec.event.event_id, (rec.stream_seq, rec.event))
    except Exception as e:  # NATS unreachable: Postgres alone
        log.warning("stream read of %s failed: %s", rid, e)
    return sorted(found.values(), key=lambda se: se[0])

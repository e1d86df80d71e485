"""Coordinator recovery: the unfinished requests of the log, each folded into where it resumes.

docs/architecture.md §7: recovery must see every event published before the crash. Postgres holds every event
up to
the recorder's ack floor (it acks only after commit, so every stream sequence ≤ the floor is committed);
the rest — the stream's tail — is read from JetStream. Together they are the whole log, whether or not
the recorder is running or caught up. Everything a resumed request needs is in its events: the prompt,
sampling and salt in `RequestReceived`, the placement in the projection, the output in `TokensCommitted`.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import NamedTuple

from sqlalchemy.ext.asyncio import AsyncEngine

from pdserve import store
from pdserve.bus import Bus
from pdserve.events import Event, RequestMigrated, RequestReceived
from pdserve.lifecycle.journal import committed_tokens, read_stream, request_events
from pdserve.lifecycle.request import ResumePoint
from pdserve.messages import Submit
from pdserve.states import TERMINAL_STATES, RequestState
from pdserve.store import RecordedEvent

log = logging.getLogger(__name__)


class Unfinished(NamedTuple):
    """One request to resume: the `Submit` rebuilt from its `RequestReceived`, and where it stands."""

    submit: Submit
    resume: ResumePoint


class Unresumable(NamedTuple):
    """An unfinished request whose log lacks what a resume needs (a `RequestReceived` without the prompt:
    written by an older gateway, or lost)."""

    request_id: str
    reason: str


async def read_log(bus: Bus, db: AsyncEngine) -> dict[str, list[RecordedEvent]]:
    """Every event of every request the log does not show finished, by request, in stream order: events
    of unfinished projection rows from Postgres, plus the stream's tail past the recorder's ack floor.
    Raises the database's or NATS's error when either cannot be read."""
    floor = await store.recorded_floor(bus)
    rows = await store.unfinished_requests(db)
    stored = await store.events_of_requests(db, [r["request_id"] for r in rows])
    tail = await read_stream(bus, bus.subjects.all_events, start_seq=floor + 1)
    by_request: dict[str, dict[str, RecordedEvent]] = defaultdict(dict)
    for rec in (*stored, *tail):
        by_request[rec.event.request_id].setdefault(rec.event.event_id, rec)
    # Requests seen only in the tail may have earlier events in Postgres (a terminal row included):
    # their whole history is needed to fold them.
    tail_only = {r.event.request_id for r in tail} - {r["request_id"] for r in rows}
    if tail_only:
        for rec in await store.events_of_requests(db, sorted(tail_only)):
            by_request[rec.event.request_id].setdefault(rec.event.event_id, rec)
    return {rid: sorted(evs.values(), key=lambda r: r.stream_seq) for rid, evs in by_request.items()}


async def read_requests(
    bus: Bus, db: AsyncEngine | None, request_ids: list[str]
) -> dict[str, list[RecordedEvent]]:
    """Every event of each of `request_ids`, in stream order (a takeover's log). A request whose
    `RequestReceived` — its first event — is still in the stream has its whole history there (retention
    drops the oldest first), so a takeover needs no Postgres while it is down; for the others, what
    Postgres holds is added. Raises NATS's error, or the database's when it is needed and down."""
    out: dict[str, list[RecordedEvent]] = {}
    missing: list[str] = []
    for request_id in request_ids:
        events = await request_events(bus, request_id)
        out[request_id] = events
        if not any(r.event.type == RequestReceived.type for r in events):
            missing.append(request_id)
    if missing and db is not None:
        for rec in await store.events_of_requests(db, missing):
            out[rec.event.request_id].append(rec)
        for request_id in missing:
            unique = {r.event.event_id: r for r in out[request_id]}
            out[request_id] = sorted(unique.values(), key=lambda r: r.stream_seq)
    return out


def plan(request_id: str, history: list[RecordedEvent]) -> Unfinished | Unresumable | None:
    """Where one request resumes, from its events in stream order; None if it is finished."""
    row = store.fold(history)
    if row is None or row["state"] in TERMINAL_STATES:
        return None
    events: list[Event] = [r.event for r in history]
    received = next((e for e in events if e.type == RequestReceived.type), None)
    payload = received.typed_payload() if received is not None else None
    if not isinstance(payload, RequestReceived) or not payload.prompt_token_ids or payload.sampling is None:
        return Unresumable(request_id, "the log holds no RequestReceived with the prompt and sampling")
    submit = Submit(
        request_id=request_id,
        model=payload.model,
        prompt_token_ids=tuple(payload.prompt_token_ids),
        sampling=payload.sampling,
        cache_salt=payload.cache_salt,
        received_ts=payload.received_ts if payload.received_ts is not None else received.ts,
    )
    holders = frozenset(w for w in (row["prefill_worker_id"], row["decode_worker_id"]) if w)
    state = RequestState(row["state"])
    decoding = state is RequestState.DECODING
    resume = ResumePoint(
        state=state,
        decode_worker_id=row["decode_worker_id"] if decoding else None,
        holders=holders,
        committed=tuple(committed_tokens(events)),
        migrations=sum(1 for e in events if e.type == RequestMigrated.type),
    )
    return Unfinished(submit, resume)

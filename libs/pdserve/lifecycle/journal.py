"""Reading the log back: a request's events from JetStream, and its committed output tokens.

The events stream holds every event until the limits retention drops it; Postgres holds every event the
recorder has committed (docs/architecture.md §7). Recovery and migration read the stream with an ephemeral,
ack-less
pull consumer filtered on a subject (`pds.events.<request_id>.TokensCommitted`, or `pds.events.>` from a
start sequence), so they see events Postgres may not hold yet.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import nats.errors
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from pydantic import ValidationError

from pdserve.bus import Bus
from pdserve.events import Event, TokensCommitted
from pdserve.store import RecordedEvent

log = logging.getLogger(__name__)

FETCH_BATCH = 1000
FETCH_TIMEOUT_S = 1.0


async def read_stream(bus: Bus, filter_subject: str, start_seq: int = 1) -> list[RecordedEvent]:
    """Every event now stored on the bus's events stream whose subject matches `filter_subject`, from
    stream sequence `start_seq` on, in stream order. Messages that are not events are skipped. Raises
    `nats.errors.Error` when NATS does not answer."""
    config = ConsumerConfig(
        ack_policy=AckPolicy.NONE,
        filter_subject=filter_subject,
        deliver_policy=DeliverPolicy.BY_START_SEQUENCE if start_seq > 1 else DeliverPolicy.ALL,
        opt_start_seq=start_seq if start_seq > 1 else None,
        inactive_threshold=30.0,
    )
    sub = await bus.js.pull_subscribe(filter_subject, stream=bus.settings.events_stream, config=config)
    out: list[RecordedEvent] = []
    try:
        info = await sub.consumer_info()
        pending = info.num_pending
        while pending > 0:
            try:
                msgs = await sub.fetch(min(FETCH_BATCH, pending), timeout=FETCH_TIMEOUT_S)
            except (TimeoutError, nats.errors.TimeoutError):
                break  # what was pending at the start has been read (or dropped by retention meanwhile)
            for msg in msgs:
                pending = msg.metadata.num_pending
                try:
                    out.append(
                        RecordedEvent(msg.metadata.sequence.stream, Event.model_validate_json(msg.data))
                    )
                except ValidationError:
                    log.warning("not an event on %s", msg.subject)
    finally:
        try:
            await sub.unsubscribe()
        except nats.errors.Error:
            pass
    return out


async def request_events(bus: Bus, request_id: str, event_type: str = "*") -> list[RecordedEvent]:
    """The stored events of one request (of one type, or all), in stream order."""
    return await read_stream(bus, bus.subjects.event(request_id, event_type))


def committed_tokens(events: Iterable[Event]) -> list[int]:
    """The output tokens the journal holds without a hole, from index 0: the union of every
    `TokensCommitted` (a migrated request commits some indices twice; the first commit of an index wins,
    as the gateway keeps the first token it streamed for an index)."""
    by_index: dict[int, int] = {}
    for event in events:
        if event.type != TokensCommitted.type:
            continue
        p = event.typed_payload()
        assert isinstance(p, TokensCommitted)
        for i, token in enumerate(p.token_ids, start=p.start_index):
            by_index.setdefault(i, token)
    out: list[int] = []
    while len(out) in by_index:
        out.append(by_index[len(out)])
    return out


async def read_committed(bus: Bus, request_id: str) -> list[int]:
    """The request's committed output tokens, read from the stream now."""
    return committed_tokens(r.event for r in await request_events(bus, request_id, TokensCommitted.type))

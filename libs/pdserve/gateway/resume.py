"""Resumable streams: `GET /v1/requests/{request_id}/stream` with `Last-Event-ID: N` picks a request's
SSE stream up again after output token N — on any gateway, e.g. one started after the first died.

The tokens come from the journal and from the live streams, whichever has them first (the reassembler
keeps the first token of each index): `TokensCommitted` events already stored (JetStream, which holds
every event the recorder has not dropped, and Postgres), the same events live on
`pds.events.<id>.TokensCommitted` (a JetStream publish reaches core subscribers too), and the decode
worker's `pds.tokens.<id>` chunks. Live subscriptions open before the history is read, so nothing
falls between them. The end comes from the decode's finishing chunk or the terminal event
(`RequestCompleted` → the finish at `completion_tokens`; `RequestFailed` / `RequestAborted` → an error).

The prompt, stop strings and endpoint come from the request's `RequestReceived`, so the resumed text is
produced exactly as the first gateway produced it (same detokenizer and stop-string state, primed with
the N tokens the client has, their text not sent again). A resumed stream is a reader: its client going
away does not abort the request.
"""

from __future__ import annotations

import logging
import time

from sqlalchemy.ext.asyncio import AsyncEngine

from pdserve.bus import Bus
from pdserve.events import (
    Event,
    RequestReceived,
)
from pdserve.gateway.errors import APIError
from pdserve.gateway.generation import Generation
from pdserve.gateway.prompt import PreparedRequest, Tokenizer
from pdserve.gateway.token_stream import event_chunk
from pdserve.lifecycle.journal import request_events
from pdserve.messages import FinishReason, TokenChunk
from pdserve.store import queries

log = logging.getLogger(__name__)


async def stored_events(bus: Bus, db: AsyncEngine | None, request_id: str) -> list[Event]:
    """The request's events from JetStream and Postgres together (by event id), in stream order."""
    found: dict[str, tuple[int, Event]] = {}
    try:
        for rec in await request_events(bus, request_id):
            found[rec.event.event_id] = (rec.stream_seq, rec.event)
    except Exception as e:  # NATS unreachable: Postgres alone
        log.warning("stream read of %s failed: %s", request_id, e)
    if db is not None:
        try:
            for rec in await queries.lifecycle_records(db, request_id):
                found.setdefault(rec.event.event_id, (rec.stream_seq, rec.event))
        except Exception as e:  # Postgres down: JetStream alone
            log.warning("store read of %s failed: %s", request_id, e)
    return [e for _, e in sorted(found.values(), key=lambda se: se[0])]


class ResumedGeneration(Generation):
    """A `Generation` fed from the journal and live streams instead of a fresh Submit.

    Build with `await ResumedGeneration.open(bus, tokenizer, db, request_id, last_event_id, ...)`,
    which raises `APIError` 404 when no `RequestReceived` with the prompt is found; then `deltas()` and
    `close()` as for any `Generation`."""

    received: RequestReceived

    @classmethod
    async def open(
        cls,
        bus: Bus,
        tokenizer: Tokenizer,
        db: AsyncEngine | None,
        request_id: str,
        last_event_id: int,
        timeout_s: float,
        gap_timeout_s: float,
        cached_tokens_wait_s: float = 1.0,
    ) -> ResumedGeneration:
        gen: ResumedGeneration | None = None
        subs = []

        async def on_event(event: Event) -> None:
            if gen is None:
                return
            await gen._note_event(event)
            if (chunk := event_chunk(event)) is not None:
                await gen._queue.put(chunk)

        queue_chunks: list[TokenChunk] = []

        async def on_chunk(chunk: TokenChunk) -> None:
            if gen is not None:
                await gen._queue.put(chunk)
            else:
                queue_chunks.append(chunk)

        subs.append(await bus.subscribe(bus.subjects.tokens(request_id), TokenChunk, on_chunk))
        subs.append(await bus.subscribe(bus.subjects.event(request_id, "*"), Event, on_event))
        history = await stored_events(bus, db, request_id)
        received = next((e.typed_payload() for e in history if e.type == RequestReceived.type), None)
        if (
            not isinstance(received, RequestReceived)
            or not received.prompt_token_ids
            or not received.sampling
        ):
            for sub in subs:
                await sub.unsubscribe()
            raise APIError(
                404,
                f"No resumable request with id `{request_id}`.",
                code="request_not_found",
                param="request_id",
            )
        prepared = PreparedRequest(tuple(received.prompt_token_ids), received.sampling, tuple(received.stop))
        gen = cls(
            bus,
            tokenizer,
            request_id=request_id,
            model=received.model,
            endpoint=received.endpoint,
            prepared=prepared,
            stream=True,
            received_ts=received.received_ts or time.time(),
            timeout_s=timeout_s,
            gap_timeout_s=gap_timeout_s,
            cache_salt=received.cache_salt,
            include_usage=received.include_usage,
            cached_tokens_wait_s=cached_tokens_wait_s,
        )
        gen.received = received
        gen.resume_from = last_event_id
        gen.ended = any(e.type in ("RequestCompleted", "RequestFailed", "RequestAborted") for e in history)
        gen._subs = subs
        for event in history:
            await gen._note_event(event)
        for chunk in [*queue_chunks, *(c for e in history if (c := event_chunk(e)) is not None)]:
            gen._queue.put_nowait(chunk)
        return gen

    async def start(self) -> None:  # the request runs already
        return None

    def abort(self, reason: str, finish_reason: FinishReason | None = None) -> None:
        """Only a stop string ends the request from here; a resumed reader leaving does not."""
        if finish_reason is not None:
            super().abort(reason, finish_reason)
        else:
            self.ended = True

    async def close(self) -> None:
        subs, self._subs = getattr(self, "_subs", []), []
        for sub in subs:
            try:
                await sub.unsubscribe()
            except Exception as e:
                log.debug("unsubscribe of %s failed: %s", self.request_id, e)

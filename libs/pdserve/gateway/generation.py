"""One request's generation as the gateway sees it: submit on the bus, then text deltas until the end.

docs/architecture.md §3 step 1: subscribe to `pds.tokens.<request_id>` before submitting (no chunk can be
missed), send `Submit` to the coordinator (which stores the request's `RequestReceived` before it accepts;
a Submit no coordinator accepts is recorded here), then turn `TokenChunk`s into text:
reorder and dedupe (`ChunkReassembler`), detokenize incrementally, cut at stop strings. Token chunks ride
core NATS, at most once: a chunk lost on the way (a NATS server of a cluster died with it in flight) is
filled from the request's journal, its `TokensCommitted` and terminal events in JetStream, read every
`JOURNAL_POLL_S` while a gap stays open and once the stream has been silent for the gap timeout (a lost
last chunk leaves no gap behind it). Whenever the
gateway ends a request the workers still run (stop string, client gone, timeout, a hole in the stream), it
sends `Abort` so they free it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from nats.errors import NoRespondersError
from opentelemetry import context as otel_context

from pdserve.bus import Bus, BusTimeout, RejectedError
from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.events import Event, PrefillCompleted, RequestFailed
from pdserve.gateway.errors import APIError, from_rejection
from pdserve.gateway.prompt import PreparedRequest, Tokenizer
from pdserve.gateway.responses import Usage
from pdserve.gateway.stop_strings import StopStringMatcher
from pdserve.gateway.token_stream import ChunkReassembler, event_chunk
from pdserve.ids import new_id
from pdserve.lifecycle.journal import request_events
from pdserve.lifecycle.receipt import store_received
from pdserve.messages import (
    Abort,
    Accepted,
    Ack,
    FinishReason,
    Receipt,
    RejectCode,
    Submit,
    TokenChunk,
    TokenLogprobs,
)

log = logging.getLogger(__name__)

SUBMIT_TRY_S = 2.0  # one Submit's wait for Accepted (a live coordinator answers in milliseconds)
SUBMIT_WAIT_S = 15.0  # how long a Submit is retried while no coordinator answers: then 503
ABORT_TIMEOUT_S = 2.0  # an Abort is best effort: the coordinator's own deadlines free the request anyway
JOURNAL_POLL_S = 1.0  # while a gap is open, the journal is read this often (tokens commit every 16)
JOURNAL_READ_TIMEOUT_S = 2.0

CLIENT_DISCONNECTED = "client disconnected"
REQUEST_TIMEOUT = "request timeout"
STOP_STRING = "stop string matched"
TOKEN_GAP = "token stream gap"


class ClientDisconnected(Exception):
    """The HTTP client went away; the request has been aborted."""


_DISCONNECT = object()  # queue sentinel: wakes `deltas()` when the client leaves


@dataclass(frozen=True)
class TextDelta:
    """New output text (may be empty), the completion tokens consumed so far, and the finish reason on
    the last delta. When the request asked for logprobs: `logprobs` of each token this delta covers and
    `text_offsets`, where each one's text starts (characters from the start of the output)."""

    text: str
    num_output_tokens: int
    finish_reason: FinishReason | None = None
    logprobs: tuple[TokenLogprobs, ...] = ()
    text_offsets: tuple[int, ...] = ()


class Generation:
    """Lifecycle: `await start()` (raises `APIError` when the coordinator refuses or does not answer) →
    `async for d in deltas()` (raises `APIError` 500 on an error chunk, 502 on a stream hole, 504 on the
    overall timeout; `ClientDisconnected` after `disconnect()`) → `await close()` (always)."""

    def __init__(self, bus: Bus, tokenizer: Tokenizer, *, request_id: str, model: str, endpoint: str,
                 prepared: PreparedRequest, stream: bool, received_ts: float, timeout_s: float,
                 gap_timeout_s: float, cache_salt: str | None = None, include_usage: bool = False,
                 cached_tokens_wait_s: float = 1.0) -> None:
        self.bus = bus
        self.request_id = request_id
        self.model = model
        self.endpoint = endpoint
        self.prepared = prepared
        self.stream = stream
        self.received_ts = received_ts
        self.cache_salt = cache_salt
        self.include_usage = include_usage
        self.deadline = time.monotonic() + timeout_s
        self.gap_timeout_s = gap_timeout_s
        self._gap_deadline: float | None = None  # while a hole in the token stream is open: when it fails
        self.num_output_tokens = 0
        self.first_token_monotonic: float | None = None
        self.last_token_monotonic: float | None = None
        self.inter_token_s: list[float] = []  # the gap before each output token after the first (ITL)
        self.finish_reason: FinishReason | None = None
        self._tokenizer = tokenizer
        self._queue: asyncio.Queue[TokenChunk | object] = asyncio.Queue()
        self._sub = None
        self._trace_context = otel_context.get_current()
        self.ended = False  # the workers are done with it: finished, failed, or aborted by us
        self.resume_from = 0  # output tokens whose text the client already has (a resumed stream)
        self.cached_tokens_wait_s = cached_tokens_wait_s
        self._prefilled = asyncio.Event()  # the first PrefillCompleted of the request was seen
        self.num_cached_tokens = 0
        self._event_sub = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prepared.prompt_token_ids)

    async def start(self) -> None:
        """Call with the request's span current: its context rides on the Submit and later Aborts."""
        self._trace_context = otel_context.get_current()
        subjects = self.bus.subjects
        # Not flushed one by one: the Submit, published next on this connection, reaches the server after
        # both subscriptions, and nothing reaches them before a coordinator has the Submit.
        self._sub = await self.bus.subscribe(subjects.tokens(self.request_id), TokenChunk, self._queue.put,
                                             flush=False)
        self._event_sub = await self.bus.subscribe(subjects.event(self.request_id, PrefillCompleted.type),
                                                   Event, self._note_event, flush=False)
        receipt = Receipt(event_id=new_id(), endpoint=self.endpoint, stream=self.stream,
                          stop=tuple(self.prepared.stop), include_usage=self.include_usage)
        submit = Submit(request_id=self.request_id, model=self.model,
                        prompt_token_ids=self.prepared.prompt_token_ids, sampling=self.prepared.sampling,
                        cache_salt=self.cache_salt, received_ts=self.received_ts, receipt=receipt)
        try:
            await self._submit(submit)
        except RejectedError as e:
            await self._record_refusal(submit, str(e))
            raise from_rejection(e) from e
        except BusTimeout as e:
            await self._record_refusal(submit, str(e))
            self.abort("coordinator did not answer the submit")  # in case it got it after all
            raise APIError(503, "The coordinator is not answering; try again later.",
                           code="coordinator_unavailable", headers={"Retry-After": "1"}) from e

    async def deltas(self) -> AsyncIterator[TextDelta]:
        """One `TextDelta` per output token (its text may be empty: held back by a stop string's prefix or
        an unfinished UTF-8 sequence), however the tokens were chunked on the bus — a live stream's
        one-token chunks and a resumed stream's 16-token journal commits give the same deltas, so an SSE
        id (`num_output_tokens`) means the same in both. The last delta carries `finish_reason`."""
        reassembler = ChunkReassembler()
        detokenizer = IncrementalDetokenizer(self._tokenizer, list(self.prepared.prompt_token_ids))
        stops = StopStringMatcher(self.prepared.stop)
        self._gap_deadline = None
        text_len = 0  # characters of output text so far: the next token's text offset
        while True:
            chunk = await self._next_chunk()
            ready = reassembler.push(chunk)
            if ready.token_ids:
                now = time.monotonic()
                if self.first_token_monotonic is None:
                    self.first_token_monotonic = now
                else:  # tokens that arrive together share the gap since the last ones
                    assert self.last_token_monotonic is not None
                    gap = (now - self.last_token_monotonic) / len(ready.token_ids)
                    self.inter_token_s += [gap] * len(ready.token_ids)
                self.last_token_monotonic = now
            # one token at a time, so the usage counts stop at a stop string
            for i, token_id in enumerate(ready.token_ids):
                self.num_output_tokens += 1
                match = stops.feed(detokenizer.add([token_id]))
                offset, text_len = text_len, text_len + len(match.text)
                if self.num_output_tokens <= self.resume_from:
                    continue  # a resumed stream: the client has this text already
                logprobs = (ready.logprobs[i],) if i < len(ready.logprobs) else ()
                offsets = (offset,) if logprobs else ()
                if match.stopped:
                    self.finish_reason = FinishReason.STOP
                    self.abort(STOP_STRING, FinishReason.STOP)
                    yield TextDelta(match.text, self.num_output_tokens, FinishReason.STOP, logprobs, offsets)
                    return
                yield TextDelta(match.text, self.num_output_tokens, None, logprobs, offsets)
            if ready.error is not None:
                self.ended = True
                raise APIError(500, f"The request failed: {ready.error}", code="generation_failed")
            if ready.finish_reason is not None:
                self.ended = True
                self.finish_reason = ready.finish_reason
                yield TextDelta(stops.flush(), self.num_output_tokens, ready.finish_reason)
                return
            if not reassembler.has_gap:
                self._gap_deadline = None
            elif self._gap_deadline is None:
                self._gap_deadline = time.monotonic() + self.gap_timeout_s

    async def _note_event(self, event: Event) -> None:
        """Keep what the request's lifecycle events tell the answer: the prompt tokens the first prefill
        found in a prefix cache (`PrefillCompleted.num_cached_tokens`; a migration's re-prefill, of prompt
        + committed output, comes later and is not the prompt's)."""
        if event.type == PrefillCompleted.type and not self._prefilled.is_set():
            self.num_cached_tokens = int(event.payload.get("num_cached_tokens") or 0)
            self._prefilled.set()

    async def usage(self) -> Usage:
        """OpenAI's usage of the request so far, with `prompt_tokens_details.cached_tokens`. The prefill
        worker's `PrefillCompleted` is published before its first token leaves, so it is normally here
        already; it is waited for at most `cached_tokens_wait_s` seconds (then the count is 0)."""
        if not self._prefilled.is_set() and self.cached_tokens_wait_s > 0:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.cached_tokens_wait_s):
                    await self._prefilled.wait()
        return Usage.of(self.num_prompt_tokens, self.num_output_tokens, self.num_cached_tokens)

    async def _next_chunk(self) -> TokenChunk:
        """The next chunk on the bus or from the journal. While a gap is open the journal is read every
        `JOURNAL_POLL_S`; a read that fails (JetStream electing a stream leader) starts the gap timeout
        again, so a gap fails only after the journal, readable for that long, did not fill it.
        Raises APIError 502 (gap timeout) or 504 (request timeout)."""
        silence_deadline = time.monotonic() + self.gap_timeout_s
        while True:
            now = time.monotonic()
            gap_deadline = self._gap_deadline
            poll = now + JOURNAL_POLL_S if gap_deadline is not None else silence_deadline
            wait_until = min(self.deadline, poll if gap_deadline is None else min(gap_deadline, poll))
            try:
                async with asyncio.timeout(max(wait_until - now, 0.0)):
                    item = await self._queue.get()
                break
            except TimeoutError:
                now = time.monotonic()
                if now < self.deadline and (gap_deadline is None or now < gap_deadline):
                    # puts what the journal holds into the queue
                    if not await self._fill_from_journal() and self._gap_deadline is not None:
                        self._gap_deadline = time.monotonic() + self.gap_timeout_s
                    silence_deadline = now + self.gap_timeout_s
                    continue
            if gap_deadline is not None and gap_deadline < self.deadline:
                self.abort(TOKEN_GAP)
                raise APIError(502, f"Output tokens from index {self.num_output_tokens} never arrived "
                                    f"(waited {self.gap_timeout_s} s).", code="token_stream_gap") from None
            self.abort(REQUEST_TIMEOUT)
            raise APIError(504, "The request did not finish within the gateway's request timeout.",
                           code="timeout") from None
        if item is _DISCONNECT:
            raise ClientDisconnected(self.request_id)
        assert isinstance(item, TokenChunk)
        return item

    async def _fill_from_journal(self) -> bool:
        """Queue, as chunks, what the request's stored events say about its output (the reassembler drops
        what it has already); False when the read failed (NATS failing over: logged, the next poll tries
        again)."""
        try:
            async with asyncio.timeout(JOURNAL_READ_TIMEOUT_S):
                records = await request_events(self.bus, self.request_id)
        except Exception as e:
            log.info("journal read of %s failed: %r", self.request_id, e)
            return False
        for rec in records:
            if (chunk := event_chunk(rec.event)) is not None:
                self._queue.put_nowait(chunk)
        return True

    def disconnect(self) -> None:
        """The client left: abort the request unless it already ended, and wake `deltas()` (which then
        raises `ClientDisconnected`)."""
        self.abort(CLIENT_DISCONNECTED)
        self._queue.put_nowait(_DISCONNECT)

    def abort(self, reason: str, finish_reason: FinishReason | None = None) -> None:
        """Ask the coordinator to stop the request and free what it holds (once; in the background)."""
        if self.ended:
            return
        self.ended = True
        msg = Abort(request_id=self.request_id, reason=reason, finish_reason=finish_reason)
        self.bus.spawn(self._send_abort(msg))

    async def _send_abort(self, msg: Abort) -> None:
        token = otel_context.attach(self._trace_context)
        try:
            await self.bus.request(self.bus.subjects.abort, msg, Ack, timeout_s=ABORT_TIMEOUT_S)
        except (BusTimeout, RejectedError) as e:
            log.warning("abort of %s (%s) not acknowledged: %s", self.request_id, msg.reason, e)
        finally:
            otel_context.detach(token)

    async def close(self) -> None:
        for sub in (self._sub, self._event_sub):
            if sub is None:
                continue
            try:
                await sub.unsubscribe()
            except Exception as e:  # connection already closed: nothing left to free
                log.debug("unsubscribe of %s failed: %s", self.request_id, e)
        self._sub = self._event_sub = None

    async def _record_refusal(self, submit: Submit, reason: str) -> None:
        """No coordinator accepted `submit`: the gateway closes the request's lifecycle in the log, its
        `RequestReceived` (stored once under the receipt's id, whoever stored it first) then
        `RequestFailed` (phase submit)."""
        await store_received(self.bus, submit)
        await self.bus.emit(self.request_id, RequestFailed(phase="submit", reason=reason))

    async def _submit(self, submit: Submit) -> None:
        """Send the Submit, again every `SUBMIT_TRY_S` without an answer, for up to `SUBMIT_WAIT_S`: the
        coordinator it reached may have died with it (several run at once, docs/architecture.md §18). A
        Submit is idempotent: a coordinator accepts a request another one owns without running it twice.
        A coordinator that cannot claim the request's lease now refuses with UNAVAILABLE: sent again too.
        Raises `BusTimeout` when none answers (at once when no coordinator subscribes at all: the client
        is told to retry), `RejectedError` on a refusal."""
        deadline = time.monotonic() + min(SUBMIT_WAIT_S, self._remaining_s())
        while True:
            left = deadline - time.monotonic()
            try:
                await self.bus.request(self.bus.subjects.submit, submit, Accepted,
                                       timeout_s=max(min(SUBMIT_TRY_S, left), 0.001))
                return
            except BusTimeout as e:
                if time.monotonic() >= deadline or isinstance(e.__cause__, NoRespondersError):
                    raise
            except RejectedError as e:  # that coordinator cannot own it now; another of the group may
                if e.code is not RejectCode.UNAVAILABLE or time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(0.2)

    def _remaining_s(self) -> float:
        return max(self.deadline - time.monotonic(), 0.001)

"""Answering a `Generation`: as server-sent events (`stream: true`) or as one JSON body.

SSE framing as OpenAI's: `data: {json}\\n\\n` per chunk, `data: [DONE]\\n\\n` at the end. An error after
the 200 header has gone out is sent as `data: {"error": {...}}` (OpenAI's error shape; the official client
raises it as `APIError`), then `[DONE]`. A client that disconnects — seen as `http.disconnect` on the ASGI
receive channel, or as cancellation of the stream task — gets its request aborted.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pdserve.gateway.errors import APIError
from pdserve.gateway.generation import ClientDisconnected, Generation
from pdserve.gateway.observe import RequestObserver
from pdserve.gateway.responses import Formatter, Usage
from pdserve.messages import TokenLogprobs

log = logging.getLogger(__name__)

SSE_DONE = "data: [DONE]\n\n"
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left before the answer


def sse(body: BaseModel | dict[str, Any], event_id: int | None = None) -> str:
    """One SSE event carrying `body` as JSON, with `id: <event_id>` when given. Chunk models are dumped
    with `exclude_unset`."""
    if isinstance(body, BaseModel):
        data = body.model_dump_json(exclude_unset=True)
    else:
        data = json.dumps(body, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n" if event_id is None else f"id: {event_id}\ndata: {data}\n\n"


async def watch_disconnect(request: Request, gen: Generation) -> None:
    """Wait for the client to go away, then abort `gen`. Cancel this task once the answer is sent."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            gen.disconnect()
            return


async def event_stream(gen: Generation, fmt: Formatter, observer: RequestObserver,
                       request: Request, opening: bool = True) -> AsyncIterator[str]:
    """The SSE body of a streamed request whose `gen` has been started. Every chunk's `id:` is the number
    of output tokens its text covers, so `GET /v1/requests/{id}/stream` with that `Last-Event-ID` goes on
    right after it. `opening=False` (a resumed stream) leaves out the opening chunks."""
    watcher = asyncio.ensure_future(watch_disconnect(request, gen))
    status: int | None = None
    error: str | None = None
    try:
        if opening:
            for chunk in fmt.opening_chunks():
                yield sse(chunk, 0)
        async for delta in gen.deltas():
            if delta.text or delta.logprobs:
                yield sse(fmt.text_chunk(delta.text, None, delta.logprobs, delta.text_offsets),
                          delta.num_output_tokens)
            if delta.finish_reason is not None:
                yield sse(fmt.text_chunk("", delta.finish_reason.value), delta.num_output_tokens)
        if fmt.include_usage:
            yield sse(fmt.usage_chunk(Usage.of(gen.num_prompt_tokens, gen.num_output_tokens)),
                      gen.num_output_tokens)
        yield SSE_DONE
    except APIError as e:
        status, error = e.status, e.message
        yield sse(e.body())
        yield SSE_DONE
    except ClientDisconnected:
        status, error = CLIENT_CLOSED_REQUEST, "client disconnected"
    except BaseException:  # cancelled (client gone) or closed early: the workers must stop too
        status, error = CLIENT_CLOSED_REQUEST, "client disconnected"
        gen.disconnect()
        raise
    finally:
        watcher.cancel()
        # Not awaited here: under anyio's cancellation every await in this frame would be cancelled again.
        gen.bus.spawn(gen.close())
        _finish(observer, gen, status, error)


async def collect(gen: Generation, fmt: Formatter, observer: RequestObserver, request: Request) -> BaseModel:
    """The whole answer of a non-streamed request whose `gen` has been started. Raises `APIError` as
    `Generation.deltas` does, and `ClientDisconnected` when the client left first."""
    watcher = asyncio.ensure_future(watch_disconnect(request, gen))
    status: int | None = None
    error: str | None = None
    try:
        parts: list[str] = []
        logprobs: list[TokenLogprobs] = []
        offsets: list[int] = []
        async for delta in gen.deltas():
            parts.append(delta.text)
            logprobs.extend(delta.logprobs)
            offsets.extend(delta.text_offsets)
        usage = Usage.of(gen.num_prompt_tokens, gen.num_output_tokens)
        return fmt.whole("".join(parts), gen.finish_reason.value if gen.finish_reason else None, usage,
                         logprobs, offsets)
    except APIError as e:
        status, error = e.status, e.message
        raise
    except BaseException:
        status, error = CLIENT_CLOSED_REQUEST, "client disconnected"
        gen.disconnect()
        raise
    finally:
        watcher.cancel()
        gen.bus.spawn(gen.close())
        _finish(observer, gen, status, error)


def _finish(observer: RequestObserver, gen: Generation, status: int | None, error: str | None) -> None:
    observer.finish(num_output_tokens=gen.num_output_tokens, first_token_monotonic=gen.first_token_monotonic,
                    finish_reason=gen.finish_reason, error_status=status, error=error)


class GenerationStream(StreamingResponse):
    """The SSE response of one generation. If the body never starts (the client left before the first
    byte, so `event_stream` never ran), the request is still aborted and its span and subscription closed."""

    def __init__(self, content: AsyncIterator[str], gen: Generation, observer: RequestObserver,
                 headers: dict[str, str]) -> None:
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self._gen = gen
        self._observer = observer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self._gen.ended:
                self._gen.disconnect()
            self._gen.bus.spawn(self._close_body())
            _finish(self._observer, self._gen, CLIENT_CLOSED_REQUEST, "client disconnected")

    async def _close_body(self) -> None:
        # A body cancelled while suspended at a yield is not finalized by Starlette: close it (its finally
        # cancels the disconnect watcher), then the subscription.
        await self.body_iterator.aclose()  # type: ignore[attr-defined]
        await self._gen.close()

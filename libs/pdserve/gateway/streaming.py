"""Answering a `Generation`: as server-sent events (`stream: true`) or as one JSON body.

SSE framing exactly as OpenAI's by default: `data: {json}\\n\\n` per chunk, `data: [DONE]\\n\\n` at the end,
nothing else (clients such as `vllm bench serve` take each blank-line-separated event to be one `data:`
line). A client that wants to resume a broken stream opts into SSE ids (`id: N` before each `data:`, N the
output tokens its text covers: the `Last-Event-ID` to resume after) with the request header
`X-PDS-Event-Ids: true`; the resume endpoint always sends them. An error after
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

from pdserve.gateway.choices import Choices
from pdserve.gateway.errors import APIError
from pdserve.gateway.generation import ClientDisconnected
from pdserve.gateway.responses import ChoiceText, Formatter

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


async def watch_disconnect(request: Request, gen: Choices) -> None:
    """Wait for the client to go away, then abort `gen`. Cancel this task once the answer is sent."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            gen.disconnect()
            return


EVENT_IDS_HEADER = "X-PDS-Event-Ids"


def wants_event_ids(request: Request) -> bool:
    """Whether the client opted into `id:` lines (`X-PDS-Event-Ids: true|1|yes`)."""
    return request.headers.get(EVENT_IDS_HEADER, "").strip().lower() in ("1", "true", "yes")


async def event_stream(gen: Choices, fmt: Formatter, request: Request, opening: bool = True,
                       event_ids: bool = False) -> AsyncIterator[str]:
    """The SSE body of a streamed request whose `gen` has been started: one event per output token whose
    text is not empty, of any choice (each chunk names its choice's `index`). With `event_ids` and one
    choice, every event's `id:` is the number of output tokens its text covers, so
    `GET /v1/requests/{id}/stream` with that `Last-Event-ID` goes on right after it (with several choices
    there are no ids: each choice resumes by its own request id). `opening=False` (a resumed stream)
    leaves out the opening chunks."""
    watcher = asyncio.ensure_future(watch_disconnect(request, gen))
    status: int | None = None
    error: str | None = None
    event_ids = event_ids and len(gen.gens) == 1

    def event(body: BaseModel | dict[str, Any], num_tokens: int) -> str:
        return sse(body, num_tokens if event_ids else None)

    try:
        if opening:
            for chunk in fmt.opening_chunks(len(gen.gens)):
                yield event(chunk, 0)
        async for index, delta in gen.deltas():
            if delta.text or delta.logprobs:
                yield event(fmt.text_chunk(delta.text, None, delta.logprobs, delta.text_offsets, index),
                            delta.num_output_tokens)
            if delta.finish_reason is not None:
                yield event(fmt.text_chunk("", delta.finish_reason.value, index=index),
                            delta.num_output_tokens)
        if fmt.include_usage:
            yield event(fmt.usage_chunk(await gen.usage()), gen.first.num_output_tokens)
        yield SSE_DONE
    except APIError as e:
        status, error = e.status, e.message
        gen.disconnect()  # the other choices, if any, end with this one
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
        gen.finish(status, error)


async def collect(gen: Choices, fmt: Formatter, request: Request) -> BaseModel:
    """The whole answer of a non-streamed request whose `gen` has been started. Raises `APIError` as
    `Generation.deltas` does, and `ClientDisconnected` when the client left first."""
    watcher = asyncio.ensure_future(watch_disconnect(request, gen))
    status: int | None = None
    error: str | None = None
    try:
        choices = [ChoiceText() for _ in gen.gens]
        parts: list[list[str]] = [[] for _ in gen.gens]
        async for index, delta in gen.deltas():
            parts[index].append(delta.text)
            choices[index].logprobs.extend(delta.logprobs)
            choices[index].text_offsets.extend(delta.text_offsets)
        for choice, text, g in zip(choices, parts, gen.gens, strict=True):
            choice.text = "".join(text)
            choice.finish_reason = g.finish_reason.value if g.finish_reason else None
        return fmt.whole(choices, await gen.usage())
    except APIError as e:
        status, error = e.status, e.message
        gen.disconnect()
        raise
    except BaseException:
        status, error = CLIENT_CLOSED_REQUEST, "client disconnected"
        gen.disconnect()
        raise
    finally:
        watcher.cancel()
        gen.bus.spawn(gen.close())
        gen.finish(status, error)


class GenerationStream(StreamingResponse):
    """The SSE response of one answer. If the body never starts (the client left before the first
    byte, so `event_stream` never ran), the request is still aborted and its spans and subscriptions
    closed."""

    def __init__(self, content: AsyncIterator[str], gen: Choices, headers: dict[str, str]) -> None:
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self._gen = gen

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self._gen.ended:
                self._gen.disconnect()
            self._gen.bus.spawn(self._close_body())
            self._gen.finish(CLIENT_CLOSED_REQUEST, "client disconnected")

    async def _close_body(self) -> None:
        # A body cancelled while suspended at a yield is not finalized by Starlette: close it (its finally
        # cancels the disconnect watcher), then the subscriptions.
        await self.body_iterator.aclose()  # type: ignore[attr-defined]
        await self._gen.close()

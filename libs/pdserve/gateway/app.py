"""The gateway's FastAPI app: the OpenAI-compatible HTTP edge of pdserve (docs/architecture.md §3, step 1).

Routes: POST /v1/completions, POST /v1/chat/completions (stream or not), GET /v1/models[/{model}],
GET /v1/requests/{request_id} (a request's lifecycle from the event store), GET
/v1/requests/{request_id}/stream (resume an SSE stream after `Last-Event-ID`), GET /health, GET /metrics.
Build it with `create_app(bus, tokenizer, settings, db)`; the service (`pdserve.services.gateway`)
serves it with uvicorn.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from sqlalchemy.ext.asyncio import AsyncEngine

from pdserve.bus import Bus
from pdserve.config import GatewaySettings
from pdserve.gateway.errors import (
    REQUEST_ID_HEADER,
    APIError,
    api_error_from_validation,
    install_error_handlers,
    invalid_request,
    model_not_found,
)
from pdserve.gateway.generation import ClientDisconnected, Generation
from pdserve.gateway.observe import RequestObserver
from pdserve.gateway.prompt import PreparedRequest, Tokenizer, check_model, prepare_chat, prepare_completion
from pdserve.gateway.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.gateway.responses import ChatFormatter, CompletionFormatter, Formatter
from pdserve.gateway.resume import ResumedGeneration
from pdserve.gateway.streaming import CLIENT_CLOSED_REQUEST, GenerationStream, collect, event_stream
from pdserve.ids import new_id
from pdserve.store import queries

log = logging.getLogger(__name__)


@dataclass
class GatewayState:
    bus: Bus
    tokenizer: Tokenizer
    settings: GatewaySettings
    db: AsyncEngine | None
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass(frozen=True)
class Endpoint:
    """What differs between the two generation endpoints."""

    path: str
    request_type: type[CompletionRequest] | type[ChatCompletionRequest]
    prepare: Callable[[Any, Tokenizer, int], PreparedRequest]
    formatter: type[Formatter]


COMPLETIONS = Endpoint("/v1/completions", CompletionRequest, prepare_completion, CompletionFormatter)
CHAT = Endpoint("/v1/chat/completions", ChatCompletionRequest, prepare_chat, ChatFormatter)


def create_app(bus: Bus, tokenizer: Tokenizer, settings: GatewaySettings,
               db: AsyncEngine | None) -> FastAPI:
    """The gateway app. `db` (the event store, read only) may be None: /v1/requests then answers 503."""
    app = FastAPI(title="pdserve gateway", description="OpenAI-compatible API of pdserve.")
    app.state.gateway = GatewayState(bus, tokenizer, settings, db)
    install_error_handlers(app)

    @app.post(COMPLETIONS.path)
    async def completions(request: Request) -> Response:
        return await generate(request, COMPLETIONS)

    @app.post(CHAT.path)
    async def chat_completions(request: Request) -> Response:
        return await generate(request, CHAT)

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(app.state.gateway)]}

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str) -> dict[str, Any]:
        state: GatewayState = app.state.gateway
        if model != state.settings.served_model_name:
            raise model_not_found(model)
        return model_card(state)

    @app.get("/v1/requests/{request_id}")
    async def request_lifecycle(request_id: str) -> dict[str, Any]:
        return await read_lifecycle(app.state.gateway, request_id)

    @app.get("/v1/requests/{request_id}/stream")
    async def resume_stream(request_id: str, request: Request) -> Response:
        return await resume(request, request_id)

    @app.get("/health")
    async def health() -> dict[str, str]:
        if not app.state.gateway.bus.nc.is_connected:
            raise APIError(503, "Not connected to NATS.", code="nats_disconnected")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return app


def model_card(state: GatewayState) -> dict[str, Any]:
    """OpenAI's model object, plus vLLM's `max_model_len`."""
    s = state.settings
    return {"id": s.served_model_name, "object": "model", "created": state.created, "owned_by": "pdserve",
            "root": s.model, "max_model_len": s.max_model_len}


async def generate(request: Request, endpoint: Endpoint) -> Response:
    """Validate → tokenize → submit → answer (SSE or JSON). Every failure is an `APIError`."""
    received_ts, received_monotonic = time.time(), time.monotonic()
    state: GatewayState = request.app.state.gateway
    req = await parse(request, endpoint)
    model = state.settings.served_model_name
    check_model(req.model, model)
    prepared = endpoint.prepare(req, state.tokenizer, state.settings.max_model_len)

    request_id = new_id()
    request.state.request_id = request_id
    observer = RequestObserver(request_id, model, endpoint.path, len(prepared.prompt_token_ids),
                               prepared.sampling.max_tokens, req.stream, received_monotonic)
    gen = Generation(state.bus, state.tokenizer, request_id=request_id, model=model, endpoint=endpoint.path,
                     prepared=prepared, stream=req.stream, received_ts=received_ts,
                     timeout_s=state.settings.request_timeout_s,
                     gap_timeout_s=state.settings.token_gap_timeout_s,
                     cache_salt=getattr(req, "cache_salt", None), include_usage=req.include_usage)
    try:
        with observer.current():
            await gen.start()
    except Exception as e:
        err = e if isinstance(e, APIError) else APIError(
            503, f"The message bus is unavailable: {type(e).__name__}: {e}", code="bus_unavailable",
            headers={"Retry-After": "1"})
        observer.finish(num_output_tokens=0, first_token_monotonic=None, finish_reason=None,
                        error_status=err.status, error=err.message)
        state.bus.spawn(gen.close())
        raise err from e

    fmt = endpoint.formatter(request_id, model, req.include_usage, token_text(state.tokenizer, prepared))
    headers = {REQUEST_ID_HEADER: request_id}
    if req.stream:
        return GenerationStream(event_stream(gen, fmt, observer, request), gen, observer,
                                headers={**headers, "Cache-Control": "no-cache"})
    try:
        with observer.current():
            body = await collect(gen, fmt, observer, request)
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED_REQUEST, headers=headers)
    return JSONResponse(body.model_dump(mode="json"), headers=headers)


class _Unobserved:
    """A resumed stream is not a new request: no span, no request metrics."""

    def finish(self, **_: Any) -> None:
        return None


async def resume(request: Request, request_id: str) -> Response:
    """The SSE stream of `request_id` from after output token `Last-Event-ID` (header, or the
    `last_event_id` query parameter; 0 = from the start). 400 on a malformed id, 404 for an unknown or
    unresumable request (see `pdserve.gateway.resume`)."""
    state: GatewayState = request.app.state.gateway
    raw = request.headers.get("last-event-id") or request.query_params.get("last_event_id") or "0"
    if not raw.isdigit():
        raise invalid_request(f"Last-Event-ID must be a token count, got {raw!r}.", param="Last-Event-ID")
    last = int(raw)
    gen = await ResumedGeneration.open(state.bus, state.tokenizer, state.db, request_id, last,
                                       timeout_s=state.settings.request_timeout_s,
                                       gap_timeout_s=state.settings.token_gap_timeout_s)
    endpoint = CHAT if gen.received.endpoint == CHAT.path else COMPLETIONS
    fmt = endpoint.formatter(request_id, gen.model, gen.include_usage,
                             token_text(state.tokenizer, gen.prepared))
    observer: Any = _Unobserved()
    return GenerationStream(event_stream(gen, fmt, observer, request, opening=last == 0), gen, observer,
                            headers={REQUEST_ID_HEADER: request_id, "Cache-Control": "no-cache"})


def token_text(tokenizer: Tokenizer, prepared: PreparedRequest) -> Callable[[int], str] | None:
    """A token id's string for logprobs (the decode of that one id, as vLLM returns it); None when the
    request did not ask for logprobs."""
    if prepared.sampling.logprobs is None:
        return None
    return lambda token_id: tokenizer.decode([token_id])


async def parse(request: Request, endpoint: Endpoint) -> CompletionRequest | ChatCompletionRequest:
    """The request body as the endpoint's model. The body is read as JSON whatever its content type
    (curl's default form type included); a syntax error, a non-object or a field error is a 400."""
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise invalid_request(f"Malformed JSON body: {e}", code="json_invalid") from e
    if not isinstance(body, dict):
        raise invalid_request("The request body must be a JSON object.", code="json_invalid")
    try:
        return endpoint.request_type.model_validate(body)
    except ValidationError as e:
        raise api_error_from_validation(e.errors(include_url=False)) from e


async def read_lifecycle(state: GatewayState, request_id: str) -> dict[str, Any]:
    """`{"request": <projection row>, "events": [<event>, ...]}` in stream order. 404 when the store
    knows nothing of `request_id`; 503 when there is no store or it cannot be read."""
    if state.db is None:
        raise APIError(503, "This gateway has no event store configured.", code="event_store_unavailable")
    try:
        row, records = await queries.request_snapshot(state.db, request_id)
    except Exception as e:  # Postgres down: serving goes on, only this read fails
        log.warning("event store read for %s failed: %s", request_id, e)
        raise APIError(503, f"The event store cannot be read now: {type(e).__name__}",
                       code="event_store_unavailable") from e
    if row is None and not records:
        raise APIError(404, f"No request with id `{request_id}` is recorded.", code="request_not_found",
                       param="request_id")
    return jsonable_encoder({"request": row, "events": [r.event.model_dump(mode="json") for r in records]})

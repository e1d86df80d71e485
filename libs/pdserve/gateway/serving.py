"""The two generation endpoints and the resume endpoint: validate → tokenize → submit → answer.

Every failure is an `APIError` in OpenAI's shape: 400 for a body that is not a JSON object, a field of the
wrong type or range, text that is no valid Unicode (a lone surrogate such as `"\\ud800"` parses as JSON but
is no text), a NUL in a stored string field (stop strings, cache_salt: Postgres' jsonb cannot hold it) or
a prompt that cannot fit the context; 413 for a body over `max_body_bytes`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from pdserve.gateway.choices import CHOICE_REQUEST_IDS_HEADER, Choices, choice_seed
from pdserve.gateway.errors import REQUEST_ID_HEADER, APIError, api_error_from_validation, invalid_request
from pdserve.gateway.generation import ClientDisconnected, Generation
from pdserve.gateway.keys import ApiKey
from pdserve.gateway.lifecycle_read import parse_request_id
from pdserve.gateway.observe import RequestObserver
from pdserve.gateway.prompt import PreparedRequest, Tokenizer, check_model, prepare_chat, prepare_completion
from pdserve.gateway.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.gateway.responses import ChatFormatter, CompletionFormatter, Formatter
from pdserve.gateway.resume import ResumedGeneration
from pdserve.gateway.streaming import (
    CLIENT_CLOSED_REQUEST,
    GenerationStream,
    collect,
    event_stream,
    wants_event_ids,
)
from pdserve.ids import new_id

if TYPE_CHECKING:
    from pdserve.gateway.app import GatewayState


@dataclass(frozen=True)
class Endpoint:
    """What differs between the two generation endpoints."""

    path: str
    request_type: type[CompletionRequest] | type[ChatCompletionRequest]
    prepare: Callable[[Any, Tokenizer, int], PreparedRequest]
    formatter: type[Formatter]


COMPLETIONS = Endpoint("/v1/completions", CompletionRequest, prepare_completion, CompletionFormatter)
CHAT = Endpoint("/v1/chat/completions", ChatCompletionRequest, prepare_chat, ChatFormatter)


async def generate(request: Request, endpoint: Endpoint) -> Response:
    """Answer one generation request (`n` choices: `pdserve.gateway.choices`), as SSE or JSON."""
    received_ts, received_monotonic = time.time(), time.monotonic()
    state: GatewayState = request.app.state.gateway
    key = getattr(request.state, "api_key", None)
    req = await parse(request, endpoint, state.settings.max_body_bytes, key)
    model = state.settings.served_model_name
    check_model(req.model, model)
    await state.capacity.ensure_listening()
    max_model_len = state.capacity.max_model_len(state.settings.max_model_len)
    prepared = endpoint.prepare(req, state.tokenizer, max_model_len)

    gens: list[Generation] = []
    observers: list[RequestObserver] = []
    for i in range(req.n):
        request_id = new_id()
        sampling = prepared.sampling.model_copy(update={"seed": choice_seed(prepared.sampling.seed, i)})
        choice = PreparedRequest(prepared.prompt_token_ids, sampling, prepared.stop)
        observers.append(RequestObserver(request_id, model, endpoint.path, len(prepared.prompt_token_ids),
                                         sampling.max_tokens, req.stream, received_monotonic, sampling))
        gens.append(Generation(state.bus, state.tokenizer, request_id=request_id, model=model,
                               endpoint=endpoint.path, prepared=choice, stream=req.stream,
                               received_ts=received_ts, timeout_s=state.settings.request_timeout_s,
                               gap_timeout_s=state.settings.token_gap_timeout_s,
                               cache_salt=getattr(req, "cache_salt", None), include_usage=req.include_usage,
                               cached_tokens_wait_s=state.settings.cached_tokens_wait_s))
        state.answered.add(request_id)
    choices = Choices(gens, observers, on_finish=state.answered.ended)
    request.state.request_id = choices.first.request_id
    try:
        await choices.start()
    except Exception as e:
        err = e if isinstance(e, APIError) else APIError(
            503, f"The message bus is unavailable: {type(e).__name__}: {e}", code="bus_unavailable",
            headers={"Retry-After": "1"})
        choices.disconnect()
        choices.finish(err.status, err.message)
        state.bus.spawn(choices.close())
        raise err from e

    fmt = endpoint.formatter(choices.first.request_id, model, req.include_usage,
                             token_text(state.tokenizer, prepared))
    headers = {REQUEST_ID_HEADER: choices.first.request_id}
    if req.n > 1:
        headers[CHOICE_REQUEST_IDS_HEADER] = ",".join(g.request_id for g in gens)
    if req.stream:
        return GenerationStream(event_stream(choices, fmt, request, event_ids=wants_event_ids(request)),
                                choices, headers={**headers, "Cache-Control": "no-cache"})
    try:
        with observers[0].current():
            body = await collect(choices, fmt, request)
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED_REQUEST, headers=headers)
    return JSONResponse(body.model_dump(mode="json"), headers=headers)


class _Unobserved:
    """A resumed stream is not a new request: no span, no request metrics."""

    def finish(self, **_: Any) -> None:
        return None


async def resume(request: Request, raw_id: str) -> Response:
    """The SSE stream of the request `raw_id` names (bare, `cmpl-…` or `chatcmpl-…`) from after output
    token `Last-Event-ID` (header, or the `last_event_id` query parameter; 0 = from the start), with `id:`
    lines. 400 on a malformed Last-Event-ID, 404 for an unknown or unresumable request (see
    `pdserve.gateway.resume`)."""
    state: GatewayState = request.app.state.gateway
    request_id = parse_request_id(raw_id)
    raw = request.headers.get("last-event-id") or request.query_params.get("last_event_id") or "0"
    raw = raw.strip()
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 12:
        raise invalid_request(f"Last-Event-ID must be a token count, got {raw[:40]!r}.",
                              param="Last-Event-ID")
    last = int(raw)
    gen = await ResumedGeneration.open(state.bus, state.tokenizer, state.db, request_id, last,
                                       timeout_s=state.settings.request_timeout_s,
                                       gap_timeout_s=state.settings.token_gap_timeout_s,
                                       cached_tokens_wait_s=state.settings.cached_tokens_wait_s)
    endpoint = CHAT if gen.received.endpoint == CHAT.path else COMPLETIONS
    fmt = endpoint.formatter(request_id, gen.model, gen.include_usage,
                             token_text(state.tokenizer, gen.prepared))
    choices = Choices([gen], [_Unobserved()])
    await choices.start()  # nothing to submit: the request runs already
    return GenerationStream(event_stream(choices, fmt, request, opening=last == 0, event_ids=True), choices,
                            headers={REQUEST_ID_HEADER: request_id, "Cache-Control": "no-cache"})


def token_text(tokenizer: Tokenizer, prepared: PreparedRequest) -> Callable[[int], str] | None:
    """A token id's string for logprobs (the decode of that one id, as vLLM returns it); None when the
    request did not ask for logprobs."""
    if prepared.sampling.logprobs is None:
        return None
    return lambda token_id: tokenizer.decode([token_id])


async def parse(request: Request, endpoint: Endpoint, max_body_bytes: int,
                key: ApiKey | None = None) -> CompletionRequest | ChatCompletionRequest:
    """The request body as the endpoint's model. The body is read as JSON whatever its content type
    (curl's default form type included); over `max_body_bytes`, or over the API key's own
    `max_request_bytes` when smaller, it is a 413, a syntax error, a non-object, text that is no valid
    Unicode or a field error is a 400."""
    limit, whose = max_body_bytes, ""
    if key is not None and key.limits.max_request_bytes is not None and key.limits.max_request_bytes < limit:
        limit, whose = key.limits.max_request_bytes, f" (the limit of API key {key.name!r})"
    raw = bytearray()
    async for part in request.stream():
        raw += part
        if len(raw) > limit:
            raise APIError(413, f"The request body exceeds {limit} bytes{whose}.", code="request_too_large")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise invalid_request(f"Malformed JSON body: {e}", code="json_invalid") from e
    if not isinstance(body, dict):
        raise invalid_request("The request body must be a JSON object.", code="json_invalid")
    check_text(body)
    try:
        return endpoint.request_type.model_validate(body)
    except ValidationError as e:
        raise api_error_from_validation(e.errors(include_url=False)) from e


def check_text(value: Any, path: str = "") -> None:
    """Raise `APIError` 400 (`invalid_text`) for a string anywhere in `value` that is no valid Unicode
    text (a lone surrogate: it has no UTF-8 form, so nothing downstream can tokenize or store it)."""
    stack: list[tuple[Any, str]] = [(value, path)]
    while stack:
        v, where = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise invalid_request(f"{where or 'body'}: the string is no valid Unicode (lone surrogate).",
                                      param=where or None, code="invalid_text") from None
        elif isinstance(v, dict):
            for k, item in v.items():
                stack.append((k, where))
                stack.append((item, f"{where}.{k}" if where else str(k)))
        elif isinstance(v, list):
            stack.extend((item, f"{where}.{i}") for i, item in enumerate(v))

"""Every 4xx/5xx the gateway answers, in OpenAI's error shape.

Shape (OpenAI API reference, "Error codes"): `{"error": {"message": str, "type": str, "param": str | null,
"code": str | null}}`. Types: `invalid_request_error` for 4xx, `server_error` for 5xx. Validation errors are
400, as OpenAI and vLLM answer them (FastAPI's default 422 is overridden). Once the gateway has assigned a
request id, the error carries it in `X-Request-Id` too (`request.state.request_id`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.bus import RejectedError
from pdserve.messages import RejectCode

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = "X-Request-Id"
INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"


class APIError(Exception):
    """An HTTP error to send in OpenAI's shape: `status` (HTTP code), `message` (for people), `type`,
    `code` (stable, for programs), `param` (the offending request field, dotted), `headers` (e.g.
    Retry-After)."""

    def __init__(self, status: int, message: str, *, type: str | None = None, code: str | None = None,
                 param: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or (INVALID_REQUEST if status < 500 else SERVER_ERROR)
        self.code = code
        self.param = param
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid_request(message: str, *, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, code=code, param=param)


def model_not_found(model: str) -> APIError:
    """OpenAI's answer to an unknown model: 404, code `model_not_found`."""
    return APIError(404, f"The model `{model}` does not exist.", code="model_not_found", param="model")


def context_length_exceeded(max_model_len: int, prompt_tokens: int, max_tokens: int, param: str) -> APIError:
    """Prompt + completion over the context (message wording: OpenAI's and vLLM's)."""
    return invalid_request(
        f"This model's maximum context length is {max_model_len} tokens. However, you requested "
        f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, {max_tokens} in the "
        f"completion). Please reduce the length of the prompt or completion.",
        param=param, code="context_length_exceeded",
    )


def api_error_from_validation(errors: Iterable[Mapping[str, Any]]) -> APIError:
    """A 400 from pydantic/FastAPI error dicts (`loc`, `msg`, `type`). `param` is the first error's
    location inside the body, dotted (`messages.0.role`); a JSON syntax error gets code `json_invalid`."""
    errors = list(errors)
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", first.get("msg", ""))
        return invalid_request(f"Malformed JSON body: {detail}", code="json_invalid")
    messages = []
    for err in errors:
        loc = _param(err.get("loc", ()))
        msg = str(err.get("msg", "")).removeprefix("Value error, ")
        messages.append(f"{loc}: {msg}" if loc else msg)
    return invalid_request("; ".join(messages), param=_param(first.get("loc", ())))


def _param(loc: Iterable[Any]) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) or None


def from_rejection(e: RejectedError) -> APIError:
    """The HTTP answer to a coordinator's typed refusal of a Submit. CAPACITY is 503 + Retry-After
    (the client should come back); INVALID is the client's fault (400); the rest are server-side."""
    if e.code in (RejectCode.CAPACITY, RejectCode.UNAVAILABLE):
        return APIError(503, f"No capacity to serve the request now: {e.message}", code="capacity",
                        headers={"Retry-After": "1"})
    if e.code is RejectCode.NO_WORKERS:
        return APIError(503, f"No worker can serve the request: {e.message}", code="no_workers",
                        headers={"Retry-After": "5"})
    if e.code is RejectCode.INVALID:
        return invalid_request(e.message, code="rejected")
    if e.code is RejectCode.TRANSFER_FAILED:
        return APIError(502, f"KV cache transfer failed: {e.message}", code=e.code.value)
    return APIError(500, f"The request was refused ({e.code.value}): {e.message}", code=e.code.value)


def error_response(err: APIError, request_id: str | None = None) -> JSONResponse:
    headers = dict(err.headers)
    if request_id:
        headers[REQUEST_ID_HEADER] = request_id
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    """Route every error FastAPI or Starlette can raise through `error_response`."""

    def request_id(request: Request) -> str | None:
        return getattr(request.state, "request_id", None)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc, request_id(request))

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(api_error_from_validation(exc.errors()), request_id(request))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = APIError(exc.status_code, str(exc.detail), headers=exc.headers)
        return error_response(err, request_id(request))

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        err = APIError(500, f"Internal error: {type(exc).__name__}: {exc}", code="internal_error")
        return error_response(err, request_id(request))

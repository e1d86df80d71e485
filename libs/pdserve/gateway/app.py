"""The gateway's FastAPI app: the OpenAI-compatible HTTP edge of pdserve (docs/architecture.md §3, step 1).

Routes: POST /v1/completions, POST /v1/chat/completions (stream or not), GET /v1/models[/{model}],
GET /v1/requests/{request_id} (a request's lifecycle from the event store), GET
/v1/requests/{request_id}/stream (resume an SSE stream after `Last-Event-ID`), GET /health, GET /metrics.
Every /v1 route takes OpenAI's `Authorization: Bearer <key>` when keys are required
(`pdserve.gateway.keys`), and then counts against the key's rate limit (`pdserve.gateway.rate_limits`);
/health, /metrics and /openapi.json are open. Build it with
`create_app(bus, tokenizer, settings, db)`; the service (`pdserve.services.gateway`) serves it with
uvicorn.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy.ext.asyncio import AsyncEngine

from pdserve.bus import Bus
from pdserve.config import GatewaySettings
from pdserve.gateway.capacity import WorkerCapacity
from pdserve.gateway.errors import APIError, install_error_handlers, model_not_found
from pdserve.gateway.keys import KeyCheck, keys_required
from pdserve.gateway.lifecycle_read import Answered, read_lifecycle
from pdserve.gateway.openapi import document_bodies
from pdserve.gateway.prompt import Tokenizer
from pdserve.gateway.rate_limits import RateLimits
from pdserve.gateway.serving import CHAT, COMPLETIONS, generate, resume


@dataclass
class GatewayState:
    bus: Bus
    tokenizer: Tokenizer
    settings: GatewaySettings
    db: AsyncEngine | None
    created: int = field(default_factory=lambda: int(time.time()))
    capacity: WorkerCapacity = field(init=False)
    answered: Answered = field(default_factory=Answered)

    def __post_init__(self) -> None:
        self.capacity = WorkerCapacity(self.bus)


def create_app(bus: Bus, tokenizer: Tokenizer, settings: GatewaySettings,
               db: AsyncEngine | None) -> FastAPI:
    """The gateway app. `db` (the event store, read only) may be None: /v1/requests then answers 503."""
    app = FastAPI(title="pdserve gateway", description="OpenAI-compatible API of pdserve.")
    app.state.gateway = GatewayState(bus, tokenizer, settings, db)
    install_error_handlers(app)
    required = keys_required(settings.api_keys, settings.host)
    keys = KeyCheck(db, settings.api_key_cache_s) if required else None
    rate_limits = RateLimits()

    async def authorized(request: Request) -> None:
        """Every /v1 route: 401 unless `Authorization: Bearer <live key>` when keys are required, then 429
        when that key's rate limit is reached; the key (`request.state.api_key`) also bounds the body."""
        request.state.api_key = None
        if keys is not None:
            key = await keys.check(request.headers.get("authorization"))
            request.state.api_key = key
            rate_limits.admit(key)

    v1 = [Depends(authorized)]

    @app.post(COMPLETIONS.path, openapi_extra=document_bodies(COMPLETIONS.request_type), dependencies=v1)
    async def completions(request: Request) -> Response:
        return await generate(request, COMPLETIONS)

    @app.post(CHAT.path, openapi_extra=document_bodies(CHAT.request_type), dependencies=v1)
    async def chat_completions(request: Request) -> Response:
        return await generate(request, CHAT)

    @app.get("/v1/models", dependencies=v1)
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [await model_card(app.state.gateway)]}

    @app.get("/v1/models/{model:path}", dependencies=v1)
    async def retrieve_model(model: str) -> dict[str, Any]:
        state: GatewayState = app.state.gateway
        if model != state.settings.served_model_name:
            raise model_not_found(model)
        return await model_card(state)

    @app.get("/v1/requests/{request_id}", dependencies=v1)
    async def request_lifecycle(request_id: str) -> dict[str, Any]:
        state: GatewayState = app.state.gateway
        return await read_lifecycle(state.bus, state.db, state.answered, request_id,
                                    state.settings.read_your_writes_wait_s)

    @app.get("/v1/requests/{request_id}/stream", dependencies=v1)
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


async def model_card(state: GatewayState) -> dict[str, Any]:
    """OpenAI's model object, plus vLLM's `max_model_len`: the configured one, capped by the KV capacity
    of the decode workers heard (`pdserve.gateway.capacity`)."""
    s = state.settings
    await state.capacity.ensure_listening()
    return {"id": s.served_model_name, "object": "model", "created": state.created, "owned_by": "pdserve",
            "root": s.model, "max_model_len": state.capacity.max_model_len(s.max_model_len)}

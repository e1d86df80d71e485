"""The HTTP floor under a streamed completion: a bare FastAPI app whose `POST /v1/completions` reads the JSON
body and streams (StreamingResponse, text/event-stream) one OpenAI completion chunk at once, then the usage
chunk and `[DONE]`. No validation, tokenizer, bus or model: what the client measures as its TTFT here is
the cost of the client, the connection, uvicorn, FastAPI and the event loop, which every request through
the gateway pays too. benchmarks/control_plane.py subtracts it.

Served the way services/gateway runs the gateway: `uvicorn.Server(uvicorn.Config(app, log_config=None,
access_log=False))` under `asyncio.run`, in a process of its own:

    python -c "from pdserve.bench.sse_floor import main; main()" PORT
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse


def _sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def create_app() -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "floor", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> StreamingResponse:
        body = await request.json()
        prompt = body.get("prompt") or []

        async def stream() -> AsyncIterator[bytes]:
            yield _sse({"id": "cmpl-floor", "object": "text_completion", "model": "floor",
                        "choices": [{"index": 0, "text": "x", "finish_reason": None}]})
            yield _sse({"id": "cmpl-floor", "object": "text_completion", "model": "floor", "choices": [],
                        "usage": {"prompt_tokens": len(prompt), "completion_tokens": 1,
                                  "total_tokens": len(prompt) + 1}})
            yield _sse("[DONE]")

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


async def serve(port: int, host: str = "127.0.0.1") -> None:
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(create_app(), host=host, port=port, log_config=None,
                                           access_log=False, timeout_graceful_shutdown=10))
    await server.serve()


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    asyncio.run(serve(int(args[0])))

"""What the gateway's integration tests share: the gateway against real NATS (and Postgres), with a scripted
coordinator in place of the real one.

The coordinator double serves `Submit` and `Abort` on its own connection, replies `Accepted` (or refuses),
and publishes the `TokenChunk`s (and lifecycle events) a test scripts: in order, shuffled, repeated, with a
hole, or ending in an error. Requests go through the ASGI app in process (httpx) and, for the official
`openai` client and client disconnects, through a real uvicorn server (`server_url`). The fixtures are
registered for tests/integration by its conftest.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import httpx
import pytest
import uvicorn
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdserve.bus import Bus, RejectedError
from pdserve.config import CommonSettings, GatewaySettings
from pdserve.embedded import free_port
from pdserve.engine.tokenizer import load_tokenizer
from pdserve.events import Payload
from pdserve.gateway.app import create_app
from pdserve.lifecycle.receipt import store_received
from pdserve.messages import Abort, Accepted, Ack, FinishReason, Submit, TokenChunk
from pdserve.store.queries import make_db

MODEL = "SmolLM2-135M-Instruct"
ANSWER = " Paris is the capital and largest city of France."

# A script turns the accepted Submit into what the coordinator publishes: chunks, lifecycle events of the
# request (a `Payload`, emitted as the service that would), and pauses (seconds).
Script = Callable[[Submit], list[TokenChunk | Payload | float]]


@dataclass
class ScriptedCoordinator:
    bus: Bus
    script: Script | None = None
    reject: RejectedError | None = None
    submits: list[Submit] = field(default_factory=list)
    aborts: list[Abort] = field(default_factory=list)
    submit_trace_ids: list[int] = field(default_factory=list)
    playing: set[asyncio.Task] = field(default_factory=set)

    async def serve(self) -> None:
        await self.bus.serve(self.bus.subjects.submit, Submit, self.submit)
        await self.bus.serve(self.bus.subjects.abort, Abort, self.abort)

    async def submit(self, req: Submit) -> Accepted:
        self.submits.append(req)
        self.submit_trace_ids.append(trace.get_current_span().get_span_context().trace_id)
        if self.reject is not None:
            raise self.reject
        await store_received(self.bus, req)  # as the coordinator does before it accepts
        if self.script is not None:
            task = asyncio.create_task(self.play(req.request_id, self.script(req)))
            self.playing.add(task)
            task.add_done_callback(self.playing.discard)
        return Accepted(request_id=req.request_id)

    async def play(self, request_id: str, items: list[TokenChunk | Payload | float]) -> None:
        for item in items:
            if isinstance(item, TokenChunk):
                await self.bus.publish(self.bus.subjects.tokens(item.request_id), item)
            elif isinstance(item, Payload):
                await self.bus.emit_stored(request_id, item)
            else:
                await asyncio.sleep(item)

    async def abort(self, req: Abort) -> Ack:
        self.aborts.append(req)
        return Ack()

    async def abort_of(self, request_id: str, timeout_s: float = 5.0) -> Abort:
        async with asyncio.timeout(timeout_s):
            while True:
                for a in self.aborts:
                    if a.request_id == request_id:
                        return a
                await asyncio.sleep(0.02)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("tiny")


@pytest.fixture(scope="module")
def spans() -> InMemorySpanExporter:
    """Finished spans of this process (an SDK provider is installed unless one already is)."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


@pytest.fixture(scope="module")
def gw_settings(settings: CommonSettings) -> GatewaySettings:
    return GatewaySettings(**settings.model_dump(), model="tiny", served_model_name=MODEL, max_model_len=256,
                           request_timeout_s=20.0, token_gap_timeout_s=0.5,
                           cached_tokens_wait_s=0.05, read_your_writes_wait_s=5.0)


@pytest.fixture(scope="module")
async def bus(settings: CommonSettings, spans) -> AsyncIterator[Bus]:
    b = await Bus.connect(settings, "gateway")
    yield b
    await b.close()


@pytest.fixture(scope="module")
async def coordinator(settings: CommonSettings) -> AsyncIterator[ScriptedCoordinator]:
    b = await Bus.connect(settings, "coordinator")
    c = ScriptedCoordinator(b)
    await c.serve()
    yield c
    for task in list(c.playing):
        task.cancel()
    await b.close()


@pytest.fixture
def coord(coordinator: ScriptedCoordinator) -> ScriptedCoordinator:
    coordinator.script, coordinator.reject = None, None
    return coordinator


@pytest.fixture(scope="module")
async def db(database_url: str):
    e = make_db(database_url)
    yield e
    await e.dispose()


@pytest.fixture(scope="module")
def app(bus, tokenizer, gw_settings, db):
    return create_app(bus, tokenizer, gw_settings, db)


@pytest.fixture
async def client(app) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://gateway",
                                 timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
async def server_url(app) -> AsyncIterator[str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None))
    server.capture_signals = contextlib.nullcontext  # the test process keeps its own signal handlers
    task = asyncio.create_task(server.serve())
    async with asyncio.timeout(10):
        while not server.started:
            await asyncio.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    await task


# ------------------------------------------------------------------ scripts


def in_order(ids: list[int], per_chunk: int = 3, finish: FinishReason = FinishReason.LENGTH) -> Script:
    def script(req: Submit) -> list[TokenChunk | float]:
        chunks: list[TokenChunk | float] = [
            TokenChunk(request_id=req.request_id, index=i, token_ids=tuple(ids[i:i + per_chunk]))
            for i in range(0, len(ids), per_chunk)
        ]
        chunks.append(TokenChunk(request_id=req.request_id, index=len(ids), finish_reason=finish))
        return chunks
    return script


def shuffled_with_repeats(ids: list[int], finish: FinishReason = FinishReason.STOP) -> Script:
    """Chunks of 2 tokens sent as: 1, 0, 0 again, 3, 2 plus 3 overlapping, end, 2 again."""
    def script(req: Submit) -> list[TokenChunk | float]:
        rid = req.request_id
        c = [TokenChunk(request_id=rid, index=i, token_ids=tuple(ids[i:i + 2])) for i in range(0, 8, 2)]
        tail = TokenChunk(request_id=rid, index=8, token_ids=tuple(ids[8:]), finish_reason=finish)
        overlap = TokenChunk(request_id=rid, index=4, token_ids=tuple(ids[4:8]))
        return [c[1], c[0], c[0], c[3], overlap, tail, c[2], c[2]]
    return script


def answer_ids(tokenizer) -> list[int]:
    ids = tokenizer.encode(ANSWER)
    assert len(ids) >= 10
    return ids


def sse_events(text: str) -> list[dict | str]:
    events: list[dict | str] = []
    for block in text.split("\n\n"):
        if not block:
            continue
        if block.startswith("id: "):  # the resume position (output tokens so far); checked elsewhere
            block = block.split("\n", 1)[1]
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events



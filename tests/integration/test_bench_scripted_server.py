"""The load generator end to end against a real HTTP SSE server that streams on a scripted timeline:
the measured TTFT, ITL, TPOT, E2EL and goodput must be the script's (within scheduling jitter)."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pdserve.bench.datasets import SampleRequest, shared_prefix_dataset
from pdserve.bench.metrics import calculate_metrics
from pdserve.bench.report import ServeReport, write_report
from pdserve.bench.runner import LoadSpec, run_load

# prompt length → (delay before the first chunk, gaps between the following chunks, completion tokens).
# Short prompts: fast first token, even 50 ms gaps. Long prompts: slow first token, uneven gaps, and one
# chunk carrying two tokens (usage says 4 tokens over 3 chunks).
SCRIPTS = {4: (0.10, [0.05, 0.05, 0.05], 4), 6: (0.60, [0.04, 0.30], 4)}
JITTER_S = 0.04  # event-loop and HTTP scheduling on a shared 2-core machine; the SLOs are far from it


def scripted_app() -> FastAPI:
    app = FastAPI()
    app.state.seen = 0

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "scripted", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        app.state.seen += 1
        rid = f"req-{app.state.seen}"
        if body.get("model") != "scripted" or not body.get("stream") or not body.get("ignore_eos"):
            return JSONResponse({"error": {"message": "unexpected body"}}, status_code=400)
        if len(body["prompt"]) not in SCRIPTS:
            return JSONResponse({"error": {"message": "no script"}}, status_code=500,
                                headers={"X-Request-Id": rid})
        first_s, gaps, tokens = SCRIPTS[len(body["prompt"])]

        async def events() -> AsyncIterator[str]:
            await asyncio.sleep(first_s)
            for i in range(len(gaps) + 1):
                if i:
                    await asyncio.sleep(gaps[i - 1])
                yield "data: " + json.dumps({"choices": [{"index": 0, "text": f"t{i}"}]}) + "\n\n"
            yield ": keep-alive comment\n\n"
            yield "data: " + json.dumps({"choices": [], "usage": {"prompt_tokens": len(body["prompt"]),
                                                                 "completion_tokens": tokens}}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers={"X-Request-Id": rid})

    return app


@pytest.fixture
async def scripted_server() -> AsyncIterator[str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(scripted_app(), log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    await task
    sock.close()


async def test_metrics_match_the_scripted_timeline(scripted_server, tmp_path):
    samples = [SampleRequest([1000] * 4, 4), SampleRequest([1000] * 6, 4), SampleRequest([1000] * 4, 4),
               SampleRequest([1000] * 5, 4)]  # the last has no script: the server answers 500
    result = await run_load(scripted_server, samples, LoadSpec(request_rate=float("inf")), progress=False)
    fast, slow, fast2, failed = result.records

    for r in (fast, fast2):
        assert r.ttft_s == pytest.approx(0.10, abs=JITTER_S)
        assert r.itls_s == pytest.approx([0.05] * 3, abs=JITTER_S)
        assert r.e2el_s == pytest.approx(0.25, abs=JITTER_S)
        assert r.tpot_s == pytest.approx(0.05, abs=JITTER_S)
        assert r.text == "t0t1t2t3" and r.request_id.startswith("req-")
    assert slow.ttft_s == pytest.approx(0.60, abs=JITTER_S)
    assert slow.itls_s == pytest.approx([0.04, 0.30], abs=JITTER_S)
    assert slow.num_output_tokens == 4  # usage, not the 3 chunks
    assert slow.tpot_s == pytest.approx(0.34 / 3, abs=JITTER_S)
    assert not failed.success and failed.error.startswith("HTTP 500") and failed.request_id

    # TTFT SLO 350 ms: the two short prompts meet it; TPOT 80 ms: the long prompt (113 ms) misses it anyway.
    m = calculate_metrics(result.records, result.duration_s, [50, 99], {"ttft": 350, "tpot": 80})
    assert (m.completed, m.failed, m.total_output, m.total_input) == (3, 1, 12, 14)
    assert result.duration_s == pytest.approx(0.94, abs=2 * JITTER_S)  # the slow request's last chunk
    assert m.request_goodput == pytest.approx(2 / result.duration_s)
    assert m.latency["itl"].count == 3 + 2 + 3
    assert m.latency["ttft"].median_ms == pytest.approx(100, abs=1000 * JITTER_S)
    assert m.max_concurrent_requests == 3

    paths = write_report(ServeReport({"dataset": "scripted", "request_rate": "inf"}, m, result.records),
                         tmp_path, "scripted")
    assert json.loads(paths[0].read_text())["metrics"]["completed"] == 3
    assert "inter_chunk_latency" in paths[1].read_text() and paths[2].stat().st_size > 10_000


async def test_requests_are_sent_at_the_arrival_times_and_a_concurrency_cap_queues_them(scripted_server):
    samples = [SampleRequest([1000] * 4, 4) for _ in range(4)]
    paced = await run_load(scripted_server, samples, LoadSpec(request_rate=4.0, burstiness=float("inf")),
                           progress=False)
    starts = [r.start_s - paced.records[0].start_s for r in paced.records]
    assert starts == pytest.approx([0.0, 0.25, 0.5, 0.75], abs=JITTER_S)

    capped = await run_load(scripted_server, samples, LoadSpec(max_concurrency=1), progress=False)
    for prev, nxt in zip(capped.records, capped.records[1:], strict=False):
        assert nxt.start_s >= prev.chunk_times_s[-1]
    assert capped.records[-1].ttft_s == pytest.approx(0.10, abs=JITTER_S)  # TTFT counts from its own send


async def test_a_conversation_turn_is_sent_only_after_the_previous_turn_finished(scripted_server):
    samples = shared_prefix_dataset(num_conversations=2, num_turns=2, system_prompt_len=3, question_len=1,
                                    output_len=1, num_prefixes=1)
    assert [s.prompt_len for s in samples] == [4, 4, 6, 6]  # both turns have a script
    result = await run_load(scripted_server, samples, LoadSpec(), progress=False)
    first, _, second, _ = result.records
    assert second.success and second.start_s >= first.chunk_times_s[-1]

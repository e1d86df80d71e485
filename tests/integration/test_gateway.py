"""The gateway against real NATS, with a scripted coordinator in place of the real one
(tests/integration/gateway_harness.py): answers, streams, errors, bad input, logprobs."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from pdserve.bus import Bus, RejectedError
from pdserve.config import CommonSettings, RecorderSettings
from pdserve.gateway.app import create_app
from pdserve.messages import FinishReason, RejectCode, Submit, TokenChunk, TokenLogprobs
from pdserve.store.recorder import Recorder, caught_up
from tests.integration.gateway_harness import (
    ANSWER,
    MODEL,
    Script,
    answer_ids,
    in_order,
    shuffled_with_repeats,
    sse_events,
)

# ------------------------------------------------------------------ non-streamed


async def test_completion_returns_the_decoded_tokens_with_usage_and_request_id(client, coord, tokenizer):
    ids = answer_ids(tokenizer)
    coord.script = in_order(ids)
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "The capital of France is",
                                                   "max_tokens": len(ids), "temperature": 0, "seed": 7})
    assert r.status_code == 200, r.text
    rid = r.headers["x-request-id"]
    body = r.json()
    assert body["id"] == f"cmpl-{rid}" and body["object"] == "text_completion" and body["model"] == MODEL
    assert body["choices"] == [{"index": 0, "text": ANSWER, "logprobs": None, "finish_reason": "length"}]
    prompt_ids = tokenizer.encode("The capital of France is")
    assert body["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids),
                             "total_tokens": len(prompt_ids) + len(ids),
                             "prompt_tokens_details": {"cached_tokens": 0}}
    submit = next(s for s in coord.submits if s.request_id == rid)
    assert list(submit.prompt_token_ids) == prompt_ids
    sampling = submit.sampling
    assert (sampling.max_tokens, sampling.temperature, sampling.seed) == (len(ids), 0.0, 7)
    assert set(tokenizer.stop_token_ids) <= set(submit.sampling.stop_token_ids)


async def test_chat_reorders_shuffled_chunks_and_drops_repeats(client, coord, tokenizer):
    ids = answer_ids(tokenizer)
    coord.script = shuffled_with_repeats(ids)
    r = await client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "Capital of France?"}], "max_tokens": 50})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"] == f"chatcmpl-{r.headers['x-request-id']}" and body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": ANSWER}
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == len(ids)
    assert isinstance(body["created"], int)


async def test_stop_string_truncates_the_text_and_aborts_the_request(client, coord, tokenizer):
    ids = answer_ids(tokenizer)
    coord.script = in_order(ids + ids, per_chunk=4)  # more than the stop string lets through
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Q:", "max_tokens": 100,
                                                   "stop": ["largest", "zzz"]})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == " Paris is the capital and " and choice["finish_reason"] == "stop"
    consumed = r.json()["usage"]["completion_tokens"]
    assert tokenizer.decode(ids[:consumed]).endswith("largest") and consumed < len(ids)
    abort = await coord.abort_of(r.headers["x-request-id"])
    assert abort.finish_reason is FinishReason.STOP


async def test_error_chunk_is_a_500_with_the_reason(client, coord, tokenizer):
    def script(req: Submit) -> list[TokenChunk | float]:
        return [TokenChunk(request_id=req.request_id, index=0, token_ids=(5, 6)),
                TokenChunk(request_id=req.request_id, index=0, error="decode: worker decode-1 lost")]
    coord.script = script
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
    assert r.status_code == 500
    error = r.json()["error"]
    assert "worker decode-1 lost" in error["message"] and error["type"] == "server_error"
    assert r.headers["x-request-id"] == coord.submits[-1].request_id


async def test_capacity_refusal_is_a_503_with_retry_after(client, coord):
    coord.reject = RejectedError(RejectCode.CAPACITY, "decode pool full")
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
    assert r.status_code == 503 and r.headers["retry-after"]
    assert "decode pool full" in r.json()["error"]["message"]
    assert r.headers["x-request-id"] == coord.submits[-1].request_id


async def test_invalid_refusal_is_a_400(client, coord):
    coord.reject = RejectedError(RejectCode.INVALID, "sampling not supported by the engine")
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
    assert r.status_code == 400 and "not supported by the engine" in r.json()["error"]["message"]


async def test_missing_coordinator_is_a_503(settings, bus, tokenizer, gw_settings):
    lonely = CommonSettings(**{**settings.model_dump(), "subject_prefix": settings.subject_prefix + "x",
                               "events_stream": settings.events_stream + "_X"})
    b = await Bus.connect(lonely, "gateway")
    try:
        app = create_app(b, tokenizer, gw_settings, None)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://gw") as c:
            r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "coordinator_unavailable"
        assert "x-request-id" in r.headers
    finally:
        await b.close()
        await bus.js.delete_stream(lonely.events_stream)


async def test_no_tokens_within_the_request_timeout_is_a_504_and_aborts(bus, coord, tokenizer, gw_settings):
    coord.script = lambda req: []  # accepted, then silence
    app = create_app(bus, tokenizer, gw_settings.model_copy(update={"request_timeout_s": 0.5}), None)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://gw") as c:
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
    abort = await coord.abort_of(r.headers["x-request-id"])
    assert abort.reason == "request timeout" and abort.finish_reason is None


async def test_a_hole_in_the_token_stream_fails_the_request_and_aborts(client, coord):
    def script(req: Submit) -> list[TokenChunk | float]:
        rid = req.request_id
        return [TokenChunk(request_id=rid, index=0, token_ids=(5, 6)),
                TokenChunk(request_id=rid, index=4, token_ids=(9,), finish_reason=FinishReason.LENGTH)]
    coord.script = script
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
    assert r.status_code == 502 and r.json()["error"]["code"] == "token_stream_gap"
    assert (await coord.abort_of(r.headers["x-request-id"])).reason == "token stream gap"


async def complete_five_tokens(bus, tokenizer, gw_settings, db, gap_timeout_s: float) -> httpx.Response:
    """A 5-token completion through a gateway with this token gap timeout, whose scripted stream is tokens
    5, 6, 7, 8, 9 with a hole the journal fills: answered 200 with their text."""
    settings = gw_settings.model_copy(update={"token_gap_timeout_s": gap_timeout_s})
    app = create_app(bus, tokenizer, settings, db)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://gw") as c:
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 5})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == tokenizer.decode([5, 6, 7, 8, 9])
    return r


async def test_chunks_lost_on_core_nats_are_filled_from_the_journal(bus, coord, tokenizer, gw_settings, db):
    """A NATS server of a cluster dying drops the chunks in flight through it: the gateway reads the
    request's TokensCommitted (and terminal event) from JetStream instead of failing on the hole."""
    from pdserve.events import RequestCompleted, TokensCommitted, TTFTBreakdown

    ttft = TTFTBreakdown(queue_s=0, route_s=0, reserve_s=0, prefill_s=0, exposed_transfer_s=0,
                         first_token_s=0, ttft_s=0)

    def script(req: Submit) -> list:
        rid = req.request_id
        return [TokenChunk(request_id=rid, index=0, token_ids=(5, 6)),
                TokensCommitted(start_index=0, token_ids=[5, 6, 7, 8]),  # chunk (7, 8) lost on the way
                TokenChunk(request_id=rid, index=4, token_ids=(9,)),
                # the last chunk lost too: nothing is ahead of a hole, the silence sends the gateway to read
                RequestCompleted(finish_reason=FinishReason.LENGTH, prompt_tokens=1, completion_tokens=5,
                                 ttft=ttft, e2e_s=0.1)]
    coord.script = script
    r = await complete_five_tokens(bus, tokenizer, gw_settings, db, gap_timeout_s=3.0)
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert coord.aborts == [] or all(a.request_id != r.headers["x-request-id"] for a in coord.aborts)


async def test_a_journal_unreadable_for_longer_than_the_gap_timeout_still_fills_the_hole(
    bus, coord, tokenizer, gw_settings, db, monkeypatch
):
    """JetStream electing a stream's new leader (4-9 s after a NATS server dies) cannot be read: the gap
    timeout starts again after each failed read, so the hole is filled once the journal answers."""
    from nats.errors import TimeoutError as NatsTimeout

    from pdserve.events import TokensCommitted
    from pdserve.gateway import generation

    unreadable_until = asyncio.get_running_loop().time() + 3.5  # > 2 gap timeouts, < the request timeout
    reads = {"failed": 0}
    real_read = generation.request_events

    async def leaderless_read(b, request_id, event_type="*"):
        if asyncio.get_running_loop().time() < unreadable_until:
            reads["failed"] += 1
            raise NatsTimeout
        return await real_read(b, request_id, event_type)

    monkeypatch.setattr(generation, "request_events", leaderless_read)

    def script(req: Submit) -> list:
        rid = req.request_id
        return [TokenChunk(request_id=rid, index=0, token_ids=(5, 6)),
                TokensCommitted(start_index=0, token_ids=[5, 6, 7, 8]),  # chunk (7, 8) lost on the way
                TokenChunk(request_id=rid, index=4, token_ids=(9,), finish_reason=FinishReason.LENGTH)]
    coord.script = script
    await complete_five_tokens(bus, tokenizer, gw_settings, db, gap_timeout_s=1.5)
    assert reads["failed"] >= 2  # the hole outlived two gap timeouts' worth of failed reads


# ------------------------------------------------------------------ streamed


async def test_streamed_chat_opens_with_the_role_and_ends_with_usage_and_done(client, coord, tokenizer):
    ids = answer_ids(tokenizer)
    coord.script = shuffled_with_repeats(ids, finish=FinishReason.LENGTH)
    r = await client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "Capital of France?"}], "max_tokens": 50,
        "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    rid = r.headers["x-request-id"]
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["id"] == f"chatcmpl-{rid}" and c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == ANSWER
    assert chunks[-2]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(ids)
    assert all(c["usage"] is None for c in chunks[:-1])


async def test_streamed_completion_stops_at_the_stop_string_and_aborts(client, coord, tokenizer):
    ids = answer_ids(tokenizer)
    coord.script = in_order(ids + ids, per_chunk=1)
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Q:", "max_tokens": 100,
                                                   "stream": True, "stop": "city"})
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    assert "usage" not in events[0]
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == " Paris is the capital and largest "
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert (await coord.abort_of(r.headers["x-request-id"])).finish_reason is FinishReason.STOP


async def test_streamed_error_is_an_error_event_then_done(client, coord):
    def script(req: Submit) -> list[TokenChunk | float]:
        return [TokenChunk(request_id=req.request_id, index=0, token_ids=(5,)),
                TokenChunk(request_id=req.request_id, index=0, error="prefill: timed out")]
    coord.script = script
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "stream": True})
    assert r.status_code == 200
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    assert "prefill: timed out" in events[-2]["error"]["message"]
    assert set(events[-2]["error"]) == {"message", "type", "param", "code"}


async def test_streamed_request_refused_before_the_stream_gets_a_plain_http_error(client, coord):
    coord.reject = RejectedError(RejectCode.CAPACITY, "full")
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "stream": True})
    assert r.status_code == 503 and r.json()["error"]["code"] == "capacity"


# ------------------------------------------------------------------ bad input, other endpoints


@pytest.mark.parametrize(("path", "content", "status", "code"), [
    ("/v1/completions", b'{"model": "x", "prompt": ', 400, "json_invalid"),
    ("/v1/completions", b"[1, 2]", 400, "json_invalid"),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": []}).encode(), 400, None),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": [{"role": 3}]}).encode(), 400, None),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 0}).encode(), 400, None),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "temperature": "x"}).encode(), 400, None),
    ("/v1/completions", json.dumps({"model": "gpt-4", "prompt": "hi"}).encode(), 404, "model_not_found"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi " * 300}).encode(), 400,
     "context_length_exceeded"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 300}).encode(), 400,
     "context_length_exceeded"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": [1, 10**9]}).encode(), 400, None),
    ("/v1/nothing", b"{}", 404, None),
])
async def test_bad_input_gets_an_openai_error_and_the_gateway_keeps_serving(
        client, coord, tokenizer, path, content, status, code):
    before = len(coord.submits)
    r = await client.post(path, content=content, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code is not None:
        assert error["code"] == code
    assert len(coord.submits) == before  # nothing reached the coordinator
    coord.script = in_order(answer_ids(tokenizer))
    ok = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 20})
    assert ok.status_code == 200


async def test_models_lists_the_served_model_and_unknown_ones_are_404(client):
    r = await client.get("/v1/models")
    assert [m["id"] for m in r.json()["data"]] == [MODEL] and r.json()["object"] == "list"
    assert (await client.get(f"/v1/models/{MODEL}")).json()["max_model_len"] == 256
    r = await client.get("/v1/models/gpt-4")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


async def test_health_is_ok_while_nats_is_connected_and_metrics_count_requests(client, coord, tokenizer):
    assert (await client.get("/health")).status_code == 200
    coord.script = in_order(answer_ids(tokenizer))
    assert (await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})).status_code == 200
    metrics = (await client.get("/metrics")).text
    assert f'pdserve:request_success_total{{finished_reason="length",model="{MODEL}"}}' in metrics
    assert "pdserve:time_to_first_token_seconds_bucket" in metrics


async def test_request_span_carries_usage_and_is_the_parent_of_the_coordinators_work(
        client, coord, tokenizer, spans):
    ids = answer_ids(tokenizer)
    coord.script = in_order(ids)
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 20})
    rid = r.headers["x-request-id"]
    span = next(s for s in spans.get_finished_spans()
                if s.name == "gateway.request" and s.attributes["pdserve.request_id"] == rid)
    assert span.attributes["gen_ai.request.model"] == MODEL
    assert span.attributes["gen_ai.usage.output_tokens"] == len(ids)
    assert span.attributes["gen_ai.usage.input_tokens"] == len(tokenizer.encode("hi"))
    index = [s.request_id for s in coord.submits].index(rid)
    assert coord.submit_trace_ids[index] == span.context.trace_id


async def test_lifecycle_endpoint_reads_the_recorded_events(client, coord, tokenizer, bus, db, settings):
    coord.script = in_order(answer_ids(tokenizer))
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
    rid = r.headers["x-request-id"]
    coord.reject = RejectedError(RejectCode.CAPACITY, "decode pool full")
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
    refused = r.headers["x-request-id"]
    stop = asyncio.Event()
    task = asyncio.create_task(Recorder(bus, db, RecorderSettings(**settings.model_dump())).run(stop))
    try:
        async with asyncio.timeout(20):
            while not await caught_up(bus):
                await asyncio.sleep(0.05)
    finally:
        stop.set()
        await task
    r = await client.get(f"/v1/requests/{rid}")
    assert r.status_code == 200, r.text
    received = [e for e in r.json()["events"] if e["type"] == "RequestReceived"]
    assert received and received[0]["payload"]["endpoint"] == "/v1/completions"
    assert received[0]["service"] == "coordinator"  # stored from the Submit's receipt
    r = await client.get(f"/v1/requests/{refused}")
    assert [e["type"] for e in r.json()["events"]] == ["RequestReceived", "RequestFailed"]
    assert r.json()["events"][1]["payload"]["phase"] == "submit"
    missing = await client.get("/v1/requests/0190a0b0-0000-7000-8000-000000000000")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "request_not_found"


async def test_lifecycle_endpoint_without_an_event_store_is_a_503(bus, tokenizer, gw_settings):
    app = create_app(bus, tokenizer, gw_settings, None)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://gw") as c:
        r = await c.get("/v1/requests/whatever")
    assert r.status_code == 503


# ------------------------------------------------------------------ real server: openai client, disconnects


async def test_openai_client_reads_a_completion_and_a_chat_stream(server_url, coord, tokenizer):
    ids = answer_ids(tokenizer)
    client = openai.AsyncOpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0)
    coord.script = in_order(ids)
    completion = await client.completions.create(model=MODEL, prompt="The capital of France is",
                                                 max_tokens=len(ids))
    assert completion.choices[0].text == ANSWER and completion.usage.completion_tokens == len(ids)

    coord.script = shuffled_with_repeats(ids)
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Capital of France?"}], max_tokens=50,
        stream=True, stream_options={"include_usage": True})
    parts, finish, usage = [], None, None
    async for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        usage = chunk.usage or usage
    assert "".join(parts) == ANSWER and finish == "stop" and usage.completion_tokens == len(ids)
    await client.close()


async def test_openai_client_raises_the_streamed_error(server_url, coord):
    def script(req: Submit) -> list[TokenChunk | float]:
        return [TokenChunk(request_id=req.request_id, index=0, error="decode: out of KV blocks")]
    coord.script = script
    client = openai.AsyncOpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0)
    stream = await client.completions.create(model=MODEL, prompt="hi", stream=True)
    with pytest.raises(openai.APIError, match="out of KV blocks"):
        async for _ in stream:
            pass
    await client.close()


def endless(ids: list[int]) -> Script:
    """A few tokens, then nothing for longer than any test waits."""
    return lambda req: [TokenChunk(request_id=req.request_id, index=0, token_ids=tuple(ids[:3])), 30.0]


async def test_client_leaving_a_stream_aborts_the_request(server_url, coord, tokenizer):
    coord.script = endless(answer_ids(tokenizer))
    async with httpx.AsyncClient(timeout=10) as c:
        async with c.stream("POST", f"{server_url}/v1/completions",
                            json={"model": MODEL, "prompt": "hi", "stream": True}) as r:
            rid = r.headers["x-request-id"]
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    break  # first token seen: hang up
    abort = await coord.abort_of(rid)
    assert abort.reason == "client disconnected"


async def test_client_leaving_a_non_streamed_request_aborts_it(server_url, coord, tokenizer):
    coord.script = endless(answer_ids(tokenizer))
    before = len(coord.submits)
    async with httpx.AsyncClient(timeout=httpx.Timeout(10, read=1.0)) as c:
        with pytest.raises(httpx.ReadTimeout):
            await c.post(f"{server_url}/v1/completions", json={"model": MODEL, "prompt": "hi"})
    rid = coord.submits[before].request_id
    abort = await coord.abort_of(rid)
    assert abort.reason == "client disconnected"


# ------------------------------------------------------------------ logprobs


def with_logprobs(ids: list[int], per_chunk: int = 3) -> Script:
    """Chunks of `ids` carrying made-up logprobs: token i has logprob -i/10 and tops (i, -i/10), (0, -9)."""
    def entry(i: int) -> TokenLogprobs:
        return TokenLogprobs(token_id=ids[i], logprob=-i / 10, top=((ids[i], -i / 10), (0, -9.0)))

    def script(req: Submit) -> list[TokenChunk | float]:
        assert req.sampling.logprobs is not None
        chunks: list[TokenChunk | float] = [
            TokenChunk(request_id=req.request_id, index=i, token_ids=tuple(ids[i:i + per_chunk]),
                       logprobs=tuple(entry(j) for j in range(i, min(i + per_chunk, len(ids)))))
            for i in range(0, len(ids), per_chunk)
        ]
        chunks.append(TokenChunk(request_id=req.request_id, index=len(ids),
                                 finish_reason=FinishReason.LENGTH))
        return chunks

    return script


@pytest.mark.parametrize("stream", [False, True])
async def test_completion_logprobs_give_each_token_its_string_logprob_top_and_offset(
        client, coord, tokenizer, stream):
    ids = answer_ids(tokenizer)
    coord.script = with_logprobs(ids)
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Q:", "max_tokens": len(ids),
                                                   "logprobs": 1, "stream": stream})
    assert r.status_code == 200, r.text
    rid = r.headers["x-request-id"]
    assert next(s for s in coord.submits if s.request_id == rid).sampling.logprobs == 1
    if stream:
        parts = [c["choices"][0] for c in sse_events(r.text)[:-1] if c["choices"][0]["logprobs"]]
        lp = {k: [x for p in parts for x in p["logprobs"][k]] for k in parts[0]["logprobs"]}
        text = "".join(p["text"] for p in parts)
    else:
        choice = r.json()["choices"][0]
        lp, text = choice["logprobs"], choice["text"]
    assert text == ANSWER
    tokens = [tokenizer.decode([t]) for t in ids]
    assert lp["tokens"] == tokens
    assert lp["token_logprobs"] == pytest.approx([-i / 10 for i in range(len(ids))])
    assert lp["top_logprobs"][3] == {tokens[3]: pytest.approx(-0.3), tokenizer.decode([0]): -9.0}
    # each token's text starts where the text of the tokens before it ends
    assert lp["text_offset"] == [len(tokenizer.decode(ids[:i])) for i in range(len(ids))]


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_logprobs_give_content_entries_with_bytes_and_top_logprobs(
        client, coord, tokenizer, stream):
    ids = answer_ids(tokenizer)
    coord.script = with_logprobs(ids)
    r = await client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "Capital of France?"}], "max_tokens": 50,
        "logprobs": True, "top_logprobs": 2, "stream": stream})
    assert r.status_code == 200, r.text
    if stream:
        content = [x for c in sse_events(r.text)[:-1] if c["choices"] and c["choices"][0]["logprobs"]
                   for x in c["choices"][0]["logprobs"]["content"]]
    else:
        content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == len(ids)
    first = content[1]
    token = tokenizer.decode([ids[1]])
    assert first == {"token": token, "logprob": pytest.approx(-0.1), "bytes": list(token.encode()),
                     "top_logprobs": [
                         {"token": token, "logprob": pytest.approx(-0.1), "bytes": list(token.encode())},
                         {"token": tokenizer.decode([0]), "logprob": -9.0,
                          "bytes": list(tokenizer.decode([0]).encode())}]}


async def test_chat_top_logprobs_above_five_is_a_400(client, coord):
    r = await client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 6})
    assert r.status_code == 400
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}

"""OpenAI API completeness at the gateway, against real NATS and Postgres with the scripted coordinator
(tests/integration/gateway_harness.py): SSE framing, cached_tokens, n > 1, read-your-writes, id forms,
resumed-stream numbering, what the workers can hold."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from pdserve.bench.client import send_completion
from pdserve.bench.datasets import SampleRequest
from pdserve.bus import Bus
from pdserve.config import CommonSettings, RecorderSettings
from pdserve.events import PrefillCompleted, RequestCompleted, TokensCommitted, TTFTBreakdown
from pdserve.gateway.app import create_app
from pdserve.messages import CompatibilityDescriptor, FinishReason, Heartbeat, Role, Submit, TokenChunk
from pdserve.store.recorder import Recorder, caught_up
from tests.integration.gateway_harness import ANSWER, MODEL, Script, answer_ids, in_order, sse_events

CACHED = 32


def prefilled(ids: list[int], cached: int = CACHED, per_chunk: int = 1, journal: bool = False) -> Script:
    """What a real stack publishes: PrefillCompleted (with `cached` prompt tokens from the prefix cache),
    one chunk per `per_chunk` tokens, the finishing chunk; with `journal`, also the TokensCommitted
    events of every 16 tokens and RequestCompleted, as the decode worker and coordinator record them."""
    def script(req: Submit) -> list:
        n = len(req.prompt_token_ids)
        hit = min(cached, n)
        items: list = [PrefillCompleted(prefill_worker_id="prefill-0", transfer_id="t", first_token_id=ids[0],
                                        num_cached_tokens=hit, num_computed_tokens=n - hit, kv_bytes=0,
                                        prefill_s=0.01)]
        rid = req.request_id
        items += [TokenChunk(request_id=rid, index=i, token_ids=tuple(ids[i:i + per_chunk]))
                  for i in range(0, len(ids), per_chunk)]
        items.append(TokenChunk(request_id=rid, index=len(ids), finish_reason=FinishReason.LENGTH))
        if journal:
            items += [TokensCommitted(start_index=i, token_ids=ids[i:i + 16]) for i in range(0, len(ids), 16)]
            items.append(RequestCompleted(
                finish_reason=FinishReason.LENGTH, prompt_tokens=n, completion_tokens=len(ids), e2e_s=0.1,
                ttft=TTFTBreakdown(queue_s=0, route_s=0, reserve_s=0, prefill_s=0, exposed_transfer_s=0,
                                   first_token_s=0, ttft_s=0.01)))
        return items
    return script


def long_prompt(tokenizer) -> str:
    text = "The quick brown fox jumps over the lazy dog. " * 8
    assert len(tokenizer.encode(text)) > CACHED
    return text


# ------------------------------------------------------------------ SSE framing


async def test_streams_are_data_lines_only_unless_event_ids_are_asked_for(client, coord, tokenizer):
    ids = answer_ids(tokenizer)
    body = {"model": MODEL, "prompt": "Q:", "max_tokens": len(ids), "stream": True,
            "stream_options": {"include_usage": True}}
    coord.script = in_order(ids, per_chunk=4)
    r = await client.post("/v1/completions", json=body)
    lines = [line for line in r.text.split("\n") if line]
    assert lines and all(line.startswith("data: ") for line in lines), lines[:3]
    assert r.text.count("\n\n") == len(lines)  # one line per event, as vllm bench serve parses them

    coord.script = in_order(ids, per_chunk=4)
    r = await client.post("/v1/completions", json=body, headers={"X-PDS-Event-Ids": "true"})
    blocks = [b for b in r.text.split("\n\n") if b]
    assert all(b.startswith("id: ") for b in blocks[:-1]) and blocks[-1] == "data: [DONE]"
    text_ids = [int(b.split("\n")[0][4:]) for b in blocks[:-2]]
    assert text_ids == list(range(1, len(ids) + 1)) + [len(ids)]  # one event per token, then the finish


async def test_pdserves_bench_client_reads_the_stream(server_url, coord, tokenizer):
    ids = answer_ids(tokenizer)
    coord.script = in_order(ids)
    async with httpx.AsyncClient(timeout=30) as c:
        sample = SampleRequest(prompt=tokenizer.encode("Q:"), output_len=len(ids))
        record = await send_completion(c, f"{server_url}/v1/completions", 0, sample, MODEL)
    assert record.success, record.error
    assert record.text == ANSWER and record.output_tokens == len(ids)
    assert len(record.chunk_times_s) == len(ids) + 1  # a chunk per token, and the finishing one


async def test_a_resumed_stream_numbers_its_events_as_the_live_stream_did(client, coord, tokenizer):
    ids = (answer_ids(tokenizer) * 4)[:40]  # 3 journal commits: 16 + 16 + 8 tokens
    coord.script = prefilled(ids, journal=True)
    live = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Q:", "max_tokens": 40,
                                                      "stream": True}, headers={"X-PDS-Event-Ids": "1"})
    rid = live.headers["x-request-id"]
    await asyncio.sleep(0.3)  # the journal events are stored
    resumed = await client.get(f"/v1/requests/chatcmpl-{rid}/stream", headers={"Last-Event-ID": "0"})
    assert resumed.status_code == 200, resumed.text

    def numbered(text: str) -> list[tuple[int, list]]:
        blocks = [b.split("\n") for b in text.split("\n\n") if b.startswith("id:")]
        return [(int(b[0][4:]), json.loads(b[1][6:])["choices"]) for b in blocks]
    assert numbered(resumed.text) == numbered(live.text)
    later = await client.get(f"/v1/requests/{rid}/stream", headers={"Last-Event-ID": "17"})
    events = sse_events(later.text)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == tokenizer.decode(ids)[
        len(tokenizer.decode(ids[:17])):]


# ------------------------------------------------------------------ cached_tokens


async def test_cached_tokens_reach_usage_through_the_openai_client(server_url, coord, tokenizer):
    ids = answer_ids(tokenizer)
    client = openai.AsyncOpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0)
    coord.script = prefilled(ids)
    completion = await client.completions.create(model=MODEL, prompt=long_prompt(tokenizer),
                                                 max_tokens=len(ids))
    assert completion.usage.prompt_tokens_details.cached_tokens == CACHED

    coord.script = prefilled(ids)
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": long_prompt(tokenizer)}], max_tokens=len(ids),
        stream=True, stream_options={"include_usage": True})
    usage = None
    async for chunk in stream:
        usage = chunk.usage or usage
    assert usage.prompt_tokens_details.cached_tokens == CACHED and usage.completion_tokens == len(ids)
    await client.close()


# ------------------------------------------------------------------ n > 1


async def test_n_choices_are_requests_of_their_own_sharing_the_prompt(server_url, coord, tokenizer):
    ids = answer_ids(tokenizer)
    coord.script = prefilled(ids)
    client = openai.AsyncOpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0)
    before = len(coord.submits)
    raw = await client.completions.with_raw_response.create(model=MODEL, prompt=long_prompt(tokenizer),
                                                            max_tokens=len(ids), n=3, seed=5, temperature=1)
    completion = raw.parse()
    assert [c.index for c in completion.choices] == [0, 1, 2]
    assert all(c.text == ANSWER and c.finish_reason == "length" for c in completion.choices)
    submits = coord.submits[before:]
    assert [s.sampling.seed for s in submits] == [5, 6, 7]
    assert len({s.request_id for s in submits}) == 3 and len({s.prompt_token_ids for s in submits}) == 1
    assert raw.headers["x-pds-request-ids"].split(",") == [s.request_id for s in submits]
    assert completion.id == f"cmpl-{submits[0].request_id}"
    usage = completion.usage
    assert usage.prompt_tokens == len(submits[0].prompt_token_ids) and usage.completion_tokens == 3 * len(ids)
    assert usage.prompt_tokens_details.cached_tokens == CACHED

    coord.script = prefilled(ids)
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=len(ids), n=2, stream=True)
    texts, finishes = ["", ""], [None, None]
    async for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            finishes[c.index] = c.finish_reason or finishes[c.index]
    assert texts == [ANSWER, ANSWER] and finishes == ["length", "length"]
    await client.close()


async def test_later_choices_are_submitted_once_the_first_has_its_first_token(client, coord, tokenizer):
    ids = answer_ids(tokenizer)
    first = prefilled(ids)
    coord.script = lambda req: [0.5, *first(req)]  # choice 0's prefill takes 0.5 s
    before = len(coord.submits)
    t0 = time.monotonic()
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "n": 2, "max_tokens": 20})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2
    assert len(coord.submits) - before == 2
    # the sibling waited for choice 0's first token (0.5 s) and then took about as long itself
    assert time.monotonic() - t0 >= 1.0


# ------------------------------------------------------------------ read-your-writes, id forms


async def test_an_answered_request_is_never_404_and_every_id_form_is_accepted(
        client, coord, tokenizer, bus, db, settings):
    ids = answer_ids(tokenizer)
    coord.script = prefilled(ids, journal=True)
    r = await client.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": len(ids),
                                                        "messages": [{"role": "user", "content": "hi"}]})
    rid = r.headers["x-request-id"]
    # no recorder has run: Postgres knows nothing yet, JetStream has every event
    got = await client.get(f"/v1/requests/{rid}")
    assert got.status_code == 200, got.text
    assert got.json()["request"]["state"] == "completed"
    assert [e["seq"] for e in got.json()["events"]] == list(range(1, len(got.json()["events"]) + 1))

    coord.script = prefilled(ids, journal=True)
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": len(ids)})
    rid2 = r.headers["x-request-id"]
    stop = asyncio.Event()
    recorder = RecorderSettings(**{**settings.model_dump(), "linger_s": 1.0})
    task = asyncio.create_task(Recorder(bus, db, recorder).run(stop))
    try:
        for form in (rid2, f"cmpl-{rid2}", f"chatcmpl-{rid2}"):
            got = await client.get(f"/v1/requests/{form}")
            assert got.status_code == 200, (form, got.text)
            assert got.json()["request"]["state"] == "completed"
            assert got.json()["events"][-1]["type"] == "RequestCompleted"
        async with asyncio.timeout(20):
            while not await caught_up(bus):
                await asyncio.sleep(0.05)
    finally:
        stop.set()
        await task
    for bad in ("not-a-uuid", "cmpl-", "a.b.>"):
        missing = await client.get(f"/v1/requests/{bad}")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "request_not_found"
        assert (await client.get(f"/v1/requests/{bad}/stream")).status_code == 404


# ------------------------------------------------------------------ what the workers can hold


def heartbeat(worker_id: str, role: Role, capacity: int) -> Heartbeat:
    descriptor = CompatibilityDescriptor(model="tiny", weights_hash="x", dtype="float32", block_size=16,
                                         num_layers=2, num_kv_heads=1, head_dim=8, hash_seed=0,
                                         layout_version=2)
    return Heartbeat(worker_id=worker_id, role=role, descriptor=descriptor, num_running=0, num_waiting=0,
                     kv_capacity_tokens=capacity, kv_free_tokens=capacity, ts=time.time())


async def test_a_request_no_decode_worker_can_hold_is_a_400_and_models_says_so(
        settings, tokenizer, gw_settings, bus):
    own = CommonSettings(**{**settings.model_dump(), "subject_prefix": settings.subject_prefix + "cap",
                            "events_stream": settings.events_stream + "_CAP"})
    b = await Bus.connect(own, "gateway")
    try:
        app = create_app(b, tokenizer, gw_settings, None)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://gw") as c:
            assert (await c.get("/v1/models")).json()["data"][0]["max_model_len"] == 256  # none heard yet
            await b.publish(b.subjects.heartbeat("decode-0"), heartbeat("decode-0", Role.DECODE, 64))
            await b.publish(b.subjects.heartbeat("prefill-0"), heartbeat("prefill-0", Role.PREFILL, 4096))
            await b.nc.flush()
            await asyncio.sleep(0.2)
            assert (await c.get(f"/v1/models/{MODEL}")).json()["max_model_len"] == 64
            r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 100})
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
            error = r.json()["error"]
            assert error["type"] == "invalid_request_error" and "64 tokens" in error["message"]
    finally:
        await b.close()
        await bus.js.delete_stream(own.events_stream)


# ------------------------------------------------------------------ malformed text


@pytest.mark.parametrize(("path", "content", "param"), [
    ("/v1/completions", b'{"prompt": "a\\ud800b"}', "prompt"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "messages.0.content"),
    ("/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud83d"}]}]}',
     "messages.0.content.0.text"),
    ("/v1/completions", b'{"prompt": "hi", "stop": ["\\u0000"]}', "stop"),
    ("/v1/completions", b'{"prompt": "hi", "cache_salt": "a\\u0000"}', "cache_salt"),
    ("/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": [{"type": "text", "text": {"a": [1]}}]}]}', None),
    ("/v1/completions", b'{"prompt": [[1, 2], [3]]}', "prompt"),
    ("/v1/completions", b'{"prompt": {"text": "hi"}}', "prompt"),
    ("/v1/completions", b'{"prompt": "hi", "seed": 18446744073709551616}', "seed"),
    ("/v1/completions", ("[" * 100_000).encode(), None),
])
async def test_malformed_text_and_types_are_400s(client, coord, path, content, param):
    before = len(coord.submits)
    r = await client.post(path, content=content, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"].startswith(param), error
    assert len(coord.submits) == before


async def test_huge_prompts_are_refused_before_tokenizing_and_huge_bodies_are_413(client, coord, gw_settings):
    t0 = time.monotonic()
    r = await client.post("/v1/completions", json={"prompt": "x" * (256 * 128 + 1)})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert time.monotonic() - t0 < 1.0
    huge = b'{"prompt": "' + b"x" * gw_settings.max_body_bytes + b'"}'
    r = await client.post("/v1/completions", content=huge)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


async def test_a_vanishing_temperature_is_greedy(client, coord, tokenizer):
    coord.script = in_order(answer_ids(tokenizer))
    r = await client.post("/v1/completions", json={"prompt": "hi", "temperature": 1e-300})
    assert r.status_code == 200
    submit = next(s for s in coord.submits if s.request_id == r.headers["x-request-id"])
    assert submit.sampling.temperature == 0


def test_openapi_documents_the_request_bodies(app):
    spec = app.openapi()
    schema = spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert "messages" in schema["schema"]["properties"] and "$ref" not in json.dumps(schema)

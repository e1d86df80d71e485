"""Concurrent streamed load for fault tests, and the checks every fault test makes.

Each request streams (SSE) greedy tokens with `ignore_eos`, so its output is exactly `max_tokens` tokens
that one process without any transfer computes too (`tests.oracle.greedy`). A client whose stream
breaks (the gateway died) resumes it with `GET /v1/requests/{id}/stream` and `Last-Event-ID`.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx

from pdserve.events import TERMINAL_TYPES
from pdserve.lifecycle.journal import committed_tokens

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = [
    "The capital of France is",
    "1, 2, 3, 4,",
    "Once upon a time",
    "def fibonacci(n):",
    "The quick brown fox jumps over",
    "In the beginning",
    "Water boils at",
    "My favourite colour is",
]
LIFECYCLE = (
    "RequestReceived",
    "RequestRouted",
    "DecodeReserved",
    "PrefillStarted",
    "PrefillCompleted",
    "TransferCompleted",
    "DecodeStarted",
    "TokensCommitted",
    "RequestCompleted",
)


def lifecycle_of(events: list) -> tuple[str, ...]:
    """The event types a completed request must have. A request the router placed `local` has no
    transfer: that is the router's fallback when no prefill worker was heard from for a liveness window
    (`heartbeat_timeout_s`), which a loaded 2-core machine can cause during a fault (the request is still
    served, by the decode worker's own prefill)."""
    routed = [e for e in events if e.type == "RequestRouted"]
    if routed and routed[-1].payload["mode"] == "local":
        return tuple(t for t in LIFECYCLE if t != "TransferCompleted")
    return LIFECYCLE


@dataclass
class Result:
    prompt: str
    request_id: str = ""
    text: str = ""
    num_chunks: int = 0
    finish_reason: str | None = None
    error: str | None = None
    resumes: int = 0
    last_event_id: str | None = None
    status: int = 0
    retry_after: str | None = None  # the Retry-After header of a refusal (503)
    tokens_seen: int = 0  # SSE ids: output tokens consumed so far
    events: list = field(default_factory=list)


def _consume(resp: httpx.Response, result: Result, progress: Callable[[Result], None]) -> bool:
    """Read one SSE response into `result`; True when `[DONE]` arrived."""
    event_id = None
    for line in resp.iter_lines():
        if line.startswith("id:"):
            event_id = line[3:].strip()
        elif line.startswith("data:"):
            data = line[5:].strip()
            if data == "[DONE]":
                return True
            body = json.loads(data)
            if event_id is not None:
                result.last_event_id = event_id
                result.tokens_seen = int(event_id)
            if "error" in body:
                result.error = body["error"]["message"]
                continue
            for choice in body.get("choices", []):
                result.text += choice.get("text") or ""
                result.finish_reason = choice.get("finish_reason") or result.finish_reason
            result.num_chunks += 1
            progress(result)
    return False


def stream_one(
    url: str,
    prompt: str,
    max_tokens: int,
    progress: Callable[[Result], None],
    resume_deadline_s: float = 60.0,
) -> Result:
    """One streamed completion; if the connection breaks before `[DONE]`, resume from the last SSE id
    (against whatever gateway answers at `url` by then) until done or `resume_deadline_s` passes."""
    result = Result(prompt)
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    try:
        # SSE ids (the resume position) are opted into: OpenAI's framing has none
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120,
                          headers={"X-PDS-Event-Ids": "true"}) as resp:
            result.status = resp.status_code
            result.request_id = resp.headers.get("x-request-id", "")
            if resp.status_code != 200:
                result.error = resp.read().decode()
                result.retry_after = resp.headers.get("retry-after")
                return result
            if _consume(resp, result, progress):
                return result
    except httpx.HTTPError as e:
        result.error = f"stream broke: {e!r}"
    deadline = time.monotonic() + resume_deadline_s
    while time.monotonic() < deadline and result.request_id:
        time.sleep(0.5)
        headers = {"Last-Event-ID": result.last_event_id} if result.last_event_id else {}
        try:
            with httpx.stream(
                "GET", f"{url}/v1/requests/{result.request_id}/stream", headers=headers, timeout=120
            ) as resp:
                if resp.status_code != 200:
                    continue
                result.resumes += 1
                result.error = None
                if _consume(resp, result, progress):
                    return result
        except httpx.HTTPError as e:
            result.error = f"resume broke: {e!r}"
    return result


def run_load(
    url: str,
    prompts: list[str],
    max_tokens: int,
    during: Callable[[], None] | None = None,
    min_tokens_before: int = 8,
    stagger_s: float = 0.0,
    during_at: int | None = None,
    when: Callable[[list[Result]], bool] | None = None,
) -> list[Result]:
    """Stream every prompt concurrently (starting one every `stagger_s` seconds); call `during()` (the
    fault) in this thread right after starting prompt number `during_at`, or else once every stream has
    `min_tokens_before` SSE chunks — or, given `when`, once `when(the streams that sent a chunk)` is true,
    polled every 20 ms — (or 30 s passed); return every result once all ended."""
    seen: dict[int, Result] = {}
    lock = threading.Lock()
    ready = threading.Event()

    def progress_of(i: int) -> Callable[[Result], None]:
        def progress(r: Result) -> None:
            with lock:
                seen[i] = r
                if when is None and len(seen) == len(prompts) and min(
                    x.num_chunks for x in seen.values()
                ) >= min_tokens_before:
                    ready.set()

        return progress

    def wait_ready() -> None:
        if when is None:
            ready.wait(30)
            return
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with lock:
                started = list(seen.values())
            if when(started):
                return
            time.sleep(0.02)

    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = []
        for i, p in enumerate(prompts):
            futures.append(pool.submit(stream_one, url, p, max_tokens, progress_of(i)))
            if during is not None and i == during_at:
                during()
            time.sleep(stagger_s)
        if during is not None and during_at is None:
            wait_ready()
            during()
        return [f.result() for f in futures]


_EXPECTED: dict[tuple[int, str, int], list[int]] = {}


def expected_outputs(reference, prompts: list[str], max_tokens: int) -> dict[str, list[int]]:
    """Greedy token ids per prompt from one process without transfer (the oracle), computed once per
    (model, prompt, max_tokens) in this session on one torch thread (the stack's workers hold the other
    core). `reference` is a session fixture's (model, tokenizer), so the model's id is stable."""
    import torch

    from tests import oracle

    model, tokenizer = reference
    torch.set_num_threads(1)
    for p in set(prompts):
        if (id(model), p, max_tokens) not in _EXPECTED:
            _EXPECTED[id(model), p, max_tokens] = oracle.greedy(model, tokenizer.encode(p), max_tokens)
    return {p: _EXPECTED[id(model), p, max_tokens] for p in set(prompts)}


async def recorded_lifecycles(store, request_ids: list[str], timeout_s: float = 60.0) -> dict[str, list]:
    """Each request's stored events (stream order), once every request has its terminal event published
    and the recorder has caught up (Postgres holds every event the stream holds)."""
    import asyncio

    import nats.errors

    from pdserve.store import queries
    from pdserve.store.recorder import caught_up

    engine, bus = store
    deadline = time.monotonic() + timeout_s
    while True:
        found = {rid: await queries.lifecycle(engine, rid) for rid in request_ids}
        done = all(any(e.type in TERMINAL_TYPES for e in evs) for evs in found.values())
        try:
            settled = done and await caught_up(bus)
        except nats.errors.Error:  # JetStream re-forming after a fault (503, timeout): ask again
            settled = False
        if settled or time.monotonic() > deadline:
            return {rid: await queries.lifecycle(engine, rid) for rid in request_ids}
        await asyncio.sleep(0.5)


def check_results(
    results: list[Result], expected: dict[str, list[int]], tokenizer, lifecycles: dict[str, list]
) -> None:
    """Every request ended completed; its text and its journal equal the oracle token for token, every
    commit before the terminal event; its lifecycle is complete, in order, with one terminal event."""
    for r in results:
        assert r.error is None and r.finish_reason == "length", (r.prompt, r.request_id, r.error, r.status)
        want = expected[r.prompt]
        assert r.text == tokenizer.decode(want), (r.prompt, r.request_id)
        events = lifecycles[r.request_id]
        types = [e.type for e in events]
        terminal = [t for t in types if t in TERMINAL_TYPES]
        assert terminal == ["RequestCompleted"], (r.request_id, types)
        assert all(t in types for t in lifecycle_of(events)), (r.request_id, types)
        assert types[0] == "RequestReceived", (r.request_id, types)
        assert committed_tokens(events) == want, r.request_id
        # the journal is whole when the log says the request ended (a migrated-from worker cut off
        # mid-stream may still commit after it, late: those repeat indices already held)
        end = types.index("RequestCompleted")
        assert committed_tokens(events[:end]) == want, (r.request_id, types)
        assert [e.seq for e in events] == list(range(1, len(events) + 1))

"""Faults of the KV transfer path on a real disaggregated stack (tiny model): bytes corrupted in flight,
clients that go away in each phase, requests that end at their first token, and the bounded admission
queue. Every worker's free KV is read from its heartbeats (`kv_free_tokens`)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import httpx
import nats
import pytest
import torch

from pdserve.config import CommonSettings
from pdserve.engine.loader import load_model
from pdserve.engine.model import LlamaModel
from pdserve.messages import Heartbeat, Subjects
from pdserve.service_plan import ServiceSpec
from tests import oracle
from tests.e2e.stack import Stack
from tests.faults.corrupting_worker import EVERY_N_ENV

pytestmark = [pytest.mark.faults, pytest.mark.stack]

MODEL = "SmolLM2-135M-Instruct"
DECODE_CAPACITY_TOKENS = 2048
# A reservation holds the prompt's blocks (decoding grows it): the filler's prompt leaves less free than
# the waiting request's prompt needs, and it decodes long enough for the test to act meanwhile.
FILLER_PROMPT_TOKENS, FILLER_MAX_TOKENS = 1000, 1000
WAITER_PROMPT_TOKENS = 1400  # of another word: it shares no prefix with the filler
STACK_ENV = {
    # Every 2nd transfer the prefill worker sends gets a flipped byte: the 1st of a request is corrupted,
    # its retransfer (the 2nd) is clean (`TransferFaultStack.module`).
    EVERY_N_ENV: "2",
    "PDS_KV_CAPACITY_TOKENS": str(DECODE_CAPACITY_TOKENS),
    "PDS_MAX_WAITING_REQUESTS": "1",
    "PDS_MAX_PREFILL_ATTEMPTS": "3",
}
PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "def fibonacci(n):", "Once upon a time " * 5]


class TransferFaultStack(Stack):
    """A `Stack` whose services all start with `STACK_ENV` on top (only workers / the coordinator read
    the variables that concern them), and whose prefill workers corrupt KV in flight
    (`tests.faults.corrupting_worker`)."""

    def env(self, spec: ServiceSpec) -> dict[str, str]:
        return {**super().env(spec), **STACK_ENV}

    def module(self, spec: ServiceSpec) -> str:
        return "tests.faults.corrupting_worker" if spec.role == "prefill" else super().module(spec)


class FreeKV:
    """The latest `kv_free_tokens` of every worker, from heartbeats, read on a thread of its own."""

    def __init__(self, settings: CommonSettings) -> None:
        self.settings = settings
        self.free: dict[str, int] = {}
        self.seen: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def start(self) -> FreeKV:
        self._thread.start()
        deadline = time.monotonic() + 20
        while len(self.free) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        return self

    async def _run(self) -> None:
        nc = await nats.connect(self.settings.nats_url)

        async def on_beat(msg) -> None:
            beat = Heartbeat.model_validate_json(msg.data)
            self.free[beat.worker_id] = beat.kv_free_tokens
            self.seen[beat.worker_id] = time.monotonic()

        await nc.subscribe(Subjects(self.settings.subject_prefix).heartbeat(), cb=on_beat)
        while not self._stop.is_set():
            await asyncio.sleep(0.1)
        await nc.close()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def wait_back_to(self, start: dict[str, int], timeout_s: float = 20.0) -> dict[str, int]:
        """Wait until every worker reports at least its `start` free tokens in a heartbeat sent after this
        call began; returns the last values seen (the caller asserts)."""
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        while time.monotonic() < deadline:
            fresh = all(self.seen.get(w, 0) > t0 for w in start)
            if fresh and all(self.free.get(w, -1) >= n for w, n in start.items()):
                break
            time.sleep(0.2)
        return dict(self.free)


@pytest.fixture(scope="module")
def stack(isolated_settings, tmp_path_factory) -> Iterator[Stack]:
    s = TransferFaultStack(isolated_settings("xferfaults"), tmp_path_factory.mktemp("xfer-stack"))
    try:
        yield s.start()
    finally:
        s.stop()


@pytest.fixture(scope="module")
def free_kv(stack) -> Iterator[FreeKV]:
    watcher = FreeKV(stack.settings).start()
    yield watcher
    watcher.stop()


@pytest.fixture(scope="module")
def greedy(settings) -> dict[str, str]:
    """prompt → the greedy text of 4 tokens from one process with no transfer."""
    loaded = load_model("tiny", settings.var_dir / "weights")
    model = LlamaModel(loaded.config, loaded.weights)
    torch.manual_seed(0)
    tok = loaded.tokenizer
    return {p: tok.decode(oracle.greedy(model, tok.encode(p), 4)) for p in PROMPTS}


def complete(url: str, prompt: str, max_tokens: int, timeout_s: float = 60.0) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=timeout_s, json={
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})


def event_types(url: str, request_id: str, until: str, timeout_s: float = 20.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    types: list[str] = []
    while time.monotonic() < deadline:
        r = httpx.get(f"{url}/v1/requests/{request_id}")
        if r.status_code == 200:
            types = [e["type"] for e in r.json()["events"]]
            if until in types:
                return types
        time.sleep(0.2)
    raise AssertionError(f"{until} of {request_id} not recorded in {timeout_s} s; saw {types}")


@pytest.fixture(scope="module")
def long_prompt(settings):
    """(n, word) → a prompt of exactly n tokens of the served tokenizer, `word` repeated."""
    tokenizer = load_model("tiny", settings.var_dir / "weights").tokenizer

    def make(n: int, word: str = " hello") -> list[int]:
        ids = tokenizer.encode(word * n)[:n]
        assert len(ids) == n
        return ids

    return make


class Filler:
    """A streaming request whose reservation fills the decode worker; `close()` disconnects it."""

    def __init__(self, url: str, prompt: list[int]) -> None:
        self.client = httpx.Client(timeout=60)
        self.cm = self.client.stream("POST", f"{url}/v1/completions", json={
            "model": MODEL, "prompt": prompt, "max_tokens": FILLER_MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True})
        self.response = self.cm.__enter__()
        self.lines = self.response.iter_lines()
        while not next(self.lines).startswith("data:"):  # decoding has begun: the decode worker is full
            pass

    def close(self) -> None:
        self.cm.__exit__(None, None, None)
        self.client.close()


def wait_deferred(url: str, request_id_box: list[str], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not request_id_box and time.monotonic() < deadline:
        time.sleep(0.05)
    assert request_id_box, "the waiting request never got a request id"
    event_types(url, request_id_box[0], "AdmissionDeferred", timeout_s)


def start_waiting_request(url: str, prompt: list[int], box: list[str],
                          results: list[httpx.Response | Exception],
                          client_timeout_s: float = 60.0) -> threading.Thread:
    """A request sent on a thread; its request id (from the response headers) lands in `box`."""

    def run() -> None:
        try:
            with httpx.stream("POST", f"{url}/v1/completions", timeout=client_timeout_s, json={
                    "model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0,
                    "ignore_eos": True, "stream": True}) as r:
                box.append(r.headers["x-request-id"])
                r.read()
                results.append(r)
        except Exception as e:  # the client gave up: that is the point of some tests
            results.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.slow
def test_corrupted_byte_in_flight_is_detected_every_time_and_output_stays_greedy(stack, greedy):
    ids: list[str] = []
    for trial in range(50):
        prompt = PROMPTS[trial % len(PROMPTS)]
        r = complete(stack.url, prompt, 4)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == greedy[prompt], f"trial {trial}"
        ids.append(r.headers["x-request-id"])
    for request_id in ids:
        types = event_types(stack.url, request_id, "RequestCompleted")
        assert types.count("ChecksumMismatch") == 1, (request_id, types)
        assert types.count("TransferCompleted") == 1, (request_id, types)
        # The corrupted transfer was never admitted: decode starts after the verified retransfer.
        order = [types.index(t) for t in ("ChecksumMismatch", "TransferCompleted", "DecodeStarted")]
        assert order == sorted(order), types


def test_requests_ending_at_their_first_token_release_everything_on_both_sides(stack, free_kv):
    start = free_kv.wait_back_to(dict(free_kv.free))
    for prompt in PROMPTS * 3:
        r = complete(stack.url, prompt, 1)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 1
    assert free_kv.wait_back_to(start) == start


def test_submit_past_the_admission_bound_gets_503_with_retry_after(stack, free_kv, long_prompt):
    start = free_kv.wait_back_to(dict(free_kv.free))
    filler = Filler(stack.url, long_prompt(FILLER_PROMPT_TOKENS))
    box: list[str] = []
    results: list = []
    try:
        waiter = start_waiting_request(stack.url, long_prompt(WAITER_PROMPT_TOKENS, " world"), box, results)
        wait_deferred(stack.url, box)
        r = complete(stack.url, "one too many", 4, timeout_s=10)
        assert r.status_code == 503, r.text
        assert int(r.headers["retry-after"]) >= 1
    finally:
        filler.close()
    waiter.join(60)
    assert isinstance(results[0], httpx.Response) and results[0].status_code == 200
    assert free_kv.wait_back_to(start) == start


def test_client_disconnect_in_each_phase_returns_every_block(stack, free_kv, long_prompt):
    start = free_kv.wait_back_to(dict(free_kv.free))
    # Admission: gone while waiting for decode capacity.
    filler = Filler(stack.url, long_prompt(FILLER_PROMPT_TOKENS))
    box: list[str] = []
    results: list = []
    try:
        waiter = start_waiting_request(stack.url, long_prompt(WAITER_PROMPT_TOKENS, " world"), box, results,
                                       client_timeout_s=1.5)
        wait_deferred(stack.url, box)
        waiter.join(10)
        assert results and isinstance(results[0], Exception)
        event_types(stack.url, box[0], "RequestAborted")
    finally:
        filler.close()  # decode: gone while tokens stream
    # Route / reserve / prefill / transfer: gone a few milliseconds in, at a different point each time
    # (1000 tokens to generate: the whole answer never comes back within the client's timeout).
    for delay_s in (0.005, 0.02, 0.05, 0.1, 0.2):
        with pytest.raises(httpx.TimeoutException):
            complete(stack.url, "Once upon a time " * 40, 1000, timeout_s=delay_s)
    assert free_kv.wait_back_to(start) == start

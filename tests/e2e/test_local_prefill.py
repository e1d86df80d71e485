"""Conditional disaggregation end to end (tiny model): the decode worker prefills a short prompt itself
(`RequestRouted.mode` 'local'), a long one goes through the prefill worker, and with no prefill worker
live every prompt is prefilled locally. Each request is served with the greedy output of one process and
none waits for a KV transfer that will never come (the reservation's lease is 60 s; the client here
gives up after 30 s).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from tests import oracle
from tests.faults.conftest import EnvStack

pytestmark = pytest.mark.stack

LOCAL_MAX_TOKENS = 64
SHORT = "The capital of France is"  # ~6 tokens: local
LONG = "The quick brown fox jumps over the lazy dog. " * 12  # ~120 tokens: past LOCAL_MAX_TOKENS
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def local_stack(isolated_settings, tmp_path_factory) -> Iterator[EnvStack]:
    stack = EnvStack(isolated_settings("localprefill"), tmp_path_factory.mktemp("local-stack"),
                     {"PDS_LOCAL_PREFILL_MAX_TOKENS": str(LOCAL_MAX_TOKENS)}, model="tiny")
    try:
        yield stack.start()
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def greedy_text(reference):
    model, tokenizer = reference

    def text(prompt: str) -> str:
        return tokenizer.decode(oracle.greedy(model, tokenizer.encode(prompt), MAX_TOKENS))

    return text


def serve(stack: EnvStack, prompt: str) -> tuple[str, str]:
    """(text, routing mode) of one greedy completion."""
    r = httpx.post(f"{stack.url}/v1/completions", timeout=30, json={
        "model": stack.served_model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True})
    assert r.status_code == 200, r.text
    rid = r.headers["x-request-id"]
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # the event log is written asynchronously
        events = httpx.get(f"{stack.url}/v1/requests/{rid}").json().get("events", [])
        modes = [e["payload"]["mode"] for e in events if e["type"] == "RequestRouted"]
        if modes and any(e["type"] == "RequestCompleted" for e in events):
            return r.json()["choices"][0]["text"], modes[-1]
        time.sleep(0.2)
    raise AssertionError(f"lifecycle of {rid} not recorded in 20 s")


def test_short_prompt_is_prefilled_by_the_decode_worker_and_a_long_one_disaggregated(
    local_stack, greedy_text
):
    assert serve(local_stack, SHORT) == (greedy_text(SHORT), "local")
    assert serve(local_stack, LONG) == (greedy_text(LONG), "disaggregated")


def test_with_no_prefill_worker_live_the_decode_worker_prefills_every_prompt(local_stack, greedy_text):
    local_stack.kill("prefill-0", sig=15)
    time.sleep(4.0)  # past the router's heartbeat timeout (3 s)
    assert serve(local_stack, LONG) == (greedy_text(LONG), "local")

"""The hybrid kimi-tiny (KDA + MLA + MoE) served by whole stacks: colocated (unified workers, no transfer)
and disaggregated (the MLA KV streamed layer-wise, the KDA state handed off whole after the prefill).

- Greedy text through either stack equals pdserve's engine alone on the same weights (`tests/oracle.py`;
  the engine alone equals HF transformers: tests/unit/test_engine_kimi_linear.py).
- The disaggregated event log reports the state beside the KV: `TransferCompleted.state_bytes` (= the
  layout's bytes per request) apart from `kv_bytes`, and `PrefillCompleted.state_bytes`.
- A prompt whose KV hit is L tokens while its latest state checkpoint is at C < L computes exactly
  prompt − C tokens, and `PrefillCompleted` says L and C.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import torch

from pdserve.config import ModelSettings
from tests import oracle
from tests.e2e.stack import Stack
from tests.e2e.test_disaggregated_tiny import poll_lifecycle

pytestmark = pytest.mark.stack

SERVED = "SmolLM2-135M-Instruct"
MAX_TOKENS = 12
PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,",
           "Once upon a time, in a small village,", "The quick brown fox jumps over the lazy dog. " * 6]
CHECKPOINT_INTERVAL = 64  # the workers' default: a state checkpoint every 4 blocks of 16


@pytest.fixture(scope="module")
def reference():
    torch.set_num_threads(1)
    return oracle.reference("kimi-tiny", ModelSettings().weights_cache_dir)


def start(isolated_settings, tmp_path_factory, mode: str) -> Iterator[Stack]:
    name = f"kimi{mode[:5]}"
    stack = Stack(isolated_settings(name), tmp_path_factory.mktemp(name), model="kimi-tiny", mode=mode)
    try:
        yield stack.start()
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def colocated(isolated_settings, tmp_path_factory, reference) -> Iterator[Stack]:
    yield from start(isolated_settings, tmp_path_factory, "colocated")


@pytest.fixture(scope="module")
def disaggregated(isolated_settings, tmp_path_factory, reference) -> Iterator[Stack]:
    yield from start(isolated_settings, tmp_path_factory, "disaggregated")


def complete(stack: Stack, prompt: str | list[int], max_tokens: int = MAX_TOKENS) -> httpx.Response:
    r = httpx.post(f"{stack.url}/v1/completions", timeout=120, json={
        "model": SERVED, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r


def assert_greedy_equals_engine_alone(stack: Stack, reference) -> None:
    loaded, model = reference
    for prompt in PROMPTS:
        expected = oracle.greedy(model, loaded.tokenizer.encode(prompt), MAX_TOKENS)
        text = complete(stack, prompt).json()["choices"][0]["text"]
        assert text == loaded.tokenizer.decode(expected), prompt


def events_of(stack: Stack, response: httpx.Response) -> dict[str, dict]:
    body = poll_lifecycle(stack.url, response.headers["x-request-id"])
    return {e["type"]: e["payload"] for e in body["events"]}


def assert_hit_pair_in_the_log(stack: Stack, reference) -> None:
    """Prompt A (100 tokens) leaves KV blocks up to 96 and a checkpoint at 64 in the prefilling worker's
    caches; B = A's first 100 tokens + 30 others hits L = 96 tokens of KV and resumes at C = 64."""
    loaded, model = reference
    a = loaded.tokenizer.encode("The history of the old harbour town, told by its fishermen. " * 12)[:100]
    assert len(a) == 100
    b = a + loaded.tokenizer.encode(" Then a storm came from the west and nobody slept." * 3)[:30]
    complete(stack, a, 2)
    r = complete(stack, b, 4)
    prefill = events_of(stack, r)["PrefillCompleted"]
    assert (prefill["num_cached_tokens"], prefill["num_checkpoint_tokens"]) == (96, CHECKPOINT_INTERVAL)
    assert prefill["num_computed_tokens"] == len(b) - CHECKPOINT_INTERVAL
    expected = oracle.greedy(model, b, 4)
    assert r.json()["choices"][0]["text"] == loaded.tokenizer.decode(expected)


def test_colocated_greedy_equals_the_engine_alone(colocated, reference) -> None:
    assert_greedy_equals_engine_alone(colocated, reference)


def test_colocated_prefix_hit_is_a_kv_length_and_a_checkpoint_length(colocated, reference) -> None:
    assert_hit_pair_in_the_log(colocated, reference)


def test_disaggregated_greedy_equals_the_engine_alone(disaggregated, reference) -> None:
    assert_greedy_equals_engine_alone(disaggregated, reference)


def test_disaggregated_log_reports_state_bytes_apart_from_kv_bytes(disaggregated, reference) -> None:
    loaded, model = reference
    layout = model.cache_spec().state
    r = complete(disaggregated, "Tell me a story about a lighthouse")
    by_type = events_of(disaggregated, r)
    transfer, prefill = by_type["TransferCompleted"], by_type["PrefillCompleted"]
    assert transfer["checksum_ok"] is True
    assert transfer["state_bytes"] == layout.bytes_per_slot(model.dtype) == prefill["state_bytes"]
    num_prompt = len(loaded.tokenizer.encode("Tell me a story about a lighthouse"))
    assert transfer["kv_bytes"] == model.cache_spec().kv_bytes_per_token(model.dtype) * num_prompt
    assert transfer["num_layers"] == model.cache_spec().num_paged_layers
    # The prefill worker streamed the first token itself: the state handoff delays the second token, not
    # the first, so the TTFT has no state part (its carve-out when it does: tests/unit/test_hybrid_serving.py)
    assert prefill["first_token_ts"] > 0
    ttft = by_type["RequestCompleted"]["ttft"]
    assert ttft["state_transfer_s"] == 0 and ttft["prefill_s"] > 0


def test_disaggregated_prefix_hit_is_a_kv_length_and_a_checkpoint_length(disaggregated, reference) -> None:
    assert_hit_pair_in_the_log(disaggregated, reference)

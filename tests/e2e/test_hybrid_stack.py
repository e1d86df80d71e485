"""The hybrid kimi-tiny (KDA + MLA + MoE) served by whole stacks: colocated (unified workers, no transfer)
and disaggregated (the MLA KV streamed layer-wise, the KDA state handed off whole after the prefill).

- Greedy text through either stack equals HF transformers' `KimiLinearForCausalLM` on the same weights:
  the 20 varied prompts × 32 tokens of tests/unit/test_engine_kimi_linear.py, four requests at a time (so
  the workers batch them and, on the system-prompt questions, hit each other's prefixes).
- A Kimi Linear directory pdserve did not generate (HF's own `save_pretrained`, another config and seed:
  `tests/foreign_kimi.py`) served by a stack started with `PDS_MODEL=<dir>` (what `make up MODEL=<dir>`
  sets) gives HF's greedy text on it.
- The disaggregated event log reports the state beside the KV: `TransferCompleted.state_bytes` (= the
  layout's bytes per request) apart from `kv_bytes`, and `PrefillCompleted.state_bytes`.
- A prompt whose KV hit is L tokens while its latest state checkpoint is at C < L computes exactly
  prompt − C tokens, and `PrefillCompleted` says L and C.
"""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
import torch

from pdserve.config import ModelSettings
from pdserve.engine.loader import build_model, load_model
from tests import oracle
from tests.e2e.stack import Stack
from tests.e2e.test_disaggregated_tiny import poll_lifecycle
from tests.foreign_kimi import save_foreign_kimi
from tests.unit.test_engine_kimi_linear import PROMPTS as VARIED_PROMPTS
from tests.unit.test_model_vs_hf import hf_greedy

pytestmark = pytest.mark.stack

SERVED = "SmolLM2-135M-Instruct"
transformers = pytest.importorskip("transformers")

MAX_TOKENS = 12
HF_TOKENS = 32  # per prompt, against HF
CHECKPOINT_INTERVAL = 64  # the workers' default: a state checkpoint every 4 blocks of 16


@pytest.fixture(scope="module")
def reference():
    torch.set_num_threads(1)
    return oracle.reference("kimi-tiny", ModelSettings().weights_cache_dir)


@pytest.fixture(scope="module")
def hf_expected(reference) -> dict[str, str]:
    """HF's greedy text of every varied prompt on kimi-tiny's weights (the directory the stack serves)."""
    loaded, _ = reference
    hf = transformers.KimiLinearForCausalLM.from_pretrained(loaded.path).eval()
    return {p: loaded.tokenizer.decode(hf_greedy(hf, loaded.tokenizer.encode(p), HF_TOKENS))
            for p in VARIED_PROMPTS}


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


def assert_greedy_equals_hf(stack: Stack, expected: dict[str, str]) -> None:
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        texts = dict(zip(expected, pool.map(
            lambda p: complete(stack, p, HF_TOKENS).json()["choices"][0]["text"], expected), strict=True))
    assert len(texts) == 20
    assert [p for p in expected if texts[p] != expected[p]] == []


def events_of(stack: Stack, response: httpx.Response) -> dict[str, dict]:
    body = poll_lifecycle(stack.url, response.headers["x-request-id"])
    return {e["type"]: e["payload"] for e in body["events"]}


def projected_row(stack: Stack, request_id: str, timeout_s: float = 20.0) -> dict:
    """The request's `requests` row once the recorder has folded its completion."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        row = httpx.get(f"{stack.url}/v1/requests/{request_id}").json()["request"]
        if row is not None and row["state"] == "completed":
            return row
        time.sleep(0.2)
    raise AssertionError(f"{request_id} not projected as completed in {timeout_s} s")


def assert_hit_pair_in_the_log(stack: Stack, reference) -> None:
    """Prompt A (100 tokens) leaves KV blocks up to 96 and a checkpoint at 64 in the prefilling worker's
    caches; B = A's first 100 tokens + 30 others hits L = 96 tokens of KV and resumes at C = 64."""
    loaded, model = reference
    a = loaded.tokenizer.encode("The history of the old harbour town, told by its fishermen. " * 12)[:100]
    assert len(a) == 100
    b = a + loaded.tokenizer.encode(" Then a storm came from the west and nobody slept." * 3)[:30]
    complete(stack, a, 2)
    r = complete(stack, b, 4)
    body = poll_lifecycle(stack.url, r.headers["x-request-id"], "RequestCompleted")
    by_type = {e["type"]: e["payload"] for e in body["events"]}
    prefill, routed = by_type["PrefillCompleted"], by_type["RequestRouted"]
    assert (prefill["num_cached_tokens"], prefill["num_checkpoint_tokens"]) == (96, CHECKPOINT_INTERVAL)
    assert prefill["num_computed_tokens"] == len(b) - CHECKPOINT_INTERVAL
    # The router predicted both lengths from the worker's KV and checkpoint events
    predicted = (routed["predicted_cached_tokens"], routed["predicted_checkpoint_tokens"])
    assert predicted == (96, CHECKPOINT_INTERVAL)
    # ... and the projection row has them (once the recorder folded the request)
    row = projected_row(stack, r.headers["x-request-id"])
    assert (row["cached_tokens"], row["checkpoint_tokens"], row["computed_tokens"]) == (
        96, CHECKPOINT_INTERVAL, len(b) - CHECKPOINT_INTERVAL)
    assert (row["predicted_cached_tokens"], row["predicted_checkpoint_tokens"]) == (96, CHECKPOINT_INTERVAL)
    # ... and `pdserve report routing` shows both
    out = subprocess.run([sys.executable, "-m", "pdserve.cli.main", "report", "routing", "--json",
                          "--database-url", stack.settings.database_url], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    report = json.loads(out)
    assert report["hybrid_requests"] >= 1 and report["checkpoint_tokens"] >= CHECKPOINT_INTERVAL
    assert report["hybrid_cached_tokens"] >= 96
    expected = oracle.greedy(model, b, 4)
    assert r.json()["choices"][0]["text"] == loaded.tokenizer.decode(expected)


def test_colocated_greedy_equals_hf_on_20_prompts(colocated, hf_expected) -> None:
    assert_greedy_equals_hf(colocated, hf_expected)


def test_colocated_prefix_hit_is_a_kv_length_and_a_checkpoint_length(colocated, reference) -> None:
    assert_hit_pair_in_the_log(colocated, reference)


def test_disaggregated_greedy_equals_hf_on_20_prompts(disaggregated, hf_expected) -> None:
    assert_greedy_equals_hf(disaggregated, hf_expected)


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
    # when each half was verified, on the decode worker's clock (one host): after the prefill started,
    # before the event saying both were
    body = poll_lifecycle(disaggregated.url, r.headers["x-request-id"])
    ts = {e["type"]: e["ts"] for e in body["events"]}
    for half in ("kv_verified_ts", "state_verified_ts"):
        assert ts["PrefillStarted"] < transfer[half] <= ts["TransferCompleted"], half
    # The prefill worker streamed the first token itself: the state handoff delays the second token, not
    # the first, so the TTFT has no state part (its carve-out when it does: tests/unit/test_hybrid_serving.py)
    assert prefill["first_token_ts"] > 0
    ttft = by_type["RequestCompleted"]["ttft"]
    assert ttft["state_transfer_s"] == 0 and ttft["prefill_s"] > 0


def test_disaggregated_prefix_hit_is_a_kv_length_and_a_checkpoint_length(disaggregated, reference) -> None:
    assert_hit_pair_in_the_log(disaggregated, reference)


# ---------------------------------------------------------------- a directory pdserve did not generate


@pytest.fixture(scope="module")
def foreign_dir(tmp_path_factory):
    return save_foreign_kimi(tmp_path_factory.mktemp("foreign-kimi"))


@pytest.fixture(scope="module")
def foreign_stack(isolated_settings, tmp_path_factory, foreign_dir) -> Iterator[Stack]:
    stack = Stack(isolated_settings("kimiforeign"), tmp_path_factory.mktemp("kimiforeign"),
                  model=str(foreign_dir), mode="disaggregated")
    try:
        yield stack.start()
    finally:
        stack.stop()


def test_a_kimi_linear_directory_saved_by_hf_is_served_by_a_stack_with_hfs_greedy_text(
    foreign_stack, foreign_dir
) -> None:
    loaded = load_model(str(foreign_dir), foreign_dir.parent)
    hf = transformers.KimiLinearForCausalLM.from_pretrained(foreign_dir).eval()
    prompts = VARIED_PROMPTS[:3] + VARIED_PROMPTS[10:13]
    for prompt in prompts:
        expected = loaded.tokenizer.decode(hf_greedy(hf, loaded.tokenizer.encode(prompt), HF_TOKENS))
        r = complete(foreign_stack, prompt, HF_TOKENS)
        assert r.json()["choices"][0]["text"] == expected, prompt
    # the stack served this directory, a hybrid, disaggregated: its state was handed off
    transfer = events_of(foreign_stack, r)["TransferCompleted"]
    assert transfer["state_bytes"] == build_model(loaded).cache_spec().state.bytes_per_slot(torch.float32)

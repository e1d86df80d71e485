"""A KDA state corrupted in flight on a real disaggregated kimi-tiny stack: its prefill worker
(`tests.faults.corrupting_worker`, target `state`) flips one byte of a state chunk of every request's first
handoff, after the checksum. The decode worker must detect it, never install that state, and fail the
transfer (TRANSFER_FAILED); the coordinator's retry then goes through clean, and the text is the engine
alone's, byte for byte. The retry recomputes the state from the prefill worker's latest checkpoint of the
prompt (the first attempt left its blocks and checkpoints cached there), not from token 0: a 100-token
prompt's retry computes exactly 100 − 64 tokens. (The per-chunk detection rate is counted at the
transport level, 60 of 60 trials: tests/integration/test_state_transfer.py.)"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import torch

from pdserve.config import ModelSettings
from pdserve.service_plan import ServiceSpec
from tests import oracle
from tests.e2e.stack import Stack
from tests.e2e.test_disaggregated_tiny import poll_lifecycle
from tests.faults.corrupting_worker import EVERY_N_ENV, TARGET_ENV

pytestmark = [pytest.mark.faults, pytest.mark.stack]

# A handoff is 2 state transfers (recurrent, conv); every 4th counts from the 1st: each request's first
# attempt has its first state tensor corrupted, its retry (transfers 3 and 4) is clean.
STACK_ENV = {EVERY_N_ENV: "4", TARGET_ENV: "state", "PDS_MAX_PREFILL_ATTEMPTS": "3"}
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
MAX_TOKENS = 10
BLOCK_SIZE, CHECKPOINT_INTERVAL = 16, 64  # the workers' defaults


class StateFaultStack(Stack):
    def env(self, spec: ServiceSpec) -> dict[str, str]:
        return {**super().env(spec), **STACK_ENV}

    def module(self, spec: ServiceSpec) -> str:
        return "tests.faults.corrupting_worker" if spec.role == "prefill" else super().module(spec)


@pytest.fixture(scope="module")
def reference():
    torch.set_num_threads(1)
    return oracle.reference("kimi-tiny", ModelSettings().weights_cache_dir)


@pytest.fixture(scope="module")
def stack(isolated_settings, tmp_path_factory, reference) -> Iterator[Stack]:
    s = StateFaultStack(isolated_settings("kimistatefault"), tmp_path_factory.mktemp("kimi-state-fault"),
                        model="kimi-tiny")
    try:
        yield s.start()
    finally:
        s.stop()


def test_a_flipped_byte_in_the_state_is_detected_and_the_output_stays_identical(stack, reference) -> None:
    loaded, model = reference
    long_prompt = loaded.tokenizer.encode("The history of the old harbour town, told by its fishermen. " * 12)
    for prompt in [*PROMPTS, long_prompt[:100]]:
        ids = loaded.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        expected = oracle.greedy(model, ids, MAX_TOKENS)
        r = httpx.post(f"{stack.url}/v1/completions", timeout=120, json={
            "model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == loaded.tokenizer.decode(expected), prompt
        events = poll_lifecycle(stack.url, r.headers["x-request-id"])["events"]
        mismatches = [e["payload"] for e in events if e["type"] == "ChecksumMismatch"]
        assert len(mismatches) == 1, mismatches
        assert ".state." in mismatches[0]["transfer_id"]  # a state tensor's, not the KV's
        transfers = [e["payload"] for e in events if e["type"] == "TransferCompleted"]
        assert len(transfers) == 1 and transfers[0]["checksum_ok"] and transfers[0]["state_bytes"] > 0
        assert sum(e["type"] == "DecodeReserved" for e in events) == 2  # the corrupted attempt, the retry
        assert sum(e["type"] == "DecodeStarted" for e in events) == 1  # admitted once: after the retry
        # The retry resumed from the latest checkpoint within its KV hit, computing prompt − C
        first, retry = [e["payload"] for e in events if e["type"] == "PrefillCompleted"]
        kv_hit = (len(ids) - 1) // BLOCK_SIZE * BLOCK_SIZE
        checkpoint = kv_hit // CHECKPOINT_INTERVAL * CHECKPOINT_INTERVAL
        assert first["num_computed_tokens"] == len(ids)
        assert (retry["num_cached_tokens"], retry["num_checkpoint_tokens"]) == (kv_hit, checkpoint)
        assert retry["num_computed_tokens"] == len(ids) - checkpoint
    assert checkpoint == CHECKPOINT_INTERVAL  # the long prompt's retry did resume from a checkpoint

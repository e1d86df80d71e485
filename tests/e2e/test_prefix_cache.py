"""Prefix caching through whole stacks (tiny model): the same request twice computes only its last prompt
token — colocated (one unified worker) and disaggregated, where the decode worker's own cache also means
only that token's KV crosses the wire — and a different `cache_salt` shares nothing."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
import torch

from pdserve.engine.loader import load_model
from tests.e2e.stack import Stack

BLOCK_SIZE = 16
PROMPT_LEN = 2 * BLOCK_SIZE + 1


@pytest.fixture(scope="module")
def colocated_stack(isolated_settings, tmp_path_factory) -> Iterator[Stack]:
    stack = Stack(
        isolated_settings("coloc"),
        tmp_path_factory.mktemp("coloc-stack"),
        model="tiny",
        mode="colocated",
        n_prefill=1,
        n_decode=0,
    )
    try:
        yield stack.start()
    finally:
        stack.stop()


def prompt(seed: int) -> list[int]:
    return torch.randint(100, 40000, (PROMPT_LEN,), generator=torch.Generator().manual_seed(seed)).tolist()


def complete(stack: Stack, ids: list[int], salt: str | None = None) -> tuple[str, list[str]]:
    body = {"model": stack.served_model, "prompt": ids, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    if salt is not None:
        body["cache_salt"] = salt
    r = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.headers["x-request-id"], r.json()["choices"][0]["text"]


def lifecycle(stack: Stack, request_id: str, timeout_s: float = 20.0) -> dict[str, dict]:
    """Payload by event type, once the request's completion is recorded."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r = httpx.get(f"{stack.url}/v1/requests/{request_id}")
        if r.status_code == 200:
            events = {e["type"]: e["payload"] for e in r.json()["events"]}
            if "RequestCompleted" in events:
                return events
        time.sleep(0.2)
    raise AssertionError(f"{request_id} not recorded as completed in {timeout_s} s")


def kv_bytes_per_token(stack: Stack) -> int:
    c = load_model("tiny", stack.var_dir / "weights").config
    return c.num_layers * 2 * c.num_kv_heads * c.head_dim * 4


def test_second_identical_request_computes_only_last_token_colocated(colocated_stack):
    ids = prompt(1)
    first_id, first_text = complete(colocated_stack, ids)
    second_id, second_text = complete(colocated_stack, ids)
    assert second_text == first_text
    first = lifecycle(colocated_stack, first_id)["PrefillCompleted"]
    second = lifecycle(colocated_stack, second_id)["PrefillCompleted"]
    assert (first["num_cached_tokens"], first["num_computed_tokens"]) == (0, PROMPT_LEN)
    assert (second["num_cached_tokens"], second["num_computed_tokens"]) == (PROMPT_LEN - 1, 1)


def test_second_identical_request_computes_and_sends_only_last_token_disaggregated(tiny_stack):
    ids = prompt(2)
    first_id, first_text = complete(tiny_stack, ids)
    second_id, second_text = complete(tiny_stack, ids)
    assert second_text == first_text
    first, second = lifecycle(tiny_stack, first_id), lifecycle(tiny_stack, second_id)
    assert (
        first["PrefillCompleted"]["num_cached_tokens"],
        first["PrefillCompleted"]["num_computed_tokens"],
    ) == (0, PROMPT_LEN)
    assert (
        second["PrefillCompleted"]["num_cached_tokens"],
        second["PrefillCompleted"]["num_computed_tokens"],
    ) == (PROMPT_LEN - 1, 1)
    per_token = kv_bytes_per_token(tiny_stack)
    assert first["TransferCompleted"]["kv_bytes"] == PROMPT_LEN * per_token
    # the decode worker already holds the first 32 tokens' blocks: only the last token's KV is sent
    assert second["TransferCompleted"]["kv_bytes"] == per_token
    assert second["PrefillCompleted"]["kv_bytes"] == per_token


def test_requests_with_different_cache_salts_share_no_cached_blocks(tiny_stack):
    ids = prompt(3)
    a_id, a_text = complete(tiny_stack, ids, salt="tenant-a")
    b_id, b_text = complete(tiny_stack, ids, salt="tenant-b")
    a2_id, _ = complete(tiny_stack, ids, salt="tenant-a")
    assert a_text == b_text
    b, a2 = lifecycle(tiny_stack, b_id), lifecycle(tiny_stack, a2_id)
    assert b["PrefillCompleted"]["num_cached_tokens"] == 0
    assert b["TransferCompleted"]["kv_bytes"] == PROMPT_LEN * kv_bytes_per_token(tiny_stack)
    assert a2["PrefillCompleted"]["num_cached_tokens"] == PROMPT_LEN - 1

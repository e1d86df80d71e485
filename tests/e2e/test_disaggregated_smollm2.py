"""SmolLM2-135M-Instruct through the disaggregated stack: the real model's real answers."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from pdserve.config import ModelSettings
from pdserve.engine.loader import load_model
from pdserve.engine.model import LlamaModel
from tests import oracle
from tests.e2e.stack import Stack

pytestmark = pytest.mark.smollm2

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a KV cache is in one sentence.",
    "List three prime numbers.",
    "Translate 'good morning' into Spanish.",
]


@pytest.fixture(scope="module")
def smollm2_stack(isolated_settings, tmp_path_factory) -> Iterator[Stack]:
    settings = isolated_settings("smollm2stack")
    stack = Stack(settings, tmp_path_factory.mktemp("smollm2-stack"), model="smollm2")
    try:
        yield stack.start()
    finally:
        stack.stop()


def chat(stack: Stack, content: str, max_tokens: int) -> httpx.Response:
    return httpx.post(f"{stack.url}/v1/chat/completions", timeout=120, json={
        "model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})


def test_the_capital_of_france_is_paris(smollm2_stack):
    r = chat(smollm2_stack, PROMPTS[0], 24)
    assert r.status_code == 200, r.text
    assert "Paris" in r.json()["choices"][0]["message"]["content"]


def test_greedy_tokens_equal_one_process_without_transfer_for_five_prompts(smollm2_stack):
    loaded = load_model("smollm2", ModelSettings().weights_cache_dir)
    model = LlamaModel(loaded.config, loaded.weights)
    tok = loaded.tokenizer
    for prompt in PROMPTS:
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}]))
        expected = tok.decode(oracle.greedy(model, ids, 16))
        r = chat(smollm2_stack, prompt, 16)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == expected, prompt

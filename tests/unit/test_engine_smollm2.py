"""The paged engine on SmolLM2-135M-Instruct gives HF transformers' greedy tokens: 20 varied prompts × 32
tokens, batched and one at a time, chunked and unchunked, with and without prefix-cache hits. The batched
run is checked against HF with one HF forward per prompt (`hf_agrees`), two prompts also against HF's own
token-by-token decode; every other run must give the same tokens."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.llm_engine import EngineConfig, LLMEngine
from pdserve.engine.model import LlamaModel
from pdserve.engine.sequence import Sequence
from pdserve.messages import SamplingParams
from tests.unit.test_model_vs_hf import hf_greedy

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.smollm2, pytest.mark.usefixtures("one_torch_thread")]

MAX_TOKENS = 32
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
SYSTEM = (
    "You are a careful assistant. Answer in one short paragraph, cite no sources, and say so when "
    "you do not know. Question: "
)
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "1, 2, 3, 4,",
    "The quick brown fox jumps over the lazy dog. " * 4,
    "import numpy as np\nx = np.",
    "Dear Sir or Madam,",
    "SELECT name FROM users WHERE",
    "The mitochondria is",
    "In 1492, Columbus",
    *(
        SYSTEM + q
        for q in (
            "why is the sky blue?",
            "what is 2 + 2?",
            "who wrote Hamlet?",
            "how do vaccines work?",
            "what is a prime number?",
            "name three colours.",
            "what is the boiling point of water?",
            "explain recursion.",
            "what is DNA?",
            "translate 'hello' to Spanish.",
        )
    ),
]


@pytest.fixture(scope="module")
def prompt_ids(smollm2) -> list[list[int]]:
    ids = [smollm2.tokenizer.encode(p) for p in PROMPTS]
    assert len(ids) == 20 and len({tuple(i) for i in ids}) == 20
    assert max(map(len, ids)) > 2 * 16 and min(map(len, ids)) < 16
    return ids


def hf_agrees(hf: torch.nn.Module, prompt: list[int], output: list[int]) -> bool:
    """Whether `output` is HF's greedy continuation of `prompt`: one HF forward over prompt + output, and
    at every position HF's argmax is the next output token. By induction this is exactly HF's greedy
    decode, at the cost of one forward instead of 32 (HF's token-by-token loop takes minutes here)."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + output[:-1]])).logits[0, len(prompt) - 1 :]
    return logits.argmax(-1).tolist() == output


def generate(engine: LLMEngine, prompts: list[list[int]], tag: str) -> list[Sequence]:
    seqs = [Sequence(f"{tag}{i}", p, GREEDY) for i, p in enumerate(prompts)]
    for s in seqs:
        engine.add_request(s)
    while engine.has_work:
        engine.step()
    return seqs


def test_engine_greedy_equals_hf_batched_and_one_at_a_time_chunked_and_not_with_and_without_cache_hits(
    smollm2, smollm2_hf, prompt_ids
):
    model = LlamaModel(smollm2.config, smollm2.weights)

    def engine(budget: int) -> LLMEngine:
        return LLMEngine(model, EngineConfig(num_blocks=256, max_num_batched_tokens=budget))

    batched = engine(4096)  # all 20 prompts prefilled in one step: no hits, no chunks
    seqs = generate(batched, prompt_ids, "b")
    hf_tokens = [s.output_token_ids for s in seqs]
    assert all(hf_agrees(smollm2_hf, ids, out) for ids, out in zip(prompt_ids, hf_tokens, strict=True))
    for i in (0, 12):  # and two decoded token by token with HF's own KV cache
        assert hf_greedy(smollm2_hf, prompt_ids[i], MAX_TOKENS) == hf_tokens[i]
    assert all(s.num_cached_tokens == 0 for s in seqs)

    chunked = engine(24)  # prefill chunks of at most 24 tokens mixed with decodes
    assert [s.output_token_ids for s in generate(chunked, prompt_ids, "c")] == hf_tokens
    again = generate(chunked, prompt_ids, "h")  # every prompt's full blocks are cached now
    assert [s.output_token_ids for s in again] == hf_tokens
    assert all(s.num_cached_tokens == (len(p) - 1) // 16 * 16 for s, p in zip(again, prompt_ids, strict=True))
    assert sum(s.num_cached_tokens for s in again) >= 16 * 15

    single = engine(2048)  # one at a time: the shared system prompt hits after its first use (prompt 10)
    alone = (0, 4, 10, 11, 15, 19)
    outputs, hits = [], []
    for i in alone:
        (s,) = generate(single, [prompt_ids[i]], f"s{i}")
        outputs.append(s.output_token_ids)
        hits.append(s.num_cached_tokens)
    assert outputs == [hf_tokens[i] for i in alone]
    assert hits[:3] == [0] * 3 and all(h >= 16 for h in hits[3:])
    for e in (batched, chunked, single):
        assert e.block_manager.num_free_blocks == 256

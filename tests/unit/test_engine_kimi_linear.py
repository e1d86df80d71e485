"""The engine on the hybrid kimi-tiny (KDA + MLA + MoE) gives HF transformers' greedy tokens: 20 varied
prompts × 32 tokens, batched and one at a time, unchunked and chunked at several chunk sizes, and resumed
from a state checkpoint inside a prefix hit (computing exactly prompt − C tokens); and a Kimi Linear
directory pdserve did not generate (HF's own `save_pretrained` of a randomly initialized model, another
config and seed) is served with HF's greedy tokens too."""

from __future__ import annotations

import pytest

from pdserve.engine.llm_engine import EngineConfig, LLMEngine
from pdserve.engine.loader import build_model, load_model
from pdserve.engine.sequence import Sequence
from pdserve.messages import SamplingParams
from tests.foreign_kimi import save_foreign_kimi
from tests.unit.test_model_vs_hf import hf_greedy

pytestmark = pytest.mark.usefixtures("one_torch_thread")

transformers = pytest.importorskip("transformers")

MAX_TOKENS = 32
BS = 16
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
SYSTEM = (
    "You are a careful assistant for a small library. Answer in one short paragraph, cite no sources, say "
    "so when you do not know, and never invent a book that is not on the shelves. Keep the tone friendly "
    "and plain, and use simple words. Question: "
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
def model(kimi):
    return build_model(kimi)


@pytest.fixture(scope="module")
def prompt_ids(kimi) -> list[list[int]]:
    return [kimi.tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def expected(kimi_hf, prompt_ids) -> list[list[int]]:
    return [hf_greedy(kimi_hf, ids, MAX_TOKENS) for ids in prompt_ids]


def engine_of(model, budget: int, num_blocks: int = 256, checkpoint_interval: int = 2 * BS) -> LLMEngine:
    return LLMEngine(model, EngineConfig(num_blocks=num_blocks, block_size=BS, max_num_batched_tokens=budget,
                                         checkpoint_interval=checkpoint_interval))


def test_the_prompts_are_varied_and_the_oracle_is_not_degenerate(prompt_ids, expected):
    assert len(prompt_ids) == 20 and min(map(len, prompt_ids)) < 8 < 40 < max(map(len, prompt_ids))
    assert len({tuple(e) for e in expected}) == 20 and all(len(set(e)) > 8 for e in expected)


@pytest.mark.parametrize("budget", [512, 13])
def test_one_at_a_time_unchunked_and_chunked_equals_hf(model, prompt_ids, expected, budget):
    engine = engine_of(model, budget)  # later system-prompt questions hit the earlier ones' prefix
    got = [engine.generate([ids], GREEDY)[0] for ids in prompt_ids]
    assert got == expected
    assert engine.state_pool.num_live == 0 and engine.state_pool.num_checkpoint_hits > 0


@pytest.mark.parametrize("budget", [512, 37, 5])
def test_batched_unchunked_and_chunked_equals_hf(model, prompt_ids, expected, budget):
    engine = engine_of(model, budget)
    assert engine.generate(prompt_ids, GREEDY) == expected
    assert engine.state_pool.num_live == 0
    assert engine.block_manager.num_free_blocks == 256


def test_a_prefix_hit_resumes_from_the_latest_checkpoint_and_computes_prompt_minus_c(
    model, prompt_ids, expected
):
    first, second = prompt_ids[10], prompt_ids[11]
    common = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    kv_hit = common // BS * BS
    interval = 2 * BS
    checkpoint = kv_hit // interval * interval
    assert 0 < checkpoint < kv_hit  # the case this test is about: the KV reaches past the latest checkpoint
    engine = engine_of(model, budget=512, checkpoint_interval=interval)
    assert engine.generate([first], GREEDY) == [expected[10]]
    before = engine.stats.num_prompt_tokens_computed
    seq = Sequence("second", second, GREEDY)
    engine.add_request(seq)
    while engine.has_work:
        engine.step()
    assert (seq.num_cached_tokens, seq.num_checkpoint_tokens) == (kv_hit, checkpoint)
    assert engine.stats.num_prompt_tokens_computed - before == len(second) - checkpoint
    assert seq.output_token_ids == expected[11]


def test_without_checkpoints_a_prefix_hit_recomputes_the_whole_prompt(model, prompt_ids, expected):
    engine = engine_of(model, budget=512, checkpoint_interval=0)
    engine.generate([prompt_ids[10]], GREEDY)
    before = engine.stats.num_prompt_tokens_computed
    seq = Sequence("again", prompt_ids[11], GREEDY)
    engine.add_request(seq)
    while engine.has_work:
        engine.step()
    assert seq.num_cached_tokens > 0 and seq.num_checkpoint_tokens == 0
    assert engine.stats.num_prompt_tokens_computed - before == len(prompt_ids[11])
    assert seq.output_token_ids == expected[11]


# ---------------------------------------------------------------- a directory pdserve did not generate


@pytest.fixture(scope="module")
def foreign_dir(tmp_path_factory):
    return save_foreign_kimi(tmp_path_factory.mktemp("foreign-kimi"))


def test_a_kimi_linear_directory_saved_by_hf_is_served_with_hfs_greedy_tokens(foreign_dir):
    loaded = load_model(str(foreign_dir), foreign_dir.parent)
    assert loaded.family == "kimi_linear" and loaded.config.q_lora_rank == 24
    assert loaded.config.num_mla_layers == 3 and loaded.config.linear_conv_kernel_dim == 3
    hf = transformers.KimiLinearForCausalLM.from_pretrained(foreign_dir).eval()
    model = build_model(loaded)
    prompts = [loaded.tokenizer.encode(p) for p in (PROMPTS[2], PROMPTS[13], PROMPTS[4])]
    expected = [hf_greedy(hf, ids, 16) for ids in prompts]
    assert len({tuple(e) for e in expected}) == 3
    engine = engine_of(model, budget=11)
    assert engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)) == expected

"""The greedy reference the distributed paths must equal: pdserve's own engine serving one prompt alone in
this process — no batching, no chunking, no transfer, no other worker. Any model family. (The engine itself
is checked against HF transformers in tests/unit/test_model_vs_hf.py and test_kimi_linear_vs_hf.py.)"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pdserve.engine.llm_engine import EngineConfig, LLMEngine
from pdserve.engine.loader import LoadedModel, build_model, load_model
from pdserve.engine.model_family import EngineModel
from pdserve.engine.sequence import Sequence as EngineSequence
from pdserve.messages import SamplingParams

BLOCK_SIZE = 16


def reference(name: str, cache_dir: Path) -> tuple[LoadedModel, EngineModel]:
    """(loaded, engine model on the CPU in fp32) of model `name` ('tiny', 'kimi-tiny', a directory, ...;
    `loader.load_model`), its family's forward chosen by `build_model`, as a CPU worker builds it."""
    loaded = load_model(name, cache_dir)
    return loaded, build_model(loaded)


def greedy(model: EngineModel, prompt_ids: Sequence[int], max_tokens: int) -> list[int]:
    """Exactly `max_tokens` greedy token ids after `prompt_ids` (EOS ignored, so lengths are fixed)."""
    num_tokens = len(prompt_ids) + max_tokens
    engine = LLMEngine(model, EngineConfig(num_blocks=-(-num_tokens // BLOCK_SIZE), block_size=BLOCK_SIZE,
                                           max_num_batched_tokens=len(prompt_ids)))
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return engine.generate([list(prompt_ids)], sampling)[0]


def greedy_logprobs(model: EngineModel, prompt_ids: Sequence[int], max_tokens: int) -> list[float]:
    """The logprob of each of `greedy`'s tokens (the raw log-softmax of the logits it was chosen from)."""
    num_tokens = len(prompt_ids) + max_tokens
    engine = LLMEngine(model, EngineConfig(num_blocks=-(-num_tokens // BLOCK_SIZE), block_size=BLOCK_SIZE,
                                           max_num_batched_tokens=len(prompt_ids)))
    engine.add_request(EngineSequence("logprobs", list(prompt_ids), SamplingParams(
        max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=0)))
    logprobs: list[float] = []
    while engine.has_work:
        logprobs += (out.logprobs.logprob for out in engine.step() if out.logprobs is not None)
    return logprobs

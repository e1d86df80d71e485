"""The engine over an offload tier (tiny Llama, against the one-sequence greedy oracle `tests/oracle.py`):
blocks the pool evicts are written down, a later prefix hit copies them back instead of recomputing them,
and the output stays the oracle's; a corrupt block in the tier is detected and recomputed."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.kv_events import BlockRemoved, BlockStored
from pdserve.engine.kv_tiers.host_tier import HostOffloadTier
from pdserve.engine.llm_engine import EngineConfig, LLMEngine
from pdserve.engine.loader import LoadedModel, load_model
from pdserve.engine.model import LlamaModel
from pdserve.engine.sequence import Sequence
from pdserve.messages import SamplingParams
from tests import oracle

BS = 16
GREEDY = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
PROMPT_LEN = 4 * BS + 3  # 4 full blocks may hit


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> LoadedModel:
    return load_model("tiny", tmp_path_factory.mktemp("weights"))


@pytest.fixture(scope="module")
def model(tiny) -> LlamaModel:
    return LlamaModel(tiny.config, tiny.weights)


@pytest.fixture(scope="module")
def prompts(tiny) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, tiny.config.vocab_size, (PROMPT_LEN,), generator=g).tolist() for _ in range(4)]


@pytest.fixture(scope="module")
def expected(model, prompts) -> list[list[int]]:
    return [oracle.greedy(model, p, GREEDY.max_tokens) for p in prompts]


def engine_of(model, tier: HostOffloadTier | None, background: bool = False) -> LLMEngine:
    # 6 blocks: one prompt (5 blocks with its output) at a time; every other prompt evicts the last one's
    return LLMEngine(model, EngineConfig(num_blocks=6, block_size=BS, max_num_batched_tokens=256),
                     tiers=[tier] if tier is not None else (), tier_writer_thread=background)


def run_one(engine: LLMEngine, prompt: list[int], request_id: str) -> Sequence:
    seq = Sequence(request_id, prompt, GREEDY)
    engine.add_request(seq)
    while engine.has_work:
        engine.step()
    return seq


@pytest.mark.parametrize("background", [False, True])
def test_evicted_blocks_come_back_from_the_offload_tier_and_the_output_is_the_oracles(
    model, prompts, expected, background
):
    tier = HostOffloadTier(64)
    engine = engine_of(model, tier, background)
    for i, p in enumerate(prompts):  # each evicts the one before from the 6-block pool
        seq = run_one(engine, p, f"first-{i}")
        assert seq.output_token_ids == expected[i]
        assert seq.num_cached_tokens == 0
    engine.flush_tiers()
    assert tier.num_blocks > 0
    computed_before = engine.stats.num_prompt_tokens_computed
    again = run_one(engine, prompts[0], "again")
    assert again.output_token_ids == expected[0]
    assert again.num_cached_tokens == 4 * BS
    assert again.cached_tokens_by_tier == {"offload": 4 * BS}
    assert engine.stats.num_prompt_tokens_computed - computed_before == PROMPT_LEN - 4 * BS
    assert engine.block_manager.num_hit_tokens_by_tier["offload"] == 4 * BS
    # the blocks copied back are registered in the pool: the next run hits them there
    third = run_one(engine, prompts[0], "third")
    assert third.cached_tokens_by_tier == {"pool": 4 * BS}
    assert third.output_token_ids == expected[0]
    engine.close()


def test_without_a_tier_the_same_workload_recomputes(model, prompts, expected):
    engine = engine_of(model, None)
    for i, p in enumerate(prompts):
        run_one(engine, p, f"first-{i}")
    again = run_one(engine, prompts[0], "again")
    assert again.num_cached_tokens == 0 and again.output_token_ids == expected[0]


def test_a_corrupt_block_in_the_tier_is_detected_and_recomputed_with_identical_output(
    model, prompts, expected
):
    tier = HostOffloadTier(64)
    engine = engine_of(model, tier)
    for i, p in enumerate(prompts):
        run_one(engine, p, f"first-{i}")
    hashes = engine.block_manager.chain_hashes(Sequence("h", prompts[0]), 4)
    assert tier.lookup(hashes) == 4
    tier._blocks["kv", hashes[2]].block.view(-1)[5] += 0.5  # corrupt the third block's held copy
    again = run_one(engine, prompts[0], "again")
    assert tier.num_corrupt == 1
    assert again.cached_tokens_by_tier == {"offload": 2 * BS}  # the hit stops before the bad block
    assert again.output_token_ids == expected[0]


def test_a_tier_smaller_than_the_working_set_never_exceeds_its_capacity(model, prompts, expected):
    tier = HostOffloadTier(3)
    engine = engine_of(model, tier)
    for rnd in range(2):
        for i, p in enumerate(prompts):
            seq = run_one(engine, p, f"r{rnd}-{i}")
            assert seq.output_token_ids == expected[i]
            assert tier.num_blocks <= 3
    assert tier.num_evictions > 0


def test_kv_events_say_which_tier_gained_and_lost_each_block(model, prompts):
    tier = HostOffloadTier(2)
    engine = engine_of(model, tier)
    run_one(engine, prompts[0], "a")
    engine.take_kv_events()
    run_one(engine, prompts[1], "b")  # evicts a's blocks from the pool into the 2-block tier
    events = engine.take_kv_events()
    pool_removed = {h for e in events if isinstance(e, BlockRemoved) and e.tier == "pool"
                    for h in e.block_hashes}
    offload_stored = [h for e in events if isinstance(e, BlockStored) and e.tier == "offload"
                      for h in e.block_hashes]
    offload_removed = [h for e in events if isinstance(e, BlockRemoved) and e.tier == "offload"
                       for h in e.block_hashes]
    assert pool_removed and set(offload_stored) == pool_removed
    held = set(offload_stored) - set(offload_removed)
    assert len(held) == 2 and all(h in tier for h in held)

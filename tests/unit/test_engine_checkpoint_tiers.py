"""A hybrid's recurrent-state checkpoints in the KV tiers (kimi-tiny, against HF transformers' greedy tokens):
with a pool and a state pool too small for the workload, a prompt's KV blocks and its state checkpoints are
evicted to the offload (or disk) tier, and the same prompt again reads both back and resumes from the
tiered checkpoint, computing exactly prompt − C tokens; a corrupt tiered checkpoint is detected and the
prefill falls back to the next shorter one (or recomputes), the output identical; the tier's capacity,
blocks and checkpoints together, is never exceeded; checkpoint events carry the tier, and the router's
index counts tiered checkpoints."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.kv_events import CheckpointRemoved, CheckpointStored
from pdserve.engine.kv_tiers.disk_tier import DiskTier
from pdserve.engine.kv_tiers.host_tier import HostOffloadTier
from pdserve.engine.llm_engine import EngineConfig, LLMEngine
from pdserve.engine.loader import build_model
from pdserve.engine.sequence import Sequence
from pdserve.messages import SamplingParams
from pdserve.messages.kv_events import KVEvents
from pdserve.routing.kv_index import KVIndex
from tests.unit.test_model_vs_hf import hf_greedy

pytestmark = pytest.mark.usefixtures("one_torch_thread")

transformers = pytest.importorskip("transformers")

BS = 16
INTERVAL = 2 * BS  # checkpoints after 32 and 64 tokens
MAX_TOKENS = 5
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
PROMPT_LEN = 4 * BS + 3  # a KV hit of 4 blocks (64 tokens), checkpoints at 32 and 64


@pytest.fixture(scope="module")
def model(kimi):
    return build_model(kimi)


@pytest.fixture(scope="module")
def prompts(kimi) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, kimi.config.vocab_size, (PROMPT_LEN,), generator=g).tolist() for _ in range(3)]


@pytest.fixture(scope="module")
def expected(kimi_hf, prompts) -> list[list[int]]:
    return [hf_greedy(kimi_hf, p, MAX_TOKENS) for p in prompts]


def engine_of(model, tier, background: bool = False, interval: int = INTERVAL) -> LLMEngine:
    # 6 blocks: one prompt (5 blocks with its output) at a time; 3 state slots: one live and the 2
    # checkpoints of one prompt, so every other prompt evicts the last one's blocks and checkpoints
    return LLMEngine(
        model, EngineConfig(num_blocks=6, block_size=BS, max_num_batched_tokens=256, num_state_slots=3,
                            checkpoint_interval=interval),
        tiers=[tier], tier_writer_thread=background,
    )


def run_one(engine: LLMEngine, prompt: list[int], request_id: str) -> Sequence:
    seq = Sequence(request_id, prompt, GREEDY)
    engine.add_request(seq)
    while engine.has_work:
        engine.step()
    return seq


def checkpoint_hashes(engine: LLMEngine, prompt: list[int]) -> dict[int, int]:
    """num_tokens → the hash its checkpoint is stored under (the block ending there)."""
    hashes = engine.block_manager.chain_hashes(Sequence("h", prompt), 4)
    return {32: hashes[1], 64: hashes[3]}


def evict_first(engine: LLMEngine, prompts: list[list[int]], expected: list[list[int]]) -> None:
    for i, p in enumerate(prompts):
        assert run_one(engine, p, f"first-{i}").output_token_ids == expected[i]
    engine.flush_tiers()


@pytest.mark.parametrize(("kind", "background"), [("offload", False), ("offload", True), ("disk", False)])
def test_an_evicted_checkpoint_comes_back_from_the_tier_and_the_prefill_resumes_from_it(
    model, prompts, expected, tmp_path, kind, background
):
    tier = HostOffloadTier(64) if kind == "offload" else DiskTier(tmp_path / "disk", 64)
    engine = engine_of(model, tier, background)
    try:
        evict_first(engine, prompts, expected)
        ckpt = checkpoint_hashes(engine, prompts[0])
        assert all(h not in engine.state_pool.checkpoints for h in ckpt.values())  # gone from the pool
        assert all(tier.lookup([h], space="checkpoint") == 1 for h in ckpt.values())  # held below it
        before = engine.stats.num_prompt_tokens_computed
        again = run_one(engine, prompts[0], "again")
        assert again.cached_tokens_by_tier == {kind: 4 * BS}
        assert (again.num_cached_tokens, again.num_checkpoint_tokens, again.checkpoint_tier) == (64, 64, kind)
        assert engine.stats.num_prompt_tokens_computed - before == PROMPT_LEN - 64
        assert again.output_token_ids == expected[0]
    finally:
        engine.close()


def test_the_tiered_checkpoint_may_end_before_the_tiered_kv_hit(model, prompts, expected):
    """A checkpoint every 3 blocks: the KV hit is 4 blocks (64 tokens), the checkpoint within it 48."""
    tier = HostOffloadTier(64)
    engine = engine_of(model, tier, interval=3 * BS)
    evict_first(engine, prompts, expected)
    before = engine.stats.num_prompt_tokens_computed
    again = run_one(engine, prompts[0], "again")
    assert again.cached_tokens_by_tier == {"offload": 4 * BS}
    assert (again.num_checkpoint_tokens, again.checkpoint_tier) == (3 * BS, "offload")
    assert engine.stats.num_prompt_tokens_computed - before == PROMPT_LEN - 3 * BS
    assert again.output_token_ids == expected[0]


def test_checkpoint_and_block_keys_are_distinct_spaces(model, prompts, expected):
    tier = HostOffloadTier(64)
    engine = engine_of(model, tier)
    evict_first(engine, prompts, expected)
    ckpt = checkpoint_hashes(engine, prompts[0])
    # the block ending at 64 tokens and the checkpoint after it share a hash, not an entry
    held = tier._blocks["kv", ckpt[64]].block, tier._blocks["checkpoint", ckpt[64]].block
    assert held[0].dtype == engine.runner.kv_cache[0].dtype and held[0].shape[1] == BS
    assert held[1].dtype == torch.uint8 and held[1].numel() == engine.state_pool.packed_bytes
    assert tier.num_blocks == tier.num_checkpoints + sum(1 for space, _ in tier._blocks if space == "kv")
    state = torch.empty(engine.state_pool.packed_bytes, dtype=torch.uint8)
    assert tier.get_into(ckpt[64], state, space="checkpoint") and torch.equal(state, held[1])
    assert not tier.get_into(ckpt[32] ^ 1, state, space="checkpoint")


@pytest.mark.parametrize(("corrupt", "resumes_at"), [((64,), 32), ((64, 32), 0)])
def test_a_corrupt_tiered_checkpoint_is_detected_and_the_prefill_falls_back(
    model, prompts, expected, corrupt, resumes_at
):
    tier = HostOffloadTier(64)
    engine = engine_of(model, tier)
    evict_first(engine, prompts, expected)
    ckpt = checkpoint_hashes(engine, prompts[0])
    for n in corrupt:
        tier._blocks["checkpoint", ckpt[n]].block[100] ^= 0x40  # one flipped bit in the held copy
    before = engine.stats.num_prompt_tokens_computed
    again = run_one(engine, prompts[0], "again")
    assert tier.num_corrupt == len(corrupt)
    assert engine.tiers.num_checkpoint_misses == len(corrupt)
    assert again.num_cached_tokens == 64 and again.num_checkpoint_tokens == resumes_at
    assert engine.stats.num_prompt_tokens_computed - before == PROMPT_LEN - resumes_at
    assert again.output_token_ids == expected[0]
    assert all(tier.lookup([ckpt[n]], space="checkpoint") == 0 for n in corrupt)  # the bad copies dropped


def test_a_tier_smaller_than_the_working_set_never_exceeds_its_capacity(model, prompts, expected):
    tier = HostOffloadTier(5)
    engine = engine_of(model, tier)
    for rnd in range(2):
        for i, p in enumerate(prompts):
            seq = run_one(engine, p, f"r{rnd}-{i}")
            assert seq.output_token_ids == expected[i]
            assert tier.num_blocks <= 5
    assert tier.num_evictions > 0 and tier.num_checkpoints > 0


def test_checkpoint_events_carry_the_tier_and_the_index_counts_tiered_checkpoints(model, prompts, expected):
    tier = HostOffloadTier(64)
    engine = engine_of(model, tier)
    evict_first(engine, prompts, expected)
    events = engine.take_kv_events()
    ckpt = checkpoint_hashes(engine, prompts[0])
    stored = {(e.block_hash, e.num_tokens) for e in events if isinstance(e, CheckpointStored)
              and e.tier == "offload"}
    assert {(ckpt[32], 32), (ckpt[64], 64)} <= stored
    pool_removed = {h for e in events if isinstance(e, CheckpointRemoved) and e.tier == "pool"
                    for h in e.block_hashes}
    assert set(ckpt.values()) <= pool_removed
    index = KVIndex()
    index.apply(KVEvents(worker_id="w", seq=0, events=tuple(events), ts=0.0))
    hashes = engine.block_manager.chain_hashes(Sequence("h", prompts[0]), 4)
    assert index.num_checkpoints("w", tier="offload") == len(stored)
    assert index.checkpoint_blocks(hashes, "w", 4) == 4  # the tiered checkpoint after 4 blocks counts

"""Two engines (two workers) over one real Mooncake Store (tiny Llama, against the greedy oracle
`tests/oracle.py`): what one computes, the other reads instead of computing; a corrupt block in the store
is detected and recomputed with identical output; a killed master leaves both serving on their own pools."""

from __future__ import annotations

import os
import signal
import uuid

import pytest
import torch

from pdserve.engine.llm_engine import EngineConfig, LLMEngine
from pdserve.engine.loader import LoadedModel, load_model
from pdserve.engine.model import LlamaModel
from pdserve.engine.sequence import Sequence
from pdserve.kv_store import MooncakeClient, MooncakeStoreTier, StoreTimeouts, store_key
from pdserve.kv_store.tier import HEADER
from pdserve.messages import SamplingParams
from tests import oracle
from tests.conftest import mooncake_importable

pytestmark = pytest.mark.skipif(bool(mooncake_importable()), reason=mooncake_importable() or "ok")

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
def prompt(tiny) -> list[int]:
    g = torch.Generator().manual_seed(11)
    return torch.randint(0, tiny.config.vocab_size, (PROMPT_LEN,), generator=g).tolist()


@pytest.fixture(scope="module")
def expected(model, prompt) -> list[int]:
    return oracle.greedy(model, prompt, GREEDY.max_tokens)


def store_tier(model, url: str, namespace: str, worker_id: str, timeouts: StoreTimeouts | None = None):
    spec = model.cache_spec()
    client = MooncakeClient(url, timeouts)
    client.connect()
    return MooncakeStoreTier(client, namespace, (spec.num_paged_layers, BS, *spec.paged_row_shape),
                             model.dtype, worker_id=worker_id)


def engine_of(model, tier) -> LLMEngine:
    return LLMEngine(model, EngineConfig(num_blocks=16, block_size=BS, max_num_batched_tokens=256),
                     tiers=[tier], tier_writer_thread=False)


def run_one(engine: LLMEngine, prompt: list[int], request_id: str) -> Sequence:
    seq = Sequence(request_id, prompt, GREEDY)
    engine.add_request(seq)
    while engine.has_work:
        engine.step()
    return seq


@pytest.fixture
def pair(model, mooncake_url):
    namespace = uuid.uuid4().hex[:16]
    tiers = [store_tier(model, mooncake_url, namespace, w) for w in ("engine-a", "engine-b")]
    yield namespace, tiers, [engine_of(model, t) for t in tiers]
    for t in tiers:
        t.close()


def test_a_prompt_one_worker_computed_is_read_from_the_store_by_another(pair, prompt, expected):
    _, (tier_a, _), (a, b) = pair
    first = run_one(a, prompt, "a")
    assert first.output_token_ids == expected and first.num_cached_tokens == 0
    published = {c.block_hash for c in tier_a.take_changes() if c.stored}
    assert len(published) >= 4  # the prompt's 4 full blocks (and any full output block)
    computed_before = b.stats.num_prompt_tokens_computed
    second = run_one(b, prompt, "b")
    assert second.cached_tokens_by_tier == {"store": 4 * BS}
    assert b.stats.num_prompt_tokens_computed - computed_before == PROMPT_LEN - 4 * BS
    assert second.output_token_ids == expected


def test_a_corrupt_block_in_the_store_is_recomputed_and_the_output_is_identical(pair, model, prompt,
                                                                                  expected):
    namespace, (tier_a, tier_b), (a, b) = pair
    run_one(a, prompt, "a")
    hashes = a.block_manager.chain_hashes(Sequence("h", prompt), 4)
    assert tier_b.lookup(hashes) == 4
    # Overwrite the third block with a copy one byte off, under the original checksum.
    buf = tier_a._lanes["kv"].get_buf
    assert tier_a.client.get_into(store_key(namespace, hashes[2]), buf.data_ptr(), buf.numel()) == buf.numel()
    buf[HEADER.size + 7] ^= 0x10
    tier_a.client.remove(store_key(namespace, hashes[2]))
    tier_a.client.put_from(store_key(namespace, hashes[2]), buf.data_ptr(), buf.numel())  # waits for remove
    again = run_one(b, prompt, "b")
    assert again.cached_tokens_by_tier == {"store": 2 * BS}  # the hit stops before the bad block
    assert again.output_token_ids == expected
    assert [c for c in tier_b.take_changes() if not c.stored] == [(False, hashes[2], "kv")]


def test_a_killed_master_leaves_both_workers_serving_identical_output(model, prompt, expected, tmp_path):
    from pdserve.embedded import start_mooncake

    server = start_mooncake(tmp_path, segment_bytes=32 << 20)
    timeouts = StoreTimeouts(lookup_s=0.2, get_s=0.3, put_s=0.3, retry_after_s=1.0)
    tiers = [store_tier(model, server.url, "killed", w, timeouts) for w in ("killed-a", "killed-b")]
    try:
        a, b = (engine_of(model, t) for t in tiers)
        assert run_one(a, prompt, "a").output_token_ids == expected
        os.kill(server.pid, signal.SIGKILL)
        for i in range(3):
            seq = run_one(b, prompt, f"b{i}")  # the store is gone: computed, then from b's own pool
            assert seq.output_token_ids == expected
        assert seq.cached_tokens_by_tier == {"pool": 4 * BS}
    finally:
        for t in tiers:
            t.close()
        server.stop()


# ---------------------------------------------------------------- a hybrid: state checkpoints in the store


def test_a_hybrids_checkpoint_one_worker_computed_is_read_from_the_store_by_another(kimi, kimi_hf,
                                                                                     mooncake_url):
    """kimi-tiny, against HF's greedy tokens: worker a publishes the prompt's KV blocks and its state
    checkpoints (after 32 and 64 tokens) on compute; worker b reads both and computes prompt − 64 tokens.
    A corrupt checkpoint in the store is detected and b falls back to the shorter one."""
    from pdserve.engine.loader import build_model
    from tests.unit.test_model_vs_hf import hf_greedy

    kimi_model = build_model(kimi)
    g = torch.Generator().manual_seed(13)
    ids = torch.randint(0, kimi.config.vocab_size, (PROMPT_LEN,), generator=g).tolist()
    want = hf_greedy(kimi_hf, ids, GREEDY.max_tokens)
    spec = kimi_model.cache_spec()
    namespace = uuid.uuid4().hex[:16]
    tiers = []
    for w in ("hybrid-a", "hybrid-b", "hybrid-c"):
        client = MooncakeClient(mooncake_url)
        client.connect()
        tiers.append(MooncakeStoreTier(
            client, namespace, (spec.num_paged_layers, BS, *spec.paged_row_shape), kimi_model.dtype,
            worker_id=w, checkpoint_bytes=spec.state.bytes_per_slot(kimi_model.dtype)))
    try:
        config = EngineConfig(num_blocks=16, block_size=BS, max_num_batched_tokens=256,
                              checkpoint_interval=2 * BS)
        a, b, c = (LLMEngine(kimi_model, config, tiers=[t], tier_writer_thread=False) for t in tiers)
        assert a.state_pool.packed_bytes == spec.state.bytes_per_slot(kimi_model.dtype)
        assert run_one(a, ids, "a").output_token_ids == want
        hashes = a.block_manager.chain_hashes(Sequence("h", ids), 4)
        assert tiers[1].lookup([hashes[1]], space="checkpoint") == 1
        assert tiers[1].lookup([hashes[3]], space="checkpoint") == 1
        before = b.stats.num_prompt_tokens_computed
        second = run_one(b, ids, "b")
        assert second.cached_tokens_by_tier == {"store": 4 * BS}
        assert (second.num_checkpoint_tokens, second.checkpoint_tier) == (4 * BS, "store")
        assert b.stats.num_prompt_tokens_computed - before == PROMPT_LEN - 4 * BS
        assert second.output_token_ids == want
        # the checkpoint after 64 tokens, one byte off under its original checksum: c falls back to 32
        key = store_key(namespace, hashes[3], "checkpoint")
        buf = tiers[0]._lanes["checkpoint"].get_buf
        assert tiers[0].client.get_into(key, buf.data_ptr(), buf.numel()) == buf.numel()
        buf[HEADER.size + 9] ^= 0x10
        tiers[0].client.remove(key)
        tiers[0].client.put_from(key, buf.data_ptr(), buf.numel())
        before = c.stats.num_prompt_tokens_computed
        third = run_one(c, ids, "c")
        assert (third.num_cached_tokens, third.num_checkpoint_tokens) == (4 * BS, 2 * BS)
        assert c.stats.num_prompt_tokens_computed - before == PROMPT_LEN - 2 * BS
        assert third.output_token_ids == want
    finally:
        for t in tiers:
            t.close()

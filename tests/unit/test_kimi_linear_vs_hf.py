"""Our Kimi Linear forward against HF transformers' `KimiLinearForCausalLM` (the oracle) on the seeded
`kimi-tiny` checkpoint, which HF loads from the very directory pdserve generated: logits at every
position, one pass and token by token, chunked prefill, and the caches themselves — the MLA latents in the
paged pool and each KDA layer's recurrent and conv state — against HF's cache."""

from __future__ import annotations

import json

import pytest
import torch

from pdserve.engine.kimi_linear import KimiLinearModel
from pdserve.engine.kimi_linear_config import KDA, MLA, SPARSE, KimiLinearConfig
from pdserve.engine.loader import build_model, load_model
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.scheduler import ScheduledSeq
from pdserve.engine.sequence import Sequence
from pdserve.engine.state_pool import StatePool

pytestmark = pytest.mark.usefixtures("one_torch_thread")

transformers = pytest.importorskip("transformers")

ATOL = 1e-4
BLOCK_SIZE = 16


@pytest.fixture(scope="session")
def kimi_model(kimi) -> KimiLinearModel:
    return build_model(kimi)


@pytest.fixture(scope="module")
def ids(kimi) -> torch.Tensor:
    return torch.randint(0, kimi.config.vocab_size, (70,), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def hf_logits(kimi_hf, ids) -> torch.Tensor:
    with torch.no_grad():
        return kimi_hf(ids[None]).logits[0]  # [T, vocab]


def runner_with(
    model: KimiLinearModel, ids: torch.Tensor, num_blocks: int = 6
) -> tuple[ModelRunner, Sequence]:
    """A runner whose pool holds one sequence of `ids` (blocks in reverse order, state in slot 1 of 3)."""
    pool = StatePool(model.cache_spec().state, 3, block_size=BLOCK_SIZE)
    runner = ModelRunner(model, num_blocks, BLOCK_SIZE, pool)
    seq = Sequence("s", ids.tolist())
    seq.block_table = list(reversed(range(num_blocks)))
    pool.free_slots.remove(1)
    seq.state_slot = 1
    return runner, seq


def compute(runner: ModelRunner, seq: Sequence, num_tokens: int) -> torch.Tensor:
    (logits,) = runner.execute([ScheduledSeq(seq, num_tokens)])
    seq.num_computed_tokens += num_tokens
    return logits


def test_kimi_tiny_is_a_hybrid_in_hf_layout_generated_once_and_deterministically(kimi, kimi_dir, tmp_path):
    cfg = kimi.config
    assert isinstance(cfg, KimiLinearConfig) and kimi.family == "kimi_linear"
    assert cfg.layer_types.count(KDA) >= 3 and cfg.layer_types.count(MLA) >= 2
    assert SPARSE in cfg.mlp_layer_types and cfg.num_local_experts > cfg.num_experts_per_tok
    assert cfg.vocab_size == 49152  # SmolLM2's tokenizer, saved as tokenizer.json
    text = "Hi <|im_start|> héllo"
    assert kimi.tokenizer.encode(text) == load_model("tiny", tmp_path).tokenizer.encode(text)
    assert {p.name for p in kimi_dir.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json"}
    raw = json.loads((kimi_dir / "config.json").read_text())
    assert raw["model_type"] == "kimi_linear" and KimiLinearConfig.from_hf_dict(raw) == cfg
    stamp = (kimi_dir / "model.safetensors").stat().st_mtime_ns
    again = load_model("kimi-tiny", kimi_dir.parent)  # reused, not regenerated
    assert (kimi_dir / "model.safetensors").stat().st_mtime_ns == stamp
    assert again.weights_hash == kimi.weights_hash
    fresh = load_model("kimi-tiny", tmp_path / "elsewhere")  # generated again: the same bytes
    assert fresh.weights_hash == kimi.weights_hash


def test_hf_reads_the_same_config_and_weights(kimi, kimi_hf):
    hf_cfg = kimi_hf.config
    assert list(hf_cfg.layer_types) == list(kimi.config.layer_types)
    assert hf_cfg.num_local_experts == kimi.config.num_local_experts
    state = kimi_hf.state_dict()
    torch.testing.assert_close(state["model.layers.0.self_attn.q_proj.weight"],
                               kimi.weights["model.layers.0.self_attn.q_proj.weight"], atol=0, rtol=0)


def test_prefill_logits_match_hf_at_the_last_position(kimi_model, ids, hf_logits):
    runner, seq = runner_with(kimi_model, ids)
    logits = compute(runner, seq, len(ids))
    torch.testing.assert_close(logits, hf_logits[-1], atol=ATOL, rtol=0)
    assert hf_logits[-1].std() > 0.5  # not trivially flat


def test_token_by_token_decode_matches_hf_at_every_position(kimi_model, ids, hf_logits):
    runner, seq = runner_with(kimi_model, ids)
    compute(runner, seq, 9)
    for position in range(9, len(ids)):
        torch.testing.assert_close(compute(runner, seq, 1), hf_logits[position], atol=ATOL, rtol=0)


@pytest.mark.parametrize("chunks", [(13, 16, 19, 21), (1, 1, 67), (64, 5)])
def test_chunked_prefill_equals_one_pass_logits_state_and_latents(kimi_model, ids, chunks):
    full_runner, full_seq = runner_with(kimi_model, ids)
    full = compute(full_runner, full_seq, sum(chunks) + 1)
    runner, seq = runner_with(kimi_model, ids)
    for n in chunks:
        compute(runner, seq, n)
    last = compute(runner, seq, 1)
    torch.testing.assert_close(last, full, atol=ATOL, rtol=0)
    for name, value in full_runner.state_pool.read(full_seq).items():
        torch.testing.assert_close(runner.state_pool.read(seq)[name], value, atol=ATOL, rtol=0)
    for layer in range(kimi_model.config.num_mla_layers):
        torch.testing.assert_close(runner.kv_cache[layer], full_runner.kv_cache[layer], atol=ATOL, rtol=0)


def test_caches_hold_what_hfs_cache_holds(kimi, kimi_model, kimi_hf, ids):
    runner, seq = runner_with(kimi_model, ids)
    compute(runner, seq, len(ids))
    with torch.no_grad():
        hf_cache = kimi_hf(ids[None], use_cache=True).cache
    state = runner.state_pool.read(seq)
    cfg = kimi.config
    kda = [i for i, kind in enumerate(cfg.layer_types) if kind == KDA]
    mla = [i for i, kind in enumerate(cfg.layer_types) if kind == MLA]
    for index, layer in enumerate(kda):
        hf_layer = hf_cache.layers[layer]
        hf_recurrent, hf_conv = hf_layer.recurrent_states[0][0], hf_layer.conv_states[0][0]
        torch.testing.assert_close(state["recurrent"][index], hf_recurrent, atol=ATOL, rtol=0)
        # HF keeps the last K inputs channel-major; the state is the last K - 1, token-major
        torch.testing.assert_close(state["conv"][index], hf_conv[:, 1:].t(), atol=ATOL, rtol=0)
    table = torch.tensor(seq.block_table)
    for index, layer in enumerate(mla):
        pool = runner.kv_cache[index]
        latents = pool[table[: -(-len(ids) // BLOCK_SIZE)]].flatten(0, 1)[: len(ids)]
        hf_layer = hf_cache.layers[layer]
        hf_latent = torch.cat((hf_layer.keys[0, 0], hf_layer.values[0, 0]), dim=-1)  # [c_KV | k_R]
        torch.testing.assert_close(latents, hf_latent, atol=ATOL, rtol=0)
    assert state["recurrent"].abs().max() > 0.05 and state["conv"].abs().max() > 0.05


def test_the_state_layout_is_what_the_pool_holds(kimi, kimi_model):
    cfg = kimi.config
    spec = kimi_model.cache_spec()
    assert spec.num_paged_layers == cfg.num_mla_layers and spec.paged_row_shape == (cfg.latent_dim,)
    assert spec.state.bytes_per_slot(torch.float32) == cfg.state_bytes
    assert spec.kv_bytes_per_token(torch.float32) == cfg.kv_bytes_per_token

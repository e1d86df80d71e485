"""Our Llama forward against HF transformers (the oracle): a seeded tiny Llama built from the same config and
weights, and SmolLM2-135M-Instruct loaded by HF from the same GGUF."""

from __future__ import annotations

import hashlib

import pytest
import torch

from pdserve.config import ModelSettings
from pdserve.engine.loader import LoadedModel, build_model, load_model
from pdserve.engine.model import LlamaModel
from pdserve.engine.model_config import LlamaConfig
from pdserve.engine.model_files import smollm2_gguf_path
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.scheduler import ScheduledSeq
from pdserve.engine.sequence import Sequence
from pdserve.kernels.paged_attention import K_INDEX, V_INDEX, gather_sequence_kv
from tests import oracle

transformers = pytest.importorskip("transformers")

ATOL = 1e-4
BLOCK_SIZE = 16


def runner_with(model: LlamaModel, ids: torch.Tensor, num_blocks: int = 4) -> tuple[ModelRunner, Sequence]:
    """A runner whose pool holds one sequence of `ids`, its blocks in reverse order (so a table lookup
    that ignored the block ids would read the wrong rows)."""
    runner = ModelRunner(model, num_blocks, BLOCK_SIZE)
    seq = Sequence("s", ids.tolist())
    seq.block_table = list(reversed(range(num_blocks)))
    return runner, seq


def compute(runner: ModelRunner, seq: Sequence, num_tokens: int, hook=None) -> torch.Tensor:
    """The next `num_tokens` of `seq` through the serving forward; the last one's logits, [vocab_size]."""
    (logits,) = runner.execute([ScheduledSeq(seq, num_tokens)], hook)
    seq.num_computed_tokens += num_tokens
    return logits


def cached_kv(runner: ModelRunner, seq: Sequence, layer: int, num_tokens: int) -> torch.Tensor:
    """[num_tokens, 2, kv_heads, head_dim]: `seq`'s first tokens' KV of one layer, read through its table."""
    return gather_sequence_kv(runner.kv_cache[layer], torch.tensor(seq.block_table), num_tokens)


def hf_llama_from(loaded: LoadedModel) -> torch.nn.Module:
    """HF LlamaForCausalLM with `loaded`'s config and weights (eager attention, the reference math)."""
    c = loaded.config
    hf_config = transformers.LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        rope_theta=c.rope_theta,
        rms_norm_eps=c.rms_norm_eps,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings,
        bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id,
        attn_implementation="eager",
    )
    model = transformers.LlamaForCausalLM(hf_config).eval()
    result = model.load_state_dict(loaded.weights, strict=False)
    assert not result.unexpected_keys
    assert set(result.missing_keys) <= {"lm_head.weight"} and c.tie_word_embeddings
    assert torch.equal(model.lm_head.weight, loaded.weights["model.embed_tokens.weight"])
    return model


def hf_greedy(model: torch.nn.Module, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """Greedy decoding with HF's own KV cache, no EOS stop (so lengths are fixed)."""
    generated: list[int] = []
    inputs, cache = torch.tensor([prompt_ids]), None
    with torch.no_grad():
        for _ in range(max_tokens):
            out = model(input_ids=inputs, cache=cache, use_cache=True)
            cache = out.cache
            generated.append(int(out.logits[0, -1].argmax()))
            inputs = torch.tensor([[generated[-1]]])
    return generated


# ---------------------------------------------------------------- tiny random Llama


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> LoadedModel:
    return load_model("tiny", tmp_path_factory.mktemp("weights"))


@pytest.fixture(scope="session")
def tiny_hf(tiny: LoadedModel) -> torch.nn.Module:
    return hf_llama_from(tiny)


@pytest.fixture(scope="session")
def tiny_ids(tiny: LoadedModel) -> torch.Tensor:
    return torch.randint(0, tiny.config.vocab_size, (48,), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="session")
def tiny_hf_logits(tiny_hf, tiny_ids) -> torch.Tensor:
    with torch.no_grad():
        return tiny_hf(tiny_ids[None]).logits[0]  # [T, vocab]


def test_tiny_model_is_deterministic_and_hash_names_its_weights(tiny: LoadedModel, tmp_path) -> None:
    again = load_model("tiny", tmp_path)
    assert again.weights_hash == tiny.weights_hash
    assert all(torch.equal(again.weights[k], v) for k, v in tiny.weights.items())
    assert tiny.config.num_kv_heads < tiny.config.num_heads  # GQA is exercised


def test_tiny_prefill_logits_match_hf_llama(tiny, tiny_ids, tiny_hf_logits) -> None:
    runner, seq = runner_with(LlamaModel(tiny.config, tiny.weights), tiny_ids)
    logits = compute(runner, seq, len(tiny_ids))
    assert logits.shape == (tiny.config.vocab_size,) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, tiny_hf_logits[-1], atol=ATOL, rtol=0)
    # the logits are not trivially flat, so agreement means something
    assert tiny_hf_logits[-1].std() > 1.0


def test_token_by_token_decode_matches_hf_at_every_position(tiny, tiny_ids, tiny_hf_logits) -> None:
    runner, seq = runner_with(LlamaModel(tiny.config, tiny.weights), tiny_ids)
    compute(runner, seq, 8)
    for position in range(8, len(tiny_ids)):
        torch.testing.assert_close(compute(runner, seq, 1), tiny_hf_logits[position], atol=ATOL, rtol=0)


def test_chunked_prefill_then_decode_equals_one_full_forward(tiny, tiny_ids) -> None:
    model = LlamaModel(tiny.config, tiny.weights)
    full_runner, full_seq = runner_with(model, tiny_ids)
    full = compute(full_runner, full_seq, len(tiny_ids))
    chunked_runner, chunked_seq = runner_with(model, tiny_ids)
    for n in (13, 16, 18):
        compute(chunked_runner, chunked_seq, n)
    last = compute(chunked_runner, chunked_seq, 1)
    torch.testing.assert_close(last, full, atol=ATOL, rtol=0)
    for layer in range(tiny.config.num_layers):
        torch.testing.assert_close(cached_kv(chunked_runner, chunked_seq, layer, 48),
                                   cached_kv(full_runner, full_seq, layer, 48), atol=ATOL, rtol=0)


def test_kv_cache_holds_the_keys_and_values_hf_caches(tiny, tiny_hf, tiny_ids) -> None:
    runner, seq = runner_with(LlamaModel(tiny.config, tiny.weights), tiny_ids)
    compute(runner, seq, len(tiny_ids))
    with torch.no_grad():
        hf_cache = tiny_hf(tiny_ids[None], use_cache=True).cache
    for layer in range(tiny.config.num_layers):
        hf_k = hf_cache.layers[layer].keys[0].transpose(0, 1)  # [T, kv_heads, head_dim], after rope
        hf_v = hf_cache.layers[layer].values[0].transpose(0, 1)
        kv = cached_kv(runner, seq, layer, 64)
        torch.testing.assert_close(kv[:48, K_INDEX], hf_k, atol=ATOL, rtol=0)
        torch.testing.assert_close(kv[:48, V_INDEX], hf_v, atol=ATOL, rtol=0)
        assert kv[48:].abs().sum() == 0  # nothing written past the sequence's tokens


def test_layer_hook_runs_once_per_layer_in_order_after_that_layers_kv_is_written(tiny, tiny_ids) -> None:
    runner, seq = runner_with(LlamaModel(tiny.config, tiny.weights), tiny_ids)
    compute(runner, seq, 10)
    seen: list[int] = []

    def hook(layer: int, kv_layer: torch.Tensor) -> None:
        assert kv_layer is runner.kv_cache[layer]
        assert cached_kv(runner, seq, layer, 20)[10:].abs().sum() > 0  # written before the hook
        if layer + 1 < tiny.config.num_layers:  # the next layer is not yet computed
            assert cached_kv(runner, seq, layer + 1, 20)[10:].abs().sum() == 0
        seen.append(layer)

    compute(runner, seq, 10, hook)
    assert seen == list(range(tiny.config.num_layers))


def test_one_block_of_one_layer_is_one_contiguous_region_of_the_advertised_size(tiny) -> None:
    runner = ModelRunner(LlamaModel(tiny.config, tiny.weights), 4, BLOCK_SIZE)
    c = tiny.config
    assert c.kv_bytes_per_token == c.num_layers * 2 * c.num_kv_heads * c.head_dim * 4
    block = runner.kv_cache[1][2]
    assert block.is_contiguous()
    assert block.numel() * block.element_size() * c.num_layers == BLOCK_SIZE * c.kv_bytes_per_token


def test_forward_refuses_positions_past_the_rope_table(tiny) -> None:
    ids = torch.zeros(tiny.config.max_position_embeddings + 1, dtype=torch.int64)
    runner, seq = runner_with(LlamaModel(tiny.config, tiny.weights), ids, num_blocks=129)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        compute(runner, seq, len(ids))


def test_tiny_engine_greedy_equals_hf_greedy(tiny, tiny_hf, tiny_ids) -> None:
    prompt = tiny_ids[:12].tolist()
    assert oracle.greedy(LlamaModel(tiny.config, tiny.weights), prompt, 10) == hf_greedy(tiny_hf, prompt, 10)


def test_a_llama_directory_saved_by_hf_is_served_with_hfs_greedy_tokens(tiny, tmp_path) -> None:
    """A local HF-layout directory of the llama family (HF's own save_pretrained, another config and
    seed): `load_model(dir)` picks the family from config.json and serves HF's greedy tokens."""
    config = transformers.LlamaConfig(
        vocab_size=tiny.config.vocab_size, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
        num_attention_heads=6, num_key_value_heads=2, rope_theta=5000.0, max_position_embeddings=512,
        tie_word_embeddings=False, initializer_range=0.3, bos_token_id=tiny.config.bos_token_id,
        eos_token_id=tiny.config.eos_token_id,
    )
    torch.manual_seed(5)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path)
    tiny.tokenizer.save_hf(tmp_path)
    loaded = load_model(str(tmp_path), tmp_path)
    assert loaded.family == "llama" and loaded.config.num_kv_heads == 2 and loaded.config.rope_theta == 5000.0
    prompt = loaded.tokenizer.encode("Once upon a time, in a small village,")
    assert oracle.greedy(build_model(loaded), prompt, 12) == hf_greedy(hf, prompt, 12)


# ---------------------------------------------------------------- SmolLM2-135M-Instruct


@pytest.fixture(scope="session")
def smollm2_model(smollm2: LoadedModel) -> LlamaModel:
    return LlamaModel(smollm2.config, smollm2.weights)


@pytest.mark.smollm2
def test_smollm2_config_and_weights_equal_hfs_dequantization(smollm2, smollm2_hf) -> None:
    assert smollm2.config == LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
        num_kv_heads=3, head_dim=64, rope_theta=100000.0, rms_norm_eps=smollm2.config.rms_norm_eps,
        max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    assert smollm2.config.rms_norm_eps == pytest.approx(1e-5)
    hf_state = smollm2_hf.state_dict()
    for name, tensor in smollm2.weights.items():
        # q/k rows un-permuted from llama.cpp's rotary order exactly as HF does it
        assert torch.equal(tensor, hf_state[name]), name


@pytest.mark.smollm2
def test_smollm2_weights_hash_is_the_ggufs_sha256_and_the_cache_reloads_identically(smollm2) -> None:
    with open(smollm2_gguf_path(), "rb") as f:
        assert smollm2.weights_hash == hashlib.file_digest(f, "sha256").hexdigest()
    cache_dir = ModelSettings().weights_cache_dir
    assert list(cache_dir.glob(f"smollm2-{smollm2.weights_hash[:16]}-*.safetensors"))
    again = load_model("smollm2", cache_dir)
    assert again.weights.keys() == smollm2.weights.keys()
    assert all(torch.equal(again.weights[k], v) for k, v in smollm2.weights.items())


@pytest.mark.smollm2
@pytest.mark.parametrize(
    "prompt",
    [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, in a small village,",
    ],
)
def test_smollm2_first_16_greedy_tokens_equal_hf(smollm2, smollm2_model, smollm2_hf, prompt: str) -> None:
    ids = smollm2.tokenizer.encode(prompt)
    assert oracle.greedy(smollm2_model, ids, 16) == hf_greedy(smollm2_hf, ids, 16)


@pytest.mark.smollm2
def test_smollm2_chat_answers_paris_for_the_capital_of_france(smollm2, smollm2_model) -> None:
    tok = smollm2.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    generated = oracle.greedy(smollm2_model, tok.encode(prompt), 16)
    answer = tok.decode(
        generated[: generated.index(tok.eos_token_id)] if tok.eos_token_id in generated else generated
    )
    assert "Paris" in answer

"""Our Llama forward against HF transformers (the oracle): a seeded tiny Llama built from the same config and
weights, and SmolLM2-135M-Instruct loaded by HF from the same GGUF."""

from __future__ import annotations

import hashlib

import pytest
import torch

from pdserve.config import ModelSettings
from pdserve.engine.kv_cache import K_INDEX, V_INDEX, SequenceKVCache
from pdserve.engine.loader import LlamaConfig, LoadedModel, load_model, smollm2_gguf_path
from pdserve.engine.model import LlamaModel, generate_greedy

transformers = pytest.importorskip("transformers")

ATOL = 1e-4


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
    model = LlamaModel(tiny.config, tiny.weights)
    cache = SequenceKVCache(tiny.config, 64)
    logits = model.forward(tiny_ids, cache)
    assert logits.shape == (tiny.config.vocab_size,) and logits.dtype == torch.float32
    assert cache.num_tokens == len(tiny_ids)
    torch.testing.assert_close(logits, tiny_hf_logits[-1], atol=ATOL, rtol=0)
    # the logits are not trivially flat, so agreement means something
    assert tiny_hf_logits[-1].std() > 1.0


def test_token_by_token_decode_matches_hf_at_every_position(tiny, tiny_ids, tiny_hf_logits) -> None:
    model = LlamaModel(tiny.config, tiny.weights)
    cache = SequenceKVCache(tiny.config, 64)
    model.forward(tiny_ids[:8], cache)
    for position in range(8, len(tiny_ids)):
        logits = model.forward(tiny_ids[position : position + 1], cache)
        torch.testing.assert_close(logits, tiny_hf_logits[position], atol=ATOL, rtol=0)


def test_chunked_prefill_then_decode_equals_one_full_forward(tiny, tiny_ids) -> None:
    model = LlamaModel(tiny.config, tiny.weights)
    full_cache = SequenceKVCache(tiny.config, 64)
    full = model.forward(tiny_ids, full_cache)
    chunked_cache = SequenceKVCache(tiny.config, 64)
    for start, end in ((0, 13), (13, 29), (29, 47)):
        model.forward(tiny_ids[start:end], chunked_cache)
    last = model.forward(tiny_ids[47:], chunked_cache)
    torch.testing.assert_close(last, full, atol=ATOL, rtol=0)
    for layer in range(tiny.config.num_layers):
        torch.testing.assert_close(
            chunked_cache.layers[layer][:48], full_cache.layers[layer][:48], atol=ATOL, rtol=0
        )


def test_kv_cache_holds_the_keys_and_values_hf_caches(tiny, tiny_hf, tiny_ids) -> None:
    model = LlamaModel(tiny.config, tiny.weights)
    cache = SequenceKVCache(tiny.config, 64)
    model.forward(tiny_ids, cache)
    with torch.no_grad():
        hf_cache = tiny_hf(tiny_ids[None], use_cache=True).cache
    for layer in range(tiny.config.num_layers):
        hf_k = hf_cache.layers[layer].keys[0].transpose(0, 1)  # [T, kv_heads, head_dim], after rope
        hf_v = hf_cache.layers[layer].values[0].transpose(0, 1)
        torch.testing.assert_close(cache.layers[layer][:48, K_INDEX], hf_k, atol=ATOL, rtol=0)
        torch.testing.assert_close(cache.layers[layer][:48, V_INDEX], hf_v, atol=ATOL, rtol=0)
        assert cache.layers[layer][48:].abs().sum() == 0  # nothing written past num_tokens


def test_layer_hook_runs_once_per_layer_in_order_after_that_layers_kv_is_written(tiny, tiny_ids) -> None:
    model = LlamaModel(tiny.config, tiny.weights)
    cache = SequenceKVCache(tiny.config, 64)
    model.forward(tiny_ids[:10], cache)
    seen: list[int] = []

    def hook(layer: int) -> None:
        region = cache.layers[layer][10:20]
        assert region.is_contiguous() and region.abs().sum() > 0  # written before the hook
        if layer + 1 < tiny.config.num_layers:
            assert cache.layers[layer + 1][10:20].abs().sum() == 0  # the next layer is not yet computed
        seen.append(layer)

    model.forward(tiny_ids[10:20], cache, layer_hook=hook)
    assert seen == list(range(tiny.config.num_layers))
    assert cache.num_tokens == 20


def test_kv_cache_layer_slice_is_one_contiguous_region_of_the_advertised_size(tiny) -> None:
    cache = SequenceKVCache(tiny.config, 32)
    c = tiny.config
    assert cache.nbytes_per_token_per_layer() == 2 * c.num_kv_heads * c.head_dim * 4
    region = cache.layers[1][5:9]
    assert region.is_contiguous()
    assert region.numel() * region.element_size() == 4 * cache.nbytes_per_token_per_layer()


def test_forward_refuses_tokens_past_the_cache_and_leaves_it_unchanged(tiny, tiny_ids) -> None:
    model = LlamaModel(tiny.config, tiny.weights)
    cache = SequenceKVCache(tiny.config, 16)
    model.forward(tiny_ids[:10], cache)
    with pytest.raises(ValueError, match="exceed"):
        model.forward(tiny_ids[10:20], cache)
    assert cache.num_tokens == 10


def test_tiny_generate_greedy_equals_hf_greedy(tiny, tiny_hf, tiny_ids) -> None:
    prompt = tiny_ids[:12].tolist()
    assert generate_greedy(LlamaModel(tiny.config, tiny.weights), prompt, 10) == hf_greedy(
        tiny_hf, prompt, 10
    )


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
    assert generate_greedy(smollm2_model, ids, 16) == hf_greedy(smollm2_hf, ids, 16)


@pytest.mark.smollm2
def test_smollm2_chat_answers_paris_for_the_capital_of_france(smollm2, smollm2_model) -> None:
    tok = smollm2.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    generated = generate_greedy(smollm2_model, tok.encode(prompt), 16)
    answer = tok.decode(
        generated[: generated.index(tok.eos_token_id)] if tok.eos_token_id in generated else generated
    )
    assert "Paris" in answer

"""`kimi-tiny`: a seeded tiny random Kimi Linear checkpoint that pdserve generates once and caches, in HF
layout (config.json in HF `KimiLinearConfig`'s names, model.safetensors in the release's tensor names,
and SmolLM2's tokenizer as tokenizer.json), so HF transformers loads the very same directory as the oracle
(`KimiLinearForCausalLM.from_pretrained(dir)`) and the API takes real text.

Six layers — KDA, KDA, MLA, KDA, KDA, MLA — the first MLP dense and the others MoE (8 experts in 2 groups,
top-2 from 1 group, one shared expert), hidden 64, SmolLM2's 49,152-token vocabulary: ~6.7 M parameters,
~27 MB.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from pdserve.engine.hf_checkpoint import write_checkpoint
from pdserve.engine.kimi_linear_config import DENSE, KDA, MLA, SPARSE, KimiLinearConfig
from pdserve.engine.tokenizer import Tokenizer

KIMI_TINY_SEED = 4321
_FORMAT = 1  # bump when the generated config, weights or files change


def kimi_tiny_config(tokenizer: Tokenizer) -> KimiLinearConfig:
    """The kimi-tiny architecture with `tokenizer`'s vocabulary and special ids."""
    return KimiLinearConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=6,
        layer_types=(KDA, KDA, MLA, KDA, KDA, MLA),
        mlp_layer_types=(DENSE,) + (SPARSE,) * 5,
        num_attention_heads=4,
        q_lora_rank=None,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        linear_num_heads=2,
        linear_head_dim=32,
        linear_conv_kernel_dim=4,
        num_local_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.446,
        rms_norm_eps=1e-5,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


def kimi_tiny_weights(config: KimiLinearConfig, seed: int) -> dict[str, torch.Tensor]:
    """Deterministic random fp32 weights for `config` in the release's tensor names, drawn from
    `torch.Generator(seed)` in a fixed order.

    Scales are larger than a trained model's init, and the decay moderate (A_log and dt_bias put
    -g ~ 0.01..0.2 per token), so attention is far from uniform, the recurrent state remembers across
    chunks, and a wrong mask, norm, gate or state changes the logits visibly.
    """
    g = torch.Generator().manual_seed(seed)
    h = config.hidden_size
    heads, d = config.linear_num_heads, config.linear_head_dim
    qkv = heads * d

    def normal(*shape: int, std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float32) * std + mean

    def uniform(*shape: int, low: float, high: float) -> torch.Tensor:
        return torch.rand(*shape, generator=g, dtype=torch.float32) * (high - low) + low

    def swiglu(prefix: str, width: int, names: tuple[str, str, str]) -> dict[str, torch.Tensor]:
        gate, up, down = names
        return {
            f"{prefix}{gate}.weight": normal(width, h, std=h**-0.5),
            f"{prefix}{up}.weight": normal(width, h, std=h**-0.5),
            f"{prefix}{down}.weight": normal(h, width, std=width**-0.5),
        }

    w = {"model.embed_tokens.weight": normal(config.vocab_size, h, std=1.0)}
    for i, kind in enumerate(config.layer_types):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        w[p + "input_layernorm.weight"] = normal(h, std=0.2, mean=1.0)
        if kind == KDA:
            for part in "qkv":
                w[a + f"{part}_proj.weight"] = normal(qkv, h, std=h**-0.5)
                w[a + f"{part}_conv1d.weight"] = normal(qkv, 1, config.linear_conv_kernel_dim, std=0.5)
            w[a + "f_a_proj.weight"] = normal(d, h, std=h**-0.5)
            w[a + "f_b_proj.weight"] = normal(qkv, d, std=0.3 * d**-0.5)
            w[a + "dt_bias"] = normal(qkv, std=0.3, mean=-2.0)
            w[a + "A_log"] = uniform(1, 1, heads, 1, low=0.1, high=1.0).log()
            w[a + "b_proj.weight"] = normal(heads, h, std=h**-0.5)
            w[a + "g_a_proj.weight"] = normal(d, h, std=h**-0.5)
            w[a + "g_b_proj.weight"] = normal(qkv, d, std=d**-0.5)
            w[a + "o_norm.weight"] = normal(d, std=0.2, mean=1.0)
            w[a + "o_proj.weight"] = normal(h, qkv, std=qkv**-0.5)
        else:
            mla_heads = config.num_attention_heads
            qk = config.qk_nope_head_dim + config.qk_rope_head_dim
            rank = config.kv_lora_rank
            if config.q_lora_rank is None:
                w[a + "q_proj.weight"] = normal(mla_heads * qk, h, std=2 * h**-0.5)
            else:
                w[a + "q_a_proj.weight"] = normal(config.q_lora_rank, h, std=h**-0.5)
                w[a + "q_a_layernorm.weight"] = normal(config.q_lora_rank, std=0.2, mean=1.0)
                w[a + "q_b_proj.weight"] = normal(
                    mla_heads * qk, config.q_lora_rank, std=2 * config.q_lora_rank**-0.5
                )
            w[a + "kv_a_proj_with_mqa.weight"] = normal(rank + config.qk_rope_head_dim, h, std=h**-0.5)
            w[a + "kv_a_layernorm.weight"] = normal(rank, std=0.2, mean=1.0)
            w[a + "kv_b_proj.weight"] = normal(
                mla_heads * (config.qk_nope_head_dim + config.v_head_dim), rank, std=2 * rank**-0.5
            )
            out = mla_heads * config.v_head_dim
            w[a + "o_proj.weight"] = normal(h, out, std=out**-0.5)
        w[p + "post_attention_layernorm.weight"] = normal(h, std=0.2, mean=1.0)
        m = p + "block_sparse_moe."
        if config.mlp_layer_types[i] == DENSE:
            w |= swiglu(m, config.intermediate_size, ("gate_proj", "up_proj", "down_proj"))
        else:
            w[m + "gate.weight"] = normal(config.num_local_experts, h, std=h**-0.5)
            w[m + "gate.e_score_correction_bias"] = normal(config.num_local_experts, std=0.1)
            for e in range(config.num_local_experts):
                w |= swiglu(f"{m}experts.{e}.", config.moe_intermediate_size, ("w1", "w3", "w2"))
            shared = config.moe_intermediate_size * config.n_shared_experts
            w |= swiglu(m + "shared_experts.", shared, ("gate_proj", "up_proj", "down_proj"))
    w["model.norm.weight"] = normal(h, std=0.2, mean=1.0)
    if not config.tie_word_embeddings:
        w["lm_head.weight"] = normal(config.vocab_size, h, std=h**-0.5)
    return w


def ensure_kimi_tiny(cache_dir: Path, tokenizer: Tokenizer) -> Path:
    """The kimi-tiny directory under `cache_dir` (`kimi-tiny-<digest>-v<format>`, the digest naming its
    config and seed), generated on the first call (~1 s) and reused after. Workers may start together:
    each writes its own temporary directory and renames it into place; a loser discards its own."""
    config = kimi_tiny_config(tokenizer)
    key = json.dumps([config.to_hf_dict(), KIMI_TINY_SEED, _FORMAT], sort_keys=True).encode()
    target = Path(cache_dir).expanduser() / f"kimi-tiny-{hashlib.sha256(key).hexdigest()[:16]}-v{_FORMAT}"
    if (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=target.name, suffix=".tmp"))
    try:
        write_checkpoint(tmp, config.to_hf_dict(), kimi_tiny_weights(config, KIMI_TINY_SEED))
        tokenizer.save_hf(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it owner-only; other users' workers may share the cache
        try:
            os.replace(tmp, target)
        except OSError:  # another process put it there first
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return target

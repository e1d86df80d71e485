"""A Kimi Linear checkpoint pdserve did not generate: HF transformers' own `save_pretrained` of a randomly
initialized `KimiLinearForCausalLM` of another shape and seed than kimi-tiny (a LoRA query, 3 MLA layers
of 5, a conv kernel of 3, no MoE groups, a wider init), with SmolLM2's tokenizer files beside it. Served
by the engine alone (tests/unit/test_engine_kimi_linear.py) and by a running stack
(tests/e2e/test_hybrid_stack.py), each against HF's greedy tokens on it."""

from __future__ import annotations

from pathlib import Path

SEED = 99


def save_foreign_kimi(path: Path) -> Path:
    """Write the checkpoint into `path` (config.json, model.safetensors, tokenizer files); returns `path`.
    Needs transformers (a test dependency)."""
    import torch
    import transformers

    from pdserve.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer("smollm2")
    config = transformers.KimiLinearConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=48,
        intermediate_size=96,
        moe_intermediate_size=24,
        num_hidden_layers=5,
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=12,
        num_local_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        n_shared_experts=1,
        linear_num_heads=3,
        linear_head_dim=16,
        linear_conv_kernel_dim=3,
        layer_types=[
            "full_attention",
            "linear_attention",
            "full_attention",
            "linear_attention",
            "full_attention",
        ],
        mlp_layer_types=["dense", "sparse", "sparse", "dense", "sparse"],
        initializer_range=0.3,
        max_position_embeddings=1024,
        pad_token_id=None,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(SEED)
    hf = transformers.KimiLinearForCausalLM(config).eval()
    hf.save_pretrained(path)
    tokenizer.save_hf(path)
    return path

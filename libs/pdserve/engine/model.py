"""Llama forward pass over one sequence and its KV cache (fp32, CPU), and a greedy reference generator.

Architecture as HF `transformers.models.llama.modeling_llama` (pre-norm decoder, RMSNorm, rotary Q/K,
grouped-query attention, SwiGLU MLP, optional tied LM head), with weights named as HF names them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from pdserve.engine.kv_cache import K_INDEX, V_INDEX, SequenceKVCache
from pdserve.engine.loader import LlamaConfig
from pdserve.kernels.attention import causal_attention
from pdserve.kernels.rms_norm import rms_norm
from pdserve.kernels.rope import apply_rope, rope_cos_sin


class _Layer:
    """One decoder layer's weights, looked up once so the forward loop does no dict work."""

    def __init__(self, weights: dict[str, torch.Tensor], index: int) -> None:
        p = f"model.layers.{index}."
        self.input_norm = weights[p + "input_layernorm.weight"]
        self.q = weights[p + "self_attn.q_proj.weight"]
        self.k = weights[p + "self_attn.k_proj.weight"]
        self.v = weights[p + "self_attn.v_proj.weight"]
        self.o = weights[p + "self_attn.o_proj.weight"]
        self.post_norm = weights[p + "post_attention_layernorm.weight"]
        self.gate = weights[p + "mlp.gate_proj.weight"]
        self.up = weights[p + "mlp.up_proj.weight"]
        self.down = weights[p + "mlp.down_proj.weight"]


class LlamaModel:
    """A Llama decoder that runs one sequence's next tokens against that sequence's SequenceKVCache.

    `weights` are fp32 tensors by HF name (see `loader`); they are used as given, not copied.
    Raises KeyError at construction when a weight is missing.
    """

    def __init__(self, config: LlamaConfig, weights: dict[str, torch.Tensor]) -> None:
        self.config = config
        self.embed = weights["model.embed_tokens.weight"]
        self.layers = [_Layer(weights, i) for i in range(config.num_layers)]
        self.final_norm = weights["model.norm.weight"]
        self.lm_head = self.embed if config.tie_word_embeddings else weights["lm_head.weight"]
        self.cos, self.sin = rope_cos_sin(config.max_position_embeddings, config.head_dim, config.rope_theta)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        cache: SequenceKVCache,
        layer_hook: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Run the next T tokens of the sequence; return the logits of the last one, [vocab_size] fp32.

        input_ids: [T] int64, at positions cache.num_tokens .. cache.num_tokens + T - 1 (T >= 1: a prefill
        chunk or one decode token). Writes their K (after rope) and V into `cache.layers[l][start:start+T]`
        and calls `layer_hook(l)` as soon as layer l's KV is written, before its attention runs, so a prefill
        worker can send layer l while layers l+1.. compute. Advances cache.num_tokens by T on success.
        Raises ValueError when T is 0 or the tokens would not fit in the cache or the rope table.
        """
        cfg = self.config
        num_new = input_ids.shape[0]
        start = cache.num_tokens
        end = start + num_new
        if num_new == 0:
            raise ValueError("forward needs at least one token")
        if end > cache.max_tokens or end > cfg.max_position_embeddings:
            raise ValueError(
                f"positions {start}..{end - 1} exceed the cache ({cache.max_tokens} tokens) "
                f"or max_position_embeddings ({cfg.max_position_embeddings})"
            )
        cos, sin = self.cos[start:end], self.sin[start:end]
        hidden = F.embedding(input_ids, self.embed)  # [T, hidden]
        for index, layer in enumerate(self.layers):
            x = rms_norm(hidden, layer.input_norm, cfg.rms_norm_eps)
            q = F.linear(x, layer.q).view(num_new, cfg.num_heads, cfg.head_dim)
            k = F.linear(x, layer.k).view(num_new, cfg.num_kv_heads, cfg.head_dim)
            v = F.linear(x, layer.v).view(num_new, cfg.num_kv_heads, cfg.head_dim)
            kv = cache.layers[index]
            kv[start:end, K_INDEX] = apply_rope(k, cos, sin)
            kv[start:end, V_INDEX] = v
            if layer_hook is not None:
                layer_hook(index)
            q = apply_rope(q, cos, sin)
            attn = causal_attention(q, kv[:end, K_INDEX], kv[:end, V_INDEX])
            hidden = hidden + F.linear(attn.reshape(num_new, cfg.num_heads * cfg.head_dim), layer.o)
            x = rms_norm(hidden, layer.post_norm, cfg.rms_norm_eps)
            hidden = hidden + F.linear(F.silu(F.linear(x, layer.gate)) * F.linear(x, layer.up), layer.down)
        cache.num_tokens = end
        # only the last token's logits are needed (sampling); skipping the rest saves T-1 LM-head GEMVs
        last = rms_norm(hidden[-1], self.final_norm, cfg.rms_norm_eps)
        return F.linear(last, self.lm_head)


def generate_greedy(model: LlamaModel, prompt_ids: Sequence[int], max_tokens: int) -> list[int]:
    """Greedy decoding in one process with no transfer: the reference the disaggregated path must equal.

    Prefills `prompt_ids` in one forward, then decodes one token at a time; returns exactly `max_tokens`
    generated ids (no stop on EOS, so comparisons have a fixed length).
    """
    cache = SequenceKVCache(model.config, len(prompt_ids) + max_tokens)
    logits = model.forward(torch.tensor(list(prompt_ids), dtype=torch.int64), cache)
    generated: list[int] = []
    for _ in range(max_tokens):
        token = int(torch.argmax(logits))
        generated.append(token)
        if len(generated) < max_tokens:
            logits = model.forward(torch.tensor([token], dtype=torch.int64), cache)
    return generated

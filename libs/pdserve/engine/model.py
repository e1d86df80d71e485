"""The Llama decoder: one forward over a batch of scheduled tokens and the paged KV cache (fp32).

Architecture as HF `transformers.models.llama.modeling_llama` (pre-norm decoder, RMSNorm, rotary Q/K,
grouped-query attention, SwiGLU MLP, optional tied LM head), from weights named as HF names them. This is
the only forward pass pdserve has for the family: serving runs it through `ModelRunner`, and the tests
check it against HF through the same path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from pdserve.engine.device import CPU
from pdserve.engine.forward_batch import ForwardBatch
from pdserve.engine.linear import SKINNY, Linear, fused, gated, path_of
from pdserve.engine.model_config import LlamaConfig
from pdserve.engine.model_family import CacheSpec, LayerHook, placed
from pdserve.engine.state_pool import StatePool
from pdserve.kernels.llama_decode import DecodeLayers, LayerWeights
from pdserve.kernels.paged_attention import paged_attention, store_kv
from pdserve.kernels.rms_norm import rms_norm
from pdserve.kernels.rope import apply_rope, rope_cos_sin

# LayerHook (model_family.py): (layer, its pool [num_blocks, block_size, 2, kv_heads, head_dim])
__all__ = ["LayerHook", "LlamaModel"]


class _Layer:
    """One decoder layer's weights: Q, K and V projections fused into one GEMM, gate and up into another."""

    def __init__(self, weight: Callable[[str], torch.Tensor], index: int) -> None:
        p = f"model.layers.{index}."
        self.input_norm = weight(p + "input_layernorm.weight")
        self.qkv = fused(*(weight(p + f"self_attn.{n}_proj.weight") for n in "qkv"))
        self.o = Linear(weight(p + "self_attn.o_proj.weight"))
        self.post_norm = weight(p + "post_attention_layernorm.weight")
        self.gate_up = gated(weight(p + "mlp.gate_proj.weight"), weight(p + "mlp.up_proj.weight"))
        self.down = Linear(weight(p + "mlp.down_proj.weight"))


class LlamaModel:
    """A Llama decoder over a paged KV cache, on `device` in `dtype` (fp32 on CPU; see `device.py`).

    `weights` are tensors by HF name (see `loader`), copied to `device` and `dtype` (used as given when they
    already are); the projections are repacked (`linear`). Every tensor a forward allocates lives on
    `device` too. Raises KeyError at construction when a weight is missing.
    """

    def __init__(
        self,
        config: LlamaConfig,
        weights: dict[str, torch.Tensor],
        device: torch.device = CPU,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        weight = placed(weights, self.device, dtype)
        self.embed = weight("model.embed_tokens.weight")
        self.layers = [_Layer(weight, i) for i in range(config.num_layers)]
        self.final_norm = weight("model.norm.weight")
        self.lm_head = Linear(self.embed if config.tie_word_embeddings else weight("lm_head.weight"))
        # computed in fp32 on the CPU (as HF's rotary embedding), then moved: the same tables everywhere
        cos, sin = rope_cos_sin(config.max_position_embeddings, config.head_dim, config.rope_theta)
        self.cos, self.sin = cos.to(self.device, dtype), sin.to(self.device, dtype)
        self.decode_layers = self._decode_layers()

    def _decode_layers(self) -> DecodeLayers | None:
        """The layers as one C call for pure decode steps (kernels/llama_decode.py), where every projection
        has the C kernel's packed copy; None otherwise."""
        linears = [(layer.qkv, layer.o, layer.gate_up, layer.down) for layer in self.layers]
        panels = [tuple(linear.panels for linear in four) for four in linears]
        if not panels or any(p is None for four in panels for p in four):
            return None
        cfg = self.config
        return DecodeLayers.for_model(
            [LayerWeights(layer.input_norm, layer.post_norm, *four)  # type: ignore[arg-type]
             for layer, four in zip(self.layers, panels, strict=True)],
            cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.rms_norm_eps)

    def cache_spec(self) -> CacheSpec:
        """Every layer paged: one token's row of a layer is its K and V, [2, num_kv_heads, head_dim]."""
        cfg = self.config
        return CacheSpec(cfg.num_layers, (2, cfg.num_kv_heads, cfg.head_dim))

    @torch.inference_mode()
    def forward(
        self, batch: ForwardBatch, kv_cache: list[torch.Tensor], layer_hook: LayerHook | None = None,
        states: StatePool | None = None,
    ) -> torch.Tensor:
        """Compute `batch`'s tokens, writing their K (after rope) and V into their slots of `kv_cache`
        (one pool per layer, [num_blocks, block_size, 2, num_kv_heads, head_dim] fp32), and return the
        logits of the rows `batch.logits_indices`: [len(logits_indices), vocab_size] fp32.

        `layer_hook(l, kv_cache[l])` runs as soon as layer l's new KV is stored, before its attention, so a
        prefill worker can send layer l while layers l+1.. compute. `states` is unused (no recurrent state).
        """
        cfg = self.config
        num_tokens = batch.input_ids.shape[0]
        num_qk = cfg.num_heads + cfg.num_kv_heads
        cos, sin = self.cos[batch.positions], self.sin[batch.positions]
        store_rows, store_slots = batch.store_slots()
        hidden = F.embedding(batch.input_ids, self.embed)  # [T, hidden]
        if (self.decode_layers is not None and layer_hook is None and store_rows is None
                and batch.attention.decode_seqs is None and path_of(num_tokens) == SKINNY):
            # every sequence one new token, every GEMM on the C kernel: the layers below in one C call
            self.decode_layers.run(hidden, cos, sin, store_slots, batch.attention, kv_cache)
            return self._logits(hidden, batch)
        for index, layer in enumerate(self.layers):
            x = rms_norm(hidden, layer.input_norm, cfg.rms_norm_eps)
            qkv = layer.qkv(x).view(num_tokens, num_qk + cfg.num_kv_heads, cfg.head_dim)
            qk = apply_rope(qkv[:, :num_qk], cos, sin)  # q and k heads rotated together
            k, v = qk[:, cfg.num_heads :], qkv[:, num_qk:]
            if store_rows is not None:
                k, v = k[store_rows], v[store_rows]
            store_kv(kv_cache[index], store_slots, k, v)
            if layer_hook is not None:
                layer_hook(index, kv_cache[index])
            attn = paged_attention(qk[:, : cfg.num_heads], kv_cache[index], batch.attention)
            hidden = layer.o.add(attn.reshape(num_tokens, cfg.num_heads * cfg.head_dim), hidden)
            x = rms_norm(hidden, layer.post_norm, cfg.rms_norm_eps)
            hidden = layer.down.add(layer.gate_up(x), hidden)  # gate_up: silu(gate) * up
        return self._logits(hidden, batch)

    def _logits(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        # only each sequence's last new token is sampled from: the LM head runs on those rows alone
        last = rms_norm(hidden[batch.logits_indices], self.final_norm, self.config.rms_norm_eps)
        return self.lm_head(last)

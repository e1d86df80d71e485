"""A model's architecture hyper-parameters, as the checkpoint's config states them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LlamaConfig:
    """Llama architecture hyper-parameters (HF `LlamaConfig` field meanings; sizes in elements/tokens)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int
    eos_token_id: int

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of one token's K and V over all layers, fp32: num_layers * 2 * kv_heads * head_dim * 4."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * 4

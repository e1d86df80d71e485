"""A model's architecture hyper-parameters, as the checkpoint's config states them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> LlamaConfig:
        """From an HF Llama config.json (`rope_theta` at the top level, or in transformers 5's
        `rope_parameters`). Raises ValueError for another model_type or a rope scaling other than the
        default; KeyError for a missing key."""
        if raw.get("model_type") != "llama":
            raise ValueError(f"model_type {raw.get('model_type')!r} is not llama")
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError(f"rope scaling {rope} is not supported")
        heads, hidden = int(raw["num_attention_heads"]), int(raw["hidden_size"])
        eos = raw["eos_token_id"]
        return cls(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rope_theta=float(raw.get("rope_theta", rope.get("rope_theta", 10000.0))),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw["max_position_embeddings"]),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=int(raw["bos_token_id"]),
            eos_token_id=int(eos[0] if isinstance(eos, list) else eos),
        )

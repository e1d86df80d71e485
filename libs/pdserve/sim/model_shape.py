"""What the roofline needs of a model: FLOPs per token, weight bytes, KV bytes per token, attention FLOPs
per (query, key) pair.

Dense-transformer counts (Kaplan et al. 2020, "Scaling Laws for Neural Language Models", §2.1: a forward
costs 2·N FLOPs per token for N non-embedding parameters, plus 2·n_layer·n_ctx·d_attn for attention):
every weight matrix is one multiply-add per token, the embedding is a lookup (no FLOPs), the LM head is
a GEMM; attention is QKᵀ and PV, 2 multiply-adds per head dimension per pair, so 4·layers·heads·head_dim
FLOPs per pair. KV per token: layers · 2 (K and V) · kv_heads · head_dim · dtype bytes.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from pdserve.engine.model_config import LlamaConfig
from pdserve.hardware.models import PUBLISHED_MODELS


class ModelShape(BaseModel):
    """A model as the cost model sees it. Bytes at `dtype_bytes` per weight and per KV element;
    `state_bytes_per_request`: recurrent state a hybrid hands off whole after prefill (0 for Llama);
    `source`: where the sizes come from (a config.json)."""

    model_config = ConfigDict(frozen=True)

    name: str
    family: str
    num_layers: int
    hidden_size: int
    num_heads: int
    head_dim: int
    body_params: int  # every parameter a token multiplies by, LM head excluded, embedding excluded
    head_params: int  # the LM head (vocab × hidden)
    embedding_params: int
    kv_bytes_per_token: int
    state_bytes_per_request: int = 0
    dtype_bytes: int = 4
    source: str = ""

    @property
    def weight_bytes(self) -> int:
        """Bytes read once per forward: every weight (a tied head counts once)."""
        return (self.body_params + self.head_params) * self.dtype_bytes

    @property
    def flops_per_token(self) -> float:
        """Body + LM head: 2 FLOPs per weight per token (the head once per sampled token is folded in:
        an upper bound for prefill, exact for decode)."""
        return 2.0 * (self.body_params + self.head_params)

    @property
    def attention_flops_per_pair(self) -> float:
        return 4.0 * self.num_layers * self.num_heads * self.head_dim

    def at_dtype(self, dtype_bytes: int) -> ModelShape:
        """The same model with weights and KV in `dtype_bytes` bytes per element (e.g. 2 for bf16)."""
        kv = self.kv_bytes_per_token * dtype_bytes // self.dtype_bytes
        state = self.state_bytes_per_request * dtype_bytes // self.dtype_bytes
        return self.model_copy(
            update={"dtype_bytes": dtype_bytes, "kv_bytes_per_token": kv, "state_bytes_per_request": state}
        )


def llama_shape(name: str, cfg: LlamaConfig, dtype_bytes: int, source: str) -> ModelShape:
    """A Llama (GQA) decoder's shape from its config, weights and KV at `dtype_bytes` per element."""
    hidden, heads, kv_heads, head_dim = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    attn = hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + heads * head_dim * hidden
    mlp = 3 * hidden * cfg.intermediate_size
    return ModelShape(
        name=name,
        family="llama",
        num_layers=cfg.num_layers,
        hidden_size=hidden,
        num_heads=heads,
        head_dim=head_dim,
        body_params=cfg.num_layers * (attn + mlp),
        head_params=cfg.vocab_size * hidden,
        embedding_params=0 if cfg.tie_word_embeddings else cfg.vocab_size * hidden,
        kv_bytes_per_token=cfg.num_layers * 2 * kv_heads * head_dim * dtype_bytes,
        dtype_bytes=dtype_bytes,
        source=source,
    )


# The published configs (hardware/models.py), bf16 as served on GPUs.
PUBLISHED: dict[str, ModelShape] = {
    name: llama_shape(name, model.config, 2, model.source) for name, model in PUBLISHED_MODELS.items()
}


def published_shape(name: str) -> ModelShape:
    """A published model's shape. Raises KeyError listing the known names."""
    try:
        return PUBLISHED[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(PUBLISHED)}") from None

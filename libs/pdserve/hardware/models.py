"""Published model configs that pdserve cannot load here but reasons about (the advisor's transfer
economics, the simulator's roofline): each as the engine's own `LlamaConfig`, with the config.json it is
written out from. One place, so the advisor and the simulator speak of the same model.
"""

from __future__ import annotations

from typing import NamedTuple

from pdserve.engine.model_config import LlamaConfig


class PublishedModel(NamedTuple):
    """A model card's config.json as a `LlamaConfig`, and that file's address."""

    config: LlamaConfig
    source: str


LLAMA_3_8B = PublishedModel(
    LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=8192,
        tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
    ),
    "https://huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/config.json",
)

# As released by Meta, April 2024.
LLAMA_3_70B = PublishedModel(
    LlamaConfig(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64,
        num_kv_heads=8, head_dim=128, rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=8192,
        tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
    ),
    "https://huggingface.co/meta-llama/Meta-Llama-3-70B/blob/main/config.json",
)

PUBLISHED_MODELS: dict[str, PublishedModel] = {"llama-3-8b": LLAMA_3_8B, "llama-3-70b": LLAMA_3_70B}

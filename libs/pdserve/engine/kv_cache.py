"""The KV cache of one sequence: preallocated, one contiguous tensor per layer, token-major."""

from __future__ import annotations

import torch

from pdserve.engine.loader import LlamaConfig

K_INDEX, V_INDEX = 0, 1


class SequenceKVCache:
    """Keys and values of one sequence's first `num_tokens` tokens, for every layer.

    `layers[l]`: [max_tokens, 2, num_kv_heads, head_dim] fp32, index 0 = K (after rope), 1 = V. Token-major,
    so the KV of tokens a..b of layer l, `layers[l][a:b]`, is one contiguous region of
    `(b - a) * nbytes_per_token_per_layer()` bytes: what a KV transfer sends and receives as is.
    `num_tokens` counts filled tokens; the model writes tokens num_tokens.. and advances it. Memory is
    allocated once here (zeros), num_layers * max_tokens * nbytes_per_token_per_layer() bytes in all.
    """

    def __init__(self, config: LlamaConfig, max_tokens: int) -> None:
        if max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        self.config = config
        self.max_tokens = max_tokens
        self.layers: list[torch.Tensor] = [
            torch.zeros(max_tokens, 2, config.num_kv_heads, config.head_dim, dtype=torch.float32)
            for _ in range(config.num_layers)
        ]
        self.num_tokens = 0

    def nbytes_per_token_per_layer(self) -> int:
        """Bytes of one token's K and V in one layer: 2 * num_kv_heads * head_dim * 4 (fp32)."""
        return 2 * self.config.num_kv_heads * self.config.head_dim * self.layers[0].element_size()

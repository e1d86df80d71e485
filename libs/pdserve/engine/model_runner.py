"""Runs the model over a scheduled batch: owns the paged KV cache and builds each forward's inputs."""

from __future__ import annotations

import torch

from pdserve.engine.forward_batch import ForwardBatch
from pdserve.engine.model import LayerHook, LlamaModel
from pdserve.engine.scheduler import ScheduledSeq
from pdserve.kernels.paged_attention import attention_metadata


class ModelRunner:
    """Owns the KV pool and runs `LlamaModel` over scheduled sequences, on the model's device.

    `kv_cache[l]`: [num_blocks, block_size, 2, num_kv_heads, head_dim] in the model's dtype (K at index 0
    of dim 2, after rope; V at 1), allocated once (zeros): num_blocks * block_size *
    `LlamaConfig.kv_bytes_per_token` bytes in fp32. A block of one layer is one contiguous region,
    token-major: what a transfer packs.
    """

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int) -> None:
        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.kv_cache = [
            torch.zeros(num_blocks, block_size, 2, cfg.num_kv_heads, cfg.head_dim, dtype=model.dtype,
                        device=model.device)
            for _ in range(cfg.num_layers)
        ]

    def prepare(self, batch: list[ScheduledSeq]) -> ForwardBatch:
        """The forward inputs of `batch`: sequence i's new tokens are `token_ids[num_computed_tokens :
        num_computed_tokens + num_new_tokens]`, in slots of its block table (which must cover them).
        Raises ValueError for an empty batch or a position past the model's rope table."""
        if not batch:
            raise ValueError("a forward needs at least one scheduled sequence")
        max_positions = self.model.config.max_position_embeddings
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        context_lens: list[int] = []
        query_lens: list[int] = []
        for seq, n in batch:
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            table = seq.block_table
            slots += (table[p // bs] * bs + p % bs for p in range(start, end))
            context_lens.append(end)
            query_lens.append(n)
        if max(context_lens) > max_positions:
            raise ValueError(f"position {max(context_lens) - 1} past max_position_embeddings {max_positions}")
        max_blocks = max(len(seq.block_table) for seq, _ in batch)
        device = self.model.device

        def tensor(values: list) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        block_tables = tensor([s.block_table + [0] * (max_blocks - len(s.block_table)) for s, _ in batch])
        meta = attention_metadata(block_tables, context_lens, query_lens, bs, self.model.dtype)
        return ForwardBatch(
            input_ids=tensor(input_ids),
            positions=tensor(positions),
            slot_mapping=tensor(slots),
            attention=meta,
            logits_indices=tensor(query_lens).cumsum(0) - 1,
        )

    def execute(self, batch: list[ScheduledSeq], layer_hook: LayerHook | None = None) -> torch.Tensor:
        """Compute every scheduled sequence's new tokens; return the logits of each one's last new token,
        [len(batch), vocab_size] fp32, in batch order. Does not advance `num_computed_tokens` (the engine
        does). Raises ValueError for an empty batch or positions past the rope table."""
        return self.model.forward(self.prepare(batch), self.kv_cache, layer_hook)

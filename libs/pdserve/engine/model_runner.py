"""Runs the model over a scheduled batch: owns the paged KV cache and builds each forward's inputs."""

from __future__ import annotations

import torch

from pdserve.engine.forward_batch import ForwardBatch
from pdserve.engine.model import LayerHook, LlamaModel
from pdserve.engine.scheduler import ScheduledSeq
from pdserve.kernels.paged_attention import attention_metadata


class ModelRunner:
    """Owns the KV pool and runs `LlamaModel` over scheduled sequences.

    `kv_cache[l]`: [num_blocks, block_size, 2, num_kv_heads, head_dim] fp32 (K at index 0 of dim 2, after
    rope; V at 1), allocated once (zeros): num_blocks * block_size * `LlamaConfig.kv_bytes_per_token` bytes.
    A block of one layer is one contiguous region, token-major: what a transfer packs.
    """

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int) -> None:
        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.kv_cache = [
            torch.zeros(num_blocks, block_size, 2, cfg.num_kv_heads, cfg.head_dim)
            for _ in range(cfg.num_layers)
        ]

    def prepare(self, batch: list[ScheduledSeq]) -> ForwardBatch:
        """The forward inputs of `batch`: sequence i's new tokens are `token_ids[num_computed_tokens :
        num_computed_tokens + num_new_tokens]`, in slots of its block table (which must cover them).
        Raises ValueError for an empty batch."""
        if not batch:
            raise ValueError("a forward needs at least one scheduled sequence")
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
        max_blocks = max(len(seq.block_table) for seq, _ in batch)
        block_tables = torch.tensor([seq.block_table + [0] * (max_blocks - len(seq.block_table))
                                     for seq, _ in batch], dtype=torch.int64)
        meta = attention_metadata(block_tables, context_lens, query_lens, bs)
        return ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            attention=meta,
            logits_indices=torch.tensor(query_lens, dtype=torch.int64).cumsum(0) - 1,
        )

    def execute(self, batch: list[ScheduledSeq], layer_hook: LayerHook | None = None) -> torch.Tensor:
        """Compute every scheduled sequence's new tokens; return the logits of each one's last new token,
        [len(batch), vocab_size] fp32, in batch order. Does not advance `num_computed_tokens` (the engine
        does). Raises ValueError for an empty batch or positions past the rope table."""
        return self.model.forward(self.prepare(batch), self.kv_cache, layer_hook)

"""One forward of the Llama model over a mixed batch (prefill chunks and decode tokens), paged KV cache."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from pdserve.engine.model import LlamaModel
from pdserve.engine.scheduler import ScheduledSeq
from pdserve.kernels.kv_pack import token_slots
from pdserve.kernels.paged_attention import paged_attention, store_kv
from pdserve.kernels.rms_norm import rms_norm
from pdserve.kernels.rope import apply_rope

# called once per layer, after that layer's new K/V are stored and before its attention runs
LayerHook = Callable[[int, torch.Tensor], None]


class ModelRunner:
    """Owns the KV pool and runs `LlamaModel`'s weights over scheduled sequences.

    `kv_cache[l]`: [num_blocks, block_size, 2, num_kv_heads, head_dim] fp32 (K at index 0 of dim 2, after
    rope; V at 1), allocated once (zeros) — num_layers * num_blocks * block_size * 2 * kv_heads * head_dim
    * 4 bytes. A block of one layer is one contiguous region, token-major: what a transfer packs.
    """

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int) -> None:
        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.kv_cache = [
            torch.zeros(num_blocks, block_size, 2, cfg.num_kv_heads, cfg.head_dim)
            for _ in range(cfg.num_layers)
        ]

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledSeq], layer_hook: LayerHook | None = None) -> torch.Tensor:
        """Compute every scheduled sequence's new tokens; return the logits of each one's last new token,
        [len(batch), vocab_size] fp32, in batch order.

        Sequence i's new tokens are `token_ids[num_computed_tokens : num_computed_tokens + num_new_tokens]`;
        its block table must already cover them. Does not advance `num_computed_tokens` (the engine does).
        Raises ValueError for an empty batch or positions past the rope table.
        """
        if not batch:
            raise ValueError("execute needs at least one scheduled sequence")
        m, cfg, bs = self.model, self.model.config, self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[torch.Tensor] = []
        context_lens: list[int] = []
        query_lens: list[int] = []
        for seq, n in batch:
            start = seq.num_computed_tokens
            input_ids += seq.token_ids[start : start + n]
            positions += range(start, start + n)
            slots.append(token_slots(seq.block_table, start, start + n, bs))
            context_lens.append(start + n)
            query_lens.append(n)
        if max(context_lens) > cfg.max_position_embeddings:
            raise ValueError(f"position {max(context_lens) - 1} past max_position_embeddings")
        max_blocks = max(len(seq.block_table) for seq, _ in batch)
        block_tables = torch.zeros(len(batch), max_blocks, dtype=torch.int64)
        for i, (seq, _) in enumerate(batch):
            block_tables[i, : len(seq.block_table)] = torch.tensor(seq.block_table, dtype=torch.int64)
        slot_mapping = torch.cat(slots)
        pos = torch.tensor(positions, dtype=torch.int64)
        cos, sin = m.cos[pos], m.sin[pos]
        num_tokens = len(input_ids)
        hidden = F.embedding(torch.tensor(input_ids, dtype=torch.int64), m.embed)  # [T, hidden]
        for index, layer in enumerate(m.layers):
            x = rms_norm(hidden, layer.input_norm, cfg.rms_norm_eps)
            q = F.linear(x, layer.q).view(num_tokens, cfg.num_heads, cfg.head_dim)
            k = F.linear(x, layer.k).view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
            v = F.linear(x, layer.v).view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
            store_kv(self.kv_cache[index], slot_mapping, apply_rope(k, cos, sin), v)
            if layer_hook is not None:
                layer_hook(index, self.kv_cache[index])
            attn = paged_attention(
                apply_rope(q, cos, sin), self.kv_cache[index], block_tables, context_lens, query_lens
            )
            # in place where the operand is this forward's own: the same arithmetic without a fresh
            # [tokens, intermediate] buffer per op (large allocations page-fault anew each time)
            hidden.add_(F.linear(attn.reshape(num_tokens, cfg.num_heads * cfg.head_dim), layer.o))
            x = rms_norm(hidden, layer.post_norm, cfg.rms_norm_eps)
            gate = F.silu(F.linear(x, layer.gate), inplace=True).mul_(F.linear(x, layer.up))
            hidden.add_(F.linear(gate, layer.down))
        last = torch.tensor(query_lens).cumsum(0) - 1
        return F.linear(rms_norm(hidden[last], m.final_norm, cfg.rms_norm_eps), m.lm_head)

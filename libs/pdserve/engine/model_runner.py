"""Runs the model over a scheduled batch: owns the paged KV cache (and, for a model with recurrent state,
holds its state pool) and builds each forward's inputs."""

from __future__ import annotations

import torch

from pdserve.engine.forward_batch import ForwardBatch, StateBatch
from pdserve.engine.model_family import EngineModel, LayerHook
from pdserve.engine.scheduler import ScheduledSeq
from pdserve.engine.state_pool import CheckpointSave, StatePool
from pdserve.kernels.paged_attention import attention_metadata


class ModelRunner:
    """Owns the KV pool and runs the model (any family, `model_family.EngineModel`) over scheduled
    sequences, on the model's device.

    `kv_cache[l]`: [num_blocks, block_size, *paged_row_shape] for each of the model's paged layers
    (`cache_spec()`), in the model's dtype, allocated once (zeros) — for Llama [num_blocks, block_size, 2,
    num_kv_heads, head_dim] (K at index 0 of dim 2, after rope; V at 1), num_blocks * block_size *
    `LlamaConfig.kv_bytes_per_token` bytes in fp32. A block of one layer is one contiguous region,
    token-major: what a transfer packs. `state_pool`: the per-request state of a model that has one
    (the engine's `StatePool`; None otherwise).
    """

    def __init__(
        self, model: EngineModel, num_blocks: int, block_size: int, state_pool: StatePool | None = None
    ) -> None:
        spec = model.cache_spec()
        if (spec.state is None) != (state_pool is None):
            raise ValueError("a state pool is needed exactly when the model has state layers")
        self.model = model
        self.block_size = block_size
        self.state_pool = state_pool
        self.kv_cache = [
            torch.zeros(num_blocks, block_size, *spec.paged_row_shape, dtype=model.dtype, device=model.device)
            for _ in range(spec.num_paged_layers)
        ]

    def prepare(
        self, batch: list[ScheduledSeq], checkpoints: list[tuple[CheckpointSave, ...]] | None = None
    ) -> ForwardBatch:
        """The forward inputs of `batch`: sequence i's new tokens are `token_ids[num_computed_tokens :
        num_computed_tokens + num_new_tokens]`, in slots of its block table (which must cover them); the
        KV of those below `num_cached_tokens` (held in shared blocks) is not written again. `checkpoints`:
        the state pool's plan for this step (`StatePool.plan_checkpoints`), one entry per sequence.
        Raises ValueError for an empty batch or a position past the model's max_position_embeddings."""
        if not batch:
            raise ValueError("a forward needs at least one scheduled sequence")
        max_positions = self.model.config.max_position_embeddings
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        context_lens: list[int] = []
        query_lens: list[int] = []
        held: list[int] = []  # rows whose KV is already in a shared block
        for seq, n in batch:
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            if start < seq.num_cached_tokens:
                held += range(len(input_ids), len(input_ids) + min(end, seq.num_cached_tokens) - start)
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
        store_rows = None
        if held:
            held_set = set(held)
            store_rows = tensor([r for r in range(len(input_ids)) if r not in held_set])
        state = None
        if self.state_pool is not None:
            plan = checkpoints or [()] * len(batch)
            state = StateBatch(
                slots=[self._state_slot(seq) for seq, _ in batch],
                checkpoints=[tuple((c.offset, c.slot) for c in saves) for saves in plan],
            )
        return ForwardBatch(
            input_ids=tensor(input_ids),
            positions=tensor(positions),
            slot_mapping=tensor(slots),
            attention=meta,
            logits_indices=tensor(query_lens).cumsum(0) - 1,
            store_rows=store_rows,
            state=state,
        )

    def execute(
        self, batch: list[ScheduledSeq], layer_hook: LayerHook | None = None,
        checkpoints: list[tuple[CheckpointSave, ...]] | None = None,
    ) -> torch.Tensor:
        """Compute every scheduled sequence's new tokens; return the logits of each one's last new token,
        [len(batch), vocab_size] fp32, in batch order. Does not advance `num_computed_tokens` (the engine
        does). Raises ValueError for an empty batch or positions past the model's context."""
        forward_batch = self.prepare(batch, checkpoints)
        return self.model.forward(forward_batch, self.kv_cache, layer_hook, self.state_pool)

    @staticmethod
    def _state_slot(seq) -> int:
        if seq.state_slot is None:
            raise ValueError(f"{seq.request_id} holds no state slot")
        return seq.state_slot

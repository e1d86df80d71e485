"""The inputs of one forward: the scheduled sequences' new tokens back to back, with where their KV goes
and, for a model with recurrent state, where each sequence's state lives."""

from __future__ import annotations

from typing import NamedTuple

import torch

from pdserve.kernels.paged_attention import PagedAttentionMetadata


class StateBatch(NamedTuple):
    """Each scheduled sequence's state slot (`state_pool.StatePool`), in batch order: `slots[i]`;
    `checkpoints[i]`: (offset, checkpoint slot) pairs, offset in 1..its new tokens, ascending — after its
    first `offset` new tokens, the forward copies its slot into that checkpoint slot, every state layer."""

    slots: list[int]
    checkpoints: list[tuple[tuple[int, int], ...]]


class ForwardBatch(NamedTuple):
    """One forward of a mixed batch (prefill chunks and decode tokens), built by `ModelRunner`.

    `input_ids`, `positions`, `slot_mapping`: [num_tokens] int64 (slot = block_id * block_size + offset,
    vLLM's meaning); `attention`: where each sequence's attention reads its KV; `logits_indices`:
    [num_seqs] int64, each sequence's last new token's row (the one sampled from). `store_rows`: the rows
    whose KV the forward writes (None: every row; a row is left out when its KV is already held in a
    shared block — a hybrid sequence recomputing from a state checkpoint inside its KV prefix hit).
    `state`: None for a model without recurrent state.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    attention: PagedAttentionMetadata
    logits_indices: torch.Tensor
    store_rows: torch.Tensor | None = None
    state: StateBatch | None = None

    def store_slots(self) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(rows to write or None for all, their slots): what a forward's KV stores take."""
        if self.store_rows is None:
            return None, self.slot_mapping
        return self.store_rows, self.slot_mapping[self.store_rows]

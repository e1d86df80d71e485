"""The inputs of one forward: the scheduled sequences' new tokens back to back, with where their KV goes."""

from __future__ import annotations

from typing import NamedTuple

import torch

from pdserve.kernels.paged_attention import PagedAttentionMetadata


class ForwardBatch(NamedTuple):
    """One forward of a mixed batch (prefill chunks and decode tokens), built by `ModelRunner`.

    `input_ids`, `positions`, `slot_mapping`: [num_tokens] int64 (slot = block_id * block_size + offset,
    vLLM's meaning); `attention`: where each sequence's attention reads its KV; `logits_indices`:
    [num_seqs] int64, each sequence's last new token's row (the one sampled from).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    attention: PagedAttentionMetadata
    logits_indices: torch.Tensor

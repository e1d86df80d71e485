"""Pack a run of token rows out of a paged KV layer into one contiguous tensor, and scatter it back.

A KV transfer moves one layer's K and V for a run of tokens (docs/architecture.md §6: packed contiguous);
the sender packs the rows from wherever its blocks are, the receiver scatters them into its own blocks.
"""

from __future__ import annotations

import torch


def token_slots(
    block_table: list[int], start: int, end: int, block_size: int, device: torch.device | None = None
) -> torch.Tensor:
    """Slots (block_id * block_size + offset) of token positions start..end-1: [end - start] int64, on
    `device` (default CPU: where the KV pool it indexes lives).

    Raises IndexError when the block table is too short for `end` tokens.
    """
    positions = torch.arange(start, end, dtype=torch.int64, device=device)
    blocks = torch.tensor(block_table, dtype=torch.int64, device=device)[positions // block_size]
    return blocks * block_size + positions % block_size


def pack_kv(kv_layer: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows `slots` of one layer's pool, copied contiguous: [len(slots), 2, num_kv_heads, head_dim].

    kv_layer: [num_blocks, block_size, 2, num_kv_heads, head_dim]. The copy is the sender's own: the
    blocks may be reused as soon as this returns.
    """
    return kv_layer.view(-1, *kv_layer.shape[2:]).index_select(0, slots)


def unpack_kv(kv_layer: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """Write `rows` [len(slots), 2, num_kv_heads, head_dim] into slots `slots` of `kv_layer`, in place;
    `rows` may be in host memory while `kv_layer` is on a device (copied over first)."""
    kv_layer.view(-1, *kv_layer.shape[2:]).index_copy_(0, slots, rows.to(kv_layer.device))

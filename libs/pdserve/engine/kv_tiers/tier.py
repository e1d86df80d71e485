"""The protocol every KV tier below the paged pool implements (offload in host memory, disk, a shared store).

A tier holds whole blocks, each keyed by its chained block hash (`engine/block_hash.py`, which already folds
the sequence's `cache_salt`): equal keys mean equal prefixes, so a block found under a key can be copied into
any block of the pool and registered there under the same key. A tier that is shared between workers (the
store) adds the model's compatibility descriptor to the key itself; per-worker tiers need not.

A block as a tier sees it: one tensor `[num_paged_layers, block_size, *paged_row_shape]` in the model's dtype,
contiguous on the CPU — every paged layer's rows of that block, stacked (`ModelRunner.read_block`). For Llama,
`paged_row_shape` is `(2, num_kv_heads, head_dim)`.

Which blocks a tier receives is its `write_on`:
- "evict": a full cached block the pool evicts (its ref count 0, its slot taken for another block) is written
  down instead of dropped — the offload and disk tiers, a per-worker capacity extension (vLLM's CPU offload,
  SGLang's HiCache host tier).
- "compute": every full block is written once it is computed — the shared store, so other workers can read it
  however long it stays in this worker's pool.

At admission the engine looks a pool miss up in its tiers in order (`lookup`), copies the hit back into newly
allocated blocks (`get_into`) and registers them as cached, so the prefill skips them. A False from `get_into`
truncates the hit there: the rest is recomputed, never read wrong.

A tier that says `holds_checkpoints` also holds a hybrid model's recurrent-state checkpoints
(`engine/state_pool.py`) in a second key space, `space="checkpoint"`: the same three calls, keyed by the
chained hash of the block ending at the checkpoint, the value one slot's whole state packed into a uint8
tensor (`StatePool.pack_slot`: every state tensor of every layer, bytes concatenated). A key in one space
never answers for the other, and a tier's capacity counts the entries of both spaces together. Checkpoints
go where blocks go: evicted from the state pool's checkpoints to the write_on="evict" tiers, saved to the
write_on="compute" ones; at admission the longest one within the KV hit, longer than the pool's own, is
copied back into the sequence's state slot (`KVTierSet.load_checkpoint`).
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from typing import Literal, NamedTuple, Protocol, runtime_checkable

import torch

TierName = Literal["offload", "disk", "store"]
WriteOn = Literal["evict", "compute"]
KeySpace = Literal["kv", "checkpoint"]
"""What a tier key names: "kv" a KV block, "checkpoint" a recurrent-state checkpoint (see the module)."""


@runtime_checkable
class KVTier(Protocol):
    """A tier of KV blocks keyed by chained block hash. Implementations must be thread-safe: `put` runs in
    the tier set's writer thread (`tier_set.KVTierSet`) while the engine's thread calls `lookup` and
    `get_into`."""

    name: str
    """"offload" | "disk" | "store": the label in events (`PrefillCompleted.cached_tokens_by_tier`), metrics
    (`pdserve:prefix_cache_hits{tier=...}`) and KV events (`BlockStored.tier`)."""

    write_on: WriteOn
    """"evict": written when the pool evicts a full cached block (offload, disk); "compute": written once a
    full block is computed (store)."""

    holds_checkpoints: bool
    """Whether the tier takes `space="checkpoint"` (offload, disk: True; the store: when built with
    `checkpoint_bytes`, its values being of fixed sizes). A tier that does not ignores that space:
    `lookup` 0, `get_into` False, `put` a drop."""

    def lookup(self, block_hashes: Sequence[int], space: KeySpace = "kv") -> int:
        """How many leading hashes of `block_hashes` (a chain, first block first) this tier holds, 0..len.
        A hint: a later `get_into` may still miss (evicted meanwhile, corrupt). Never raises."""
        ...

    def put(self, block_hash: int, block: torch.Tensor, space: KeySpace = "kv") -> None:
        """Hold a copy of `block` ([num_paged_layers, block_size, *paged_row_shape], model dtype, contiguous
        CPU) under `block_hash`, with its checksum (`kv_tiers.checksum.block_digest`). The tier may refuse
        it or evict others (LRU) but never holds more than its capacity. The caller may reuse `block`
        once this returns. Never raises for a full or failing tier (it drops the block)."""
        ...

    def get_into(self, block_hash: int, out: torch.Tensor, space: KeySpace = "kv") -> bool:
        """Copy the block held under `block_hash` into `out` (same shape and dtype as put). False on a miss,
        a checksum mismatch (the bad copy is dropped) or any error: the caller recomputes; `out`'s
        contents are then unspecified. Never raises."""
        ...


class TierChange(NamedTuple):
    """One change to what a per-worker tier holds: `stored` True = `block_hash` now held, False = dropped
    (LRU eviction, corrupt copy), in key space `space`."""

    stored: bool
    block_hash: int
    space: KeySpace = "kv"


@runtime_checkable
class ReportsChanges(Protocol):
    """A tier that reports what it gained and lost, so the worker's KV events tell the router what it holds
    (`BlockStored` / `BlockRemoved` with `tier` = the tier's name). Per-worker tiers (offload, disk)
    implement it; a shared store reports its contents by its own means."""

    def take_changes(self) -> list[TierChange]:
        """Changes since the last call, oldest first."""
        ...


# How tiers are wired (the engine integration, engine/llm_engine.py and workers/core.py):
# `LLMEngine(model, config, stop_token_ids, tiers=[...])` takes the tiers in lookup order (offload, disk,
# store); the worker builds that list from its settings (`workers/kv_tiers.py`, `build_tiers`), where a new
# tier adds itself.


def leading_run(block_hashes: Sequence[int], held: Container[int] | Container[tuple[str, int]],
                space: KeySpace | None = None) -> int:
    """How many of `block_hashes`, from the first, are in `held`: a tier's `lookup` over what it holds
    (keyed by hash, or with `space` by (space, hash))."""
    for i, h in enumerate(block_hashes):
        if (h if space is None else (space, h)) not in held:
            return i
    return len(block_hashes)

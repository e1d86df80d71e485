"""The seam between the engine and a model family: what a model tells the engine it needs cached, and the
one forward the engine calls. Families: `llama` (`model.LlamaModel`) and `kimi_linear`
(`kimi_linear.KimiLinearModel`), chosen by the checkpoint's config.json `model_type` (`loader.build_model`).

The engine (`ModelRunner`, `LLMEngine`, `Scheduler`) knows no family: it allocates what `cache_spec()`
asks for — paged KV (`num_paged_layers` pools of `[num_blocks, block_size, *paged_row_shape]`, blocks
managed by the `BlockManager` with prefix caching) and, when `state` is set, a `StatePool` of per-request
state slots with checkpoints — and calls `forward(batch, kv_cache, layer_hook, states)`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch

from pdserve.engine.forward_batch import ForwardBatch
from pdserve.engine.state_pool import StateLayout, StatePool

# called once per paged layer, after that layer's new KV is stored and before its attention runs:
# (paged layer index, that layer's pool [num_blocks, block_size, *paged_row_shape])
LayerHook = Callable[[int, torch.Tensor], None]


class CacheSpec(NamedTuple):
    """What a model needs the engine to hold: `num_paged_layers` paged KV pools whose one token's row is
    `paged_row_shape` (Llama: (2, kv_heads, head_dim); Kimi Linear's MLA: (kv_lora_rank + rope_dim,)),
    and per-request recurrent state (`state`; None: the model has none)."""

    num_paged_layers: int
    paged_row_shape: tuple[int, ...]
    state: StateLayout | None = None

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of one token's paged KV over all paged layers in `dtype`."""
        numel = 1
        for size in self.paged_row_shape:
            numel *= size
        return self.num_paged_layers * numel * dtype.itemsize


class EngineModel(Protocol):
    """A model family's forward as the engine drives it. `config` has at least `vocab_size`,
    `max_position_embeddings`, `bos_token_id`, `eos_token_id`."""

    family: str
    config: Any
    device: torch.device
    dtype: torch.dtype

    def cache_spec(self) -> CacheSpec: ...

    def forward(
        self, batch: ForwardBatch, kv_cache: list[torch.Tensor], layer_hook: LayerHook | None = None,
        states: StatePool | None = None,
    ) -> torch.Tensor:
        """Compute `batch`'s tokens: write their KV into `kv_cache` (rows `batch.store_rows`), advance
        their state in `states` (slots `batch.state`, snapshotting its checkpoints), call `layer_hook`
        per paged layer once its KV is stored; return the logits of rows `batch.logits_indices`,
        [num_seqs, vocab_size] fp32."""
        ...


def placed(weights: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype
           ) -> Callable[[str], torch.Tensor]:
    """A lookup of `weights` by HF name that returns each tensor on `device` in `dtype` (the tensor itself
    when it already is). Raises KeyError for a missing name."""

    def weight(name: str) -> torch.Tensor:
        return weights[name].to(device=device, dtype=dtype)

    return weight

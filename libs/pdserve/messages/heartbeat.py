"""What a worker is and how loaded it is, published every heartbeat interval (pds.heartbeat.<id>):
`Heartbeat`, carrying its `CompatibilityDescriptor`."""

from __future__ import annotations

from pydantic import Field

from pdserve.messages.common import Message, Role


class CompatibilityDescriptor(Message):
    """What must match for a prefill worker's KV to be usable by a decode worker (docs/architecture.md §6)."""

    model: str
    weights_hash: str
    dtype: str
    block_size: int
    num_layers: int = Field(description="Paged KV layers a transfer carries (Llama: every layer; a hybrid: "
                            "its attention layers).")
    num_kv_heads: int = Field(0, description="Llama: KV heads per layer (0 for a family without them).")
    head_dim: int = Field(0, description="Llama: head dimension (0 for a family without one).")
    hash_seed: int
    layout_version: int
    family: str = Field("llama", description="The model family (`EngineModel.family`): 'llama' or "
                        "'kimi_linear'. Older workers omit it, and served only llama.")
    paged_row_shape: tuple[int, ...] = Field(
        (), description="One token's row of a paged KV layer (`CacheSpec.paged_row_shape`): Llama "
        "(2, kv_heads, head_dim), Kimi Linear's MLA (kv_lora_rank + rope_dim,).")
    state_layout: tuple[str, ...] = Field(
        (), description="Per-request recurrent state a handoff carries, one 'name[layers,*shape]:dtype' per "
        "tensor (`CacheSpec.state`); empty for a model without state.")
    memory: str = Field("cpu", description="Where the KV pool lives (the device type: 'cpu' or 'cuda'); "
                        "the transports move host memory, so only equal memory types pair.")


class Heartbeat(Message):
    worker_id: str
    role: Role
    descriptor: CompatibilityDescriptor
    num_running: int
    num_waiting: int
    kv_capacity_tokens: int
    kv_free_tokens: int
    ts: float

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
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hash_seed: int
    layout_version: int
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

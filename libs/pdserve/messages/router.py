"""The coordinator ↔ router placement command (pds.router.route: `RouteRequest` → `RouteDecision`) and
what the router publishes about a worker it cannot pair (`WorkerIncompatible`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from pdserve.messages.common import Message, Role
from pdserve.messages.heartbeat import CompatibilityDescriptor


class RouteRequest(Message):
    request_id: str
    num_prompt_tokens: int = Field(ge=1)
    prompt_token_ids: tuple[int, ...] = ()
    cache_salt: str | None = None


class CandidateCost(Message):
    worker_id: str
    role: Role
    cost: float
    active_requests: int
    kv_usage: float = Field(description="Fraction of KV capacity in use, 0..1.")
    # The KV router's cost terms (pdserve.routing.policy), in blocks of the worker's block size.
    cached_blocks: int = 0
    uncached_blocks: int = 0
    active_prefill_blocks: int = 0
    active_decode_blocks: int = 0
    checkpoint_blocks: int = Field(0, description="A hybrid's longest state checkpoint within the KV hit, "
                                   "in blocks (0 without one, or for a model without state).")
    cached_blocks_by_tier: dict[str, int] = Field(
        default_factory=dict, description="cached_blocks by the tier holding them ('pool', 'offload', ...).")


class RouteOutcome(BaseModel):
    """Where the router places a request, and what it decided from: defined once for the reply
    (`RouteDecision`) and the event that records it (`events.RequestRouted`)."""

    model_config = ConfigDict(frozen=True)

    mode: Literal["disaggregated", "local", "colocated"]
    prefill_worker_id: str
    decode_worker_id: str
    candidates: tuple[CandidateCost, ...]
    predicted_cached_tokens: int = 0
    best_cached_tokens: int = 0
    predicted_checkpoint_tokens: int = Field(
        0, description="A hybrid: the state checkpoint the chosen prefill worker resumes from (<= "
        "predicted_cached_tokens), so it computes prompt − this; 0 for a model without state.")
    policy: str = ""
    block_size: int = 0
    prompt_block_hashes: tuple[int, ...] = Field(
        (), description="The prompt's chained block hashes: what offline replay re-decides with.")


class RouteDecision(Message, RouteOutcome):
    request_id: str


class RouteBooked(Message):
    """A router placed `request_id`: what it booked on which workers (routing/active_load.py), published
    on `pds.router.booked` so that every other router books the same before its next decision."""

    router_id: str
    request_id: str
    prefill_worker_id: str
    prefill_blocks: int = Field(ge=0)
    decode_worker_id: str
    decode_blocks: int = Field(ge=0)


class WorkerIncompatible(Message):
    """Published by the router when a worker's descriptor matches no live worker of the other pool, so
    it is never paired (nor used) while that lasts. `differences`: field → (this worker's value, the
    first peer's value), as strings."""

    worker_id: str
    role: Role
    descriptor: CompatibilityDescriptor
    peers: tuple[str, ...]
    differences: dict[str, tuple[str, str]]

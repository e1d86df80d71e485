"""Every message that crosses a process boundary, and the NATS subject it travels on.

Each command subject has exactly one request type and one reply type. A handler that refuses a command
replies with `Rejected` instead (the bus raises it as `RejectedError` on the caller's side), so a caller
always gets either its reply type or a typed reason. Payloads are JSON (pydantic v2).

Subjects (prefix `pds` by default, configurable so tests can share a server):

| subject                          | request          | reply             | from → to               |
|----------------------------------|------------------|-------------------|-------------------------|
| pds.coord.submit                 | Submit           | Accepted          | gateway → coordinator   |
| pds.coord.abort                  | Abort            | Ack               | gateway → coordinator   |
| pds.worker.<id>.finished         | DecodeFinished   | Ack               | decode → coordinator    |
| pds.router.route                 | RouteRequest     | RouteDecision     | coordinator → router    |
| pds.worker.<id>.reserve          | ReserveRequest   | Reservation       | coordinator → decode    |
| pds.worker.<id>.prefill          | PrefillRequest   | PrefillResult     | coordinator → prefill   |
| pds.worker.<id>.start            | StartDecode      | DecodeAdmitted    | coordinator → decode    |
| pds.worker.<id>.release          | Release          | Ack               | coordinator → workers   |
| pds.heartbeat.<id>    (publish)  | Heartbeat        | —                 | workers → router        |
| pds.kv.<id>           (publish)  | KVEvents         | —                 | workers → router        |
| pds.kvdigest.<id>     (publish)  | KVDigest         | —                 | workers → router        |
| pds.tokens.<request_id> (publish)| TokenChunk       | —                 | decode/coord → gateway  |
| pds.events.<request_id>.<type>   | events.Event     | JetStream ack     | everyone → recorder     |
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

# The engine's own vocabulary, carried on the wire as the engine defines it (re-exported here).
from pdserve.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored  # noqa: F401
from pdserve.engine.outputs import FinishReason, TokenLogprobs  # noqa: F401
from pdserve.engine.sampling_params import SamplingParams  # noqa: F401


class Message(BaseModel):
    """Base of every wire message: immutable, unknown fields rejected."""

    model_config = ConfigDict(frozen=True, extra="forbid")


# ---------------------------------------------------------------- subjects


class Subjects:
    """All subject names, built from one prefix."""

    def __init__(self, prefix: str = "pds") -> None:
        self.prefix = prefix

    @property
    def submit(self) -> str:
        return f"{self.prefix}.coord.submit"

    @property
    def abort(self) -> str:
        return f"{self.prefix}.coord.abort"

    def finished(self, worker_id: str = "*") -> str:
        """A decode worker's DecodeFinished reports, under its own subjects: a worker publishes nothing under
        `coord.` (docs/architecture.md §9)."""
        return f"{self.prefix}.worker.{worker_id}.finished"

    @property
    def route(self) -> str:
        return f"{self.prefix}.router.route"

    def worker(self, worker_id: str, command: Literal["reserve", "prefill", "start", "release"]) -> str:
        return f"{self.prefix}.worker.{worker_id}.{command}"

    def heartbeat(self, worker_id: str = "*") -> str:
        return f"{self.prefix}.heartbeat.{worker_id}"

    def kv_events(self, worker_id: str = "*") -> str:
        return f"{self.prefix}.kv.{worker_id}"

    def kv_digest(self, worker_id: str = "*") -> str:
        return f"{self.prefix}.kvdigest.{worker_id}"

    def tokens(self, request_id: str) -> str:
        return f"{self.prefix}.tokens.{request_id}"

    def incompatible(self, worker_id: str = "*") -> str:
        return f"{self.prefix}.incompatible.{worker_id}"

    def event(self, request_id: str, event_type: str) -> str:
        return f"{self.prefix}.events.{request_id}.{event_type}"

    @property
    def all_events(self) -> str:
        return f"{self.prefix}.events.>"


# ---------------------------------------------------------------- shared parts


class Role(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    UNIFIED = "unified"






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


# ---------------------------------------------------------------- replies shared by many subjects


class Ack(Message):
    ok: bool = True


class RejectCode(StrEnum):
    INVALID = "invalid"  # the request failed validation
    CAPACITY = "capacity"  # no room now (decode full); retry later
    NOT_FOUND = "not_found"  # unknown request / transfer
    DUPLICATE = "duplicate"  # id already seen
    NO_WORKERS = "no_workers"  # nothing registered can serve it
    TRANSFER_FAILED = "transfer_failed"  # KV did not arrive verified
    INTERNAL = "internal"


class Rejected(Message):
    """The typed refusal any handler may reply with instead of its reply type."""

    code: RejectCode
    message: str


# ---------------------------------------------------------------- gateway ↔ coordinator


class Submit(Message):
    request_id: str
    model: str
    prompt_token_ids: tuple[int, ...] = Field(min_length=1)
    sampling: SamplingParams
    cache_salt: str | None = Field(None, description="Requests with different salts never share cached KV.")
    received_ts: float = Field(description="Gateway's receive time, UNIX seconds.")


class Accepted(Message):
    request_id: str


class Abort(Message):
    """Stop a request and free what it holds. `finish_reason` is set when the gateway ended the request
    as finished rather than cancelled (a stop string matched: "stop"), so the lifecycle records it as
    completed."""

    request_id: str
    reason: str
    finish_reason: FinishReason | None = None




class TokenChunk(Message):
    """Tokens of one request, streamed on pds.tokens.<request_id>. `index` is the position of
    `token_ids[0]` in the output, so a receiver can drop repeats and detect gaps. The last chunk has
    `finish_reason` (completed) or `error` (failed) set."""

    request_id: str
    index: int = Field(ge=0)
    token_ids: tuple[int, ...] = ()
    finish_reason: FinishReason | None = None
    error: str | None = None
    logprobs: tuple[TokenLogprobs, ...] | None = Field(
        None, description="Aligned with token_ids, when the request asked for logprobs.")


# ---------------------------------------------------------------- coordinator ↔ router


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
    policy: str = ""
    block_size: int = 0
    prompt_block_hashes: tuple[int, ...] = Field(
        (), description="The prompt's chained block hashes: what offline replay re-decides with.")


class RouteDecision(Message, RouteOutcome):
    request_id: str


# ---------------------------------------------------------------- coordinator ↔ workers


class KVTransportKind(StrEnum):
    """How KV moves between workers (`pdserve.transfer.make_transport`)."""

    UCXX = "ucxx"  # UCX: shared memory on one host, RDMA or TCP across hosts
    TCP = "tcp"  # plain asyncio TCP: the no-RDMA baseline


class KVEndpoint(Message):
    """Where a decode worker receives KV: transport kind and its address (base64 UCX worker address,
    or host:port for tcp)."""

    transport: KVTransportKind
    address: str


class ReserveRequest(Message):
    request_id: str
    transfer_id: str
    num_prompt_tokens: int = Field(ge=1)
    max_tokens: int = Field(ge=1)
    lease_s: float = Field(gt=0, description="The reservation expires unless started before then.")
    prompt_token_ids: tuple[int, ...] = Field(
        (), description="The prompt the KV will cover: the decode worker looks it up in its own cache.")
    cache_salt: str | None = Field(None, description="Extra prefix-cache key (Submit.cache_salt).")


class Reservation(Message):
    request_id: str
    transfer_id: str
    worker_id: str
    endpoint: KVEndpoint
    num_tokens: int = Field(description="KV slots reserved: prompt + max_tokens.")
    num_cached_tokens: int = Field(
        0, description="Leading prompt tokens whose KV the decode worker already holds (its prefix cache, "
        "whole blocks): the prefill worker sends only the KV of the tokens after them.")


class PrefillRequest(Message):
    request_id: str
    transfer_id: str
    prompt_token_ids: tuple[int, ...] = Field(min_length=1)
    sampling: SamplingParams
    decode_worker_id: str
    endpoint: KVEndpoint
    decode_num_cached_tokens: int = Field(
        0, ge=0, description="Reservation.num_cached_tokens: KV rows the decode worker already holds; the "
        "transfer carries rows decode_num_cached_tokens.. of the prompt, landing at row 0 of its buffers.")
    cache_salt: str | None = Field(None, description="Extra prefix-cache key (Submit.cache_salt).")


class PrefillOutcome(BaseModel):
    """What a prefill produced, defined once for the reply (`PrefillResult`) and the event
    (`events.PrefillCompleted`). `num_cached_tokens` of the prompt were found in the prefill worker's
    prefix cache, `num_computed_tokens` computed; `kv_bytes` of KV sent (the event: when the compute
    ended; the reply: once every send was delivered); `prefill_s` seconds of compute."""

    model_config = ConfigDict(frozen=True)

    transfer_id: str
    first_token_id: int
    num_cached_tokens: int
    num_computed_tokens: int
    kv_bytes: int
    prefill_s: float


class PrefillResult(Message, PrefillOutcome):
    request_id: str
    first_token_logprobs: TokenLogprobs | None = None


class StartDecode(Message):
    """`prompt_token_ids` is what the KV covers. A migrated request (its decode worker died) is
    re-prefilled with prompt + the tokens already committed; then `output_start_index` is how many
    output tokens the client already has, so the first token streamed here has that index and
    `sampling.max_tokens` still counts from the original start."""

    request_id: str
    transfer_id: str
    first_token_id: int
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    output_start_index: int = Field(0, ge=0)
    first_token_logprobs: TokenLogprobs | None = Field(None, description="From PrefillResult.")


class DecodeAdmitted(Message):
    request_id: str
    worker_id: str
    transfer_bytes: int
    transfer_s: float = Field(description="Reservation (first byte expected) → last layer verified, seconds.")
    transfer_done_ts: float = Field(description="UNIX seconds when the last layer was verified.")
    first_token_ts: float = Field(description="UNIX seconds when the first token left the decode worker.")


class Release(Message):
    """Free what the request holds. With `finish_reason`, a running sequence is finished (its tokens
    committed and the coordinator told) rather than dropped: the gateway ended it (a stop string)."""

    request_id: str
    reason: str = "finished"
    finish_reason: FinishReason | None = None


class DecodeFinished(Message):
    request_id: str
    worker_id: str
    finish_reason: FinishReason
    num_output_tokens: int
    first_token_ts: float
    last_token_ts: float


# ---------------------------------------------------------------- heartbeats


class Heartbeat(Message):
    worker_id: str
    role: Role
    descriptor: CompatibilityDescriptor
    num_running: int
    num_waiting: int
    kv_capacity_tokens: int
    kv_free_tokens: int
    ts: float


class WorkerIncompatible(Message):
    """Published by the router when a worker's descriptor matches no live worker of the other pool, so
    it is never paired (nor used) while that lasts. `differences`: field → (this worker's value, the
    first peer's value), as strings."""

    worker_id: str
    role: Role
    descriptor: CompatibilityDescriptor
    peers: tuple[str, ...]
    differences: dict[str, tuple[str, str]]


# ---------------------------------------------------------------- KV cache events (vLLM's KV events)








class KVEvents(Message):
    """A batch of KV cache events of one worker. `seq` increases by one per batch, so a receiver
    detects a lost batch (and then waits for the next `KVDigest` or clears the worker)."""

    worker_id: str
    seq: int = Field(ge=0)
    events: tuple[Annotated[BlockStored | BlockRemoved | AllBlocksCleared, Field(discriminator="kind")], ...]
    ts: float


class KVDigest(Message):
    """Periodic summary of a worker's prefix cache for drift detection: the block count and the XOR of
    every held block hash (order-free, updated in O(1) per event)."""

    worker_id: str
    seq: int = Field(description="The last KVEvents seq this digest includes.")
    num_blocks: int
    xor_hashes: int
    ts: float

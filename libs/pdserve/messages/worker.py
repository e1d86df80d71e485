"""The coordinator ↔ worker commands (pds.worker.<id>.*): reserve → `Reservation`, prefill →
`PrefillResult`, start → `DecodeAdmitted`, release → `Ack`; and where a decode worker receives KV
(`KVEndpoint`)."""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

from pdserve.engine.outputs import FinishReason, TokenLogprobs
from pdserve.engine.sampling_params import SamplingParams
from pdserve.messages.common import Message


class KVTransportKind(StrEnum):
    """How KV moves between workers (`pdserve.transfer.make_transport`)."""

    UCXX = "ucxx"  # UCX: shared memory on one host, RDMA or TCP across hosts
    TCP = "tcp"  # plain asyncio TCP: the no-RDMA baseline


class KVEndpoint(Message):
    """Where a decode worker receives KV: transport kind and its address (base64 UCX worker address,
    or host:port for tcp)."""

    transport: KVTransportKind
    address: str


# The endpoint of a reservation no transfer fills: on a worker without a transport (unified), or one that
# prefills into it itself (a local placement).
LOCAL_ENDPOINT = KVEndpoint(transport=KVTransportKind.TCP, address="local")


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


class LocalReserve(BaseModel):
    """A local placement's decode reservation, made by its prefill command (`PrefillRequest.reserve`):
    the worker holds prompt + `max_tokens` KV slots as a `ReserveRequest` would, expecting no transfer,
    then prefills into them — the reserve's own round trip saved. `lease_s` as `ReserveRequest.lease_s`."""

    model_config = ConfigDict(frozen=True)

    max_tokens: int = Field(ge=1)
    lease_s: float = Field(gt=0)


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
    output_start_index: int = Field(0, ge=0, description="Index of the token this prefill samples in the "
                                    "request's output (StartDecode.output_start_index).")
    stream_first_token: bool = Field(
        True, description="Publish the sampled token on pds.tokens.<request_id> at once, before any KV "
        "transfer completes or decode starts (the client's first token; a stop token is never published). "
        "False on a retry, whose first token is the first attempt's.")
    reserve: LocalReserve | None = Field(
        None, description="A local placement (decode_worker_id is this worker): reserve the decode KV first, "
        "in this command; refused with CAPACITY while the worker is full, as a reserve is. The worker emits "
        "DecodeReserved. None: the reservation was made by a reserve command before.")


class PrefillOutcome(BaseModel):
    """What a prefill produced, defined once for the reply (`PrefillResult`) and the event
    (`events.PrefillCompleted`). `num_cached_tokens` of the prompt were found in the prefill worker's
    prefix cache, `num_computed_tokens` computed; `kv_bytes` of KV sent (the event: when the compute
    ended; the reply: once every send was delivered); `prefill_s` seconds of compute. For a model with
    recurrent state: the prefill resumed from a state checkpoint of `num_checkpoint_tokens` tokens (<=
    `num_cached_tokens`; it computed prompt - num_checkpoint_tokens tokens), and `state_bytes` of state
    follow the KV (0 without state, or for a local prefill). `cached_tokens_by_tier`: num_cached_tokens
    split by where the KV came from — "pool" (the prefill worker's paged pool) or a tier below it
    ("offload", ...: engine/kv_tiers) — summing to num_cached_tokens; empty in events recorded before the
    field existed, and when nothing was cached."""

    model_config = ConfigDict(frozen=True)

    transfer_id: str
    first_token_id: int
    num_cached_tokens: int
    cached_tokens_by_tier: dict[str, int] = Field(default_factory=dict)
    num_computed_tokens: int
    kv_bytes: int
    prefill_s: float
    num_checkpoint_tokens: int = 0
    state_bytes: int = 0
    first_token_ts: float = Field(0.0, description="UNIX seconds when the prefill worker published the first "
                                  "token to the client; 0 when it did not (a stop token, or a retry).")


class PrefillResult(Message, PrefillOutcome):
    request_id: str
    first_token_logprobs: TokenLogprobs | None = None
    state_s: float = Field(0.0, ge=0, description="Seconds from the state handed to the transport, after the "
                           "compute, until every state tensor was delivered: the serial state transfer.")


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

"""The lifecycle events: a closed, versioned set (schema v1).

Every step of every request is one `Event` published to JetStream on `pds.events.<request_id>.<type>`
with `Nats-Msg-Id = event_id` (deduplication), recorded by the recorder into Postgres. Several services
write events of one request; their order is the JetStream stream sequence.

The envelope is typed; the payload is one of the `Payload` classes below, chosen by `type`. An event of
an unknown type or a newer `schema_version` still parses (payload kept as a dict): nothing is dropped.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from pdserve.ids import new_id
from pdserve.messages import FinishReason, PrefillOutcome, RouteOutcome, SamplingParams, Submit

SCHEMA_VERSION = 1


class Payload(BaseModel):
    model_config = ConfigDict(frozen=True, extra="allow")
    type: ClassVar[str]


class RequestReceived(Payload):
    """Everything needed to run the request again from the log alone (coordinator recovery, resumable
    streams): the prompt token ids, sampling, cache salt, stop strings and the gateway's receive time
    (UNIX seconds). Events of older producers lack them (None): such a request cannot be resumed."""

    type: ClassVar[str] = "RequestReceived"
    model: str
    endpoint: str
    num_prompt_tokens: int
    max_tokens: int
    stream: bool
    prompt_token_ids: list[int] | None = None
    sampling: SamplingParams | None = None
    cache_salt: str | None = None
    stop: list[str] = []
    include_usage: bool = False
    received_ts: float | None = None

    @classmethod
    def of(cls, submit: Submit) -> RequestReceived:
        """The event of a gateway's `submit` (its `receipt` set; ValueError otherwise)."""
        r = submit.receipt
        if r is None:
            raise ValueError(f"Submit of {submit.request_id} has no receipt: its RequestReceived is stored")
        return cls(model=submit.model, endpoint=r.endpoint, num_prompt_tokens=len(submit.prompt_token_ids),
                   max_tokens=submit.sampling.max_tokens, stream=r.stream,
                   prompt_token_ids=list(submit.prompt_token_ids), sampling=submit.sampling,
                   cache_salt=submit.cache_salt, stop=list(r.stop), include_usage=r.include_usage,
                   received_ts=submit.received_ts)


class RequestRouted(Payload, RouteOutcome):
    """The router's decision (`messages.RouteOutcome`'s fields) and how long the coordinator waited for it
    (`route_s`, seconds)."""

    type: ClassVar[str] = "RequestRouted"
    route_s: float

    @classmethod
    def of(cls, decision: RouteOutcome, route_s: float) -> RequestRouted:
        return cls(**{f: getattr(decision, f) for f in RouteOutcome.model_fields}, route_s=route_s)


class DecodeReserved(Payload):
    type: ClassVar[str] = "DecodeReserved"
    decode_worker_id: str
    transfer_id: str
    num_tokens: int
    reserve_s: float


class AdmissionDeferred(Payload):
    type: ClassVar[str] = "AdmissionDeferred"
    decode_worker_id: str
    reason: str


class PrefillStarted(Payload):
    type: ClassVar[str] = "PrefillStarted"
    prefill_worker_id: str
    transfer_id: str
    num_prompt_tokens: int


class PrefillCompleted(Payload, PrefillOutcome):
    """The prefill compute is done on `prefill_worker_id` (`messages.PrefillOutcome`'s fields)."""

    type: ClassVar[str] = "PrefillCompleted"
    prefill_worker_id: str


class TransferCompleted(Payload):
    """The decode worker holds the whole transfer, verified: `kv_bytes` of paged KV over `num_layers` paged
    layers and, for a model with recurrent state, `state_bytes` of state (0 otherwise, and in events
    recorded before the field existed); `transfer_s` from the reservation to the last chunk verified.
    `kv_verified_ts` / `state_verified_ts`: UNIX seconds (decode worker's clock) when the KV half and the
    state half were verified, so each one's tail after `PrefillCompleted` is read apart (0.0: no state, or
    an event recorded before the fields existed)."""

    type: ClassVar[str] = "TransferCompleted"
    transfer_id: str
    transport: str
    kv_bytes: int
    num_layers: int
    transfer_s: float
    checksum_ok: bool
    state_bytes: int = 0
    kv_verified_ts: float = 0.0
    state_verified_ts: float = 0.0


class ChecksumMismatch(Payload):
    type: ClassVar[str] = "ChecksumMismatch"
    transfer_id: str
    layer: int
    expected: str
    actual: str


class DecodeStarted(Payload):
    type: ClassVar[str] = "DecodeStarted"
    decode_worker_id: str
    num_running: int


class TokensCommitted(Payload):
    type: ClassVar[str] = "TokensCommitted"
    start_index: int
    token_ids: list[int]


class TTFTBreakdown(BaseModel):
    """Seconds from the gateway's receive to the first token leaving the decode worker, by phase.
    `state_transfer_s`: a hybrid's state handoff, the serial part after the prefill's compute that cannot
    overlap it (carved out of the prefill phase; 0 for a model without state and in older events)."""

    queue_s: float
    route_s: float
    reserve_s: float
    prefill_s: float
    exposed_transfer_s: float
    first_token_s: float
    ttft_s: float
    state_transfer_s: float = 0.0


class RequestMigrated(Payload):
    """The request leaves `from_worker_id` (dead, or silent past the coordinator's liveness timeout) and
    runs again on a healthy pair: re-prefilled with prompt + its `num_committed_tokens` committed output
    tokens, streaming on from that index. `attempt` counts migrations of this request (1 = first)."""

    type: ClassVar[str] = "RequestMigrated"
    from_worker_id: str
    phase: str
    reason: str
    num_committed_tokens: int
    attempt: int


class RequestRecovered(Payload):
    """A coordinator that started found this request unfinished in the log and resumes it from `state`
    (the projection state its events fold to) with `num_committed_tokens` already committed."""

    type: ClassVar[str] = "RequestRecovered"
    state: str
    num_committed_tokens: int
    action: str


class RequestTakenOver(Payload):
    """Coordinator `worker_id` (the event's envelope: a coordinator's events carry its lease holder id) now
    owns this request, taken from `from_coordinator_id` whose lease expired (missed renewals) or was given
    up (`reason`); `lease_revision` is the revision of the request's lease key that made the taker its
    owner (lifecycle/ownership.py). A `RequestRecovered` follows: where the request resumes."""

    type: ClassVar[str] = "RequestTakenOver"
    from_coordinator_id: str
    reason: str
    lease_revision: int


class RequestCompleted(Payload):
    type: ClassVar[str] = "RequestCompleted"
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    ttft: TTFTBreakdown
    e2e_s: float


class RequestFailed(Payload):
    type: ClassVar[str] = "RequestFailed"
    phase: str
    reason: str


class RequestAborted(Payload):
    type: ClassVar[str] = "RequestAborted"
    reason: str


PAYLOAD_TYPES: dict[str, type[Payload]] = {
    cls.type: cls
    for cls in (
        RequestReceived,
        RequestRouted,
        DecodeReserved,
        AdmissionDeferred,
        PrefillStarted,
        PrefillCompleted,
        TransferCompleted,
        ChecksumMismatch,
        DecodeStarted,
        TokensCommitted,
        RequestMigrated,
        RequestRecovered,
        RequestTakenOver,
        RequestCompleted,
        RequestFailed,
        RequestAborted,
    )
}
TERMINAL_TYPES = frozenset({"RequestCompleted", "RequestFailed", "RequestAborted"})


class Event(BaseModel):
    """The envelope every event travels and is stored in.

    `seq` is the event's 1-based position among its request's events in stream order. It is assigned
    when read back from the store (`pdserve.store.queries.lifecycle`), never by the publisher: several
    services publish one request's events concurrently, so no publisher can number them without a
    round trip per event; the JetStream stream sequence is the order, and `seq` is its per-request rank.
    On the wire it is None.
    """

    model_config = ConfigDict(frozen=True)

    event_id: str = Field(default_factory=new_id)
    request_id: str
    type: str
    schema_version: int = SCHEMA_VERSION
    ts: float = Field(default_factory=time.time, description="UTC UNIX seconds, µs resolution.")
    service: str
    worker_id: str | None = None
    trace_id: str | None = None
    span_id: str | None = None
    seq: int | None = Field(None, description="Per-request position in stream order, 1-based (store reads).")
    payload: dict[str, Any]

    @classmethod
    def of(cls, request_id: str, payload: Payload, *, service: str, worker_id: str | None = None,
           trace_id: str | None = None, span_id: str | None = None, event_id: str | None = None) -> Event:
        """`event_id`: a fresh one unless given (an event its producer may publish again: `Receipt`)."""
        return cls(event_id=event_id or new_id(), request_id=request_id, type=payload.type, service=service,
                   worker_id=worker_id, trace_id=trace_id, span_id=span_id,
                   payload=payload.model_dump(mode="json"))

    def typed_payload(self) -> Payload | None:
        """The payload as its class, or None for an unknown type or a newer schema version."""
        cls = PAYLOAD_TYPES.get(self.type)
        if cls is None or self.schema_version > SCHEMA_VERSION:
            return None
        return cls.model_validate(self.payload)

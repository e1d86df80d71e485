"""The `requests` projection: a pure fold of one request's events, in stream order, into one row.

`apply(row, event)` is used both live (the recorder, per committed batch) and by replay
(`queries.rebuild_projections`), so replaying the events table gives exactly the rows the recorder
wrote. Order is the JetStream stream sequence, never `ts`: several services stamp events with their own
clocks (docs/architecture.md §7).

State follows the request state machine, `pdserve.states.TRANSITIONS` (docs/architecture.md §4): received →
routed →
reserved → prefilling → transferred → decoding → completed | failed | aborted. A request that leaves its
placement is `migrating` (`RequestMigrated`: a worker it depended on was lost) or `recovering`
(`RequestRecovered` by a restarted coordinator that re-prefills it) until its next `RequestRouted`; a
recovered request that keeps decoding on its worker (action "watch decode") stays `decoding`. A retry may
step back (a second `DecodeReserved` after a failed transfer is `reserved` again), but a terminal state
is final: a late event still fills in its fields, never the state. The worker columns keep the last
placement until a new one replaces them.
Unknown event types, and events of a newer schema version, leave the row as it is (the event itself is
kept in the `events` table); so does a payload that fails validation.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from pdserve.events import (
    AdmissionDeferred,
    ChecksumMismatch,
    DecodeReserved,
    DecodeStarted,
    Event,
    Payload,
    PrefillCompleted,
    PrefillStarted,
    RequestAborted,
    RequestCompleted,
    RequestFailed,
    RequestMigrated,
    RequestReceived,
    RequestRecovered,
    RequestRouted,
    RequestTakenOver,
    TokensCommitted,
    TransferCompleted,
)
from pdserve.messages import FinishReason
from pdserve.states import TERMINAL_STATES, RequestState, next_state
from pdserve.store.tables import REQUEST_COLUMNS

Row = dict[str, Any]
# Recorded, no column of their own: folding them only advances `last_stream_seq`.
UNPROJECTED_TYPES = frozenset({AdmissionDeferred.type, ChecksumMismatch.type, RequestTakenOver.type})


def to_datetime(ts: float) -> datetime:
    """UNIX seconds (UTC) → an aware datetime, µs resolution (Postgres `timestamptz`)."""
    return datetime.fromtimestamp(ts, tz=UTC)


def empty_row(request_id: str) -> Row:
    """The row of a request no event has been folded into yet: every column present, all None."""
    row: Row = dict.fromkeys(REQUEST_COLUMNS)
    row["request_id"] = request_id
    row["state"] = RequestState.RECEIVED.value
    row["last_stream_seq"] = 0
    return row


def _fields(p: Payload, ts: float) -> Row:
    """The columns one known payload sets; `ts` is the event's UNIX seconds (only the events that set a
    timestamp column convert it: the conversion was an eighth of a fold's time). The state is
    `pdserve.states.next_state`'s business."""
    match p:
        case RequestReceived():
            return {"model": p.model, "prompt_tokens": p.num_prompt_tokens, "received_at": to_datetime(ts)}
        case RequestRouted():
            return {"mode": p.mode, "prefill_worker_id": p.prefill_worker_id,
                    "decode_worker_id": p.decode_worker_id, "route_s": p.route_s,
                    "predicted_cached_tokens": p.predicted_cached_tokens,
                    "predicted_checkpoint_tokens": p.predicted_checkpoint_tokens}
        case DecodeReserved():
            return {"decode_worker_id": p.decode_worker_id, "reserve_s": p.reserve_s}
        case PrefillStarted():
            return {"prefill_worker_id": p.prefill_worker_id}
        case PrefillCompleted():
            return {"cached_tokens": p.num_cached_tokens, "computed_tokens": p.num_computed_tokens,
                    "checkpoint_tokens": p.num_checkpoint_tokens, "kv_bytes": p.kv_bytes,
                    "state_bytes": p.state_bytes, "prefill_s": p.prefill_s}
        case TransferCompleted():
            return {"kv_bytes": p.kv_bytes, "state_bytes": p.state_bytes, "transfer_s": p.transfer_s}
        case DecodeStarted():
            return {"decode_worker_id": p.decode_worker_id}
        case TokensCommitted():
            return {"_committed_tokens": p.start_index + len(p.token_ids)}
        case RequestMigrated() | RequestRecovered():
            return {"_committed_tokens": p.num_committed_tokens}
        case RequestCompleted():
            t = p.ttft
            return {
                "finish_reason": str(p.finish_reason), "prompt_tokens": p.prompt_tokens,
                "completion_tokens": p.completion_tokens, "ttft_s": t.ttft_s, "queue_s": t.queue_s,
                "route_s": t.route_s, "reserve_s": t.reserve_s, "prefill_s": t.prefill_s,
                "exposed_transfer_s": t.exposed_transfer_s, "first_token_s": t.first_token_s,
                "e2e_s": p.e2e_s, "finished_at": to_datetime(ts),
            }
        case RequestFailed():
            return {"failure_phase": p.phase, "failure_reason": p.reason, "finished_at": to_datetime(ts)}
        case RequestAborted():
            return {"finish_reason": str(FinishReason.ABORT), "failure_reason": p.reason,
                    "finished_at": to_datetime(ts)}
    return {}  # UNPROJECTED_TYPES never get here


def apply(row: Row | None, event: Event, stream_seq: int | None = None) -> Row:
    """Fold one event into a request's projection row and return the new row (the input is not changed).

    `row` is None for the request's first event. `stream_seq` is the event's JetStream stream sequence;
    when given it becomes `last_stream_seq`, and an event at or below the row's `last_stream_seq` (a
    redelivery already folded) returns the row unchanged. Never raises on an event's content: an
    unknown type, a newer schema version or a payload that does not match its type's class changes only
    `last_stream_seq` (the row is created if absent).
    """
    new = dict(row) if row is not None else empty_row(event.request_id)
    if stream_seq is not None:
        if stream_seq <= new["last_stream_seq"]:
            return new
        new["last_stream_seq"] = stream_seq
    if event.type in UNPROJECTED_TYPES:
        return new  # no column of their own: not worth validating their payload
    try:
        payload = event.typed_payload()
    except ValidationError:
        payload = None  # a malformed known payload is kept in `events`, like an unknown type
    if payload is None:
        return new
    fields = _fields(payload, event.ts)
    if (committed := fields.pop("_committed_tokens", None)) is not None:
        # The journal only grows; a resend of an earlier chunk must not shrink the count.
        fields["completion_tokens"] = max(new["completion_tokens"] or 0, committed)
    if new["state"] in TERMINAL_STATES:
        # The terminal event's figures are the final word; late events may only fill gaps.
        fields = {k: v for k, v in fields.items() if new[k] is None}
    elif (state := next_state(new["state"], payload)) is not None:
        new["state"] = str(state)
    new.update(fields)
    return new


def fold(events: Iterable[tuple[int, Event]], row: Row | None = None) -> Row | None:
    """Fold `(stream_seq, event)` pairs of one request, already in stream order, onto `row`."""
    for seq, event in events:
        row = apply(row, event, seq)
    return row

"""The request state machine: the states a request's log folds to, the phases of the coordinator's
lifecycle, and the one transition table both follow (docs/architecture.md §4).

`TRANSITIONS` says which event moves a request to which state, and in which phase of the coordinator's
lifecycle (`pdserve.lifecycle.request`) that event is emitted. The projection (`pdserve.store.projection`)
folds a request's events with `next_state`; the lifecycle names its phases by `Phase`; recovery reads the
folded state (`RequestState`) to decide how a request resumes (`RecoveryAction`).

Every transition leaves any non-terminal state: events of one request are published by several services
concurrently, so the table cannot require the previous state (a retry may step back: a second
`DecodeReserved` after a failed transfer is `reserved` again). A terminal state is final.

Imports only pydantic (through `pdserve.events`): no NATS, no SQLAlchemy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from pdserve.events import (
    DecodeReserved,
    DecodeStarted,
    Payload,
    PrefillStarted,
    RequestAborted,
    RequestCompleted,
    RequestFailed,
    RequestMigrated,
    RequestReceived,
    RequestRecovered,
    RequestRouted,
    TransferCompleted,
)


class RequestState(StrEnum):
    """Where a request stands, as its events fold (the `requests.state` column)."""

    RECEIVED = "received"
    ROUTED = "routed"
    RESERVED = "reserved"
    PREFILLING = "prefilling"
    TRANSFERRED = "transferred"
    DECODING = "decoding"
    MIGRATING = "migrating"  # left a placement whose worker was lost, not yet routed again
    RECOVERING = "recovering"  # resumed by a restarted coordinator, not yet routed again
    COMPLETED = "completed"
    FAILED = "failed"
    ABORTED = "aborted"


TERMINAL_STATES: frozenset[RequestState] = frozenset(
    {RequestState.COMPLETED, RequestState.FAILED, RequestState.ABORTED}
)


class Phase(StrEnum):
    """What the coordinator's lifecycle of a request is doing; `RequestFailed.phase` and
    `RequestMigrated.phase` name one."""

    ROUTE = "route"  # asking the router for a (prefill, decode) pair
    RESERVE = "reserve"  # reserving decode KV
    ADMISSION = "admission"  # reserve, while the decode worker is full: the bounded wait
    PREFILL = "prefill"  # the prefill worker computes the prompt and streams its KV
    TRANSFER = "transfer"  # start decode: the decode worker waits for the KV, verified
    DECODE = "decode"  # tokens stream until DecodeFinished
    RECOVERY = "recovery"  # a restarted coordinator resumes the request from the log


class RecoveryAction(StrEnum):
    """How a restarted coordinator resumes an unfinished request (`RequestRecovered.action`)."""

    WATCH_DECODE = "watch decode"  # decoding on a live worker: wait for its end
    RE_PREFILL = "re-prefill"  # anything else: run it again from route with prompt + committed tokens


@dataclass(frozen=True)
class Transition:
    """An event of type `event` moves a non-terminal request to `to`, when `when` (a test of the
    payload, described by `condition`) holds. `phase`: the lifecycle phase that waits for the step the
    event reports (None: outside the phases — the gateway's `RequestReceived`, a migration, the end).
    `by`: the service that emits it."""

    event: str
    to: RequestState
    phase: Phase | None
    by: str
    condition: str = ""
    when: Callable[[Payload], bool] | None = None

    def applies(self, payload: Payload) -> bool:
        return payload.type == self.event and (self.when is None or self.when(payload))


def _verified(p: Payload) -> bool:
    return isinstance(p, TransferCompleted) and p.checksum_ok


def _watch_decode(p: Payload) -> bool:
    return isinstance(p, RequestRecovered) and p.action == RecoveryAction.WATCH_DECODE


def _re_prefill(p: Payload) -> bool:
    return isinstance(p, RequestRecovered) and p.action != RecoveryAction.WATCH_DECODE


S = RequestState
TRANSITIONS: tuple[Transition, ...] = (
    Transition(RequestReceived.type, S.RECEIVED, None, "gateway"),
    Transition(RequestRouted.type, S.ROUTED, Phase.ROUTE, "coordinator"),
    Transition(DecodeReserved.type, S.RESERVED, Phase.RESERVE, "coordinator or, local, the worker"),
    Transition(PrefillStarted.type, S.PREFILLING, Phase.PREFILL, "prefill worker"),
    # A failed checksum is followed by a retransfer: only a verified transfer moves the state.
    Transition(TransferCompleted.type, S.TRANSFERRED, Phase.TRANSFER, "decode worker", "checksum_ok",
               _verified),
    Transition(DecodeStarted.type, S.DECODING, Phase.TRANSFER, "decode worker"),
    Transition(RequestMigrated.type, S.MIGRATING, None, "coordinator"),
    Transition(RequestRecovered.type, S.DECODING, Phase.RECOVERY, "coordinator", "action = watch decode",
               _watch_decode),
    Transition(RequestRecovered.type, S.RECOVERING, Phase.RECOVERY, "coordinator", "action = re-prefill",
               _re_prefill),
    Transition(RequestCompleted.type, S.COMPLETED, None, "coordinator"),
    Transition(RequestFailed.type, S.FAILED, None, "coordinator"),
    Transition(RequestAborted.type, S.ABORTED, None, "coordinator"),
)
del S

# The table by event type: the projection folds every recorded event through it.
_BY_EVENT: dict[str, tuple[Transition, ...]] = {
    e: tuple(t for t in TRANSITIONS if t.event == e) for e in dict.fromkeys(t.event for t in TRANSITIONS)
}


def next_state(state: str, payload: Payload) -> RequestState | None:
    """The state `payload` moves a request in `state` (a `RequestState` value) to, or None when it does
    not move it: a terminal `state`, an event type outside the table (PrefillCompleted, TokensCommitted,
    AdmissionDeferred, ChecksumMismatch only fill in columns or the log), a condition that does not
    hold."""
    if state in TERMINAL_STATES:
        return None
    for t in _BY_EVENT.get(payload.type, ()):
        if t.when is None or t.when(payload):
            return t.to
    return None


def mermaid() -> str:
    """The state machine as a mermaid `stateDiagram-v2` (docs/architecture.md §4 shows this text). No
    transition requires a previous state, so each is an edge from `live`, which stands for any
    non-terminal state; a request's first event makes it `received`."""
    lines = ["stateDiagram-v2", f"    [*] --> {RequestState.RECEIVED.value}: {RequestReceived.type}"]
    for t in TRANSITIONS:
        label = t.event + (f" [{t.condition}]" if t.condition else "")
        lines.append(f"    live --> {t.to.value}: {label}")
    lines += [f"    {s.value} --> [*]" for s in RequestState if s in TERMINAL_STATES]
    lines.append("    note left of live: any state but completed, failed, aborted")
    return "\n".join(lines) + "\n"

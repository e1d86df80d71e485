"""The coordinator's lifecycle and the projection follow one state machine: `pdserve.states.TRANSITIONS`.

The projection is checked against the table for every event type from every state; the lifecycle is run
(a scripted bus standing in for router and workers) and every event it and its workers emit is checked
against the table's phase for that event, and the states its events fold to against the table's
targets."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdserve.bus import RejectedError
from pdserve.config import CoordinatorSettings
from pdserve.events import (
    PAYLOAD_TYPES,
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
    TTFTBreakdown,
)
from pdserve.ids import new_id
from pdserve.lifecycle.request import RequestLifecycle
from pdserve.messages import (
    Ack,
    CandidateCost,
    DecodeAdmitted,
    DecodeFinished,
    FinishReason,
    KVEndpoint,
    PrefillOutcome,
    PrefillResult,
    RejectCode,
    Reservation,
    Role,
    RouteDecision,
    SamplingParams,
    Subjects,
    Submit,
)
from pdserve.states import (
    TERMINAL_STATES,
    TRANSITIONS,
    Phase,
    RecoveryAction,
    RequestState,
    next_state,
)
from pdserve.store.projection import apply, empty_row
from pdserve.store.tables import REQUEST_STATES, requests

CAND = CandidateCost(worker_id="prefill-0", role=Role.PREFILL, cost=1.0, active_requests=0, kv_usage=0.0)
TTFT = TTFTBreakdown(queue_s=0, route_s=0, reserve_s=0, prefill_s=0, exposed_transfer_s=0, first_token_s=0,
                     ttft_s=0)
# One payload of every type, both sides of every condition the table tests.
SAMPLES: list[Payload] = [
    RequestReceived(model="tiny", endpoint="/v1/completions", num_prompt_tokens=4, max_tokens=2,
                    stream=False),
    RequestRouted(mode="disaggregated", prefill_worker_id="prefill-0", decode_worker_id="decode-0",
                  candidates=[CAND], route_s=0.001),
    DecodeReserved(decode_worker_id="decode-0", transfer_id="x", num_tokens=6, reserve_s=0.001),
    AdmissionDeferred(decode_worker_id="decode-0", reason="full"),
    PrefillStarted(prefill_worker_id="prefill-0", transfer_id="x", num_prompt_tokens=4),
    PrefillCompleted(prefill_worker_id="prefill-0", transfer_id="x", first_token_id=1, num_cached_tokens=0,
                     num_computed_tokens=4, kv_bytes=64, prefill_s=0.01),
    TransferCompleted(transfer_id="x", transport="tcp", kv_bytes=64, num_layers=2, transfer_s=0.01,
                      checksum_ok=True),
    TransferCompleted(transfer_id="x", transport="tcp", kv_bytes=64, num_layers=2, transfer_s=0.01,
                      checksum_ok=False),
    ChecksumMismatch(transfer_id="x", layer=0, expected="aa", actual="bb"),
    DecodeStarted(decode_worker_id="decode-0", num_running=1),
    TokensCommitted(start_index=0, token_ids=[1]),
    RequestMigrated(from_worker_id="decode-0", phase=Phase.DECODE, reason="lost", num_committed_tokens=1,
                    attempt=1),
    RequestRecovered(state=RequestState.DECODING, num_committed_tokens=1, action=RecoveryAction.WATCH_DECODE),
    RequestRecovered(state=RequestState.ROUTED, num_committed_tokens=0, action=RecoveryAction.RE_PREFILL),
    RequestTakenOver(from_coordinator_id="coordinator.0badc0de", reason="expired", lease_revision=7),
    RequestCompleted(finish_reason=FinishReason.LENGTH, prompt_tokens=4, completion_tokens=2, ttft=TTFT,
                     e2e_s=0.1),
    RequestFailed(phase=Phase.ROUTE, reason="no workers"),
    RequestAborted(reason="client gone"),
]


def test_the_table_speaks_of_known_events_and_reaches_every_state():
    assert {type(p) for p in SAMPLES} == set(PAYLOAD_TYPES.values())
    assert {t.event for t in TRANSITIONS} <= set(PAYLOAD_TYPES)
    assert {t.to for t in TRANSITIONS} == set(RequestState)
    assert TERMINAL_STATES == {RequestState.COMPLETED, RequestState.FAILED, RequestState.ABORTED}
    # The event store's CHECK constraint admits exactly the enum's states.
    assert REQUEST_STATES == tuple(RequestState)
    check = next(c for c in requests.constraints if c.name == "requests_state_valid")
    assert all(f"'{s}'" in str(check.sqltext) for s in RequestState)


@pytest.mark.parametrize("state", list(RequestState))
def test_the_projection_moves_a_request_exactly_as_the_table_says(state):
    fired = set()
    for payload in SAMPLES:
        row = {**empty_row(new_id()), "state": str(state)}
        event = Event.of(row["request_id"], payload, service="test")
        folded = apply(row, event, stream_seq=1)["state"]
        expected = next_state(state, payload)
        assert folded == (expected or state), (state, payload)
        if expected is not None:
            fired.add(next(t for t in TRANSITIONS if t.applies(payload)))
    # From a live state every transition of the table fires; from a terminal one none does.
    assert fired == (set() if state in TERMINAL_STATES else set(TRANSITIONS))


class ScriptedBus:
    """Router and workers as replies: the first transfer fails verification (the decode worker says
    TRANSFER_FAILED), the second is verified; decoding ends with DecodeFinished. Every event emitted, by
    the lifecycle or by a scripted worker, is kept with the lifecycle's phase at that moment."""

    def __init__(self) -> None:
        self.subjects = Subjects("test")
        self.lifecycle: RequestLifecycle | None = None
        self.emitted: list[tuple[Phase, Payload]] = []
        self.starts = 0

    async def emit(self, request_id: str, payload: Payload, worker_id: str | None = None) -> None:
        assert self.lifecycle is not None
        self.emitted.append((self.lifecycle.phase, payload))

    emit_stored = emit  # the terminal events: stored before the request's lease is released

    async def publish(self, subject, msg) -> None:
        pass

    async def request(self, subject: str, msg, reply_type, timeout_s: float):
        rid = msg.request_id
        if subject == self.subjects.route:
            return RouteDecision(request_id=rid, mode="disaggregated", prefill_worker_id="prefill-0",
                                 decode_worker_id="decode-0", candidates=(CAND,))
        command = subject.rsplit(".", 1)[1]
        if command == "reserve":
            return Reservation(request_id=rid, transfer_id=msg.transfer_id, worker_id="decode-0",
                               endpoint=KVEndpoint(transport="tcp", address="local"), num_tokens=6)
        if command == "prefill":
            await self.emit(rid, PrefillStarted(prefill_worker_id="prefill-0", transfer_id=msg.transfer_id,
                                                num_prompt_tokens=len(msg.prompt_token_ids)))
            outcome = PrefillOutcome(transfer_id=msg.transfer_id, first_token_id=1, num_cached_tokens=0,
                                     num_computed_tokens=len(msg.prompt_token_ids), kv_bytes=64,
                                     prefill_s=0.01)
            await self.emit(rid, PrefillCompleted(prefill_worker_id="prefill-0", **dict(outcome)))
            return PrefillResult(request_id=rid, **dict(outcome))
        if command == "start":
            self.starts += 1
            if self.starts == 1:
                await self.emit(rid, ChecksumMismatch(transfer_id=msg.transfer_id, layer=0, expected="a",
                                                      actual="b"))
                raise RejectedError(RejectCode.TRANSFER_FAILED, "checksum mismatch at layer 0")
            await self.emit(rid, TransferCompleted(transfer_id=msg.transfer_id, transport="tcp", kv_bytes=64,
                                                   num_layers=2, transfer_s=0.01, checksum_ok=True))
            await self.emit(rid, DecodeStarted(decode_worker_id="decode-0", num_running=1))
            now = time.time()
            asyncio.get_running_loop().call_soon(self.lifecycle.on_finished, DecodeFinished(
                request_id=rid, worker_id="decode-0", finish_reason=FinishReason.LENGTH, num_output_tokens=2,
                first_token_ts=now, last_token_ts=now))
            return DecodeAdmitted(request_id=rid, worker_id="decode-0", transfer_bytes=64, transfer_s=0.01,
                                  transfer_done_ts=now, first_token_ts=now)
        assert command == "release", subject
        return Ack()


class AllAlive:
    """Liveness in which no worker ever dies."""

    async def first_lost(self, watched) -> str:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    def is_dead(self, worker_id: str) -> bool:
        return False


async def test_the_lifecycle_emits_each_event_in_the_phase_the_table_gives_and_folds_along_it():
    bus = ScriptedBus()
    submit = Submit(request_id=new_id(), model="tiny", prompt_token_ids=(1, 2, 3, 4),
                    sampling=SamplingParams(max_tokens=2), received_ts=time.time())
    lifecycle = RequestLifecycle(bus, CoordinatorSettings(), submit, AllAlive())  # type: ignore[arg-type]
    bus.lifecycle = lifecycle
    await asyncio.wait_for(lifecycle.run(), 10)

    row = empty_row(submit.request_id)
    states = []
    for seq, (phase, payload) in enumerate(bus.emitted, start=1):
        moving = [t for t in TRANSITIONS if t.applies(payload)]
        if moving and moving[0].phase is not None:
            assert phase is moving[0].phase, (payload.type, phase)
        row = apply(row, Event.of(submit.request_id, payload, service="test"), stream_seq=seq)
        assert row["state"] == (moving[0].to if moving else states[-1] if states else RequestState.RECEIVED)
        states.append(row["state"])
    S = RequestState
    assert states == [
        S.ROUTED, S.RESERVED, S.PREFILLING, S.PREFILLING, S.PREFILLING,  # ... ChecksumMismatch: no move
        S.RESERVED, S.PREFILLING, S.PREFILLING, S.TRANSFERRED, S.DECODING, S.COMPLETED,
    ]
    # Every phase of the table that a placement passes through was entered by the lifecycle.
    entered = {phase for phase, _ in bus.emitted}
    assert {t.phase for t in TRANSITIONS if t.phase not in (None, Phase.RECOVERY)} <= entered

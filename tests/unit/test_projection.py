"""The `requests` projection is a pure fold of a request's events in stream order."""

from __future__ import annotations

import json
from datetime import UTC, datetime

from pdserve.events import (
    AdmissionDeferred,
    ChecksumMismatch,
    DecodeReserved,
    DecodeStarted,
    Event,
    Payload,
    PrefillCompleted,
    PrefillStarted,
    RequestCompleted,
    RequestFailed,
    RequestMigrated,
    RequestReceived,
    RequestRecovered,
    RequestRouted,
    TokensCommitted,
    TransferCompleted,
    TTFTBreakdown,
)
from pdserve.ids import new_id
from pdserve.messages import CandidateCost
from pdserve.store.projection import apply, fold
from pdserve.store.rows import EVENT_COLUMNS, event_record, event_row

T0 = 1_700_000_000.0  # 2023-11-14, before any test run


def _event(request_id: str, payload: Payload, ts: float, service: str, worker_id: str | None = None) -> Event:
    return Event.of(request_id, payload, service=service, worker_id=worker_id).model_copy(update={"ts": ts})


def full_lifecycle(request_id: str, t0: float = T0) -> list[Event]:
    """One disaggregated request, gateway to completion, as the services would emit it."""
    cand = CandidateCost(worker_id="prefill-1", role="prefill", cost=1.0, active_requests=0, kv_usage=0.1)
    ttft = TTFTBreakdown(queue_s=0.001, route_s=0.002, reserve_s=0.003, prefill_s=0.2,
                         exposed_transfer_s=0.01, first_token_s=0.02, ttft_s=0.236)
    steps: list[tuple[str, str | None, Payload]] = [
        ("gateway", None, RequestReceived(model="tiny", endpoint="/v1/completions", num_prompt_tokens=40,
                                          max_tokens=8, stream=False)),
        ("coordinator", None, RequestRouted(mode="disaggregated", prefill_worker_id="prefill-1",
                                            decode_worker_id="decode-1", candidates=[cand],
                                            predicted_cached_tokens=16, best_cached_tokens=16,
                                            route_s=0.002)),
        ("coordinator", None, AdmissionDeferred(decode_worker_id="decode-1", reason="full")),
        ("coordinator", None, DecodeReserved(decode_worker_id="decode-1", transfer_id="x1", num_tokens=48,
                                             reserve_s=0.003)),
        ("prefill", "prefill-1", PrefillStarted(prefill_worker_id="prefill-1", transfer_id="x1",
                                                num_prompt_tokens=40)),
        ("prefill", "prefill-1", PrefillCompleted(prefill_worker_id="prefill-1", transfer_id="x1",
                                                  first_token_id=7, num_cached_tokens=16,
                                                  num_computed_tokens=24, kv_bytes=1_843_200, prefill_s=0.2)),
        ("decode", "decode-1", ChecksumMismatch(transfer_id="x1", layer=1, expected="aa", actual="bb")),
        ("decode", "decode-1", TransferCompleted(transfer_id="x1", transport="ucxx", kv_bytes=1_843_200,
                                                 num_layers=2, transfer_s=0.05, checksum_ok=True)),
        ("decode", "decode-1", DecodeStarted(decode_worker_id="decode-1", num_running=1)),
        ("decode", "decode-1", TokensCommitted(start_index=0, token_ids=[7, 8, 9, 10])),
        ("decode", "decode-1", TokensCommitted(start_index=4, token_ids=[11, 12, 13, 14])),
        ("coordinator", None, RequestCompleted(finish_reason="length", prompt_tokens=40, completion_tokens=8,
                                               ttft=ttft, e2e_s=0.4)),
    ]
    return [_event(request_id, p, t0 + 0.01 * i, svc, wid) for i, (svc, wid, p) in enumerate(steps)]


def migrated_lifecycle(request_id: str, t0: float = T0) -> list[Event]:
    """`full_lifecycle` up to 4 committed tokens; then decode-1 dies and the request migrates to
    decode-2; then the coordinator restarts and re-prefills it; then a third coordinator finds it decoding
    on decode-3 and watches it; then it completes."""
    life = full_lifecycle(request_id, t0)
    first, completed = life[:10], life[-1]  # up to TokensCommitted [0, 4)
    lost = RequestMigrated(from_worker_id="decode-1", phase="decode", reason="no heartbeat for 2.0 s",
                           num_committed_tokens=4, attempt=1)
    again: list[tuple[str, str | None, Payload]] = [
        ("coordinator", None, lost),
        ("coordinator", None, RequestRouted(mode="disaggregated", prefill_worker_id="prefill-1",
                                            decode_worker_id="decode-2", candidates=[],
                                            predicted_cached_tokens=32, best_cached_tokens=32,
                                            route_s=0.004)),
        ("coordinator", None, RequestRecovered(state="routed", num_committed_tokens=4, action="re-prefill")),
        ("coordinator", None, RequestRouted(mode="disaggregated", prefill_worker_id="prefill-2",
                                            decode_worker_id="decode-3", candidates=[],
                                            predicted_cached_tokens=0, best_cached_tokens=0,
                                            route_s=0.005)),
        ("decode", "decode-3", DecodeStarted(decode_worker_id="decode-3", num_running=2)),
        ("coordinator", None, RequestRecovered(state="decoding", num_committed_tokens=4,
                                               action="watch decode")),
        ("decode", "decode-3", TokensCommitted(start_index=4, token_ids=[11, 12, 13, 14])),
    ]
    rest = [_event(request_id, p, t0 + 1 + 0.01 * i, svc, wid) for i, (svc, wid, p) in enumerate(again)]
    return [*first, *rest, completed.model_copy(update={"ts": t0 + 2})]


def _fold(events: list[Event], first_seq: int = 1):
    return fold((first_seq + i, e) for i, e in enumerate(events))


def test_full_disaggregated_lifecycle_folds_into_a_completed_row():
    rid = new_id()
    row = _fold(full_lifecycle(rid))
    assert row["request_id"] == rid
    assert row["state"] == "completed"
    assert (row["model"], row["mode"]) == ("tiny", "disaggregated")
    assert (row["prefill_worker_id"], row["decode_worker_id"]) == ("prefill-1", "decode-1")
    assert (row["prompt_tokens"], row["completion_tokens"]) == (40, 8)
    assert (row["cached_tokens"], row["computed_tokens"]) == (16, 24)
    assert (row["kv_bytes"], row["transfer_s"]) == (1_843_200, 0.05)
    assert (row["ttft_s"], row["queue_s"], row["route_s"], row["reserve_s"]) == (0.236, 0.001, 0.002, 0.003)
    assert (row["prefill_s"], row["exposed_transfer_s"], row["first_token_s"]) == (0.2, 0.01, 0.02)
    assert (row["e2e_s"], row["finish_reason"]) == (0.4, "length")
    assert row["failure_phase"] is None and row["failure_reason"] is None
    assert row["received_at"] == datetime.fromtimestamp(T0, UTC)
    assert row["finished_at"] == datetime.fromtimestamp(T0 + 0.11, UTC)
    assert row["last_stream_seq"] == 12


def test_state_follows_each_lifecycle_step():
    rid = new_id()
    states = []
    row = None
    for seq, event in enumerate(full_lifecycle(rid), start=1):
        row = apply(row, event, seq)
        states.append(row["state"])
    assert states == ["received", "routed", "routed", "reserved", "prefilling", "prefilling", "prefilling",
                      "transferred", "decoding", "decoding", "decoding", "completed"]


def test_migration_and_recovery_change_the_state_until_the_next_placement():
    rid = new_id()
    states, rows = [], []
    row = None
    for seq, event in enumerate(migrated_lifecycle(rid), start=1):
        row = apply(row, event, seq)
        states.append(row["state"])
        rows.append(row)
    assert states[9:] == ["decoding",  # TokensCommitted [0, 4) on decode-1
                          "migrating", "routed", "recovering", "routed", "decoding",
                          "decoding",  # RequestRecovered "watch decode": still decoding on decode-3
                          "decoding", "completed"]
    migrating = rows[10]
    # Until the next placement the row names the lost one; the journal count is the migration's.
    assert (migrating["prefill_worker_id"], migrating["decode_worker_id"]) == ("prefill-1", "decode-1")
    assert migrating["completion_tokens"] == 4 and migrating["last_stream_seq"] == 11
    recovering = rows[12]
    assert (recovering["decode_worker_id"], recovering["route_s"]) == ("decode-2", 0.004)
    assert recovering["completion_tokens"] == 4 and recovering["last_stream_seq"] == 13
    final = rows[-1]
    assert (final["prefill_worker_id"], final["decode_worker_id"]) == ("prefill-2", "decode-3")
    assert (final["completion_tokens"], final["route_s"], final["last_stream_seq"]) == (8, 0.002, 18)
    assert final["finished_at"] == datetime.fromtimestamp(T0 + 2, UTC)


def test_a_late_migration_or_recovery_event_does_not_reopen_a_finished_request():
    rid = new_id()
    done = _fold(full_lifecycle(rid))
    late = [RequestMigrated(from_worker_id="decode-1", phase="decode", reason="x", num_committed_tokens=2,
                            attempt=1),
            RequestRecovered(state="decoding", num_committed_tokens=2, action="re-prefill")]
    row = done
    for seq, p in enumerate(late, start=13):
        row = apply(row, _event(rid, p, T0 + 5, "coordinator"), seq)
    assert row == done | {"last_stream_seq": 14}


def test_failed_request_records_phase_reason_and_keeps_progress_so_far():
    rid = new_id()
    events = full_lifecycle(rid)[:6]
    failed = RequestFailed(phase="transfer", reason="checksum mismatch twice")
    events.append(_event(rid, failed, T0 + 1, "coordinator"))
    row = _fold(events)
    assert row["state"] == "failed"
    assert (row["failure_phase"], row["failure_reason"]) == ("transfer", "checksum mismatch twice")
    assert row["finished_at"] == datetime.fromtimestamp(T0 + 1, UTC)
    assert row["computed_tokens"] == 24 and row["finish_reason"] is None and row["ttft_s"] is None


def test_unknown_event_type_leaves_row_intact_but_advances_its_sequence():
    rid = new_id()
    before = _fold(full_lifecycle(rid)[:2])
    unknown = Event(request_id=rid, type="KVMigrated", service="decode", payload={"to": "decode-2"})
    newer = Event(request_id=rid, type="RequestRouted", schema_version=99, service="router", payload={"x": 1})
    after = apply(apply(before, unknown, 3), newer, 4)
    assert {k: v for k, v in after.items() if k != "last_stream_seq"} == {
        k: v for k, v in before.items() if k != "last_stream_seq"}
    assert after["last_stream_seq"] == 4
    assert apply(None, unknown, 1)["state"] == "received"


def test_malformed_known_payload_is_treated_like_an_unknown_type():
    rid = new_id()
    before = _fold(full_lifecycle(rid)[:1])
    broken = Event(request_id=rid, type="RequestRouted", service="router", payload={"mode": 3})
    after = apply(before, broken, 2)
    assert after["state"] == "received" and after["last_stream_seq"] == 2


def test_order_is_stream_sequence_not_event_timestamps():
    # Skewed service clocks: decode's events carry earlier timestamps than the gateway's.
    rid = new_id()
    events = full_lifecycle(rid)
    skewed = [e.model_copy(update={"ts": T0 - 0.5 * i}) for i, e in enumerate(events)]
    row = _fold(skewed)
    assert row["state"] == "completed"
    assert row["received_at"] == datetime.fromtimestamp(T0, UTC)
    assert row["finished_at"] == datetime.fromtimestamp(T0 - 0.5 * 11, UTC)
    assert {k: v for k, v in row.items() if not k.endswith("_at")} == {
        k: v for k, v in _fold(events).items() if not k.endswith("_at")}


def test_redelivered_event_at_or_below_last_sequence_is_not_folded_twice():
    rid = new_id()
    events = full_lifecycle(rid)
    row = _fold(events)
    again = apply(row, events[3], 4)  # DecodeReserved again, as a redelivery of seq 4
    assert again == row


def test_terminal_state_is_final_but_late_events_fill_missing_fields():
    rid = new_id()
    events = full_lifecycle(rid)[:2]
    failed = RequestFailed(phase="reserve", reason="no decode capacity")
    events.append(_event(rid, failed, T0 + 1, "coordinator"))
    row = _fold(events)
    late_start = _event(rid, DecodeStarted(decode_worker_id="decode-9", num_running=1), T0 + 2, "decode")
    late_tokens = _event(rid, TokensCommitted(start_index=0, token_ids=[1, 2]), T0 + 3, "decode")
    row = apply(apply(row, late_start, 4), late_tokens, 5)
    assert row["state"] == "failed"
    assert row["decode_worker_id"] == "decode-1"  # set before the failure; not overwritten
    assert row["completion_tokens"] == 2  # was unknown; a late journal entry fills it


def test_fold_does_not_mutate_its_input_row():
    rid = new_id()
    events = full_lifecycle(rid)
    row = _fold(events[:1])
    snapshot = dict(row)
    apply(row, events[1], 2)
    assert row == snapshot


def test_copy_record_of_an_event_is_its_row_in_column_order():
    event = full_lifecycle(new_id())[1]
    record = event_record(42, event)
    row = event_row(event, 42)
    assert record[:-1] == tuple(row[c] for c in EVENT_COLUMNS[:-1])
    assert EVENT_COLUMNS[-1] == "payload" and json.loads(record[-1]) == row["payload"]

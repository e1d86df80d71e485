"""Folding the log into where a request resumes (coordinator recovery), and the committed-token journal."""

from __future__ import annotations

from pdserve.events import (
    DecodeReserved,
    DecodeStarted,
    Event,
    RequestCompleted,
    RequestMigrated,
    RequestReceived,
    RequestRouted,
    TokensCommitted,
    TTFTBreakdown,
)
from pdserve.gateway.resume import event_chunk
from pdserve.ids import new_id
from pdserve.lifecycle.journal import committed_tokens
from pdserve.lifecycle.recovery import Unfinished, Unresumable, plan
from pdserve.messages import FinishReason, SamplingParams
from pdserve.store.rows import RecordedEvent

RID = new_id()
SAMPLING = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


def history(*payloads) -> list[RecordedEvent]:
    return [RecordedEvent(i, Event.of(RID, p, service="test")) for i, p in enumerate(payloads, start=1)]


def received(**kw) -> RequestReceived:
    fields = dict(
        model="m",
        endpoint="/v1/completions",
        num_prompt_tokens=3,
        max_tokens=32,
        stream=True,
        prompt_token_ids=[1, 2, 3],
        sampling=SAMPLING,
        cache_salt="s",
        received_ts=100.0,
    )
    return RequestReceived(**{**fields, **kw})


def routed() -> RequestRouted:
    return RequestRouted(
        mode="disaggregated",
        prefill_worker_id="prefill-0",
        decode_worker_id="decode-0",
        candidates=[],
        predicted_cached_tokens=0,
        best_cached_tokens=0,
        route_s=0.01,
    )


def test_decoding_request_resumes_on_its_worker_with_the_committed_tokens():
    found = plan(
        RID,
        history(
            received(),
            routed(),
            DecodeReserved(decode_worker_id="decode-0", transfer_id="t", num_tokens=35, reserve_s=0.0),
            DecodeStarted(decode_worker_id="decode-0", num_running=1),
            TokensCommitted(start_index=0, token_ids=[7, 8]),
            TokensCommitted(start_index=2, token_ids=[9]),
        ),
    )
    assert isinstance(found, Unfinished)
    assert found.submit.prompt_token_ids == (1, 2, 3) and found.submit.sampling == SAMPLING
    assert found.submit.cache_salt == "s" and found.submit.received_ts == 100.0
    assert found.resume.state == "decoding" and found.resume.decode_worker_id == "decode-0"
    assert found.resume.committed == (7, 8, 9)
    assert found.resume.holders == {"prefill-0", "decode-0"}


def test_request_not_yet_decoding_is_re_prefilled_from_route():
    found = plan(RID, history(received(), routed()))
    assert isinstance(found, Unfinished)
    assert found.resume.state == "routed" and found.resume.decode_worker_id is None


def test_completed_request_is_not_resumed():
    ttft = TTFTBreakdown(
        queue_s=0, route_s=0, reserve_s=0, prefill_s=0, exposed_transfer_s=0, first_token_s=0, ttft_s=0.1
    )
    done = RequestCompleted(
        finish_reason=FinishReason.LENGTH, prompt_tokens=3, completion_tokens=1, ttft=ttft, e2e_s=1.0
    )
    assert plan(RID, history(received(), routed(), done)) is None


def test_request_whose_received_event_lacks_the_prompt_fails_with_a_reason():
    found = plan(RID, history(received(prompt_token_ids=None), routed()))
    assert isinstance(found, Unresumable) and "prompt" in found.reason


def test_migrations_already_made_count_against_the_limit():
    lost = RequestMigrated(
        from_worker_id="decode-0", phase="decode", reason="x", num_committed_tokens=0, attempt=1
    )
    found = plan(RID, history(received(), routed(), lost, routed()))
    assert isinstance(found, Unfinished) and found.resume.migrations == 1


def test_journal_keeps_the_first_commit_of_an_index_and_stops_at_a_hole():
    evs = [
        Event.of(RID, p, service="t")
        for p in (
            TokensCommitted(start_index=0, token_ids=[1, 2, 3]),
            TokensCommitted(start_index=2, token_ids=[99, 4]),  # a migrated run re-committing index 2
            TokensCommitted(start_index=6, token_ids=[6]),  # after a hole: not contiguous yet
        )
    ]
    assert committed_tokens(evs) == [1, 2, 3, 4]


def test_terminal_event_ends_a_resumed_stream_at_the_completion_count():
    ttft = TTFTBreakdown(
        queue_s=0, route_s=0, reserve_s=0, prefill_s=0, exposed_transfer_s=0, first_token_s=0, ttft_s=0.1
    )
    chunk = event_chunk(
        Event.of(
            RID,
            RequestCompleted(
                finish_reason=FinishReason.LENGTH, prompt_tokens=3, completion_tokens=5, ttft=ttft, e2e_s=1.0
            ),
            service="t",
        )
    )
    assert chunk is not None and chunk.index == 5 and chunk.finish_reason is FinishReason.LENGTH
    assert event_chunk(Event.of(RID, routed(), service="t")) is None

"""A request's completion: its TTFT broken down by phase, and the `RequestCompleted` event."""

from __future__ import annotations

from opentelemetry import trace

from pdserve.bus import Bus
from pdserve.events import RequestCompleted, TTFTBreakdown
from pdserve.messages import DecodeAdmitted, DecodeFinished, Submit


def ttft_breakdown(
    received_ts: float, done: DecodeFinished, admitted: DecodeAdmitted | None, timings: dict[str, float]
) -> TTFTBreakdown:
    """Seconds from the gateway's receive (`received_ts`, UNIX s) to the first token, by phase. `timings`
    holds the UNIX seconds at which the placement began route / reserve / prefill and ended prefill
    ("route", "reserve", "prefill", "prefilled"), and "first_token" when the prefill worker streamed the
    first token itself: then the prefill phase ends there, and neither the transfer nor the start of decode
    is on the TTFT path (exposed transfer, first token and a hybrid's state transfer 0: the state delays the
    second token instead). Otherwise, optionally, "state_sent": when a hybrid's serial state handoff began
    (after the compute; the prefill phase ends there and `state_transfer_s` runs to "prefilled"; absent: no
    state). Without a placement of this coordinator (`admitted` None or no timings: a request resumed while
    decoding) only the total is known."""
    if admitted is None or not timings:
        return TTFTBreakdown(queue_s=0.0, route_s=0.0, reserve_s=0.0, prefill_s=0.0, exposed_transfer_s=0.0,
                             first_token_s=0.0, ttft_s=max(0.0, done.first_token_ts - received_ts))
    before_prefill = {
        "queue_s": max(0.0, timings["route"] - received_ts),
        "route_s": timings["reserve"] - timings["route"],
        "reserve_s": timings["prefill"] - timings["reserve"],
    }
    streamed = timings.get("first_token", 0.0)
    if streamed and streamed <= admitted.first_token_ts:
        return TTFTBreakdown(**before_prefill, prefill_s=streamed - timings["prefill"],
                             exposed_transfer_s=0.0, first_token_s=0.0, ttft_s=streamed - received_ts)
    transfer_end = max(timings["prefilled"], admitted.transfer_done_ts)
    state_sent = timings.get("state_sent", timings["prefilled"])
    return TTFTBreakdown(
        **before_prefill,
        prefill_s=state_sent - timings["prefill"],
        state_transfer_s=timings["prefilled"] - state_sent,
        exposed_transfer_s=transfer_end - timings["prefilled"],
        first_token_s=max(0.0, admitted.first_token_ts - transfer_end),
        ttft_s=admitted.first_token_ts - received_ts,
    )


async def emit_completed(
    bus: Bus, submit: Submit, done: DecodeFinished, admitted: DecodeAdmitted | None, timings: dict[str, float]
) -> None:
    """Emit `RequestCompleted` (and put the TTFT breakdown on the current span). The breakdown is of this
    coordinator's first placement (`admitted`, `timings`)."""
    ttft = ttft_breakdown(submit.received_ts, done, admitted, timings)
    span = trace.get_current_span()
    for name, value in ttft.model_dump().items():
        span.set_attribute(f"pdserve.ttft.{name}" if name != "ttft_s" else "pdserve.ttft_s", value)
    await bus.emit_stored(
        submit.request_id,
        RequestCompleted(
            finish_reason=done.finish_reason,
            prompt_tokens=len(submit.prompt_token_ids),
            completion_tokens=done.num_output_tokens,
            ttft=ttft,
            e2e_s=done.last_token_ts - submit.received_ts,
        ),
    )

"""One placement of a request, as steps on its `RequestContext`: route, reserve decode KV (waiting,
bounded, while decode is full), prefill with the transfer plan, start decode once the KV arrived verified.
A local placement (the router's `local` or `colocated` mode: prefill and decode on one worker) reserves in
its prefill command instead (`PrefillRequest.reserve`): no KV moves, so nothing needs the reservation
before the prefill, and the reserve's round trip is saved.

Admission: a request the coordinator accepted is *awaiting admission* until its first decode reservation;
the coordinator counts those against `max_waiting_requests` when a Submit arrives (lifecycle/coordinator.py),
so the queue is bounded even when a burst of Submits arrives before any of them has heard that decode is
full. A request already admitted once (migrated, or resumed by recovery) never counts again.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from opentelemetry import trace

from pdserve.bus import BusTimeout, RejectedError
from pdserve.events import AdmissionDeferred, DecodeReserved, RequestRouted
from pdserve.ids import new_id
from pdserve.lifecycle.context import PhaseFailed, RequestContext
from pdserve.messages import (
    LOCAL_ENDPOINT,
    DecodeAdmitted,
    LocalReserve,
    PrefillRequest,
    PrefillResult,
    RejectCode,
    Reservation,
    ReserveRequest,
    RouteDecision,
    RouteRequest,
    StartDecode,
)
from pdserve.states import Phase
from pdserve.telemetry import metrics

log = logging.getLogger(__name__)
tracer = trace.get_tracer("pdserve.coordinator")

ROUTE_RETRY_S = 0.25
T = TypeVar("T")


async def ask_route(ctx: RequestContext, prompt: tuple[int, ...]) -> tuple[RouteDecision, float]:
    """A placement of `prompt`: from the coordinator's own placer (`ctx.placer`), else asked of the router
    service; retried for `route_wait_s` while the router is unreachable, no live pair exists, or the
    placement names a worker this coordinator already saw die. Returns the decision and the seconds it
    took; records nothing (`route` does). Raises `PhaseFailed` (phase route) after `route_wait_s`."""
    settings = ctx.settings
    t0 = time.perf_counter()
    deadline = time.monotonic() + settings.route_wait_s
    req = RouteRequest(
        request_id=ctx.request_id,
        num_prompt_tokens=len(prompt),
        prompt_token_ids=prompt,
        cache_salt=ctx.submit.cache_salt,
    )
    with tracer.start_as_current_span("coordinator.route"):
        while True:
            try:
                decision = await (ctx.placer.place(req) if ctx.placer is not None else ctx.bus.request(
                    ctx.bus.subjects.route, req, RouteDecision, settings.route_timeout_s))
                dead = {
                    w
                    for w in (decision.prefill_worker_id, decision.decode_worker_id)
                    if ctx.liveness.is_dead(w)
                }
                if not dead:
                    return decision, time.perf_counter() - t0
                reason = f"the router still lists dead {', '.join(sorted(dead))}"
            except BusTimeout as e:
                reason = f"router unreachable ({e})"
            except RejectedError as e:
                if e.code is not RejectCode.NO_WORKERS:
                    raise
                reason = e.message
            if time.monotonic() + ROUTE_RETRY_S > deadline:
                raise PhaseFailed(Phase.ROUTE, f"{reason} for {settings.route_wait_s} s")
            await asyncio.sleep(ROUTE_RETRY_S)


async def route(ctx: RequestContext, prompt: tuple[int, ...],
                asked: Awaitable[tuple[RouteDecision, float]] | None = None) -> RouteDecision:
    """The route phase: the router's placement of `prompt` (`ask_route`; or `asked`, the answer to a
    question already put to it for this prompt), recorded as `RequestRouted`. Raises as `ask_route`."""
    ctx.enter(Phase.ROUTE, set())
    decision, route_s = await (asked if asked is not None else ask_route(ctx, prompt))
    await ctx.bus.emit(ctx.request_id, RequestRouted.of(decision, route_s=route_s))
    return decision


async def place(
    ctx: RequestContext,
    decision: RouteDecision,
    prompt: tuple[int, ...],
    start_index: int,
    timings: dict[str, float],
) -> DecodeAdmitted:
    """Reserve, prefill `prompt` and start decode from output index `start_index`; a transfer that
    fails verification is redone (fresh reservation and prefill) up to `max_prefill_attempts`, then
    `PhaseFailed` (phase transfer). A local placement (prefill and decode on one worker) reserves in its
    prefill command: one round trip fewer, no transfer. `timings` gets the UNIX seconds each step began
    (a local placement's "reserve" and "prefill" are the same instant), and "first_token" when the first
    attempt's prefill worker streamed the first token itself. The first attempt's first token is the
    request's: the client may already have it, so a retry streams none and decodes from it."""
    settings = ctx.settings
    max_tokens = ctx.submit.sampling.max_tokens - start_index
    local = decision.prefill_worker_id == decision.decode_worker_id
    first: PrefillResult | None = None
    for attempt in range(1, settings.max_prefill_attempts + 1):
        timings["reserve"] = time.time()
        if local:
            transfer_id, endpoint, cached = new_id(), LOCAL_ENDPOINT, 0
            reserve = LocalReserve(max_tokens=max_tokens, lease_s=settings.prefill_timeout_s)
        else:
            reservation = await _reserve(ctx, decision, len(prompt), max_tokens, prompt)
            transfer_id, endpoint = reservation.transfer_id, reservation.endpoint
            cached, reserve = reservation.num_cached_tokens, None
        timings["prefill"] = time.time()
        prefill = PrefillRequest(
            request_id=ctx.request_id, transfer_id=transfer_id, prompt_token_ids=prompt,
            sampling=ctx.submit.sampling, decode_worker_id=decision.decode_worker_id, endpoint=endpoint,
            decode_num_cached_tokens=cached, cache_salt=ctx.submit.cache_salt, output_start_index=start_index,
            stream_first_token=first is None, reserve=reserve,
        )
        if local:
            result = await _until_admitted(ctx, decision.decode_worker_id,
                                           functools.partial(_prefill, ctx, decision, prefill))
        else:
            result = await _prefill(ctx, decision, prefill)
        timings["prefilled"] = time.time()
        if first is None:
            first = result
            if result.first_token_ts:
                timings["first_token"] = result.first_token_ts
        # a hybrid's state handoff, after the compute (PrefillResult.state_s): the TTFT's serial state part
        timings["state_sent"] = max(timings["prefill"], timings["prefilled"] - result.state_s)
        try:
            admitted = await _start(ctx, decision, transfer_id, first, prompt, start_index)
            break
        except RejectedError as e:
            if e.code is not RejectCode.TRANSFER_FAILED:
                raise
            log.warning("request %s: %s (attempt %d)", ctx.request_id, e.message, attempt)
            await ctx.release(decision.prefill_worker_id, "transfer failed")
    else:
        raise PhaseFailed(Phase.TRANSFER, f"KV not verified after {settings.max_prefill_attempts} attempts")
    if not local:
        await ctx.release(decision.prefill_worker_id, "transferred")  # decode confirmed: prefill KV done
    return admitted


async def _until_admitted(ctx: RequestContext, worker: str, command: Callable[[], Awaitable[T]]) -> T:
    """`command()` — a reserve on decode worker `worker`, or a local placement's reserve-and-prefill —
    again while the worker refuses it with CAPACITY (decode full: `AdmissionDeferred` emitted once, retried
    with backoff 20 ms → 0.5 s), for `admission_wait_s` at most, then `PhaseFailed` (phase admission).
    The request leaves the admission queue once it succeeds."""
    settings = ctx.settings
    deadline = time.monotonic() + settings.admission_wait_s
    delay, deferred = 0.02, False
    while True:
        try:
            reply = await command()
            break
        except RejectedError as e:
            if e.code is not RejectCode.CAPACITY:
                raise
            if not deferred:
                deferred = True
                metrics.ADMISSION_DEFERRED.labels(worker_id=worker).inc()
                await ctx.bus.emit(ctx.request_id,
                                   AdmissionDeferred(decode_worker_id=worker, reason=e.message))
            if time.monotonic() + delay > deadline:
                raise PhaseFailed(
                    Phase.ADMISSION, f"decode {worker} full for {settings.admission_wait_s} s"
                ) from e
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)
    ctx.awaiting_admission = False  # admitted; a failed or aborted request leaves the queue by ending
    return reply


async def _reserve(
    ctx: RequestContext,
    decision: RouteDecision,
    num_prompt_tokens: int,
    max_tokens: int,
    prompt: tuple[int, ...] = (),
) -> Reservation:
    """Reserve decode KV on the decode worker (waiting, bounded, while it is full: `_until_admitted`)."""
    settings = ctx.settings
    worker = decision.decode_worker_id
    ctx.enter(Phase.RESERVE, {worker})
    req = ReserveRequest(
        request_id=ctx.request_id,
        transfer_id=new_id(),
        num_prompt_tokens=num_prompt_tokens,
        max_tokens=max_tokens,
        lease_s=settings.prefill_timeout_s,
        prompt_token_ids=prompt,
        cache_salt=ctx.submit.cache_salt,
    )
    t0 = time.perf_counter()

    def reserve() -> Awaitable[Reservation]:
        ctx.holders.add(worker)
        return ctx.command(worker, ctx.bus.request(ctx.bus.subjects.worker(worker, "reserve"), req,
                                                   Reservation, settings.reserve_timeout_s))

    with tracer.start_as_current_span("coordinator.reserve"):
        reservation = await _until_admitted(ctx, worker, reserve)
    await ctx.bus.emit(
        ctx.request_id,
        DecodeReserved(
            decode_worker_id=worker,
            transfer_id=reservation.transfer_id,
            num_tokens=reservation.num_tokens,
            reserve_s=time.perf_counter() - t0,
        ),
    )
    return reservation


async def _prefill(ctx: RequestContext, decision: RouteDecision, req: PrefillRequest) -> PrefillResult:
    worker = decision.prefill_worker_id
    ctx.enter(Phase.PREFILL, {worker, decision.decode_worker_id})
    ctx.holders.add(worker)
    with tracer.start_as_current_span("coordinator.prefill"):
        return await ctx.command(
            worker,
            ctx.bus.request(ctx.bus.subjects.worker(worker, "prefill"), req, PrefillResult,
                            ctx.settings.prefill_timeout_s),
        )


async def _start(
    ctx: RequestContext,
    decision: RouteDecision,
    transfer_id: str,
    result: PrefillResult,
    prompt: tuple[int, ...],
    start_index: int,
) -> DecodeAdmitted:
    worker = decision.decode_worker_id
    ctx.enter(Phase.TRANSFER, {worker})
    with tracer.start_as_current_span("coordinator.start_decode"):
        return await ctx.command(
            worker,
            ctx.bus.request(
                ctx.bus.subjects.worker(worker, "start"),
                StartDecode(
                    request_id=ctx.request_id,
                    transfer_id=transfer_id,
                    first_token_id=result.first_token_id,
                    prompt_token_ids=prompt,
                    sampling=ctx.submit.sampling,
                    output_start_index=start_index,
                    first_token_logprobs=result.first_token_logprobs,
                ),
                DecodeAdmitted,
                ctx.settings.prefill_timeout_s,
            ),
        )

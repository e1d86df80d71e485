"""One request's lifecycle across the pools, owned by the coordinator (DESIGN §2).

route → reserve decode KV (waiting, bounded, while decode is full) → prefill with the transfer plan →
start decode (which waits for the KV to arrive verified) → wait for the decode to finish. Every phase
has a deadline, so every request ends: `RequestCompleted`, `RequestFailed` {phase, reason} or
`RequestAborted`. Whatever the outcome, everything the request holds on every worker is released.
A transfer that fails verification is retried with a fresh reservation and prefill, up to
`max_prefill_attempts`; unverified KV is never admitted.
"""

from __future__ import annotations

import asyncio
import logging
import time

from opentelemetry import trace

from pdserve.bus import Bus, BusTimeout, RejectedError
from pdserve.config import CoordinatorSettings
from pdserve.events import (
    AdmissionDeferred,
    DecodeReserved,
    RequestAborted,
    RequestCompleted,
    RequestFailed,
    RequestRouted,
    TTFTBreakdown,
)
from pdserve.ids import new_id
from pdserve.messages import (
    Ack,
    DecodeAdmitted,
    DecodeFinished,
    FinishReason,
    PrefillRequest,
    PrefillResult,
    RejectCode,
    Release,
    Reservation,
    ReserveRequest,
    RouteDecision,
    RouteRequest,
    StartDecode,
    Submit,
    TokenChunk,
)

log = logging.getLogger(__name__)
tracer = trace.get_tracer("pdserve.coordinator")


class PhaseFailed(Exception):
    def __init__(self, phase: str, reason: str) -> None:
        super().__init__(f"{phase}: {reason}")
        self.phase = phase
        self.reason = reason


class RequestLifecycle:
    def __init__(self, bus: Bus, settings: CoordinatorSettings, submit: Submit) -> None:
        self.bus = bus
        self.settings = settings
        self.submit = submit
        self.request_id = submit.request_id
        self.accepted_ts = time.time()
        self.finished: asyncio.Future[DecodeFinished] = asyncio.get_running_loop().create_future()
        self.holders: set[str] = set()  # workers that may hold something of this request
        self.phase = "route"
        self.decision: RouteDecision | None = None

    async def run(self) -> None:
        try:
            with tracer.start_as_current_span("coordinator.request") as span:
                span.set_attribute("pdserve.request_id", self.request_id)
                await self._run(span)
        except asyncio.CancelledError:
            await self.bus.emit(self.request_id, RequestAborted(reason=f"aborted during {self.phase}"))
            raise
        except (PhaseFailed, BusTimeout, RejectedError) as e:
            phase, reason = (e.phase, e.reason) if isinstance(e, PhaseFailed) else (self.phase, str(e))
            log.warning("request %s failed in %s: %s", self.request_id, phase, reason)
            await self.bus.emit(self.request_id, RequestFailed(phase=phase, reason=reason))
            await self.bus.publish(self.bus.subjects.tokens(self.request_id),
                                   TokenChunk(request_id=self.request_id, index=0, error=f"{phase}: {reason}"))
        finally:
            await self._release_all()

    async def _run(self, span: trace.Span) -> None:
        t_route = time.time()
        decision = self.decision = await self._route()
        t_reserve = time.time()
        for attempt in range(1, self.settings.max_prefill_attempts + 1):
            reservation = await self._reserve(decision)
            t_prefill = time.time()
            result = await self._prefill(decision, reservation)
            t_prefilled = time.time()
            try:
                admitted = await self._start(decision, reservation, result)
                break
            except RejectedError as e:
                if e.code is not RejectCode.TRANSFER_FAILED:
                    raise
                log.warning("request %s: %s (attempt %d)", self.request_id, e.message, attempt)
                await self._release(decision.prefill_worker_id, "transfer failed")
        else:
            raise PhaseFailed("transfer", f"KV not verified after {self.settings.max_prefill_attempts} attempts")
        await self._release(decision.prefill_worker_id, "transferred")  # decode confirmed: prefill KV done
        self.phase = "decode"
        with tracer.start_as_current_span("coordinator.decode"):
            try:
                done = await asyncio.wait_for(asyncio.shield(self.finished), self.settings.decode_timeout_s)
            except TimeoutError as e:
                raise PhaseFailed("decode", f"no finish within {self.settings.decode_timeout_s} s") from e
        received = self.submit.received_ts
        transfer_end = max(t_prefilled, admitted.transfer_done_ts)
        ttft = TTFTBreakdown(
            queue_s=self.accepted_ts - received, route_s=t_reserve - t_route, reserve_s=t_prefill - t_reserve,
            prefill_s=t_prefilled - t_prefill, exposed_transfer_s=transfer_end - t_prefilled,
            first_token_s=max(0.0, admitted.first_token_ts - transfer_end),
            ttft_s=admitted.first_token_ts - received,
        )
        for name, value in ttft.model_dump().items():
            span.set_attribute(f"pdserve.ttft.{name}" if name != "ttft_s" else "pdserve.ttft_s", value)
        await self.bus.emit(self.request_id, RequestCompleted(
            finish_reason=done.finish_reason, prompt_tokens=len(self.submit.prompt_token_ids),
            completion_tokens=done.num_output_tokens, ttft=ttft, e2e_s=done.last_token_ts - received))

    async def _route(self) -> RouteDecision:
        self.phase = "route"
        t0 = time.perf_counter()
        with tracer.start_as_current_span("coordinator.route"):
            decision = await self.bus.request(
                self.bus.subjects.route,
                RouteRequest(request_id=self.request_id, num_prompt_tokens=len(self.submit.prompt_token_ids)),
                RouteDecision, self.settings.route_timeout_s)
        await self.bus.emit(self.request_id, RequestRouted(
            mode=decision.mode, prefill_worker_id=decision.prefill_worker_id,
            decode_worker_id=decision.decode_worker_id, candidates=list(decision.candidates),
            predicted_cached_tokens=decision.predicted_cached_tokens,
            best_cached_tokens=decision.best_cached_tokens, route_s=time.perf_counter() - t0))
        return decision

    async def _reserve(self, decision: RouteDecision) -> Reservation:
        """Reserve decode KV; while the decode worker is full, wait (bounded by `admission_wait_s`)."""
        self.phase = "reserve"
        worker = decision.decode_worker_id
        req = ReserveRequest(request_id=self.request_id, transfer_id=new_id(),
                             num_prompt_tokens=len(self.submit.prompt_token_ids),
                             max_tokens=self.submit.sampling.max_tokens, lease_s=self.settings.prefill_timeout_s)
        deadline = time.monotonic() + self.settings.admission_wait_s
        delay, deferred = 0.02, False
        t0 = time.perf_counter()
        with tracer.start_as_current_span("coordinator.reserve"):
            while True:
                self.holders.add(worker)
                try:
                    reservation = await self.bus.request(self.bus.subjects.worker(worker, "reserve"), req,
                                                         Reservation, self.settings.reserve_timeout_s)
                    break
                except RejectedError as e:
                    if e.code is not RejectCode.CAPACITY:
                        raise
                    if not deferred:
                        deferred = True
                        await self.bus.emit(self.request_id, AdmissionDeferred(decode_worker_id=worker,
                                                                               reason=e.message))
                    if time.monotonic() + delay > deadline:
                        raise PhaseFailed("admission", f"decode {worker} full for "
                                          f"{self.settings.admission_wait_s} s") from e
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 0.5)
        await self.bus.emit(self.request_id, DecodeReserved(
            decode_worker_id=worker, transfer_id=reservation.transfer_id, num_tokens=reservation.num_tokens,
            reserve_s=time.perf_counter() - t0))
        return reservation

    async def _prefill(self, decision: RouteDecision, reservation: Reservation) -> PrefillResult:
        self.phase = "prefill"
        worker = decision.prefill_worker_id
        self.holders.add(worker)
        with tracer.start_as_current_span("coordinator.prefill"):
            return await self.bus.request(
                self.bus.subjects.worker(worker, "prefill"),
                PrefillRequest(request_id=self.request_id, transfer_id=reservation.transfer_id,
                               prompt_token_ids=self.submit.prompt_token_ids, sampling=self.submit.sampling,
                               decode_worker_id=decision.decode_worker_id, endpoint=reservation.endpoint),
                PrefillResult, self.settings.prefill_timeout_s)

    async def _start(self, decision: RouteDecision, reservation: Reservation,
                     result: PrefillResult) -> DecodeAdmitted:
        self.phase = "transfer"
        with tracer.start_as_current_span("coordinator.start_decode"):
            return await self.bus.request(
                self.bus.subjects.worker(decision.decode_worker_id, "start"),
                StartDecode(request_id=self.request_id, transfer_id=reservation.transfer_id,
                            first_token_id=result.first_token_id, prompt_token_ids=self.submit.prompt_token_ids,
                            sampling=self.submit.sampling),
                DecodeAdmitted, self.settings.prefill_timeout_s)

    async def finish_early(self, finish_reason: FinishReason, reason: str) -> bool:
        """The gateway ended a decoding request as finished (a stop string): the decode worker commits
        its tokens and reports `DecodeFinished`, so the request completes. False if not decoding."""
        if self.phase != "decode" or self.decision is None:
            return False
        await self._release(self.decision.decode_worker_id, reason, finish_reason)
        return True

    async def _release(self, worker: str, reason: str, finish_reason: FinishReason | None = None) -> None:
        try:
            await self.bus.request(self.bus.subjects.worker(worker, "release"),
                                   Release(request_id=self.request_id, reason=reason, finish_reason=finish_reason),
                                   Ack, timeout_s=2.0)
            self.holders.discard(worker)
        except (BusTimeout, RejectedError) as e:
            log.warning("release of %s on %s failed: %s", self.request_id, worker, e)

    async def _release_all(self) -> None:
        await asyncio.gather(*(self._release(w, "finished") for w in list(self.holders)))

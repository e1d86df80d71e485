"""One placement of a request: reserve decode KV (waiting, bounded, while decode is full), prefill with the
transfer plan, start decode once the KV arrived verified.

Admission: a request the coordinator accepted is *awaiting admission* until its first decode reservation;
the coordinator counts those against `max_waiting_requests` when a Submit arrives (lifecycle/coordinator.py),
so the queue is bounded even when a burst of Submits arrives before any of them has heard that decode is
full. A request already admitted once (migrated, or resumed by recovery) never counts again.
"""

from __future__ import annotations

import asyncio
import logging
import time

from opentelemetry import trace

from pdserve.bus import RejectedError
from pdserve.events import AdmissionDeferred, DecodeReserved
from pdserve.ids import new_id
from pdserve.lifecycle.phases import PhaseFailed, Phases
from pdserve.messages import (
    DecodeAdmitted,
    PrefillRequest,
    PrefillResult,
    RejectCode,
    Reservation,
    ReserveRequest,
    RouteDecision,
    StartDecode,
)
from pdserve.telemetry import metrics

log = logging.getLogger(__name__)
tracer = trace.get_tracer("pdserve.coordinator")


class Placement(Phases):
    async def place(
        self, decision: RouteDecision, prompt: tuple[int, ...], start_index: int, timings: dict[str, float]
    ) -> DecodeAdmitted:
        """Reserve, prefill `prompt` and start decode from output index `start_index`; a transfer that
        fails verification is redone (fresh reservation and prefill) up to `max_prefill_attempts`."""
        max_tokens = self.submit.sampling.max_tokens - start_index
        for attempt in range(1, self.settings.max_prefill_attempts + 1):
            timings["reserve"] = time.time()
            reservation = await self._reserve(decision, len(prompt), max_tokens, prompt)
            timings["prefill"] = time.time()
            result = await self._prefill(decision, reservation, prompt)
            timings["prefilled"] = time.time()
            try:
                admitted = await self._start(decision, reservation, result, prompt, start_index)
                break
            except RejectedError as e:
                if e.code is not RejectCode.TRANSFER_FAILED:
                    raise
                log.warning("request %s: %s (attempt %d)", self.request_id, e.message, attempt)
                await self._release(decision.prefill_worker_id, "transfer failed")
        else:
            raise PhaseFailed(
                "transfer", f"KV not verified after {self.settings.max_prefill_attempts} attempts"
            )
        if decision.prefill_worker_id != decision.decode_worker_id:
            await self._release(
                decision.prefill_worker_id, "transferred"
            )  # decode confirmed: prefill KV done
        return admitted

    async def _reserve(
        self, decision: RouteDecision, num_prompt_tokens: int, max_tokens: int, prompt: tuple[int, ...] = ()
    ) -> Reservation:
        """Reserve decode KV; while the decode worker is full, wait (bounded by `admission_wait_s`), then
        fail with phase `admission`."""
        self.phase = "reserve"
        worker = decision.decode_worker_id
        self.watched = {worker}
        req = ReserveRequest(
            request_id=self.request_id,
            transfer_id=new_id(),
            num_prompt_tokens=num_prompt_tokens,
            max_tokens=max_tokens,
            lease_s=self.settings.prefill_timeout_s,
            prompt_token_ids=prompt,
            cache_salt=self.submit.cache_salt,
        )
        deadline = time.monotonic() + self.settings.admission_wait_s
        delay, deferred = 0.02, False
        t0 = time.perf_counter()
        with tracer.start_as_current_span("coordinator.reserve"):
            while True:
                self.holders.add(worker)
                try:
                    reservation = await self.command(
                        worker,
                        self.bus.request(
                            self.bus.subjects.worker(worker, "reserve"),
                            req,
                            Reservation,
                            self.settings.reserve_timeout_s,
                        ),
                    )
                    break
                except RejectedError as e:
                    if e.code is not RejectCode.CAPACITY:
                        raise
                    if not deferred:
                        deferred = True
                        metrics.ADMISSION_DEFERRED.labels(worker_id=worker).inc()
                        await self.bus.emit(
                            self.request_id, AdmissionDeferred(decode_worker_id=worker, reason=e.message)
                        )
                    if time.monotonic() + delay > deadline:
                        raise PhaseFailed(
                            "admission", f"decode {worker} full for {self.settings.admission_wait_s} s"
                        ) from e
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 0.5)
        self.awaiting_admission = False  # admitted; a failed or aborted request leaves the queue by ending
        await self.bus.emit(
            self.request_id,
            DecodeReserved(
                decode_worker_id=worker,
                transfer_id=reservation.transfer_id,
                num_tokens=reservation.num_tokens,
                reserve_s=time.perf_counter() - t0,
            ),
        )
        return reservation

    async def _prefill(
        self, decision: RouteDecision, reservation: Reservation, prompt: tuple[int, ...]
    ) -> PrefillResult:
        self.phase = "prefill"
        worker = decision.prefill_worker_id
        self.holders.add(worker)
        self.watched = {worker, decision.decode_worker_id}
        with tracer.start_as_current_span("coordinator.prefill"):
            return await self.command(
                worker,
                self.bus.request(
                    self.bus.subjects.worker(worker, "prefill"),
                    PrefillRequest(
                        request_id=self.request_id,
                        transfer_id=reservation.transfer_id,
                        prompt_token_ids=prompt,
                        sampling=self.submit.sampling,
                        decode_worker_id=decision.decode_worker_id,
                        endpoint=reservation.endpoint,
                        decode_num_cached_tokens=reservation.num_cached_tokens,
                        cache_salt=self.submit.cache_salt,
                    ),
                    PrefillResult,
                    self.settings.prefill_timeout_s,
                ),
            )

    async def _start(
        self,
        decision: RouteDecision,
        reservation: Reservation,
        result: PrefillResult,
        prompt: tuple[int, ...],
        start_index: int,
    ) -> DecodeAdmitted:
        self.phase = "transfer"
        worker = decision.decode_worker_id
        self.watched = {worker}
        with tracer.start_as_current_span("coordinator.start_decode"):
            return await self.command(
                worker,
                self.bus.request(
                    self.bus.subjects.worker(worker, "start"),
                    StartDecode(
                        request_id=self.request_id,
                        transfer_id=reservation.transfer_id,
                        first_token_id=result.first_token_id,
                        prompt_token_ids=prompt,
                        sampling=self.submit.sampling,
                        output_start_index=start_index,
                        first_token_logprobs=result.first_token_logprobs,
                    ),
                    DecodeAdmitted,
                    self.settings.prefill_timeout_s,
                ),
            )

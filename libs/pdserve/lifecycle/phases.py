"""The phases of one placement of a request: route, reserve, prefill, start decode; and its completion.

`Phases` is the base of `RequestLifecycle` (lifecycle/request.py), which strings placements together
across migrations. Each command to a worker is raced against that worker's liveness (`watch`): a worker
whose heartbeats stop, or that does not answer a command, raises `WorkerLost`, which the lifecycle turns
into a migration.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import TypeVar

from nats.errors import NoRespondersError
from opentelemetry import trace

from pdserve.bus import Bus, BusTimeout, RejectedError
from pdserve.config import CoordinatorSettings
from pdserve.events import AdmissionDeferred, DecodeReserved, RequestCompleted, RequestRouted, TTFTBreakdown
from pdserve.ids import new_id
from pdserve.lifecycle.liveness import WorkerLiveness
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
)

log = logging.getLogger(__name__)
tracer = trace.get_tracer("pdserve.coordinator")

T = TypeVar("T")
ROUTE_RETRY_S = 0.25


class PhaseFailed(Exception):
    def __init__(self, phase: str, reason: str) -> None:
        super().__init__(f"{phase}: {reason}")
        self.phase = phase
        self.reason = reason


class WorkerLost(Exception):
    """A worker this placement depends on died (heartbeats stopped) or did not answer a command."""

    def __init__(self, worker_id: str, phase: str, reason: str) -> None:
        super().__init__(f"{worker_id} lost in {phase}: {reason}")
        self.worker_id = worker_id
        self.phase = phase
        self.reason = reason


class Phases:
    def __init__(
        self, bus: Bus, settings: CoordinatorSettings, submit: Submit, liveness: WorkerLiveness
    ) -> None:
        self.bus = bus
        self.settings = settings
        self.submit = submit
        self.liveness = liveness
        self.request_id = submit.request_id
        self.holders: set[str] = set()  # workers that may hold something of this request
        self.watched: set[str] = set()  # workers whose death abandons the current phase
        self.phase = "route"
        self.waiting_admission = False  # in the admission queue: decode said full, waiting to retry

    async def watch(self, coro: Awaitable[T]) -> T:
        """Await `coro` unless a worker of `self.watched` dies first: then cancel it, raise `WorkerLost`."""
        main = asyncio.ensure_future(coro)
        lost = asyncio.ensure_future(self.liveness.first_lost(lambda: self.watched))
        try:
            await asyncio.wait({main, lost}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (main, lost):
                if not task.done():
                    task.cancel()
            await asyncio.gather(main, lost, return_exceptions=True)
        if main.done() and not main.cancelled():
            return main.result()
        silent = self.liveness.silent_s(lost.result())
        raise WorkerLost(lost.result(), self.phase, f"no heartbeat for {silent:.1f} s")

    async def command(self, worker: str, coro: Awaitable[T]) -> T:
        """A command to `worker`, watched; a worker that does not answer is lost."""
        try:
            return await self.watch(coro)
        except BusTimeout as e:
            if isinstance(e.__cause__, NoRespondersError):  # nobody subscribed: the process is gone
                self.liveness.suspect(worker)
            raise WorkerLost(worker, self.phase, str(e)) from e

    # ------------------------------------------------------------ route

    async def route(self, prompt: tuple[int, ...]) -> RouteDecision:
        """Ask the router for a placement of `prompt`; retried for `route_wait_s` while the router is
        unreachable, has no live pair, or names a worker this coordinator already saw die."""
        self.phase = "route"
        self.watched = set()
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.settings.route_wait_s
        req = RouteRequest(
            request_id=self.request_id,
            num_prompt_tokens=len(prompt),
            prompt_token_ids=prompt,
            cache_salt=self.submit.cache_salt,
        )
        with tracer.start_as_current_span("coordinator.route"):
            while True:
                try:
                    decision = await self.bus.request(
                        self.bus.subjects.route, req, RouteDecision, self.settings.route_timeout_s
                    )
                    dead = {
                        w
                        for w in (decision.prefill_worker_id, decision.decode_worker_id)
                        if self.liveness.is_dead(w)
                    }
                    if not dead:
                        break
                    reason = f"the router still lists dead {', '.join(sorted(dead))}"
                except BusTimeout as e:
                    reason = f"router unreachable ({e})"
                except RejectedError as e:
                    if e.code is not RejectCode.NO_WORKERS:
                        raise
                    reason = e.message
                if time.monotonic() + ROUTE_RETRY_S > deadline:
                    raise PhaseFailed("route", f"{reason} for {self.settings.route_wait_s} s")
                await asyncio.sleep(ROUTE_RETRY_S)
        await self.bus.emit(
            self.request_id,
            RequestRouted(
                mode=decision.mode,
                prefill_worker_id=decision.prefill_worker_id,
                decode_worker_id=decision.decode_worker_id,
                candidates=list(decision.candidates),
                predicted_cached_tokens=decision.predicted_cached_tokens,
                best_cached_tokens=decision.best_cached_tokens,
                route_s=time.perf_counter() - t0,
                policy=decision.policy,
                block_size=decision.block_size,
                prompt_block_hashes=list(decision.prompt_block_hashes),
            ),
        )
        return decision

    # ------------------------------------------------------------ reserve → prefill → start

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
        """Reserve decode KV; while the decode worker is full, wait (bounded by `admission_wait_s`)."""
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
            try:
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
                        self.waiting_admission = True
                        if not deferred:
                            deferred = True
                            await self.bus.emit(
                                self.request_id, AdmissionDeferred(decode_worker_id=worker, reason=e.message)
                            )
                        if time.monotonic() + delay > deadline:
                            raise PhaseFailed(
                                "admission", f"decode {worker} full for {self.settings.admission_wait_s} s"
                            ) from e
                        await asyncio.sleep(delay)
                        delay = min(delay * 2, 0.5)
            finally:
                # Whatever ends the wait (reserved, failed, aborted), the request leaves the queue.
                self.waiting_admission = False
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

    # ------------------------------------------------------------ end

    async def complete(
        self, done: DecodeFinished, admitted: DecodeAdmitted | None, timings: dict[str, float]
    ) -> None:
        """Emit `RequestCompleted`. The TTFT breakdown is of this coordinator's first placement; a
        request resumed while decoding has only its total TTFT (the phases ran under another coordinator)."""
        received = self.submit.received_ts
        if admitted is not None and timings:
            transfer_end = max(timings["prefilled"], admitted.transfer_done_ts)
            ttft = TTFTBreakdown(
                queue_s=max(0.0, timings["route"] - received),
                route_s=timings["reserve"] - timings["route"],
                reserve_s=timings["prefill"] - timings["reserve"],
                prefill_s=timings["prefilled"] - timings["prefill"],
                exposed_transfer_s=transfer_end - timings["prefilled"],
                first_token_s=max(0.0, admitted.first_token_ts - transfer_end),
                ttft_s=admitted.first_token_ts - received,
            )
        else:
            ttft = TTFTBreakdown(
                queue_s=0.0,
                route_s=0.0,
                reserve_s=0.0,
                prefill_s=0.0,
                exposed_transfer_s=0.0,
                first_token_s=0.0,
                ttft_s=max(0.0, done.first_token_ts - received),
            )
        span = trace.get_current_span()
        for name, value in ttft.model_dump().items():
            span.set_attribute(f"pdserve.ttft.{name}" if name != "ttft_s" else "pdserve.ttft_s", value)
        await self.bus.emit(
            self.request_id,
            RequestCompleted(
                finish_reason=done.finish_reason,
                prompt_tokens=len(self.submit.prompt_token_ids),
                completion_tokens=done.num_output_tokens,
                ttft=ttft,
                e2e_s=done.last_token_ts - received,
            ),
        )

    async def _release(self, worker: str, reason: str, finish_reason: FinishReason | None = None) -> None:
        try:
            await self.bus.request(
                self.bus.subjects.worker(worker, "release"),
                Release(request_id=self.request_id, reason=reason, finish_reason=finish_reason),
                Ack,
                timeout_s=2.0,
            )
            self.holders.discard(worker)
        except (BusTimeout, RejectedError) as e:
            log.warning("release of %s on %s failed: %s", self.request_id, worker, e)

    async def _release_all(self) -> None:
        await asyncio.gather(*(self._release(w, "finished") for w in list(self.holders)))

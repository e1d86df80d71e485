"""The shared ground of one request's placements: commands raced against worker liveness, routing, and
releasing what the request holds.

`Phases` is the base of `Placement` (lifecycle/placement.py: reserve → prefill → start decode), itself the
base of `RequestLifecycle` (lifecycle/request.py), which strings placements together across migrations.
Each command to a worker is raced against that worker's liveness (`watch`): a worker whose heartbeats
stop, or that does not answer a command, raises `WorkerLost`, which the lifecycle turns into a migration.
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
from pdserve.events import RequestRouted
from pdserve.lifecycle.liveness import WorkerLiveness
from pdserve.messages import (
    Ack,
    FinishReason,
    RejectCode,
    Release,
    RouteDecision,
    RouteRequest,
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
        # Accepted, never yet reserved decode KV (lifecycle/placement.py): counted against the bound.
        self.awaiting_admission = True

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

    # ------------------------------------------------------------ release

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

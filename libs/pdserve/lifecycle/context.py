"""What the steps of one request's lifecycle share: the request, the phase it is in, the workers it holds
or depends on, and commands to those workers raced against their liveness.

`RequestLifecycle` (lifecycle/request.py) owns one `RequestContext` and passes it to the placement steps
(lifecycle/placement.py). Each command to a worker is raced against that worker's liveness (`watch`): a
worker whose heartbeats stop, or that does not answer a command, raises `WorkerLost`, which the lifecycle
turns into a migration. A phase that runs out of time or options raises `PhaseFailed`, which ends the
request with `RequestFailed`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from nats.errors import NoRespondersError

from pdserve.bus import Bus, BusTimeout, RejectedError
from pdserve.config import CoordinatorSettings
from pdserve.lifecycle.liveness import WorkerLiveness
from pdserve.messages import Ack, FinishReason, Release, Submit
from pdserve.routing.live import LivePlacer
from pdserve.states import Phase

log = logging.getLogger(__name__)

T = TypeVar("T")


class PhaseFailed(Exception):
    """Phase `phase` of a request cannot complete (`reason`): the request fails."""

    def __init__(self, phase: Phase, reason: str) -> None:
        super().__init__(f"{phase}: {reason}")
        self.phase = phase
        self.reason = reason


class WorkerLost(Exception):
    """A worker this placement depends on died (heartbeats stopped) or did not answer a command."""

    def __init__(self, worker_id: str, phase: Phase, reason: str) -> None:
        super().__init__(f"{worker_id} lost in {phase}: {reason}")
        self.worker_id = worker_id
        self.phase = phase
        self.reason = reason


class LeaseLost(Exception):
    """This coordinator no longer holds the lease that makes it the request's owner (lifecycle/ownership.py):
    it stops acting on the request at once, without an event or a release (the new owner resumes it)."""


class RequestContext:
    """One request as its lifecycle's steps see it. `holders`: workers that may hold something of the
    request (released at its end); `watched`: workers whose death abandons the current phase;
    `awaiting_admission`: accepted, never yet reserved decode KV (the coordinator counts these against
    `max_waiting_requests`). `placer`: the coordinator's own placer (None: the router service places)."""

    def __init__(
        self, bus: Bus, settings: CoordinatorSettings, submit: Submit, liveness: WorkerLiveness,
        owned: Callable[[], bool] = lambda: True, placer: LivePlacer | None = None,
    ) -> None:
        self.bus = bus
        self.placer = placer
        self.owned = owned
        self.settings = settings
        self.submit = submit
        self.liveness = liveness
        self.request_id = submit.request_id
        self.holders: set[str] = set()
        self.watched: set[str] = set()
        self.phase = Phase.ROUTE
        self.awaiting_admission = True

    def enter(self, phase: Phase, watched: set[str]) -> None:
        """Begin `phase`, abandoned if a worker of `watched` dies."""
        self.phase = phase
        self.watched = watched

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
        """A command to `worker`, watched; a worker that does not answer is lost. Raises `LeaseLost`, and
        sends nothing, when this coordinator's lease on the request is not valid (fencing)."""
        if not self.owned():
            if asyncio.iscoroutine(coro):
                coro.close()
            raise LeaseLost(self.request_id)
        try:
            return await self.watch(coro)
        except BusTimeout as e:
            if isinstance(e.__cause__, NoRespondersError):  # nobody subscribed: the process is gone
                self.liveness.suspect(worker)
            raise WorkerLost(worker, self.phase, str(e)) from e

    async def release(self, worker: str, reason: str, finish_reason: FinishReason | None = None) -> None:
        """Tell `worker` to free what it holds of this request; a failure is logged, never raised."""
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

    async def release_all(self) -> None:
        await asyncio.gather(*(self.release(w, "finished") for w in list(self.holders)))

"""The coordinator's state: the lifecycles in flight, the commands that touch them, and recovery.

Several coordinators may run at once (docs/architecture.md §18): each request is owned by the one whose
lease key names it (lifecycle/ownership.py). A Submit reaches one coordinator of the `coordinator` queue
group, which claims the request's lease and runs it; a coordinator whose lease expires (killed, stalled,
cut off) has its requests taken over by another's sweep, which folds their events from the log and
resumes each (lifecycle/recovery.py), exactly as a coordinator does at start for unfinished requests
that no coordinator owns. Nothing here outlives the process that the log and the leases do not hold.
`DecodeFinished` reports for requests this coordinator does not run (yet) are kept `UNCLAIMED_TTL_S`: a
request taken over after its decode worker reported finds its report here.
"""

from __future__ import annotations

import asyncio
import logging
import time

from sqlalchemy.ext.asyncio import AsyncEngine

from pdserve.bus import Bus, RejectedError
from pdserve.config import CoordinatorSettings, Placement, RouterSettings
from pdserve.events import RequestFailed, RequestRecovered, RequestTakenOver
from pdserve.lifecycle.liveness import WorkerLiveness
from pdserve.lifecycle.ownership import Ownership, Taken
from pdserve.lifecycle.receipt import store_received
from pdserve.lifecycle.recovery import Unfinished, Unresumable, plan, read_log, read_requests
from pdserve.lifecycle.request import RequestLifecycle, ResumePoint
from pdserve.messages import Abort, Accepted, Ack, DecodeFinished, RejectCode, Submit, TokenChunk
from pdserve.routing.live import LivePlacer
from pdserve.states import Phase, RecoveryAction
from pdserve.telemetry import metrics

log = logging.getLogger(__name__)

UNCLAIMED_TTL_S = 120.0  # a DecodeFinished no lifecycle claimed within this long is dropped
RECOVERY_BACKOFF_S = (0.5, 5.0)


class Coordinator:
    """Lifecycle: `Coordinator(bus, settings, db)` → `await serve()` (lease, handlers, liveness, the
    takeover sweep and recovery in the background) → `await stop()`. `db` (the event store) may be None:
    then nothing is recovered at start, and a takeover reads the request's events from JetStream alone.
    With `settings.placement` 'coordinator' it places its requests in-process (`routing.live.LivePlacer`,
    configured by `router_settings`, default `RouterSettings()` from the environment); with 'router' it
    asks the router service."""

    def __init__(self, bus: Bus, settings: CoordinatorSettings, db: AsyncEngine | None = None,
                 router_settings: RouterSettings | None = None) -> None:
        self.bus = bus
        self.settings = settings
        self.db = db
        self.placer = (LivePlacer(bus, router_settings or RouterSettings(), settings.worker_id)
                       if settings.placement is Placement.COORDINATOR else None)
        self.liveness = WorkerLiveness(bus, settings.worker_timeout_s)
        self.ownership = Ownership(bus, settings, on_fenced=self._fenced)
        self.active: dict[str, tuple[RequestLifecycle, asyncio.Task]] = {}
        self.unclaimed: dict[str, tuple[float, DecodeFinished]] = {}
        self.claiming: set[str] = set()  # Submits accepted here whose lease claim is in flight
        self.recovered = asyncio.Event()  # set once recovery has resumed every unfinished request
        self._sweeper: asyncio.Task | None = None

    def _lifecycle(self, submit: Submit, resume: ResumePoint | None = None) -> RequestLifecycle:
        return RequestLifecycle(self.bus, self.settings, submit, self.liveness, resume,
                                owned=self.ownership.valid, placer=self.placer)

    def _start(self, lifecycle: RequestLifecycle) -> None:
        rid = lifecycle.request_id
        task = self.bus.spawn(lifecycle.run())
        self.active[rid] = (lifecycle, task)

        def done(_: asyncio.Task) -> None:
            if self.active.get(rid, (None,))[0] is lifecycle:
                del self.active[rid]
            if lifecycle.handed_off:
                self.ownership.forget(rid)  # the key stays: whoever takes over finds the request in it
            else:
                self.bus.spawn(self.ownership.release(rid))  # its terminal event is stored by now

        task.add_done_callback(done)
        if (held := self.unclaimed.pop(rid, None)) is not None:
            lifecycle.on_finished(held[1])

    @property
    def num_waiting(self) -> int:
        """The admission queue: accepted requests that have not yet held a decode reservation (routing,
        reserving, or told by their decode worker that it is full and waiting to retry). Safe from the
        metrics server's thread: `list()` copies the values without running Python code."""
        waiting = sum(1 for lifecycle, _ in list(self.active.values()) if lifecycle.awaiting_admission)
        return len(self.claiming) + waiting  # claiming: accepted, lease claim in flight, about to wait

    async def submit(self, req: Submit) -> Accepted:
        """Start a request; a Submit of a request already in flight (the gateway retried, or recovery
        resumed it first) is accepted again without a second run. A Submit with a receipt is accepted
        once its `RequestReceived` is stored, which runs beside the route's and the claim's round trips;
        the run starts after it. Raises RejectedError(CAPACITY) while
        `max_waiting_requests` requests await admission (the gateway answers 503 + Retry-After). Counting
        every accepted request not yet reserved — not only those already told decode is full — keeps the
        bound when a burst of Submits arrives before any of them has reached a decode worker."""
        rid = req.request_id
        if rid not in self.active and rid not in self.claiming:
            if self.num_waiting >= self.settings.max_waiting_requests:
                raise RejectedError(RejectCode.CAPACITY, f"{self.num_waiting} requests already await "
                                    f"admission to decode (max_waiting_requests)")
            if not self.ownership.valid():
                raise RejectedError(RejectCode.UNAVAILABLE, "this coordinator holds no valid lease now")
            # counted as waiting while the claim's round trip runs, so Submits arriving meanwhile see it
            self.claiming.add(rid)
            lifecycle = self._lifecycle(req)
            lifecycle.route_ahead()  # the route's round trip overlaps the claim's and the store's
            stored = self.bus.spawn(store_received(self.bus, req))
            owner: str | None = ""
            try:
                owner = await self.ownership.claim(rid)
                await stored  # accepted means stored, and the run's events follow it
            except Exception as e:  # the lease bucket unreachable from here (NATS or its quorum lost)
                raise RejectedError(RejectCode.UNAVAILABLE, f"request lease not claimed: {e!r}") from e
            finally:
                self.claiming.discard(rid)
                if owner is not None:  # not this coordinator's: another holds it, or no claim was made
                    lifecycle.drop()
            if owner is None:
                self._start(lifecycle)
            # else another coordinator owns it (a retried Submit), or a duplicate here is being started:
            # accepted without a second run; if that owner dies, its lease's takeover resumes it
        return Accepted(request_id=req.request_id)

    async def abort(self, req: Abort) -> Ack:
        """Cancel a request in any phase; its lifecycle emits RequestAborted and releases its KV."""
        entry = self.active.get(req.request_id)
        if entry is None:
            return Ack()
        lifecycle, task = entry
        if req.finish_reason is not None and await lifecycle.finish_early(req.finish_reason, req.reason):
            return Ack()
        log.info("aborting %s: %s", req.request_id, req.reason)
        task.cancel()
        return Ack()

    async def finished(self, msg: DecodeFinished) -> Ack:
        entry = self.active.get(msg.request_id)
        if entry is not None:
            entry[0].on_finished(msg)
        else:  # another coordinator's request, or one this coordinator is about to take over
            now = time.monotonic()
            while self.unclaimed and now - next(iter(self.unclaimed.values()))[0] > UNCLAIMED_TTL_S:
                del self.unclaimed[next(iter(self.unclaimed))]
            self.unclaimed[msg.request_id] = (now, msg)
        return Ack()

    async def serve(self) -> None:
        metrics.ADMISSION_QUEUE_LENGTH.set_function(lambda: self.num_waiting)  # read at each scrape
        if self.placer is not None:
            await self.placer.start()
        await self.ownership.start()
        await self.liveness.start()
        s = self.bus.subjects
        await self.bus.serve(s.finished(), DecodeFinished, self.finished)
        await self.bus.serve(s.abort, Abort, self.abort)
        await self.bus.serve(s.submit, Submit, self.submit, queue="coordinator")
        if self.settings.recover_on_start and self.db is not None:
            self.bus.spawn(self.recover())
        else:
            self.recovered.set()
        self._sweeper = asyncio.ensure_future(self._sweep_forever())

    async def _sweep_forever(self) -> None:
        """Take over the requests of coordinators whose lease expired or was given up (ownership.py)."""
        period = max(self.settings.lease_renew_s, self.settings.lease_s / 4)
        while True:
            await asyncio.sleep(period)
            try:
                taken = await self.ownership.sweep()
            except Exception as e:  # NATS unreachable: the next sweep tries again
                log.warning("lease sweep failed (%s: %s)", type(e).__name__, e)
                continue
            if taken:
                await self._take_over(taken)

    async def _take_over(self, taken: list[Taken]) -> None:
        """Resume requests this coordinator now owns: their events folded from the log (JetStream, with
        Postgres for what the stream no longer holds), each resumed where it stands."""
        log.warning("taking over %d requests (%s)", len(taken),
                    ", ".join(sorted({f"{t.from_holder}: {t.reason}" for t in taken})))
        delay = RECOVERY_BACKOFF_S[0]
        while True:
            try:
                histories = await read_requests(self.bus, self.db, [t.request_id for t in taken])
                break
            except Exception as e:  # NATS or Postgres down: the log is still there; wait for it
                log.warning("takeover cannot read the log (%s: %s); retrying in %.1f s",
                            type(e).__name__, e, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, RECOVERY_BACKOFF_S[1])
        for t in taken:
            found = plan(t.request_id, histories.get(t.request_id, []))
            if found is None:  # ended before its owner released the lease
                await self.ownership.release(t.request_id)
                continue
            await self.bus.emit(t.request_id, RequestTakenOver(
                from_coordinator_id=t.from_holder, reason=t.reason, lease_revision=t.revision))
            await self._resume(found)

    async def _resume(self, found: Unfinished | Unresumable) -> None:
        if isinstance(found, Unresumable):
            await self._fail_unresumable(found)
            await self.ownership.release(found.request_id)
            return
        request_id = found.submit.request_id
        action = RecoveryAction.WATCH_DECODE if found.resume.decode_worker_id else RecoveryAction.RE_PREFILL
        await self.bus.emit(request_id, RequestRecovered(
            state=found.resume.state, num_committed_tokens=len(found.resume.committed), action=action))
        self._start(self._lifecycle(found.submit, found.resume))

    async def _fenced(self, holder: str) -> None:
        """This coordinator's lease `holder` was lost: stop acting on every request it ran, without ending
        or releasing any (the coordinator that takes them over resumes them from the log)."""
        entries = list(self.active.values())
        for lifecycle, task in entries:
            lifecycle.hand_off()
            task.cancel()
        await asyncio.gather(*(t for _, t in entries), return_exceptions=True)
        log.warning("lease %s lost: %d requests handed off", holder, len(entries))

    async def recover(self) -> int:
        """Resume every unfinished request of the log; retried with backoff while Postgres or NATS cannot
        be read (new requests are served meanwhile). Returns the number resumed."""
        assert self.db is not None
        delay = RECOVERY_BACKOFF_S[0]
        while True:
            try:
                histories = await read_log(self.bus, self.db)
                break
            except Exception as e:  # Postgres or NATS down: the log is still there; wait for it
                log.warning(
                    "recovery cannot read the log (%s: %s); retrying in %.1f s", type(e).__name__, e, delay
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, RECOVERY_BACKOFF_S[1])
        resumed = 0
        for request_id, history in histories.items():
            if request_id in self.active:
                continue
            found = plan(request_id, history)
            if found is None:
                continue
            try:  # owned by another coordinator (live, or taken over by a sweep): not resumed here
                if await self.ownership.claim(request_id) is not None:
                    continue
            except Exception as e:
                log.warning("recovery: lease of %s not claimed (%s); a sweep takes it", request_id, e)
                continue
            await self._resume(found)
            resumed += isinstance(found, Unfinished)
        log.info("recovery: %d unfinished requests resumed", resumed)
        self.recovered.set()
        self.unclaimed.clear()
        return resumed

    async def _fail_unresumable(self, found: Unresumable) -> None:
        log.warning("request %s cannot be resumed: %s", found.request_id, found.reason)
        await self.bus.emit(found.request_id, RequestFailed(phase=Phase.RECOVERY, reason=found.reason))
        await self.bus.publish(
            self.bus.subjects.tokens(found.request_id),
            TokenChunk(request_id=found.request_id, index=0, error=f"recovery: {found.reason}"),
        )

    async def stop(self) -> None:
        """Stop without ending any request: the in-flight ones are handed off, their leases given up, so
        another coordinator takes them over at its next sweep and resumes them from the log (a stop is a
        restart, as far as the requests can tell)."""
        if self._sweeper is not None:
            self._sweeper.cancel()
        for lifecycle, task in list(self.active.values()):
            lifecycle.hand_off()
            task.cancel()
        await asyncio.gather(*(t for _, t in self.active.values()), return_exceptions=True)
        await self.ownership.give_up()
        await self.liveness.stop()
        if self.placer is not None:
            await self.placer.stop()

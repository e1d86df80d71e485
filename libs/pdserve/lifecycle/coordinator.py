"""The coordinator's state: the lifecycles in flight, the commands that touch them, and recovery.

Nothing here outlives the process that the log does not hold: at start (`recover`) the coordinator folds
the events of every unfinished request (lifecycle/recovery.py) and resumes each; until that is done,
`DecodeFinished` reports for requests it does not know yet are kept for them.
"""

from __future__ import annotations

import asyncio
import logging
import time

from sqlalchemy.ext.asyncio import AsyncEngine

from pdserve.bus import Bus, RejectedError
from pdserve.config import CoordinatorSettings
from pdserve.events import RequestFailed, RequestRecovered
from pdserve.lifecycle.liveness import WorkerLiveness
from pdserve.lifecycle.recovery import Unfinished, Unresumable, plan, read_log
from pdserve.lifecycle.request import RequestLifecycle, ResumePoint
from pdserve.messages import Abort, Accepted, Ack, DecodeFinished, RejectCode, Submit, TokenChunk
from pdserve.states import Phase, RecoveryAction
from pdserve.telemetry import metrics

log = logging.getLogger(__name__)

UNCLAIMED_TTL_S = 120.0  # a DecodeFinished no lifecycle claimed within this long is dropped
RECOVERY_BACKOFF_S = (0.5, 5.0)


class Coordinator:
    """Lifecycle: `Coordinator(bus, settings, db)` → `await serve()` (handlers, liveness, recovery in
    the background) → `await stop()`. `db` (the event store) may be None: then nothing is recovered."""

    def __init__(self, bus: Bus, settings: CoordinatorSettings, db: AsyncEngine | None = None) -> None:
        self.bus = bus
        self.settings = settings
        self.db = db
        self.liveness = WorkerLiveness(bus, settings.worker_timeout_s)
        self.active: dict[str, tuple[RequestLifecycle, asyncio.Task]] = {}
        self.unclaimed: dict[str, tuple[float, DecodeFinished]] = {}
        self.recovered = asyncio.Event()  # set once recovery has resumed every unfinished request

    def _start(self, submit: Submit, resume: ResumePoint | None = None) -> None:
        lifecycle = RequestLifecycle(self.bus, self.settings, submit, self.liveness, resume)
        task = self.bus.spawn(lifecycle.run())
        self.active[submit.request_id] = (lifecycle, task)
        task.add_done_callback(lambda _: self.active.pop(submit.request_id, None))
        if (held := self.unclaimed.pop(submit.request_id, None)) is not None:
            lifecycle.on_finished(held[1])

    @property
    def num_waiting(self) -> int:
        """The admission queue: accepted requests that have not yet held a decode reservation (routing,
        reserving, or told by their decode worker that it is full and waiting to retry). Safe from the
        metrics server's thread: `list()` copies the values without running Python code."""
        return sum(1 for lifecycle, _ in list(self.active.values()) if lifecycle.awaiting_admission)

    async def submit(self, req: Submit) -> Accepted:
        """Start a request; a Submit of a request already in flight (the gateway retried, or recovery
        resumed it first) is accepted again without a second run. Raises RejectedError(CAPACITY) while
        `max_waiting_requests` requests await admission (the gateway answers 503 + Retry-After). Counting
        every accepted request not yet reserved — not only those already told decode is full — keeps the
        bound when a burst of Submits arrives before any of them has reached a decode worker."""
        if req.request_id not in self.active:
            if self.num_waiting >= self.settings.max_waiting_requests:
                raise RejectedError(RejectCode.CAPACITY, f"{self.num_waiting} requests already await "
                                    f"admission to decode (max_waiting_requests)")
            self._start(req)
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
        elif not self.recovered.is_set():
            now = time.monotonic()
            self.unclaimed = {k: v for k, v in self.unclaimed.items() if now - v[0] < UNCLAIMED_TTL_S}
            self.unclaimed[msg.request_id] = (now, msg)
        return Ack()

    async def serve(self) -> None:
        metrics.ADMISSION_QUEUE_LENGTH.set_function(lambda: self.num_waiting)  # read at each scrape
        await self.liveness.start()
        s = self.bus.subjects
        await self.bus.serve(s.finished(), DecodeFinished, self.finished)
        await self.bus.serve(s.abort, Abort, self.abort)
        await self.bus.serve(s.submit, Submit, self.submit, queue="coordinator")
        if self.settings.recover_on_start and self.db is not None:
            self.bus.spawn(self.recover())
        else:
            self.recovered.set()

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
            if isinstance(found, Unresumable):
                await self._fail_unresumable(found)
            elif isinstance(found, Unfinished):
                action = (RecoveryAction.WATCH_DECODE if found.resume.decode_worker_id
                          else RecoveryAction.RE_PREFILL)
                await self.bus.emit(
                    request_id,
                    RequestRecovered(
                        state=found.resume.state,
                        num_committed_tokens=len(found.resume.committed),
                        action=action,
                    ),
                )
                self._start(found.submit, found.resume)
                resumed += 1
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
        """Stop without ending any request: the in-flight ones are handed off to the next coordinator,
        which resumes them from the log (a stop is a restart, as far as the requests can tell)."""
        for lifecycle, task in list(self.active.values()):
            lifecycle.hand_off()
            task.cancel()
        await asyncio.gather(*(t for _, t in self.active.values()), return_exceptions=True)
        await self.liveness.stop()

"""One request's lifecycle across the pools, owned by the coordinator (docs/architecture.md §3).

route → reserve decode KV (waiting, bounded, while decode is full) → prefill with the transfer plan →
start decode (which waits for the KV to arrive verified) → wait for the decode to finish. Every phase
has a deadline, so every request ends: `RequestCompleted`, `RequestFailed` {phase, reason} or
`RequestAborted`. Whatever the outcome, everything the request holds on every worker is released.
A transfer that fails verification is retried with a fresh reservation and prefill, up to
`max_prefill_attempts`; unverified KV is never admitted.

Migration: while a worker the request depends on is silent past `worker_timeout_s` (or does not answer
a command), the attempt is abandoned (`WorkerLost`), and — at most `max_migrations` times — the request
runs again on a healthy pair, re-prefilled with prompt + the output tokens the journal
(`TokensCommitted`) holds, streaming on from that index. Tokens streamed but not yet committed when the
decode died are generated again with the same indices; the gateway keeps the first token of each index
(`ChunkReassembler`), so with greedy sampling (deterministic) the client's stream has no token missing or
repeated. With temperature > 0 the regenerated tail may differ from what was streamed; the client keeps
what it saw, the journal keeps its first commit of each index.

Recovery: a lifecycle built with a `ResumePoint` (folded from the log by `lifecycle.recovery`) starts
from it: a request decoding on a worker that is still alive is watched to its end; any other unfinished
request runs again from route with prompt + committed tokens.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from opentelemetry import trace

from pdserve.bus import Bus, BusTimeout, RejectedError
from pdserve.config import CoordinatorSettings
from pdserve.events import RequestAborted, RequestFailed, RequestMigrated
from pdserve.lifecycle.completion import emit_completed
from pdserve.lifecycle.context import LeaseLost, PhaseFailed, RequestContext, WorkerLost
from pdserve.lifecycle.journal import read_committed
from pdserve.lifecycle.liveness import WorkerLiveness
from pdserve.lifecycle.placement import ask_route, place, route
from pdserve.messages import DecodeAdmitted, DecodeFinished, FinishReason, RouteDecision, Submit, TokenChunk
from pdserve.routing.live import LivePlacer
from pdserve.states import Phase, RequestState

log = logging.getLogger(__name__)
tracer = trace.get_tracer("pdserve.coordinator")

__all__ = ["LeaseLost", "PhaseFailed", "RequestLifecycle", "ResumePoint", "WorkerLost"]


@dataclass(frozen=True)
class ResumePoint:
    """Where a recovered request picks up: its projection `state`, the decode worker it was running on
    (None unless `state` is decoding), workers that may hold something of it, the output tokens
    committed so far and the migrations already made."""

    state: RequestState
    decode_worker_id: str | None
    holders: frozenset[str]
    committed: tuple[int, ...]
    migrations: int = 0


@dataclass
class Attempt:
    """The placement a run of the request is using now (one per migration)."""

    decision: RouteDecision
    admitted: DecodeAdmitted | None = None
    timings: dict[str, float] = field(default_factory=dict)  # UNIX seconds at each phase start


class RequestLifecycle:
    """One request, from accepted to ended, on the coordinator: `run()` once, as a task; `on_finished`,
    `finish_early` and `hand_off` from the coordinator's handlers. The steps of a placement are
    lifecycle/placement.py's, on this lifecycle's `RequestContext` (`ctx`)."""

    def __init__(
        self,
        bus: Bus,
        settings: CoordinatorSettings,
        submit: Submit,
        liveness: WorkerLiveness,
        resume: ResumePoint | None = None,
        owned: Callable[[], bool] = lambda: True,
        placer: LivePlacer | None = None,
    ) -> None:
        """`owned`: whether this coordinator still holds the request's lease (checked before every command
        to a worker; lifecycle/ownership.py). `placer`: the coordinator's own (None: the router places)."""
        self.ctx = ctx = RequestContext(bus, settings, submit, liveness, owned, placer)
        self.bus, self.settings, self.submit, self.liveness = bus, settings, submit, liveness
        self.request_id = submit.request_id
        self.resume = resume
        self.committed: list[int] = list(resume.committed) if resume else []
        self.migrations = resume.migrations if resume else 0
        self.first: Attempt | None = None  # the first attempt of this coordinator's run (TTFT)
        self.attempt: Attempt | None = None
        self.decode_worker: str | None = resume.decode_worker_id if resume else None  # a kept report counts
        self.finished: asyncio.Future[DecodeFinished] = asyncio.get_running_loop().create_future()
        self.handed_off = False
        # started here, not in run(): a route asked ahead of the run (`route_ahead`) is one of its steps
        self.span = tracer.start_span("coordinator.request",
                                      attributes={"pdserve.request_id": self.request_id})
        self._route_ahead: asyncio.Task[tuple[RouteDecision, float]] | None = None
        self._route_ahead_ts = 0.0
        self._last_attempt: trace.SpanContext | None = None
        if resume:
            ctx.holders |= set(resume.holders)
            ctx.awaiting_admission = False  # admitted by the coordinator that accepted it

    @property
    def phase(self) -> Phase:
        return self.ctx.phase

    @property
    def awaiting_admission(self) -> bool:
        """Accepted, never yet reserved decode KV: counted against `max_waiting_requests`."""
        return self.ctx.awaiting_admission

    def route_ahead(self) -> None:
        """Place the request now, before `run()`: the coordinator calls it while its claim of the request's
        lease is in flight, so the placement (in-process, or the router's round trip) overlaps the claim's
        instead of following it. Nothing is recorded or commanded until the run, which emits `RequestRouted`
        with this answer; a request whose claim fails is `drop`ped. The placer booked load for the answer
        (routing/active_load.py): the owner's route replaces that booking, or, for a retried Submit the
        owner routed already, it stands in for the owner's until the request's end or its age releases it
        (one booking per request either way)."""
        assert self.resume is None and not self.committed, "a resumed request routes prompt + committed"
        self._route_ahead_ts = time.time()
        with trace.use_span(self.span):
            self._route_ahead = self.bus.spawn(ask_route(self.ctx, tuple(self.submit.prompt_token_ids)))

    def drop(self) -> None:
        """This coordinator did not come to own the request (its lease claim failed, or another holds it):
        the run never starts; the route asked ahead is cancelled."""
        if self._route_ahead is not None:
            self._route_ahead.cancel()
        self.span.set_attribute("pdserve.owned", False)
        self.span.end()

    async def run(self) -> None:
        try:
            with trace.use_span(self.span, end_on_exit=True):
                await self._run()
        except asyncio.CancelledError:
            if not self.handed_off:
                await self.bus.emit_stored(self.request_id,
                                           RequestAborted(reason=f"aborted during {self.phase}"))
            raise
        except LeaseLost:
            log.warning("request %s: lease lost in %s; left to the coordinator that takes it over",
                        self.request_id, self.phase)
            self.handed_off = True
        except (PhaseFailed, BusTimeout, RejectedError) as e:
            phase, reason = (e.phase, e.reason) if isinstance(e, PhaseFailed) else (self.phase, str(e))
            log.warning("request %s failed in %s: %s", self.request_id, phase, reason)
            await self.bus.emit_stored(self.request_id, RequestFailed(phase=phase, reason=reason))
            await self.bus.publish(
                self.bus.subjects.tokens(self.request_id),
                TokenChunk(request_id=self.request_id, index=0, error=f"{phase}: {reason}"),
            )
        finally:
            if self._route_ahead is not None:  # the run ended before it used it
                self._route_ahead.cancel()
            if not self.handed_off:
                await self.ctx.release_all()

    def hand_off(self) -> None:
        """The coordinator is stopping, not the request: cancelling the run then neither aborts nor
        releases anything; the next coordinator resumes the request from the log."""
        self.handed_off = True

    async def _run(self) -> None:
        done: DecodeFinished | None = None
        resume = self.resume
        if (
            resume is not None
            and resume.decode_worker_id
            and not self.liveness.is_dead(resume.decode_worker_id)
        ):
            self.decode_worker = resume.decode_worker_id
            try:
                with self._attempt_span():
                    done = await self._decode(stall_s=self.settings.recovery_stall_s)
            except WorkerLost as e:
                await self._migrate(e)
        elif resume is not None:
            # Whatever the previous coordinator's attempt left on workers is freed; the run starts over
            # from the journal as it stands once they stopped (a decode may have committed more meanwhile).
            await self.ctx.release_all()
            self.ctx.holders.clear()
            await self._reread_journal()
        while done is None:
            try:
                with self._attempt_span():
                    done = await self._run_once()
            except WorkerLost as e:
                await self._migrate(e)
        first = self.first
        await emit_completed(
            self.bus, self.submit, done, first.admitted if first else None, first.timings if first else {}
        )

    @contextmanager
    def _attempt_span(self) -> Iterator[trace.Span]:
        """`coordinator.attempt`: one placement of the request (the first, then one per migration), linked
        to the attempt it retries, so a migrated request's trace shows which attempt replaced which."""
        links = [trace.Link(self._last_attempt, {"pdserve.link": "retry_of"})] if self._last_attempt else []
        with tracer.start_as_current_span("coordinator.attempt", links=links, attributes={
            "pdserve.request_id": self.request_id, "pdserve.attempt": self.migrations,
        }) as span:
            self._last_attempt = span.get_span_context()
            yield span

    async def _run_once(self) -> DecodeFinished:
        """One placement: route → reserve → prefill → start → decode, from the committed tokens on."""
        start_index = len(self.committed)
        if start_index >= self.submit.sampling.max_tokens:
            return await self._already_done(start_index)
        prompt = (*self.submit.prompt_token_ids, *self.committed)
        asked, self._route_ahead = self._route_ahead, None
        timings = {"route": self._route_ahead_ts if asked else time.time()}
        decision = await route(self.ctx, prompt, asked)
        attempt = self.attempt = Attempt(decision, timings=timings)
        self.decode_worker = decision.decode_worker_id
        if self.first is None:
            self.first = attempt
        attempt.admitted = await place(self.ctx, attempt.decision, prompt, start_index, timings)
        return await self._decode()

    async def _decode(self, stall_s: float | None = None) -> DecodeFinished:
        """Wait for the decode worker's `DecodeFinished`; `WorkerLost` when it dies first (or, with
        `stall_s`, when it streams nothing for that long)."""
        assert self.decode_worker is not None
        self.ctx.enter(Phase.DECODE, {self.decode_worker})
        with tracer.start_as_current_span("coordinator.decode"):
            wait = self._wait_finished() if stall_s is None else self._wait_finished_or_stall(stall_s)
            return await self.ctx.watch(wait)

    async def _wait_finished(self) -> DecodeFinished:
        try:
            return await asyncio.wait_for(asyncio.shield(self.finished), self.settings.decode_timeout_s)
        except TimeoutError as e:
            raise PhaseFailed(Phase.DECODE, f"no finish within {self.settings.decode_timeout_s} s") from e

    async def _wait_finished_or_stall(self, stall_s: float) -> DecodeFinished:
        last = [time.monotonic()]

        async def on_chunk(_: TokenChunk) -> None:
            last[0] = time.monotonic()

        sub = await self.bus.subscribe(self.bus.subjects.tokens(self.request_id), TokenChunk, on_chunk)
        deadline = time.monotonic() + self.settings.decode_timeout_s
        try:
            while time.monotonic() < deadline:
                try:
                    return await asyncio.wait_for(asyncio.shield(self.finished), 0.25)
                except TimeoutError:
                    if time.monotonic() - last[0] > stall_s:
                        raise WorkerLost(
                            self.decode_worker or "",
                            Phase.DECODE,
                            f"nothing streamed for {stall_s} s after recovery",
                        ) from None
            raise PhaseFailed(Phase.DECODE, f"no finish within {self.settings.decode_timeout_s} s")
        finally:
            await sub.unsubscribe()

    async def _already_done(self, num_tokens: int) -> DecodeFinished:
        """Every token was committed before the worker (or coordinator) died: the request is complete;
        the gateway is told the stream's end in case the finishing chunk was lost."""
        await self.bus.publish(
            self.bus.subjects.tokens(self.request_id),
            TokenChunk(request_id=self.request_id, index=num_tokens, finish_reason=FinishReason.LENGTH),
        )
        now = time.time()
        return DecodeFinished(
            request_id=self.request_id,
            worker_id=self.decode_worker or "",
            finish_reason=FinishReason.LENGTH,
            num_output_tokens=num_tokens,
            first_token_ts=now,
            last_token_ts=now,
        )

    async def _migrate(self, lost: WorkerLost) -> None:
        """Abandon the placement that lost a worker; raise `PhaseFailed` past the migration limit."""
        log.warning("request %s lost %s in %s: %s", self.request_id, lost.worker_id, lost.phase, lost.reason)
        self.migrations += 1
        if self.migrations > self.settings.max_migrations:
            raise PhaseFailed(
                lost.phase,
                f"worker {lost.worker_id} lost ({lost.reason}); "
                f"{self.settings.max_migrations} migrations allowed",
            )
        await self.ctx.release_all()  # a silent-but-alive worker stops; a dead one costs one no-responders
        self.ctx.holders.clear()
        await self._reread_journal()
        if not self.finished.done():
            self.finished.cancel()
        self.finished = asyncio.get_running_loop().create_future()
        await self.bus.emit(
            self.request_id,
            RequestMigrated(
                from_worker_id=lost.worker_id,
                phase=lost.phase,
                reason=lost.reason,
                num_committed_tokens=len(self.committed),
                attempt=self.migrations,
            ),
        )

    async def _reread_journal(self) -> None:
        """Take the committed tokens from the journal when it holds more than this lifecycle knows."""
        try:
            journal = await read_committed(self.bus, self.request_id)
        except Exception as e:  # NATS restarting: regenerate from what is known (more work, same tokens)
            log.warning(
                "journal of %s unreadable (%s); resuming from %d tokens",
                self.request_id,
                e,
                len(self.committed),
            )
            journal = []
        if len(journal) > len(self.committed):
            self.committed = journal

    def on_finished(self, msg: DecodeFinished) -> None:
        """A decode worker reports the end; only the current placement's worker counts (an abandoned one
        may still report)."""
        if msg.worker_id == self.decode_worker and not self.finished.done():
            self.finished.set_result(msg)

    async def finish_early(self, finish_reason: FinishReason, reason: str) -> bool:
        """The gateway ended a decoding request as finished (a stop string): the decode worker commits
        its tokens and reports `DecodeFinished`, so the request completes. False if not decoding."""
        if self.phase is not Phase.DECODE or self.decode_worker is None:
            return False
        await self.ctx.release(self.decode_worker, reason, finish_reason)
        return True

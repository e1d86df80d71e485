"""A worker's engine loop: runs `LLMEngine.step` in a thread while there is work, then publishes what the
step produced — each decoding sequence's new token on `pds.tokens.<request_id>`, `TokensCommitted` every
`commit_every_tokens` and at the end, `DecodeFinished` to the coordinator — and resolves the prompt's first
token for whoever waits on a prefill. The running batch is the engine's continuous batch.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import NamedTuple, TypeVar

import torch
from opentelemetry import trace

from pdserve.bus import Bus, BusTimeout, RejectedError
from pdserve.engine.llm_engine import LLMEngine, StepOutput
from pdserve.engine.sequence import Sequence
from pdserve.engine.state_pool import SequenceState
from pdserve.events import TokensCommitted
from pdserve.messages import Ack, DecodeFinished, FinishReason, RejectCode, TokenChunk, TokenLogprobs

log = logging.getLogger(__name__)
tracer = trace.get_tracer("pdserve.worker")

_IDLE_RETRY_S = 0.005  # work queued but nothing schedulable (blocks held by reservations): poll gently
# How long a finished sequence's DecodeFinished is offered to the coordinator: beyond a coordinator's
# restart, whose start-up alone may wait JETSTREAM_READY_S (30 s, bus.py) for JetStream. It was 10 × 2.5 s,
# and a CI run's coordinator, killed mid-decode, came back after it: the request never ended in the log.
FINISHED_RETRY_S = 120.0
T = TypeVar("T")


class PrefillDone(NamedTuple):
    """A prompt's end on this worker: its first token, that token's logprobs (None unless asked) and, for
    a model with recurrent state, a copy of the whole state after the prompt (`StepOutput.state`)."""

    token_id: int
    logprobs: TokenLogprobs | None
    state: SequenceState | None = None


@dataclass
class DecodeStream:
    """The client-facing side of a decoding sequence: tokens streamed and committed so far."""

    seq: Sequence
    span: trace.Span
    num_streamed: int = 0
    num_committed: int = 0
    first_token_ts: float = 0.0
    commits: list[asyncio.Task] = field(default_factory=list)  # TokensCommitted publishes, until stored


class EngineLoop:
    """The loop of one worker's engine. `compute` is the worker's engine lock (every engine call, here and
    in the command handlers, holds it, except the step's forward); `after_step` runs after every step,
    outside the lock (the worker flushes its KV cache events); `commit_every_tokens` is how many streamed
    tokens a `TokensCommitted` may lag behind; `torch_threads` the step thread's torch threads."""

    def __init__(self, engine: LLMEngine, compute: asyncio.Lock, bus: Bus, worker_id: str, *,
                 commit_every_tokens: int, after_step: Callable[[], Awaitable[None]],
                 torch_threads: int = 1) -> None:
        self.engine = engine
        self.compute = compute
        self.bus = bus
        self.worker_id = worker_id
        self.commit_every_tokens = commit_every_tokens
        self.after_step = after_step
        self.streams: dict[str, DecodeStream] = {}
        self.prefills: dict[str, asyncio.Future[PrefillDone]] = {}
        self._wakeup = asyncio.Event()
        # Every step runs on this one thread, the only one of the worker with an OpenMP team of more than
        # one thread (engine/threads.py: a second team slows the first).
        self._step_thread = ThreadPoolExecutor(1, f"{worker_id}-step", initializer=torch.set_num_threads,
                                               initargs=(torch_threads,))

    @property
    def num_running(self) -> int:
        return len(self.engine.scheduler.running)

    def wake(self) -> None:
        self._wakeup.set()

    def expect_prefill(self, request_id: str) -> asyncio.Future[PrefillDone]:
        """A future resolved with `PrefillDone` (first token, its logprobs, the state) when `request_id`'s
        `stop_after_prefill` sequence finishes its prompt, or failed with RejectedError when it is released
        first."""
        fut: asyncio.Future[PrefillDone] = asyncio.get_running_loop().create_future()
        self.prefills[request_id] = fut
        return fut

    def fail_prefill(self, request_id: str, reason: str) -> None:
        fut = self.prefills.pop(request_id, None)
        if fut is not None and not fut.done():
            fut.set_exception(
                RejectedError(RejectCode.NOT_FOUND, f"{request_id} released during prefill: {reason}")
            )

    async def run(self) -> None:
        """Forever: one engine step, then its outputs. The step's schedule and its sampling run on the step
        thread under the worker's compute lock, its forward on the same thread without it
        (`LLMEngine.run_step`)."""
        while True:
            if not self.engine.has_work:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            async with self.compute:
                plan = await self.on_step_thread(self.engine.begin_step)
            outputs = []
            if plan is not None:
                # The forward runs without the lock: a reserve, a new prefill or an admission that comes
                # meanwhile is taken now, and joins the next step, instead of waiting for this one to end.
                logits = await self.on_step_thread(self.engine.run_step, plan)
                async with self.compute:
                    outputs = await self.on_step_thread(self.engine.finish_step, plan, logits)
            await self.after_step()
            for out in outputs:
                await self._dispatch(out)
            if plan is None:
                await asyncio.sleep(_IDLE_RETRY_S)

    def on_step_thread(self, fn: Callable[..., T], *args: object) -> asyncio.Future[T]:
        """`fn(*args)` on the step thread, the one every engine step runs on (after the step in flight), in
        a copy of the caller's context (trace context included), as `asyncio.to_thread` runs it."""
        call = functools.partial(contextvars.copy_context().run, fn, *args)
        return asyncio.get_running_loop().run_in_executor(self._step_thread, call)

    def close(self) -> None:
        """Let the step thread go once the step in flight (if any) ends."""
        self._step_thread.shutdown(wait=False, cancel_futures=True)

    async def admit(
        self, seq: Sequence, first_token_id: int, first_logprobs: TokenLogprobs | None = None
    ) -> float:
        """Start decoding `seq` (prompt KV complete): stream the prompt's first token (with its logprobs,
        when given) and join the batch. Returns the first token's UNIX timestamp."""
        stream = DecodeStream(
            seq, tracer.start_span("decode.generate", attributes={"pdserve.request_id": seq.request_id})
        )
        self.streams[seq.request_id] = stream
        async with self.compute:
            reason = self.engine.admit(seq, first_token_id)
        stream.first_token_ts = time.time()
        await self._emit(
            stream, () if reason is FinishReason.STOP else (first_token_id,), reason, first_logprobs
        )
        self.wake()
        return stream.first_token_ts

    async def finish_now(self, request_id: str, reason: FinishReason) -> None:
        """End a decoding sequence as finished (e.g. the gateway matched a stop string)."""
        stream = self.streams.get(request_id)
        if stream is not None:
            async with self.compute:
                self.engine.free(stream.seq)
            self._finish(stream, reason)

    def stop(self, request_id: str) -> None:
        """Forget a stream without telling anyone (abort / release); the caller frees the blocks."""
        stream = self.streams.pop(request_id, None)
        if stream is not None:
            stream.span.set_attribute("pdserve.finish_reason", FinishReason.ABORT.value)
            stream.span.end()

    async def _dispatch(self, out: StepOutput) -> None:
        rid = out.seq.request_id
        if out.prefill_done:
            fut = self.prefills.pop(rid, None)
            if fut is not None and not fut.done():
                fut.set_result(PrefillDone(out.sampled_token_id, out.logprobs, out.state))
            return
        stream = self.streams.get(rid)
        if stream is not None:
            await self._emit(stream, out.new_token_ids, out.finish_reason, out.logprobs)

    async def _emit(
        self,
        stream: DecodeStream,
        token_ids: tuple[int, ...],
        reason: FinishReason | None,
        logprobs: TokenLogprobs | None = None,
    ) -> None:
        seq, bus = stream.seq, self.bus
        await bus.publish(
            bus.subjects.tokens(seq.request_id),
            TokenChunk(
                request_id=seq.request_id,
                index=seq.output_start_index + stream.num_streamed,
                token_ids=token_ids,
                finish_reason=reason,
                # a stop token is not streamed, so neither are its logprobs
                logprobs=(logprobs,) if logprobs is not None and token_ids else None,
            ),
        )
        stream.num_streamed += len(token_ids)
        if reason is not None:
            self._finish(stream, reason)
        elif stream.num_streamed - stream.num_committed >= self.commit_every_tokens:
            if (commit := self._commit(stream)) is not None:
                stream.commits = [t for t in stream.commits if not t.done()]
                stream.commits.append(self.bus.spawn(
                    self.bus.emit_stored(stream.seq.request_id, commit, self.worker_id)))

    def _commit(self, stream: DecodeStream) -> TokensCommitted | None:
        """The tokens streamed since the last commit, as the next `TokensCommitted` (None if none)."""
        seq = stream.seq
        new = seq.output_token_ids[stream.num_committed : stream.num_streamed]
        if not new:
            return None
        commit = TokensCommitted(start_index=seq.output_start_index + stream.num_committed, token_ids=new)
        stream.num_committed = stream.num_streamed
        return commit

    def _finish(self, stream: DecodeStream, reason: FinishReason) -> None:
        """Off the loop's path: every `TokensCommitted` stored, then `DecodeFinished` to the coordinator,
        so the request's terminal event (which the coordinator emits on it) follows every commit in the
        stream even when a publish is retried across a NATS failover: the journal is whole once the log
        says the request ended."""
        seq = stream.seq
        self.streams.pop(seq.request_id, None)
        stream.span.set_attribute("pdserve.finish_reason", reason.value)
        stream.span.set_attribute("gen_ai.usage.output_tokens", stream.num_streamed)
        stream.span.end()
        msg = DecodeFinished(
            request_id=seq.request_id,
            worker_id=self.worker_id,
            finish_reason=reason,
            num_output_tokens=seq.output_start_index + stream.num_streamed,
            first_token_ts=stream.first_token_ts or time.time(),
            last_token_ts=time.time(),
        )
        self.bus.spawn(self._tell_coordinator(msg, stream.commits, self._commit(stream)))

    async def _tell_coordinator(self, msg: DecodeFinished, commits: list[asyncio.Task],
                                last_commit: TokensCommitted | None,
                                retry_s: float = FINISHED_RETRY_S) -> None:
        """Every commit stored, then `msg` to the coordinator until one acknowledges it, backing off from
        0.5 s to 5 s, for `retry_s` at most: the request's terminal event is the coordinator's to emit, so
        a coordinator restarting meanwhile must still hear of it."""
        bus = self.bus
        await asyncio.gather(*commits)
        if last_commit is not None:
            await bus.emit_stored(msg.request_id, last_commit, self.worker_id)
        deadline = time.monotonic() + retry_s
        backoff, attempt = 0.5, 0
        while True:
            attempt += 1
            try:
                await bus.request(bus.subjects.finished(msg.worker_id), msg, Ack, timeout_s=2.0)
                return
            except (BusTimeout, RejectedError) as e:
                if time.monotonic() + backoff >= deadline:
                    log.error("DecodeFinished for %s never acknowledged in %d attempts over %.0f s: %s",
                              msg.request_id, attempt, retry_s, e)
                    return
                log.warning("DecodeFinished for %s not acknowledged (%s), attempt %d", msg.request_id, e,
                            attempt)
                await asyncio.sleep(backoff)
                backoff = min(5.0, backoff * 2)

"""The decode loop: every running sequence advances one token per round; tokens stream to the gateway.

A sequence ends on EOS or a stop token (unless `ignore_eos`), at `max_tokens`, or when its reserved KV
is full; then its KV is freed, its last `TokensCommitted` event is written and the coordinator is told
(`DecodeFinished`). `stop(request_id)` removes a sequence at once (abort / release).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from opentelemetry import trace

from pdserve.bus import BusTimeout, RejectedError
from pdserve.engine.sampler import Sampler
from pdserve.events import TokensCommitted
from pdserve.messages import Ack, DecodeFinished, FinishReason, SamplingParams, TokenChunk
from pdserve.workers.slots import Slot

if TYPE_CHECKING:
    from pdserve.workers.worker import Worker

log = logging.getLogger(__name__)
tracer = trace.get_tracer("pdserve.worker")


@dataclass
class RunningSequence:
    request_id: str
    slot: Slot
    sampler: Sampler
    sampling: SamplingParams
    prompt_len: int
    output_start_index: int = 0  # output tokens the client already has (a migrated request)
    output_ids: list[int] = field(default_factory=list)
    num_committed: int = 0
    first_token_ts: float = 0.0
    span: trace.Span | None = None


class DecodeLoop:
    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.running: dict[str, RunningSequence] = {}
        self._wakeup = asyncio.Event()
        self._stop_ids = set(worker.loaded.tokenizer.stop_token_ids)

    @property
    def num_running(self) -> int:
        return len(self.running)

    async def admit(self, seq: RunningSequence, first_token_id: int) -> float:
        """Add a sequence whose prompt KV is in place, emit its first token (from prefill); returns
        the first token's UNIX timestamp."""
        seq.span = tracer.start_span("decode.generate", attributes={"pdserve.request_id": seq.request_id})
        reason = await self._append(seq, first_token_id)
        seq.first_token_ts = time.time()
        if reason is None:
            self.running[seq.request_id] = seq
            self._wakeup.set()
        return seq.first_token_ts

    async def finish_now(self, request_id: str, reason: FinishReason) -> None:
        """End a running sequence as finished (e.g. the gateway matched a stop string)."""
        seq = self.running.get(request_id)
        if seq is not None:
            await self._commit(seq)
            self._finish(seq, reason)

    def stop(self, request_id: str) -> None:
        seq = self.running.pop(request_id, None)
        if seq is not None and seq.span is not None:
            seq.span.set_attribute("pdserve.finish_reason", FinishReason.ABORT.value)
            seq.span.end()

    async def run(self) -> None:
        """Forever: one decode round over all running sequences, then publish their tokens."""
        while True:
            if not self.running:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            batch = list(self.running.values())
            async with self.worker.compute:
                tokens = await asyncio.to_thread(self._step, batch)
            for seq, token in zip(batch, tokens, strict=True):
                if seq.request_id in self.running:  # not released while we computed
                    await self._append(seq, token)

    def _step(self, batch: list[RunningSequence]) -> list[int]:
        model = self.worker.model
        out = []
        for seq in batch:
            logits = model.forward(torch.tensor([seq.output_ids[-1]], dtype=torch.int64), seq.slot.cache)
            out.append(seq.sampler.sample(logits))
        return out

    def _finish_reason(self, seq: RunningSequence, token: int) -> FinishReason | None:
        if not seq.sampling.ignore_eos and (token in self._stop_ids or token in seq.sampling.stop_token_ids):
            return FinishReason.STOP
        if seq.output_start_index + len(seq.output_ids) >= seq.sampling.max_tokens:
            return FinishReason.LENGTH
        if seq.prompt_len + len(seq.output_ids) >= seq.slot.num_tokens:
            return FinishReason.LENGTH
        return None

    async def _append(self, seq: RunningSequence, token: int) -> FinishReason | None:
        """Append one sampled token, stream it, and finish the sequence if it ended."""
        index = len(seq.output_ids)
        seq.output_ids.append(token)
        stream_index = seq.output_start_index + index
        reason = self._finish_reason(seq, token)
        if reason is FinishReason.STOP:
            seq.output_ids.pop()  # a stop token ends the text; it is not part of it (as in vLLM)
        emitted = tuple(seq.output_ids[index:])
        bus = self.worker.bus
        await bus.publish(bus.subjects.tokens(seq.request_id),
                          TokenChunk(request_id=seq.request_id, index=stream_index, token_ids=emitted,
                                     finish_reason=reason))
        if reason is not None or len(seq.output_ids) - seq.num_committed >= self.worker.settings.commit_every_tokens:
            await self._commit(seq)
        if reason is not None:
            self._finish(seq, reason)
        return reason

    async def _commit(self, seq: RunningSequence) -> None:
        new = seq.output_ids[seq.num_committed:]
        if new:
            await self.worker.bus.emit(seq.request_id, TokensCommitted(
                start_index=seq.output_start_index + seq.num_committed, token_ids=new), self.worker.worker_id)
            seq.num_committed = len(seq.output_ids)

    def _finish(self, seq: RunningSequence, reason: FinishReason) -> None:
        self.running.pop(seq.request_id, None)
        self.worker.slots.release(seq.request_id)
        if seq.span is not None:
            seq.span.set_attribute("pdserve.finish_reason", reason.value)
            seq.span.set_attribute("gen_ai.usage.output_tokens", len(seq.output_ids))
            seq.span.end()
        msg = DecodeFinished(request_id=seq.request_id, worker_id=self.worker.worker_id, finish_reason=reason,
                             num_output_tokens=seq.output_start_index + len(seq.output_ids), first_token_ts=seq.first_token_ts or time.time(),
                             last_token_ts=time.time())
        self.worker.bus.spawn(self._tell_coordinator(msg))

    async def _tell_coordinator(self, msg: DecodeFinished, attempts: int = 10) -> None:
        bus = self.worker.bus
        for attempt in range(attempts):
            try:
                await bus.request(bus.subjects.finished, msg, Ack, timeout_s=2.0)
                return
            except (BusTimeout, RejectedError) as e:
                log.warning("DecodeFinished for %s not acknowledged (%s), attempt %d", msg.request_id, e, attempt + 1)
                await asyncio.sleep(0.5)

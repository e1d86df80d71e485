"""The prefill command of a worker: run the prompt through the engine (chunked, batched with whatever
else runs), stream its first token to the client at once, and return it.

On a prefill worker the prompt's KV rows that the decode worker lacks are streamed to it as each layer is
computed (`kv_transfer_mode='layerwise'`) or all at once after the prefill (`'naive'`, the baseline);
`PrefillCompleted` is emitted when the compute is done, the reply comes once every send is delivered. A
decode or unified worker prefills locally into a reservation of its own (the router's `local` mode).

For a model with recurrent state (a hybrid), the whole state after the prompt follows the KV over the same
transport, every tensor checksummed (`state_transfer.send_state`), started as soon as the compute ends; the
reply comes once it is delivered too, with `state_s` its serial time (docs/architecture.md §6).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from opentelemetry import propagate, trace

from pdserve.bus import RejectedError
from pdserve.config import KVTransferMode
from pdserve.engine.llm_engine import CannotFit
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.events import DecodeReserved, PrefillCompleted, PrefillStarted
from pdserve.messages import (
    LocalReserve,
    PrefillOutcome,
    PrefillRequest,
    PrefillResult,
    RejectCode,
    Reservation,
    ReserveRequest,
    Role,
    TokenChunk,
    TokenLogprobs,
)
from pdserve.workers.core import WorkerCore
from pdserve.workers.kv_transfer import OutboundKV
from pdserve.workers.state_transfer import send_state, state_bytes

tracer = trace.get_tracer("pdserve.worker")
Hold = Callable[[ReserveRequest, bool], Awaitable[Reservation]]  # (request, expect_transfer) → Reservation


class PrefillCommands:
    """`hold`: the decode side's reservation (`DecodeCommands.hold`; None on a prefill worker), which a
    local placement's prefill command makes first when it carries `reserve`."""

    def __init__(self, core: WorkerCore, hold: Hold | None = None) -> None:
        self.core = core
        self.hold = hold

    async def prefill(self, req: PrefillRequest) -> PrefillResult:
        core = self.core
        local = req.decode_worker_id == core.worker_id
        if not local and (core.transport is None or core.role is not Role.PREFILL):
            raise RejectedError(
                RejectCode.INVALID, f"{core.worker_id} cannot prefill for {req.decode_worker_id}"
            )
        outbound: OutboundKV | None = None
        if local:
            if req.reserve is not None:
                await self._reserve_here(req, req.reserve)
            held = core.reserved.get(req.request_id)
            if held is None or held.seq.status is not SequenceStatus.RESERVED:
                raise RejectedError(
                    RejectCode.NOT_FOUND, f"no reservation awaiting prefill for {req.request_id}"
                )
            if held.kv is not None:  # prefilled here: no KV will arrive for this reservation
                held.kv.cancel()
                await held.kv.drained()
                held.kv = None
            seq = held.seq
            seq.token_ids = list(req.prompt_token_ids)  # the reserved ids may have been a placeholder
            seq.set_sampling(req.sampling)
            first = core.loop.expect_prefill(req.request_id)
            async with core.compute:
                core.engine.prefill_held(seq)
        else:
            seq = Sequence(req.request_id, req.prompt_token_ids, req.sampling, cache_salt=req.cache_salt)
            seq.stop_after_prefill = seq.free_after_prefill = True
            seq.num_sent_tokens = req.decode_num_cached_tokens
            outbound = OutboundKV(core.transport, req, core.model.cache_spec().num_paged_layers,
                                  naive=core.settings.kv_transfer_mode is KVTransferMode.NAIVE)
            seq.kv_sink = outbound.on_layer
            first = core.loop.expect_prefill(req.request_id)
            async with core.compute:
                try:
                    core.engine.add_request(seq)
                except CannotFit as e:
                    core.loop.fail_prefill(req.request_id, str(e))
                    raise RejectedError(RejectCode.INVALID, f"can never fit: {e}") from e
            core.prefilling[req.request_id] = seq
        core.loop.wake()
        num_prompt = len(req.prompt_token_ids)
        await core.bus.emit(
            req.request_id,
            PrefillStarted(
                prefill_worker_id=core.worker_id, transfer_id=req.transfer_id, num_prompt_tokens=num_prompt
            ),
            core.worker_id,
        )
        t0 = time.perf_counter()
        state_s = 0.0
        with tracer.start_as_current_span("prefill.forward") as span:
            span.set_attribute("pdserve.request_id", req.request_id)
            span.set_attribute("pdserve.num_prompt_tokens", num_prompt)
            span.set_attribute("pdserve.local", local)
            done = await first
            first_token, first_logprobs = done.token_id, done.logprobs
            # The compute is done: from here on, what the decode worker waits for is the transfer's tail
            # (benchmarks/exposed_transfer.py measures it from this event to TransferCompleted).
            prefill_s = time.perf_counter() - t0
            state_send: asyncio.Task[int] | None = None
            if outbound is not None and done.state is not None:  # the state exists only now: sent at once
                t_state = time.perf_counter()
                carrier: dict[str, str] = {}
                propagate.inject(carrier)
                state_send = asyncio.ensure_future(send_state(
                    core.transport, req.endpoint, req.transfer_id, done.state, carrier.get("traceparent")))
            first_token_ts = await self._stream_first_token(req, first_token, first_logprobs)
            cached = seq.num_cached_tokens
            # A hybrid resumes from its state checkpoint C <= the KV hit L: it computed prompt - C tokens.
            resumed = seq.num_checkpoint_tokens if core.engine.state_pool is not None else cached
            # What the event and the reply share; the event's kv_bytes are those sent so far.
            outcome = PrefillOutcome(
                transfer_id=req.transfer_id, first_token_id=first_token, num_cached_tokens=cached,
                cached_tokens_by_tier=dict(seq.cached_tokens_by_tier),
                num_computed_tokens=num_prompt - resumed, prefill_s=prefill_s,
                kv_bytes=outbound.kv_bytes if outbound is not None else 0, first_token_ts=first_token_ts,
                num_checkpoint_tokens=seq.num_checkpoint_tokens,
                state_bytes=state_bytes(done.state) if state_send is not None else 0,
            )
            completed = PrefillCompleted(prefill_worker_id=core.worker_id, **dict(outcome))
            await core.bus.emit(req.request_id, completed, core.worker_id)
            span.set_attribute("pdserve.num_cached_tokens", cached)
            if outbound is not None:  # (a local prefill's cache lookup was counted at its reservation)
                core.count_prefix_cache(num_prompt, seq.cached_tokens_by_tier)
                core.prefilling.pop(req.request_id, None)
                # The reply's kv_bytes (and state_bytes): once every send is delivered.
                kv_sent = outbound.complete(seq.num_chunks_sent)
                if state_send is None:
                    delivered = await kv_sent
                else:
                    delivered, sent_state = await asyncio.gather(kv_sent, state_send)
                    state_s = time.perf_counter() - t_state
                    outcome = outcome.model_copy(update={"state_bytes": sent_state})
                outcome = outcome.model_copy(update={"kv_bytes": delivered})
        return PrefillResult(request_id=req.request_id, first_token_logprobs=first_logprobs, state_s=state_s,
                             **dict(outcome))

    async def _reserve_here(self, req: PrefillRequest, terms: LocalReserve) -> None:
        """A local placement's reservation, in its prefill command: held as a reserve command holds it (no
        transfer expected), `DecodeReserved` emitted here. Raises what `DecodeCommands.hold` raises."""
        core = self.core
        if self.hold is None:
            raise RejectedError(RejectCode.INVALID, f"{core.worker_id} is a prefill worker")
        t0 = time.perf_counter()
        reservation = await self.hold(ReserveRequest(
            request_id=req.request_id, transfer_id=req.transfer_id,
            num_prompt_tokens=len(req.prompt_token_ids), max_tokens=terms.max_tokens, lease_s=terms.lease_s,
            prompt_token_ids=req.prompt_token_ids, cache_salt=req.cache_salt), False)
        await core.bus.emit(req.request_id, DecodeReserved(
            decode_worker_id=core.worker_id, transfer_id=req.transfer_id, num_tokens=reservation.num_tokens,
            reserve_s=time.perf_counter() - t0), core.worker_id)

    async def _stream_first_token(
        self, req: PrefillRequest, token: int, logprobs: TokenLogprobs | None
    ) -> float:
        """Publish the prompt's sampled token to the client now, so the first token waits for neither the
        KV transfer's tail nor the coordinator's start of decode; returns the UNIX seconds it left, 0.0 when
        it is not published (a retry, or a stop token: the decode worker ends the stream on it). The decode
        worker streams the same index again once it admits the sequence; the gateway keeps one of each
        index (`ChunkReassembler`)."""
        core = self.core
        if not req.stream_first_token or core.engine.is_stop_token(token, req.sampling):
            return 0.0
        await core.bus.publish(core.bus.subjects.tokens(req.request_id), TokenChunk(
            request_id=req.request_id, index=req.output_start_index, token_ids=(token,),
            logprobs=(logprobs,) if logprobs is not None else None), now=True)
        return time.time()

"""The decode side of a worker (decode and unified roles): `reserve` holds KV blocks for a request and
expects its transfer, `start` admits it into the continuous batch once that transfer is verified.

- reserve: hold KV blocks for the prompt + max_tokens, sharing what this worker's prefix cache already
  has (reported as `num_cached_tokens`), and expect the transfer of the rest.
- start: wait until the transfer is verified and in the reserved blocks (scattered chunk by chunk as it
  arrives, see `kv_transfer`), admit the sequence into the engine's continuous batch, stream tokens.

For a model with recurrent state (a hybrid) the transfer also carries the whole state after the prompt
(`state_transfer`): it is expected at reservation beside the KV, and installed only once every tensor of
it is verified; a bad checksum in it fails the transfer as one in the KV does (TRANSFER_FAILED: the
coordinator retries, then recomputes), so an unverified state is never admitted.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from opentelemetry import trace

from pdserve.bus import RejectedError
from pdserve.engine.llm_engine import CannotFit, NoFreeBlocks
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.engine.threads import one_thread
from pdserve.events import ChecksumMismatch, DecodeStarted, TransferCompleted
from pdserve.messages import (
    LOCAL_ENDPOINT,
    DecodeAdmitted,
    RejectCode,
    Reservation,
    ReserveRequest,
    Role,
    StartDecode,
)
from pdserve.telemetry import metrics
from pdserve.transfer.base import ChecksumMismatchError, KVTransport, TransferStats, TransferTimeout
from pdserve.workers.core import WorkerCore
from pdserve.workers.kv_transfer import InboundKV
from pdserve.workers.reserved_kv import ReservedKV
from pdserve.workers.state_transfer import StateInbound, is_state_transfer

tracer = trace.get_tracer("pdserve.worker")


class DecodeCommands:
    def __init__(self, core: WorkerCore) -> None:
        self.core = core
        # Received KV is scattered into the blocks here, one chunk at a time, off the event loop.
        self.scatter_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{core.worker_id}-scatter",
                                               initializer=one_thread)

    async def reserve(self, req: ReserveRequest) -> Reservation:
        """The reserve command: hold KV for `req`'s prompt + max_tokens and expect its transfer."""
        return await self.hold(req, expect_transfer=True)

    async def hold(self, req: ReserveRequest, expect_transfer: bool) -> Reservation:
        """Hold KV blocks for `req` (its prompt's prefix-cache hit shared) until started or released, and,
        with `expect_transfer` on a worker with a transport, expect the transfer of the rest. Raises
        RejectedError: INVALID (a prefill worker, a request that can never fit), CAPACITY (no free blocks
        now), DUPLICATE (superseded by a newer reserve, or a transfer id already seen)."""
        core = self.core
        if core.role is Role.PREFILL:
            raise RejectedError(RejectCode.INVALID, f"{core.worker_id} is a prefill worker")
        known = bool(req.prompt_token_ids)  # a caller that does not send them gets no prefix-cache hit
        if known and len(req.prompt_token_ids) != req.num_prompt_tokens:
            raise RejectedError(
                RejectCode.INVALID,
                f"{len(req.prompt_token_ids)} prompt token ids for num_prompt_tokens {req.num_prompt_tokens}",
            )
        # The coordinator's newest reserve for a request wins: it sends another only once it gave up on
        # the earlier one's reply (a timeout behind a long engine step, a migration back to this worker),
        # so whatever the request still holds here is released first.
        core.reserving[req.request_id] = req.transfer_id
        await core.release(req.request_id, "superseded by a newer reserve")
        prompt = req.prompt_token_ids or (0,) * req.num_prompt_tokens  # placeholder until `start` tells
        seq = Sequence(req.request_id, prompt, cache_salt=req.cache_salt)
        try:
            async with core.compute:
                try:
                    core.engine.reserve(seq, req.max_tokens, use_prefix_cache=known)
                except CannotFit as e:
                    raise RejectedError(RejectCode.INVALID, f"can never fit: {e}") from e
                except NoFreeBlocks as e:
                    raise RejectedError(RejectCode.CAPACITY, str(e)) from e
        finally:
            latest = core.reserving.get(req.request_id) == req.transfer_id
            if latest:
                del core.reserving[req.request_id]
        if not latest:  # a newer reserve came while this one waited for the engine
            await core.free(seq)
            raise RejectedError(RejectCode.DUPLICATE, f"reserve {req.transfer_id} superseded by a newer one")
        if known:
            core.count_prefix_cache(req.num_prompt_tokens, seq.cached_tokens_by_tier)
        held = ReservedKV(req.request_id, req.transfer_id, seq,
                          lease_deadline=time.monotonic() + req.lease_s)
        if core.transport is not None and expect_transfer:
            try:
                held.kv = self._expect(core.transport, req, seq)
            except ValueError as e:
                await core.free(seq)
                raise RejectedError(RejectCode.DUPLICATE, str(e)) from e
        core.reserved.add(held)
        endpoint = core.transport.endpoint() if core.transport and held.kv is not None else LOCAL_ENDPOINT
        return Reservation(
            request_id=req.request_id,
            transfer_id=req.transfer_id,
            worker_id=core.worker_id,
            endpoint=endpoint,
            num_tokens=req.num_prompt_tokens + req.max_tokens,
            num_cached_tokens=seq.num_cached_tokens,
        )

    def _expect(self, transport: KVTransport, req: ReserveRequest, seq: Sequence) -> InboundKV:
        """Expect `req`'s transfer into `seq`'s reserved blocks. Raises ValueError for a transfer id the
        transport has already seen."""
        core = self.core

        async def completed(stats: TransferStats, state: TransferStats | None) -> None:
            state_bytes = state.kv_bytes if state is not None else 0
            seconds = max(stats.seconds, state.seconds) if state is not None else stats.seconds
            metrics.KV_TRANSFER_BYTES.labels(worker_id=core.worker_id).inc(stats.kv_bytes + state_bytes)
            metrics.KV_TRANSFER_SECONDS.labels(worker_id=core.worker_id).observe(seconds)
            await core.bus.emit(
                req.request_id,
                TransferCompleted(
                    transfer_id=req.transfer_id,
                    transport=transport.kind,
                    kv_bytes=stats.kv_bytes,
                    num_layers=stats.num_layers,
                    transfer_s=seconds,
                    checksum_ok=True,
                    state_bytes=state_bytes,
                    kv_verified_ts=stats.verified_ts,
                    state_verified_ts=state.verified_ts if state is not None else 0.0,
                ),
                core.worker_id,
            )

        spec = core.model.cache_spec()
        state = None
        if spec.state is not None:  # raises ValueError, as the KV's expect does, for a seen transfer id
            state = StateInbound(transport, req.transfer_id, spec.state, core.model.dtype)
        try:
            return InboundKV(transport, req.transfer_id, seq, core.engine.runner.kv_cache,
                             core.settings.block_size, spec.paged_row_shape, core.settings.lease_s,
                             self.scatter_pool, completed, state)
        except ValueError:
            if state is not None:
                state.cancel()
            raise

    async def start(self, req: StartDecode) -> DecodeAdmitted:
        core = self.core
        held = core.reserved.get(req.request_id)
        if held is None or held.transfer_id != req.transfer_id:
            raise RejectedError(RejectCode.NOT_FOUND, f"no reservation for transfer {req.transfer_id}")
        seq = held.seq
        if len(req.prompt_token_ids) != seq.num_prompt_tokens:
            raise RejectedError(
                RejectCode.INVALID,
                f"start's prompt has {len(req.prompt_token_ids)} tokens, "
                f"the reservation {seq.num_prompt_tokens}",
            )
        if seq.status is SequenceStatus.RESERVED:
            seq.token_ids = list(req.prompt_token_ids)  # the reserved ids may have been a placeholder
        held.started = True
        kv_bytes, transfer_s, transfer_done_ts = 0, 0.0, time.time()
        if held.kv is not None:
            try:
                stats = await held.kv.ready()
            except ChecksumMismatchError as e:
                metrics.CHECKSUM_FAILURES.labels(worker_id=core.worker_id).inc()
                # a state tensor's mismatch names its transfer (`<id>.state.<name>`) and its layer (chunk)
                in_state = is_state_transfer(e.transfer_id)
                await core.bus.emit(
                    req.request_id,
                    ChecksumMismatch(
                        transfer_id=e.transfer_id if in_state else req.transfer_id,
                        layer=e.chunk if in_state else e.layer, expected=e.expected, actual=e.actual,
                    ),
                    core.worker_id,
                )
                await core.drop(req.request_id)
                where = f"state {e.transfer_id} layer {e.chunk}" if in_state else f"layer {e.layer}"
                raise RejectedError(RejectCode.TRANSFER_FAILED, f"checksum mismatch at {where}") from e
            except TransferTimeout as e:
                await core.drop(req.request_id)
                raise RejectedError(RejectCode.TRANSFER_FAILED, f"transfer timed out: {e}") from e
            kv_bytes, transfer_s, transfer_done_ts = stats.kv_bytes, stats.seconds, held.kv.ready_ts
            if held.kv.state_stats is not None:
                kv_bytes += held.kv.state_stats.kv_bytes
                transfer_s = max(transfer_s, held.kv.state_stats.seconds)
            async with core.compute:  # verified and scattered: now, and only now, the blocks count
                state = held.kv.state
                if state is not None:  # every tensor verified (`ready()`): the state may be installed
                    core.engine.install_state(seq, state)
                core.engine.mark_computed(seq, len(seq))
            await core.kv_events.flush()
        elif seq.status is not SequenceStatus.PARKED:
            raise RejectedError(RejectCode.NOT_FOUND, f"{req.request_id} was not prefilled here")
        seq.output_start_index = req.output_start_index
        if held.kv is not None:
            seq.set_sampling(req.sampling)
        with tracer.start_as_current_span("decode.admit") as span:
            span.set_attribute("pdserve.request_id", req.request_id)
            await core.bus.emit(
                req.request_id,
                DecodeStarted(decode_worker_id=core.worker_id, num_running=core.loop.num_running + 1),
                core.worker_id,
            )
            first_token_ts = await core.loop.admit(seq, req.first_token_id, req.first_token_logprobs)
        return DecodeAdmitted(
            request_id=req.request_id,
            worker_id=core.worker_id,
            transfer_bytes=kv_bytes,
            transfer_s=transfer_s,
            transfer_done_ts=transfer_done_ts,
            first_token_ts=first_token_ts,
        )

"""One engine worker in a role: prefill, decode, or unified (both, colocated).

Commands it serves (see `pdserve.messages`):
- reserve (decode/unified): hold KV blocks for the prompt, sharing what this worker's prefix cache already
  has (reported as `num_cached_tokens`), and expect the transfer of the rest.
- prefill (prefill, or decode/unified for a local prefill): run the prompt through the engine (chunked,
  batched with whatever else runs) and, from a prefill worker, stream each layer's KV rows that the decode
  worker lacks as soon as that layer is computed (`kv_transfer_mode='layerwise'`) or all of them once the
  prefill is done (`'naive'`, the baseline); `PrefillCompleted` when the compute is done, the first token
  returned once every send is delivered.
- start (decode/unified): wait until the transfer is verified and in the reserved blocks (scattered chunk
  by chunk as it arrives, see `kv_transfer`), admit the sequence into the engine's continuous batch,
  stream tokens.
- release (all): free everything the request holds here; idempotent.

The engine runs in a worker thread (one torch thread per worker), one step at a time under `compute`;
every engine call from a handler takes the same lock, so the event loop keeps serving NATS and moving KV
while a step runs and the engine is never used from two threads at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from opentelemetry import trace

from pdserve.bus import Bus, RejectedError
from pdserve.config import KVTransferMode, WorkerSettings
from pdserve.engine.llm_engine import CannotFit, EngineConfig, LLMEngine, NoFreeBlocks
from pdserve.engine.loader import LoadedModel
from pdserve.engine.model import LlamaModel
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.events import (
    ChecksumMismatch,
    DecodeStarted,
    PrefillCompleted,
    PrefillStarted,
    TransferCompleted,
)
from pdserve.messages import (
    Ack,
    CompatibilityDescriptor,
    DecodeAdmitted,
    Heartbeat,
    KVEndpoint,
    KVTransportKind,
    PrefillOutcome,
    PrefillRequest,
    PrefillResult,
    RejectCode,
    Release,
    Reservation,
    ReserveRequest,
    Role,
    StartDecode,
)
from pdserve.telemetry import metrics
from pdserve.transfer.base import ChecksumMismatchError, KVTransport, TransferStats, TransferTimeout
from pdserve.workers.engine_loop import EngineLoop
from pdserve.workers.kv_events import KVEventPublisher
from pdserve.workers.kv_transfer import InboundKV, OutboundKV
from pdserve.workers.reserved_kv import ReservedKV, ReservedKVTable

log = logging.getLogger(__name__)
tracer = trace.get_tracer("pdserve.worker")

LAYOUT_VERSION = (
    2  # per layer [num_blocks, block_size, 2, kv_heads, head_dim] fp32; transfers carry token rows
)


class Worker:
    def __init__(
        self, bus: Bus, settings: WorkerSettings, loaded: LoadedModel, transport: KVTransport | None
    ) -> None:
        self.bus = bus
        self.settings = settings
        self.worker_id = settings.worker_id
        self.role = settings.role
        self.loaded = loaded
        self.model = LlamaModel(loaded.config, loaded.weights)
        self.engine = LLMEngine(
            self.model,
            EngineConfig(
                num_blocks=max(settings.kv_capacity_tokens // settings.block_size, 1),
                block_size=settings.block_size,
                max_num_batched_tokens=settings.max_num_batched_tokens,
                max_num_seqs=settings.max_num_seqs,
                hash_seed=settings.kv_hash_seed,
            ),
            loaded.tokenizer.stop_token_ids,
        )
        self.transport = transport
        # Received KV is scattered into the blocks here, one chunk at a time, off the event loop.
        self.scatter_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{self.worker_id}-scatter")
        self.reserved = ReservedKVTable()
        self.prefilling: dict[str, Sequence] = {}  # prefill role: sequences computing for a decode worker
        self.compute = asyncio.Lock()  # one engine call at a time on this worker's core
        self.kv_events = KVEventPublisher(bus, self.worker_id, self.engine.block_manager)
        self.loop = EngineLoop(self.engine, self.compute, bus, self.worker_id,
                               commit_every_tokens=settings.commit_every_tokens,
                               after_step=self.kv_events.flush)
        cfg = loaded.config
        self.descriptor = CompatibilityDescriptor(
            model=loaded.name,
            weights_hash=loaded.weights_hash,
            dtype="float32",
            block_size=settings.block_size,
            num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            hash_seed=settings.kv_hash_seed,
            layout_version=LAYOUT_VERSION,
        )

    # ------------------------------------------------------------ reserve / release

    async def reserve(self, req: ReserveRequest) -> Reservation:
        if self.role is Role.PREFILL:
            raise RejectedError(RejectCode.INVALID, f"{self.worker_id} is a prefill worker")
        known = bool(req.prompt_token_ids)  # a caller that does not send them gets no prefix-cache hit
        if known and len(req.prompt_token_ids) != req.num_prompt_tokens:
            raise RejectedError(
                RejectCode.INVALID,
                f"{len(req.prompt_token_ids)} prompt token ids for num_prompt_tokens {req.num_prompt_tokens}",
            )
        if self.reserved.get(req.request_id) is not None:
            raise RejectedError(RejectCode.DUPLICATE, f"request {req.request_id} already reserved")
        prompt = req.prompt_token_ids or (0,) * req.num_prompt_tokens  # placeholder until `start` tells
        seq = Sequence(req.request_id, prompt, cache_salt=req.cache_salt)
        async with self.compute:
            try:
                self.engine.reserve(seq, req.max_tokens, use_prefix_cache=known)
            except CannotFit as e:
                raise RejectedError(RejectCode.INVALID, f"can never fit: {e}") from e
            except NoFreeBlocks as e:
                raise RejectedError(RejectCode.CAPACITY, str(e)) from e
        if known:
            self._count_prefix_cache(req.num_prompt_tokens, seq.num_cached_tokens)
        held = ReservedKV(req.request_id, req.transfer_id, seq,
                          lease_deadline=time.monotonic() + req.lease_s)
        if self.transport is not None:
            try:
                held.kv = self._expect(req, seq)
            except ValueError as e:
                await self._free(seq)
                raise RejectedError(RejectCode.DUPLICATE, str(e)) from e
        self.reserved.add(held)
        endpoint = (self.transport.endpoint() if self.transport
                    else KVEndpoint(transport=KVTransportKind.TCP, address="local"))
        return Reservation(
            request_id=req.request_id,
            transfer_id=req.transfer_id,
            worker_id=self.worker_id,
            endpoint=endpoint,
            num_tokens=req.num_prompt_tokens + req.max_tokens,
            num_cached_tokens=seq.num_cached_tokens,
        )

    def _expect(self, req: ReserveRequest, seq: Sequence) -> InboundKV:
        """Expect `req`'s transfer into `seq`'s reserved blocks. Raises ValueError for a transfer id the
        transport has already seen."""
        cfg = self.loaded.config

        async def completed(stats: TransferStats) -> None:
            metrics.KV_TRANSFER_BYTES.labels(worker_id=self.worker_id).inc(stats.kv_bytes)
            metrics.KV_TRANSFER_SECONDS.labels(worker_id=self.worker_id).observe(stats.seconds)
            await self.bus.emit(
                req.request_id,
                TransferCompleted(
                    transfer_id=req.transfer_id,
                    transport=self.transport.kind,
                    kv_bytes=stats.kv_bytes,
                    num_layers=stats.num_layers,
                    transfer_s=stats.seconds,
                    checksum_ok=True,
                ),
                self.worker_id,
            )

        return InboundKV(self.transport, req.transfer_id, seq, self.engine.runner.kv_cache,
                         self.settings.block_size, cfg.num_kv_heads, cfg.head_dim, self.settings.lease_s,
                         self.scatter_pool, completed)

    async def release(self, req: Release) -> Ack:
        if req.finish_reason is not None:
            await self.loop.finish_now(req.request_id, req.finish_reason)
        self.loop.stop(req.request_id)
        self.loop.fail_prefill(req.request_id, req.reason)
        held = self.reserved.pop(req.request_id)
        if held is not None:
            await self._free_reserved(held)
        elif (seq := self.prefilling.pop(req.request_id, None)) is not None:
            await self._free(seq)
        return Ack()

    async def _free_reserved(self, held: ReservedKV) -> None:
        """Free popped reserved KV once nothing writes into its blocks any more."""
        if held.kv is not None:
            await held.kv.drained()
        await self._free(held.seq)

    async def _free(self, seq: Sequence) -> None:
        async with self.compute:
            self.engine.free(seq)
        await self.kv_events.flush()

    # ------------------------------------------------------------ prefill

    async def prefill(self, req: PrefillRequest) -> PrefillResult:
        local = req.decode_worker_id == self.worker_id
        if not local and (self.transport is None or self.role is not Role.PREFILL):
            raise RejectedError(
                RejectCode.INVALID, f"{self.worker_id} cannot prefill for {req.decode_worker_id}"
            )
        outbound: OutboundKV | None = None
        if local:
            held = self.reserved.get(req.request_id)
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
            first = self.loop.expect_prefill(req.request_id)
            async with self.compute:
                self.engine.prefill_held(seq)
        else:
            seq = Sequence(req.request_id, req.prompt_token_ids, req.sampling, cache_salt=req.cache_salt)
            seq.stop_after_prefill = seq.free_after_prefill = True
            seq.num_sent_tokens = req.decode_num_cached_tokens
            outbound = OutboundKV(self.transport, req, self.loaded.config.num_layers,
                                  naive=self.settings.kv_transfer_mode is KVTransferMode.NAIVE)
            seq.kv_sink = outbound.on_layer
            first = self.loop.expect_prefill(req.request_id)
            async with self.compute:
                try:
                    self.engine.add_request(seq)
                except CannotFit as e:
                    self.loop.fail_prefill(req.request_id, str(e))
                    raise RejectedError(RejectCode.INVALID, f"can never fit: {e}") from e
            self.prefilling[req.request_id] = seq
        self.loop.wake()
        num_prompt = len(req.prompt_token_ids)
        await self.bus.emit(
            req.request_id,
            PrefillStarted(
                prefill_worker_id=self.worker_id, transfer_id=req.transfer_id, num_prompt_tokens=num_prompt
            ),
            self.worker_id,
        )
        t0 = time.perf_counter()
        with tracer.start_as_current_span("prefill.forward") as span:
            span.set_attribute("pdserve.request_id", req.request_id)
            span.set_attribute("pdserve.num_prompt_tokens", num_prompt)
            span.set_attribute("pdserve.local", local)
            first_token, first_logprobs = await first
            # The compute is done: from here on, what the decode worker waits for is the transfer's tail
            # (benchmarks/exposed_transfer.py measures it from this event to TransferCompleted).
            prefill_s = time.perf_counter() - t0
            cached = seq.num_cached_tokens
            # What the event and the reply share; the event's kv_bytes are those sent so far.
            outcome = PrefillOutcome(
                transfer_id=req.transfer_id, first_token_id=first_token, num_cached_tokens=cached,
                num_computed_tokens=num_prompt - cached, prefill_s=prefill_s,
                kv_bytes=outbound.kv_bytes if outbound is not None else 0,
            )
            completed = PrefillCompleted(prefill_worker_id=self.worker_id, **dict(outcome))
            await self.bus.emit(req.request_id, completed, self.worker_id)
            span.set_attribute("pdserve.num_cached_tokens", cached)
            if outbound is not None:  # (a local prefill's cache lookup was counted at its reservation)
                self._count_prefix_cache(num_prompt, cached)
                self.prefilling.pop(req.request_id, None)
                # The reply's kv_bytes: once every send is delivered.
                delivered = await outbound.complete(seq.num_chunks_sent)
                outcome = outcome.model_copy(update={"kv_bytes": delivered})
        return PrefillResult(request_id=req.request_id, first_token_logprobs=first_logprobs, **dict(outcome))

    # ------------------------------------------------------------ start decode

    async def start(self, req: StartDecode) -> DecodeAdmitted:
        held = self.reserved.get(req.request_id)
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
                metrics.CHECKSUM_FAILURES.labels(worker_id=self.worker_id).inc()
                await self.bus.emit(
                    req.request_id,
                    ChecksumMismatch(
                        transfer_id=req.transfer_id, layer=e.layer, expected=e.expected, actual=e.actual
                    ),
                    self.worker_id,
                )
                await self._drop(req.request_id)
                raise RejectedError(
                    RejectCode.TRANSFER_FAILED, f"checksum mismatch at layer {e.layer}"
                ) from e
            except TransferTimeout as e:
                await self._drop(req.request_id)
                raise RejectedError(RejectCode.TRANSFER_FAILED, f"transfer timed out: {e}") from e
            kv_bytes, transfer_s, transfer_done_ts = stats.kv_bytes, stats.seconds, held.kv.ready_ts
            async with self.compute:  # verified and scattered: now, and only now, the blocks count
                self.engine.mark_computed(seq, len(seq))
            await self.kv_events.flush()
        elif seq.status is not SequenceStatus.PARKED:
            raise RejectedError(RejectCode.NOT_FOUND, f"{req.request_id} was not prefilled here")
        seq.output_start_index = req.output_start_index
        if held.kv is not None:
            seq.set_sampling(req.sampling)
        with tracer.start_as_current_span("decode.admit") as span:
            span.set_attribute("pdserve.request_id", req.request_id)
            await self.bus.emit(
                req.request_id,
                DecodeStarted(decode_worker_id=self.worker_id, num_running=self.loop.num_running + 1),
                self.worker_id,
            )
            first_token_ts = await self.loop.admit(seq, req.first_token_id, req.first_token_logprobs)
        return DecodeAdmitted(
            request_id=req.request_id,
            worker_id=self.worker_id,
            transfer_bytes=kv_bytes,
            transfer_s=transfer_s,
            transfer_done_ts=transfer_done_ts,
            first_token_ts=first_token_ts,
        )

    async def _drop(self, request_id: str) -> None:
        held = self.reserved.pop(request_id)
        if held is not None:
            await self._free_reserved(held)

    # ------------------------------------------------------------ heartbeats and leases

    def heartbeat(self) -> Heartbeat:
        """This worker's load and capacity now; the scheduler gauges of /metrics are set from the same
        figures (so they move with each heartbeat)."""
        bm = self.engine.block_manager
        hb = Heartbeat(
            worker_id=self.worker_id,
            role=self.role,
            descriptor=self.descriptor,
            num_running=self.loop.num_running,
            num_waiting=len(self.engine.scheduler.waiting) + self.reserved.num_waiting(),
            kv_capacity_tokens=bm.num_blocks * bm.block_size,
            kv_free_tokens=bm.num_free_blocks * bm.block_size,
            ts=time.time(),
        )
        metrics.NUM_REQUESTS_RUNNING.labels(worker_id=self.worker_id).set(hb.num_running)
        metrics.NUM_REQUESTS_WAITING.labels(worker_id=self.worker_id).set(hb.num_waiting)
        metrics.KV_CACHE_USAGE_PERC.labels(worker_id=self.worker_id).set(
            1 - hb.kv_free_tokens / hb.kv_capacity_tokens)
        return hb

    def _count_prefix_cache(self, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        """One prefix cache lookup: `num_prompt_tokens` queried, `num_cached_tokens` found (vLLM's
        prefix_cache_queries / prefix_cache_hits, in tokens)."""
        metrics.PREFIX_CACHE_QUERIES.labels(worker_id=self.worker_id).inc(num_prompt_tokens)
        metrics.PREFIX_CACHE_HITS.labels(worker_id=self.worker_id).inc(num_cached_tokens)

    async def run_heartbeats(self) -> None:
        """Publish a heartbeat (and a KV digest) every interval; free reservations whose lease expired."""
        while True:
            for request_id in self.reserved.expired(time.monotonic()):
                log.warning("%s: lease of %s expired unstarted; freeing", self.worker_id, request_id)
                await self._drop(request_id)
            await self.bus.publish(self.bus.subjects.heartbeat(self.worker_id), self.heartbeat())
            await self.kv_events.digest()
            await asyncio.sleep(self.settings.heartbeat_interval_s)

    async def serve(self) -> None:
        """Announce an empty prefix cache (AllBlocksCleared), then register the command handlers."""
        await self.kv_events.cleared()
        s = self.bus.subjects
        await self.bus.serve(s.worker(self.worker_id, "release"), Release, self.release)
        await self.bus.serve(s.worker(self.worker_id, "prefill"), PrefillRequest, self.prefill)
        if self.role is not Role.PREFILL:
            await self.bus.serve(s.worker(self.worker_id, "reserve"), ReserveRequest, self.reserve)
            await self.bus.serve(s.worker(self.worker_id, "start"), StartDecode, self.start)

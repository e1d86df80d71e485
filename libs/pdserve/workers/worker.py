"""One engine worker in a role: prefill, decode, or unified (both, colocated).

Commands it serves (see `pdserve.messages`):
- reserve (decode/unified): set KV aside for prompt + max_tokens and expect the transfer into it.
- prefill (prefill, or decode/unified for a local prefill): run the prompt, stream each layer's KV to
  the reserved endpoint as soon as that layer is computed, return the first token.
- start (decode/unified): wait for the transfer to be verified, admit the sequence, stream tokens.
- release (all): free everything the request holds here; idempotent.

The model runs in a worker thread (one torch thread per worker), one forward at a time, so the event
loop keeps serving NATS and moving KV while a forward runs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Future

import torch
from opentelemetry import propagate, trace

from pdserve.bus import Bus, RejectedError
from pdserve.config import WorkerSettings
from pdserve.engine.kv_cache import SequenceKVCache
from pdserve.engine.loader import LoadedModel
from pdserve.engine.model import LlamaModel
from pdserve.engine.sampler import Sampler
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
    PrefillRequest,
    PrefillResult,
    RejectCode,
    Release,
    Reservation,
    ReserveRequest,
    Role,
    StartDecode,
)
from pdserve.transfer.base import ChecksumMismatchError, KVTransport, TransferTimeout
from pdserve.workers.decode_loop import DecodeLoop, RunningSequence
from pdserve.workers.slots import Slot, SlotTable

log = logging.getLogger(__name__)
tracer = trace.get_tracer("pdserve.worker")

BLOCK_SIZE = 16  # the paged engine's block size; part of the compatibility descriptor already
LAYOUT_VERSION = 1  # [tokens, 2, kv_heads, head_dim] fp32 per layer


class Worker:
    def __init__(self, bus: Bus, settings: WorkerSettings, loaded: LoadedModel,
                 transport: KVTransport | None) -> None:
        self.bus = bus
        self.settings = settings
        self.worker_id = settings.worker_id
        self.role = Role(settings.role)
        self.loaded = loaded
        self.model = LlamaModel(loaded.config, loaded.weights)
        self.transport = transport
        self.slots = SlotTable(settings.kv_capacity_tokens)
        self.prefilled: dict[str, SequenceKVCache] = {}  # prefill role: KV kept until release
        self.compute = asyncio.Lock()  # one forward at a time on this worker's core
        self.decode = DecodeLoop(self)
        cfg = loaded.config
        self.descriptor = CompatibilityDescriptor(
            model=loaded.name, weights_hash=loaded.weights_hash, dtype="float32", block_size=BLOCK_SIZE,
            num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
            hash_seed=0, layout_version=LAYOUT_VERSION,
        )

    # ------------------------------------------------------------ reserve / release

    async def reserve(self, req: ReserveRequest) -> Reservation:
        if self.role is Role.PREFILL:
            raise RejectedError(RejectCode.INVALID, f"{self.worker_id} is a prefill worker")
        num_tokens = req.num_prompt_tokens + req.max_tokens
        if num_tokens > self.slots.capacity_tokens:
            raise RejectedError(RejectCode.INVALID, f"{num_tokens} tokens can never fit in "
                                f"{self.slots.capacity_tokens}")
        if self.slots.get(req.request_id) is not None:
            raise RejectedError(RejectCode.DUPLICATE, f"request {req.request_id} already reserved")
        if not self.slots.can_reserve(num_tokens):
            raise RejectedError(RejectCode.CAPACITY, f"{num_tokens} tokens wanted, {self.slots.free_tokens} free")
        cache = SequenceKVCache(self.loaded.config, num_tokens)
        slot = Slot(req.request_id, req.transfer_id, cache, num_tokens,
                    lease_deadline=time.monotonic() + req.lease_s)
        if self.transport is not None:
            try:
                slot.inbound = self.transport.expect(req.transfer_id, cache.layers)
            except ValueError as e:
                raise RejectedError(RejectCode.DUPLICATE, str(e)) from e
        self.slots.reserve(slot)
        endpoint = self.transport.endpoint() if self.transport else KVEndpoint(transport="tcp", address="local")
        return Reservation(request_id=req.request_id, transfer_id=req.transfer_id, worker_id=self.worker_id,
                           endpoint=endpoint, num_tokens=num_tokens)

    async def release(self, req: Release) -> Ack:
        if req.finish_reason is not None:
            await self.decode.finish_now(req.request_id, req.finish_reason)
        self.decode.stop(req.request_id)
        self.slots.release(req.request_id)
        self.prefilled.pop(req.request_id, None)
        return Ack()

    # ------------------------------------------------------------ prefill

    async def prefill(self, req: PrefillRequest) -> PrefillResult:
        local = req.decode_worker_id == self.worker_id
        if not local and (self.transport is None or self.role is not Role.PREFILL):
            raise RejectedError(RejectCode.INVALID, f"{self.worker_id} cannot prefill for {req.decode_worker_id}")
        if local:
            slot = self.slots.get(req.request_id)
            if slot is None:
                raise RejectedError(RejectCode.NOT_FOUND, f"no reservation for {req.request_id}")
            cache = slot.cache
        else:
            cache = SequenceKVCache(self.loaded.config, len(req.prompt_token_ids))
            self.prefilled[req.request_id] = cache
        await self.bus.emit(req.request_id, PrefillStarted(
            prefill_worker_id=self.worker_id, transfer_id=req.transfer_id,
            num_prompt_tokens=len(req.prompt_token_ids)), self.worker_id)
        t0 = time.perf_counter()
        with tracer.start_as_current_span("prefill.forward") as span:
            span.set_attribute("pdserve.request_id", req.request_id)
            span.set_attribute("pdserve.num_prompt_tokens", len(req.prompt_token_ids))
            span.set_attribute("pdserve.local", local)
            sends: list[Future[int]] = []
            hook = None if local else self._layer_sender(req, cache, sends)
            input_ids = torch.tensor(req.prompt_token_ids, dtype=torch.int64)
            async with self.compute:
                logits = await asyncio.to_thread(self.model.forward, input_ids, cache, hook)
            first_token = Sampler(req.sampling).sample(logits)
            kv_bytes = sum(await asyncio.gather(*map(asyncio.wrap_future, sends)))
            if not local:
                await self.transport.finish(req.endpoint, req.transfer_id, self.loaded.config.num_layers, 1)
        prefill_s = time.perf_counter() - t0
        await self.bus.emit(req.request_id, PrefillCompleted(
            prefill_worker_id=self.worker_id, transfer_id=req.transfer_id, first_token_id=first_token,
            num_cached_tokens=0, num_computed_tokens=len(req.prompt_token_ids), kv_bytes=kv_bytes,
            prefill_s=prefill_s), self.worker_id)
        return PrefillResult(request_id=req.request_id, transfer_id=req.transfer_id, first_token_id=first_token,
                             num_cached_tokens=0, num_computed_tokens=len(req.prompt_token_ids),
                             kv_bytes=kv_bytes, prefill_s=prefill_s)

    def _layer_sender(self, req: PrefillRequest, cache: SequenceKVCache, sends: list[Future[int]]):
        """A layer hook (called in the forward's thread) that streams layer l's KV while l+1 computes."""
        loop = asyncio.get_running_loop()
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        n = len(req.prompt_token_ids)

        def on_layer(layer: int) -> None:
            coro = self.transport.send_layer(req.endpoint, req.transfer_id, layer, 0, 0,
                                             cache.layers[layer][:n], carrier.get("traceparent"))
            sends.append(asyncio.run_coroutine_threadsafe(coro, loop))

        return on_layer

    # ------------------------------------------------------------ start decode

    async def start(self, req: StartDecode) -> DecodeAdmitted:
        slot = self.slots.get(req.request_id)
        if slot is None or slot.transfer_id != req.transfer_id:
            raise RejectedError(RejectCode.NOT_FOUND, f"no reservation for transfer {req.transfer_id}")
        slot.started = True
        kv_bytes, transfer_s = 0, 0.0
        if slot.inbound is not None:
            try:
                stats = await slot.inbound.wait(self.settings.lease_s)
            except ChecksumMismatchError as e:
                await self.bus.emit(req.request_id, ChecksumMismatch(
                    transfer_id=req.transfer_id, layer=e.layer, expected=e.expected, actual=e.actual),
                    self.worker_id)
                self.slots.release(req.request_id)
                raise RejectedError(RejectCode.TRANSFER_FAILED, f"checksum mismatch at layer {e.layer}") from e
            except TransferTimeout as e:
                self.slots.release(req.request_id)
                raise RejectedError(RejectCode.TRANSFER_FAILED, f"transfer timed out: {e}") from e
            kv_bytes, transfer_s = stats.kv_bytes, stats.seconds
            await self.bus.emit(req.request_id, TransferCompleted(
                transfer_id=req.transfer_id, transport=self.transport.kind, kv_bytes=stats.kv_bytes,
                num_layers=stats.num_layers, transfer_s=stats.seconds, checksum_ok=True), self.worker_id)
        transfer_done_ts = time.time()
        slot.cache.num_tokens = len(req.prompt_token_ids)
        with tracer.start_as_current_span("decode.admit") as span:
            span.set_attribute("pdserve.request_id", req.request_id)
            seq = RunningSequence(request_id=req.request_id, slot=slot, sampler=Sampler(req.sampling),
                                  sampling=req.sampling, prompt_len=len(req.prompt_token_ids),
                                  output_start_index=req.output_start_index)
            await self.bus.emit(req.request_id, DecodeStarted(
                decode_worker_id=self.worker_id, num_running=self.decode.num_running + 1), self.worker_id)
            first_token_ts = await self.decode.admit(seq, req.first_token_id)
        return DecodeAdmitted(request_id=req.request_id, worker_id=self.worker_id, transfer_bytes=kv_bytes,
                              transfer_s=transfer_s, transfer_done_ts=transfer_done_ts,
                              first_token_ts=first_token_ts)

    # ------------------------------------------------------------ heartbeats and leases

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(worker_id=self.worker_id, role=self.role, descriptor=self.descriptor,
                         num_running=self.decode.num_running, num_waiting=self.slots.num_waiting(),
                         kv_capacity_tokens=self.slots.capacity_tokens, kv_free_tokens=self.slots.free_tokens,
                         ts=time.time())

    async def run_heartbeats(self) -> None:
        """Publish a heartbeat every interval and free reservations whose lease expired."""
        while True:
            for request_id in self.slots.expired(time.monotonic()):
                log.warning("%s: lease of %s expired unstarted; freeing", self.worker_id, request_id)
                self.slots.release(request_id)
            await self.bus.publish(self.bus.subjects.heartbeat(self.worker_id), self.heartbeat())
            await asyncio.sleep(self.settings.heartbeat_interval_s)

    async def serve(self) -> None:
        """Register this worker's command handlers (each on its own subject)."""
        s = self.bus.subjects
        await self.bus.serve(s.worker(self.worker_id, "release"), Release, self.release)
        await self.bus.serve(s.worker(self.worker_id, "prefill"), PrefillRequest, self.prefill)
        if self.role is not Role.PREFILL:
            await self.bus.serve(s.worker(self.worker_id, "reserve"), ReserveRequest, self.reserve)
            await self.bus.serve(s.worker(self.worker_id, "start"), StartDecode, self.start)

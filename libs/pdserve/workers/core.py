"""What every command of a worker shares: the engine (model, KV cache, continuous batch) and the one lock
in front of it, the engine loop, the reserved KV, the sequences prefilling for a decode worker, the KV
cache events, and freeing what a request holds.

The engine runs in a worker thread (one torch thread per worker), one step at a time; every engine call
from a handler takes `compute`, which a step holds while it schedules and samples but not during its
forward (`LLMEngine.run_step`), so the event loop keeps serving NATS and moving KV while a step runs, and a
reserve or a new request is taken mid-step instead of after it.
"""

from __future__ import annotations

import asyncio

import torch

from pdserve.bus import Bus
from pdserve.config import WorkerSettings
from pdserve.engine.device import engine_dtype
from pdserve.engine.llm_engine import EngineConfig, LLMEngine
from pdserve.engine.loader import LoadedModel, build_model
from pdserve.engine.sequence import Sequence
from pdserve.telemetry import metrics
from pdserve.transfer.base import KVTransport
from pdserve.workers.engine_loop import EngineLoop
from pdserve.workers.kv_events import KVEventPublisher
from pdserve.workers.kv_tiers import build_tiers
from pdserve.workers.reserved_kv import ReservedKV, ReservedKVTable


class WorkerCore:
    def __init__(
        self, bus: Bus, settings: WorkerSettings, loaded: LoadedModel, transport: KVTransport | None
    ) -> None:
        self.bus = bus
        self.settings = settings
        self.worker_id = settings.worker_id
        self.role = settings.role
        self.loaded = loaded
        self.transport = transport
        device = torch.device(settings.device)
        self.model = build_model(loaded, device, engine_dtype(device))
        self.engine = LLMEngine(
            self.model,
            EngineConfig(
                num_blocks=max(settings.kv_capacity_tokens // settings.block_size, 1),
                block_size=settings.block_size,
                max_num_batched_tokens=settings.max_num_batched_tokens,
                max_num_seqs=settings.max_num_seqs,
                hash_seed=settings.kv_hash_seed,
                checkpoint_interval=settings.checkpoint_interval,
            ),
            loaded.tokenizer.stop_token_ids,
            tiers=build_tiers(settings, loaded, self.model),
        )
        # every label cached_tokens_by_tier can carry here: the pool, then the tiers below it
        self.tier_names = ["pool"] + [t.name for t in (self.engine.tiers.tiers if self.engine.tiers else [])]
        self.reserved = ReservedKVTable()
        # request id → transfer id of the newest reserve command for it: a later reserve supersedes an
        # earlier one still waiting for the engine (the coordinator gave up on that one's reply)
        self.reserving: dict[str, str] = {}
        self.prefilling: dict[str, Sequence] = {}  # prefill role: sequences computing for a decode worker
        self.compute = asyncio.Lock()  # one engine call at a time on this worker's core
        self.kv_events = KVEventPublisher(bus, self.worker_id, self.engine.block_manager,
                                          self.engine.take_kv_events)
        self.loop = EngineLoop(self.engine, self.compute, bus, self.worker_id,
                               commit_every_tokens=settings.commit_every_tokens,
                               after_step=self.kv_events.flush, torch_threads=settings.torch_threads)

    async def free(self, seq: Sequence) -> None:
        async with self.compute:
            self.engine.free(seq)
        await self.kv_events.flush()

    async def free_reserved(self, held: ReservedKV) -> None:
        """Free popped reserved KV once nothing writes into its blocks any more."""
        if held.kv is not None:
            await held.kv.drained()
        await self.free(held.seq)

    async def release(self, request_id: str, reason: str) -> None:
        """Free everything `request_id` holds here (its stream, a prefill in flight, its reserved KV or
        prefilling sequence); idempotent."""
        self.loop.stop(request_id)
        self.loop.fail_prefill(request_id, reason)
        held = self.reserved.pop(request_id)
        if held is not None:
            await self.free_reserved(held)
        elif (seq := self.prefilling.pop(request_id, None)) is not None:
            await self.free(seq)

    async def drop(self, request_id: str) -> None:
        """Free `request_id`'s reserved KV, if any."""
        held = self.reserved.pop(request_id)
        if held is not None:
            await self.free_reserved(held)

    def count_prefix_cache(self, num_prompt_tokens: int, cached_tokens_by_tier: dict[str, int]) -> None:
        """One prefix cache lookup: `num_prompt_tokens` queried, the tokens found by the tier they came
        from (`Sequence.cached_tokens_by_tier`: vLLM's prefix_cache_queries / prefix_cache_hits, in
        tokens, hits labelled by tier)."""
        metrics.PREFIX_CACHE_QUERIES.labels(worker_id=self.worker_id).inc(num_prompt_tokens)
        for tier, tokens in cached_tokens_by_tier.items():
            metrics.PREFIX_CACHE_HITS.labels(worker_id=self.worker_id, tier=tier).inc(tokens)

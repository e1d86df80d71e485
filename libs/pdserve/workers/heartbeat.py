"""What a worker tells the router about itself: its `CompatibilityDescriptor` (what must match for a peer
to use its KV, docs/architecture.md §6) and, every `heartbeat_interval_s`, a `Heartbeat` with its load and
free KV plus a digest of its prefix cache; the same beat frees reservations whose lease expired.
"""

from __future__ import annotations

import asyncio
import logging
import time

from pdserve.config import WorkerSettings
from pdserve.engine.loader import LoadedModel
from pdserve.engine.model_family import EngineModel
from pdserve.messages import CompatibilityDescriptor, Heartbeat
from pdserve.telemetry import metrics
from pdserve.workers.core import WorkerCore

log = logging.getLogger(__name__)

LAYOUT_VERSION = 2  # paged: per layer [num_blocks, block_size, *paged_row_shape]; transfers carry token rows


def state_layout(model: EngineModel) -> tuple[str, ...]:
    """The descriptor's `state_layout`: one 'name[layers,*shape]:dtype' per state tensor of `model`'s
    `cache_spec().state` (a tensor without a dtype of its own is in the model's), () without state."""
    layout = model.cache_spec().state
    if layout is None:
        return ()
    return tuple(
        f"{t.name}[{','.join(str(n) for n in (layout.num_layers, *t.shape))}]:"
        f"{str(t.dtype or model.dtype).removeprefix('torch.')}"
        for t in layout.tensors
    )


def compatibility_descriptor(
    loaded: LoadedModel, settings: WorkerSettings, model: EngineModel
) -> CompatibilityDescriptor:
    """What must match for a peer to use this worker's KV and state (docs/architecture.md §6): the model
    and its weights, the family and its cache layout (paged rows, state tensors), dtype, memory, block size
    and hash seed. Llama keeps its KV head fields; a family without them has 0 there."""
    spec = model.cache_spec()
    cfg = loaded.config
    llama = loaded.family == "llama"
    return CompatibilityDescriptor(
        model=loaded.name,
        weights_hash=loaded.weights_hash,
        dtype=str(model.dtype).removeprefix("torch."),
        memory=model.device.type,
        block_size=settings.block_size,
        num_layers=spec.num_paged_layers,
        num_kv_heads=cfg.num_kv_heads if llama else 0,
        head_dim=cfg.head_dim if llama else 0,
        hash_seed=settings.kv_hash_seed,
        layout_version=LAYOUT_VERSION,
        family=loaded.family,
        paged_row_shape=spec.paged_row_shape,
        state_layout=state_layout(model),
    )


class Heartbeats:
    def __init__(self, core: WorkerCore) -> None:
        self.core = core
        self.descriptor = compatibility_descriptor(core.loaded, core.settings, core.model)

    def heartbeat(self) -> Heartbeat:
        """This worker's load and capacity now; the scheduler gauges of /metrics are set from the same
        figures (so they move with each heartbeat)."""
        core = self.core
        bm = core.engine.block_manager
        hb = Heartbeat(
            worker_id=core.worker_id,
            role=core.role,
            descriptor=self.descriptor,
            num_running=core.loop.num_running,
            num_waiting=len(core.engine.scheduler.waiting) + core.reserved.num_waiting(),
            kv_capacity_tokens=bm.num_blocks * bm.block_size,
            kv_free_tokens=bm.num_free_blocks * bm.block_size,
            ts=time.time(),
        )
        metrics.NUM_REQUESTS_RUNNING.labels(worker_id=core.worker_id).set(hb.num_running)
        metrics.NUM_REQUESTS_WAITING.labels(worker_id=core.worker_id).set(hb.num_waiting)
        metrics.KV_CACHE_USAGE_PERC.labels(worker_id=core.worker_id).set(
            1 - hb.kv_free_tokens / hb.kv_capacity_tokens)
        return hb

    async def run(self) -> None:
        """Publish a heartbeat (and a KV digest) every interval; free reservations whose lease expired."""
        core = self.core
        while True:
            for request_id in core.reserved.expired(time.monotonic()):
                log.warning("%s: lease of %s expired unstarted; freeing", core.worker_id, request_id)
                await core.drop(request_id)
            await core.bus.publish(core.bus.subjects.heartbeat(core.worker_id), self.heartbeat())
            await core.kv_events.digest()
            await asyncio.sleep(core.settings.heartbeat_interval_s)

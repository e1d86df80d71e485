"""Wiring of a worker process, shared by the prefill and decode services (they differ only in role)."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable

from pdserve.bus import Bus
from pdserve.config import WorkerSettings
from pdserve.engine.host_memory import retain_freed_memory
from pdserve.engine.loader import load_model
from pdserve.engine.threads import one_thread
from pdserve.messages import KVTransportKind, Role
from pdserve.service import MainTask, run_service, until_stopped
from pdserve.telemetry import metrics
from pdserve.transfer import KVTransport, make_transport
from pdserve.workers.worker import Worker

log = logging.getLogger(__name__)


def run_worker(default_role: Role,
               make_transport: Callable[[KVTransportKind, str], KVTransport] = make_transport) -> None:
    """Run a worker process. `make_transport(kind, host)` builds its KV transport bound to `PDS_KV_HOST`
    (a test wraps the real one to inject faults: tests/faults/corrupting.py)."""
    settings = WorkerSettings()
    if "PDS_ROLE" not in os.environ:
        settings.role = default_role
    if not settings.worker_id:
        settings.worker_id = f"{settings.role}-{os.getpid()}"
    # One torch thread for every thread of the process but the engine loop's step thread, which runs on
    # the worker's `torch_threads` cores (engine/threads.py).
    one_thread()
    retain_freed_memory()  # a forward's large activations stay in the heap between steps

    async def setup(bus: Bus):
        loaded = await asyncio.to_thread(load_model, settings.model, settings.weights_cache_dir)
        transport = None
        if settings.role is not Role.UNIFIED:
            transport = make_transport(settings.kv_transport, settings.kv_host)
            await transport.start()
        worker = Worker(bus, settings, loaded, transport)
        metrics.init_worker_series(settings.worker_id, receives_kv=settings.role is not Role.PREFILL,
                                   tiers=tuple(worker.core.tier_names))
        await worker.serve()
        engine = bus.spawn(worker.core.loop.run())
        engine.set_name(f"{settings.worker_id} engine loop")
        tasks = [bus.spawn(worker.heartbeats.run()), engine]
        log.info("%s serving %s as %s", settings.worker_id, loaded.name, settings.role)

        async def cleanup() -> None:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            worker.core.loop.close()
            if transport is not None:
                await transport.stop()

        return MainTask(lambda stop: until_stopped(stop, engine), cleanup)

    run_service(settings.worker_id, settings, setup)

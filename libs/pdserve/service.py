"""The one way a pdserve process runs: telemetry → bus → setup → run until a signal → drain → close.

Every `services/<name>/__main__.py` is `run_service(name, settings, setup)`. `setup(bus)` starts the
service's work and returns what ends it:
- an async cleanup, for a service of handlers (router, coordinator): the process then waits for
  SIGTERM/SIGINT, runs the cleanup, closes the bus;
- a `MainTask`, for a service whose work is one task (the gateway's HTTP server, the recorder's fetch
  loop) or has a task it cannot live without (a worker's engine loop: `until_stopped`): the process runs
  it until it returns (it must return once signalled), then cleans up the same way.
If setup or the main task fails, the failure is logged and the process exits 1, so the supervisor
restarts it.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from pdserve.bus import Bus
from pdserve.config import CommonSettings
from pdserve.telemetry.metrics import start_metrics_server
from pdserve.telemetry.setup import init_telemetry

log = logging.getLogger(__name__)

Cleanup = Callable[[], Awaitable[None]]
SIGNALS = (signal.SIGTERM, signal.SIGINT)


async def _nothing() -> None:
    pass


@dataclass(frozen=True)
class MainTask:
    """A service's one main task. `run(stop)` is awaited as the process's work and must return once `stop`
    is set (SIGTERM/SIGINT); `on_signal(sig)`, if given, is called on each signal as well, for a task that
    has its own way of being told (uvicorn's `handle_exit`). `cleanup` runs once `run` has returned or
    failed."""

    run: Callable[[asyncio.Event], Awaitable[None]]
    cleanup: Cleanup = _nothing
    on_signal: Callable[[int], None] | None = None


Setup = Callable[[Bus], Awaitable[Cleanup | MainTask]]


async def until_stopped(stop: asyncio.Event, *vital: asyncio.Task) -> None:
    """Wait for `stop`; but should one of the `vital` tasks (work the process cannot serve without, such
    as a worker's engine loop) end first, raise its exception (RuntimeError if it returned), so the
    process exits 1 and is restarted instead of answering heartbeats with nothing behind them."""
    stopped = asyncio.ensure_future(stop.wait())
    try:
        done, _ = await asyncio.wait({stopped, *vital}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    for task in vital:
        if task in done:
            task.result()
            raise RuntimeError(f"{task.get_name()} ended")


async def serve_until_signalled(name: str, settings: CommonSettings, setup: Setup, *,
                                metrics_server: bool = True) -> None:
    telemetry = init_telemetry(name, settings)
    port = start_metrics_server(settings.metrics_port) if metrics_server else None
    bus = await Bus.connect(settings, name)
    stop = asyncio.Event()
    on_signal: Callable[[int], None] | None = None

    def signalled(sig: int) -> None:
        stop.set()
        if on_signal is not None:
            on_signal(sig)

    loop = asyncio.get_running_loop()
    for sig in SIGNALS:
        loop.add_signal_handler(sig, signalled, sig)
    try:
        started = await setup(bus)
        # Everything alive now (modules, schemas; a worker's model: ~200k objects) lives as long as the
        # process: frozen out of the collector's scans (as vLLM's engine core does), whose full ones took
        # ~80 ms in a worker and landed inside engine steps (served colocated, 128-token prompts one at a
        # time: prefill steps 170-180 -> 154-168 ms, 163 in process).
        gc.collect()
        gc.freeze()
        task = started if isinstance(started, MainTask) else MainTask(lambda stop: stop.wait(), started)
        try:
            on_signal = task.on_signal
            metrics = "" if port is None else f", metrics :{port}"
            log.info("%s ready (nats %s%s)", name, settings.nats_url, metrics)
            if not stop.is_set():  # a signal during setup: clean up straight away
                await task.run(stop)
        finally:
            log.info("%s stopping", name)
            await task.cleanup()
    finally:
        for sig in SIGNALS:
            loop.remove_signal_handler(sig)
        await bus.close()
        telemetry.shutdown()


def run_service(name: str, settings: CommonSettings, setup: Setup, *, metrics_server: bool = True) -> None:
    """Run one service process until SIGTERM/SIGINT (or its main task's end); exit 1 if it fails.
    `metrics_server=False` for a process that serves /metrics itself (the gateway)."""
    try:
        asyncio.run(serve_until_signalled(name, settings, setup, metrics_server=metrics_server))
    except Exception:
        log.exception("%s failed", name)
        sys.exit(1)

"""The one way a pdserve process runs: telemetry → bus → handlers → wait for a signal → drain → close.

Every `services/<name>/__main__.py` is `run_service(name, settings, setup)` where `setup(bus)` registers
its handlers and returns an async cleanup, so no service copies the start/stop dance.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable

from pdserve.bus import Bus
from pdserve.config import CommonSettings
from pdserve.telemetry.metrics import start_metrics_server
from pdserve.telemetry.setup import init_telemetry

log = logging.getLogger(__name__)

Cleanup = Callable[[], Awaitable[None]]


async def serve_until_signalled(
    name: str, settings: CommonSettings, setup: Callable[[Bus], Awaitable[Cleanup]]
) -> None:
    telemetry = init_telemetry(name, settings)
    port = start_metrics_server(settings.metrics_port)
    bus = await Bus.connect(settings, name)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    cleanup = await setup(bus)
    log.info("%s ready (nats %s, metrics :%d)", name, settings.nats_url, port)
    try:
        await stop.wait()
    finally:
        log.info("%s stopping", name)
        await cleanup()
        await bus.close()
        telemetry.shutdown()


def run_service(name: str, settings: CommonSettings, setup: Callable[[Bus], Awaitable[Cleanup]]) -> None:
    """Run one service process until SIGTERM/SIGINT."""
    asyncio.run(serve_until_signalled(name, settings, setup))

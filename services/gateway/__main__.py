"""Gateway: the OpenAI-compatible HTTP edge (validation, chat template, tokenization, SSE).

settings → telemetry → bus → tokenizer and event store → app → uvicorn until SIGTERM/SIGINT → drain.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

from pdserve.bus import Bus
from pdserve.config import GatewaySettings
from pdserve.engine.tokenizer import load_tokenizer
from pdserve.gateway.app import create_app
from pdserve.store.queries import make_db
from pdserve.telemetry.setup import init_telemetry

log = logging.getLogger("pdserve.gateway")


class _Server(uvicorn.Server):
    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn re-raises a captured signal once serve() returns, which would kill the process before
        # the bus is drained and spans are flushed; handle the signals on the loop instead.
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.handle_exit, sig, None)
        try:
            yield
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)


async def serve(settings: GatewaySettings) -> None:
    telemetry = init_telemetry("gateway", settings)
    bus = await Bus.connect(settings, "gateway")
    tokenizer = load_tokenizer(settings.model)
    db = make_db(settings.database_url)
    app = create_app(bus, tokenizer, settings, db)
    server = _Server(uvicorn.Config(app, host=settings.host, port=settings.port, log_config=None,
                                    access_log=False, timeout_graceful_shutdown=10))
    log.info("gateway listening on http://%s:%d (model %s)", settings.host, settings.port,
             settings.served_model_name)
    try:
        await server.serve()
    finally:
        log.info("gateway stopping")
        await bus.close()
        await db.dispose()
        telemetry.shutdown()


def main() -> None:
    asyncio.run(serve(GatewaySettings()))


if __name__ == "__main__":
    main()

"""Gateway: the OpenAI-compatible HTTP edge (validation, chat template, tokenization, SSE).

`run_service` with uvicorn's server as the main task: settings → telemetry → bus → tokenizer and event
store → app → uvicorn until SIGTERM/SIGINT → drain. No separate metrics server: the app serves /metrics.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

from pdserve.bus import Bus
from pdserve.config import GatewaySettings
from pdserve.engine.tokenizer import load_tokenizer
from pdserve.gateway.app import create_app
from pdserve.service import MainTask, run_service
from pdserve.store.queries import make_db

log = logging.getLogger("pdserve.gateway")


class _Server(uvicorn.Server):
    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn re-raises a captured signal once serve() returns, which would kill the process before
        # the bus is drained and spans are flushed; `run_service` handles the signals on the loop instead
        # and passes them to `handle_exit` (a second SIGINT still forces the exit).
        yield


def main() -> None:
    settings = GatewaySettings()

    async def setup(bus: Bus) -> MainTask:
        tokenizer = load_tokenizer(settings.model)
        db = make_db(settings.database_url)
        app = create_app(bus, tokenizer, settings, db)
        server = _Server(uvicorn.Config(app, host=settings.host, port=settings.port, log_config=None,
                                        access_log=False, timeout_graceful_shutdown=10))
        log.info("gateway listening on http://%s:%d (model %s)", settings.host, settings.port,
                 settings.served_model_name)
        return MainTask(run=lambda stop: server.serve(), cleanup=db.dispose,
                        on_signal=lambda sig: server.handle_exit(sig, None))

    run_service("gateway", settings, setup, metrics_server=False)


if __name__ == "__main__":
    main()

"""Python logging for every pdserve process: one format, carrying the service name and the current
trace id, so a log line in var/log/ leads to its waterfall (`pdserve trace`)."""

from __future__ import annotations

import logging
import sys

from opentelemetry import trace

LOG_FORMAT = "%(asctime)s %(levelname)-7s %(service)s %(name)s [trace=%(trace_id)s] %(message)s"


class _ContextFilter(logging.Filter):
    """Stamps each record with the service name and the trace id of the span current when it was
    logged ("-" outside any span)."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def filter(self, record: logging.LogRecord) -> bool:
        ctx = trace.get_current_span().get_span_context()
        record.service = self.service
        record.trace_id = f"{ctx.trace_id:032x}" if ctx.is_valid else "-"
        return True


class _PdserveHandler(logging.StreamHandler):
    """Marker type, so a second `configure_logging` replaces the handler instead of adding one."""


def configure_logging(service: str, level: str = "INFO") -> None:
    """Send every logger's records to stderr in `LOG_FORMAT`, at `level` ("DEBUG", "INFO", ... or a
    number as a string). `service` is the resource service name, e.g. "pdserve-router". Idempotent:
    calling again replaces pdserve's handler and level. Raises ValueError on an unknown level name."""
    numeric = logging.getLevelName(level.upper()) if not level.isdigit() else int(level)
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")
    root = logging.getLogger()
    for h in [h for h in root.handlers if isinstance(h, _PdserveHandler)]:
        root.removeHandler(h)
    handler = _PdserveHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    handler.addFilter(_ContextFilter(service))
    root.addHandler(handler)
    root.setLevel(numeric)

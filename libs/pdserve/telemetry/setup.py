"""Tracing and logging setup, called once at the start of every pdserve process (docs/architecture.md §8).

Export goes to OTLP/HTTP when `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`)
is set — the exporter reads the endpoint, headers and certificates from the standard OTel variables —
otherwise to JSON lines in `settings.trace_dir / f"{service}-{pid}.jsonl"`, which `pdserve trace` reads.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

from pdserve.config import CommonSettings
from pdserve.telemetry.jsonl_exporter import JsonLinesSpanExporter
from pdserve.telemetry.logging import configure_logging

log = logging.getLogger(__name__)

# Without a reachable collector, the OTLP exporter's default 10 s timeout (plus retries) made process
# shutdown block ~6.5 s on this machine; 1 s bounds it (docs/architecture.md §10).
OTLP_TIMEOUT_S = 1.0
# The SDK default of 5 s would leave a just-finished request invisible to `pdserve trace` for seconds.
SCHEDULE_DELAY_MS = 500
SHUTDOWN_FLUSH_TIMEOUT_MS = 2000

_OTLP_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
_OTLP_TIMEOUT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT")


def service_name(service: str) -> str:
    """The OTel resource `service.name` of a pdserve process: "gateway" → "pdserve-gateway"."""
    return f"pdserve-{service}"


def otlp_endpoint_configured() -> bool:
    """True when the standard OTel variables name an OTLP collector."""
    return any(os.environ.get(v) for v in _OTLP_ENDPOINT_VARS)


def trace_file(service: str, settings: CommonSettings, pid: int | None = None) -> Path:
    """Where this process's JSON-lines spans go: `<var_dir>/traces/<service>-<pid>.jsonl`."""
    return settings.trace_dir / f"{service}-{os.getpid() if pid is None else pid}.jsonl"


def make_span_exporter(service: str, settings: CommonSettings) -> SpanExporter:
    """OTLP/HTTP exporter (timeout `OTLP_TIMEOUT_S` unless an OTEL_EXPORTER_OTLP_*TIMEOUT variable says
    otherwise) when an endpoint is configured, else a `JsonLinesSpanExporter` on `trace_file(...)`."""
    if otlp_endpoint_configured():
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        timeout = None if any(os.environ.get(v) for v in _OTLP_TIMEOUT_VARS) else OTLP_TIMEOUT_S
        return OTLPSpanExporter(timeout=timeout)
    return JsonLinesSpanExporter(trace_file(service, settings))


def build_tracer_provider(service: str, exporter: SpanExporter) -> TracerProvider:
    """A TracerProvider with resource service.name = `service_name(service)` exporting through a
    BatchSpanProcessor to `exporter`. Not installed globally: `init_telemetry` does that; tests use
    this to emulate several services in one process."""
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name(service)}))
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=SCHEDULE_DELAY_MS))
    return provider


@dataclass
class Telemetry:
    """What `init_telemetry` set up. `tracer` names spans after the service; `exporter` is the OTLP or
    JSON-lines exporter in use; `trace_path` is the JSON-lines file (None when exporting OTLP)."""

    service: str
    provider: TracerProvider
    exporter: SpanExporter
    trace_path: Path | None

    @property
    def tracer(self) -> trace.Tracer:
        return self.provider.get_tracer(f"pdserve.{self.service}")

    def flush(self, timeout_ms: int = SHUTDOWN_FLUSH_TIMEOUT_MS) -> bool:
        """Export every finished span now; False if `timeout_ms` passed first."""
        return self.provider.force_flush(timeout_ms)

    def shutdown(self) -> None:
        """Flush finished spans and stop the exporter. Bounded: ~`SHUTDOWN_FLUSH_TIMEOUT_MS` plus one
        OTLP request timeout when a collector does not answer."""
        self.flush()
        self.provider.shutdown()


def init_telemetry(service: str, settings: CommonSettings) -> Telemetry:
    """Configure logging (level `settings.log_level`) and install the global TracerProvider of this
    process for `service` ("gateway", "router", "coordinator", "prefill", "decode", "recorder", ...).

    Call once per process, first thing. OTel allows one global provider per process: a second call
    logs a warning and returns a Telemetry whose provider is not global (spans made through its
    `tracer` still export; spans made through `trace.get_tracer` go to the first provider).
    """
    configure_logging(service_name(service), settings.log_level)
    exporter = make_span_exporter(service, settings)
    provider = build_tracer_provider(service, exporter)
    trace.set_tracer_provider(provider)
    path = exporter.path if isinstance(exporter, JsonLinesSpanExporter) else None
    log.info("tracing to %s", path or f"OTLP ({type(exporter).__name__})")
    return Telemetry(service=service, provider=provider, exporter=exporter, trace_path=path)

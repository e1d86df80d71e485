"""Telemetry setup: the JSON-lines exporter, the OTLP choice, process init, logging and /metrics."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.trace import Status, StatusCode

from pdserve.config import CommonSettings
from pdserve.telemetry import metrics
from pdserve.telemetry.jsonl_exporter import JsonLinesSpanExporter
from pdserve.telemetry.logging import configure_logging
from pdserve.telemetry.setup import build_tracer_provider, make_span_exporter, trace_file

OTLP_VARS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
             "OTEL_EXPORTER_OTLP_TIMEOUT", "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT")


@pytest.fixture
def no_otlp_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in OTLP_VARS:
        monkeypatch.delenv(var, raising=False)


def test_exporter_writes_one_json_line_per_span_with_parent_events_and_status(tmp_path: Path) -> None:
    path = tmp_path / "traces" / "prefill-7.jsonl"
    provider = build_tracer_provider("prefill", JsonLinesSpanExporter(path))
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("prefill.forward", attributes={"pdserve.request_id": "r1"}) as parent:
        with tracer.start_as_current_span("transfer.send") as child:
            child.set_attribute("pdserve.layer", 3)
            child.set_attribute("pdserve.block_ids", [4, 5])
            child.add_event("sent", {"pdserve.kv_bytes": 1024})
            child.set_status(Status(StatusCode.ERROR, "peer gone"))
    provider.shutdown()

    send, forward = (json.loads(line) for line in path.read_text().splitlines())
    assert forward["parent_span_id"] is None
    assert send["parent_span_id"] == forward["span_id"] == f"{parent.get_span_context().span_id:016x}"
    assert send["trace_id"] == forward["trace_id"] and len(send["trace_id"]) == 32
    assert send["service"] == "pdserve-prefill" and send["name"] == "transfer.send"
    assert send["attributes"] == {"pdserve.layer": 3, "pdserve.block_ids": [4, 5]}
    assert [e["name"] for e in send["events"]] == ["sent"]
    assert send["events"][0]["attributes"] == {"pdserve.kv_bytes": 1024}
    assert send["status"] == {"code": "ERROR", "description": "peer gone"}
    assert forward["start_unix_ns"] <= send["start_unix_ns"] <= send["end_unix_ns"] <= forward["end_unix_ns"]


def test_without_otlp_endpoint_spans_go_to_a_per_process_jsonl_file(tmp_path: Path, no_otlp_env) -> None:
    settings = CommonSettings(var_dir=tmp_path)
    exporter = make_span_exporter("router", settings)
    assert isinstance(exporter, JsonLinesSpanExporter)
    assert exporter.path == tmp_path / "traces" / f"router-{__import__('os').getpid()}.jsonl"
    assert trace_file("router", settings, pid=42) == tmp_path / "traces" / "router-42.jsonl"


class _Collector(BaseHTTPRequestHandler):
    received: list[tuple[str, bytes]] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.received.append((self.path, body))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def collector() -> Iterator[str]:
    """A minimal OTLP/HTTP receiver on a free port: records each POST's path and body, answers 200."""
    _Collector.received = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


def test_with_otlp_endpoint_spans_are_posted_to_the_collector(
        tmp_path: Path, collector: str, no_otlp_env, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector)
    exporter = make_span_exporter("decode", CommonSettings(var_dir=tmp_path))
    assert isinstance(exporter, OTLPSpanExporter)
    provider = build_tracer_provider("decode", exporter)
    with provider.get_tracer("test").start_as_current_span("decode.admit"):
        pass
    provider.shutdown()
    ((path, body),) = _Collector.received
    assert path == "/v1/traces"
    assert b"decode.admit" in body and b"pdserve-decode" in body
    assert not (tmp_path / "traces").exists()


def test_init_telemetry_in_a_fresh_process_flushes_its_spans_at_shutdown(tmp_path: Path) -> None:
    # A subprocess: OTel allows one global TracerProvider per process, and this test sets it.
    code = (
        "import os, sys, logging\n"
        "from opentelemetry import trace\n"
        "from pdserve.config import CommonSettings\n"
        "from pdserve.telemetry.setup import init_telemetry\n"
        f"t = init_telemetry('coordinator', CommonSettings(var_dir={str(tmp_path)!r}, log_level='DEBUG'))\n"
        "with trace.get_tracer('x').start_as_current_span('coordinator.request'):\n"
        "    logging.getLogger('pdserve.test').info('inside')\n"
        "t.shutdown()\n"
        "print(os.getpid())\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k not in OTLP_VARS}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    pid = int(done.stdout.strip())
    (record,) = (json.loads(line) for line in (tmp_path / "traces" / f"coordinator-{pid}.jsonl").open())
    assert record["name"] == "coordinator.request" and record["service"] == "pdserve-coordinator"
    log_line = next(line for line in done.stderr.splitlines() if line.endswith("inside"))
    assert "pdserve-coordinator pdserve.test" in log_line and f"[trace={record['trace_id']}]" in log_line


@pytest.fixture
def restore_root_logger() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_logging_is_configured_once_however_often_it_is_called(restore_root_logger, capsys) -> None:
    configure_logging("pdserve-gateway", "INFO")
    configure_logging("pdserve-gateway", "warning")
    logging.getLogger("pdserve.x").info("hidden")
    logging.getLogger("pdserve.x").warning("shown")
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "WARNING" in err[0] and "pdserve-gateway" in err[0] and "[trace=-]" in err[0]


def test_unknown_log_level_is_refused(restore_root_logger) -> None:
    with pytest.raises(ValueError, match="VERBOSE"):
        configure_logging("pdserve-gateway", "VERBOSE")


def test_metrics_server_on_a_free_port_exposes_pdserve_metrics() -> None:
    port = metrics.start_metrics_server(0, addr="127.0.0.1")
    assert port > 0
    metrics.TIME_TO_FIRST_TOKEN_SECONDS.labels(model="tiny-test").observe(0.09)
    metrics.KV_TRANSFER_BYTES.labels(worker_id="decode-test").inc(24576)
    metrics.KV_CACHE_USAGE_PERC.labels(worker_id="decode-test").set(0.25)
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    assert 'pdserve:time_to_first_token_seconds_bucket{le="0.1",model="tiny-test"} 1.0' in text
    assert 'pdserve:time_to_first_token_seconds_bucket{le="0.08",model="tiny-test"} 0.0' in text
    assert 'pdserve:kv_transfer_bytes_total{worker_id="decode-test"} 24576.0' in text
    assert 'pdserve:kv_cache_usage_perc{worker_id="decode-test"} 0.25' in text
    for name in ("num_requests_running gauge", "num_requests_waiting gauge",
                 "prefix_cache_queries_total counter",
                 "prefix_cache_hits_total counter", "inter_token_latency_seconds histogram",
                 "e2e_request_latency_seconds histogram", "kv_transfer_seconds histogram",
                 "checksum_failures_total counter", "admission_deferred_total counter",
                 "events_recorder_lag_seconds gauge"):
        assert f"# TYPE pdserve:{name}\n" in text


# What Prometheus 2.x sends when it scrapes: OpenMetrics first.
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
                     "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1")


def test_metrics_server_keeps_the_pdserve_prefix_for_a_prometheus_scrape() -> None:
    port = metrics.start_metrics_server(0, addr="127.0.0.1")
    metrics.CHECKSUM_FAILURES.labels(worker_id="decode-scraped").inc()
    url = f"http://127.0.0.1:{port}/metrics"
    text = httpx.get(url, headers={"Accept": PROMETHEUS_ACCEPT}, timeout=5).text
    assert 'pdserve:checksum_failures_total{worker_id="decode-scraped"} 1.0' in text
    assert "pdserve_" not in text

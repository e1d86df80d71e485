"""Must-show 2 of issue 18: every process of a stack (tiny model, 1 prefill, 2 decode workers) exports OTLP
to a real collector (Rotel), and one request's trace read back from the collector's storage is complete —
gateway → coordinator → router → prefill → per-layer transfer and checksum → decode, nothing orphaned —
with the OTel GenAI attributes on the gateway's span; so is a request whose decode worker is killed
mid-stream: the retried attempt is linked to the one it replaces. `pdserve trace --otlp-file` draws it."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
from rich.console import Console

from pdserve.cli import trace as trace_cli
from pdserve.telemetry.spans import SpanRecord, spans_of_request
from tests.e2e.collector import Rotel, rotel_binary
from tests.e2e.test_prefix_cache import prompt
from tests.faults.conftest import EnvStack

pytestmark = [pytest.mark.stack,
              pytest.mark.skipif(rotel_binary() is None, reason="rotel not installed (dev dependency)")]

TINY_LAYERS = 2


@pytest.fixture(scope="module")
def traced_stack(isolated_settings, tmp_path_factory) -> Iterator[tuple[EnvStack, Rotel]]:
    tmp = tmp_path_factory.mktemp("otlp")
    collector = Rotel(tmp).start()
    stack = EnvStack(isolated_settings("otlp"), tmp / "stack",
                     {"OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint, "PDS_COMMIT_EVERY_TOKENS": "8"},
                     model="tiny", n_prefill=1, n_decode=2)
    try:
        yield stack.start(), collector
    finally:
        stack.stop()
        collector.stop()


def trace_of(collector: Rotel, request_id: str, complete: Callable[[list[SpanRecord]], bool],
             timeout_s: float = 20.0) -> list[SpanRecord]:
    """The request's spans as the collector stored them, once `complete(spans)` and none is orphaned: spans
    arrive in batches, each process's on its own schedule, and a parent (the gateway's HTTP server span,
    which ends after the last byte) may come in a later batch than its children."""
    deadline = time.monotonic() + timeout_s
    spans: list[SpanRecord] = []
    while time.monotonic() < deadline:
        assert collector.alive(), collector.log_tail()
        spans = spans_of_request(collector.spans(), request_id)
        if complete(spans) and not orphans(spans):
            return spans
        time.sleep(0.3)
    raise AssertionError(f"incomplete trace of {request_id}: {sorted({(s.service, s.name) for s in spans})}, "
                         f"orphaned {orphans(spans)}")


def names(spans: list[SpanRecord]) -> set[str]:
    return {s.name for s in spans}


def one_placement_complete(spans: list[SpanRecord]) -> bool:
    return {"gateway.request", "coordinator.request", "router.route", "prefill.forward", "transfer.send",
            "transfer.verify_checksum", "decode.generate"} <= names(spans)


def orphans(spans: list[SpanRecord]) -> list[tuple[str, str]]:
    """(service, name) of the spans whose parent is not among `spans`."""
    ids = {s.span_id for s in spans}
    return [(s.service, s.name) for s in spans if s.parent_span_id and s.parent_span_id not in ids]


def check_whole_tree(spans: list[SpanRecord]) -> None:
    assert len({s.trace_id for s in spans}) == 1, "one trace per request"
    assert not orphans(spans), orphans(spans)
    roots = [s for s in spans if not s.parent_span_id]  # the gateway's HTTP server span
    assert [r.service for r in roots] == ["pdserve-gateway"], [(r.service, r.name) for r in roots]


def test_one_request_is_one_complete_trace_in_the_collector(traced_stack):
    stack, collector = traced_stack
    ids = prompt(1)
    r = httpx.post(f"{stack.url}/v1/completions", timeout=60, json={
        "model": stack.served_model, "prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    request_id = r.headers["x-request-id"]
    spans = trace_of(collector, request_id,
                     lambda s: one_placement_complete(s) and "decode.admit" in names(s))
    check_whole_tree(spans)
    services = {s.service for s in spans}
    assert {"pdserve-gateway", "pdserve-coordinator", "pdserve-prefill-0"} <= services
    assert services & {"pdserve-decode-0", "pdserve-decode-1"}
    # placed in the coordinator's own process: no router on the request's way
    assert {s.service for s in spans if s.name == "router.route"} == {"pdserve-coordinator"}

    gateway = next(s for s in spans if s.name == "gateway.request")
    a = gateway.attributes
    assert a["gen_ai.request.model"] == a["gen_ai.response.model"] == stack.served_model
    assert a["gen_ai.operation.name"] == "text_completion"
    assert a["gen_ai.usage.input_tokens"] == len(ids) and a["gen_ai.usage.output_tokens"] == 8
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    assert a["gen_ai.response.id"] == r.json()["id"] and a["gen_ai.request.temperature"] == 0.0

    sends = [s for s in spans if s.name == "transfer.send"]
    checks = [s for s in spans if s.name == "transfer.verify_checksum"]
    assert {s.attributes["pdserve.layer"] for s in sends} == set(range(TINY_LAYERS))
    assert all(s.attributes["pdserve.bytes"] > 0 for s in sends)
    assert {s.attributes["pdserve.layer"] for s in checks} == set(range(TINY_LAYERS))
    assert all(s.attributes["pdserve.checksum_ok"] is True for s in checks)
    assert {s.service for s in checks} <= {"pdserve-decode-0", "pdserve-decode-1"}
    coordinator = next(s for s in spans if s.name == "coordinator.request")
    assert coordinator.attributes["pdserve.ttft_s"] > 0

    # `pdserve trace` reads the same storage.
    console = Console(record=True, width=220)
    args = argparse.Namespace(request_id=request_id, var_dir=None, otlp_file=collector.traces_file, width=40)
    assert trace_cli.run(args, console) == 0
    out = console.export_text()
    assert "transfer.send" in out and "prefill-0" in out and "TTFT" in out and spans[0].trace_id in out


def stream_and_kill_decode(stack: EnvStack, ids: list[int], max_tokens: int) -> tuple[str, int, str]:
    """Stream a completion; once 5 tokens came, kill -9 the decode worker serving it. Returns (request id,
    tokens received, killed worker) once the stream ended."""
    body = {"model": stack.served_model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    received, killed, finish = 0, "", None
    with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        request_id = r.headers["x-request-id"]
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            received += 1
            finish = choice.get("finish_reason") or finish
            if received == 5:
                events = httpx.get(f"{stack.url}/v1/requests/{request_id}", timeout=10).json()["events"]
                killed = next(e["payload"]["decode_worker_id"] for e in events
                              if e["type"] == "RequestRouted")
                stack.kill(killed)
    assert finish == "length", finish
    return request_id, received, killed


def test_a_migrated_request_is_one_trace_with_the_retry_linked(traced_stack):
    stack, collector = traced_stack
    request_id, received, killed = stream_and_kill_decode(stack, prompt(2), max_tokens=600)
    assert received >= 600  # every token arrived (one SSE chunk per token, possibly with empty text)

    def migrated_and_done(spans: list[SpanRecord]) -> bool:
        attempts = [s for s in spans if s.name == "coordinator.attempt"]
        return len(attempts) == 2 and sum(s.name == "decode.generate" for s in spans) >= 1 and any(
            s.name == "gateway.request" for s in spans)

    spans = trace_of(collector, request_id, migrated_and_done, timeout_s=60)
    check_whole_tree(spans)
    attempts = [s for s in spans if s.name == "coordinator.attempt"]
    first, second = sorted(attempts, key=lambda s: s.start_unix_ns)
    assert first.status_code == "ERROR" and first.attributes["pdserve.attempt"] == 0
    assert second.attributes["pdserve.attempt"] == 1
    assert [(link["span_id"], link["attributes"]["pdserve.link"]) for link in second.links] == [
        (first.span_id, "retry_of")]
    # The retry ran the whole placement again (route, prefill, transfer) and decoded on the other worker.
    by_id = {s.span_id: s for s in spans}

    def under(span: SpanRecord, ancestor: SpanRecord) -> bool:
        while span.parent_span_id:
            if span.parent_span_id == ancestor.span_id:
                return True
            span = by_id[span.parent_span_id]
        return False

    retried = [s for s in spans if under(s, second)]
    assert {"router.route", "prefill.forward", "transfer.send", "transfer.verify_checksum",
            "decode.generate"} <= names(retried)
    survivor = {s.service for s in retried if s.name == "decode.generate"}
    assert survivor and f"pdserve-{killed}" not in survivor
    gateway = next(s for s in spans if s.name == "gateway.request")
    assert gateway.attributes["gen_ai.usage.output_tokens"] == 600

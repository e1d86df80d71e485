"""Workers' Prometheus metrics through a whole stack (tiny model): what /metrics counts equals what the
event log records for the same requests — prefix cache queries and hits on both pools, KV bytes received,
one transfer observed per request — and the scheduler gauges are exported per worker."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.embedded import free_port
from tests.e2e.test_prefix_cache import complete, kv_bytes_per_token, lifecycle, prompt
from tests.faults.conftest import EnvStack

pytestmark = pytest.mark.stack

WORKERS = ("prefill-0", "decode-0")


@pytest.fixture(scope="module")
def metrics_stack(isolated_settings, tmp_path_factory) -> Iterator[EnvStack]:
    ports = {name: free_port() for name in WORKERS}
    stack = EnvStack(isolated_settings("metrics"), tmp_path_factory.mktemp("metrics-stack"), {},
                     {name: {"PDS_METRICS_PORT": str(port)} for name, port in ports.items()}, model="tiny")
    stack.metrics_ports = ports
    try:
        yield stack.start()
    finally:
        stack.stop()


def scrape(stack: EnvStack, worker: str) -> dict[str, float]:
    """Every sample of `worker`'s /metrics, by name (labels dropped: one worker per process)."""
    text = httpx.get(f"http://127.0.0.1:{stack.metrics_ports[worker]}/metrics", timeout=10).text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.labels.get("worker_id", worker) == worker}


def test_worker_metrics_equal_what_the_event_log_records(metrics_stack):
    before = {w: scrape(metrics_stack, w) for w in WORKERS}
    ids = prompt(7)
    events = [lifecycle(metrics_stack, complete(metrics_stack, ids)[0]) for _ in range(2)]  # 2nd: cache hits
    after = {w: scrape(metrics_stack, w) for w in WORKERS}

    def delta(worker: str, name: str) -> float:
        return after[worker][f"pdserve:{name}"] - before[worker].get(f"pdserve:{name}", 0.0)

    prompt_tokens = sum(e["PrefillStarted"]["num_prompt_tokens"] for e in events)
    assert delta("prefill-0", "prefix_cache_queries_total") == prompt_tokens == 2 * len(ids)
    assert delta("prefill-0", "prefix_cache_hits_total") == sum(
        e["PrefillCompleted"]["num_cached_tokens"] for e in events) > 0
    received = sum(e["TransferCompleted"]["kv_bytes"] for e in events)
    assert delta("decode-0", "kv_transfer_bytes_total") == received
    assert delta("decode-0", "kv_transfer_seconds_count") == 2
    # The decode worker's own prefix cache: every prompt token it did not have to receive was a hit.
    assert delta("decode-0", "prefix_cache_queries_total") == prompt_tokens
    assert delta("decode-0", "prefix_cache_hits_total") == prompt_tokens - received // kv_bytes_per_token(
        metrics_stack) > 0
    for w in WORKERS:
        assert after[w]["pdserve:num_requests_running"] >= 0
        assert 0.0 <= after[w]["pdserve:kv_cache_usage_perc"] <= 1.0

"""Must-show 1 of issue 18: a real Prometheus scrapes a running stack (tiny model, disaggregated), requests
go through it, and every panel query of the Grafana dashboards that docker-compose.yml provisions
(observability/grafana/dashboards/, read here from the same files) returns data — so no dashboard can
silently plot nothing. The queries traffic must move are also checked to have moved."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

import httpx
import pytest

from pdserve.embedded import free_port
from tests.e2e.prometheus import INSTALL_HINT, Prometheus, dashboard_queries, grafana_expr, prometheus_binary
from tests.e2e.test_prefix_cache import prompt
from tests.faults.conftest import EnvStack

pytestmark = [
    pytest.mark.stack,
    pytest.mark.skipif(prometheus_binary() is None, reason=f"no prometheus binary on PATH: {INSTALL_HINT}"),
]

RATE_INTERVAL = "10s"  # what Grafana's $__rate_interval is at a 1 s scrape interval, with room to spare
# Series that requests through the stack must have moved (a finite value > 0 somewhere in the window).
MOVED_BY_TRAFFIC = ("time_to_first_token", "ttft_phase_seconds_sum", "inter_token_latency",
                    "request_time_per_output_token", "kv_transfer_bytes", "kv_transfer_seconds",
                    "router_placements", "request_outcomes", "prefix_cache_hits", "generation_tokens")


@pytest.fixture(scope="module")
def observed_stack(isolated_settings, tmp_path_factory) -> Iterator[tuple[EnvStack, Prometheus]]:
    tmp = tmp_path_factory.mktemp("dashboards")
    settings = isolated_settings("dash")
    names = ("recorder", "coordinator", "prefill-0", "decode-0")
    ports = {name: free_port() for name in names}
    stack = EnvStack(settings, tmp / "stack", {},
                     {name: {"PDS_METRICS_PORT": str(port)} for name, port in ports.items()}, model="tiny")
    assert {s.name for s in stack.plan} == {*names, "gateway"}  # every process is scraped
    targets = {"pdserve": [f"127.0.0.1:{p}" for p in ports.values()],
               "pdserve-gateway": [f"127.0.0.1:{stack.port}"]}  # the gateway's app serves /metrics
    prom = Prometheus(tmp, targets)
    try:
        stack.start()
        prom.start()
        wait_all_scraped(prom, len(names) + 1)
        yield stack, prom
    finally:
        prom.stop()
        stack.stop()


def wait_all_scraped(prom: Prometheus, num_targets: int, timeout_s: float = 60.0) -> None:
    """Until Prometheus has scraped every target successfully, then two more intervals: traffic sent
    before a target's first scrape is in no rate (a counter's first sample has nothing to rise from), which
    on a loaded machine left whole panels empty."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        health = prom.targets_up()
        if len(health) == num_targets and set(health.values()) == {"up"}:
            time.sleep(2.0)
            return
        time.sleep(0.5)
    raise TimeoutError(f"prometheus did not scrape every target in {timeout_s} s: {prom.targets_up()}")


def send_traffic(stack: EnvStack) -> None:
    """Streamed and plain completions over a few seconds (so rates have several scrapes to span), each
    prompt twice (prefix cache hits)."""
    with httpx.Client(timeout=60) as client:
        for round_ in range(4):
            for seed in (round_, round_ + 100):
                body = {"model": stack.served_model, "prompt": prompt(seed), "max_tokens": 12,
                        "temperature": 0, "ignore_eos": True, "stream": seed % 2 == 0}
                for _ in range(2):
                    r = client.post(f"{stack.url}/v1/completions", json=body)
                    assert r.status_code == 200, r.text
            time.sleep(1.5)


def values(result: list[dict]) -> list[float]:
    return [float(v) for series in result for _, v in series["values"]]


def finite(result: list[dict]) -> list[float]:
    return [v for v in values(result) if math.isfinite(v)]


def test_every_dashboard_panel_has_data_on_a_real_prometheus(observed_stack):
    stack, prom = observed_stack
    queries = dashboard_queries()
    assert len({q.panel for q in queries}) >= 12, "the dashboards lost panels"
    start = time.time()
    send_traffic(stack)
    time.sleep(4.0)  # the recorder commits the last events; two more scrapes
    end = time.time()
    health = prom.targets_up()
    assert len(health) == 5 and set(health.values()) == {"up"}, health

    empty, unmoved = [], []
    for q in queries:
        expr = grafana_expr(q.expr, RATE_INTERVAL)
        got = finite(prom.query_range(expr, start, end))
        if not got:
            empty.append(f"{q.dashboard} / {q.panel} [{q.ref_id}]: {expr}")
        elif any(m in expr for m in MOVED_BY_TRAFFIC) and max(got) <= 0:
            unmoved.append(f"{q.dashboard} / {q.panel} [{q.ref_id}]: {expr}")
    assert not empty, "panels with no data:\n" + "\n".join(empty)
    assert not unmoved, "panels traffic should have moved, flat at 0:\n" + "\n".join(unmoved)
    # The check itself can fail: a misspelled metric has no data.
    assert not finite(prom.query_range("sum(rate(pdserve:no_such_metric_total[10s]))", start, end))

"""Prometheus metrics of every pdserve process (docs/architecture.md §8), in prometheus_client's default
registry.

Names follow vLLM's (vllm/v1/metrics/loggers.py) with the `pdserve:` prefix where the meaning is the same;
histogram buckets are vLLM's too, so dashboards written for vLLM read these. Counters are exposed with
prometheus_client's `_total` suffix (`pdserve:prefix_cache_hits_total`), as vLLM's are.

Labels: `worker_id` on what a worker measures about itself, `model` (served model name) on request
latencies measured at the edge. Use: `metrics.NUM_REQUESTS_RUNNING.labels(worker_id=wid).set(n)`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

# vLLM's buckets for TTFT, for TPOT/ITL, and for request latencies (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                  10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                             60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# One request's transfer spans from one block (SmolLM2-135M fp32: 30 layers x 24 KiB = 720 KiB, well under
# 1 ms in shared memory, docs/architecture.md §10) to a long prompt's hundreds of MiB (seconds over TCP).
TRANSFER_SECONDS_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                              5.0, 10.0)

WORKER = ("worker_id",)
MODEL = ("model",)

# ---------------------------------------------------------------- scheduler state (per worker)
NUM_REQUESTS_RUNNING = Gauge(
    "pdserve:num_requests_running", "Sequences in the worker's running batch.", WORKER)
NUM_REQUESTS_WAITING = Gauge(
    "pdserve:num_requests_waiting", "Sequences waiting to be scheduled on the worker.", WORKER)
KV_CACHE_USAGE_PERC = Gauge(
    "pdserve:kv_cache_usage_perc", "Fraction of KV cache blocks in use, 0 to 1 (as vLLM's).", WORKER)
PREFIX_CACHE_QUERIES = Counter(
    "pdserve:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", WORKER)
PREFIX_CACHE_HITS = Counter(
    "pdserve:prefix_cache_hits", "Prompt tokens found in the prefix cache, by the tier they came from: "
    "'pool' (the paged pool) or a tier below it ('offload', ...: engine/kv_tiers).", ("worker_id", "tier"))

# ---------------------------------------------------------------- request latencies (per model)
TIME_TO_FIRST_TOKEN_SECONDS = Histogram(
    "pdserve:time_to_first_token_seconds", "Time to first token (TTFT), seconds.", MODEL,
    buckets=TTFT_BUCKETS_S)
INTER_TOKEN_LATENCY_SECONDS = Histogram(
    "pdserve:inter_token_latency_seconds", "Time between consecutive output tokens (ITL), seconds.",
    MODEL, buckets=ITL_BUCKETS_S)
E2E_REQUEST_LATENCY_SECONDS = Histogram(
    "pdserve:e2e_request_latency_seconds", "End-to-end request latency (E2EL), seconds.", MODEL,
    buckets=REQUEST_LATENCY_BUCKETS_S)
TIME_PER_OUTPUT_TOKEN_SECONDS = Histogram(
    "pdserve:request_time_per_output_token_seconds",
    "Time per output token (TPOT) of each finished request: (last - first token) / (output tokens - 1).",
    MODEL, buckets=ITL_BUCKETS_S)

# ---------------------------------------------------------------- what only pdserve has
KV_TRANSFER_BYTES = Counter(
    "pdserve:kv_transfer_bytes", "KV cache bytes moved from prefill to decode, by receiving worker.", WORKER)
KV_TRANSFER_SECONDS = Histogram(
    "pdserve:kv_transfer_seconds", "Duration of one request's KV transfer, seconds, by receiving worker.",
    WORKER, buckets=TRANSFER_SECONDS_BUCKETS_S)
ROUTER_PLACEMENTS = Counter(
    "pdserve:router_placements",
    "Requests the router placed, by mode (disaggregated, local, colocated) and reason: 'policy' (the "
    "routing policy's choice), 'short_prompt' (conditional disaggregation: few uncached tokens on an idle "
    "decode worker) or 'no_prefill_worker' (no compatible prefill worker heard from within "
    "heartbeat_timeout_s: the decode worker prefills itself).", ("mode", "reason"))
CHECKSUM_FAILURES = Counter(
    "pdserve:checksum_failures",
    "KV transfers refused because a (layer, chunk) checksum did not match on arrival.", WORKER)
ADMISSION_DEFERRED = Counter(
    "pdserve:admission_deferred",
    "Requests told their decode worker is full (once per request, as the AdmissionDeferred event).", WORKER)
ADMISSION_QUEUE_LENGTH = Gauge(
    "pdserve:admission_queue_length",
    "Requests the coordinator accepted that hold no decode reservation yet (at most max_waiting_requests).")
ROUTER_PROMPT_TOKENS = Counter(
    "pdserve:router_prompt_tokens", "Prompt tokens the router placed, by the worker chosen to prefill.",
    WORKER)
ROUTER_CEILING_CACHED_TOKENS = Counter(
    "pdserve:router_ceiling_cached_tokens",
    "The perfect-router ceiling: of each placed prompt, the most cached tokens any candidate held, by the "
    "worker chosen to prefill (beside that worker's prefix_cache_hits / prefix_cache_queries).", WORKER)

# ---------------------------------------------------------------- from the event log (the recorder)
# Counted once, by the recorder, from the events it commits (pdserve.store.event_metrics): what the
# dashboards show is what the event log holds, whichever process emitted the event.
TTFT_PHASE_SECONDS = Histogram(
    "pdserve:ttft_phase_seconds",
    "Each completed request's TTFT by phase (queue, route, reserve, prefill, exposed_transfer, "
    "first_token), as the coordinator measured it (RequestCompleted.ttft).", ("phase",),
    buckets=TTFT_BUCKETS_S)
REQUEST_OUTCOMES = Counter(
    "pdserve:request_outcomes",
    "Lifecycle outcomes: completed (reason = finish reason), failed (reason = phase), aborted, migrated "
    "(reason = phase; a request may migrate more than once) and recovered (reason = recovery action).",
    ("outcome", "reason"))
EVENTS_RECORDER_LAG_SECONDS = Gauge(
    "pdserve:events_recorder_lag_seconds", "Age of the newest event the recorder has committed, seconds.")


def init_worker_series(worker_id: str, receives_kv: bool, tiers: tuple[str, ...] = ("pool",)) -> None:
    """Create a worker's labelled series at 0, so a dashboard shows "none yet" rather than nothing (a
    labelled series exists only once touched). `receives_kv`: a decode or unified worker; `tiers`: the
    prefix-cache tiers it hits from ("pool", then those below it)."""
    for family in (PREFIX_CACHE_QUERIES, NUM_REQUESTS_RUNNING, NUM_REQUESTS_WAITING, KV_CACHE_USAGE_PERC):
        family.labels(worker_id=worker_id)
    for tier in tiers:
        PREFIX_CACHE_HITS.labels(worker_id=worker_id, tier=tier)
    if receives_kv:
        for family in (CHECKSUM_FAILURES, KV_TRANSFER_BYTES, KV_TRANSFER_SECONDS):
            family.labels(worker_id=worker_id)


def init_router_series() -> None:
    """Every (mode, reason) the router can place with, at 0 (see `ROUTER_PLACEMENTS`)."""
    for mode, reason in (("disaggregated", "policy"), ("local", "short_prompt"),
                         ("local", "no_prefill_worker"), ("colocated", "policy")):
        ROUTER_PLACEMENTS.labels(mode=mode, reason=reason)


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base class's name)
        pass  # one line per scrape on stderr otherwise


def _text_format(app: Callable) -> Callable:
    """`app` answering in the Prometheus text format whatever the scraper accepts. Prometheus asks for
    OpenMetrics first, and prometheus_client's OpenMetrics output (0.26) writes the samples of
    `pdserve:x` as `pdserve_x`: every series would be stored under a name no dashboard queries (found by
    tests/e2e/test_dashboards.py). The text format keeps the names, as the gateway's /metrics does."""

    def text_only(environ: dict, start_response: Callable) -> object:
        return app({**environ, "HTTP_ACCEPT": "text/plain; version=0.0.4"}, start_response)

    return text_only


def start_metrics_server(port: int, addr: str = "0.0.0.0") -> int:
    """Serve the default registry at http://`addr`:`port`/metrics (text format) from a daemon thread and
    return the bound port (`port` 0 = a free one, for tests and several workers on one host). `addr`
    defaults to every interface so a Prometheus container can scrape it. Raises OSError if the port is
    taken."""
    httpd = make_server(addr, port, _text_format(make_wsgi_app()), ThreadingWSGIServer,
                        handler_class=_QuietHandler)
    threading.Thread(target=httpd.serve_forever, name="metrics", daemon=True).start()
    return int(httpd.server_port)

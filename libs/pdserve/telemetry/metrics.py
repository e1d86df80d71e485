"""Prometheus metrics of every pdserve process (docs/architecture.md §8), in prometheus_client's default
registry.

Names follow vLLM's (vllm/v1/metrics/loggers.py) with the `pdserve:` prefix where the meaning is the same;
histogram buckets are vLLM's too, so dashboards written for vLLM read these. Counters are exposed with
prometheus_client's `_total` suffix (`pdserve:prefix_cache_hits_total`), as vLLM's are.

Labels: `worker_id` on what a worker measures about itself, `model` (served model name) on request
latencies measured at the edge. Use: `metrics.NUM_REQUESTS_RUNNING.labels(worker_id=wid).set(n)`.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

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
    "pdserve:prefix_cache_hits", "Prompt tokens found in the prefix cache.", WORKER)

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
EVENTS_RECORDER_LAG_SECONDS = Gauge(
    "pdserve:events_recorder_lag_seconds", "Age of the newest event the recorder has committed, seconds.")


def start_metrics_server(port: int, addr: str = "0.0.0.0") -> int:
    """Serve the default registry at http://`addr`:`port`/metrics from a daemon thread and return the
    bound port (`port` 0 = a free one, for tests and several workers on one host). `addr` defaults to
    every interface so a Prometheus container can scrape it. Raises OSError if the port is taken."""
    server, _thread = start_http_server(port, addr=addr)
    return int(server.server_port)

"""The `gateway.request` span and the gateway's Prometheus metrics for one request.

The span is the root of the request's trace (docs/architecture.md §8); it is current while the gateway talks
to the bus,
so the coordinator's spans join it through the `traceparent` header. Attributes: OTel GenAI semantic
conventions (`gen_ai.operation.name`, `gen_ai.request.model` / `max_tokens` / `temperature` / `top_p` /
`top_k` / `seed`, `gen_ai.response.id` / `model` / `finish_reasons`, `gen_ai.usage.input_tokens` /
`output_tokens`) and `pdserve.request_id`.

Metrics (default registry, vLLM's names with the `pdserve:` prefix, vllm/v1/metrics/loggers.py):
`request_success_total{model,finished_reason}`, `prompt_tokens_total`, `generation_tokens_total`,
TTFT, ITL, TPOT and E2E latency as the client sees them, plus `pdserve:request_errors_total{model,status}`
and the `pdserve:gateway_requests_in_flight` gauge.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode
from prometheus_client import Counter, Gauge

from pdserve.engine.sampling_params import SamplingParams
from pdserve.telemetry.metrics import (
    E2E_REQUEST_LATENCY_SECONDS,
    INTER_TOKEN_LATENCY_SECONDS,
    TIME_PER_OUTPUT_TOKEN_SECONDS,
    TIME_TO_FIRST_TOKEN_SECONDS,
)

tracer = trace.get_tracer("pdserve.gateway")

REQUEST_SUCCESS = Counter("pdserve:request_success", "Requests finished, by finish reason.",
                          ("model", "finished_reason"))
REQUEST_ERRORS = Counter("pdserve:request_errors", "Requests answered with an HTTP error after admission "
                         "checks, by status (499 = client disconnected).", ("model", "status"))
PROMPT_TOKENS = Counter("pdserve:prompt_tokens", "Prompt tokens of submitted requests.", ("model",))
GENERATION_TOKENS = Counter("pdserve:generation_tokens", "Completion tokens returned.", ("model",))
REQUESTS_IN_FLIGHT = Gauge("pdserve:gateway_requests_in_flight", "Requests the gateway is serving now.",
                           ("model",))


class RequestObserver:
    """Opens the span at construction; `finish(...)` ends it and records the metrics, once."""

    def __init__(self, request_id: str, model: str, endpoint: str, num_prompt_tokens: int, max_tokens: int,
                 stream: bool, received_monotonic: float, sampling: SamplingParams | None = None) -> None:
        self.model = model
        self.start = received_monotonic
        chat = "chat" in endpoint
        attributes: dict[str, str | int | float | bool] = {
            "pdserve.request_id": request_id,
            "gen_ai.operation.name": "chat" if chat else "text_completion",
            "gen_ai.request.model": model,
            "gen_ai.request.max_tokens": max_tokens,
            "gen_ai.usage.input_tokens": num_prompt_tokens,
            "gen_ai.response.id": f"{'chatcmpl' if chat else 'cmpl'}-{request_id}",  # the body's `id`
            "gen_ai.response.model": model,
            "http.route": endpoint,
            "pdserve.stream": stream,
        }
        if sampling is not None:
            attributes |= {"gen_ai.request.temperature": sampling.temperature,
                           "gen_ai.request.top_p": sampling.top_p}
            if sampling.top_k > 0:
                attributes["gen_ai.request.top_k"] = sampling.top_k
            if sampling.seed is not None:
                attributes["gen_ai.request.seed"] = sampling.seed
        self.span = tracer.start_span("gateway.request", attributes=attributes)
        self._num_prompt_tokens = num_prompt_tokens
        self._finished = False
        REQUESTS_IN_FLIGHT.labels(model).inc()

    @contextmanager
    def current(self) -> Iterator[None]:
        """Make the span current (the bus injects it into outgoing messages)."""
        with trace.use_span(self.span, end_on_exit=False):
            yield

    def finish(self, *, num_output_tokens: int, first_token_monotonic: float | None,
               finish_reason: str | None, error_status: int | None = None, error: str | None = None,
               last_token_monotonic: float | None = None, inter_token_s: Sequence[float] = ()) -> None:
        """End the span and record the request's metrics: TTFT once a token came, and for a success E2E
        latency, each gap between tokens (ITL) and the request's TPOT."""
        if self._finished:
            return
        self._finished = True
        REQUESTS_IN_FLIGHT.labels(self.model).dec()
        self.span.set_attribute("gen_ai.usage.output_tokens", num_output_tokens)
        if error_status is None:
            self.span.set_attribute("gen_ai.response.finish_reasons", [str(finish_reason)])
            REQUEST_SUCCESS.labels(self.model, str(finish_reason)).inc()
            PROMPT_TOKENS.labels(self.model).inc(self._num_prompt_tokens)
            GENERATION_TOKENS.labels(self.model).inc(num_output_tokens)
            E2E_REQUEST_LATENCY_SECONDS.labels(self.model).observe(time.monotonic() - self.start)
            itl = INTER_TOKEN_LATENCY_SECONDS.labels(self.model)
            for gap in inter_token_s:
                itl.observe(gap)
            first, last = first_token_monotonic, last_token_monotonic
            if first is not None and last is not None and num_output_tokens > 1:
                TIME_PER_OUTPUT_TOKEN_SECONDS.labels(self.model).observe(
                    (last - first) / (num_output_tokens - 1))
        else:
            self.span.set_attribute("http.response.status_code", error_status)
            self.span.set_status(Status(StatusCode.ERROR, error))
            REQUEST_ERRORS.labels(self.model, str(error_status)).inc()
        if first_token_monotonic is not None:
            TIME_TO_FIRST_TOKEN_SECONDS.labels(self.model).observe(first_token_monotonic - self.start)
        self.span.end()

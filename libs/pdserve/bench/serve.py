"""One `pdserve bench serve` run: build the request set, send it, compute vLLM's metrics, join the event
log's TTFT breakdown."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field

from pdserve.bench.breakdown import fetch_breakdowns
from pdserve.bench.datasets import (
    SampleRequest,
    prefix_repetition_dataset,
    random_dataset,
    shared_prefix_dataset,
)
from pdserve.bench.metrics import calculate_metrics
from pdserve.bench.report import ServeReport
from pdserve.bench.runner import LoadSpec, run_load

log = logging.getLogger(__name__)


@dataclass
class ServeConfig:
    """Everything one run needs (the CLI flags of `pdserve bench serve`; defaults are vLLM's where it has
    one, smaller where this 2-core CPU machine needs it). Lengths are tokens, rates requests/s,
    SLOs milliseconds.

    `num_prompts`: requests for `random` and `prefix_repetition`; conversations for `shared_prefix`
    (each of `num_turns` turns). `database_url`: the stack's event store (SQLAlchemy asyncpg URL) for
    the TTFT breakdown, None to skip it.
    """

    base_url: str = "http://127.0.0.1:8000"
    dataset: str = "random"
    num_prompts: int = 40
    input_len: int = 128
    output_len: int = 32
    range_ratio: float = 0.0
    prefix_len: int = 0
    suffix_len: int = 128
    num_prefixes: int = 4
    num_turns: int = 3
    request_rate: float = float("inf")
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    percentiles: list[float] = field(default_factory=lambda: [50.0, 90.0, 99.0])
    goodput_slo_ms: dict[str, float] = field(default_factory=dict)
    ignore_eos: bool = True
    model: str | None = None
    database_url: str | None = None
    read_timeout_s: float = 3600.0

    def load(self) -> LoadSpec:
        return LoadSpec(self.request_rate, self.burstiness, self.max_concurrency, self.seed, self.ignore_eos,
                        self.read_timeout_s)


def build_samples(cfg: ServeConfig) -> list[SampleRequest]:
    """The request set `cfg` describes, reproducible from `cfg.seed`. Raises ValueError on an unknown
    dataset or the dataset's own parameter errors."""
    if cfg.dataset == "random":
        return random_dataset(cfg.num_prompts, cfg.input_len, cfg.output_len, cfg.range_ratio,
                              cfg.prefix_len, cfg.seed)
    if cfg.dataset == "prefix_repetition":
        return prefix_repetition_dataset(cfg.num_prompts, cfg.prefix_len, cfg.suffix_len, cfg.num_prefixes,
                                         cfg.output_len, cfg.seed)
    if cfg.dataset == "shared_prefix":
        return shared_prefix_dataset(cfg.num_prompts, cfg.num_turns, cfg.prefix_len, cfg.input_len,
                                     cfg.output_len, cfg.num_prefixes, cfg.seed)
    raise ValueError(f"unknown dataset {cfg.dataset!r}")


async def run_serve(cfg: ServeConfig, progress: bool = True) -> ServeReport:
    """Run the benchmark `cfg` describes and return its report (nothing written). A failing event-store
    read is logged and leaves the breakdown empty: the client-side metrics stand on their own."""
    samples = build_samples(cfg)
    result = await run_load(cfg.base_url, samples, cfg.load(), cfg.model, progress)
    metrics = calculate_metrics(result.records, result.duration_s, cfg.percentiles, cfg.goodput_slo_ms)
    breakdowns = {}
    ids = [r.request_id for r in result.records if r.request_id]
    if cfg.database_url and ids:
        try:
            breakdowns = await fetch_breakdowns(cfg.database_url, ids)
        except Exception as e:  # the breakdown is an extra; never lose a finished run over it
            log.warning("TTFT breakdown not joined: the event store could not be read: %s", e)
    config = {k: v for k, v in asdict(cfg).items() if k != "database_url"}
    config["num_requests"] = len(samples)
    return ServeReport(config=config, metrics=metrics, records=result.records, breakdowns=breakdowns)

"""The engine alone on a serving workload: the most a server around it could deliver, measured.

`engine_alone_tok_s` runs the requests a serving benchmark sends (`pdserve.bench.datasets`: prompts as
token ids, exactly `output_len` tokens each, greedy, EOS ignored) through one `LLMEngine` in this
process, at most `concurrency` in flight (a finished request's place goes to the next, as a closed-loop
client's does), and times the whole run. No HTTP, bus, coordinator, detokenizer or other process shares
the cores, so a server of the same engine on the same cores cannot pass it: `benchmarks/vs_vllm.py`
reports it per cell beside the roofline's ceiling, for what a target above it would need (a faster
engine, not a lighter server).
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq

from pdserve.bench.datasets import SampleRequest
from pdserve.config import WorkerSettings
from pdserve.engine.llm_engine import EngineConfig, LLMEngine
from pdserve.engine.model_family import EngineModel
from pdserve.engine.sequence import Sequence
from pdserve.messages import SamplingParams

# a worker's chunked-prefill budget unless told otherwise (PDS_MAX_NUM_BATCHED_TOKENS)
WORKER_MAX_NUM_BATCHED_TOKENS: int = WorkerSettings.model_fields["max_num_batched_tokens"].default


def run_closed_loop(engine: LLMEngine, requests: Seq[SampleRequest], concurrency: int, salt: str) -> int:
    """Every request of `requests` through `engine` to its `output_len` tokens, at most `concurrency` at
    once, in order. `salt` keeps this run's prompts from hitting an earlier run's cached blocks. Returns
    the output tokens produced."""
    pending = list(enumerate(requests))
    in_flight: set[str] = set()
    produced = 0
    while pending or in_flight:
        while pending and len(in_flight) < concurrency:
            i, req = pending.pop(0)
            sampling = SamplingParams(max_tokens=req.output_len, temperature=0, ignore_eos=True)
            engine.add_request(Sequence(f"{salt}-{i}", list(req.prompt), sampling, cache_salt=salt))
            in_flight.add(f"{salt}-{i}")
        for out in engine.step():
            produced += len(out.new_token_ids)
            if out.finish_reason is not None:
                in_flight.discard(out.seq.request_id)
    return produced


def engine_alone_tok_s(model: EngineModel, requests: Seq[SampleRequest], concurrency: int,
                       max_num_batched_tokens: int = WORKER_MAX_NUM_BATCHED_TOKENS,
                       num_blocks: int = 1024) -> float:
    """Output tokens/s of `requests` through a fresh engine on `model` (this thread's torch threads), at
    most `concurrency` in flight: the engine's `max_num_batched_tokens` (chunked-prefill budget) a
    worker's default (config.WorkerSettings), `num_blocks` KV blocks (SmolLM2 fp32: 720 KiB each; 1024
    hold 8 requests of 2,048 tokens), after an untimed warm-up of the first `concurrency` requests.
    Raises ValueError for no requests."""
    if not requests:
        raise ValueError("no requests")
    engine = LLMEngine(model, EngineConfig(num_blocks=num_blocks,
                                           max_num_batched_tokens=max_num_batched_tokens))
    run_closed_loop(engine, requests[:concurrency], concurrency, salt="warm-up")
    t0 = time.perf_counter()
    produced = run_closed_loop(engine, requests, concurrency, salt="timed")
    return produced / (time.perf_counter() - t0)

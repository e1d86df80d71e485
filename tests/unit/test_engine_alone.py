"""The engine-alone measurement under benchmarks/vs_vllm.py (pdserve.bench.engine_alone): every request runs
to exactly its output length, never more than the concurrency at once, and its greedy tokens are those of
the requests run one at a time."""

from __future__ import annotations

import pytest

from pdserve.bench.datasets import random_dataset
from pdserve.bench.engine_alone import engine_alone_tok_s, run_closed_loop
from pdserve.engine.llm_engine import EngineConfig, LLMEngine
from pdserve.engine.loader import build_model, load_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_model(load_model("tiny", tmp_path_factory.mktemp("weights")))


class Counting(LLMEngine):
    """An engine that remembers the most sequences it ever ran at once and the tokens each produced."""

    most_running = 0
    tokens: dict[str, list[int]]

    def step(self):
        outs = super().step()
        self.most_running = max(self.most_running, len(self.scheduler.running))
        for out in outs:
            self.tokens.setdefault(out.seq.request_id, []).extend(out.new_token_ids)
        return outs


def engine(model) -> Counting:
    e = Counting(model, EngineConfig(num_blocks=512, max_num_batched_tokens=256))
    e.tokens = {}
    return e


def test_closed_loop_runs_every_request_to_its_length_at_most_concurrency_at_once(model):
    requests = random_dataset(7, 40, 5, range_ratio=0.5, seed=3, token_range=(10, 200))
    batched, alone = engine(model), engine(model)
    assert run_closed_loop(batched, requests, concurrency=3, salt="a") == sum(r.output_len for r in requests)
    assert batched.most_running == 3
    for i, req in enumerate(requests):
        run_closed_loop(alone, [req], concurrency=1, salt=f"b{i}")
    assert [batched.tokens[f"a-{i}"] for i in range(7)] == [alone.tokens[f"b{i}-0"] for i in range(7)]
    assert [len(batched.tokens[f"a-{i}"]) for i in range(7)] == [r.output_len for r in requests]


def test_engine_alone_rate_is_positive_and_needs_requests(model):
    assert engine_alone_tok_s(model, random_dataset(4, 16, 3, seed=1, token_range=(10, 200)), 2) > 0
    with pytest.raises(ValueError):
        engine_alone_tok_s(model, [], 2)

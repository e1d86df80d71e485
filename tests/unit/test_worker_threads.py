"""A worker's torch threads: `pdserve up` shares the host's cores among its workers, and a worker runs
every engine step on one thread with that many torch threads while its other threads keep one
(engine/threads.py says why)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from pdserve.engine.llm_engine import EngineConfig, LLMEngine
from pdserve.engine.loader import load_model
from pdserve.engine.model import LlamaModel
from pdserve.engine.threads import one_thread
from pdserve.service_plan import service_plan, worker_threads
from pdserve.workers.engine_loop import EngineLoop


@pytest.mark.parametrize(
    ("plan", "cores", "threads"),
    [
        (service_plan("colocated", 0, 1), 2, 2),  # one unified worker owns the host
        (service_plan("colocated", 1, 1), 2, 1),
        (service_plan("disaggregated", 1, 1), 2, 1),
        (service_plan("disaggregated", 1, 1), 8, 4),
        (service_plan("disaggregated", 2, 2), 2, 1),  # never below one
    ],
)
def test_pdserve_up_shares_the_hosts_cores_among_its_workers(plan, cores: int, threads: int) -> None:
    assert worker_threads(plan, cores) == threads


def test_only_workers_are_given_a_thread_count(tmp_path) -> None:
    envs = {s.name: s.environment(nats_url="nats://x", database_url="postgresql://u@h/db", model="tiny",
                                  var_dir=tmp_path, gateway_port=8000, torch_threads=2)
            for s in service_plan("colocated", 0, 1)}
    assert {name: env["PDS_TORCH_THREADS"] for name, env in envs.items() if "PDS_TORCH_THREADS" in env} \
        == {"unified-0": "2"}


def test_one_thread_sets_only_the_calling_threads_count() -> None:
    def other() -> None:
        one_thread()
        seen.append(torch.get_num_threads())

    before, seen = torch.get_num_threads(), []
    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert seen == [1]
    assert torch.get_num_threads() == before


def test_every_step_call_runs_on_one_thread_with_the_workers_torch_threads(tmp_path) -> None:
    tiny = load_model("tiny", tmp_path)
    engine = LLMEngine(LlamaModel(tiny.config, tiny.weights), EngineConfig(num_blocks=8))

    async def probe() -> list[tuple[int, int]]:
        loop = EngineLoop(engine, asyncio.Lock(), bus=None, worker_id="w", commit_every_tokens=16,
                          after_step=asyncio.sleep, torch_threads=2)
        try:
            seen = [await loop.on_step_thread(lambda: (threading.get_ident(), torch.get_num_threads()))
                    for _ in range(3)]
        finally:
            loop.close()
        return seen

    before = torch.get_num_threads()
    seen = asyncio.run(probe())
    assert len({ident for ident, _ in seen}) == 1
    assert seen[0][0] != threading.get_ident()
    assert {n for _, n in seen} == {2}
    assert torch.get_num_threads() == before  # the caller's own count is left as it was

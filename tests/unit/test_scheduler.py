"""Scheduler: token budget and chunked prefill, decodes first, admission by free blocks, preemption of the
newest sequence by recompute, and clear refusal of what can never fit."""

from __future__ import annotations

import pytest

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.scheduler import CannotFit, Scheduler, SchedulerConfig
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.messages import SamplingParams

BS = 4


def make(num_blocks: int, budget: int, max_seqs: int = 8, max_len: int = 1000) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BS), SchedulerConfig(budget, max_seqs, max_len))


def request(name: str, n: int, max_tokens: int = 4) -> Sequence:
    return Sequence(
        name,
        list(range(1000 + 7 * len(name), 1000 + 7 * len(name) + n)),
        SamplingParams(max_tokens=max_tokens),
    )


def advance(sched: Scheduler) -> list[tuple[str, int]]:
    """One step as the engine does it, with a fixed next token: returns (request_id, tokens) scheduled."""
    out = sched.schedule()
    for seq, n in out.scheduled:
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == len(seq):
            seq.token_ids.append(7)
    return [(s.request_id, n) for s, n in out.scheduled]


def test_a_long_prompt_is_prefilled_in_chunks_of_the_budget():
    sched = make(32, budget=8)
    sched.add(request("a", 21))
    assert [advance(sched) for _ in range(4)] == [[("a", 8)], [("a", 8)], [("a", 5)], [("a", 1)]]


def test_decodes_are_scheduled_before_prefill_chunks_and_share_the_budget():
    sched = make(32, budget=6)
    sched.add(request("a", 3))
    assert advance(sched) == [("a", 3)]
    sched.add(request("bb", 20))
    assert advance(sched) == [("a", 1), ("bb", 5)]
    assert advance(sched) == [("a", 1), ("bb", 5)]


def test_waiting_requests_wait_for_blocks_and_for_a_sequence_slot():
    sched = make(4, budget=100, max_seqs=2)
    for name, n in (("a", 5), ("bb", 5), ("ccc", 2)):
        sched.add(request(name, n))
    assert advance(sched) == [("a", 5), ("bb", 5)]  # 2 blocks each: the pool is full, and so is max_seqs
    assert [s.request_id for s in sched.waiting] == ["ccc"]


def test_when_blocks_run_out_the_newest_running_sequence_is_preempted_and_recomputed_later():
    sched = make(4, budget=100)
    a, b = request("a", 4, max_tokens=8), request("bb", 4, max_tokens=8)
    sched.add(a)
    sched.add(b)
    assert advance(sched) == [("a", 4), ("bb", 4)]  # each: 4 prompt tokens, one block, + 1 sampled
    assert advance(sched) == [("a", 1), ("bb", 1)]  # second blocks
    for _ in range(3):
        advance(sched)
    # a needs a third block: none free; bb (newest) is preempted, its blocks freed, queued first
    out = sched.schedule()
    assert [s.request_id for s in out.preempted] == ["bb"] and [s.request_id for s, _ in out.scheduled] == [
        "a"
    ]
    assert b.status is SequenceStatus.WAITING and b.block_table == [] and b.num_computed_tokens == 0
    assert sched.waiting[0] is b and b.num_preemptions == 1


def test_a_request_that_can_never_fit_is_refused_with_the_reason():
    sched = make(4, budget=100, max_len=64)
    with pytest.raises(CannotFit, match="need 5 blocks of 4; the KV cache has 4"):
        sched.add(request("a", 15, max_tokens=2))
    with pytest.raises(CannotFit, match="exceed max_model_len 64"):
        make(100, budget=100, max_len=64).add(request("a", 60, max_tokens=5))
    sched.add(request("a", 14, max_tokens=2))  # exactly 16 tokens = 4 blocks fits

"""Arrival process and datasets of the load generator: vLLM's definitions, reproducible from a seed."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.bench.arrivals import arrival_times
from pdserve.bench.datasets import prefix_repetition_dataset, random_dataset, shared_prefix_dataset


def test_last_arrival_lands_at_n_over_rate_whatever_the_burstiness():
    for burstiness in (0.25, 1.0, 4.0):
        t = arrival_times(50, 5.0, burstiness, np.random.default_rng(1))
        assert t[-1] == pytest.approx(10.0)
        assert all(b >= a for a, b in zip(t, t[1:], strict=False))


def test_infinite_rate_sends_everything_at_once_and_infinite_burstiness_evenly():
    assert arrival_times(4, float("inf")) == [0.0] * 4
    assert arrival_times(4, 2.0, float("inf")) == pytest.approx([0.5, 1.0, 1.5, 2.0])


def test_lower_burstiness_gives_more_variable_gaps():
    def cv(burstiness: float) -> float:
        gaps = np.diff([0.0, *arrival_times(4000, 10.0, burstiness, np.random.default_rng(0))])
        return float(np.std(gaps) / np.mean(gaps))

    # Gamma(k): coefficient of variation 1/sqrt(k): 2 for k=0.25, 1 (Poisson) for k=1, 0.5 for k=4.
    assert cv(0.25) == pytest.approx(2.0, rel=0.1)
    assert cv(1.0) == pytest.approx(1.0, rel=0.1)
    assert cv(4.0) == pytest.approx(0.5, rel=0.1)


@pytest.mark.parametrize("kwargs", [dict(n=0, request_rate=1.0), dict(n=3, request_rate=0.0),
                                    dict(n=3, request_rate=1.0, burstiness=0.0)])
def test_invalid_arrival_parameters_are_refused(kwargs):
    with pytest.raises(ValueError):
        arrival_times(**kwargs)


def test_random_lengths_stay_in_the_range_ratio_window_and_repeat_with_the_seed():
    reqs = random_dataset(200, input_len=100, output_len=20, range_ratio=0.5, prefix_len=10, seed=3)
    assert {10 + 50 <= r.prompt_len <= 10 + 150 for r in reqs} == {True}
    assert {10 <= r.output_len <= 30 for r in reqs} == {True}
    assert len({r.prompt_len for r in reqs}) > 20
    assert len({tuple(r.prompt[:10]) for r in reqs}) == 1
    assert reqs == random_dataset(200, input_len=100, output_len=20, range_ratio=0.5, prefix_len=10, seed=3)
    assert reqs != random_dataset(200, input_len=100, output_len=20, range_ratio=0.5, prefix_len=10, seed=4)


def test_random_with_zero_range_ratio_has_exact_lengths():
    reqs = random_dataset(5, input_len=64, output_len=7)
    assert [(r.prompt_len, r.output_len) for r in reqs] == [(64, 7)] * 5
    with pytest.raises(ValueError):
        random_dataset(5, 64, 7, range_ratio=1.0)


def test_prefix_repetition_shares_each_prefix_among_its_group():
    reqs = prefix_repetition_dataset(12, prefix_len=16, suffix_len=8, num_prefixes=3, output_len=4, seed=0)
    assert len(reqs) == 12 and {r.prompt_len for r in reqs} == {24}
    groups: dict[tuple[int, ...], int] = {}
    for r in reqs:
        groups[tuple(r.prompt[:16])] = groups.get(tuple(r.prompt[:16]), 0) + 1
    assert sorted(groups.values()) == [4, 4, 4]
    with pytest.raises(ValueError):
        prefix_repetition_dataset(2, 16, 8, num_prefixes=3, output_len=4)


def test_shared_prefix_turns_extend_the_previous_turn_and_wait_for_it():
    reqs = shared_prefix_dataset(num_conversations=4, num_turns=3, system_prompt_len=32, question_len=8,
                                 output_len=5, num_prefixes=2)
    assert len(reqs) == 12
    by_conv: dict[int, list] = {}
    for i, r in enumerate(reqs):
        by_conv.setdefault(r.conversation, []).append((i, r))
    for turns in by_conv.values():
        assert [r.turn for _, r in turns] == [0, 1, 2]
        assert turns[0][1].after is None
        for (i_prev, prev), (_, nxt) in zip(turns, turns[1:], strict=False):
            assert nxt.after == i_prev
            assert nxt.prompt[:prev.prompt_len] == prev.prompt
            assert nxt.prompt_len == prev.prompt_len + 5 + 8  # stand-in answer + next question
    # conversations 0 and 2 share system prompt 0; 0 and 1 do not
    assert reqs[0].prompt[:32] == reqs[2].prompt[:32] != reqs[1].prompt[:32]

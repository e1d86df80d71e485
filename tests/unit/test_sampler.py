"""Sampling: greedy at temperature 0, seeded draws reproducible, top-k and top-p restrict the support the way
vLLM does, and draws follow the filtered distribution."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.sampler import Sampler, draw, sampling_probs, token_logprobs
from pdserve.messages import SamplingParams

# probabilities 0.5, 0.3, 0.15, 0.05 (as logits), token order scrambled so index != rank
PROBS = torch.tensor([0.15, 0.5, 0.05, 0.3])
LOGITS = PROBS.log()


def draws(params: SamplingParams, logits: torch.Tensor, n: int) -> list[int]:
    sampler = Sampler(params)
    return [sampler.sample(logits) for _ in range(n)]


def test_temperature_zero_is_argmax_whatever_the_seed() -> None:
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    for seed in (None, 1, 2):
        assert (
            draws(SamplingParams(temperature=0.0, seed=seed, top_k=5), logits, 3)
            == [int(logits.argmax())] * 3
        )


def test_same_seed_gives_the_same_tokens_and_another_seed_other_tokens() -> None:
    logits = torch.zeros(50_000)  # uniform: collisions between different seeds are negligible
    first = draws(SamplingParams(temperature=1.0, seed=42), logits, 20)
    assert first == draws(SamplingParams(temperature=1.0, seed=42), logits, 20)
    assert first != draws(SamplingParams(temperature=1.0, seed=43), logits, 20)
    assert len(set(first)) > 1  # the generator advances between draws


def test_unseeded_samplers_do_not_repeat_each_other() -> None:
    logits = torch.zeros(50_000)
    assert draws(SamplingParams(temperature=1.0), logits, 10) != draws(
        SamplingParams(temperature=1.0), logits, 10
    )


def test_temperature_scales_logits_before_softmax() -> None:
    logits = torch.tensor([2.0, 1.0, -1.0])
    torch.testing.assert_close(sampling_probs(logits, 2.0, -1, 1.0), torch.softmax(logits / 2.0, dim=-1))
    torch.testing.assert_close(sampling_probs(logits, 0.5, 0, 1.0), torch.softmax(logits / 0.5, dim=-1))


def test_top_k_keeps_only_the_k_most_likely_tokens_renormalized() -> None:
    probs = sampling_probs(LOGITS, 1.0, 2, 1.0)
    torch.testing.assert_close(probs, torch.tensor([0.0, 0.5, 0.0, 0.3]) / 0.8)
    assert set(draws(SamplingParams(temperature=1.0, top_k=2, seed=0), LOGITS, 300)) == {1, 3}


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    torch.testing.assert_close(sampling_probs(LOGITS, 1.0, -1, 0.45), torch.tensor([0.0, 1.0, 0.0, 0.0]))
    torch.testing.assert_close(sampling_probs(LOGITS, 1.0, -1, 0.6), torch.tensor([0.0, 0.5, 0.0, 0.3]) / 0.8)
    torch.testing.assert_close(
        sampling_probs(LOGITS, 1.0, -1, 0.9), torch.tensor([0.15, 0.5, 0.0, 0.3]) / 0.95
    )
    assert set(draws(SamplingParams(temperature=1.0, top_p=0.6, seed=0), LOGITS, 300)) == {1, 3}


def test_top_k_then_top_p_compose() -> None:
    # top-k 3 leaves 0.5, 0.3, 0.15 (renormalized 0.526, 0.316, 0.158); top-p 0.8 then drops the 0.158
    probs = sampling_probs(LOGITS, 1.0, 3, 0.8)
    torch.testing.assert_close(probs, torch.tensor([0.0, 0.5, 0.0, 0.3]) / 0.8)


def test_draw_frequencies_follow_the_distribution() -> None:
    counts = torch.bincount(
        torch.tensor(draws(SamplingParams(temperature=1.0, seed=7), LOGITS, 20_000)), minlength=4
    )
    torch.testing.assert_close(counts / 20_000, PROBS, atol=0.015, rtol=0)


def test_tokens_of_probability_zero_are_never_drawn() -> None:
    probs = torch.tensor([0.0, 0.25, 0.0, 0.75, 0.0])
    g = torch.Generator().manual_seed(5)
    assert set(draw(probs, g) for _ in range(2000)) == {1, 3}


def test_a_uniform_number_rounded_onto_the_total_draws_the_last_possible_token(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "rand", lambda *_, **__: torch.tensor(1.0, dtype=torch.float64))
    assert draw(torch.tensor([0.0, 0.25, 0.0, 0.75, 0.0]), torch.Generator()) == 3
    monkeypatch.setattr(torch, "rand", lambda *_, **__: torch.tensor(0.0, dtype=torch.float64))
    assert draw(torch.tensor([0.0, 0.25, 0.0, 0.75, 0.0]), torch.Generator()) == 1


def test_logprobs_are_the_raw_log_softmax_and_greedy_picks_the_top_one() -> None:
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    # temperature and top-p do not change the reported logprobs: they are the model's raw distribution
    sampler = Sampler(SamplingParams(temperature=0.0, top_p=0.5, logprobs=5))
    token = sampler.sample(logits)
    lp = sampler.logprobs(logits, token)
    reference = torch.log_softmax(logits.float(), dim=-1)
    assert lp is not None and lp.token_id == token == int(reference.argmax())
    assert abs(lp.logprob - float(reference[token])) < 1e-6
    ranked = torch.sort(reference, descending=True)
    assert [t for t, _ in lp.top] == ranked.indices[:5].tolist()
    assert torch.allclose(torch.tensor([v for _, v in lp.top]), ranked.values[:5])
    assert lp.logprob == max(v for _, v in lp.top)


def test_logprobs_of_a_sampled_token_are_reported_for_that_token() -> None:
    lp = token_logprobs(LOGITS, 2, 0)
    assert lp.token_id == 2 and abs(lp.logprob - float(PROBS.log()[2])) < 1e-6 and lp.top == ()


def test_no_logprobs_unless_asked() -> None:
    assert Sampler(SamplingParams(temperature=0.0)).logprobs(LOGITS, 1) is None

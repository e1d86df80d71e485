"""Stage 3's what-if (`advise/whatif.py`): the log's own requests simulated on the baseline's fleet and on
every split of it, with the control plane fitted to the log."""

from __future__ import annotations

import pytest

from pdserve.advise.evidence import RequestFacts
from pdserve.advise.whatif import GAIN, log_requests, simulate_split
from pdserve.hardware.links import link
from tests.unit.test_sim import hw

HW = hw(kv_tokens=64000)  # prefill step 10 ms + 1 ms/token; decode step 20 ms + 2 ms/sequence
SHAPE_LIMITS = {
    "max_num_seqs": 64,
    "max_num_batched_tokens": 512,
    "kv_capacity_tokens": 64000,
    "block_size": 16,
}
LINK = link("UCX shared memory (this machine)")


def facts(n: int, every_s: float, prompt: int, output: int, tpot_s: float) -> list[RequestFacts]:
    """`n` completed requests `every_s` apart; each TTFT 0.1 s above its prefill_s of 1 s, its TPOT
    `tpot_s`."""
    return [
        RequestFacts(
            f"r{i}",
            prompt_tokens=prompt,
            received_ts=1000.0 + i * every_s,
            completion_tokens=output,
            ttft_s=1.1,
            prefill_s=1.0,
            e2e_s=1.1 + (output - 1) * tpot_s,
        )
        for i in range(n)
    ]


def test_log_requests_replay_the_completed_ones_from_the_first_arrival():
    fs = facts(3, 0.5, 100, 10, 0.03) + [RequestFacts("failed", prompt_tokens=50, received_ts=999.0)]
    assert [(r.arrival_s, r.prompt_len, r.output_len) for r in log_requests(fs)] == [
        (0.0, 100, 10),
        (0.5, 100, 10),
        (1.0, 100, 10),
    ]


def test_prefill_heavy_traffic_loses_goodput_when_one_replica_must_prefill_it_all():
    """1,000-token prompts (~1 s of prefill) every 0.6 s: two unified replicas keep up, one prefill
    replica cannot (it would need 1.7 s of prefill per second)."""
    m = simulate_split(
        facts(20, 0.6, 1000, 10, 0.01), HW, LINK, 2, {"ttft": 3000.0, "tpot": 200.0}, SHAPE_LIMITS, "test"
    )
    assert m["split_goodput_colocated"].value > 0
    assert m[GAIN].value < 0.5
    assert "1 prefill + 1 decode" in m["split_goodput_best"].note
    assert "100 ms before the engine" in m["split_goodput_colocated"].note  # TTFT − queue − prefill
    assert "and 0.0 ms per emitted token" in m["split_goodput_colocated"].note  # the engine alone is slower


def test_a_tight_tpot_slo_under_prefill_chunks_is_won_by_the_split():
    """1,000-token prompts every 1 s, 50 tokens out, TPOT ≤ 30 ms: on a unified replica each prompt's
    512-token chunks stretch the steps of the sequences decoding beside them (TPOT ~43 ms); a decode pool
    steps at ~22 ms, and one prefill replica just keeps up."""
    m = simulate_split(
        facts(20, 1.0, 1000, 50, 0.01), HW, LINK, 2, {"ttft": 5000.0, "tpot": 30.0}, SHAPE_LIMITS, "test"
    )
    assert m[GAIN].value >= 5.0


def test_the_per_token_time_is_fitted_to_the_logs_tpot():
    m = simulate_split(
        facts(10, 2.0, 100, 40, 0.030), HW, LINK, 2, {"ttft": 3000.0, "tpot": 200.0}, SHAPE_LIMITS, "test"
    )
    # one sequence per replica: a 22 ms step + the fitted per-token time = the log's 30 ms
    assert "8.0 ms per emitted token" in m["split_goodput_colocated"].note


def test_a_fleet_of_one_or_an_empty_log_is_not_simulated():
    one = simulate_split(facts(3, 1.0, 100, 10, 0.03), HW, LINK, 1, {"ttft": 3000.0}, SHAPE_LIMITS, "t")
    assert one[GAIN].value is None and "cannot be split" in one[GAIN].note
    empty = simulate_split([], HW, LINK, 2, {"ttft": 3000.0}, SHAPE_LIMITS, "t")
    assert empty[GAIN].value is None and "no completed request" in empty[GAIN].note


@pytest.mark.parametrize("fleet", [3, 4])
def test_every_split_of_the_fleet_is_simulated(fleet):
    m = simulate_split(facts(6, 1.0, 100, 10, 0.03), HW, LINK, fleet, {"ttft": 3000.0}, SHAPE_LIMITS, "t")
    assert m[GAIN].note.count("P+") == fleet - 1

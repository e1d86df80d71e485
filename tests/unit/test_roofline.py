"""The serving ceiling's arithmetic (libs/pdserve/bench/roofline.py), on round numbers."""

from __future__ import annotations

import pytest
import torch

from pdserve.bench.roofline import DenseModelCost, Roofline, measure_roofline, serving_ceiling_s


def roof(flops: float, bandwidth: float) -> Roofline:
    return Roofline(flops, flops, flops, bandwidth, threads=1)


COST = DenseModelCost(num_params=100, head_params=10)  # body 90


def test_prefill_flops_pass_the_body_per_token_and_the_head_once():
    assert COST.body_params == 90
    assert COST.prefill_flop(3) == 2 * (3 * 90 + 10)


def test_a_compute_bound_workload_is_its_flops_at_the_gemm_peak():
    # 4 prompts of 3 tokens, 5 output tokens, 2 at once: 4 × (560 + 4 × 200) = 5440 FLOP; 2 waves × 4 steps
    # × 400 bytes = 3200 bytes
    assert serving_ceiling_s(roof(1e3, 1e6), COST, 4, 3, 5, 2) == pytest.approx(5.44)


def test_a_bandwidth_bound_workload_is_its_decode_steps_reading_every_weight():
    # the same workload at a fast GEMM: 8 steps of 400 bytes at 100 B/s
    assert serving_ceiling_s(roof(1e9, 100.0), COST, 4, 3, 5, 2) == pytest.approx(32.0)
    # one more prompt than the concurrency admits adds a wave of steps
    assert serving_ceiling_s(roof(1e9, 100.0), COST, 5, 3, 5, 2) == pytest.approx(48.0)


def test_the_measurement_runs_on_the_threads_asked_and_leaves_torch_as_it_was():
    before = torch.get_num_threads()
    r = measure_roofline(threads=1)
    assert r.threads == 1 and torch.get_num_threads() == before
    assert r.gemm_flops == max(r.gemm_flops_matmul, r.gemm_flops_onednn) > 0 and r.bandwidth_bytes_s > 0

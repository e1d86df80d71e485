"""The simulator (libs/pdserve/sim/) on hand-computable scenarios: known step costs → exact TTFT, TPOT,
transfer and admission times; the chunked-prefill budget; backpressure on decode KV; prefix caching with
pdserve's block hashes; its metrics against bench/metrics.py; the cost fit and the roofline scaling."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.bench.datasets import random_dataset
from pdserve.bench.metrics import RequestRecord, calculate_metrics
from pdserve.hardware.accelerators import ACCELERATORS, accelerator
from pdserve.sim.calibrate import fit_decode_token_s
from pdserve.sim.cluster import simulate
from pdserve.sim.config import ClusterConfig, LinkConfig, Overheads, PoolConfig, PoolRole
from pdserve.sim.cost import StepCost, attention_pairs
from pdserve.sim.fit import fit_cost
from pdserve.sim.model_shape import ModelShape, published_shape
from pdserve.sim.profile import DecodeSample, Efficiency, HardwareProfile, PrefillSample
from pdserve.sim.roofline import scaled_profile
from pdserve.sim.search import cheapest_split, max_rate
from pdserve.sim.workload import SimRequest, from_samples

EXACT = {"rel": 1e-12, "abs": 1e-12}
SHAPE = ModelShape(
    name="m",
    family="llama",
    num_layers=4,
    hidden_size=8,
    num_heads=1,
    head_dim=8,
    body_params=0,
    head_params=0,
    embedding_params=0,
    kv_bytes_per_token=1000,
)
# prefill step 10 ms + 1 ms/token; decode step 20 ms + 2 ms/sequence; no attention or context terms
COST = StepCost(
    prefill_fixed_s=0.010,
    prefill_token_s=0.001,
    prefill_pair_s=0.0,
    decode_fixed_s=0.020,
    decode_seq_s=0.002,
    decode_ctx_s=0.0,
)


def hw(kv_tokens: int = 16000, cost: StepCost = COST) -> HardwareProfile:
    return HardwareProfile(
        name="h", accelerator="test", dtype="fp32", model=SHAPE, cost=cost, kv_capacity_tokens=kv_tokens
    )


def colocated(replicas: int = 1, **pool) -> ClusterConfig:
    pool.setdefault("hardware", hw())
    return ClusterConfig(pools=[PoolConfig(role=PoolRole.UNIFIED, replicas=replicas, **pool)])


def disaggregated(layerwise: bool, prefill: int = 1, decode: int = 1, **pool) -> ClusterConfig:
    pool.setdefault("hardware", hw())
    link = LinkConfig(bandwidth_bytes_per_s=1e6, latency_s=0.001, layerwise=layerwise)
    return ClusterConfig(
        pools=[
            PoolConfig(role=PoolRole.PREFILL, replicas=prefill, **pool),
            PoolConfig(role=PoolRole.DECODE, replicas=decode, **pool),
        ],
        link=link,
    )


def test_one_colocated_request_has_the_step_costs_ttft_and_tpot():
    r = simulate(colocated(), [SimRequest(0.0, 100, 5)])
    assert r.ttft_s[0] == pytest.approx(0.010 + 100 * 0.001, **EXACT)  # one 100-token chunk
    assert r.tpot_s[0] == pytest.approx(0.020 + 0.002, **EXACT)  # every decode step has one sequence
    assert r.e2el_s[0] == pytest.approx(0.110 + 4 * 0.022, **EXACT)
    assert list(r.itl_s()) == pytest.approx([0.022] * 4, **EXACT)


def test_naive_transfer_starts_after_the_prefill_and_delays_decode_not_ttft():
    r = simulate(disaggregated(layerwise=False), [SimRequest(0.0, 100, 5)])
    transfer = 0.001 + 100 * 1000 / 1e6  # latency + KV bytes / bandwidth
    assert r.ttft_s[0] == pytest.approx(0.110, **EXACT)  # the prefill worker streams the first token
    assert r.kv_done_s[0] == pytest.approx(0.110 + transfer, **EXACT)
    assert r.e2el_s[0] == pytest.approx(0.110 + transfer + 4 * 0.022, **EXACT)
    assert r.tpot_s[0] == pytest.approx((transfer + 4 * 0.022) / 4, **EXACT)


def test_layerwise_transfer_overlaps_the_prefill():
    # the link (0.101 s) is slower than the prefill (0.110 s ≥ whole / layers): done at start + whole
    r = simulate(disaggregated(layerwise=True), [SimRequest(0.0, 100, 5)])
    assert r.kv_done_s[0] == pytest.approx(max(0.110 + 0.101 / 4, 0.0 + 0.101), **EXACT)
    assert r.kv_done_s[0] == pytest.approx(0.13525, **EXACT)


def test_first_token_from_decode_puts_the_transfer_and_decode_start_in_ttft():
    cfg = disaggregated(layerwise=False).model_copy(
        update={"first_token_from": "decode", "overheads": Overheads(decode_start_s=0.005)}
    )
    r = simulate(cfg, [SimRequest(0.0, 100, 5)])
    assert r.ttft_s[0] == pytest.approx(0.110 + 0.101 + 0.005, **EXACT)
    assert r.ttft_breakdown_s()["exposed_transfer"] == pytest.approx(0.106, **EXACT)


def test_chunked_prefill_splits_a_prompt_at_the_token_budget():
    r = simulate(colocated(max_num_batched_tokens=512), [SimRequest(0.0, 1000, 1)])
    assert r.ttft_s[0] == pytest.approx((0.010 + 512 * 0.001) + (0.010 + 488 * 0.001), **EXACT)


def test_a_prefill_chunk_shares_the_step_with_decodes_under_the_budget():
    # request 0 decodes in 22 ms steps from t=0.110; request 1 (512 tokens) arrives mid-step, at 0.120: its
    # first step (from 0.132) holds 1 decode and 511 prefill tokens, its second 1 decode and 1 prefill token
    r = simulate(colocated(max_num_batched_tokens=512), [SimRequest(0.0, 100, 10), SimRequest(0.120, 512, 2)])
    step1 = 0.020 + 0.002 + 511 * 0.001
    step2 = 0.020 + 0.002 + 1 * 0.001
    assert r.first_token_s[1] == pytest.approx(0.132 + step1 + step2, **EXACT)


def test_a_colocated_request_is_reserved_and_queued_mid_step_and_prefills_in_the_next():
    # request 0 decodes in 22 ms steps from t=0.020 (ends 0.042, 0.064, 0.086, ...). Request 1 comes at
    # 0.050: its reservation and its prefill are taken while the step computes, and the next step (0.064)
    # holds its 10 tokens beside the decode. Its start arrives while the step after its first token runs,
    # so it decodes from the one after that.
    r = simulate(colocated(), [SimRequest(0.0, 10, 100), SimRequest(0.050, 10, 2)])
    assert r.admit_s[1] == pytest.approx(0.050, **EXACT)
    assert r.prefill_start_s[1] == pytest.approx(0.064, **EXACT)
    assert r.first_token_s[1] == pytest.approx(0.064 + 0.022 + 0.010, **EXACT)
    assert r.finish_s[1] == pytest.approx(0.096 + 0.022 + 0.024, **EXACT)


def test_decode_token_overhead_grows_each_step_with_its_batch():
    cfg = colocated().model_copy(update={"overheads": Overheads(decode_token_s=0.003)})
    r = simulate(cfg, [SimRequest(0.0, 100, 5)])
    assert r.ttft_s[0] == pytest.approx(0.010 + 100 * 0.001, **EXACT)  # a prefill step decodes nothing
    assert r.tpot_s[0] == pytest.approx(0.020 + 0.002 + 0.003, **EXACT)


def test_max_num_seqs_holds_the_second_prefill_until_the_first_finishes():
    # request 0 decodes from 0.020; request 1 comes at 0.030, and its one slot is taken until 0.064
    r = simulate(
        colocated(max_num_seqs=1, max_num_batched_tokens=512),
        [SimRequest(0.0, 10, 3), SimRequest(0.030, 10, 1)],
    )
    first_done = 0.020 + 2 * 0.022
    assert r.finish_s[0] == pytest.approx(first_done, **EXACT)
    assert r.prefill_start_s[1] == pytest.approx(first_done, **EXACT)
    assert r.first_token_s[1] == pytest.approx(first_done + 0.020, **EXACT)


def test_decode_kv_backpressure_admits_the_second_request_when_the_first_releases():
    # 10 blocks of 16 tokens: one request of 100 + 60 tokens holds all 10
    cfg = disaggregated(layerwise=False, hardware=hw(kv_tokens=160))
    r = simulate(cfg, [SimRequest(0.0, 100, 60), SimRequest(0.0, 100, 60)])
    assert r.admit_s[0] == 0.0
    assert r.admit_s[1] == pytest.approx(r.finish_s[0], **EXACT)
    assert r.ttft_breakdown_s()["admission"] == pytest.approx(r.finish_s[0] / 2, **EXACT)


def test_a_request_larger_than_the_decode_kv_is_rejected_not_hung():
    r = simulate(colocated(hardware=hw(kv_tokens=64)), [SimRequest(0.0, 100, 5), SimRequest(0.0, 10, 2)])
    assert r.rejected == [0]
    assert list(r.done) == [False, True]


def test_prefix_cache_hits_the_repeated_prompt_by_block_hash():
    samples = random_dataset(1, 100, 2, seed=3) * 2
    reqs = from_samples(samples, [0.0, 10.0], block_size=16)
    r = simulate(colocated(), reqs)
    assert list(r.cached_tokens) == [0, 96]  # (100 - 1) // 16 = 6 full blocks; the last token recomputed
    assert r.ttft_s[1] == pytest.approx(0.010 + 4 * 0.001, **EXACT)


def test_kv_policy_sends_the_repeat_to_the_replica_holding_its_prefix():
    samples = random_dataset(2, 100, 2, seed=3)
    reqs = from_samples([samples[0], samples[1], samples[0]], [0.0, 0.0, 10.0], block_size=16)
    r = simulate(colocated(replicas=2), reqs)
    assert r.cached_tokens[2] == 96


def test_metrics_match_bench_metrics_on_the_same_times():
    reqs = [SimRequest(0.0, 50, 6), SimRequest(0.01, 80, 4), SimRequest(0.05, 20, 9)]
    r = simulate(colocated(), reqs)
    records = []
    for i, q in enumerate(reqs):
        records.append(
            RequestRecord(
                index=i,
                prompt_len=q.prompt_len,
                expected_output_len=q.output_len,
                start_s=q.arrival_s,
                success=True,
                output_tokens=q.output_len,
            )
        )
    times = [r.token_times_s(i) for i in range(len(reqs))]
    assert times[0][-1] == pytest.approx(r.finish_s[0], **EXACT)
    for rec, ts in zip(records, times, strict=True):
        rec.chunk_times_s = ts
    slo = {"ttft": 150.0, "tpot": 30.0}
    want = calculate_metrics(records, max(t[-1] for t in times), goodput_slo_ms=slo)
    got = r.metrics(slo)
    for key in ("ttft", "tpot", "itl", "e2el"):
        assert got.latency[key].median_ms == pytest.approx(want.latency[key].median_ms, **EXACT)
        assert got.latency[key].p(99) == pytest.approx(want.latency[key].p(99), **EXACT)
        assert got.latency[key].count == want.latency[key].count
    assert got.request_goodput == pytest.approx(want.request_goodput, **EXACT)


def test_fit_recovers_known_coefficients():
    truth = StepCost(
        prefill_fixed_s=0.01,
        prefill_token_s=0.002,
        prefill_pair_s=1e-7,
        decode_fixed_s=0.03,
        decode_seq_s=0.001,
        decode_ctx_s=2e-6,
    )
    prefill = []
    for n, chunk in ((16, 512), (128, 512), (512, 512), (512, 128), (300, 64)):
        steps, start, s = 0, 0, 0.0
        while start < n:
            k = min(chunk, n - start)
            s += truth.step_s(k, attention_pairs(start, k), 0, 0)
            start += k
            steps += 1
        prefill.append(PrefillSample(prompt_tokens=n, chunk_tokens=chunk, seconds=s))
    decode = [
        DecodeSample(batch=b, context=c, seconds=truth.decode_step_s(b, c))
        for b in (1, 4, 16)
        for c in (32, 512)
    ]
    fit = fit_cost(prefill, decode)
    for field, value in truth.model_dump().items():
        assert getattr(fit.cost, field) == pytest.approx(value, rel=1e-6)
    assert fit.prefill.max_abs_rel < 1e-9 and fit.decode.max_abs_rel < 1e-9


def test_roofline_scales_the_published_peaks_by_the_measured_efficiency():
    h100 = accelerator("H100")
    model = published_shape("llama-3-8b")
    prof = scaled_profile(h100, model, Efficiency(compute=0.5, memory=0.8), dtype="bf16")
    w = model.at_dtype(2).weight_bytes
    assert prof.cost.decode_fixed_s == pytest.approx(w / (3.35e12 * 0.8), **EXACT)
    assert prof.cost.prefill_token_s == pytest.approx(model.flops_per_token / (989.5e12 * 0.5), **EXACT)
    assert prof.cost.decode_ctx_s == pytest.approx(32 * 2 * 8 * 128 * 2 / (3.35e12 * 0.8), **EXACT)
    assert prof.sources["peak bf16 FLOP/s"] == h100.source
    with pytest.raises(ValueError, match="does not fit"):
        scaled_profile(accelerator("l40s"), published_shape("llama-3-70b"), Efficiency(compute=1, memory=1))
    with pytest.raises(KeyError, match="no published fp8"):
        scaled_profile(accelerator("a100"), model, Efficiency(compute=1, memory=1), dtype="fp8")


def test_every_accelerator_cites_its_datasheet():
    for acc in ACCELERATORS.values():
        assert acc.source.startswith("https://") and acc.memory_bytes_per_s > 0 and acc.flops["bf16"] > 0
    with pytest.raises(KeyError, match="known"):
        accelerator("tpu-v9")


def test_goodput_search_finds_the_rate_where_attainment_drops():
    cfg = colocated()

    def workload(rate: float) -> list[SimRequest]:
        return [SimRequest(i / rate, 100, 5) for i in range(40)]

    # one request costs 0.11 s prefill + 4 × ≥ 0.022 s decode: a 0.2 s TTFT SLO holds well below 10 req/s
    found = max_rate(cfg, workload, {"ttft": 200.0}, attainment=0.9, hi=64.0)
    assert 1.0 < found.goodput_rate < 20.0
    assert all((p.attainment >= 0.9) == (p.rate <= found.goodput_rate) for p in found.probes)


def test_cheapest_split_is_the_fewest_replicas_that_hold_the_rate():
    reqs = [SimRequest(i * 0.05, 100, 20) for i in range(60)]
    best, tried = cheapest_split(lambda p, d: colocated(replicas=p), reqs, {"ttft": 300.0}, 0.9, 6, False)
    assert best is not None
    assert all(s.attainment < 0.9 for s in tried[:-1]) and tried[-1] == best


def test_weighted_itl_distribution_is_the_expanded_one():
    import numpy as np

    from pdserve.bench.metrics import distribution
    from pdserve.sim.results import weighted_distribution

    rng = np.random.default_rng(0)
    values, weights = rng.random(50) / 10, rng.integers(0, 7, 50)
    want = distribution(list(np.repeat(values, weights)), (50.0, 90.0, 99.0))
    got = weighted_distribution(values, weights, (50.0, 90.0, 99.0))
    assert got.count == want.count
    for a, b in ((got.mean_ms, want.mean_ms), (got.median_ms, want.median_ms), (got.std_ms, want.std_ms)):
        assert a == pytest.approx(b, rel=1e-12)
    for q in (50.0, 90.0, 99.0):
        assert got.p(q) == pytest.approx(want.p(q), rel=1e-12)


def test_reserve_is_taken_while_the_decode_workers_step_computes():
    # request 0 decodes on the decode replica from its join; request 1 arrives mid-step: its reservation
    # is made at once (a worker takes commands during a forward), so its prefill starts on arrival
    cfg = disaggregated(layerwise=False)
    r = simulate(cfg, [SimRequest(0.0, 100, 50), SimRequest(0.25, 10, 2)])
    assert r.admit_s[1] == pytest.approx(0.25, **EXACT)
    assert r.first_token_s[1] == pytest.approx(0.25 + 0.010 + 10 * 0.001, **EXACT)


def test_decode_token_fit_finds_where_the_simulated_tpot_meets_the_measured():
    # a simulated TPOT of 22 ms + 1 × the per-token time (one sequence per step): 30 ms needs 8 ms
    assert fit_decode_token_s(lambda x: 0.022 + x, 0.030) == pytest.approx(0.008, abs=1e-4)
    assert fit_decode_token_s(lambda x: 0.022 + x, 0.020) == 0.0  # the engine alone is already slower
    assert fit_decode_token_s(lambda x: 0.022 + x, 0.5) == pytest.approx(0.05, abs=1e-4)  # capped at 50 ms
    with pytest.raises(ValueError, match="positive"):
        fit_decode_token_s(lambda x: x, 0.0)


def test_fitted_decode_token_time_reproduces_a_batchs_tpot():
    """Four sequences decoding together (they arrive during a one-token request's step, so they prefill in
    one step): each step 20 + 4 × 2 ms of engine + 4 × the per-token time."""
    reqs = [SimRequest(0.0, 1, 1)] + [SimRequest(0.001, 10, 50)] * 4

    def tpot(x: float) -> float:
        cfg = colocated().model_copy(update={"overheads": Overheads(decode_token_s=x)})
        return float(np.median(simulate(cfg, reqs).tpot_s))

    x = fit_decode_token_s(tpot, 0.040)
    assert x == pytest.approx(0.003, abs=1e-4) and tpot(x) == pytest.approx(0.040, abs=4e-4)


def test_a_decode_step_that_starts_beside_a_prefill_step_is_slowed_by_the_interference():
    # request 0 decodes on the decode replica from its join (naive transfer: 0.110 + 0.101); request 1's
    # 200-token prefill (0.010 + 0.200 s, one output token) runs from 0.5 on the prefill replica: a decode
    # step that starts within it takes 1.5 x 22 ms, the others 22 ms
    cfg = disaggregated(layerwise=False)
    cfg = cfg.model_copy(update={"overheads": Overheads(prefill_interference=0.5)})
    r = simulate(cfg, [SimRequest(0.0, 100, 60), SimRequest(0.5, 200, 1)])
    ends = r.step_ends_s["decode-0"]
    gaps = np.diff(ends)
    starts = ends[:-1]
    beside = (starts >= 0.5) & (starts < 0.5 + 0.210)
    assert beside.any() and (~beside).any()
    assert gaps[beside] == pytest.approx(0.033, **EXACT)
    assert gaps[~beside & (starts > ends[0])] == pytest.approx(0.022, **EXACT)
    plain = simulate(disaggregated(layerwise=False), [SimRequest(0.0, 100, 60), SimRequest(0.5, 200, 1)])
    assert r.finish_s[0] > plain.finish_s[0] and r.ttft_s[1] == pytest.approx(plain.ttft_s[1], **EXACT)

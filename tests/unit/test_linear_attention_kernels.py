"""The hybrid model's kernels on their own: the chunked gated delta rule equals its one-token recurrence for
any split and chunk size (and HF's reference functions), the short conv carries its state exactly, MLA's
weight-absorbed decode equals its expanded prefill form, and the MoE router matches HF's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels.gated_delta_rule import gated_delta_rule_chunked, gated_delta_rule_step, l2_normalize
from pdserve.kernels.mla import MLAWeights, mla_attention, split_up_proj, store_latent
from pdserve.kernels.moe import route_topk
from pdserve.kernels.paged_attention import attention_metadata
from pdserve.kernels.short_conv import causal_conv, causal_conv_step

T, H, DK, DV = 150, 3, 16, 8
ATOL = 1e-5


@pytest.fixture(scope="module")
def inputs():
    g = torch.Generator().manual_seed(3)
    q = l2_normalize(torch.randn(T, H, DK, generator=g))
    k = l2_normalize(torch.randn(T, H, DK, generator=g))
    v = torch.randn(T, H, DV, generator=g)
    decay = -torch.rand(T, H, DK, generator=g) * 0.5
    beta = torch.rand(T, H, generator=g)
    return q, k, v, decay, beta


def recurrent(inputs, num_tokens: int = T) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v, decay, beta = inputs
    state = torch.zeros(1, H, DK, DV)
    outs = [gated_delta_rule_step(q[t : t + 1], k[t : t + 1], v[t : t + 1], decay[t : t + 1], beta[t : t + 1],
                                  state, DK**-0.5) for t in range(num_tokens)]
    return torch.cat(outs), state[0]


@pytest.mark.parametrize("splits, chunk_size", [((T,), 64), ((1, 63, 64, 22), 64), ((70, 80), 16), ((T,), 7)])
def test_chunked_delta_rule_equals_the_recurrence_for_any_split(inputs, splits, chunk_size):
    ref_out, ref_state = recurrent(inputs)
    state = torch.zeros(H, DK, DV)
    outs, start = [], 0
    for n in splits:
        part = [t[start : start + n] for t in inputs]
        outs.append(gated_delta_rule_chunked(*part, state, DK**-0.5, chunk_size=chunk_size))
        start += n
    torch.testing.assert_close(torch.cat(outs), ref_out, atol=ATOL, rtol=0)
    torch.testing.assert_close(state, ref_state, atol=ATOL, rtol=0)
    assert ref_state.abs().max() > 0.1  # the state carries something


def test_delta_rule_matches_hfs_reference_kda(inputs):
    kimi = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    q, k, v, decay, beta = inputs
    hf_out, hf_state = kimi.chunk_kimi_delta_attention(
        q[None], k[None], v[None], decay[None], beta[None], initial_state=None, output_final_state=True,
        use_qk_l2norm_in_kernel=False,
    )
    state = torch.zeros(H, DK, DV)
    out = gated_delta_rule_chunked(q, k, v, decay, beta, state, DK**-0.5)
    torch.testing.assert_close(out, hf_out[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(state, hf_state[0], atol=ATOL, rtol=0)


def test_short_conv_carries_its_state_across_chunks_and_steps():
    g = torch.Generator().manual_seed(5)
    x, weight = torch.randn(40, 12, generator=g), torch.randn(12, 4, generator=g)
    ref = F.silu(F.conv1d(x.t()[None], weight[:, None], padding=3, groups=12)[0, :, :40]).t()
    state = torch.zeros(3, 12)
    out = torch.cat([causal_conv(x[:2], weight, state), causal_conv(x[2:30], weight, state)])
    steps = torch.stack([state] * 2)  # two sequences decoding from the same state
    tail = [causal_conv_step(torch.stack([x[t]] * 2), weight, steps)[0] for t in range(30, 40)]
    torch.testing.assert_close(torch.cat([out, torch.stack(tail)]), ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(steps[1], x[-3:])  # the state is the last K - 1 inputs


def test_mla_absorbed_decode_equals_the_expanded_prefill():
    g = torch.Generator().manual_seed(9)
    heads, nope, rope, v_dim, rank, bs = 4, 8, 4, 6, 10, 4
    kv_b = torch.randn(heads * (nope + v_dim), rank, generator=g)
    w_uk, w_uv = split_up_proj(kv_b, heads, nope)
    weights = MLAWeights(lambda c: c @ kv_b.t(), w_uk, w_uv)
    pool = torch.zeros(6, bs, rank + rope)
    n = 11
    table = [5, 0, 3]
    slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(n)])
    store_latent(pool, slots, torch.randn(n, rank + rope, generator=g))
    q = torch.randn(n, heads, nope + rope, generator=g)
    tables = torch.tensor([table])
    prefill = mla_attention(q, pool, attention_metadata(tables, [n], [n], bs), weights, nope, 0.3)
    # the last query alone, as a decode step (absorbed), and as the tail of a 2-token chunk (expanded)
    decode = mla_attention(q[-1:], pool, attention_metadata(tables, [n], [1], bs), weights, nope, 0.3)
    torch.testing.assert_close(decode, prefill[-1:], atol=ATOL, rtol=0)
    chunk = mla_attention(q[-2:], pool, attention_metadata(tables, [n], [2], bs), weights, nope, 0.3)
    torch.testing.assert_close(chunk, prefill[-2:], atol=ATOL, rtol=0)


def test_router_picks_hfs_experts_with_hfs_weights():
    kimi = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    transformers = pytest.importorskip("transformers")
    config = transformers.KimiLinearConfig(hidden_size=16, num_local_experts=8, num_experts_per_tok=3,
                                           n_group=4, topk_group=2, pad_token_id=None)
    router = kimi.KimiLinearTopkRouter(config)
    g = torch.Generator().manual_seed(2)
    router.weight.data = torch.randn(8, 16, generator=g)
    router.e_score_correction_bias.data = torch.randn(8, generator=g) * 0.1
    x = torch.randn(20, 16, generator=g)
    _, hf_weights, hf_experts = router(x)
    weights, experts = route_topk(x @ router.weight.t(), router.e_score_correction_bias, 3, 4, 2, True,
                                  config.routed_scaling_factor)
    order, hf_order = experts.argsort(-1), hf_experts.argsort(-1)
    assert torch.equal(experts.gather(1, order), hf_experts.gather(1, hf_order))
    torch.testing.assert_close(weights.gather(1, order), hf_weights.gather(1, hf_order))

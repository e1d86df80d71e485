"""The C pointwise kernels (kernels/csrc/rms_norm.c, rope.c, silu_and_mul.c) against HF transformers' Llama
modules and torch's formulas, on one and two threads, including strided rows and tails under 16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm, rotate_half

from pdserve.kernels import activation, rms_norm, rope

THREADS = (1, 2)


@pytest.fixture(params=THREADS, ids=lambda t: f"{t}-threads")
def threads(request):
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(1)


@pytest.mark.parametrize("module", [rms_norm, rope, activation], ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_kernel_builds(module):
    # a machine with a C compiler (every one pdserve's README sets up) must build it; else the torch path runs
    assert module.native_kernel() is not None


@pytest.mark.parametrize("rows,dim", [(1, 576), (8, 576), (128, 576), (3, 40)])
@pytest.mark.parametrize("strided", [False, True])
def test_rms_norm_matches_hf(threads, rows, dim, strided):
    g = torch.Generator().manual_seed(rows * dim)
    wide = torch.randn(rows, dim + 24, generator=g) * 3
    x = wide[:, 5 : 5 + dim] if strided else wide[:, :dim].contiguous()
    hf = LlamaRMSNorm(dim, eps=1e-5)
    hf.weight.data = torch.randn(dim, generator=g)
    out = rms_norm.rms_norm(x, hf.weight.data, 1e-5)
    assert out.is_contiguous() and out.shape == x.shape
    torch.testing.assert_close(out, hf(x).detach(), rtol=1e-5, atol=1e-5)


def test_rms_norm_takes_any_leading_shape():
    g = torch.Generator().manual_seed(0)
    x, weight = torch.randn(2, 3, 64, generator=g), torch.randn(64, generator=g)
    expected = torch.stack([rms_norm.rms_norm(x[i], weight, 1e-6) for i in range(2)])
    torch.testing.assert_close(rms_norm.rms_norm(x, weight, 1e-6), expected, rtol=0, atol=0)


@pytest.mark.parametrize("tokens,heads,head_dim", [(1, 12, 64), (128, 12, 64), (5, 3, 6)])
def test_rope_matches_hf(threads, tokens, heads, head_dim):
    """x a slice of a fused QKV row (rows strided) as the model passes it; cos, sin at random positions."""
    g = torch.Generator().manual_seed(tokens * heads)
    qkv = torch.randn(tokens, heads + 4, head_dim, generator=g)
    x = qkv[:, :heads]
    cos_table, sin_table = rope.rope_cos_sin(4096, head_dim, 10000.0)
    positions = torch.randint(0, 4096, (tokens,), generator=g)
    cos, sin = cos_table[positions], sin_table[positions]
    out = rope.apply_rope(x, cos, sin)
    expected = x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)  # HF's apply_rotary_pos_emb
    assert out.is_contiguous()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows,d", [(1, 1536), (128, 1536), (5, 20)])
def test_silu_and_mul_matches_torch(threads, rows, d):
    g = torch.Generator().manual_seed(rows * d)
    gate_up = torch.randn(rows, 2 * d, generator=g) * 6  # past e^x's polynomial's easy range both ways
    out = activation.silu_and_mul(gate_up)
    torch.testing.assert_close(out, F.silu(gate_up[:, :d]) * gate_up[:, d:], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("d", [16, 20])  # a whole vector, and one with a tail
def test_silu_and_mul_of_a_gate_past_e_to_the_88_is_torchs_not_nan(threads, d):
    # 1 + e^-g overflows to inf for g < -88.7: the kernel's reciprocal estimate gave inf * 0 = NaN there
    gates = torch.tensor([-1e4, -200.0, -100.0, -89.0, -88.0, -87.0, 0.0, 87.0, 89.0, 100.0, 1e4])
    gate = gates.repeat(-(-d // len(gates)))[:d]
    gate_up = torch.cat([gate, torch.full((d,), 3.0)]).unsqueeze(0)
    out = activation.silu_and_mul(gate_up)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, F.silu(gate_up[:, :d]) * gate_up[:, d:], rtol=1e-5, atol=1e-6)


def test_silu_and_mul_rejects_an_odd_width():
    with pytest.raises(ValueError, match="even"):
        activation.silu_and_mul(torch.zeros(2, 7))

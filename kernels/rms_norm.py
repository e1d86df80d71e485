"""RMSNorm (Zhang & Sennrich 2019, https://arxiv.org/abs/1910.07467) as Llama uses it."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * x / sqrt(mean(x**2, -1) + eps)` over the last dimension.

    x: [..., hidden] fp32; weight: [hidden] fp32; returns the shape of x. The order of operations
    follows HF's `LlamaRMSNorm` (normalize, then scale) so results agree to rounding.
    """
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))

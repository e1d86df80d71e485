"""Rotary position embedding (RoFormer, Su et al. 2021, https://arxiv.org/abs/2104.09864), HF Llama layout.

HF's layout pairs dimension i with i + head_dim/2 (`rotate_half`), not (2i, 2i+1) as in the paper and in
ggml; GGUF Q/K weights are un-permuted to HF's order at load (`loader.unpermute_rotary_rows`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from pdserve.kernels import native


def rope_cos_sin(max_positions: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Tables `cos, sin`: [max_positions, head_dim] fp32, row p for position p.

    inv_freq[i] = theta ** (-2i / head_dim), angles = p * inv_freq, duplicated across both halves, computed
    exactly as HF's `LlamaRotaryEmbedding` (default rope type) so the tables agree bit for bit.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim))
    positions = torch.arange(max_positions, dtype=torch.int64).to(torch.float32)
    angles = torch.outer(positions, inv_freq)
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` [num_tokens, num_heads, head_dim] by `cos`, `sin` [num_tokens, head_dim] (rows = positions).

    Returns a new contiguous tensor of x's shape: x * cos + rotate_half(x) * sin. Computed by the C kernel
    (csrc/rope.c) on `torch.get_num_threads()` threads where it is built, all three are fp32 on the CPU, x's
    heads are contiguous within a row (rows may be strided: a slice of the fused QKV output) and cos, sin
    are contiguous; else by torch.
    """
    kernel = native_kernel()
    num_tokens, num_heads, head_dim = x.shape
    if (kernel is not None and native.cpu_fp32(x, cos, sin) and x.stride(2) == 1 and x.stride(1) == head_dim
            and head_dim % 2 == 0 and cos.is_contiguous() and sin.is_contiguous()):
        out = torch.empty(x.shape, dtype=x.dtype)
        kernel(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), num_tokens,
               num_heads, head_dim, torch.get_num_threads())
        return out
    half = head_dim // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


@functools.cache
def native_kernel() -> Callable[..., int] | None:
    """The C kernel, built on the first call; None where it cannot be built (kernels/native.py)."""
    # x, x_stride, cos, sin, out, rows, heads, head_dim, num_threads (csrc/rope.c)
    i64, ptr = native.I64, native.PTR
    return native.bind("rope", [ptr, i64, ptr, ptr, ptr, i64, i64, i64, native.INT])

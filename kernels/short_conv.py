"""The short causal convolution of a linear-attention layer, with the state it carries between calls.

Kimi Delta Attention (KDA; Kimi Team, "Kimi Linear: An Expressive, Efficient Attention Architecture",
arXiv:2510.26692, §3), like Gated DeltaNet (Yang, Kautz & Hatamizadeh, "Gated Delta Networks", ICLR 2025,
arXiv:2412.06464) and Mamba before it, passes its q, k and v projections through a depthwise causal 1-D
convolution of a short kernel (K = 4) followed by SiLU, so each channel mixes the current token with the
K - 1 tokens before it:

    y[t, c] = silu( sum_{j=0}^{K-1} weight[c, j] * x[t - (K - 1) + j, c] ),   x[t < 0] = 0

(cross-correlation, as `torch.nn.functional.conv1d` with `padding=K-1`, `groups=channels`, bias-free).

The state of the convolution is the last K - 1 *inputs* of the sequence, oldest first: `[K - 1, channels]`
(zeros before the first token: the convolution's zero left padding). A prefill chunk or a decode step reads
it as the left context and replaces it with the last K - 1 rows of (state, new inputs), so feeding a
sequence in any split gives the same outputs as one pass. Token-major, like the projections it follows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """The convolution of one sequence's `num_tokens` new inputs, continuing from `state`.

    x: [num_tokens, channels]; weight: [channels, K]; state: [K - 1, channels], the sequence's previous
    K - 1 inputs (zeros at its start) — replaced in place by its last K - 1 inputs after `x` (so `state`
    may be a view into a state pool). All in one dtype (fp32 on the CPU).
    Returns silu(conv): [num_tokens, channels].
    """
    num_tokens = x.shape[0]
    kernel = weight.shape[1]
    padded = torch.cat((state, x), dim=0)  # [K - 1 + num_tokens, channels]: row K - 1 + t is x[t]
    out = padded[:num_tokens] * weight[:, 0]
    for j in range(1, kernel):
        out.addcmul_(padded[j : j + num_tokens], weight[:, j])
    state.copy_(padded[num_tokens:])
    return F.silu(out)


def causal_conv_step(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
    """One new input for each of `batch` sequences (decode): `causal_conv` with num_tokens = 1, batched.

    x: [batch, channels]; weight: [channels, K]; states: [batch, K - 1, channels], each sequence's
    previous K - 1 inputs — updated in place (shifted by one, `x` appended; the caller gathers them from
    its pool and scatters them back). Returns silu(conv): [batch, channels].
    """
    window = torch.cat((states, x.unsqueeze(1)), dim=1)  # [batch, K, channels]
    out = (window * weight.t()).sum(dim=1)
    states.copy_(window[:, 1:])
    return F.silu(out)

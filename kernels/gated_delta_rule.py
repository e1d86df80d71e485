"""The gated delta rule with per-channel decay (Kimi Delta Attention's core), chunked for prefill and
one token at a time for decode (fp32).

The delta rule (Schlag, Irie & Schmidhuber 2021, arXiv:2102.11174; DeltaNet: Yang et al., "Parallelizing
Linear Transformers with the Delta Rule over Sequence Length", NeurIPS 2024, arXiv:2406.06484) keeps a
fast-weight state S (d_k x d_v per head) that token t first decays, then corrects towards mapping its key
to its value with strength beta_t; Gated DeltaNet (Yang, Kautz & Hatamizadeh, ICLR 2025,
arXiv:2412.06464) decays S by a scalar per head and token; Kimi Delta Attention (Kimi Team, "Kimi Linear",
arXiv:2510.26692, §3, eq. 1-2) makes the decay per key channel, a vector alpha_t = exp(g_t) in (0, 1]^d_k:

    S_t = (I - beta_t k_t k_t^T) Diag(alpha_t) S_{t-1} + beta_t k_t v_t^T
    o_t = scale * S_t^T q_t

(rows of S are key channels). Written the way it is computed one token at a time (`gated_delta_rule_step`):
decay, read the decayed memory at k_t, write beta_t * (v_t - memory) at k_t, read at q_t.

Chunked form (`gated_delta_rule_chunked`; the WY/UT representation of DeltaNet §3 generalized to
per-channel decay as in the Kimi Linear report §3.2). Within a chunk of n tokens that starts from state S_0,
with Gamma_t = g_1 + ... + g_t (cumulative log decay, per channel), unrolling the recurrence gives

    S_t = Diag(e^{Gamma_t}) S_0 + sum_{i<=t} Diag(e^{Gamma_t - Gamma_i}) k_i delta_i^T
    delta_i = beta_i (v_i - (k_i * e^{Gamma_i})^T S_0 - sum_{j<i} A'_ij delta_j),
    A'_ij = sum_c k_ic k_jc e^{Gamma_ic - Gamma_jc}

so with A = Diag(beta) A' strictly lower triangular, (I + A) Delta = Diag(beta) (V - (K * e^Gamma) S_0):
one unit-triangular solve gives every delta ("new value") of the chunk, then

    o_t = scale * ((q_t * e^{Gamma_t})^T S_0 + sum_{i<=t} P_ti delta_i),
    P_ti = sum_c q_tc k_ic e^{Gamma_tc - Gamma_ic}
    S_n = Diag(e^{Gamma_n}) S_0 + (K * e^{Gamma_n - Gamma})^T Delta

The decay factors e^{Gamma_t - Gamma_i} (i <= t) are formed per pair and channel, [heads, n, n, d_k]
per chunk, never as e^{Gamma_t} * e^{-Gamma_i}, which overflows once a chunk has decayed far; the chunk
size bounds that tensor (64: heads * 64 * 64 * d_k floats).
"""

from __future__ import annotations

import torch

CHUNK_SIZE = 64


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`x / sqrt(sum(x**2, -1) + eps)` over the last dimension (KDA normalizes q and k so; the eps inside
    the root, as the flash-linear-attention kernels the Kimi Linear release uses). Shape of x."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta_rule_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, scale: float,
) -> torch.Tensor:
    """One token for each of `batch` sequences (decode), the recurrence as written above.

    q, k: [batch, heads, d_k]; v: [batch, heads, d_v]; g: [batch, heads, d_k] log decay (<= 0);
    beta: [batch, heads] in (0, 1); state: [batch, heads, d_k, d_v] fp32, S_{t-1}, replaced in place by S_t
    (the caller gathers it from its pool and scatters it back). Returns o: [batch, heads, d_v].
    """
    state.mul_(g.exp().unsqueeze(-1))
    memory = (k.unsqueeze(-2) @ state).squeeze(-2)  # [batch, heads, d_v]: the decayed state read at k
    delta = (v - memory).mul_(beta.unsqueeze(-1))
    state.add_(k.unsqueeze(-1) * delta.unsqueeze(-2))
    return (q.unsqueeze(-2) @ state).squeeze(-2).mul_(scale)


def gated_delta_rule_chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, scale: float, chunk_size: int = CHUNK_SIZE,
) -> torch.Tensor:
    """`num_tokens` consecutive tokens of one sequence (a prefill chunk), chunk by chunk as derived above.

    q, k: [num_tokens, heads, d_k]; v: [num_tokens, heads, d_v]; g: [num_tokens, heads, d_k] log decay
    (<= 0); beta: [num_tokens, heads]; state: [heads, d_k, d_v] fp32, the state before the first token
    (zeros at the sequence's start), replaced in place by the state after the last one (may be a view
    into a state pool). Returns o: [num_tokens, heads, d_v]. Equal to `num_tokens` calls of
    `gated_delta_rule_step` up to fp32 rounding, for any split of the sequence into calls.
    """
    num_tokens, _, _ = q.shape
    out = v.new_empty(v.shape)
    # head-major: every product below is a batched matmul over heads
    qh, kh, vh, gh = (t.transpose(0, 1) for t in (q, k, v, g))  # [heads, num_tokens, d]
    bh = beta.t().unsqueeze(-1)  # [heads, num_tokens, 1]
    for start in range(0, num_tokens, chunk_size):
        end = min(start + chunk_size, num_tokens)
        n = end - start
        qc, kc, vc, bc = qh[:, start:end] * scale, kh[:, start:end], vh[:, start:end], bh[:, start:end]
        gamma = gh[:, start:end].cumsum(dim=1)  # [heads, n, d_k]: Gamma_t
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril_()  # i <= t
        pair_decay = (gamma.unsqueeze(2) - gamma.unsqueeze(1)).masked_fill_(~causal[..., None], -torch.inf)
        pair_decay.exp_()  # [heads, t, i, d_k]: e^{Gamma_t - Gamma_i}, 0 above the diagonal
        a = (kc.unsqueeze(2) * pair_decay * kc.unsqueeze(1)).sum(-1).mul_(bc).tril_(-1)  # [heads, n, n]
        p = (qc.unsqueeze(2) * pair_decay * kc.unsqueeze(1)).sum(-1)  # [heads, n, n], i <= t
        decay = gamma.exp()
        rhs = torch.cat((vc * bc, kc * decay * bc), dim=-1)  # solve for V and K * e^Gamma terms at once
        solved = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)
        d_v = vc.shape[-1]
        delta = solved[..., :d_v] - solved[..., d_v:] @ state  # [heads, n, d_v]
        out[start:end] = ((qc * decay) @ state + p @ delta).transpose(0, 1)
        last = gamma[:, -1:]  # [heads, 1, d_k]: Gamma_n
        state.mul_(last.exp().transpose(1, 2)).add_((kc * (last - gamma).exp()).transpose(1, 2) @ delta)
    return out

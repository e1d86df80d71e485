"""This machine's compute and memory roofline, measured, and what it allows a workload of a dense model.

Measured, not looked up (a shared machine's share of its cores and memory is what serving gets): the fp32
GEMM rate of a 2048² matmul (the best of torch's default MKL path and oneDNN with a prepacked weight, as
`pdserve.engine.linear` runs it) and the memory bandwidth of a 256 MiB copy (bytes read + written per
second), each the best of 3 after a warm-up, on `threads` torch threads.

A token costs 2 FLOP per weight it passes (Kaplan et al. 2020, https://arxiv.org/abs/2001.08361: C ≈ 2N
per token); the embedding is a lookup (no FLOPs), the LM head a GEMM only for the rows sampled from (a
prompt's last token, every decode token). A decode step reads every weight once (fp32: 4 bytes each).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch

from pdserve.engine.linear import Linear, best_time_s

if TYPE_CHECKING:
    from pdserve.engine.loader import LoadedModel


@dataclass(frozen=True)
class Roofline:
    """`gemm_flops`: FLOP/s, the better of `gemm_flops_matmul` (MKL) and `gemm_flops_onednn`;
    `bandwidth_bytes_s`: bytes/s copied (read + written); `threads`: torch threads it was measured on."""

    gemm_flops: float
    gemm_flops_matmul: float
    gemm_flops_onednn: float
    bandwidth_bytes_s: float
    threads: int

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def measure_roofline(threads: int | None = None) -> Roofline:
    """Measure on `threads` torch threads (default: as many as torch has now; restored afterwards).
    ~2 s, ~600 MiB of memory while it runs."""
    before = torch.get_num_threads()
    threads = threads or before
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
        flop = 2 * 2048**3
        mkl = flop / best_time_s(lambda: a @ b, 3)
        packed = Linear(b.t())
        onednn = flop / best_time_s(lambda: packed(a), 3)
        src = torch.empty(64 << 20)  # 256 MiB fp32
        dst = torch.empty_like(src)
        src.fill_(1.0)
        copy_s = best_time_s(lambda: dst.copy_(src), 3)
    finally:
        torch.set_num_threads(before)
    return Roofline(max(mkl, onednn), mkl, onednn, 2 * src.nbytes / copy_s, threads)


@dataclass(frozen=True)
class DenseModelCost:
    """What a token costs a dense decoder: `num_params` (every weight, the embedding included; weights
    bytes = 4 × num_params in fp32) and `head_params` (the LM head's: vocab × hidden, tied or not)."""

    num_params: int
    head_params: int

    @classmethod
    def of(cls, loaded: LoadedModel) -> DenseModelCost:
        """The cost of a loaded Llama-family model (`engine.loader.load_model`)."""
        num_params = sum(w.numel() for w in loaded.weights.values())
        return cls(num_params, loaded.config.vocab_size * loaded.config.hidden_size)

    @property
    def body_params(self) -> int:
        """The weights a prompt token passes: all but the embedding lookup and the LM head."""
        return self.num_params - self.head_params

    def prefill_flop(self, prompt_tokens: int) -> float:
        return 2.0 * (prompt_tokens * self.body_params + self.head_params)


def serving_ceiling_s(roof: Roofline, cost: DenseModelCost, num_prompts: int, input_len: int, output_len: int,
                      concurrency: int) -> float:
    """The least time any engine on this machine needs to serve `num_prompts` requests of `input_len`
    prompt and `output_len` output tokens, at most `concurrency` at once (seconds): the longer of (a) every
    FLOP of it at the GEMM peak — each prompt's prefill and every further output token through all weights
    — and (b) its decode steps at memory bandwidth: each request needs `output_len - 1` steps after its
    prefill, one after another, so ceil(num_prompts / concurrency) × (output_len - 1) steps at least, each
    reading every weight once. Attention's FLOPs and KV reads are left out (they only add), so this bounds
    throughput from above: output tokens / this = the most tok/s the machine allows."""
    flop = num_prompts * (cost.prefill_flop(input_len) + (output_len - 1) * 2.0 * cost.num_params)
    steps = math.ceil(num_prompts / concurrency) * (output_len - 1)
    return max(flop / roof.gemm_flops, steps * 4.0 * cost.num_params / roof.bandwidth_bytes_s)

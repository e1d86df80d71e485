"""Hardware profiles for accelerators that are not here: their published peaks (`hardware/accelerators.py`)
scaled by the efficiency this engine reaches on this machine's own roofline.

With F = peak FLOP/s in the serving dtype × `Efficiency.compute` and B = memory bandwidth ×
`Efficiency.memory`, both × the tensor-parallel degree t (a TP group is one replica of t GPUs):

    prefill_token_s = flops_per_token / F              prefill_pair_s = attention_flops_per_pair / F
    decode_seq_s    = flops_per_token / F              decode_ctx_s   = kv_bytes_per_token / B
    prefill_fixed_s = decode_fixed_s = weight_bytes / B    (one weight read per step)

plus, for t > 1, two all-reduces of the hidden state per layer (Megatron-LM's tensor parallelism:
Shoeybi et al. 2019, §3), each moving 2·(t−1)/t · hidden · dtype bytes per token over the scale-up link
(ring all-reduce), added per token to prefill_token_s and decode_seq_s. KV capacity: the HBM left after
the weights (× `memory_utilization`, vLLM's `gpu_memory_utilization` default 0.9) over the KV bytes per
token.
"""

from __future__ import annotations

from pdserve.hardware.accelerators import Accelerator
from pdserve.sim.cost import StepCost
from pdserve.sim.model_shape import ModelShape
from pdserve.sim.profile import Efficiency, HardwareProfile

DTYPE_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


def scaled_profile(
    acc: Accelerator,
    model: ModelShape,
    efficiency: Efficiency,
    *,
    dtype: str = "bf16",
    tensor_parallel: int = 1,
    memory_utilization: float = 0.9,
    name: str | None = None,
) -> HardwareProfile:
    """`model` served on `acc` × `tensor_parallel` in `dtype`, at `efficiency`. Raises KeyError for a
    dtype the datasheet lacks, ValueError when the weights do not fit."""
    t = tensor_parallel
    shape = model.at_dtype(DTYPE_BYTES[dtype])
    flops = acc.peak_flops(dtype) * efficiency.compute * t
    bw = acc.memory_bytes_per_s * efficiency.memory * t
    allreduce_s = 0.0
    if t > 1:
        per_token = 2 * shape.num_layers * 2 * (t - 1) / t * shape.hidden_size * shape.dtype_bytes
        allreduce_s = per_token / acc.scale_up_bytes_per_s
    free = (
        acc.memory_bytes * t * memory_utilization
        - shape.weight_bytes
        - shape.embedding_params * shape.dtype_bytes
    )
    if free <= 0:
        raise ValueError(
            f"{model.name} in {dtype} ({shape.weight_bytes / 1e9:.0f} GB) does not fit "
            f"{t} × {acc.name} ({acc.memory_bytes / 1e9:.0f} GB each)"
        )
    fixed = shape.weight_bytes / bw
    cost = StepCost(
        prefill_fixed_s=fixed,
        prefill_token_s=shape.flops_per_token / flops + allreduce_s,
        prefill_pair_s=shape.attention_flops_per_pair / flops,
        decode_fixed_s=fixed,
        decode_seq_s=shape.flops_per_token / flops + allreduce_s,
        decode_ctx_s=shape.kv_bytes_per_token / bw,
    )
    sources = {
        f"peak {dtype} FLOP/s": acc.source,
        "memory bandwidth": acc.source,
        "memory capacity": acc.source,
        "efficiency": "measured here (pdserve profile: fitted cost against this CPU's roofline)",
        "model shape": shape.source,
    }
    if t > 1:
        sources["scale-up link"] = acc.source
    return HardwareProfile(
        name=name or f"{acc.name}-tp{t}-{model.name}-{dtype}",
        accelerator=acc.name,
        tensor_parallel=t,
        dtype=dtype,
        model=shape,
        cost=cost,
        kv_capacity_tokens=int(free // shape.kv_bytes_per_token),
        sources=sources,
    )

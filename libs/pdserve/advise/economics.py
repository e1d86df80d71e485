"""Exercise A and E of the disaggregation checklist, from a model's spec and the link table.

A, transfer economics: a request of `n` prompt tokens moves `n × kv_bytes_per_token` of paged KV (plus the
recurrent state of a hybrid) from the prefill to the decode worker. Sent after the prefill, that costs
`latency + bytes / bandwidth` (`hardware.links.Link.transfer_s`); streamed layer by layer, only the last
layer's share and, for a hybrid, the whole state are exposed (the state only exists once the last token is
processed, so it cannot overlap the prefill). Recomputing it instead costs the prefill: `n / prefill_tok_s`.
Transfer is worth it when it is cheaper than the prefill it saves.

E, weight duplication: two pools hold two copies of the weights. The second copy's share of a fleet of `G`
accelerators of `M` bytes each is `weight_bytes / (G × M)`: the memory a colocated fleet would have given to
KV. It falls below a threshold at `G ≥ weight_bytes / (threshold × M)`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict

from pdserve.advise.models import ModelSpec
from pdserve.hardware.links import LINKS, Link

# The checklist's recompute rate for Llama-3-70B ("prefill 4,000 tokens at 28,000 tok/s = 143 ms").
CHECKLIST_PREFILL_TOK_S = 28_000.0
# NVIDIA H100 SXM datasheet: 80 GB HBM3 (the checklist's "71 GB × 2 pools" is sized against it).
H100_MEMORY_BYTES = 80e9


class TransferRow(BaseModel):
    """One link at one prompt length. Seconds; `transfer_s`: the whole handoff sent after the prefill;
    `exposed_layerwise_s`: what layer-wise streaming leaves on the TTFT path (last paged layer + state)."""

    model_config = ConfigDict(frozen=True)

    link: str
    achievable_GB_s: float
    rdma_class: bool
    transfer_s: float
    exposed_layerwise_s: float
    prefill_s: float
    transfer_over_prefill: float
    cheaper_than_recompute: bool


class PromptEconomics(BaseModel):
    """Exercise A at one prompt length (`label`: 'p50', 'p95', or the length itself)."""

    model_config = ConfigDict(frozen=True)

    label: str
    num_tokens: int
    kv_bytes: int
    state_bytes: int
    transfer_bytes: int
    prefill_s: float
    rows: tuple[TransferRow, ...]


class DuplicationRow(BaseModel):
    model_config = ConfigDict(frozen=True)

    fleet_accelerators: int
    weight_share: float


class Duplication(BaseModel):
    """Exercise E: the second pool's weight copy against fleet size. `min_accelerators_per_copy`: the
    fewest accelerators one copy of the weights fits on (weights only, nothing for KV)."""

    model_config = ConfigDict(frozen=True)

    weight_bytes: int
    accelerator_memory_bytes: float
    accelerator_source: str
    min_accelerators_per_copy: int
    threshold: float
    fleet_for_threshold: int
    rows: tuple[DuplicationRow, ...]


class Economics(BaseModel):
    """Exercises A and E for one model."""

    model_config = ConfigDict(frozen=True)

    model: ModelSpec
    prefill_tok_s: float | None
    prefill_source: str
    prompts: tuple[PromptEconomics, ...]
    duplication: Duplication


def transfer_row(spec: ModelSpec, link: Link, num_tokens: int, prefill_s: float) -> TransferRow:
    """Link `link` moving a `num_tokens`-token request of `spec`, against `prefill_s` seconds of prefill."""
    bw = link.achievable_GB_s * 1e9
    total = link.transfer_s(spec.transfer_bytes(num_tokens))
    last_layer = spec.kv_bytes(num_tokens) / max(spec.num_paged_layers, 1)
    exposed = link.latency_s + (last_layer + spec.state_bytes_per_request) / bw
    return TransferRow(
        link=link.name,
        achievable_GB_s=link.achievable_GB_s,
        rdma_class=link.rdma_class,
        transfer_s=total,
        exposed_layerwise_s=exposed,
        prefill_s=prefill_s,
        transfer_over_prefill=total / prefill_s if prefill_s > 0 else math.inf,
        cheaper_than_recompute=total < prefill_s,
    )


def prompt_economics(
    spec: ModelSpec,
    num_tokens: int,
    prefill_s: float,
    links: Sequence[Link] = LINKS,
    label: str | None = None,
) -> PromptEconomics:
    """Exercise A at one prompt length, every link in `links`."""
    return PromptEconomics(
        label=label or str(num_tokens),
        num_tokens=num_tokens,
        kv_bytes=spec.kv_bytes(num_tokens),
        state_bytes=spec.state_bytes_per_request,
        transfer_bytes=spec.transfer_bytes(num_tokens),
        prefill_s=prefill_s,
        rows=tuple(transfer_row(spec, c, num_tokens, prefill_s) for c in links),
    )


def duplication(
    weight_bytes: int,
    accelerator_memory_bytes: float = H100_MEMORY_BYTES,
    accelerator_source: str = "NVIDIA H100 SXM datasheet: 80 GB HBM3",
    fleets: Sequence[int] = (2, 4, 8, 16, 32, 64, 128, 256, 512),
    threshold: float = 0.05,
) -> Duplication:
    """Exercise E: share `weight_bytes / (G × memory)` per fleet size G, and the smallest G at which it is
    ≤ `threshold` (default 5%). Raises ValueError unless memory > 0 and 0 < threshold < 1."""
    if not accelerator_memory_bytes > 0 or not 0 < threshold < 1:
        raise ValueError("accelerator memory must be > 0 and the threshold in (0, 1)")
    return Duplication(
        weight_bytes=weight_bytes,
        accelerator_memory_bytes=accelerator_memory_bytes,
        accelerator_source=accelerator_source,
        min_accelerators_per_copy=math.ceil(weight_bytes / accelerator_memory_bytes),
        threshold=threshold,
        fleet_for_threshold=math.ceil(weight_bytes / (threshold * accelerator_memory_bytes)),
        rows=tuple(
            DuplicationRow(fleet_accelerators=g, weight_share=weight_bytes / (g * accelerator_memory_bytes))
            for g in fleets
        ),
    )


def economics(
    spec: ModelSpec,
    prompt_lens: Sequence[tuple[str, int]],
    prefill_s: Sequence[float],
    prefill_tok_s: float | None,
    prefill_source: str,
    links: Sequence[Link] = LINKS,
    **duplication_kw,
) -> Economics:
    """Exercises A (one `PromptEconomics` per (label, length) with its measured or modelled `prefill_s`)
    and E for `spec`."""
    if len(prompt_lens) != len(prefill_s):
        raise ValueError("one prefill time per prompt length")
    prompts = tuple(
        prompt_economics(spec, n, p, links, label)
        for (label, n), p in zip(prompt_lens, prefill_s, strict=True)
    )
    return Economics(
        model=spec,
        prefill_tok_s=prefill_tok_s,
        prefill_source=prefill_source,
        prompts=prompts,
        duplication=duplication(spec.weight_bytes, **duplication_kw),
    )


def measure_prefill_s(name: str, num_tokens: int, cache_dir, repeats: int = 2) -> float:
    """Seconds this machine's engine takes to prefill `num_tokens` tokens of model `name` (fp32 CPU, one
    unchunked prefill: `max_num_batched_tokens` = the prompt, one output token; best of `repeats` after a
    warm-up; prefix caching cannot help: each repeat's tokens differ), on one torch thread."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a worker runs (one thread per process)
    try:
        return _timed_prefill(name, num_tokens, cache_dir, repeats)
    finally:
        torch.set_num_threads(threads)


def _timed_prefill(name: str, num_tokens: int, cache_dir, repeats: int) -> float:
    import time

    from pdserve.engine.llm_engine import EngineConfig, LLMEngine
    from pdserve.engine.loader import build_model, load_model
    from pdserve.engine.sampling_params import SamplingParams

    loaded = load_model(name, cache_dir)
    model = build_model(loaded)
    block = 16
    cfg = EngineConfig(
        num_blocks=(num_tokens // block + 4) * 2,
        block_size=block,
        max_num_batched_tokens=num_tokens + 1,
        max_model_len=num_tokens + 8,
    )
    engine = LLMEngine(model, cfg)
    vocab = loaded.config.vocab_size
    best = math.inf
    for r in range(repeats + 1):
        prompt = [(7919 * (i + 1) + 104729 * r) % (vocab - 1) + 1 for i in range(num_tokens)]
        t0 = time.perf_counter()
        engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        if r:
            best = min(best, time.perf_counter() - t0)
    return best

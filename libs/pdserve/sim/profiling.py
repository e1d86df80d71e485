"""`pdserve profile` end to end: measure (`measure.py`), fit (`fit.py`), scale to accelerators
(`roofline.py`), into one `Profile`."""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime

import torch
from tqdm import tqdm

from pdserve.config import ModelSettings
from pdserve.engine.loader import build_model, load_model
from pdserve.hardware.accelerators import ACCELERATORS
from pdserve.sim import measure
from pdserve.sim.fit import fit_cost
from pdserve.sim.model_shape import ModelShape, published_shape
from pdserve.sim.profile import Efficiency, HardwareProfile, Profile
from pdserve.sim.roofline import scaled_profile


@dataclass
class ProfileConfig:
    """What to measure. Lengths and budgets in tokens; `transports`: `make_transport` kinds;
    `hardware`: (accelerator, published model, dtype, tensor-parallel degree) profiles to scale to."""

    model: str = "smollm2"
    families: list[str] = field(default_factory=lambda: ["smollm2", "kimi-tiny"])
    prompt_lengths: list[int] = field(default_factory=lambda: [16, 64, 128, 256, 512])
    chunk_sizes: list[int] = field(default_factory=lambda: [128, 512])
    batches: list[int] = field(default_factory=lambda: [1, 4, 16, 32])
    contexts: list[int] = field(default_factory=lambda: [32, 256, 1024])
    decode_steps: int = 6
    reps: int = 2
    transports: list[str] = field(default_factory=lambda: ["tcp", "ucxx"])
    transfer_bytes: int = 32 << 20
    transfer_layers: int = 30
    kv_capacity_tokens: int = 32768
    max_num_batched_tokens: int = 512
    hardware: list[tuple[str, str, str, int]] = field(
        default_factory=lambda: (
            [(acc, "llama-3-70b", "bf16", 8) for acc in ("h100-sxm", "h200", "a100-80gb", "b200", "mi300x")]
            + [(acc, "llama-3-8b", "bf16", 1) for acc in ACCELERATORS]
        )
    )


def shape_of(name: str, model) -> ModelShape:
    """The engine model's shape: parameters counted from its weights (the tied head counted as the head,
    the embedding as a lookup), KV and state bytes from its `CacheSpec`."""
    cfg = model.config
    spec = model.cache_spec()
    weights = sum(p.numel() for p in _weights(model))
    head = cfg.vocab_size * cfg.hidden_size
    embedding = head if not getattr(cfg, "tie_word_embeddings", True) else 0
    heads = getattr(cfg, "num_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    return ModelShape(
        name=name,
        family=getattr(model, "family", "llama"),
        num_layers=spec.num_paged_layers,
        hidden_size=cfg.hidden_size,
        num_heads=heads,
        head_dim=head_dim,
        body_params=weights - head - embedding,
        head_params=head,
        embedding_params=embedding,
        kv_bytes_per_token=spec.kv_bytes_per_token(model.dtype),
        state_bytes_per_request=spec.state.bytes_per_slot(model.dtype) if spec.state is not None else 0,
        dtype_bytes=model.dtype.itemsize,
        source=f"pdserve's {name} (engine/loader.py), counted from its weights",
    )


def _weights(model) -> list[torch.Tensor]:
    return list(model.weights.values()) if hasattr(model, "weights") else []


def run_profile(cfg: ProfileConfig, progress: bool = True) -> Profile:
    started = time.monotonic()
    torch.set_num_threads(1)
    steps = (
        len(cfg.prompt_lengths) * len(cfg.chunk_sizes)
        + len(cfg.batches) * len(cfg.contexts)
        + len(cfg.families)
        + len(cfg.transports)
        + 1
    )
    bar = tqdm(total=steps, desc="pdserve profile", disable=not progress, unit="step")

    def tick(what: str) -> None:
        bar.set_postfix_str(what[:60])
        bar.update()

    roof = measure.roofline()
    tick(f"roofline: {roof.gemm_flops / 1e9:.0f} GFLOP/s, {roof.memory_bytes_per_s / 1e9:.1f} GB/s")
    settings = ModelSettings()
    models = {}
    for name in dict.fromkeys([cfg.model, *cfg.families]):
        models[name] = build_model(load_model(name, settings.weights_cache_dir))
    model = models[cfg.model]
    loaded_weights = load_model(cfg.model, settings.weights_cache_dir).weights
    prefill = measure.measure_prefill(model, cfg.prompt_lengths, cfg.chunk_sizes, cfg.reps, tick)
    decode = measure.measure_decode(model, cfg.batches, cfg.contexts, cfg.decode_steps, tick)
    families = []
    for name in cfg.families:
        families.append(measure.cache_bytes(name, models[name]))
        tick(f"{name}: {families[-1].kv_bytes_per_token} KV bytes/token")
    transfers, notes = [], []
    for kind in cfg.transports:
        try:
            transfers.append(
                measure.measure_transfer(kind, cfg.transfer_bytes, cfg.transfer_layers, cfg.reps)
            )
            tick(f"{kind}: {transfers[-1].gb_s:.2f} GB/s")
        except Exception as e:  # a transport that cannot run here is reported, not fatal
            notes.append(f"{kind}: not measured ({type(e).__name__}: {e})")
            tick(notes[-1])
    bar.close()
    fit = fit_cost(prefill, decode)
    shape = shape_of(cfg.model, _WithWeights(model, loaded_weights))
    eff = Efficiency(
        compute=min(1.0, shape.flops_per_token / fit.cost.prefill_token_s / roof.gemm_flops)
        if fit.cost.prefill_token_s > 0
        else 1.0,
        memory=min(1.0, shape.weight_bytes / fit.cost.decode_fixed_s / roof.memory_bytes_per_s)
        if fit.cost.decode_fixed_s > 0
        else 1.0,
    )
    measured = HardwareProfile(
        name="measured",
        accelerator=f"this machine's CPU ({platform.processor() or platform.machine()}, 1 thread)",
        dtype=str(model.dtype).removeprefix("torch."),
        model=shape,
        cost=fit.cost,
        kv_capacity_tokens=cfg.kv_capacity_tokens,
        sources={"cost": "measured here (pdserve profile)", "kv capacity": "PDS_KV_CAPACITY_TOKENS default"},
    )
    hardware = []
    for acc, model_name, dtype, tp in cfg.hardware:
        try:
            hardware.append(
                scaled_profile(
                    ACCELERATORS[acc], published_shape(model_name), eff, dtype=dtype, tensor_parallel=tp
                )
            )
        except (KeyError, ValueError) as e:
            notes.append(f"{acc} {model_name} {dtype} tp{tp}: {e}")
    profile = Profile(
        created_at=datetime.now(UTC).isoformat(timespec="seconds"),
        machine=f"{platform.machine()}, {platform.platform()}",
        model=shape,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        prefill=prefill,
        decode=decode,
        cost=fit.cost,
        prefill_fit=fit.prefill,
        decode_fit=fit.decode,
        roofline=roof,
        efficiency=eff,
        families=families,
        transfers=transfers,
        measured=measured,
        hardware=hardware,
        notes=notes,
        elapsed_s=time.monotonic() - started,
    )
    return profile


class _WithWeights:
    """The engine model with the checkpoint's weights beside it (for counting parameters)."""

    def __init__(self, model, weights: dict[str, torch.Tensor]) -> None:
        self._model, self.weights = model, weights

    def __getattr__(self, name: str):
        return getattr(self._model, name)

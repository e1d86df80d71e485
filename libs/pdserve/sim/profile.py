"""The profile file `pdserve profile` writes and `pdserve sim` reads (JSON, these pydantic models).

A `Profile` holds what was measured on this machine — prefill and decode step times (`PrefillSample`,
`DecodeSample`), KV/state bytes per token per model family, transfer GB/s per transport, this CPU's GEMM
and memory-bandwidth roofline — the step cost model fitted to them with its fit error (`fit.py`), and
hardware profiles for published accelerators scaled from the measured efficiency (`roofline.py`).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from pdserve.sim.cost import StepCost
from pdserve.sim.model_shape import ModelShape


class PrefillSample(BaseModel):
    """One prompt of `prompt_tokens` prefilled in chunks of at most `chunk_tokens` (its steps' total),
    seconds: the fastest of the repeats."""

    model_config = ConfigDict(frozen=True)

    prompt_tokens: int
    chunk_tokens: int
    seconds: float


class DecodeSample(BaseModel):
    """One decode step of `batch` sequences each at `context` tokens, seconds (median over the steps)."""

    model_config = ConfigDict(frozen=True)

    batch: int
    context: int
    seconds: float


class FitError(BaseModel):
    """How far the fitted model is from its samples: |predicted − measured| / measured."""

    samples: int
    mean_abs_rel: float
    max_abs_rel: float


class CacheBytes(BaseModel):
    """A model family's cache per token (paged KV over all paged layers) and per request (recurrent state),
    from its `CacheSpec` (engine/model_family.py) at `dtype`."""

    family: str
    model: str
    dtype: str
    num_paged_layers: int
    paged_row_shape: list[int]
    kv_bytes_per_token: int
    state_bytes_per_request: int


class TransferSample(BaseModel):
    """One KV transfer between two processes through a pdserve transport: `nbytes` in `num_layers` layers,
    the fastest of the repeats."""

    transport: str
    nbytes: int
    num_layers: int
    seconds: float

    @property
    def gb_s(self) -> float:
        return self.nbytes / self.seconds / 1e9


class Roofline(BaseModel):
    """This machine's peaks as one engine thread sees them: dense fp32 GEMM FLOP/s (oneDNN prepacked, as
    `engine/linear.py` runs them) and memory bandwidth (a 256 MiB copy, read + write bytes)."""

    gemm_flops: float
    memory_bytes_per_s: float
    threads: int


class Efficiency(BaseModel):
    """The measured engine's achieved fraction of `Roofline`: `compute` = FLOPs per prefill token /
    fitted seconds per prefill token / peak FLOP/s; `memory` = weight bytes / fitted fixed decode step /
    peak bandwidth (each capped at 1)."""

    compute: float
    memory: float


class HardwareProfile(BaseModel):
    """A pool's hardware as the simulator runs it: a step cost, the KV capacity, the model, and where each
    number came from (`sources`: quantity → datasheet URL or 'measured here')."""

    name: str
    accelerator: str
    tensor_parallel: int = 1
    dtype: str
    model: ModelShape
    cost: StepCost
    kv_capacity_tokens: int
    sources: dict[str, str] = Field(default_factory=dict)


class Profile(BaseModel):
    """Everything `pdserve profile` measured (see the module docstring). `measured` is this machine's own
    hardware profile (its cost the fitted one); `hardware` the accelerators scaled from it."""

    created_at: str
    machine: str
    model: ModelShape
    max_num_batched_tokens: int
    prefill: list[PrefillSample]
    decode: list[DecodeSample]
    cost: StepCost
    prefill_fit: FitError
    decode_fit: FitError
    roofline: Roofline
    efficiency: Efficiency
    families: list[CacheBytes] = Field(default_factory=list)
    transfers: list[TransferSample] = Field(default_factory=list)
    measured: HardwareProfile
    hardware: list[HardwareProfile] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)
    elapsed_s: float = 0.0

    def hardware_profile(self, name: str | None) -> HardwareProfile:
        """The profile called `name` ('measured' or None: this machine's). Raises KeyError listing them."""
        if name in (None, "measured", self.measured.name):
            return self.measured
        for hw in self.hardware:
            if hw.name == name:
                return hw
        names = ", ".join(["measured", *(h.name for h in self.hardware)])
        raise KeyError(f"no hardware profile {name!r} in this profile; it has {names}")

    def transfer_gb_s(self, transport: str) -> float | None:
        """The best GB/s measured over `transport` (largest transfer), or None when not measured."""
        samples = [t for t in self.transfers if t.transport == transport]
        return max(samples, key=lambda t: t.nbytes).gb_s if samples else None

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.model_dump_json(indent=2))

    @classmethod
    def read(cls, path: Path) -> Profile:
        """Raises FileNotFoundError, pydantic.ValidationError."""
        return cls.model_validate_json(path.read_text())

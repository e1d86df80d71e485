"""What a model moves between pools and holds on each: KV bytes per token, recurrent-state bytes per request,
weight bytes. From the configs the engine serves (`engine/model_config.py`, `engine/kimi_linear_config.py`)
and the real checkpoints' tensors, plus Llama-3-70B written out from its published config.json.
"""

from __future__ import annotations

from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict

from pdserve.engine.kimi_linear_config import KimiLinearConfig
from pdserve.engine.model_config import LlamaConfig
from pdserve.hardware.models import LLAMA_3_70B

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


class ModelSpec(BaseModel):
    """A model as the transfer and the fleet see it. Bytes are in the given dtypes: `kv_bytes_per_token`
    over every paged layer (K and V, or MLA's latent), `state_bytes_per_request` of recurrent + conv state
    over every state layer (0: none), `weight_bytes` of every parameter."""

    model_config = ConfigDict(frozen=True)

    name: str
    family: str
    kv_dtype: str
    weight_dtype: str
    num_paged_layers: int
    kv_bytes_per_token: int
    state_bytes_per_request: int
    num_params: int
    weight_bytes: int
    source: str

    def kv_bytes(self, num_tokens: int) -> int:
        """Paged KV bytes of a request of `num_tokens` prompt tokens."""
        return num_tokens * self.kv_bytes_per_token

    def transfer_bytes(self, num_tokens: int) -> int:
        """Everything a prefill → decode handoff moves: paged KV plus the recurrent state."""
        return self.kv_bytes(num_tokens) + self.state_bytes_per_request


def llama_num_params(cfg: LlamaConfig) -> int:
    """Parameters of a Llama: embeddings (+ an untied LM head), per layer q/k/v/o, gate/up/down and two
    RMSNorms, and the final norm (HF `LlamaForCausalLM`'s tensors, no biases)."""
    h, kv = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim
    attn = h * cfg.num_heads * cfg.head_dim * 2 + h * kv * 2
    mlp = 3 * h * cfg.intermediate_size
    embed = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2)
    return embed + cfg.num_layers * (attn + mlp + 2 * h) + h


def llama_spec(
    name: str, cfg: LlamaConfig, kv_dtype: str, weight_dtype: str, source: str, num_params: int | None = None
) -> ModelSpec:
    """A Llama's spec: KV per token = layers × 2 × kv_heads × head_dim × dtype bytes. `num_params` from
    the checkpoint when given, else `llama_num_params`."""
    params = llama_num_params(cfg) if num_params is None else num_params
    return ModelSpec(
        name=name,
        family="llama",
        kv_dtype=kv_dtype,
        weight_dtype=weight_dtype,
        num_paged_layers=cfg.num_layers,
        kv_bytes_per_token=cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * DTYPE_BYTES[kv_dtype],
        state_bytes_per_request=0,
        num_params=params,
        weight_bytes=params * DTYPE_BYTES[weight_dtype],
        source=source,
    )


def kimi_linear_spec(
    name: str, cfg: KimiLinearConfig, num_params: int, kv_dtype: str, weight_dtype: str, source: str
) -> ModelSpec:
    """A Kimi Linear hybrid's spec: MLA layers paged (latent kv_lora_rank + rope_dim per token), KDA layers'
    recurrent [heads, d, d] and conv [(K-1), 3·heads·d] state per request (`KimiLinearConfig.state_bytes`
    in fp32, scaled to `kv_dtype`; the engine keeps the recurrent state fp32, so fp32 is what moves)."""
    scale = DTYPE_BYTES[kv_dtype] / 4
    return ModelSpec(
        name=name,
        family="kimi_linear",
        kv_dtype=kv_dtype,
        weight_dtype=weight_dtype,
        num_paged_layers=cfg.num_mla_layers,
        kv_bytes_per_token=int(cfg.kv_bytes_per_token * scale),
        state_bytes_per_request=cfg.state_bytes,
        num_params=num_params,
        weight_bytes=num_params * DTYPE_BYTES[weight_dtype],
        source=source,
    )


def _numel(weights: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() for t in weights.values())


def served_spec(name: str, cache_dir: Path, kv_dtype: str = "fp32", weight_dtype: str = "fp32") -> ModelSpec:
    """The spec of a model pdserve serves (`smollm2`, `tiny`, `kimi-tiny` or an HF model directory).
    SmolLM2: its config from the GGUF's metadata and `llama_num_params` (134,515,008, the same as the
    dequantized checkpoint's tensors); the others: the parameter count summed over the real checkpoint's
    tensors (`engine.loader.load_model`). Raises as `load_model` does."""
    from pdserve.engine.gguf_file import read_gguf
    from pdserve.engine.loader import config_from_gguf, load_model
    from pdserve.engine.model_files import smollm2_gguf_path

    if name == "smollm2":
        cfg = config_from_gguf(read_gguf(smollm2_gguf_path(), with_tensors=False))
        return llama_spec(
            name, cfg, kv_dtype, weight_dtype, source="engine/model_config.py (the GGUF's metadata)"
        )
    loaded = load_model(name, cache_dir)
    params = _numel(loaded.weights)
    if isinstance(loaded.config, KimiLinearConfig):
        return kimi_linear_spec(
            name,
            loaded.config,
            params,
            kv_dtype,
            weight_dtype,
            source="engine/kimi_linear_config.py + the checkpoint's tensors",
        )
    return llama_spec(
        name,
        loaded.config,
        kv_dtype,
        weight_dtype,
        num_params=params,
        source="engine/model_config.py + the checkpoint's tensors",
    )


def llama_3_70b(kv_dtype: str = "fp8", weight_dtype: str = "fp8") -> ModelSpec:
    """Llama-3-70B from its published config (the checklist's example: GQA-8, FP8 KV, FP8 weights)."""
    return llama_spec(
        "Llama-3-70B",
        LLAMA_3_70B.config,
        kv_dtype,
        weight_dtype,
        source=LLAMA_3_70B.source,
    )

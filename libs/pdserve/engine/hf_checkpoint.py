"""A model directory in Hugging Face layout: config.json, *.safetensors, tokenizer files.

`read_checkpoint` reads the config and every tensor (fp32, CPU), with the names normalized to the ones the
engine's models read (`model.py`, `kimi_linear.py`). Kimi Linear checkpoints come in two spellings, both
accepted: the release's (and HF `save_pretrained`'s) — `block_sparse_moe.` MLPs, one `experts.{e}.w1/w2/w3`
per expert, `q_conv1d`/`k_conv1d`/`v_conv1d`, the forget gate's `f_a_proj`/`f_b_proj`/`dt_bias`/`A_log`
on the attention — and HF's in-memory one (`mlp.`, `experts.gate_up_proj` / `experts.down_proj` stacked
over experts, one `conv1d`, `forget_gate.`). The engine's names: `mlp.` for dense and sparse MLPs, the
rest as the release spells it.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

CONFIG = "config.json"


def is_checkpoint_dir(path: str | Path) -> bool:
    """Whether `path` is a directory holding a config.json."""
    return (Path(path).expanduser() / CONFIG).is_file()


def read_config(path: str | Path) -> dict[str, Any]:
    """The parsed config.json of the model directory `path`. Raises FileNotFoundError."""
    return json.loads((Path(path).expanduser() / CONFIG).read_text())


def read_checkpoint(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor], str]:
    """(config.json parsed, every tensor of every *.safetensors as fp32 by engine name, a SHA-256 hex digest
    of config.json and the safetensors files' bytes in name order). Raises FileNotFoundError when the
    directory has no config.json or no *.safetensors."""
    root = Path(path).expanduser()
    config = read_config(root)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{root}: no *.safetensors")
    digest = hashlib.sha256((root / CONFIG).read_bytes())
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        with open(file, "rb") as f:
            digest.update(hashlib.file_digest(f, "sha256").digest())
        weights.update(load_file(file))
    weights = {name: t.to(torch.float32) for name, t in weights.items()}
    if config.get("model_type") == "kimi_linear":
        weights = normalize_kimi_linear_names(weights)
    return config, weights, digest.hexdigest()


def write_checkpoint(path: str | Path, config: dict[str, Any], weights: dict[str, torch.Tensor]) -> None:
    """Write config.json and model.safetensors (tensors contiguous, as given) into directory `path`."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    (root / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file({k: v.contiguous() for k, v in weights.items()}, root / "model.safetensors",
              metadata={"format": "pt"})


_EXPERTS_STACKED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def normalize_kimi_linear_names(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Kimi Linear tensors in either spelling (module doc) -> the engine's names."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        name = name.replace(".block_sparse_moe.", ".mlp.").replace(".self_attn.forget_gate.", ".self_attn.")
        stacked = _EXPERTS_STACKED.match(name)
        if stacked:
            prefix, kind = stacked.groups()
            for expert, w in enumerate(tensor):  # gate_up: [2 I, hidden] = w1 rows then w3 rows
                if kind == "gate_up_proj":
                    w1, w3 = w.chunk(2, dim=0)
                    out[f"{prefix}.{expert}.w1.weight"], out[f"{prefix}.{expert}.w3.weight"] = w1, w3
                else:
                    out[f"{prefix}.{expert}.w2.weight"] = w
        elif name.endswith(".self_attn.conv1d.weight"):  # [3 D, 1, K]: q, k, v channels
            base = name.removesuffix("conv1d.weight")
            for part, w in zip("qkv", tensor.chunk(3, dim=0), strict=True):
                out[f"{base}{part}_conv1d.weight"] = w
        else:
            out[name] = tensor
    return out

